"""`profstream grafana push` and the Grafana annotation sink against a local HTTP double.

No Grafana server can run on the development machines, so ``GrafanaDouble`` is a real HTTP
server on loopback that answers the endpoints profstream uses the way Grafana's HTTP API
documents them (/api/folders, /api/dashboards/db, /api/annotations) and records every
request. It refuses anything that strays from the documented bodies (unknown or null
fields, wrong types) and lists what it refused in ``violations``, so the tests hold the
client to the API, not to itself.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
from collections import namedtuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from profstream.schema.codec import encode
from profstream.sinks.grafana import Grafana, GrafanaAnnotationSink
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "glsa_t0k3n-never-printed"
MS = 1_000_000


class GrafanaDouble:
    """A loopback HTTP server that answers like Grafana's HTTP API and records requests."""

    def __init__(self, token: str = TOKEN, port: int = 0, sub_path: str = "") -> None:
        self.token = token
        self.sub_path = sub_path  # Grafana served under a path, as behind a reverse proxy
        self.refuse = False  # answer 401 to every request, as Grafana does to a revoked token
        self.requests: list[dict] = []
        self.violations: list[str] = []
        self.annotations: list[dict] = []
        self.folders: dict[str, dict] = {}
        self.dashboards: dict[str, dict] = {}  # uid -> the body of the last POST /api/dashboards/db
        self.versions: dict[str, int] = {}
        self._lock = threading.Lock()
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep the test output clean
                pass

            def do_GET(self) -> None:
                double._serve(self, "GET")

            def do_POST(self) -> None:
                double._serve(self, "POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{sub_path}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> GrafanaDouble:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def refused(self) -> int:
        with self._lock:
            return sum(1 for r in self.requests if r["status"] == 401)

    def annotation_bodies(self) -> list[dict]:
        with self._lock:
            return [dict(a["body"]) for a in self.annotations]

    # -- the endpoints ----------------------------------------------------------------------

    def _serve(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(h.path.removeprefix(self.sub_path) if h.path.startswith(self.sub_path + "/") else "/-")
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        with self._lock:
            record = {"method": method, "path": url.path, "query": parse_qs(url.query),
                      "auth": h.headers.get("Authorization"), "content_type": h.headers.get("Content-Type")}
            self.requests.append(record)
            if self.refuse or record["auth"] != f"Bearer {self.token}":
                status, answer = 401, {"message": "invalid API key"}
            else:
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                    self.violations.append(f"{method} {url.path}: body is not JSON")
                status, answer = self._route(method, url.path, record["query"], body, record)
            record["status"] = status
        data = json.dumps(answer).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _bad(self, what: str) -> tuple[int, dict]:
        self.violations.append(what)
        return 400, {"message": what}

    def _route(self, method, path, query, body, record) -> tuple[int, dict | list]:
        if method == "POST" and (record["content_type"] or "").split(";")[0].strip() != "application/json":
            return self._bad(f"POST {path} without Content-Type application/json")
        if method == "GET" and path.startswith("/api/folders/"):
            uid = path.rsplit("/", 1)[1]
            if uid in self.folders:
                return 200, self.folders[uid]
            return 404, {"message": "folder not found", "status": "not-found"}
        if method == "POST" and path == "/api/folders":
            return self._create_folder(body)
        if method == "POST" and path == "/api/dashboards/db":
            return self._save_dashboard(body)
        if method == "POST" and path == "/api/annotations":
            return self._add_annotation(body)
        if method == "GET" and path == "/api/annotations":
            return 200, self._find_annotations(query)
        self.violations.append(f"{method} {path}: not an endpoint profstream should call")
        return 404, {"message": "not found"}

    def _create_folder(self, body) -> tuple[int, dict]:
        # POST /api/folders {uid?, title, parentUid?}
        if not isinstance(body, dict) or not isinstance(body.get("title"), str) or not body["title"]:
            return self._bad("POST /api/folders: title (string) is required")
        if set(body) - {"uid", "title", "parentUid"}:
            return self._bad(f"POST /api/folders: unknown fields {sorted(set(body) - {'uid', 'title', 'parentUid'})}")
        uid = body.get("uid") or f"f{len(self.folders) + 1}"
        if uid in self.folders:
            return 409, {"message": "a folder with the same uid already exists"}
        self.folders[uid] = {"id": len(self.folders) + 1, "uid": uid, "title": body["title"]}
        return 200, self.folders[uid]

    def _save_dashboard(self, body) -> tuple[int, dict]:
        # POST /api/dashboards/db {dashboard, folderUid?, message?, overwrite?}
        allowed = {"dashboard", "folderUid", "folderId", "message", "overwrite"}
        if not isinstance(body, dict) or not isinstance(body.get("dashboard"), dict):
            return self._bad("POST /api/dashboards/db: dashboard (object) is required")
        if set(body) - allowed:
            return self._bad(f"POST /api/dashboards/db: unknown fields {sorted(set(body) - allowed)}")
        d = body["dashboard"]
        if not d.get("title") or not isinstance(d.get("uid"), str):
            return self._bad("POST /api/dashboards/db: dashboard.title and dashboard.uid are required")
        if d.get("id") is not None:
            return self._bad("POST /api/dashboards/db: dashboard.id must be null to create or replace by uid")
        folder = body.get("folderUid")
        if folder is not None and folder not in self.folders:
            return 400, {"message": "folder not found", "status": "folder-not-found"}
        if not isinstance(body.get("overwrite", False), bool):
            return self._bad("POST /api/dashboards/db: overwrite must be a boolean")
        if d["uid"] in self.dashboards and not body.get("overwrite"):
            return 412, {"message": "A dashboard with the same uid already exists", "status": "name-exists"}
        self.dashboards[d["uid"]] = body
        self.versions[d["uid"]] = self.versions.get(d["uid"], 0) + 1
        slug = re.sub(r"[^a-z0-9]+", "-", d["title"].lower()).strip("-")
        return 200, {"id": list(self.dashboards).index(d["uid"]) + 1, "uid": d["uid"], "slug": slug,
                     "status": "success", "url": f"{self.sub_path}/d/{d['uid']}/{slug}",
                     "version": self.versions[d["uid"]]}

    def _add_annotation(self, body) -> tuple[int, dict]:
        # POST /api/annotations {dashboardUID?, panelId?, time, timeEnd?, tags, text}
        allowed = {"dashboardUID", "dashboardId", "panelId", "time", "timeEnd", "tags", "text", "data"}
        if not isinstance(body, dict):
            return self._bad("POST /api/annotations: body must be an object")
        problems = [f"unknown field {k}" for k in body if k not in allowed]
        problems += [f"{k} is null" for k, v in body.items() if v is None]
        if not isinstance(body.get("time"), int) or body["time"] <= 0:
            problems.append("time must be epoch milliseconds")
        if "timeEnd" in body and (not isinstance(body["timeEnd"], int) or body["timeEnd"] < body.get("time", 0)):
            problems.append("timeEnd must be epoch milliseconds >= time")
        if not isinstance(body.get("tags"), list) or not all(isinstance(t, str) and t for t in body["tags"]):
            problems.append("tags must be a list of strings")
        if not isinstance(body.get("text"), str) or not body["text"]:
            problems.append("text is required")
        if problems:
            return self._bad("POST /api/annotations: " + "; ".join(problems))
        self.annotations.append({"id": len(self.annotations) + 1, "body": body})
        return 200, {"message": "Annotation added", "id": len(self.annotations)}

    def _find_annotations(self, query) -> list[dict]:
        # GET /api/annotations?tags=a&tags=b&type=annotation&limit=n: all tags must match
        tags = set(query.get("tags", []))
        limit = int(query.get("limit", ["100"])[0])
        found = [{"id": a["id"], "time": a["body"]["time"], "timeEnd": a["body"].get("timeEnd", a["body"]["time"]),
                  "tags": a["body"]["tags"], "text": a["body"]["text"]}
                 for a in self.annotations if tags <= set(a["body"]["tags"])]
        return found[:limit]


# -- records as the processors write them ----------------------------------------------------

Record = namedtuple("Record", "topic partition offset value")


def step_metrics(run_id: str, rank: int, step: int, start_ms: int, step_ms: int = 100) -> dict:
    start, end = start_ms * MS, (start_ms + step_ms) * MS
    return {"run_id": run_id, "rank": rank, "world_size": 2, "host": "h0", "device": "cuda:0", "step": step,
            "start_ns": start, "end_ns": end, "step_time_ns": end - start, "data_wait_ns": 0, "fp_bp_ns": end - start,
            "tail_ns": 0, "compute_ns": 0, "comm_ns": 0, "overlap_ns": 0, "pure_comm_ns": 0, "idle_ns": 0,
            "utilization": 0.0, "overlap_ratio": 0.0, "op_count": 0, "op_types": [], "memory": None, "queues": [],
            "starved": False, "rolling": None, "closed_by": "watermark", "late_events": 0, "closed_ns": end}


def alert(run_id: str, rank: int, step: int, state: str, ts_ms: int) -> dict:
    return {"name": "DataQueueStall", "state": state, "run_id": run_id, "rank": rank, "step": step,
            "ts_ns": ts_ms * MS, "summary": f"run {run_id} rank {rank}: data queue {state}",
            "evidence": {"starved_steps_total": 5.0}}


class Feed:
    """Records with growing offsets per topic partition, as SinkLoop hands them to a sink."""

    def __init__(self) -> None:
        self.offsets: dict[tuple[str, int], int] = {}

    def __call__(self, topic: str, name: str, record: dict | bytes, partition: int = 0) -> Record:
        value = record if isinstance(record, bytes) else encode(name, record)
        offset = self.offsets.get((topic, partition), 0)
        self.offsets[(topic, partition)] = offset + 1
        return Record(topic, partition, offset, value)


def run_records(feed: Feed, run_id: str, t0_ms: int, steps: int = 10, rank: int = 0) -> list[Record]:
    """Steps 0.. of one rank (on partition ``rank``), 100 ms each from ``t0_ms``."""
    return [feed("p.steps", "StepMetrics", step_metrics(run_id, rank, step, t0_ms + 100 * step), rank)
            for step in range(steps)]


def free_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sinks():
    """Make annotation sinks that are closed at the end of the test."""
    made: list[GrafanaAnnotationSink] = []

    def make(url: str, token: str | None = TOKEN, **kw) -> GrafanaAnnotationSink:
        kw.setdefault("backoff_s", (0.05, 0.2))
        kw.setdefault("close_timeout_s", 0.5)
        sink = GrafanaAnnotationSink(Grafana(url, token, timeout=2.0), **kw)
        made.append(sink)
        return sink

    yield make
    for sink in made:
        sink.close()


def grafana_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "profstream.sink.grafana" and r.levelno >= logging.WARNING]


# -- push -----------------------------------------------------------------------------------

def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profstream.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, **(env or {})})


