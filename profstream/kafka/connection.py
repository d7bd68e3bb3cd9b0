"""One Kafka connection setting for every profstream client: ``Connection``.

A connection is the bootstrap address and the client properties that go with it, given
once with the standard Kafka property names (``security.protocol``, ``sasl.mechanism``,
``sasl.username`` / ``sasl.password``, ``ssl.ca.location``, ``ssl.certificate.location``,
``ssl.key.location``, ``ssl.key.password``, ``sasl.oauthbearer.*``...): a properties file
(option ``kafka_config``, like kcat's ``-F`` or the Java tools' ``--command-config``) and
overrides (option ``kafka_properties``, ``-X KEY=VALUE`` on the command line), through the
usual option chain (profstream/config.py). It is built once and handed to every client;
each client library gets it in its own dialect from the one table ``PROPERTIES``:
librdkafka (``librdkafka()``: the compiled Monitor, the Python Monitor, the processors,
the control reader) and kafka-python (``kafka_python()``: sinks, admin, tools).

A value may be a reference instead of the secret itself: ``${env:NAME}`` (an environment
variable) or ``${file:PATH}`` (a file's content, stripped) or ``${file:PATH:KEY}`` (a key
of a properties file, as Kafka's FileConfigProvider reads it). Secret values never appear
in ``str()``, ``repr()``, ``describe()`` or an error of this module; ``redact()`` takes
them out of any other text (a client library's message).
"""

from __future__ import annotations

import difflib
import os
import re
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profstream.config import ConfigError, parse_properties

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI")
ANONYMOUS = "ANONYMOUS"  # the principal of a client the broker did not authenticate
HIDDEN = "***"


@dataclass(frozen=True)
class Property:
    """One client property: its librdkafka name and kafka-python argument (None: the
    kafka-python client gets it some other way), whether it is a secret, the values it
    takes (empty: any)."""

    librdkafka: str | None
    kafka_python: str | None
    secret: bool = False
    values: tuple[str, ...] = ()
    file: bool = False  # a path that must name a readable file


# The standard names (Java client's where librdkafka shares them, else librdkafka's) and
# the aliases read as them. The Java clients' keystore/truststore names are accepted for
# PEM files (type PEM); sasl.jaas.config is read into the username and password (or the
# OIDC client id, secret and scope) it holds.
PROPERTIES: dict[str, Property] = {
    "security.protocol": Property("security.protocol", "security_protocol", values=PROTOCOLS),
    "sasl.mechanism": Property("sasl.mechanisms", "sasl_mechanism", values=MECHANISMS),
    "sasl.username": Property("sasl.username", "sasl_plain_username"),
    "sasl.password": Property("sasl.password", "sasl_plain_password", secret=True),
    "sasl.kerberos.service.name": Property("sasl.kerberos.service.name", "sasl_kerberos_service_name"),
    "ssl.ca.location": Property("ssl.ca.location", "ssl_cafile", file=True),
    "ssl.certificate.location": Property("ssl.certificate.location", "ssl_certfile", file=True),
    "ssl.key.location": Property("ssl.key.location", "ssl_keyfile", file=True),
    "ssl.key.password": Property("ssl.key.password", "ssl_password", secret=True),
    "ssl.endpoint.identification.algorithm": Property("ssl.endpoint.identification.algorithm", None,
                                                      values=("https", "none")),
    "sasl.oauthbearer.method": Property("sasl.oauthbearer.method", None, values=("default", "oidc")),
    "sasl.oauthbearer.client.id": Property("sasl.oauthbearer.client.id", None),
    "sasl.oauthbearer.client.secret": Property("sasl.oauthbearer.client.secret", None, secret=True),
    "sasl.oauthbearer.token.endpoint.url": Property("sasl.oauthbearer.token.endpoint.url", None),
    "sasl.oauthbearer.scope": Property("sasl.oauthbearer.scope", None),
    "sasl.oauthbearer.extensions": Property("sasl.oauthbearer.extensions", None),
    "client.id": Property("client.id", "client_id"),
}
ALIASES = {
    "sasl.mechanisms": "sasl.mechanism",
    "ssl.truststore.location": "ssl.ca.location",  # with ssl.truststore.type=PEM
    "sasl.oauthbearer.token.endpoint.uri": "sasl.oauthbearer.token.endpoint.url",
}
# Read and checked, not passed on: profstream resolves ${env:...} and ${file:...} itself.
IGNORED = re.compile(r"config\.providers(\..*)?|ssl\.(truststore|keystore)\.type|sasl\.login\.callback\.handler\.class|"
                     r"sasl\.oauthbearer\.jwks\.endpoint\.url")
