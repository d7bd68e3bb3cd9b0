"""One connection setting for every Kafka client (profstream/kafka/connection.py): the
properties file and its overrides through the option chain, each library's dialect from
the one table, secrets from files and variables that never show in a message."""

from __future__ import annotations

import pytest

from profstream.config import MONITOR_OPTIONS, ConfigError, resolve
from profstream.kafka.connection import Connection, parse_properties

SECRET = "s3cret-Pa55-zq9"


def _write(path, text: str):
    path.write_text(text)
    return path


@pytest.fixture
def pem(tmp_path):
    """Stand-ins for the PEM files (the table checks they are readable files)."""
    files = {}
    for name in ("ca.pem", "client.pem", "client.key"):
        files[name] = _write(tmp_path / name, "-----BEGIN CERTIFICATE-----\n")
    return files


def _conn(tmp_path, text: str, overrides=None, environ=None, bootstrap=None) -> Connection:
    props = _write(tmp_path / "client.properties", text)
    args = {"kafka_config": str(props), "kafka_properties": overrides, "bootstrap": bootstrap}
    options = resolve(MONITOR_OPTIONS, args, environ=environ or {})
    return Connection.from_options(options, bootstrap_given=bootstrap is not None)


def test_one_mapping_reaches_both_libraries_in_their_own_dialect(tmp_path, pem):
    conn = _conn(tmp_path, f"""\
# a Java tool's --command-config file
bootstrap.servers=kafka-1:9093,kafka-2:9093
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.username=trainer
sasl.password={SECRET}
ssl.ca.location={pem['ca.pem']}
""")
    assert conn.bootstrap == "kafka-1:9093,kafka-2:9093"  # the file's, as no --bootstrap was given
    native = conn.librdkafka()
    assert native == {"bootstrap.servers": "kafka-1:9093,kafka-2:9093", "security.protocol": "SASL_SSL",
                      "sasl.mechanisms": "SCRAM-SHA-512", "sasl.username": "trainer", "sasl.password": SECRET,
                      "ssl.ca.location": str(pem["ca.pem"]), "ssl.endpoint.identification.algorithm": "https"}
    python = conn.kafka_python()
    assert python == {"bootstrap_servers": ["kafka-1:9093", "kafka-2:9093"], "security_protocol": "SASL_SSL",
                      "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "trainer",
                      "sasl_plain_password": SECRET, "ssl_cafile": str(pem["ca.pem"]), "ssl_check_hostname": True}
    assert conn.principal() == "trainer"


def test_overrides_win_over_the_file_and_the_bootstrap_option_over_both(tmp_path):
    conn = _conn(tmp_path, "bootstrap.servers=a:1\nsecurity.protocol=SASL_PLAINTEXT\nsasl.mechanism=PLAIN\n"
                           "sasl.username=alice\nsasl.password=x\n",
                 overrides=["sasl.username=bob", f"sasl.password={SECRET}"], bootstrap="b:2")
    assert (conn.bootstrap, conn.get("sasl.username"), conn.get("sasl.password")) == ("b:2", "bob", SECRET)


def test_the_environment_gives_the_file_and_overrides(tmp_path, monkeypatch):
    props = _write(tmp_path / "c.properties", "security.protocol=SASL_PLAINTEXT\nsasl.username=u\n")
    environ = {"PROFSTREAM_KAFKA_CONFIG": str(props), "PROFSTREAM_KAFKA_PROPERTIES": f"sasl.password={SECRET}",
               "PROFSTREAM_BOOTSTRAP": "h:9"}
    options = resolve(MONITOR_OPTIONS, {}, environ=environ)
    conn = Connection.from_options(options)
    assert (conn.bootstrap, conn.mechanism, conn.get("sasl.password")) == ("h:9", "PLAIN", SECRET)
    json_environ = {"PROFSTREAM_OPTIONS": '{"kafka_properties": {"security.protocol": "SSL"}}'}
    assert Connection.from_options(resolve(MONITOR_OPTIONS, {}, environ=json_environ)).protocol == "SSL"


def test_secrets_come_from_a_variable_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KAFKA_PW", SECRET)
    secret_file = _write(tmp_path / "pw", SECRET + "\n")
    store = _write(tmp_path / "secrets.properties", f"trainer.password={SECRET}\n")
    base = "security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-256\nsasl.username=t\n"
    for ref in ("${env:KAFKA_PW}", f"${{file:{secret_file}}}", f"${{file:{store}:trainer.password}}"):
        assert _conn(tmp_path, base + f"sasl.password={ref}\n").get("sasl.password") == SECRET
    with pytest.raises(ConfigError, match=r"\$\{env:NOPE\}, which is not set: export NOPE"):
        _conn(tmp_path, base + "sasl.password=${env:NOPE}\n")
    with pytest.raises(ConfigError, match="no such key"):
        _conn(tmp_path, base + f"sasl.password=${{file:{store}:other}}\n")