def test_push_puts_every_generated_dashboard_in_the_profstream_folder_and_replaces_it_next_time():
    files = {json.loads(p.read_text())["uid"]: json.loads(p.read_text()) for p in (ROOT / "dashboards").glob("*.json")}
    assert len(files) == 3
    with GrafanaDouble() as grafana:
        first = _cli("grafana", "push", "--url", grafana.url, env={"PROFSTREAM_GRAFANA_TOKEN": TOKEN})
        second = _cli("grafana", "push", "--url", grafana.url, "--token", TOKEN)
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    assert grafana.violations == []
    assert grafana.folders == {"profstream": {"id": 1, "uid": "profstream", "title": "profstream"}}
    assert set(grafana.dashboards) == set(files)
    for uid, body in grafana.dashboards.items():
        assert body["folderUid"] == "profstream" and body["overwrite"] is True
        assert body["dashboard"] == {**files[uid], "id": None}  # uploaded as generated
    assert grafana.versions == {uid: 2 for uid in files}  # the second push replaced them
    for title in ("profstream / Training run", "profstream / Cluster", "profstream / Pipeline health"):
        assert title in first.stdout
    assert f"{grafana.url}/d/profstream-training-run/" in first.stdout
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in grafana.requests)
    for out in (first, second):
        assert TOKEN not in out.stdout + out.stderr