SECRET_NAMES = frozenset({"sasl.jaas.config", "ssl.keystore.password", "ssl.truststore.password",
                          *(k for k, p in PROPERTIES.items() if p.secret)})
_REFERENCE = re.compile(r"\$\{(env|file):([^}]*)\}")
_JAAS_OPTION = re.compile(r'(\w+)\s*=\s*"((?:[^"\\]|\\.)*)"')


def is_secret(name: str) -> bool:
    return name in SECRET_NAMES or name.endswith((".password", ".secret"))


def read_properties(path: str | Path, what: str = "Kafka client properties file") -> dict[str, str]:
    """``key=value`` lines of a Java properties file (``#`` / ``!`` comments, ``key: value``
    too, a trailing backslash continues a line). ConfigError (one line) when unreadable."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read the {what} {path} ({e.strerror or e}): give an existing, readable "
                          "file") from None
    out: dict[str, str] = {}
    lines = iter(text.splitlines())
    for line in lines:
        line = line.strip()
        while line.endswith("\\") and not line.endswith("\\\\"):
            line = line[:-1] + next(lines, "").strip()
        if not line or line[0] in "#!":
            continue
        m = re.match(r"([^=:\s]+)\s*[=:\s]\s*(.*)", line)
        if m is None:
            out[line] = ""
            continue
        out[m.group(1)] = m.group(2).strip()
    return out


def _resolve_reference(name: str, value: str, source: str) -> str:
    """``value`` with its ${env:NAME} / ${file:PATH[:KEY]} references read; the errors name
    the reference, never what it holds."""

    def read(m: re.Match) -> str:
        kind, arg = m.group(1), m.group(2)
        if kind == "env":
            if arg not in os.environ:
                raise ConfigError(f"{source}: {name} refers to ${{env:{arg}}}, which is not set: export {arg}")
            return os.environ[arg]
        path, sep, key = arg.rpartition(":") if re.search(r":[^/\\]+$", arg) and not re.fullmatch(
            r"[A-Za-z]:[/\\].*", arg) else (arg, "", "")
        if sep:
            values = read_properties(path, f"file of ${{file:{arg}}} ({name})")
            if key not in values:
                raise ConfigError(f"{source}: {name} refers to key {key!r} of {path}, which has no such key")
            return values[key]
        try:
            return Path(path).expanduser().read_text().strip()
        except OSError as e:
            raise ConfigError(f"{source}: {name} refers to ${{file:{path}}}, which cannot be read "
                              f"({e.strerror or e}): give a readable file") from None

    return _REFERENCE.sub(read, value)


def _parse_jaas(value: str, source: str) -> dict[str, str]:
    """The username/password (PLAIN, SCRAM) or clientId/clientSecret/scope (OAUTHBEARER)
    of a Java sasl.jaas.config."""
    options = {k: v.replace('\\"', '"') for k, v in _JAAS_OPTION.findall(value)}
    out = {}
    for ours, theirs in (("sasl.username", "username"), ("sasl.password", "password"),
                         ("sasl.oauthbearer.client.id", "clientId"),
                         ("sasl.oauthbearer.client.secret", "clientSecret"), ("sasl.oauthbearer.scope", "scope")):
        if theirs in options:
            out[ours] = options[theirs]
    if not out and "OAuthBearerLoginModule" not in value:
        raise ConfigError(f"{source}: sasl.jaas.config holds no username/password (nor clientId/clientSecret): "
                          "give sasl.username and sasl.password instead")
    return out


def _close_name(name: str) -> str:
    close = difflib.get_close_matches(name, [*PROPERTIES, *ALIASES], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def canonical(raw: Mapping[str, str], source: str) -> dict[str, str]:
    """``raw`` properties under their standard names, references read, values checked:
    ConfigError naming the property and what it takes (never a secret's value)."""
    out: dict[str, str] = {}
    jaas: dict[str, str] = {}
    for name, value in raw.items():
        name = name.strip()
        value = _resolve_reference(name, str(value), source)
        if name == "bootstrap.servers":
            out[name] = value
            continue
        if name == "sasl.jaas.config":
            jaas = _parse_jaas(value, source)
            continue
        if name == "ssl.keystore.location":  # a PEM keystore: key and certificate chain in one file
            out.setdefault("ssl.certificate.location", value)
            out.setdefault("ssl.key.location", value)
            continue
        if name in ("ssl.keystore.password", "ssl.truststore.password"):
            if name == "ssl.keystore.password":
                out.setdefault("ssl.key.password", value)
            continue
        if name in ("ssl.truststore.type", "ssl.keystore.type") and value.strip().upper() != "PEM":
            raise ConfigError(f"{source}: {name}={value.strip()}: profstream's clients read PEM files; convert the "
                              "store (keytool -exportcert -rfc, openssl pkcs12 -nodes) and give ssl.ca.location, "
                              "ssl.certificate.location and ssl.key.location")
        if IGNORED.fullmatch(name):
            continue
        name = ALIASES.get(name, name)
        prop = PROPERTIES.get(name)
        if prop is None:
            raise ConfigError(f"{source}: unknown Kafka client property {name!r}{_close_name(name)}; profstream's "
                              f"clients take {', '.join(PROPERTIES)} (docs/security.md)")
        value = value.strip()
        if name in ("security.protocol", "sasl.mechanism"):
            value = value.upper()
        elif prop.values:
            value = value.lower() or "none"
        if prop.values and value not in prop.values:
            raise ConfigError(f"{source}: {name}={value}: expected one of {', '.join(prop.values)}")
        if prop.file and not os.access(Path(value).expanduser(), os.R_OK):
            raise ConfigError(f"{source}: {name}={value}: no readable file there; give the path of a PEM file")
        out[name] = str(Path(value).expanduser()) if prop.file else value
    for k, v in jaas.items():
        out.setdefault(k, v)
    return out


class Connection:
    """The bootstrap address and client properties of every profstream Kafka client.

    ``str(conn)`` is the bootstrap address (what messages show), ``describe()`` adds the
    protocol and who connects; neither ever holds a secret."""

    __slots__ = ("bootstrap", "_props", "source", "_oauth")

    def __init__(self, bootstrap: str, properties: Mapping[str, str] | None = None, source: str = "") -> None:
        self.bootstrap = bootstrap
        self.source = source
        props = dict(properties or {})
        props.pop("bootstrap.servers", None)
        self._props = props
        self._oauth: Any = None
        self._check()

    # -- building -----------------------------------------------------------------------

    @classmethod
    def of(cls, value: Connection | str) -> Connection:
        """``value`` itself, or a plaintext connection to the bootstrap address ``value``."""
        return value if isinstance(value, Connection) else cls(str(value))

    @classmethod
    def from_options(cls, options: Mapping[str, Any], bootstrap_given: bool = True) -> Connection:
        """The connection of resolved options (``bootstrap``, ``kafka_config``,
        ``kafka_properties``): the file's properties, the overrides over them. The bootstrap
        option wins over the file's bootstrap.servers when given (``bootstrap_given``)."""
        raw: dict[str, str] = {}
        sources = []
        path = options.get("kafka_config")
        if path:
            raw.update(read_properties(path))
            sources.append(str(path))
        overrides = options.get("kafka_properties")
        if overrides:
            raw.update(parse_properties(overrides))
            sources.append("kafka_properties")
        source = " + ".join(sources) or "options"
        props = canonical(raw, source)
        bootstrap = options.get("bootstrap") or ""
        if "bootstrap.servers" in props and not bootstrap_given:
            bootstrap = props["bootstrap.servers"].replace(" ", "")
            from profstream.config import MONITOR_OPTIONS

            check = next(o for o in MONITOR_OPTIONS if o.name == "bootstrap").check
            if not check(bootstrap):
                raise ConfigError(f"{source}: bootstrap.servers={bootstrap}: expected host:port[,host:port]")
        return cls(bootstrap, props, source)

    def _check(self) -> None:
        p, source = self._props, self.source or "Kafka client properties"
        protocol = self.protocol
        mechanism = p.get("sasl.mechanism")
        if self.sasl:
            mechanism = mechanism or "PLAIN"  # the Kafka clients' default
            if mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
                missing = [k for k in ("sasl.username", "sasl.password") if not p.get(k)]
                if missing:
                    raise ConfigError(f"{source}: security.protocol={protocol} with sasl.mechanism={mechanism} needs "
                                      f"{' and '.join(missing)}")
            if mechanism == "OAUTHBEARER" and p.get("sasl.oauthbearer.method") == "oidc":
                missing = [k for k in ("sasl.oauthbearer.client.id", "sasl.oauthbearer.client.secret",
                                       "sasl.oauthbearer.token.endpoint.url") if not p.get(k)]
                if missing:
                    raise ConfigError(f"{source}: sasl.oauthbearer.method=oidc needs {', '.join(missing)}")
        elif mechanism or p.get("sasl.username"):
            raise ConfigError(f"{source}: sasl.* properties are given but security.protocol={protocol}: use "
                              f"security.protocol={'SASL_SSL' if self.tls else 'SASL_SSL (or SASL_PLAINTEXT)'}")
        if not self.tls and any(k.startswith("ssl.") for k in p):
            raise ConfigError(f"{source}: ssl.* properties are given but security.protocol={protocol}: use "
                              f"security.protocol={'SASL_SSL' if self.sasl else 'SSL'}")
        if ("ssl.certificate.location" in p) != ("ssl.key.location" in p):
            raise ConfigError(f"{source}: a client certificate needs both ssl.certificate.location and "
                              "ssl.key.location")

    # -- what it is ---------------------------------------------------------------------

    @property
    def protocol(self) -> str:
        return self._props.get("security.protocol", "PLAINTEXT")

    @property
    def tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def mechanism(self) -> str | None:
        return (self._props.get("sasl.mechanism") or "PLAIN") if self.sasl else None

    @property
    def secured(self) -> bool:
        return self.protocol != "PLAINTEXT"

    def get(self, name: str, default: str | None = None) -> str | None:
        """A property's value (a secret's too: for clients, never for messages)."""
        return self._props.get(name, default)

    def properties(self) -> dict[str, str]:
        """Every property under its standard name (secrets included: for clients)."""
        return dict(self._props)

    def principal(self) -> str:
        """Who the broker sees, as far as the client can tell: the SASL username, the
        OIDC client id, the CN of the client certificate (the mapping of ``stack up
        --secure``: ssl.principal.mapping.rules=RULE:^CN=([^,]+).*$/$1/), else ANONYMOUS."""
        p = self._props
        if self.sasl:
            if self.mechanism == "OAUTHBEARER":
                return p.get("sasl.oauthbearer.client.id") or ANONYMOUS
            if self.mechanism != "GSSAPI":
                return p["sasl.username"]
        if self.tls and p.get("ssl.certificate.location"):
            cn = certificate_subject(p["ssl.certificate.location"]).get("commonName")
            if cn:
                return cn
        return ANONYMOUS

    def describe(self) -> str:
        """The address, protocol and who connects, for people: never a secret."""
        if not self.secured:
            return self.bootstrap
        who = []
        if self.sasl:
            who.append(f"{self.mechanism} as {self.principal()}")
        if self.tls and self._props.get("ssl.certificate.location"):
            who.append("client certificate")
        return f"{self.bootstrap} ({self.protocol}{', ' + ', '.join(who) if who else ''})"

    def secrets(self) -> list[str]:
        return [v for k, v in self._props.items() if is_secret(k) and v]

    def redact(self, text: str) -> str:
        """``text`` with every secret value of this connection replaced by ***."""
        for secret in sorted(self.secrets(), key=len, reverse=True):
            text = text.replace(secret, HIDDEN)
        return text

    def with_bootstrap(self, bootstrap: str) -> Connection:
        return Connection(bootstrap, self._props, self.source)

    def __str__(self) -> str:
        return self.bootstrap

    def __repr__(self) -> str:
        shown = {k: (HIDDEN if is_secret(k) else v) for k, v in self._props.items()}
        return f"Connection({self.bootstrap!r}, {shown!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Connection) and (self.bootstrap, self._props) == (other.bootstrap, other._props)

    def __hash__(self) -> int:
        return hash((self.bootstrap, tuple(sorted(self._props.items()))))

    def __reduce__(self):  # to a child process (simulate --procs): the same connection
        return (Connection, (self.bootstrap, self._props, self.source))

    # -- each library's dialect ---------------------------------------------------------

    def librdkafka(self) -> dict[str, str]:
        """The properties under librdkafka's names (``bootstrap.servers`` included)."""
        out = {"bootstrap.servers": self.bootstrap}
        for name, value in self._props.items():
            prop = PROPERTIES[name]
            if prop.librdkafka is not None:
                out[prop.librdkafka] = value
        if self.tls and "ssl.endpoint.identification.algorithm" not in out:
            out["ssl.endpoint.identification.algorithm"] = "https"
        return out

    def kafka_python(self) -> dict[str, Any]:
        """The properties as kafka-python's keyword arguments (``bootstrap_servers`` included)."""
        out: dict[str, Any] = {"bootstrap_servers": self.bootstrap.split(",")}
        for name, value in self._props.items():
            prop = PROPERTIES[name]
            if prop.kafka_python is not None:
                out[prop.kafka_python] = value
        if self.tls:
            out["ssl_check_hostname"] = self._props.get("ssl.endpoint.identification.algorithm", "https") == "https"
        if self.mechanism == "OAUTHBEARER":
            out["sasl_oauth_token_provider"] = self._token_provider()
        return out

    def _token_provider(self) -> Any:
        if self._oauth is None:
            self._oauth = oauth_token_provider(self)
        return self._oauth


def certificate_subject(path: str) -> dict[str, str]:
    """The subject of the first certificate of a PEM file ({} when it cannot be read)."""
    info = certificate_info(path)
    return dict(pair for rdn in info.get("subject", ()) for pair in rdn) if info else {}


def certificate_info(path: str) -> dict | None:
    """What Python's ssl module reads of the first certificate of a PEM file (subject,
    notBefore, notAfter...), None when it cannot."""
    try:
        return ssl._ssl._test_decode_cert(str(path))  # the only stdlib reader of a certificate file
    except (AttributeError, OSError, ssl.SSLError, ValueError):
        return None


def certificate_expiry(path: str) -> tuple[float, float] | None:
    """(notBefore, notAfter) of the first certificate of a PEM file, epoch seconds."""
    info = certificate_info(path)
    if not info or "notAfter" not in info:
        return None
    return ssl.cert_time_to_seconds(info["notBefore"]), ssl.cert_time_to_seconds(info["notAfter"])


def oauth_token_provider(conn: Connection) -> Any:
    """kafka-python's OAUTHBEARER token source: OIDC client credentials against
    ``sasl.oauthbearer.token.endpoint.url`` (what librdkafka does with
    sasl.oauthbearer.method=oidc), the token reused until a minute before it expires."""
    try:
        from kafka.net.sasl.oauth import AbstractTokenProvider
    except ImportError:  # kafka-python 2.x
        from kafka.sasl.oauth import AbstractTokenProvider

    if conn.get("sasl.oauthbearer.method") != "oidc":
        raise ConfigError(f"{conn.source or 'Kafka client properties'}: sasl.mechanism=OAUTHBEARER needs "
                          "sasl.oauthbearer.method=oidc with a client id, secret and token endpoint")

    class ClientCredentials(AbstractTokenProvider):
        def __init__(self) -> None:
            self._lock = threading.Lock()
            self._token = ""
            self._until = 0.0

        def token(self) -> str:
            with self._lock:
                if time.time() < self._until - 60:
                    return self._token
                self._token, lifetime = fetch_oidc_token(conn)
                self._until = time.time() + lifetime
                return self._token

        def extensions(self) -> dict:
            text = conn.get("sasl.oauthbearer.extensions") or ""
            return dict(p.split("=", 1) for p in text.split(",") if "=" in p)

    return ClientCredentials()


def fetch_oidc_token(conn: Connection, timeout: float = 10.0) -> tuple[str, float]:
    """(access token, seconds it lives) by the client-credentials grant."""
    import base64
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    url = conn.get("sasl.oauthbearer.token.endpoint.url") or ""
    client_id, secret = conn.get("sasl.oauthbearer.client.id") or "", conn.get("sasl.oauthbearer.client.secret") or ""
    form = {"grant_type": "client_credentials"}
    if conn.get("sasl.oauthbearer.scope"):
        form["scope"] = conn.get("sasl.oauthbearer.scope")
    auth = base64.b64encode(f"{urllib.parse.quote(client_id)}:{urllib.parse.quote(secret)}".encode()).decode()
    request = urllib.request.Request(url, data=urllib.parse.urlencode(form).encode(), method="POST",
                                     headers={"Authorization": f"Basic {auth}",
                                              "Content-Type": "application/x-www-form-urlencoded"})
    context = ssl.create_default_context(cafile=conn.get("ssl.ca.location")) if url.startswith("https") else None
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as answer:
            data = json.loads(answer.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ConnectionError(conn.redact(f"the OIDC token endpoint {url} did not give a token "
                                          f"({getattr(e, 'reason', None) or e})")) from None
    token = data.get("access_token") if isinstance(data, dict) else None
    if not token:
        raise ConnectionError(f"the OIDC token endpoint {url} answered without an access_token: check "
                              "sasl.oauthbearer.client.id and its secret")
    return token, float(data.get("expires_in") or 300)
