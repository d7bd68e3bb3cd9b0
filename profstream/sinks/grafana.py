"""Grafana: upload the dashboards and annotate runs and alerts, through grafana-client.

``Grafana.push_dashboard`` uploads a generated dashboard (dashboards/*.json) into a folder
(``POST /api/folders``, ``POST /api/dashboards/db``). ``GrafanaAnnotationSink`` turns the
processed topics into annotations (``POST /api/annotations``), tagged ``profstream`` and
``run:<run id>`` so the dashboards can show them:

- run start: the first StepMetrics of a run, posted once per run (Grafana is asked first,
  so a restarted sink does not post it again);
- run end: a run that sent no StepMetrics for ``run_idle_s``; a run that sends steps
  again afterwards gets a "resumed" annotation;
- alerts: firing as a point, resolved as a region from firing to resolution that links
  the timeline of a capture the alert asked for (autocapture) when one finished meanwhile;
- op captures (the control topic, docs/capture.md): a region over the captured steps of
  each rank that finished one, tagged ``capture``, ``run:``, ``rank:`` and the alert that
  asked for it, linking the captured window's timeline file.

A worker thread posts; ``handle`` only queues. When Grafana is unreachable or refuses the
credentials the sink logs one warning per outage, keeps up to ``max_pending`` annotations
(the oldest are dropped beyond that, and counted), retries with exponential backoff and
keeps consuming. Offsets are durable only up to the first record whose annotation is not
yet posted, so after a crash those records are read again (annotations are at least once).
"""

from __future__ import annotations

import html
import json
import logging
import re
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

import niquests
from grafana_client import GrafanaApi
from grafana_client.client import GrafanaException

from profstream.config import ConfigError, Option, resolve
from profstream.processors.hangs import HANG_ALERT
from profstream.schema.codec import DecodeError, decode_any

log = logging.getLogger("profstream.sink.grafana")

GRAFANA_OPTIONS: tuple[Option, ...] = (
    Option("grafana_url", "str", "http://localhost:3000",
           "Grafana base URL (http://user:password@host:3000 means basic auth)"),
    Option("grafana_token", "str", None, "Grafana service-account token, sent as a Bearer token; never printed",
           optional=True),
)
TAG = "profstream"
FOLDER_UID = "profstream"
FOLDER_TITLE = "profstream"
# Statuses that no retry can fix: the annotation itself is wrong.
_REJECTED = (400, 413, 422)
_TRANSPORT_ERRORS = (GrafanaException, niquests.exceptions.RequestException)


class GrafanaError(Exception):
    """A Grafana call that failed; the message is one line without credentials."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def rejected(self) -> bool:
        """Grafana understood the request and refused its content: retrying cannot help."""
        return self.status in _REJECTED

    @property
    def kind(self) -> str:
        if self.status in (401, 403):
            return "refused"
        return "unreachable" if self.status is None else f"http {self.status}"


def redact_url(url: str) -> str:
    """``url`` as shown to users: without user, password, query and trailing slash."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