def test_push_with_a_refused_token_fails_in_one_line_that_does_not_show_the_token():
    with GrafanaDouble(token="the-right-token") as grafana:
        result = _cli("grafana", "push", "--url", grafana.url, "--token", TOKEN)
    assert result.returncode == 2
    assert "refused the credentials (401 Unauthorized)" in result.stderr
    assert "PROFSTREAM_GRAFANA_TOKEN" in result.stderr
    assert TOKEN not in result.stdout + result.stderr
    assert grafana.dashboards == {}


def test_push_to_a_closed_port_says_grafana_cannot_be_reached_without_printing_url_credentials():
    port = free_port()
    result = _cli("grafana", "push", env={"PROFSTREAM_GRAFANA_URL": f"http://admin:s3cr3t-pw@127.0.0.1:{port}"})
    assert result.returncode == 2
    assert f"cannot reach Grafana at http://127.0.0.1:{port}" in result.stderr
    assert "s3cr3t-pw" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_push_reaches_a_grafana_served_under_a_sub_path():
    with GrafanaDouble(sub_path="/tools/grafana") as grafana:
        result = _cli("grafana", "push", "--url", grafana.url, "--token", TOKEN)  # no trailing slash
    assert result.returncode == 0, result.stderr
    assert grafana.violations == [] and len(grafana.dashboards) == 3
    assert f"{grafana.url}/d/profstream-cluster/" in result.stdout


