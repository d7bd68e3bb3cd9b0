"""TLS and basic auth of profstream's HTTP endpoints, from a web-config file in the format of
Prometheus's own exporters (the exporter-toolkit's ``--web.config.file``):

.. code-block:: yaml

    tls_server_config:
      cert_file: server.crt          # relative paths: to the file's directory
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # optional: mutual TLS
      client_ca_file: clients-ca.crt
      min_version: TLS12             # TLS10..TLS13
    basic_auth_users:
      prometheus: $2y$10$...         # bcrypt hashes (htpasswd -nBC 10 "" | tr -d ':\\n')

``/metrics`` of the exporter (``sink prometheus --web-config``) and of the processors
(``process --web-config``), and the webhook (``--web-config``, for its TLS; its own auth
is a bearer token) take it. The file is read again when it changes (at most once a
second): certificates and users are rotated without a restart. A bad file is a
``ConfigError`` naming the key and what it takes. Passwords are checked against the hash
once per password (bcrypt costs tens of ms by design); the cache keeps only a SHA-256 of
the password it saw.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profstream.config import ConfigError

KEYS = ("tls_server_config", "basic_auth_users", "http_server_config")
TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version",
            "cipher_suites", "curve_preferences", "prefer_server_cipher_suites")
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "RequestClientCert": ssl.CERT_OPTIONAL,
               "RequireAnyClientCert": ssl.CERT_REQUIRED, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1, "TLS12": ssl.TLSVersion.TLSv1_2,
            "TLS13": ssl.TLSVersion.TLSv1_3}
HANDSHAKE_TIMEOUT_S = 10.0
RELOAD_EVERY_S = 1.0


@dataclass
class WebSettings:
    """One reading of a web-config file."""

    tls: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash


def _fail(path: Path, what: str) -> ConfigError:
    return ConfigError(f"web config {path}: {what}")


def read_settings(path: Path) -> WebSettings:
    """The settings of one web-config file; ConfigError (one line) when it is bad."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"cannot read the web config {path} ({e.strerror or e}): give an existing file") from None
    except yaml.YAMLError as e:
        raise _fail(path, f"not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise _fail(path, "expected a mapping with tls_server_config and/or basic_auth_users")
    unknown = [k for k in data if k not in KEYS]
    if unknown:
        raise _fail(path, f"unknown key {unknown[0]!r}; known keys: {', '.join(KEYS)}")
    settings = WebSettings()
    if data.get("tls_server_config") is not None:
        settings.tls = _tls(path, data["tls_server_config"])
    users = data.get("basic_auth_users") or {}
    if not isinstance(users, dict):
        raise _fail(path, "basic_auth_users: expected a mapping of user names to bcrypt hashes")
    for user, hashed in users.items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise _fail(path, f"basic_auth_users[{user!r}]: expected a bcrypt hash ($2y$...), e.g. from "
                              "`htpasswd -nBC 10 \"\" | tr -d ':\\n'`")
        settings.users[str(user)] = hashed.encode()
    return settings


def _tls(path: Path, conf: Any) -> ssl.SSLContext:
    if not isinstance(conf, dict):
        raise _fail(path, "tls_server_config: expected a mapping (cert_file, key_file...)")
    unknown = [k for k in conf if k not in TLS_KEYS]
    if unknown:
        raise _fail(path, f"tls_server_config: unknown key {unknown[0]!r}; known keys: {', '.join(TLS_KEYS)}")
    for key in ("cert_file", "key_file"):
        if not conf.get(key):
            raise _fail(path, f"tls_server_config needs {key}")

    def file(key: str) -> str:
        p = Path(str(conf[key])).expanduser()
        return str(p if p.is_absolute() else path.parent / p)

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(file("cert_file"), file("key_file"))
    except (OSError, ssl.SSLError) as e:
        raise _fail(path, f"cannot use cert_file/key_file ({getattr(e, 'strerror', None) or e})") from None
    auth = conf.get("client_auth_type", "NoClientCert")
    if auth not in CLIENT_AUTH:
        raise _fail(path, f"tls_server_config.client_auth_type {auth!r}: expected one of {', '.join(CLIENT_AUTH)}")
    ctx.verify_mode = CLIENT_AUTH[auth]
    if auth in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert", "RequireAnyClientCert") or conf.get(
            "client_ca_file"):
        if not conf.get("client_ca_file"):
            raise _fail(path, f"tls_server_config.client_auth_type {auth} needs client_ca_file")
        try:
            ctx.load_verify_locations(file("client_ca_file"))
        except (OSError, ssl.SSLError) as e:
            raise _fail(path, f"cannot use client_ca_file ({getattr(e, 'strerror', None) or e})") from None
    for key, attr in (("min_version", "minimum_version"), ("max_version", "maximum_version")):
        if conf.get(key) is not None:
            if conf[key] not in VERSIONS:
                raise _fail(path, f"tls_server_config.{key} {conf[key]!r}: expected one of {', '.join(VERSIONS)}")
            setattr(ctx, attr, VERSIONS[conf[key]])
    return ctx


