"""What is wrong with a Kafka connection, in one line that says what to do.

``explain`` reads a client library's error text (librdkafka's or kafka-python's) and names
the cause: credentials the broker refused, a certificate it or we do not trust or that
expired, TLS spoken to a plaintext port or the reverse, a mechanism the listener does not
offer, an ACL that is missing. ``check`` finds out for a connection, at once: the address
(TCP), the local certificate files, the TLS handshake (Python's ssl, so a certificate
problem is named exactly), then a metadata request through librdkafka, which reports the
SASL outcome. Neither ever shows a secret: texts pass through ``Connection.redact``.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import time
from datetime import UTC, datetime

from profstream.kafka.connection import Connection, certificate_expiry

# Kafka's codes of the authorization errors (kafka-python's and librdkafka's names alike).
TOPIC_AUTHORIZATION_FAILED, GROUP_AUTHORIZATION_FAILED, CLUSTER_AUTHORIZATION_FAILED = 29, 30, 31
TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
AUTHORIZATION_CODES = {TOPIC_AUTHORIZATION_FAILED: "TOPIC", GROUP_AUTHORIZATION_FAILED: "GROUP",
                       CLUSTER_AUTHORIZATION_FAILED: "CLUSTER",
                       TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "TRANSACTIONAL_ID"}


# The probes' own librdkafka lines (its FATAL line of a refused producer id, say) are not
# the user's: what they found is said once, explained, by whoever asked.
_QUIET = logging.getLogger("profstream.diagnose.librdkafka")
_QUIET.setLevel(logging.CRITICAL + 1)
_QUIET.propagate = False


class SecurityError(ConnectionError):
    """The broker answered and refused us (credentials, certificate, protocol), or we
    refused it: retrying with the same settings cannot help. The message is one line."""


def _where(conn: Connection) -> str:
    return conn.source if conn.source and conn.source != "options" else "the Kafka client properties"


def explain(conn: Connection, text: str) -> str | None:
    """One line naming the cause of a client library's error ``text`` and what to do,
    None when the text is not a security problem (a broker down, a timeout)."""
    t = text.lower()
    where = _where(conn)
    who = conn.principal()
    if ("authentication failed" in t and "invalid credentials" in t) or "saslauthenticationfailed" in t or (
            "sasl authentication error" in t and "invalid credentials" in t):
        return (f"the broker refused the credentials of {who!r} ({conn.mechanism}): wrong password or unknown user; "
                f"check sasl.username and sasl.password in {where}")
    if "unsupported sasl mechanism" in t or "unsupportedsaslmechanism" in t or "illegal_sasl_state" in t:
        return (f"the listener at {conn.bootstrap} does not offer SASL mechanism {conn.mechanism}: use one it "
                f"enables (sasl.mechanism in {where})")
    if "certificate has expired" in t or "certificate expired" in t:
        if "alert" in t:
            return (f"the broker refused our client certificate as expired: renew ssl.certificate.location "
                    f"({conn.get('ssl.certificate.location')})")
        return (f"the broker's certificate at {conn.bootstrap} has expired: the broker must renew it (or check the "
                "clock of this machine)")
    if "alert unknown ca" in t or "alert bad certificate" in t or "alert certificate unknown" in t or (
            "alert certificate required" in t):
        if not conn.get("ssl.certificate.location"):
            return (f"the listener at {conn.bootstrap} requires a client certificate (mutual TLS): give "
                    f"ssl.certificate.location and ssl.key.location in {where}")
        return (f"the broker does not trust our client certificate ({conn.get('ssl.certificate.location')}): use one "
                "signed by a CA the broker trusts (its ssl.truststore)")
    if "certificate verify failed" in t or "unable to get local issuer" in t or "self-signed certificate" in t or (
            "self signed certificate" in t):
        if "hostname mismatch" in t or "ip address mismatch" in t or "doesn't match" in t:
            return (f"the broker's certificate does not name {conn.bootstrap.split(',')[0].rpartition(':')[0]}: "
                    "connect by a name the certificate holds, or set ssl.endpoint.identification.algorithm=none "
                    f"in {where}")
        ca = conn.get("ssl.ca.location")
        return (f"the broker's certificate at {conn.bootstrap} is not trusted: "
                + (f"it is not signed by the CA of ssl.ca.location ({ca}): give the CA that signed it"
                   if ca else f"give the CA that signed it as ssl.ca.location in {where}"))
    if "connecting to a ssl listener" in t or "connecting to a ssl" in t or "speaks tls" in t:
        return (f"{conn.bootstrap} is a TLS listener and this client speaks plaintext: set security.protocol=SSL or "
                f"SASL_SSL (with ssl.ca.location) in {where}")
    if "wrong version number" in t or "packet length too long" in t or "record layer failure" in t or (
            "connecting to a plaintext" in t) or "plaintext listener" in t or (
            "unexpected eof" in t and conn.tls and "handshake" in t):
        return (f"{conn.bootstrap} does not speak TLS (a plaintext listener?) and this client has "
                f"security.protocol={conn.protocol}: use the broker's TLS port, or security.protocol="
                f"{'SASL_PLAINTEXT' if conn.sasl else 'PLAINTEXT'}")
    if "authorization failed" in t or "authorization_failed" in t or "authorizationfailed" in t:
        return f"the broker denied {who!r} an operation ({conn.redact(text.strip())}): see docs/security.md"
    return None


def expired_files(conn: Connection, now: float | None = None) -> str | None:
    """A client certificate (or CA) file of ``conn`` that is expired or not valid yet."""
    now = time.time() if now is None else now
    for name, what in (("ssl.certificate.location", "our client certificate"), ("ssl.ca.location", "the CA")):
        path = conn.get(name)
        if not path:
            continue
        span = certificate_expiry(path)
        if span is None:
            continue
        start, end = span
        when = datetime.fromtimestamp(end if now > end else start, UTC).strftime("%Y-%m-%d %H:%M UTC")
        if now > end:
            return f"{what} ({name}={path}) expired on {when}: renew it"
        if now < start:
            return f"{what} ({name}={path}) is not valid before {when}: check this machine's clock"
    return None


def _first_address(conn: Connection) -> tuple[str, int]:
    host, _, port = conn.bootstrap.split(",")[0].strip().rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def _client_context(conn: Connection) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=conn.get("ssl.ca.location"))
    ctx.check_hostname = conn.get("ssl.endpoint.identification.algorithm", "https") == "https"
    if conn.get("ssl.certificate.location"):
        ctx.load_cert_chain(conn.get("ssl.certificate.location"), conn.get("ssl.key.location"),
                            password=conn.get("ssl.key.password"))
    return ctx


# ApiVersions v0 with correlation id 1 and client id "profstream-check"
_API_VERSIONS = struct.pack(">hhih", 18, 0, 1, 16) + b"profstream-check"
_API_VERSIONS = struct.pack(">i", len(_API_VERSIONS)) + _API_VERSIONS


def handshake_problem(conn: Connection, timeout: float = 3.0) -> str | None:
    """What the first bootstrap address says to this connection's TLS setting: the TLS
    handshake for a TLS client (a certificate problem named exactly, a plaintext port), an
    ApiVersions request for a plaintext one (a TLS port); None when it is as expected, or
    when the address does not answer (the clients' own retries say that)."""
    host, port = _first_address(conn)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    try:
        sock.settimeout(timeout)
        if conn.tls:
            try:
                ctx = _client_context(conn)
            except (OSError, ssl.SSLError) as e:
                return (f"cannot use the client certificate or key of {_where(conn)} "
                        f"({getattr(e, 'reason', None) or e}): check ssl.certificate.location, ssl.key.location and "
                        "ssl.key.password")
            try:
                with ctx.wrap_socket(sock, server_hostname=host) as tls:
                    # TLS 1.3: the broker says what it thinks of our certificate after the handshake
                    tls.sendall(_API_VERSIONS)
                    tls.recv(4)
            except ssl.SSLCertVerificationError as e:
                return explain(conn, f"certificate verify failed: {e.verify_message}")
            except ssl.SSLError as e:
                reason = (e.reason or str(e)).lower().replace("_", " ")
                if "wrong version" in reason or "record layer" in reason or "packet length" in reason or (
                        "unexpected eof" in reason):
                    return explain(conn, "wrong version number")
                return explain(conn, f"alert {reason}") or f"the TLS handshake with {conn.bootstrap} failed ({reason})"
            except (TimeoutError, ConnectionResetError, BrokenPipeError, OSError):
                return None
            return None
        sock.sendall(_API_VERSIONS)
        head = sock.recv(5)
        if head[:1] == b"\x15" and head[1:2] == b"\x03":  # a TLS alert record: the port speaks TLS
            return explain(conn, "connecting to a SSL listener")
        if not head:  # closed without a word: a TLS listener that could not parse plaintext
            return explain(conn, "connecting to a SSL listener")
        return None
    except OSError:
        return None
    finally:
        sock.close()


def librdkafka_problem(conn: Connection, timeout: float = 5.0) -> str | None:
    """Ask for metadata through librdkafka with ``conn``'s settings; the first security
    error it reports, explained (None when it answered or said nothing we can name)."""
    import confluent_kafka

    errors: list[str] = []
    config = dict(conn.librdkafka(), **{"socket.timeout.ms": max(1000, int(timeout * 1000)),
                                        "logger": _QUIET,
                                        "error_cb": lambda err: errors.append(err.str())})
    try:
        client = confluent_kafka.Producer(config)
    except confluent_kafka.KafkaException as e:
        return conn.redact(f"librdkafka refused the settings of {_where(conn)}: {e}")
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                client.list_topics(timeout=min(0.5, max(0.05, deadline - time.monotonic())))
                return None
            except confluent_kafka.KafkaException:
                pass
            client.poll(0)
            for text in errors:
                reason = explain(conn, text)
                if reason is not None:
                    return reason
        return None
    finally:
        client.purge()
        client.flush(0)


def fatal_reason(conn: Connection, timeout: float = 5.0) -> str | None:
    """What makes an idempotent producer of ``conn`` fail for good ("Local: Fatal error" is
    all a client's later calls say): its first fatal error's text, None when none came.
    It sends nothing: the producer id it asks for is what fails (no WRITE on any topic)."""
    import confluent_kafka

    errors: list[str] = []
    client = confluent_kafka.Producer(dict(conn.librdkafka(), **{
        "enable.idempotence": True, "logger": _QUIET,
        "error_cb": lambda err: errors.append(err.str()) if err.fatal() else None}))
    deadline = time.monotonic() + timeout
    try:
        while not errors and time.monotonic() < deadline:
            try:
                client.poll(0.1)
            except confluent_kafka.KafkaException as e:  # a fatal error may come as an exception too
                errors.append(e.args[0].str() if e.args else str(e))
    finally:
        client.purge()
    return conn.redact(errors[0]) if errors else None


def check(conn: Connection, timeout: float = 5.0) -> str | None:
    """Why clients with ``conn`` cannot work with the broker, in one line; None when they
    can (or when all we know is that it does not answer yet)."""
    from profstream.kafka.clients import refused

    why = refused(conn)
    if why is not None:
        return f"no Kafka broker takes connections at {conn.bootstrap} ({why}): check the address"
    return expired_files(conn) or handshake_problem(conn, min(3.0, timeout)) or (
        librdkafka_problem(conn, timeout) if conn.secured else None)


def failure(conn: Connection, error: BaseException | str) -> str:
    """An error of a client, as one line: explained when it is a security problem, else
    its own text; secrets taken out."""
    text = str(error) if not isinstance(error, BaseException) else f"{type(error).__name__}: {error}"
    return explain(conn, text) or conn.redact(text)


def authorization_error(principal: str, operation: str, resource: str, name: str, pattern: str = "LITERAL",
                        hint: str = "") -> str:
    """The one line of an ACL denial: what was denied and the ACL that would allow it."""
    return (f"the broker denied User:{principal} {operation} on {resource.lower()} {name}: missing ACL "
            f"'ALLOW User:{principal} {operation} {resource} {name}" + (f" ({pattern})" if pattern != "LITERAL" else "")
            + "'" + (f"; {hint}" if hint else "; `profstream acl show --role ROLE` lists each role's ACLs"))


def topic_denied(conn: Connection, topic: str, operation: str = "READ", timeout: float = 5.0,
                 hint: str = "") -> str | None:
    """The one line of an ACL denial when the broker will not describe ``topic`` to this
    client (it exists or not: Kafka does not say), None when it will or when the client
    is not authenticated (no ACLs to blame)."""
    if not conn.secured:
        return None
    import confluent_kafka

    client = confluent_kafka.Producer(dict(conn.librdkafka(), logger=_QUIET))
    try:
        meta = client.list_topics(topic, timeout=timeout).topics.get(topic)
    except confluent_kafka.KafkaException:
        return None
    if meta is None or meta.error is None or meta.error.code() != confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED:
        return None
    return authorization_error(conn.principal(), operation, "TOPIC", topic, hint=hint)
