"""Names of the profstream topics and their creation on a broker."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from profstream.kafka.connection import ANONYMOUS, Connection
from profstream.kafka.limits import TOPIC_MAX_MESSAGE_BYTES

BASE_TOPICS = ("raw", "steps", "run", "alerts", "dlq", "state", "run-state", "control", "partials")
# Changelogs of the processors' checkpoints (docs/exactly-once.md): compacted, and
# partitioned like the topic whose state they hold (state like raw, run-state like partials,
# the run stage's input).
COMPACTED = {"state": "raw", "run-state": "partials"}
_COMPACT_CONFIGS = {"cleanup.policy": "compact", "segment.ms": "60000", "min.cleanable.dirty.ratio": "0.1",
                    "delete.retention.ms": "60000"}
# Every topic takes what profstream's clients send (profstream.kafka.limits).
_SIZE_CONFIGS = {"max.message.bytes": str(TOPIC_MAX_MESSAGE_BYTES)}
DEFAULT_PREFIX = "profstream"
# The group ids of the Monitors' capture request readers, which never join them (librdkafka
# wants one, and looks its coordinator up: a broker with ACLs asks DESCRIBE on it).
CONTROL_GROUP_PREFIX = "profstream-control-"
# Replicas per partition and the in-sync replicas an acks=all write needs, by cluster size:
# three copies where there are three brokers, and a write on two of them before it counts,
# so that one broker may die without losing or refusing anything.
MAX_REPLICATION = 3
MIN_INSYNC_AT_FULL_REPLICATION = 2
MAX_PREFIX_LEN = 100

_PREFIX_RE = re.compile(r"[A-Za-z0-9._-]+")
_TOPIC_ALREADY_EXISTS = 36
_DENIED = (29, 31)  # TOPIC_AUTHORIZATION_FAILED, CLUSTER_AUTHORIZATION_FAILED


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` if usable in Kafka topic names, else raise a one-line ValueError."""
    if not isinstance(prefix, str) or not prefix:
        raise ValueError("topic prefix is empty: pass a name such as 'profstream'")
    if len(prefix) > MAX_PREFIX_LEN:
        raise ValueError(
            f"topic prefix is {len(prefix)} characters long: use at most {MAX_PREFIX_LEN}"
        )
    if not _PREFIX_RE.fullmatch(prefix):
        bad = sorted({c for c in prefix if not _PREFIX_RE.fullmatch(c)})
        raise ValueError(
            f"topic prefix {prefix!r} contains {''.join(bad)!r}: use only letters, digits, "
            "'.', '_' and '-'"
        )
    return prefix


@dataclass(frozen=True)
class Topics:
    """The topics of one profstream deployment: ``<prefix>.raw`` etc. (``BASE_TOPICS``)."""

    prefix: str = DEFAULT_PREFIX

    def _name(self, base: str) -> str:
        return f"{self.prefix}.{base}"

    @property
    def raw(self) -> str:
        return self._name("raw")

    @property
    def steps(self) -> str:
        return self._name("steps")

    @property
    def partials(self) -> str:
        """The run stage's input (docs/exactly-once.md): the step stages' StepPartials, and
        copies of the RankEnds and RankProgress they write to ``steps``, keyed and
        partitioned by run."""
        return self._name("partials")

    @property
    def run(self) -> str:
        return self._name("run")

    @property
    def alerts(self) -> str:
        return self._name("alerts")

    @property
    def dlq(self) -> str:
        return self._name("dlq")

    @property
    def state(self) -> str:
        return self._name("state")

    @property
    def run_state(self) -> str:
        return self._name("run-state")

    @property
    def control(self) -> str:
        """Capture statuses (the ranks' and the guard's), keyed by run (docs/capture.md); the
        capture requests of older clients (read for their history, never acted on)."""
        return self._name("control")

    @property
    def requests_prefix(self) -> str:
        """The prefix of the capture request topics: one per requester (``requests``)."""
        return self._name("requests.")

    def requests(self, principal: str) -> str:
        """The capture requests of ``principal``, keyed by run: only that principal may write
        there (its ACL), so who asked is what the broker authenticated (docs/security.md)."""
        return self.requests_prefix + requester_name(principal)

    def requester_of(self, topic: str) -> str | None:
        """The principal of a request topic of this prefix, None for any other topic."""
        return topic[len(self.requests_prefix):] or None if topic.startswith(self.requests_prefix) else None

    def all(self) -> list[str]:
        return [self._name(base) for base in BASE_TOPICS]


