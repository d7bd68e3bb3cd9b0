"""The secured broker of the tests (``secure_stack``): `profstream stack up --secure` in a
state directory of the session, and per test a topic prefix of its own with every role's
ACLs on it, applied by the admin as an operator would (``profstream.kafka.acls.grant``).

Users are the roles (trainer, processor, sink, capture, autocapture) and admin, each with a
SCRAM password and a client certificate (``conn(user, mtls=...)``).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from profstream.kafka.acls import ROLES, grant
from profstream.kafka.connection import Connection
from profstream.kafka.topics import Topics
from profstream.stack.secure import client_connection, issue_certificate, make_ca, secure_dir


@dataclass
class SecureStack:
    state_dir: Path

    @property
    def material(self) -> Path:
        return secure_dir(self.state_dir)

    def conn(self, user: str = "admin", mtls: bool = False, **overrides: str) -> Connection:
        """``user``'s connection (SCRAM over SASL_SSL, or its certificate over mutual TLS),
        with ``overrides`` (property name with _ for .) over its properties."""
        base = client_connection(self.state_dir, user, mtls)
        if not overrides:
            return base
        props = base.properties()
        props.update({k.replace("_", "."): v for k, v in overrides.items()})
        return Connection(base.bootstrap, props, base.source)

    @property
    def sasl_bootstrap(self) -> str:
        return self.conn().bootstrap

    @property
    def ssl_bootstrap(self) -> str:
        return self.conn(mtls=True).bootstrap

    def topics(self, name: str, groups: dict[str, tuple[str, ...]] | None = None) -> Topics:
        """A prefix of its own for one test: its topics created and each role's ACLs
        granted to the user of the same name (``groups``: a role's consumer groups)."""
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name)[:50]
        topics = Topics(f"s-{slug}-{uuid.uuid4().hex[:6]}")
        admin = self.conn()
        for role in ROLES:
            grant(admin, role, role, topics, (groups or {}).get(role, ()))
        return topics

    def certificate(self, name: str, ca: str = "ca", days: int = 30) -> tuple[Path, Path]:
        """A client certificate CN=<name> signed by ``ca`` (another one made by ``other_ca``)."""
        return issue_certificate(self.material, name, ca=ca, days=days)

    def other_ca(self, name: str = "stranger-ca") -> Path:
        """A CA the broker does not trust (made once)."""
        if not (self.material / f"{name}.pem").is_file():
            make_ca(self.material, name)
        return self.material / f"{name}.pem"

    def expired_certificate(self, name: str = "expired") -> tuple[Path, Path]:
        """A client certificate of the broker's CA that expired in 2020 (``openssl ca``
        takes explicit dates)."""
        import subprocess

        d = self.material / "expired-ca"
        d.mkdir(exist_ok=True)
        (d / "index.txt").write_text("")
        (d / "serial").write_text("1000\n")
        (d / "ca.cnf").write_text(f"""\
[ca]
default_ca = local
[local]
dir = {d}
database = {d}/index.txt
new_certs_dir = {d}
serial = {d}/serial
certificate = {self.material}/ca.pem
private_key = {self.material}/ca.key
default_md = sha256
policy = any
unique_subject = no
[any]
commonName = supplied
""")
        subprocess.run(["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}"], cwd=d, check=True,
                       capture_output=True)
        subprocess.run(["openssl", "ca", "-batch", "-config", "ca.cnf", "-in", f"{name}.csr", "-out", f"{name}.pem",
                        "-startdate", "20200101000000Z", "-enddate", "20200201000000Z", "-notext"], cwd=d, check=True,
                       capture_output=True)
        return d / f"{name}.pem", d / f"{name}.key"


def produce_error(conn: Connection, topic: str, timeout: float = 20.0) -> str | None:
    """The error name of producing one record to ``topic`` with ``conn`` (librdkafka), None
    when the broker took it."""
    import confluent_kafka

    errors: list[str] = []
    producer = confluent_kafka.Producer(dict(conn.librdkafka(), **{"message.timeout.ms": int(timeout * 1000)}))
    producer.produce(topic, b"acl probe", on_delivery=lambda err, _m: errors.append(err.name() if err else ""))
    producer.flush(timeout + 5)
    return errors[0] or None if errors else "NO_REPORT"


def consume_error(conn: Connection, topic: str, group: str | None = None, timeout: float = 20.0) -> str | None:
    """The error name of reading ``topic`` with ``conn`` (in consumer group ``group``, else
    partition 0 assigned as the Monitor's request reader does, in no group but with a
    group id of the readers' prefix), None when a read went through (partition end reached)."""
    import time

    import confluent_kafka

    consumer = confluent_kafka.Consumer(dict(conn.librdkafka(), **{
        "group.id": group or "profstream-control-probe", "enable.partition.eof": True, "auto.offset.reset": "earliest",
        "enable.auto.commit": False}))
    try:
        if group is None:
            meta = consumer.list_topics(topic, timeout=timeout).topics[topic]
            if meta.error is not None:  # what the broker says of a topic it will not describe to us
                return meta.error.name()
            consumer.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
        else:
            consumer.subscribe([topic])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            error = msg.error()
            if error is None or error.code() == confluent_kafka.KafkaError._PARTITION_EOF:
                return None
            return error.name()
        return "TIMED_OUT"
    finally:
        consumer.close()