def test_a_java_jaas_config_and_pem_stores_are_read(tmp_path, pem):
    conn = _conn(tmp_path, f"""\
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="alice" \\
    password="{SECRET}";
ssl.truststore.type=PEM
ssl.truststore.location={pem['ca.pem']}
""")
    assert (conn.get("sasl.username"), conn.get("sasl.password"), conn.get("ssl.ca.location")) == (
        "alice", SECRET, str(pem["ca.pem"]))
    with pytest.raises(ConfigError, match="ssl.truststore.type=JKS: profstream's clients read PEM files; convert"):
        _conn(tmp_path, "security.protocol=SSL\nssl.truststore.type=JKS\n")


@pytest.mark.parametrize("text, message", [
    ("security.protocl=SSL\n", "unknown Kafka client property 'security.protocl' .*did you mean 'security.protocol'"),
    ("security.protocol=TLS\n", "security.protocol=TLS: expected one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL"),
    ("security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-512\nsasl.username=u\n", "needs sasl.password"),
    ("sasl.username=u\n", "sasl.* properties are given but security.protocol=PLAINTEXT"),
    ("security.protocol=SSL\nssl.ca.location=/nonexistent/ca.pem\n", "no readable file there"),
])
def test_bad_properties_are_one_line_errors_that_say_what_to_do(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message) as e:
        _conn(tmp_path, text)
    assert "\n" not in str(e.value)


def test_a_secret_never_shows_in_a_message(tmp_path, pem):
    conn = _conn(tmp_path, f"security.protocol=SASL_SSL\nsasl.mechanism=PLAIN\nsasl.username=u\n"
                           f"sasl.password={SECRET}\nssl.ca.location={pem['ca.pem']}\n"
                           f"ssl.certificate.location={pem['client.pem']}\nssl.key.location={pem['client.key']}\n"
                           f"ssl.key.password={SECRET}x\n", bootstrap="h:1")
    for text in (str(conn), repr(conn), conn.describe(), conn.redact(f"failed with {SECRET}x and {SECRET}")):
        assert SECRET not in text
    assert conn.describe() == "h:1 (SASL_SSL, PLAIN as u, client certificate)"
    # a bad override holding a secret: the error names the option, not the value
    with pytest.raises(ConfigError) as e:
        resolve(MONITOR_OPTIONS, {"kafka_properties": f"{SECRET}-without-equals"})
    assert SECRET not in str(e.value) and "kafka-properties" in str(e.value)


def test_a_plain_address_is_a_plaintext_connection():
    conn = Connection.of("127.0.0.1:9092")
    assert (conn.protocol, conn.secured, conn.principal(), conn.describe()) == (
        "PLAINTEXT", False, "ANONYMOUS", "127.0.0.1:9092")
    assert Connection.of(conn) is conn
    assert parse_properties('{"a": 1, "b": true}') == {"a": "1", "b": "true"}


def test_oidc_client_credentials_give_kafka_python_its_token(tmp_path):
    """OAUTHBEARER with sasl.oauthbearer.method=oidc: librdkafka gets the properties, and
    kafka-python a token provider of profstream's that asks the token endpoint (client
    credentials, HTTP basic auth of the client) and reuses the token until near its expiry."""
    import base64
    import json
    import threading
    import urllib.parse
    from http.server import BaseHTTPRequestHandler, HTTPServer

    asked = []

    class Endpoint(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = urllib.parse.parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
            asked.append((self.headers["Authorization"], body))
            data = json.dumps({"access_token": "tok-1", "expires_in": 3600}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        conn = _conn(tmp_path, f"""\
security.protocol=SASL_PLAINTEXT
sasl.mechanism=OAUTHBEARER
sasl.oauthbearer.method=oidc
sasl.oauthbearer.client.id=job-17
sasl.oauthbearer.client.secret={SECRET}
sasl.oauthbearer.token.endpoint.url=http://127.0.0.1:{server.server_port}/token
sasl.oauthbearer.scope=kafka
""", bootstrap="h:1")
        assert conn.librdkafka()["sasl.oauthbearer.client.secret"] == SECRET
        provider = conn.kafka_python()["sasl_oauth_token_provider"]
        assert provider.token() == "tok-1" and provider.token() == "tok-1"
        assert len(asked) == 1  # reused
        auth, body = asked[0]
        assert auth == "Basic " + base64.b64encode(f"job-17:{SECRET}".encode()).decode()
        assert body == {"grant_type": ["client_credentials"], "scope": ["kafka"]}
        assert conn.principal() == "job-17" and SECRET not in repr(conn)
    finally:
        server.shutdown()
