"""The secured local broker of ``profstream stack up --secure``: what a production Kafka asks
of its clients, on loopback.

- A CA and certificates made on the spot with openssl (``secure/`` in the state directory):
  the broker's (CN=broker, for 127.0.0.1 and localhost) and one per user (CN=<user>).
- Two client listeners: SASL_SSL with SCRAM-SHA-512 (the users are created when the storage
  is formatted, ``kafka-storage format --add-scram``) and SSL with client certificates
  required (mutual TLS); the controller listener is mutual TLS too. A certificate's CN is
  its principal (``ssl.principal.mapping.rules``), so a user is the same principal both ways.
- The StandardAuthorizer, no access without an ACL; ``broker`` and ``admin`` are super users.
- One client properties file per user and way in, ``secure/<user>.properties`` (SCRAM) and
  ``secure/<user>-mtls.properties`` (certificate); the passwords stay in files of their own
  (mode 600) that the properties refer to as ``${file:...}``.

The users are the roles of ``profstream.kafka.acls`` (trainer, processor, sink, capture,
autocapture) and ``admin``, which ``stack up --secure`` uses to create the topics and each
role's ACLs for the default topic prefix.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from pathlib import Path

from profstream.kafka.connection import Connection
from profstream.stack.errors import StackError

SECURE_DIR = "secure"
MECHANISM = "SCRAM-SHA-512"
ADMIN = "admin"
BROKER_PRINCIPAL = "broker"
USERS = (ADMIN, "trainer", "processor", "sink", "capture", "autocapture")
CERT_DAYS = 825
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def secure_dir(state_dir: Path) -> Path:
    return state_dir / SECURE_DIR


def _openssl(args: list[str], cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise StackError("openssl is not installed: `apt-get install openssl` (stack up --secure makes its "
                         "certificates with it)")
    done = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise StackError(f"openssl {args[0]} failed in {cwd} ({last}): remove {cwd} and retry")


def _private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def issue_certificate(directory: Path, name: str, ca: str = "ca", days: int = CERT_DAYS,
                      server: bool = False, cn: str | None = None) -> tuple[Path, Path]:
    """A key and a certificate CN=<cn or name> signed by ``ca`` (``<ca>.pem``/``<ca>.key``
    in ``directory``): (``<name>.pem``, ``<name>.key``). ``server``: for 127.0.0.1 and
    localhost, usable both ways (the broker is a client of its controller)."""
    ext = directory / f"{name}.ext"
    usage = "serverAuth,clientAuth" if server else "clientAuth"
    ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                   f"extendedKeyUsage={usage}\n" + ("subjectAltName=IP:127.0.0.1,DNS:localhost\n" if server else ""))
    _openssl(["req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn or name}"], directory)
    _openssl(["x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
              "-out", f"{name}.pem", "-days", str(days), "-extfile", ext.name], directory)
    (directory / f"{name}.csr").unlink()
    ext.unlink()
    os.chmod(directory / f"{name}.key", 0o600)
    return directory / f"{name}.pem", directory / f"{name}.key"


def make_ca(directory: Path, name: str = "ca", days: int = 3650) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    _openssl(["req", "-x509", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", str(days),
              "-subj", f"/CN=profstream local {name}"], directory)
    os.chmod(directory / f"{name}.key", 0o600)
    return directory / f"{name}.pem"


def ensure_material(state_dir: Path) -> Path:
    """The CA, the certificates and the passwords of ``state_dir``'s secured broker, made
    once (a restart keeps them: the users' credentials are in the broker's storage)."""
    d = secure_dir(state_dir)
    if (d / "ready").is_file():
        return d
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True, mode=0o700)
    make_ca(d)
    issue_certificate(d, BROKER_PRINCIPAL, server=True)
    (d / "broker-keystore.pem").write_text((d / "broker.key").read_text() + (d / "broker.pem").read_text())
    os.chmod(d / "broker-keystore.pem", 0o600)
    for user in USERS:
        issue_certificate(d, user)
        _private(d / f"{user}.password", secrets.token_urlsafe(24) + "\n")
    (d / "ready").write_text("")
    return d


def password(state_dir: Path, user: str) -> str:
    return (secure_dir(state_dir) / f"{user}.password").read_text().strip()


def scram_arguments(state_dir: Path) -> list[str]:
    """``kafka-storage format`` arguments that create every user's SCRAM credentials."""
    out = []
    for user in USERS:
        out += ["--add-scram", f"{MECHANISM}=[name={user},password={password(state_dir, user)}]"]
    return out


def server_properties(state_dir: Path, sasl_port: int, ssl_port: int, controller_port: int) -> dict[str, str]:
    """The listeners and security settings of the secured node (single broker)."""
    d = secure_dir(state_dir)
    return {
        "listeners": f"SASL_SSL://127.0.0.1:{sasl_port},SSL://127.0.0.1:{ssl_port},"
                     f"CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"SASL_SSL://127.0.0.1:{sasl_port},SSL://127.0.0.1:{ssl_port}",
        "inter.broker.listener.name": "SSL",
        "listener.security.protocol.map": "SASL_SSL:SASL_SSL,SSL:SSL,CONTROLLER:SSL",
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(d / "broker-keystore.pem"),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(d / "ca.pem"),
        "ssl.client.auth": "required",
        "listener.name.sasl_ssl.ssl.client.auth": "none",
        "ssl.principal.mapping.rules": "RULE:^CN=([^,]+).*$/$1/,DEFAULT",
        "sasl.enabled.mechanisms": MECHANISM,
        "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config":
            "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{BROKER_PRINCIPAL};User:{ADMIN}",
    }


def write_client_properties(state_dir: Path, sasl_bootstrap: str, ssl_bootstrap: str) -> dict[str, Path]:
    """Each user's two client properties files; returns {user: its SCRAM file}."""
    d = secure_dir(state_dir)
    out = {}
    for user in USERS:
        scram = d / f"{user}.properties"
        scram.write_text(f"""\
# profstream stack up --secure: user {user} over SASL_SSL with SCRAM ({MECHANISM})
bootstrap.servers={sasl_bootstrap}
security.protocol=SASL_SSL
sasl.mechanism={MECHANISM}
sasl.username={user}
sasl.password=${{file:{d / f'{user}.password'}}}
ssl.ca.location={d / 'ca.pem'}
""")
        (d / f"{user}-mtls.properties").write_text(f"""\
# profstream stack up --secure: user {user} over SSL with its client certificate (mutual TLS)
bootstrap.servers={ssl_bootstrap}
security.protocol=SSL
ssl.ca.location={d / 'ca.pem'}
ssl.certificate.location={d / f'{user}.pem'}
ssl.key.location={d / f'{user}.key'}
""")
        out[user] = scram
    return out


def client_connection(state_dir: Path, user: str = ADMIN, mtls: bool = False) -> Connection:
    """The connection of ``user``'s properties file (SCRAM, or mutual TLS)."""
    from profstream.kafka.connection import canonical, read_properties

    path = secure_dir(state_dir) / f"{user}{'-mtls' if mtls else ''}.properties"
    props = canonical(read_properties(path), str(path))
    return Connection(props["bootstrap.servers"], props, str(path))


def is_secure(state_dir: Path) -> bool:
    return (secure_dir(state_dir) / "admin.properties").is_file()
