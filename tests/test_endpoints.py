"""The HTTP endpoints behind locked doors: /metrics of the exporter and the processors with
TLS and basic auth from a web config (Prometheus's exporters' format), scraped by a real
Prometheus; Alertmanager's webhook with a bearer token, on loopback unless told."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest
from typer.testing import CliRunner

from profstream.cli import app
from profstream.config import ConfigError
from profstream.control.webhook import serve_webhook
from profstream.metrics_server import serve_metrics
from profstream.processors.health import ProcessorHealth
from profstream.stack.secure import issue_certificate, make_ca
from profstream.web_config import WebConfig
from tests.helpers import wait_until

PASSWORD = "scrape-Pa55"
TOKEN = "webhook-t0ken-9f"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA and a server certificate for 127.0.0.1/localhost."""
    d = tmp_path_factory.mktemp("pki")
    make_ca(d)
    issue_certificate(d, "server", server=True)
    return d


def _web(tmp_path: Path, pki: Path, tls: bool = True, users: bool = True, extra: str = "") -> Path:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    text = ""
    if tls:
        text += f"tls_server_config:\n  cert_file: {pki / 'server.pem'}\n  key_file: {pki / 'server.key'}\n"
    if users:
        text += f"basic_auth_users:\n  prometheus: '{hashed}'\n"
    path = tmp_path / "web.yml"
    path.write_text(text + extra)
    return path


def _get(url: str, pki: Path, user: str | None = None, password: str | None = None):
    request = urllib.request.Request(url)
    if user is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    context = ssl.create_default_context(cafile=str(pki / "ca.pem")) if url.startswith("https") else None
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_over_tls_with_basic_auth(tmp_path, pki):
    server = serve_metrics("127.0.0.1", 0, lambda: b"profstream_up 1\n", "test", web=WebConfig(_web(tmp_path, pki)))
    try:
        url = f"https://127.0.0.1:{server.server_port}/metrics"
        assert _get(url, pki, "prometheus", PASSWORD) == (200, "profstream_up 1\n")
        assert _get(url, pki)[0] == 401  # no credentials
        assert _get(url, pki, "prometheus", "wrong")[0] == 401
        assert _get(url, pki, "someone", PASSWORD)[0] == 401
        with pytest.raises(OSError):  # plain HTTP to a TLS port gets no answer
            urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5).read()
    finally:
        server.shutdown()
        server.server_close()


def test_clients_stuck_in_or_after_the_tls_handshake_do_not_delay_a_scrape(tmp_path, pki):
    # the handshake runs on the server's one I/O thread, without blocking (metrics_server.py):
    # clients that connect and say nothing, or send half a TLS hello, hold only their sockets
    server = serve_metrics("127.0.0.1", 0, lambda: b"profstream_up 1\n", "test", web=WebConfig(_web(tmp_path, pki)))
    held = []
    try:
        for i in range(32):
            s = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
            if i % 2:
                s.sendall(b"\x16\x03\x01\x02\x00\x01")  # the start of a ClientHello, and nothing more
            held.append(s)
        url = f"https://127.0.0.1:{server.server_port}/metrics"
        for _ in range(3):
            started = time.monotonic()
            assert _get(url, pki, "prometheus", PASSWORD) == (200, "profstream_up 1\n")
            assert time.monotonic() - started < 2.0
    finally:
        for s in held:
            s.close()
        server.shutdown()
        server.server_close()


def test_the_processor_health_endpoint_takes_an_address_and_a_web_config(tmp_path, pki):
    health = ProcessorHealth()
    health.serve(0, "127.0.0.1", WebConfig(_web(tmp_path, pki, tls=False)))
    try:
        assert health.server.server_address[0] == "127.0.0.1"
        url = f"http://127.0.0.1:{health.server.server_port}/metrics"
        assert _get(url, pki)[0] == 401
        status, body = _get(url, pki, "prometheus", PASSWORD)
        assert status == 200 and "profstream_events_total" in body
    finally:
        health.server.shutdown()
        health.server.server_close()


@pytest.mark.parametrize("extra, said", [
    ("nonsense: 1\n", "unknown key 'nonsense'; known keys: tls_server_config, basic_auth_users"),
    ("", None),
])
def test_a_bad_web_config_is_one_line_that_names_the_key(tmp_path, pki, extra, said):
    path = _web(tmp_path, pki, extra=extra)
    if said is None:
        WebConfig(path)
        return
    with pytest.raises(ConfigError, match=said) as e:
        WebConfig(path)
    assert "\n" not in str(e.value)


def test_a_web_config_with_a_clear_password_or_no_key_file_is_refused(tmp_path, pki):
    path = tmp_path / "web.yml"
    path.write_text("basic_auth_users:\n  prometheus: hunter2\n")
    with pytest.raises(ConfigError, match=r"basic_auth_users\['prometheus'\]: expected a bcrypt hash") as e:
        WebConfig(path)
    assert "hunter2" not in str(e.value)
    path.write_text(f"tls_server_config:\n  cert_file: {pki / 'server.pem'}\n")
    with pytest.raises(ConfigError, match="tls_server_config needs key_file"):
        WebConfig(path)


