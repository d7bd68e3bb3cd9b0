"""CaptureRequest and CaptureStatus as plain dicts: building, checking, encoding, reading.

Requests travel on the request topic of their requester, ``<prefix>.requests.<user>``, which
only that principal may write (its ACL): the reader of a request sets ``requester`` from
the topic (``request_from``), never from the request's own ``requested_by`` (free text,
shown for people). Statuses travel on ``<prefix>.control`` and carry the requester on.

A request names a run, its ranks (all, or ranges such as ``0,3-5``) and its ``kind``: a
capture of ``ops`` (a start: each rank's next step, or step N; a number of steps; what
the profiler records) or every Python thread's ``stacks`` now (``profstream stacks``); a
status says what one rank (or, with ``rank`` None, a service for the whole request) did
with it: ``armed``, ``started``, ``finished`` or ``refused`` with a reason. A rank answers
a stacks request with one status, ``finished`` with its ``threads`` (or ``refused``). A
refusal's reason begins with one of ``REFUSALS`` and a colon, then says why in words.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from profstream.schema.codec import DecodeError, decode_any, encode
from profstream.schema.names import is_valid_name

REQUEST, STATUS = "CaptureRequest", "CaptureStatus"
ARMED, STARTED, FINISHED, REFUSED = "armed", "started", "finished", "refused"
STATES = (ARMED, STARTED, FINISHED, REFUSED)
OPS, STACKS = "ops", "stacks"  # a request's kind
KINDS = (OPS, STACKS)
ACTIVITIES = ("cpu", "cuda")
DEFAULT_STEPS = 20
DEFAULT_EXPIRES_S = 300.0
# The first word of a refusal's reason.
REFUSALS = ("invalid", "expired", "over_limit", "busy", "unavailable", "start_passed", "unknown_run", "ended")

_RANKS_RE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


class RequestError(ValueError):
    """A request that cannot be sent as given; the message says what to change."""


def parse_ranks(text: str | None) -> list[dict] | None:
    """``"all"`` (or None) -> None; ``"0,3-5"`` -> [{first: 0, last: 0}, {first: 3, last: 5}]."""
    if text is None or text.strip().lower() in ("", "all"):
        return None
    ranges = []
    for part in text.split(","):
        m = _RANKS_RE.fullmatch(part)
        if m is None:
            raise RequestError(f"ranks {text!r}: expected 'all' or a list such as 0,3-5")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        if last < first:
            raise RequestError(f"ranks {text!r}: the range {part.strip()} ends before it starts")
        ranges.append({"first": first, "last": last})
    return ranges


def format_ranks(ranges: list[dict] | None) -> str:
    if ranges is None:
        return "all"
    return ",".join(str(r["first"]) if r["first"] == r["last"] else f"{r['first']}-{r['last']}" for r in ranges)


def rank_in(ranges: list[dict] | None, rank: int) -> bool:
    """Whether ``rank`` is among ``ranges`` (None: every rank)."""
    return ranges is None or any(r["first"] <= rank <= r["last"] for r in ranges)


def listed_ranks(ranges: list[dict] | None) -> list[int] | None:
    """The ranks of explicit ranges, in order (None: every rank)."""
    if ranges is None:
        return None
    return sorted({k for r in ranges for k in range(r["first"], r["last"] + 1)})


def new_request(run_id: str, *, ranks: list[dict] | None = None, start_step: int | None = None,
                steps: int = DEFAULT_STEPS, activities: tuple[str, ...] = ACTIVITIES, record_shapes: bool = False,
                profile_memory: bool = False, with_stack: bool = False, reason: str = "", requested_by: str = "",
                expires_s: float = DEFAULT_EXPIRES_S, now_ns: int | None = None, kind: str = OPS) -> dict:
    """A checked CaptureRequest with a fresh request_id; RequestError says what is wrong."""
    now = time.time_ns() if now_ns is None else now_ns
    if not expires_s > 0:
        raise RequestError(f"expires {expires_s!r} s: give a number of seconds > 0")
    request = {
        "request_id": uuid.uuid4().hex, "run_id": run_id, "ranks": ranks, "kind": kind, "start_step": start_step,
        "steps": steps, "activities": list(activities), "record_shapes": record_shapes,
        "profile_memory": profile_memory, "with_stack": with_stack, "reason": reason,
        "requested_by": requested_by, "requested_ns": now, "expires_at_ns": now + int(expires_s * 1e9),
    }
    problem = check_request(request)
    if problem is not None:
        raise RequestError(problem.partition(": ")[2])
    return request


def new_stacks_request(run_id: str, *, ranks: list[dict] | None = None, reason: str = "", requested_by: str = "",
                       expires_s: float = 60.0, now_ns: int | None = None) -> dict:
    """A request for the stacks of every Python thread of ``ranks`` (None: all) of ``run_id``;
    a rank that reads it after ``expires_s`` refuses it (its answer would be old news)."""
    return new_request(run_id, ranks=ranks, steps=1, reason=reason, requested_by=requested_by,
                       expires_s=expires_s, now_ns=now_ns, kind=STACKS)


def check_request(request: dict) -> str | None:
    """None for a request a rank can act on, else a refusal reason (``invalid: ...``)."""
    def invalid(why: str) -> str:
        return f"invalid: {why}"

    if not is_valid_name(request["request_id"]):
        return invalid(f"request id {request['request_id']!r} is not a valid name")
    if not is_valid_name(request["run_id"]):
        return invalid(f"run id {request['run_id']!r} is not a valid name")
    if request["kind"] not in KINDS:
        return invalid(f"kind {request['kind']!r}: expected one of {', '.join(KINDS)}")
    if request["steps"] < 1:
        return invalid(f"steps {request['steps']}: ask for at least 1")
    if request["start_step"] is not None and request["start_step"] < 0:
        return invalid(f"start step {request['start_step']}: steps are >= 0")
    for r in request["ranks"] or ():
        if r["first"] < 0 or r["last"] < r["first"]:
            return invalid(f"rank range {r['first']}-{r['last']}")
    if request["ranks"] == []:
        return invalid("no rank: give ranks or null for all")
    if not request["activities"]:
        return invalid("no activity: give cpu, cuda or both")
    return None


def refusal(code: str, detail: str) -> str:
    assert code in REFUSALS, code
    return f"{code}: {detail}"


def refusal_code(reason: str) -> str:
    """The first word of a refusal's reason (``busy``, ``expired``...)."""
    return reason.partition(":")[0]


