"""Least privilege: the ACLs of each role, for the broker's authorizer to enforce.

Roles (docs/security.md has the table and the threat model):

- ``trainer``: a training job's Monitor. Writes raw events (``<prefix>.raw``) and capture
  statuses (``<prefix>.control``), reads capture requests (``<prefix>.requests.*``). It
  cannot write steps, run or alerts (no forged figures), cannot issue capture requests
  and reads nothing else.
- ``processor``: reads raw (and partials, for the run stage), writes the figures (steps,
  partials, run), alerts, dead letters and its changelogs, within its consumer groups and
  transactional ids (both ``<group>*``, the group given by ``--group-id``).
- ``sink``: reads the processed topics (and raw, control and the requests, for the
  archive and the timeline) in its consumer groups; writes nothing.
- ``capture``: a person's ``profstream capture``. Writes its own request topic
  ``<prefix>.requests.<principal>`` and nothing else; reads the requests, the statuses and
  the run topic (to say whether a run is live).
- ``autocapture``: ``capture`` plus the alerts topic in, and the guard's refusals
  (``<prefix>.control``) and dead letters out.

An admin (a super user, or one allowed ALTER on the cluster) applies them with
``profstream acl apply`` (which also creates the topics and the request topic of a
requester), or prints them as ``kafka-acls.sh`` commands with ``profstream acl show``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from profstream.kafka.connection import Connection
from profstream.kafka.topics import CONTROL_GROUP_PREFIX, Topics, requester_name

ROLES = ("trainer", "processor", "sink", "capture", "autocapture")
DEFAULT_PROCESSOR_GROUP = "profstream-processor"
# The consumer groups of the sinks' defaults (each command's --group-id)
DEFAULT_SINK_GROUPS = ("profstream-prometheus", "profstream-grafana", "profstream-timeline", "profstream-archive")
READ, WRITE, DESCRIBE, CREATE = "READ", "WRITE", "DESCRIBE", "CREATE"
TOPIC, GROUP, TRANSACTIONAL_ID = "TOPIC", "GROUP", "TRANSACTIONAL_ID"
LITERAL, PREFIXED = "LITERAL", "PREFIXED"


@dataclass(frozen=True, order=True)
class Acl:
    """ALLOW ``principal`` ``operation`` on ``resource`` ``name`` (a name or a prefix)."""

    principal: str  # User:<name>
    resource: str  # TOPIC, GROUP, TRANSACTIONAL_ID
    name: str
    operation: str
    pattern: str = LITERAL

    def line(self) -> str:
        return (f"ALLOW {self.principal} {self.operation} {self.resource} {self.name}"
                + (" (prefixed)" if self.pattern == PREFIXED else ""))

    def kafka_acls(self) -> str:
        """The ``kafka-acls.sh`` command that adds it."""
        option = {TOPIC: "--topic", GROUP: "--group", TRANSACTIONAL_ID: "--transactional-id"}[self.resource]
        return (f"kafka-acls.sh --bootstrap-server $BOOTSTRAP --command-config admin.properties --add "
                f"--allow-principal {self.principal} --operation {self.operation.capitalize()} "
                f"{option} '{self.name}'" + (" --resource-pattern-type prefixed" if self.pattern == PREFIXED else ""))


def principal_of(user: str) -> str:
    return user if ":" in user else f"User:{user}"


def role_acls(role: str, user: str, topics: Topics, groups: Sequence[str] = ()) -> list[Acl]:
    """The ACLs ``role`` needs for principal ``user`` on the topics of ``topics``.
    ``groups``: the processor's group id (default profstream-processor), the sinks' groups
    (default each sink's)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
    who = principal_of(user)

    def topic(name: str, *operations: str, pattern: str = LITERAL) -> list[Acl]:
        return [Acl(who, TOPIC, name, op, pattern) for op in operations]

    t = topics
    if role == "trainer":
        # the capture request reader never joins its group (librdkafka wants one to look up)
        return (topic(t.raw, WRITE, DESCRIBE) + topic(t.control, WRITE, DESCRIBE)
                + topic(t.requests_prefix, READ, DESCRIBE, pattern=PREFIXED)
                + [Acl(who, GROUP, CONTROL_GROUP_PREFIX, DESCRIBE, PREFIXED)])
    if role == "processor":
        group = (groups or (DEFAULT_PROCESSOR_GROUP,))[0]
        # the step stage writes steps and partials; the run stage reads partials, not steps
        return (topic(t.raw, READ, DESCRIBE) + topic(t.steps, WRITE, DESCRIBE) + topic(t.partials, READ, WRITE, DESCRIBE)
                + topic(t.run, WRITE, DESCRIBE) + topic(t.alerts, WRITE, DESCRIBE) + topic(t.dlq, WRITE, DESCRIBE)
                + topic(t.state, READ, WRITE, DESCRIBE) + topic(t.run_state, READ, WRITE, DESCRIBE)
                + [Acl(who, GROUP, group, READ, PREFIXED),  # <group>, <group>-run and their restore readers
                   Acl(who, TRANSACTIONAL_ID, group, WRITE, PREFIXED),
                   Acl(who, TRANSACTIONAL_ID, group, DESCRIBE, PREFIXED)])
    if role == "sink":
        out = []
        for name in (t.raw, t.steps, t.run, t.alerts, t.control):
            out += topic(name, READ, DESCRIBE)
        out += topic(t.requests_prefix, READ, DESCRIBE, pattern=PREFIXED)
        return out + [Acl(who, GROUP, g, READ) for g in (groups or DEFAULT_SINK_GROUPS)]
    out = (topic(t.requests(user.partition(":")[2] if ":" in user else user), WRITE, DESCRIBE)
           + topic(t.requests_prefix, READ, DESCRIBE, pattern=PREFIXED)
           + topic(t.control, READ, DESCRIBE) + topic(t.run, READ, DESCRIBE))
    if role == "autocapture":
        out += topic(t.alerts, READ, DESCRIBE) + topic(t.control, WRITE) + topic(t.dlq, WRITE, DESCRIBE)
    return out


def requester_topics(role: str, user: str, topics: Topics) -> list[str]:
    """The request topic a role writes (created with its ACLs): capture and autocapture."""
    return [topics.requests(requester_name(user))] if role in ("capture", "autocapture") else []


def _binding(acl: Acl):
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    return AclBinding(ResourceType[acl.resource], acl.name, ResourcePatternType[acl.pattern], acl.principal, "*",
                      AclOperation[acl.operation], AclPermissionType.ALLOW)


def admin_client(conn: Connection):
    import logging

    from confluent_kafka.admin import AdminClient

    return AdminClient(dict(conn.librdkafka(), logger=logging.getLogger("kafka.librdkafka")))


def apply_acls(conn: Connection, acls: Iterable[Acl], timeout: float = 30.0) -> int:
    """Create ``acls`` on the broker of ``conn`` (an admin's connection); returns how many.
    Existing ones are fine. RuntimeError (one line) when the broker refuses."""
    from profstream.kafka.diagnose import failure

    acls = sorted(set(acls))
    if not acls:
        return 0
    admin = admin_client(conn)
    futures = admin.create_acls([_binding(a) for a in acls], request_timeout=timeout)
    for binding, future in futures.items():
        try:
            future.result(timeout)
        except Exception as e:
            raise RuntimeError(f"the broker did not take the ACL {binding.principal} {binding.operation.name} "
                               f"{binding.restype.name} {binding.name} ({failure(conn, e)}): apply ACLs with an "
                               "admin's --kafka-config (a super user, or one allowed ALTER on the cluster)") from None
    return len(acls)


def grant(conn: Connection, role: str, user: str, topics: Topics, groups: Sequence[str] = (),
          timeout: float = 30.0) -> list[Acl]:
    """As an admin: the topics of ``topics`` (and the requester's topic) created, and
    ``role``'s ACLs for ``user`` applied; returns them."""
    from profstream.kafka.topics import _admin, ensure_topic_exists, ensure_topics

    ensure_topics(conn, topics, timeout=timeout)
    with _admin(conn, timeout) as admin:
        for topic in requester_topics(role, user, topics):
            ensure_topic_exists(admin, topic, timeout=timeout)
    acls = role_acls(role, user, topics, groups)
    apply_acls(conn, acls, timeout)
    return acls


def setup_stack(state_dir: Path, topics: Topics | None = None) -> None:
    """The secured local broker's topics of ``topics`` (the default prefix) and each role's
    ACLs for the user of the same name, as its admin."""
    from profstream.stack.secure import client_connection

    topics = topics or Topics()
    admin = client_connection(state_dir)
    for role in ROLES:
        grant(admin, role, role, topics)


def check_role(conn: Connection, role: str, topics: Topics, groups: Sequence[str] = (),
               timeout: float = 10.0) -> list[tuple[Acl, str | None]]:
    """Each ACL ``role`` needs, checked with the role's own connection: (ACL, None) when the
    broker grants it, (ACL, why not) when not. The broker says what it lets the client do
    (topics' and groups' authorized operations, KIP-430); a transactional id is tried
    (``init_transactions`` of ``<group>-doctor``, which fences nobody). A prefixed topic ACL
    is checked on a topic of the prefix when one is visible."""
    from confluent_kafka import KafkaException, TopicCollection

    user = conn.principal()
    acls = role_acls(role, user, topics, groups)
    admin = admin_client(conn)
    out: list[tuple[Acl, str | None]] = []
    visible = set(admin.list_topics(timeout=timeout).topics)
    topic_ops: dict[str, set[str] | str] = {}
    for acl in acls:
        if acl.resource != TOPIC or acl.name in topic_ops:
            continue
        name = acl.name
        if acl.pattern == PREFIXED:
            found = sorted(t for t in visible if t.startswith(name) and t != name)
            if not found:
                topic_ops[name] = f"no topic of prefix {name} to check it on yet"
                continue
            name = found[0]
        try:
            (future,) = admin.describe_topics(TopicCollection([name]), include_authorized_operations=True,
                                              request_timeout=timeout).values()
            topic_ops[acl.name] = {op.name for op in (future.result(timeout).authorized_operations or ())}
        except KafkaException as e:
            topic_ops[acl.name] = set() if e.args and "AUTHORIZATION" in e.args[0].name() else e.args[0].str()
    group_ops: dict[str, set[str] | str] = {}
    for acl in acls:
        if acl.resource == GROUP and acl.name not in group_ops:
            name = acl.name + "doctor" if acl.pattern == PREFIXED else acl.name
            try:
                (future,) = admin.describe_consumer_groups([name], include_authorized_operations=True,
                                                           request_timeout=timeout).values()
                group_ops[acl.name] = {op.name for op in (future.result(timeout).authorized_operations or ())}
            except KafkaException as e:
                group_ops[acl.name] = set() if e.args and "AUTHORIZATION" in e.args[0].name() else e.args[0].str()
    txn_checked: dict[str, str | None] = {}
    for acl in acls:
        if acl.resource == TRANSACTIONAL_ID:
            if acl.name not in txn_checked:
                txn_checked[acl.name] = _try_transactional_id(conn, acl.name + "doctor", timeout)
            out.append((acl, txn_checked[acl.name]))
            continue
        ops = (topic_ops if acl.resource == TOPIC else group_ops)[acl.name]
        if isinstance(ops, str):
            out.append((acl, f"not checked: {ops}"))
        elif acl.operation in ops or "ALL" in ops:
            out.append((acl, None))
        else:
            out.append((acl, "missing"))
    return out


def _try_transactional_id(conn: Connection, transactional_id: str, timeout: float) -> str | None:
    from confluent_kafka import KafkaException

    from profstream.kafka.clients import make_transactional_producer

    producer = make_transactional_producer(conn, transactional_id)
    try:
        producer.init_transactions(timeout)
        return None
    except KafkaException as e:
        return "missing" if "AUTHORIZATION" in e.args[0].name() else f"not checked: {e.args[0].str()}"