def test_push_uses_basic_auth_from_the_url_when_no_token_is_given():
    import base64

    with GrafanaDouble(token="unused") as grafana:
        result = _cli("grafana", "push", "--url", grafana.url.replace("http://", "http://admin:pw@"))
    assert result.returncode == 2  # the double only takes the token, so it refuses basic auth...
    expected = "Basic " + base64.b64encode(b"admin:pw").decode()
    assert grafana.requests and all(r["auth"] == expected for r in grafana.requests)  # ...which was sent


# -- annotations ----------------------------------------------------------------------------

def test_runs_and_alerts_become_annotations_with_grafanas_documented_bodies(sinks, caplog):
    feed = Feed()
    t0 = 1_700_000_000_000
    with GrafanaDouble() as grafana:
        sink = sinks(grafana.url, run_idle_s=0.5)
        # ranks are on different partitions, read in any order: the run starts with the earliest step
        sink.handle(run_records(feed, "r1", t0 + 7, rank=1))
        sink.handle(run_records(feed, "r1", t0, rank=0))
        sink.handle([feed("p.alerts", "Alert", alert("r1", 0, 5, "firing", t0 + 600)),
                     feed("p.alerts", "Alert", alert("r1", 0, 9, "resolved", t0 + 1000)),
                     feed("p.alerts", "Alert", b"not avro")])
        bodies = wait_until(lambda: (lambda b: b if len(b) >= 4 else None)(grafana.annotation_bodies()), 10,
                            "run start, alert firing and resolved, and run end")
    assert grafana.violations == []
    kinds = {b["tags"][2] if b["tags"][1] == "run" else b["tags"][3]: b for b in bodies}
    assert len(bodies) == 4 and set(kinds) == {"start", "firing", "resolved", "end"}
    assert kinds["start"] == {"time": t0, "tags": ["profstream", "run", "start", "run:r1"], "text": "run r1 started"}
    firing = kinds["firing"]
    assert firing["time"] == t0 + 600 and "timeEnd" not in firing
    assert firing["tags"] == ["profstream", "alert", "DataQueueStall", "firing", "run:r1", "rank:0"]
    assert firing["text"].startswith("DataQueueStall firing at step 5: run r1 rank 0")
    resolved = kinds["resolved"]
    assert (resolved["time"], resolved["timeEnd"]) == (t0 + 600, t0 + 1000)  # a region: firing to resolved
    assert kinds["end"]["time"] == t0 + 1007  # the end of the last step
    assert kinds["end"]["text"].startswith("run r1 ended: steps 0-9 on 2 ranks")
    assert sink.undecodable == 1 and sink.posted == 4
    for name in ("training-run.json", "cluster.json"):  # every one shows on the per-run dashboards
        dashboard = json.loads((ROOT / "dashboards" / name).read_text())
        queries = [{t.replace("$run", "r1") for t in a["target"]["tags"]} for a in dashboard["annotations"]["list"]]
        assert all(any(q <= set(b["tags"]) for q in queries) for b in bodies), name
    assert sink.durable_offsets() == {("p.steps", 0): 10, ("p.steps", 1): 10, ("p.alerts", 0): 3}
    assert grafana_warnings(caplog) == ["skipping undecodable records on p.alerts (first: not_avro: no Avro "
                                        "single-object marker C3 01)"]