class Grafana:
    """The Grafana HTTP API endpoints profstream uses (grafana-client underneath)."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 5.0) -> None:
        parts = urlsplit(url)
        self.display_url = redact_url(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"Grafana URL {self.display_url!r}: expected http(s)://host[:port][/path] "
                              "(--url or PROFSTREAM_GRAFANA_URL)")
        self._secrets = [s for s in (token, parts.password) if s]
        if parts.path and not parts.path.endswith("/"):  # grafana-client appends "api" to the path as is
            url = urlunsplit(parts._replace(path=parts.path + "/"))
        self.api = GrafanaApi.from_url(url, credential=token or None, timeout=timeout)

    @classmethod
    def from_options(cls, url: str | None = None, token: str | None = None,
                     environ: Mapping[str, str] | None = None, timeout: float = 5.0) -> Grafana:
        """From --url/--token, else PROFSTREAM_GRAFANA_URL/_TOKEN (or PROFSTREAM_OPTIONS), else defaults."""
        opts = resolve(GRAFANA_OPTIONS, {"grafana_url": url, "grafana_token": token}, environ)
        return cls(opts["grafana_url"], opts["grafana_token"], timeout)

    def link(self, path: str) -> str:
        """A browser link to ``path`` as Grafana returns it (e.g. the ``url`` of a saved dashboard)."""
        return urljoin(self.display_url + "/", path)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _TRANSPORT_ERRORS as e:
            raise GrafanaError(self._describe(e), getattr(e, "status_code", None) or None) from e

    def _describe(self, e: Exception) -> str:
        status = getattr(e, "status_code", None) or None
        where = f"Grafana at {self.display_url}"
        if status in (401, 403):
            text = (f"{where} refused the credentials ({status} {'Unauthorized' if status == 401 else 'Forbidden'}): "
                    "check --token / PROFSTREAM_GRAFANA_TOKEN (a service-account token with Editor rights)")
        elif status is not None:
            text = f"{where} answered {status} ({getattr(e, 'message', e)})"
        else:
            text = (f"cannot reach {where} ({type(e).__name__}): check --url / PROFSTREAM_GRAFANA_URL "
                    "and that Grafana is up")
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return " ".join(text.split())

    # -- dashboards -----------------------------------------------------------------------

    def ensure_folder(self, uid: str = FOLDER_UID, title: str = FOLDER_TITLE) -> None:
        try:
            self._call(self.api.folder.get_folder, uid)
        except GrafanaError as e:
            if e.status != 404:
                raise
            self._call(self.api.folder.create_folder, title, uid=uid)

    def push_dashboard(self, dashboard: dict, folder_uid: str = FOLDER_UID,
                       message: str = "profstream grafana push") -> dict:
        """Create or replace ``dashboard`` (by uid) in folder ``folder_uid``; Grafana's answer."""
        body = {"dashboard": {**dashboard, "id": None}, "folderUid": folder_uid, "overwrite": True,
                "message": message}
        return self._call(self.api.dashboard.update_dashboard, body)

    # -- annotations ----------------------------------------------------------------------
    # grafana-client's add_annotation sends null panelId/timeEnd; these post the documented body.

    def post_annotation(self, body: dict) -> int | None:
        answer = self._call(self.api.client.POST, "/annotations", json=body)
        return answer.get("id") if isinstance(answer, dict) else None

    def find_annotations(self, tags: Sequence[str], limit: int = 1) -> list:
        params = [("tags", t) for t in tags] + [("type", "annotation"), ("limit", str(limit))]
        answer = self._call(self.api.client.GET, "/annotations", params=params)
        return answer if isinstance(answer, list) else []


def default_dashboards_dir() -> Path:
    """dashboards/ in the current directory, else the one of the checkout profstream runs from."""
    for candidate in (Path.cwd() / "dashboards", Path(__file__).resolve().parents[2] / "dashboards"):
        if any(candidate.glob("*.json")):
            return candidate
    return Path("dashboards")


def load_dashboards(directory: Path) -> list[dict]:
    """The dashboards (``*.json``) of ``directory``, sorted by file name."""
    files = sorted(Path(directory).glob("*.json"))
    if not files:
        raise ConfigError(f"no dashboards (*.json) in {directory}: pass --dir with profstream's dashboards/ "
                          "directory (make dashboards writes them)")
    out = []
    for path in files:
        try:
            dashboard = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read dashboard {path}: {e}") from None
        if not isinstance(dashboard, dict) or not dashboard.get("uid") or not dashboard.get("title"):
            raise ConfigError(f"{path} is not a Grafana dashboard (no uid or title)")
        out.append(dashboard)
    return out


# -- annotation sink ------------------------------------------------------------------------

TopicPartition = tuple[str, int]


@dataclass
class Annotation:
    """One annotation to post (times in ms since the epoch)."""

    time_ms: int
    tags: list[str]
    text: str
    time_end_ms: int | None = None
    unique: bool = False  # post only when Grafana holds no annotation with these tags
    source: tuple[TopicPartition, int] | None = None  # the record it comes from

    def body(self) -> dict:
        body: dict[str, Any] = {"time": self.time_ms, "tags": list(self.tags), "text": self.text}
        if self.time_end_ms is not None:
            body["timeEnd"] = self.time_end_ms
        return body


