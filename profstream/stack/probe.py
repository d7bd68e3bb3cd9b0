"""Is a Kafka broker answering? ApiVersions + Metadata over a raw socket, bounded by a deadline."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

from profstream.kafka.connection import Connection
from profstream.stack.errors import StackError

_API_VERSIONS = 18
_METADATA = 3


class _ProbeError(Exception):
    pass


def _split_bootstrap(bootstrap: str) -> list[tuple[str, int]]:
    out = []
    for item in bootstrap.split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"bad bootstrap address {item!r}: expected HOST:PORT")
        out.append((host.strip("[]") or "127.0.0.1", int(port)))
    if not out:
        raise ValueError(f"bad bootstrap address {bootstrap!r}: expected HOST:PORT")
    return out


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _ProbeError("timed out")
        sock.settimeout(remaining)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise _ProbeError("connection closed by peer")
        buf += chunk
    return bytes(buf)


def _request(
    sock: socket.socket, api_key: int, version: int, corr: int, body: bytes, deadline: float
) -> bytes:
    client_id = b"profstream-probe"
    header = struct.pack(">hhih", api_key, version, corr, len(client_id)) + client_id
    msg = header + body
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _ProbeError("timed out")
    sock.settimeout(remaining)
    sock.sendall(struct.pack(">i", len(msg)) + msg)
    (size,) = struct.unpack(">i", _recv_exact(sock, 4, deadline))
    if size < 4 or size > 64 * 1024 * 1024:
        raise _ProbeError(f"not a Kafka response (frame size {size})")
    payload = _recv_exact(sock, size, deadline)
    (got_corr,) = struct.unpack_from(">i", payload)
    if got_corr != corr:
        raise _ProbeError("not a Kafka response (correlation id mismatch)")
    return payload[4:]


def _probe(host: str, port: int, deadline: float) -> int:
    """One ApiVersions + Metadata round trip; returns the number of live brokers."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _ProbeError("timed out")
    try:
        sock = socket.create_connection((host, port), timeout=remaining)
    except OSError as exc:
        raise _ProbeError(exc.strerror or str(exc)) from exc
    try:
        # ApiVersions v0: error_code, [api_key, min, max]; every broker since 0.10 has it.
        resp = _request(sock, _API_VERSIONS, 0, 1, b"", deadline)
        (err, n) = struct.unpack_from(">hi", resp)
        if err != 0:
            raise _ProbeError(f"ApiVersions error code {err}")
        meta_range = None
        for i in range(n):
            key, lo, hi = struct.unpack_from(">hhh", resp, 6 + 6 * i)
            if key == _METADATA:
                meta_range = (lo, hi)
        if meta_range is None:
            raise _ProbeError("broker does not offer Metadata")
        # Non-flexible Metadata versions 1..7 share the broker-list layout we read.
        candidates = [v for v in range(1, 8) if meta_range[0] <= v <= meta_range[1]]
        if not candidates:
            raise _ProbeError(f"no usable Metadata version in {meta_range}")
        ver = max(candidates)
        body = struct.pack(">i", 0)  # empty topic list: ask for brokers only
        if ver >= 4:
            body += b"\x00"  # allow_auto_topic_creation = false
        resp = _request(sock, _METADATA, ver, 2, body, deadline)
        off = 4 if ver >= 3 else 0  # throttle_time_ms
        (n_brokers,) = struct.unpack_from(">i", resp, off)
        return max(n_brokers, 0)
    except (OSError, struct.error) as exc:
        raise _ProbeError(str(exc) or type(exc).__name__) from exc
    finally:
        sock.close()


def _answers(bootstrap: str, deadline: float, brokers: int = 1) -> str | None:
    """None when some bootstrap address answers Metadata with >= ``brokers`` brokers, else a reason."""
    reason = "no address"
    for host, port in _split_bootstrap(bootstrap):
        try:
            listed = _probe(host, port, deadline)
            if listed >= brokers:
                return None
            reason = "metadata lists no live broker yet" if not listed else f"metadata lists {listed} of {brokers} brokers"
        except _ProbeError as exc:
            reason = str(exc)
    return reason