def test_a_finished_capture_is_a_region_tagged_with_its_alert_and_linking_its_timeline(sinks):
    from profstream.control.records import new_request, new_status

    feed = Feed()
    t0 = 1_700_000_000_000
    request = new_request("r1", steps=3, reason="RankStraggler firing on rank 3 (Alertmanager)")
    statuses = [new_status(request, "armed", 3),
                new_status(request, "finished", 3, first_step=40, last_step=42, ops=900,
                           window_start_ns=(t0 + 10) * MS, window_end_ns=(t0 + 310) * MS),
                new_status(request, "refused", 0, reason="busy: capture already running")]
    with GrafanaDouble() as grafana:
        sink = sinks(grafana.url, timeline_url="http://files:8080/timeline/")
        sink.handle([feed("p.control", "CaptureRequest", request)]
                    + [feed("p.control", "CaptureStatus", s) for s in statuses])
        (body,) = wait_until(grafana.annotation_bodies, 10, "the capture's annotation")
    assert grafana.violations == []
    assert (body["time"], body["timeEnd"]) == (t0 + 10, t0 + 310)
    assert body["tags"] == ["profstream", "capture", "run:r1", "rank:3", "RankStraggler"]
    assert body["text"].startswith("ops captured on rank 3, steps 40-42 (900 ops) for RankStraggler firing")
    assert '<a href="http://files:8080/timeline/r1/rank-3/steps-40-42.json.gz">timeline</a>' in body["text"]
    dashboard = json.loads((ROOT / "dashboards" / "training-run.json").read_text())
    queries = [{t.replace("$run", "r1") for t in a["target"]["tags"]} for a in dashboard["annotations"]["list"]]
    assert any(q <= set(body["tags"]) for q in queries)  # it shows on the run's dashboard


def test_an_alerts_region_links_the_timeline_of_the_capture_it_asked_for(sinks):
    from profstream.control.records import new_request, new_status

    feed = Feed()
    t0 = 1_700_000_000_000
    straggler = {**alert("r1", 3, 40, "firing", t0), "name": "RankStraggler"}
    other = {**alert("r1", 5, 40, "firing", t0), "name": "DataQueueStall"}  # asked for no capture
    request = new_request("r1", steps=3, reason="RankStraggler firing on rank 3 (autocapture)")
    finished = new_status(request, "finished", 3, first_step=41, last_step=43, ops=900,
                          window_start_ns=(t0 + 10) * MS, window_end_ns=(t0 + 310) * MS)
    with GrafanaDouble() as grafana:
        sink = sinks(grafana.url, timeline_url="http://files:8080/timeline")
        sink.handle([feed("p.alerts", "Alert", straggler), feed("p.alerts", "Alert", other),
                     feed("p.control", "CaptureRequest", request), feed("p.control", "CaptureStatus", finished),
                     feed("p.alerts", "Alert", {**straggler, "state": "resolved", "ts_ns": (t0 + 900) * MS}),
                     feed("p.alerts", "Alert", {**other, "state": "resolved", "ts_ns": (t0 + 900) * MS})])
        bodies = wait_until(lambda: (lambda b: b if len(b) >= 5 else None)(grafana.annotation_bodies()), 10,
                            "two alerts firing and resolved, one capture")
    assert grafana.violations == []
    resolved = {b["tags"][2]: b for b in bodies if "resolved" in b["tags"]}
    link = '<a href="http://files:8080/timeline/r1/rank-3/steps-41-43.json.gz">timeline</a>'
    assert resolved["RankStraggler"]["text"].endswith(f"; captured: {link}")
    assert (resolved["RankStraggler"]["time"], resolved["RankStraggler"]["timeEnd"]) == (t0, t0 + 900)
    assert "captured" not in resolved["DataQueueStall"]["text"]


def test_a_hang_s_annotation_names_the_command_that_prints_the_stacks_autocapture_asked_for(sinks):
    feed = Feed()
    t0 = 1_700_000_000_000
    hang = {**alert("r1", 0, 40, "firing", t0), "name": "TrainingHang", "rank": None,
            "summary": "run r1: ranks 0, 2 in step 40 for 65 s (past 60 s); rank 1 in step 39 for 66 s"}
    with GrafanaDouble() as grafana:
        sink = sinks(grafana.url, timeline_url="http://files:8080/timeline")
        sink.handle([feed("p.alerts", "Alert", hang)])
        (body,) = wait_until(grafana.annotation_bodies, 10, "the hang's annotation")
    assert body["text"].startswith("TrainingHang firing at step 40: run r1: ranks 0, 2 in step 40")
    assert body["text"].endswith("; every rank's stacks: profstream stacks --run r1 --latest "
                                 '(<a href="http://files:8080/timeline/r1/stacks.json.gz">stacks timeline</a>)')


