"""Alertmanager's webhook receiver: its notifications in, capture requests out.

Alertmanager POSTs its documented JSON (``version`` "4": ``status``, ``receiver``,
``groupLabels``, ``commonLabels``, ``alerts`` with ``status``, ``labels``, ``annotations``,
``startsAt``, ``endsAt``, ``fingerprint``...). Each alert whose labels carry ``alertname``
and ``run`` (and ``rank`` where the rule has it) is handed to ``on_alert``; the answer
lists what each became. A body that is not such JSON gets 400 and a one-line reason
(Alertmanager logs it and does not retry); ``GET /healthz`` answers 200.

Every POST must carry ``Authorization: Bearer <token>`` (Alertmanager's
``http_config.authorization``): without it, or with another token, 401 and nothing is
created. With a web config (``web_config.WebConfig``) the receiver speaks TLS; it binds
loopback unless told otherwise.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from profstream.schema.names import is_valid_name
from profstream.web_config import WebConfig, bearer_ok

log = logging.getLogger("profstream.webhook")

MAX_BODY_BYTES = 4 * 1024 * 1024
PATHS = ("/", "/alerts")


class WebhookError(ValueError):
    """A body that is not an Alertmanager notification; the message says what is wrong."""


def alerts_of(payload: object) -> list[tuple[str, str, int | None, str]]:
    """(alertname, run, rank or None, status) of each alert of a notification that names
    a run; alerts without a run label are left out."""
    if not isinstance(payload, dict) or not isinstance(payload.get("alerts"), list):
        raise WebhookError("expected Alertmanager's webhook JSON: an object with an 'alerts' list")
    out = []
    for i, alert in enumerate(payload["alerts"]):
        if not isinstance(alert, dict) or not isinstance(alert.get("labels"), dict):
            raise WebhookError(f"alerts[{i}] has no 'labels' object")
        labels = alert["labels"]
        status = alert.get("status", payload.get("status"))
        if status not in ("firing", "resolved"):
            raise WebhookError(f"alerts[{i}].status {status!r}: expected firing or resolved")
        name, run = labels.get("alertname"), labels.get("run")
        if not isinstance(name, str) or not is_valid_name(run):
            continue  # not a run's alert (a pipeline alert): nothing to capture
        rank = labels.get("rank")
        try:
            rank = int(rank) if rank is not None else None
        except (TypeError, ValueError):
            raise WebhookError(f"alerts[{i}] label rank={rank!r}: expected an integer") from None
        out.append((name, run, rank if rank is None or rank >= 0 else None, status))
    return out


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:
        log.debug("webhook: " + format, *args)


def serve_webhook(addr: str, port: int, on_alert: Callable[[str, str, int | None, str], object], token: str,
                  web: WebConfig | None = None) -> WSGIServer:
    """Serve the receiver on http(s)://addr:port/alerts from a daemon thread; ``on_alert``
    returns an outcome whose ``line()`` is reported back; a request without ``Bearer
    <token>`` gets 401. Raises OSError when the port cannot be bound; ``server.shutdown()``
    stops it."""
    if not token:
        raise ValueError("the webhook needs a bearer token")

    refused = [0, -1e18]  # POSTs refused for their token, when the last was said

    def reply(start_response: Callable, status: str, body: dict) -> list[bytes]:
        data = (json.dumps(body) + "\n").encode()
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        path, method = environ.get("PATH_INFO", "/"), environ.get("REQUEST_METHOD", "GET")
        if path == "/healthz" and method == "GET":
            return reply(start_response, "200 OK", {"status": "ok"})
        if path not in PATHS:
            return reply(start_response, "404 Not Found", {"error": f"POST Alertmanager notifications to /alerts, "
                                                                    f"not {path}"})
        if method != "POST":
            return reply(start_response, "405 Method Not Allowed", {"error": "POST Alertmanager notifications"})
        if not bearer_ok(environ.get("HTTP_AUTHORIZATION"), token):
            try:  # read what was sent (bounded): closing on an unread body resets the answer away
                environ["wsgi.input"].read(min(int(environ.get("CONTENT_LENGTH") or 0), MAX_BODY_BYTES))
            except (ValueError, OSError):
                pass
            refused[0] += 1
            if time.monotonic() - refused[1] >= 60.0:  # one line a minute at most, whoever knocks
                refused[1] = time.monotonic()
                log.warning("webhook: a POST from %s without the bearer token was refused (401; %d so far)",
                            environ.get("REMOTE_ADDR", "?"), refused[0])
            start_response("401 Unauthorized", [("Content-Type", "application/json"),
                                                ("WWW-Authenticate", 'Bearer realm="profstream webhook"')])
            return [b'{"error": "send Authorization: Bearer <token> (Alertmanager: http_config.authorization)"}\n']
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = -1
        if not 0 < length <= MAX_BODY_BYTES:
            return reply(start_response, "400 Bad Request", {"error": f"a JSON body of 1 to {MAX_BODY_BYTES} bytes "
                                                                      "with its Content-Length"})
        try:
            payload = json.loads(environ["wsgi.input"].read(length))
            alerts = alerts_of(payload)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return reply(start_response, "400 Bad Request", {"error": f"the body is not JSON ({e})"})
        except WebhookError as e:
            return reply(start_response, "400 Bad Request", {"error": str(e)})
        outcomes = [on_alert(*alert) for alert in alerts]
        return reply(start_response, "200 OK", {"outcomes": [o.line() for o in outcomes]})

    class Server(WSGIServer):
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        daemon_threads = True

    from socketserver import ThreadingMixIn

    class ThreadingServer(ThreadingMixIn, Server):
        def finish_request(self, request, client_address) -> None:
            if web is not None:  # the TLS handshake on the request's thread, not the accept loop's
                request = web.wrap(request)
            super().finish_request(request, client_address)

    server = make_server(addr, port, app, ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="profstream-webhook", daemon=True).start()
    return server