def requester_name(principal: str) -> str:
    """``principal`` (``User:alice`` or ``alice``) as the last part of a topic name; ValueError
    (one line) for a name a topic cannot carry."""
    name = principal.partition(":")[2] if principal.startswith("User:") else principal
    if not name or len(name) > 100 or not _PREFIX_RE.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"principal {principal!r} cannot name a request topic: use a user name of letters, digits, "
                         "'.', '_' and '-' (its requests go to <prefix>.requests.<user>)")
    return name


def replication(brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) of profstream's topics, and of the bundled
    cluster's internal ones, on a cluster of ``brokers`` brokers: min(3, brokers), and 2 in
    sync from 3 brokers on (1 below)."""
    factor = max(1, min(MAX_REPLICATION, brokers))
    return factor, (MIN_INSYNC_AT_FULL_REPLICATION if factor >= MAX_REPLICATION else 1)


def _admin(conn: Connection | str, timeout: float):
    from kafka import KafkaAdminClient

    ms = max(1000, int(timeout * 1000))
    return KafkaAdminClient(
        **Connection.of(conn).kafka_python(),
        client_id="profstream-admin",
        request_timeout_ms=min(ms, 30000),
        bootstrap_timeout_ms=ms,
    )


def ensure_topics(
    conn: Connection | str,
    topics: Topics,
    raw_partitions: int = 12,
    partitions: int = 3,
    timeout: float = 30.0,
    needed: tuple[str, ...] | None = None,
    operation: str = "DESCRIBE",
) -> list[str]:
    """Create the topics of ``topics`` that do not exist yet.

    ``raw`` and its changelog ``state`` get ``raw_partitions`` partitions, the others
    ``partitions``; the changelogs are compacted; every topic takes messages up to
    ``TOPIC_MAX_MESSAGE_BYTES``. Replication follows the brokers that answer
    (:func:`replication`): factor min(3, brokers), ``min.insync.replicas`` 2 from 3
    brokers on. Existing topics
    are left alone (even with another partition count); a concurrent creation of the same
    topic is fine. Waits until every topic has a leader for each partition. Returns the
    names this call created.

    ``needed``: the base names (``raw``, ``control``...) the caller uses (None: all). On a
    broker with ACLs a client sees only the topics it may use and may create none: the
    others are then left to whoever may (``profstream acl apply``), and a needed one it can
    neither see nor create is a ``TopicAccessError`` naming the ACL that is missing (for
    ``operation``, what the caller does with it: WRITE for a Monitor).
    """
    from kafka.errors import KafkaError, KafkaTimeoutError

    from profstream.stack.errors import StackError
    from profstream.stack.probe import wait_for_broker

    validate_prefix(topics.prefix)
    if raw_partitions < 1 or partitions < 1:
        raise ValueError("partition counts must be >= 1")
    conn = Connection.of(conn)
    bootstrap = conn.bootstrap
    deadline = time.monotonic() + timeout
    wait_for_broker(conn, timeout)

    def remaining_ms() -> int:
        return max(1000, int((deadline - time.monotonic()) * 1000))

    counts = {base: (raw_partitions if COMPACTED.get(base, base) == "raw" else partitions) for base in BASE_TOPICS}
    wanted = {topics._name(base): counts[base] for base in BASE_TOPICS}
    configs = {topics._name(base): dict(_SIZE_CONFIGS, **(_COMPACT_CONFIGS if base in COMPACTED else {}))
               for base in BASE_TOPICS}
    if conn.principal() == ANONYMOUS:  # no authentication: everyone's requests go to the one request topic
        anonymous = topics.requests(ANONYMOUS)
        wanted[anonymous], configs[anonymous] = partitions, dict(_SIZE_CONFIGS)
    needed_names = set(wanted) if needed is None else {topics._name(base) for base in needed}
    created: list[str] = []
    denied: list[str] = []
    try:
        with _admin(conn, max(1.0, deadline - time.monotonic())) as admin:
            existing = set(admin.list_topics())
            missing = {n: p for n, p in wanted.items() if n not in existing}
            if missing:
                factor, min_insync = replication(len(admin.describe_cluster()["brokers"]))
                for n in missing:
                    configs[n]["min.insync.replicas"] = str(min_insync)
                result = admin.create_topics(
                    {n: {"num_partitions": p, "replication_factor": factor, "configs": configs[n]}
                     for n, p in missing.items()},
                    timeout_ms=min(remaining_ms(), 30000),
                    raise_errors=False,
                )
                failures = []
                for t in result["topics"]:
                    code = t.get("error_code", 0)
                    if code == 0:
                        created.append(t["name"])
                    elif code in _DENIED:
                        denied.append(t["name"])
                    elif code != _TOPIC_ALREADY_EXISTS:
                        msg = t.get("error_message") or f"error code {code}"
                        failures.append(f"{t['name']}: {msg}")
                if failures:
                    raise StackError(
                        f"could not create topics on {bootstrap} ({'; '.join(failures)}): "
                        "check the broker log"
                    )
            lacking = [n for n in denied if n in needed_names]
            if lacking:
                from profstream.kafka.diagnose import authorization_error
                from profstream.stack.errors import TopicAccessError

                raise TopicAccessError(authorization_error(
                    conn.principal(), operation, "TOPIC", lacking[0],
                    hint=f"it does not see the topic and may not create it (an admin creates the topics: "
                         f"`profstream acl apply --topic-prefix {topics.prefix}`)"))
            admin.wait_for_topics([n for n in wanted if n not in denied], timeout_ms=remaining_ms())
    except KafkaTimeoutError as exc:
        raise StackError(
            f"topics on {bootstrap} not ready within {timeout:g} s ({exc}): check the "
            "broker log / retry with a larger timeout"
        ) from exc
    except KafkaError as exc:
        from profstream.kafka.diagnose import failure

        raise StackError(
            f"creating topics on {bootstrap} failed ({failure(conn, exc)}): "
            "check the broker log"
        ) from None
    order = {n: i for i, n in enumerate(wanted)}
    return sorted(created, key=order.__getitem__)


def ensure_topic_exists(admin, topic: str, partitions: int = 3, timeout: float = 10.0) -> bool:
    """Create ``topic`` (a request topic: keyed by run like the control topic) with the
    replication of profstream's topics, unless this admin client sees it; True when made.
    Raises kafka-python's error when the broker refuses (e.g. no CREATE ACL)."""
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    if topic in set(admin.list_topics()):
        return False
    factor, min_insync = replication(len(admin.describe_cluster()["brokers"]))
    try:
        admin.create_topics([NewTopic(topic, partitions, factor, topic_configs={
            **_SIZE_CONFIGS, "min.insync.replicas": str(min_insync)})], timeout_ms=int(timeout * 1000))
    except TopicAlreadyExistsError:
        return False
    admin.wait_for_topics([topic], timeout_ms=int(timeout * 1000))
    return True


def delete_topics(conn: Connection | str, topics: Topics, timeout: float = 30.0) -> list[str]:
    """Delete the topics of ``topics`` that exist (its request topics too); returns the
    names deleted."""
    validate_prefix(topics.prefix)
    with _admin(conn, timeout) as admin:
        existing = set(admin.list_topics())
        names = [n for n in topics.all() if n in existing] + sorted(n for n in existing if topics.requester_of(n))
        if names:
            admin.delete_topics(
                names, timeout_ms=max(1000, int(timeout * 1000)), raise_errors=False
            )
    return names


def missing_topics(conn: Connection | str, topics: Topics, timeout: float = 10.0) -> list[str]:
    """The topics of ``topics`` that the broker does not have (or does not show this
    client: on a broker with ACLs, those it may not DESCRIBE)."""
    validate_prefix(topics.prefix)
    with _admin(conn, timeout) as admin:
        existing = set(admin.list_topics())
    return [n for n in topics.all() if n not in existing]