def test_a_refused_token_warns_once_keeps_consuming_and_posts_everything_once_accepted(sinks, caplog):
    feed = Feed()
    t0 = 1_700_000_000_000
    with GrafanaDouble() as grafana:
        grafana.refuse = True
        sink = sinks(grafana.url)
        firing = [feed("p.alerts", "Alert", alert(f"r{i}", 0, 24, "firing", t0 + i)) for i in range(5)]
        for rec in firing:
            sink.handle([rec])
        # every record was taken in while Grafana refused each attempt: consuming never waited on it
        assert grafana.annotation_bodies() == []
        wait_until(lambda: grafana.refused() >= 4, 10, "the sink to retry")
        assert sink.durable_offsets() == {("p.alerts", 0): 0}  # nothing posted, nothing committed
        more = [feed("p.alerts", "Alert", alert(f"r{i}", 0, 39, "resolved", t0 + 100 + i)) for i in range(5)]
        sink.handle(more)
        grafana.refuse = False  # the token is accepted again
        bodies = wait_until(lambda: (lambda b: b if len(b) >= 10 else None)(grafana.annotation_bodies()), 10,
                            "the ten kept annotations")
        wait_until(lambda: sink.durable_offsets() == {("p.alerts", 0): 10}, 5, "the offsets to advance")
    assert grafana.violations == []
    assert [b["time"] for b in bodies] == [t0 + i for i in range(5)] * 2  # in order, each exactly once
    assert [b.get("timeEnd") for b in bodies[5:]] == [t0 + 100 + i for i in range(5)]
    warnings = grafana_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "refused the credentials (401 Unauthorized)" in warnings[0]
    assert TOKEN not in "\n".join(r.getMessage() for r in caplog.records)


def test_a_closed_port_warns_once_keeps_up_to_max_pending_and_delivers_when_grafana_comes_up(sinks, caplog):
    feed = Feed()
    t0 = 1_700_000_000_000
    port = free_port()
    sink = sinks(f"http://127.0.0.1:{port}", max_pending=3)
    records = [feed("p.alerts", "Alert", alert("r1", rank, 24, "firing", t0 + rank)) for rank in range(5)]
    sink.handle(records)
    wait_until(lambda: sink.failed_attempts >= 4, 10, "the sink to retry the closed port")
    assert sink.dropped == 2 and sink.pending == 3  # the two oldest made room
    assert sink.durable_offsets() == {("p.alerts", 0): 2}  # the dropped ones are given up, the kept are not
    with GrafanaDouble(port=port) as grafana:  # Grafana comes up on that port
        bodies = wait_until(lambda: (lambda b: b if len(b) >= 3 else None)(grafana.annotation_bodies()), 10,
                            "the kept annotations")
        wait_until(lambda: sink.durable_offsets() == {("p.alerts", 0): 5}, 5, "the offsets to advance")
    assert [b["time"] for b in bodies] == [t0 + 2, t0 + 3, t0 + 4]
    assert grafana.violations == []
    warnings = grafana_warnings(caplog)
    assert len(warnings) == 2, warnings  # one for the outage, one for the first drop
    assert sum(f"cannot reach Grafana at http://127.0.0.1:{port}" in w for w in warnings) == 1
    assert sum("dropping the oldest" in w for w in warnings) == 1


def test_a_restarted_sink_does_not_post_a_run_start_twice(sinks):
    feed = Feed()
    t0 = 1_700_000_000_000
    with GrafanaDouble() as grafana:
        first = sinks(grafana.url, run_idle_s=600)
        first.handle(run_records(feed, "r1", t0, steps=3))
        wait_until(lambda: first.posted == 1, 10, "the run start")
        first.close()
        again = sinks(grafana.url, run_idle_s=600)  # a restart goes on with the later steps of the run
        again.handle([feed("p.steps", "StepMetrics", step_metrics("r1", 0, 3, t0 + 300))])
        wait_until(lambda: again.skipped == 1, 10, "the second sink to look the run start up")
        assert again.posted == 0
    starts = [b for b in grafana.annotation_bodies() if "start" in b["tags"]]
    assert len(starts) == 1 and starts[0]["time"] == t0
    lookups = [r for r in grafana.requests if r["method"] == "GET" and r["path"] == "/api/annotations"]
    assert lookups[-1]["query"]["tags"] == ["profstream", "run", "start", "run:r1"]