def test_a_rotated_password_takes_effect_without_a_restart(tmp_path, pki):
    path = _web(tmp_path, pki, tls=False)
    server = serve_metrics("127.0.0.1", 0, lambda: b"x 1\n", "test", web=WebConfig(path))
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert _get(url, pki, "prometheus", PASSWORD)[0] == 200
        new = bcrypt.hashpw(b"rotated", bcrypt.gensalt(rounds=4)).decode()
        path.write_text(f"basic_auth_users:\n  prometheus: '{new}'\n")
        wait_until(lambda: _get(url, pki, "prometheus", "rotated")[0] == 200, 10, "the new password to be read")
        assert _get(url, pki, "prometheus", PASSWORD)[0] == 401
    finally:
        server.shutdown()
        server.server_close()


def test_a_real_prometheus_scrapes_over_tls_with_basic_auth(tmp_path, pki):
    from tests.test_prometheus_real import Prometheus

    server = serve_metrics("127.0.0.1", 0, lambda: b"# TYPE profstream_secured gauge\nprofstream_secured 42\n",
                           "test", web=WebConfig(_web(tmp_path, pki)))
    (tmp_path / "password").write_text(PASSWORD)
    (tmp_path / "wrong").write_text("not it")

    def job(name: str, password_file: str) -> dict:
        return {"job_name": name, "scheme": "https", "tls_config": {"ca_file": str(pki / "ca.pem")},
                "basic_auth": {"username": "prometheus", "password_file": str(tmp_path / password_file)},
                "static_configs": [{"targets": [f"127.0.0.1:{server.server_port}"]}]}

    prom = Prometheus(tmp_path, {}, [job("secured", "password"), job("wrong-password", "wrong")])
    try:
        wait_until(prom.ready, 60, "prometheus to be ready")
        wait_until(lambda: prom.query('profstream_secured{job="secured"}'), 60, "the secured target's figures")
        assert list(prom.query('profstream_secured{job="secured"}').values()) == [42.0]
        targets = {t["labels"]["job"]: t for t in prom.api("targets")["activeTargets"]}
        wait_until(lambda: {t["labels"]["job"]: t for t in prom.api("targets")["activeTargets"]}[
            "wrong-password"]["health"] == "down", 30, "the wrong password's scrape to fail")
        targets = {t["labels"]["job"]: t for t in prom.api("targets")["activeTargets"]}
        assert targets["secured"]["health"] == "up"
        assert "401" in targets["wrong-password"]["lastError"]
    finally:
        prom.stop()
        server.shutdown()
        server.server_close()


def _post(url: str, token: str | None, pki: Path, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cafile=str(pki / "ca.pem")) if url.startswith("https") else None
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


NOTIFICATION = {"version": "4", "status": "firing", "alerts": [
    {"status": "firing", "labels": {"alertname": "RankStraggler", "run": "r1", "rank": "3"}}]}


class _Outcome:
    def line(self) -> str:
        return "requested"


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_the_webhook_takes_only_posts_with_its_bearer_token(tmp_path, pki, tls):
    asked = []
    web = WebConfig(_web(tmp_path, pki, users=False)) if tls else None
    server = serve_webhook("127.0.0.1", 0, lambda *alert: asked.append(alert) or _Outcome(), TOKEN, web)
    try:
        url = f"{'https' if tls else 'http'}://127.0.0.1:{server.server_port}/alerts"
        for token in (None, "wrong", TOKEN[:-1]):
            status, answer = _post(url, token, pki, NOTIFICATION)
            assert status == 401 and "Bearer" in answer["error"]
        assert asked == []  # nothing was created
        assert _post(url, TOKEN, pki, NOTIFICATION) == (200, {"outcomes": ["requested"]})
        assert asked == [("RankStraggler", "r1", 3, "firing")]
    finally:
        server.shutdown()
        server.server_close()


def test_the_webhook_needs_a_token_and_listens_on_loopback_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("PROFSTREAM_WEBHOOK_TOKEN", raising=False)
    for argv in (["webhook"], ["autocapture", "--webhook-port", "9466"]):
        result = CliRunner().invoke(app, [*argv, "--bootstrap", "127.0.0.1:1"])
        assert result.exit_code == 2 and "the webhook needs a bearer token: give --token-file FILE" in result.output
    for command in ("webhook", "autocapture"):
        shown = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert "[default: 127.0.0.1]" in shown.output, shown.output
    shown = CliRunner().invoke(app, ["process", "--help"], env={"COLUMNS": "200"})
    assert "--metrics-addr" in shown.output and "--web-config" in shown.output