class WebConfig:
    """A web-config file, read again when it changes; what a server asks of it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().resolve()
        self._lock = threading.Lock()
        self._stamp = self._mtime()
        self._settings = read_settings(self.path)  # a bad file fails the start, in one line
        self._checked_at = time.monotonic()
        self._ok: dict[tuple[str, bytes], bytes] = {}  # (user, sha256 of a password) -> the hash it matched

    def _mtime(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def settings(self) -> WebSettings:
        """The current settings (the file read again when it changed; a file broken since
        keeps the last good settings, and says so once)."""
        with self._lock:
            now = time.monotonic()
            if now - self._checked_at >= RELOAD_EVERY_S:
                self._checked_at = now
                stamp = self._mtime()
                if stamp != self._stamp:
                    self._stamp = stamp
                    try:
                        self._settings = read_settings(self.path)
                        self._ok.clear()
                    except ConfigError as e:
                        import logging

                        logging.getLogger("profstream.web").warning("%s; the previous settings stay", e)
            return self._settings

    @property
    def tls(self) -> bool:
        return self.settings().tls is not None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def wrap(self, sock: socket.socket) -> socket.socket:
        """``sock`` as the server side of a TLS connection, handshake done (on the calling
        thread, a worker's, never the accept loop's), when the config has TLS."""
        ctx = self.settings().tls
        if ctx is None:
            return sock
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        return ctx.wrap_socket(sock, server_side=True)

    def authorized(self, header: str | bytes | None) -> bool:
        """Whether an ``Authorization`` header value lets a request in: always when the
        config has no users, else a Basic user:password of basic_auth_users."""
        users = self.settings().users
        if not users:
            return True
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        if not header or not header[:6].lower() == "basic ":
            return False
        try:
            user, _, password = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        hashed = users.get(user)
        if hashed is None:
            return False
        key = (user, hashlib.sha256(password.encode()).digest())
        with self._lock:
            if self._ok.get(key) == hashed:
                return True
        import bcrypt

        try:
            good = bcrypt.checkpw(password.encode(), hashed)
        except ValueError:
            return False
        if good:
            with self._lock:
                self._ok[key] = hashed
        return good


def bearer_ok(header: str | bytes | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (compared in constant
    time)."""
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    if not header or not header[:7].lower() == "bearer ":
        return False
    return hmac.compare_digest(header[7:].strip().encode(), token.encode())


def read_token(path: str | Path) -> str:
    """The bearer token of a file (stripped); ConfigError when unreadable or empty."""
    path = Path(path).expanduser()
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read the token file {path} ({e.strerror or e}): give an existing file") from None
    if not token:
        raise ConfigError(f"the token file {path} is empty: put the bearer token Alertmanager sends in it")
    return token