def test_a_run_that_goes_silent_and_comes_back_is_marked_ended_then_resumed(sinks):
    feed = Feed()
    t0 = 1_700_000_000_000
    with GrafanaDouble() as grafana:
        sink = sinks(grafana.url, run_idle_s=0.3)
        sink.handle(run_records(feed, "r1", t0, steps=2) + run_records(feed, "r1", t0, steps=2, rank=1))
        wait_until(lambda: sink.posted == 2, 10, "start and end")
        sink.handle([feed("p.steps", "StepMetrics", step_metrics("r1", 0, 2, t0 + 5000))])
        wait_until(lambda: sink.posted == 4, 10, "resumed and ended again")
    kinds = [(b["tags"][2], b["time"]) for b in grafana.annotation_bodies()]
    assert kinds == [("start", t0), ("end", t0 + 200), ("resumed", t0 + 5000), ("end", t0 + 5100)]


# -- with the real broker and processor ---------------------------------------------------------

def test_profstream_sink_grafana_annotates_a_stalled_simulated_run_end_to_end(kafka_bootstrap, topics, tmp_path):
    from profstream.simulate import SimConfig, run_simulation
    from tests.test_processor import RunningProcessor

    cfg = SimConfig(run_id="annotated", ranks=2, steps=50, ops_per_step=40, stall=(20, 34), seed=5)
    log_path = tmp_path / "sink.log"
    with GrafanaDouble() as grafana, open(log_path, "w") as log:
        sink = subprocess.Popen(
            [sys.executable, "-m", "profstream.cli", "sink", "grafana", "--bootstrap", kafka_bootstrap,
             "--topic-prefix", topics.prefix, "--group-id", f"grafana-{topics.prefix}", "--run-idle-s", "2"],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PROFSTREAM_GRAFANA_URL": grafana.url, "PROFSTREAM_GRAFANA_TOKEN": TOKEN,
                 "PYTHONUNBUFFERED": "1"})
        try:
            wait_until(lambda: "annotating Grafana" in log_path.read_text() or sink.poll() is not None, 60,
                       "the sink to start")
            assert sink.poll() is None, log_path.read_text()
            with RunningProcessor(kafka_bootstrap, topics):
                run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
                bodies = wait_until(lambda: (lambda b: b if any("end" in x["tags"] for x in b) else None)(
                    grafana.annotation_bodies()), 90, "the run's end annotation")
        finally:
            sink.terminate()  # SIGTERM, as `docker compose stop` sends
            code = sink.wait(30)
    output = log_path.read_text()
    assert code == 0, output
    assert TOKEN not in output and f"annotating Grafana at {grafana.url} from {topics.steps}" in output
    assert grafana.violations == []
    assert all("run:annotated" in b["tags"] for b in bodies)
    alerts = sorted((b["tags"][-1], b["tags"][3], b["text"].split(" at step ")[1].split(":")[0])
                    for b in bodies if "alert" in b["tags"])
    assert alerts == [("rank:0", "firing", "24"), ("rank:0", "resolved", "39"),
                      ("rank:1", "firing", "24"), ("rank:1", "resolved", "39")]
    for rank in (0, 1):
        fired = next(b for b in bodies if f"rank:{rank}" in b["tags"] and "firing" in b["tags"])
        resolved = next(b for b in bodies if f"rank:{rank}" in b["tags"] and "resolved" in b["tags"])
        assert resolved["time"] == fired["time"] < resolved["timeEnd"]
    runs = [b for b in bodies if "run" in b["tags"][1:2]]
    assert [b["tags"][2] for b in runs] == ["start", "end"]
    assert runs[0]["time"] < runs[1]["time"]
    assert runs[1]["text"].startswith("run annotated ended: steps 0-49 on 2 ranks")