def new_status(request: dict, state: str, rank: int | None, *, first_step: int | None = None,
               last_step: int | None = None, ops: int = 0, window_start_ns: int | None = None,
               window_end_ns: int | None = None, reason: str = "", world_size: int | None = None,
               host: str = "", ts_ns: int | None = None, threads: list[dict] | None = None,
               threads_omitted: int = 0) -> dict:
    """The CaptureStatus of ``request`` on ``rank`` (None: for the whole request); it carries
    the request's authenticated requester and its reason (and, answering a stacks request,
    the rank's ``threads``: producers/stacks.py)."""
    assert state in STATES, state
    return {"request_id": request["request_id"], "run_id": request["run_id"], "rank": rank, "state": state,
            "first_step": first_step, "last_step": last_step, "ops": ops, "window_start_ns": window_start_ns,
            "window_end_ns": window_end_ns, "reason": reason, "world_size": world_size, "host": host,
            "requester": request.get("requester", ""), "request_reason": request.get("reason", ""),
            "threads": threads, "threads_omitted": threads_omitted, "ts_ns": time.time_ns() if ts_ns is None else ts_ns}


def request_from(topic: str, requests_prefix: str, record: dict) -> dict | None:
    """``record`` (a CaptureRequest read from ``topic``) with its ``requester``: the user of
    its request topic; None when ``topic`` is no request topic (a request on the legacy
    control topic: history, never acted on)."""
    if not topic.startswith(requests_prefix) or len(topic) == len(requests_prefix):
        return None
    return {**record, "requester": topic[len(requests_prefix):]}


def who_asked(request: dict) -> str:
    """Who sent a request, for people: the authenticated requester, with what it says of
    itself when that differs; a legacy one's free text, marked as not authenticated."""
    said = request.get("requested_by", "")
    requester = request.get("requester")
    if not requester:
        return f"{said or '?'} (unauthenticated)"
    return requester if not said or said == requester else f"{requester} ({said})"


# Requests for ops and statuses without threads are written in the versions that Monitors,
# sinks and guards from before stacks requests read (CaptureRequest v1, CaptureStatus v2).
OPS_REQUEST_VERSION = 1
STATUS_WITHOUT_THREADS_VERSION = 2


def encode_request(request: dict) -> bytes:
    return encode(REQUEST, request, OPS_REQUEST_VERSION if request.get("kind", OPS) == OPS else None)


def encode_status(status: dict) -> bytes:
    return encode(STATUS, status, STATUS_WITHOUT_THREADS_VERSION if status.get("threads") is None else None)


def control_key(run_id: str) -> bytes:
    """The key of every control record of a run (a request or a status): its partition is
    the run's."""
    return run_id.encode()


def control_partition(run_id: str, partitions: int) -> int:
    """The partition of ``<prefix>.control`` (or of a request topic) holding ``run_id``'s
    records: Kafka's default partitioner (murmur2 of the key), which every profstream
    client uses."""
    from kafka.partitioner.default import murmur2

    return (murmur2(control_key(run_id)) & 0x7FFFFFFF) % partitions


def decode_control(value: bytes) -> tuple[str, dict]:
    """(REQUEST or STATUS, record); DecodeError for anything else."""
    name, record = decode_any(value)
    if name not in (REQUEST, STATUS):
        raise DecodeError("wrong_type", f"expected a CaptureRequest or CaptureStatus, got {name}")
    return name, record


def describe_request(request: dict) -> str:
    """One line for people: what is asked of which ranks."""
    if request["kind"] == STACKS:
        return f"stacks of ranks {format_ranks(request['ranks'])} of run {request['run_id']}"
    start = "the next step" if request["start_step"] is None else f"step {request['start_step']}"
    return (f"{request['steps']} steps from {start} on ranks {format_ranks(request['ranks'])} of run "
            f"{request['run_id']}")


def settings_of(request: dict) -> dict[str, Any]:
    """What the profiler records for ``request``."""
    return {"activities": frozenset(request["activities"]), "record_shapes": request["record_shapes"],
            "profile_memory": request["profile_memory"], "with_stack": request["with_stack"]}