def live_brokers(address: str, timeout: float) -> int | None:
    """How many live brokers the broker at ``address`` (one host:port) lists; None when it
    does not answer within ``timeout`` s."""
    ((host, port),) = _split_bootstrap(address)
    try:
        return _probe(host, port, time.monotonic() + timeout)
    except _ProbeError:
        return None


def wait_for_broker(conn: Connection | str, timeout: float, alive: Callable[[], None] | None = None,
                    brokers: int = 1) -> None:
    """Poll until a broker at ``conn`` answers a Metadata request listing at least
    ``brokers`` live brokers (a cluster: all of them).

    Uses a raw ApiVersions + Metadata exchange on a socket bounded by the deadline, so
    it never blocks longer than ``timeout`` (a TLS or SASL connection: librdkafka's
    metadata request, ``_wait_secured``). Raises :class:`StackError` on the deadline, and
    at once when the broker answers but refuses this connection (credentials,
    certificate, TLS vs plaintext: one line that says which). ``alive`` is called between
    attempts (it may raise to give up early).
    """
    conn = Connection.of(conn)
    bootstrap = conn.bootstrap
    try:
        _split_bootstrap(bootstrap)
    except ValueError as exc:
        raise StackError(f"{exc}: pass e.g. 127.0.0.1:9092") from exc
    if conn.secured:
        _wait_secured(conn, timeout, alive, brokers)
        return
    start = time.monotonic()
    deadline = start + max(timeout, 0.0)
    delay = 0.05
    reason = "not tried"
    while True:
        # Each attempt gets at most 5 s so a half-open peer cannot eat the whole budget.
        attempt_deadline = min(deadline, time.monotonic() + 5.0)
        reason = _answers(bootstrap, attempt_deadline, brokers) or ""
        if not reason:
            return
        if reason.startswith("connection closed") or reason.startswith("not a Kafka response"):
            from profstream.kafka.diagnose import handshake_problem

            mismatch = handshake_problem(conn, max(0.1, min(3.0, deadline - time.monotonic())))
            if mismatch is not None:  # a TLS listener: waiting longer cannot help
                raise StackError(mismatch)
        if alive is not None:
            alive()
        now = time.monotonic()
        if now >= deadline:
            break
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, 0.25)
    raise StackError(
        f"broker at {bootstrap} did not answer within {timeout:g} s ({reason}): "
        "check the address / start one with `profstream stack up`"
    )


def _wait_secured(conn: Connection, timeout: float, alive: Callable[[], None] | None, brokers: int) -> None:
    """wait_for_broker for a TLS or SASL connection: librdkafka's metadata request with the
    connection's settings, until it lists ``brokers`` brokers; a security problem (what
    ``diagnose.explain`` names in librdkafka's errors, or the TLS handshake shows) ends
    the wait at once."""
    import logging

    import confluent_kafka

    from profstream.kafka.diagnose import expired_files, explain, handshake_problem

    problem = expired_files(conn)
    if problem is not None:
        raise StackError(problem)
    errors: list[str] = []
    client = confluent_kafka.Producer(dict(conn.librdkafka(), **{
        "logger": logging.getLogger("kafka.librdkafka"), "error_cb": lambda err: errors.append(err.str())}))
    deadline = time.monotonic() + max(timeout, 0.0)
    reason = "not tried"
    checked_handshake = False
    try:
        while True:
            try:
                listed = len(client.list_topics(timeout=max(0.1, min(2.0, deadline - time.monotonic()))).brokers)
                if listed >= brokers:
                    return
                reason = f"metadata lists {listed} of {brokers} brokers"
            except confluent_kafka.KafkaException as e:
                reason = conn.redact(str(e.args[0].str() if e.args else e))
            client.poll(0)
            for text in errors:
                why = explain(conn, text)
                if why is not None:
                    raise StackError(why)
            if errors and not checked_handshake:  # librdkafka's words may be vague: ask the handshake
                checked_handshake = True
                why = handshake_problem(conn, max(0.1, min(3.0, deadline - time.monotonic())))
                if why is not None:
                    raise StackError(why)
            if errors:
                reason = conn.redact(errors[-1])
            if alive is not None:
                alive()
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    finally:
        client.purge()
    raise StackError(
        f"broker at {conn.describe()} did not answer within {timeout:g} s ({reason}): "
        "check the address and the Kafka client properties"
    )