@dataclass
class _Run:
    first_step: int
    last_step: int
    end_ns: int
    last_seen: float
    ranks: set[int] = field(default_factory=set)
    start: Annotation | None = None  # until posted: moved earlier when an earlier step arrives


def _ms(ns: int) -> int:
    return ns // 1_000_000


def _bounded_put(d: OrderedDict, key: Any, value: Any, limit: int) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > limit:
        d.popitem(last=False)


class GrafanaAnnotationSink:
    """A sink (see runner.py) of StepMetrics and Alert records that annotates Grafana."""

    def __init__(self, grafana: Grafana, run_idle_s: float = 60.0, max_pending: int = 10_000,
                 backoff_s: tuple[float, float] = (0.5, 30.0), close_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, timeline_url: str = "") -> None:
        self.grafana = grafana
        self.timeline_url = timeline_url.rstrip("/")  # where the timeline sink's --out is served, if anywhere
        self._request_reasons: OrderedDict[str, str] = OrderedDict()
        # (run, rank, alert) -> link to the timeline of a capture that alert asked for
        self._captured: OrderedDict[tuple, str] = OrderedDict()
        self.run_idle_s = run_idle_s
        self.max_pending = max_pending
        self.backoff_min, self.backoff_max = backoff_s
        self.close_timeout_s = close_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._queue: deque[Annotation] = deque()
        self._handled: dict[TopicPartition, int] = {}
        self._pending: dict[TopicPartition, deque[int]] = {}  # offsets whose annotation is not posted
        self._finished: dict[TopicPartition, Counter] = {}  # of those, finished out of order
        self._runs: dict[str, _Run] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._firing: OrderedDict[tuple, int] = OrderedDict()
        self._warned_decode: set[str] = set()
        self._outage: str | None = None  # kind of the current outage
        self._outage_since = 0.0
        self._dropped_before_outage = 0
        self._drop_warned = False  # until the queue is empty again
        self.posted = 0
        self.skipped = 0  # unique annotations Grafana already had
        self.rejected = 0
        self.dropped = 0
        self.failed_attempts = 0
        self.undecodable = 0
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._deadline = float("inf")
        self._worker = threading.Thread(target=self._work, name="grafana-annotations", daemon=True)
        self._worker.start()

    # -- consume side (SinkLoop's thread) ---------------------------------------------------

    def handle(self, records: Sequence[Any]) -> None:
        queued = False
        for rec in records:
            tp = (rec.topic, rec.partition)
            try:
                name, value = decode_any(rec.value)
            except DecodeError as e:
                self.undecodable += 1
                if e.reason not in self._warned_decode:
                    self._warned_decode.add(e.reason)
                    log.warning("skipping undecodable records on %s (first: %s)", rec.topic, e)
                name, value = None, None
            with self._lock:
                annotation = None
                if name == "StepMetrics":
                    annotation = self._step(value)
                elif name == "Alert":
                    annotation = self._alert(value)
                elif name == "CaptureRequest":
                    _bounded_put(self._request_reasons, value["request_id"], value["reason"], 10_000)
                elif name == "CaptureStatus":
                    annotation = self._capture(value)
                if annotation is not None:
                    annotation.source = (tp, rec.offset)
                    self._pending.setdefault(tp, deque()).append(rec.offset)
                    self._enqueue(annotation)
                    queued = True
                self._handled[tp] = rec.offset + 1
        if queued:
            self._wake.set()

    def _step(self, m: dict) -> Annotation | None:
        run_id, now = m["run_id"], self._clock()
        run = self._runs.get(run_id)
        if run is not None:
            run.last_seen = now
            run.ranks.add(m["rank"])
            run.first_step = min(run.first_step, m["step"])
            run.last_step = max(run.last_step, m["step"])
            run.end_ns = max(run.end_ns, m["end_ns"])
            if run.start is not None and _ms(m["start_ns"]) < run.start.time_ms:
                run.start.time_ms = _ms(m["start_ns"])
            return None
        resumed = run_id in self._ended
        if resumed:
            del self._ended[run_id]
        run = _Run(m["step"], m["step"], m["end_ns"], now, {m["rank"]})
        self._runs[run_id] = run
        if resumed:
            return Annotation(_ms(m["start_ns"]), [TAG, "run", "resumed", f"run:{run_id}"],
                              f"run {run_id} resumed at step {m['step']}")
        run.start = Annotation(_ms(m["start_ns"]), [TAG, "run", "start", f"run:{run_id}"],
                               f"run {run_id} started", unique=True)
        return run.start

    def _alert(self, a: dict) -> Annotation:
        run_id, rank, name, state = a["run_id"], a["rank"], a["name"], a["state"]
        tags = [TAG, "alert", name, state, f"run:{run_id}"] + ([f"rank:{rank}"] if rank is not None else [])
        evidence = ", ".join(f"{k}={v:g}" for k, v in sorted(a["evidence"].items()))
        text = f"{name} {state} at step {a['step']}: {a['summary']}" + (f" ({evidence})" if evidence else "")
        ts_ms, key = _ms(a["ts_ns"]), (run_id, rank, name)
        if state == "firing" and name == HANG_ALERT:  # autocapture asks every rank for its stacks on it
            text += f"; every rank's stacks: profstream stacks --run {run_id} --latest"
            if self.timeline_url:
                text += (f' (<a href="{html.escape(self.timeline_url)}/{html.escape(run_id)}/stacks.json.gz">stacks '
                         'timeline</a>)')
        if state == "firing":
            _bounded_put(self._firing, key, ts_ms, 10_000)
            return Annotation(ts_ms, tags, text)
        captured = self._captured.get(key) or self._captured.get((run_id, None, name))
        if captured:  # the alert's region links the detail captured because of it
            text += f"; captured: {captured}"
        since = self._firing.pop(key, None)
        if since is None or since > ts_ms:
            return Annotation(ts_ms, tags, text)
        return Annotation(since, tags, text, time_end_ms=ts_ms)

    def _capture(self, st: dict) -> Annotation | None:
        """A finished capture of one rank: a region over its steps, linking its timeline."""
        if st["state"] != "finished" or st["rank"] is None or st["window_start_ns"] is None:
            return None
        run_id, rank, first, last = st["run_id"], st["rank"], st["first_step"], st["last_step"]
        reason = self._request_reasons.get(st["request_id"], "")
        asked_by = re.match(r"(\w+) firing\b", reason)  # autocapture's reasons: "<alert> firing on rank ..."
        alert = asked_by.group(1) if asked_by else None
        path = f"{run_id}/rank-{rank}/steps-{first}-{last}.json.gz"
        link = (f'<a href="{html.escape(self.timeline_url)}/{html.escape(path)}">timeline</a>' if self.timeline_url
                else f"timeline: {html.escape(path)} under the timeline sink's --out")
        if alert:
            _bounded_put(self._captured, (run_id, rank, alert), link, 10_000)
            _bounded_put(self._captured, (run_id, None, alert), link, 10_000)
        text = (f"ops captured on rank {rank}, steps {first}-{last} ({st['ops']} ops)"
                + (f" for {html.escape(reason)}" if reason else "") + f"; {link}"
                + (f" ({html.escape(st['reason'])})" if st["reason"] else ""))
        tags = [TAG, "capture", f"run:{run_id}", f"rank:{rank}"] + ([alert] if alert else [])
        end = st["window_end_ns"] if st["window_end_ns"] is not None else st["ts_ns"]
        return Annotation(_ms(st["window_start_ns"]), tags, text, time_end_ms=_ms(end))

    def _enqueue(self, annotation: Annotation) -> None:
        if len(self._queue) >= self.max_pending:
            oldest = self._queue.popleft()
            self._finish(oldest)
            self.dropped += 1
            if not self._drop_warned:
                self._drop_warned = True
                log.warning("more than %d Grafana annotations waiting: dropping the oldest until Grafana answers",
                            self.max_pending)
        self._queue.append(annotation)

    def _finish(self, annotation: Annotation) -> None:
        if annotation.source is not None:
            tp, offset = annotation.source
            self._finished.setdefault(tp, Counter())[offset] += 1
        if annotation.unique:
            for run in self._runs.values():
                if run.start is annotation:
                    run.start = None

    def durable_offsets(self) -> dict[TopicPartition, int]:
        """Per partition: the offset of the first record whose annotation is not yet posted."""
        with self._lock:
            out = {}
            for tp, handled in self._handled.items():
                pending, finished = self._pending.get(tp), self._finished.get(tp)
                while pending and finished and finished[pending[0]] > 0:
                    offset = pending.popleft()
                    finished[offset] -= 1
                    if not finished[offset]:
                        del finished[offset]
                out[tp] = pending[0] if pending else handled
            return out

    @property
    def pending(self) -> int:
        """Annotations waiting to be posted."""
        with self._lock:
            return len(self._queue)

    def close(self) -> None:
        """Post what is queued (for up to close_timeout_s), then stop the worker."""
        self._deadline = self._clock() + self.close_timeout_s
        self._closing.set()
        self._wake.set()
        self._worker.join(self.close_timeout_s + 10.0)
        left = self.pending
        if left:
            log.warning("%d Grafana annotations not posted at exit; their records are read again on the next start",
                        left)

    # -- worker ------------------------------------------------------------------------------

    def _work(self) -> None:
        backoff = self.backoff_min
        next_idle_check = self._clock()
        while True:
            now = self._clock()
            if now >= next_idle_check:
                self._end_idle_runs(now)
                next_idle_check = now + max(0.05, min(1.0, self.run_idle_s / 4))
            self._wake.clear()
            with self._lock:
                item = self._queue.popleft() if self._queue else None
                body = item.body() if item is not None else None
                if item is None:
                    self._drop_warned = False
            if item is None:
                if self._closing.is_set():
                    return
                self._wake.wait(max(0.0, next_idle_check - self._clock()))
                continue
            try:
                if item.unique and self.grafana.find_annotations(item.tags):
                    outcome = "skipped"
                else:
                    self.grafana.post_annotation(body)
                    outcome = "posted"
            except GrafanaError as e:
                if e.rejected:
                    self.rejected += 1
                    (log.warning if self.rejected == 1 else log.debug)("Grafana rejected an annotation: %s", e)
                    outcome = "rejected"
                else:
                    self.failed_attempts += 1
                    with self._lock:
                        self._queue.appendleft(item)
                    self._outage_began(e)
                    if not self._sleep(backoff):
                        return
                    backoff = min(backoff * 2, self.backoff_max)
                    continue
            with self._lock:
                self._finish(item)
            if outcome == "posted":
                self.posted += 1
            elif outcome == "skipped":
                self.skipped += 1
            if self._outage is not None and outcome != "rejected":
                self._outage_ended()
            backoff = self.backoff_min

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` (less when closing); False when the close deadline has passed."""
        if self._closing.is_set():
            remaining = self._deadline - self._clock()
            if remaining <= 0:
                return False
            seconds = min(seconds, remaining)
            time.sleep(seconds)
            return True
        self._closing.wait(seconds)
        return True

    def _outage_began(self, e: GrafanaError) -> None:
        if self._outage == e.kind:
            return
        if self._outage is None:
            self._outage_since = self._clock()
            self._dropped_before_outage = self.dropped
        self._outage = e.kind
        log.warning("%s; annotations are kept (up to %d) and retried with backoff up to %g s",
                    e, self.max_pending, self.backoff_max)

    def _outage_ended(self) -> None:
        log.info("Grafana at %s answers again after %.0f s (%d annotations dropped meanwhile)",
                 self.grafana.display_url, self._clock() - self._outage_since,
                 self.dropped - self._dropped_before_outage)
        self._outage = None

    def _end_idle_runs(self, now: float) -> None:
        with self._lock:
            idle = [run_id for run_id, run in self._runs.items() if now - run.last_seen >= self.run_idle_s]
            for run_id in idle:
                run = self._runs.pop(run_id)
                _bounded_put(self._ended, run_id, None, 10_000)
                self._enqueue(Annotation(
                    _ms(run.end_ns), [TAG, "run", "end", f"run:{run_id}"],
                    f"run {run_id} ended: steps {run.first_step}-{run.last_step} on {len(run.ranks)} "
                    f"rank{'s' if len(run.ranks) != 1 else ''} (no step for {self.run_idle_s:g} s)"))
        if idle:
            self._wake.set()
