"""What `profstream demo` leaves behind: the sinks run in-process next to the demo's processor.

``DemoOutputs`` starts the Prometheus exporter, the archive sink and the timeline sink on
threads (each in a consumer group of its own, so they never take records from a real
deployment's sinks), serves the processor's health metrics, and starts a Prometheus with
the project's configuration when a ``prometheus`` binary is installed. ``finish()``
waits until the sinks have everything of the run, closes the files and writes the
post-mortem report from the archive.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from profstream.kafka.connection import Connection
from profstream.kafka.topics import Topics, ensure_topics
from profstream.offline.report import gather, write_report
from profstream.processors.health import ProcessorHealth
from profstream.sinks.archive import ArchiveProgress, run_archive
from profstream.sinks.prometheus import ExporterError, PrometheusExporter
from profstream.sinks.runner import SinkLoop
from profstream.sinks.timeline import TimelineSink

log = logging.getLogger("profstream.demo")

EXPORTER_PORT, HEALTH_PORT, PROMETHEUS_PORT = 9464, 9465, 9090
DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"  # in a checkout


def _port(preferred: int) -> int:
    """``preferred`` if it is free on loopback, else any free port."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


@dataclass
class DemoPaths:
    out: Path
    archive: Path
    timeline: Path
    report: Path | None = None
    exporter_url: str = ""
    health_url: str = ""
    prometheus_url: str | None = None
    notes: list[str] = field(default_factory=list)


class DemoOutputs:
    def __init__(self, conn: Connection | str, topics: Topics, out_dir: Path, health: ProcessorHealth) -> None:
        self.conn, self.topics = conn, topics
        out_dir = Path(out_dir)
        self.paths = DemoPaths(out_dir, out_dir / "archive", out_dir / "timeline")
        self._health = health
        self._stop_archive = threading.Event()
        self._stop_timeline = threading.Event()
        self._threads: list[threading.Thread] = []
        self._archive_lag: tuple[float, int] = (0.0, -1)  # (when seen, messages behind)
        self._timeline_loop: SinkLoop | None = None
        self._exporter: PrometheusExporter | None = None
        self._prometheus: subprocess.Popen | None = None

    # -- start --------------------------------------------------------------------------

    def start(self) -> DemoPaths:
        ensure_topics(self.conn, self.topics)
        self.paths.out.mkdir(parents=True, exist_ok=True)
        health_port = _port(HEALTH_PORT)
        self._health.serve(health_port, addr="127.0.0.1")
        self.paths.health_url = f"http://127.0.0.1:{health_port}/metrics"
        self._exporter = PrometheusExporter(self.conn, self.topics, port=_port(EXPORTER_PORT), addr="127.0.0.1",
                                            group_id="profstream-demo-exporter")
        try:
            self.paths.exporter_url = self._exporter.serve()
        except ExporterError as e:
            self.paths.notes.append(f"no Prometheus exporter: {e}")
            self._exporter = None
        else:
            self._thread(self._exporter.run, "demo-exporter")
        self._thread(lambda: run_archive(self.conn, [self.topics.raw, self.topics.steps], self.paths.archive,
                                         self._stop_archive, group_id="profstream-demo-archive", max_age_s=1.0,
                                         progress=self._archive_progress), "demo-archive")
        self._timeline_loop = SinkLoop(self.conn, [self.topics.raw], "profstream-demo-timeline",
                                       TimelineSink(self.paths.timeline))
        self._thread(lambda: self._timeline_loop.run(self._stop_timeline), "demo-timeline")
        self._start_prometheus(health_port)
        return self.paths

    def _thread(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _archive_progress(self, p: ArchiveProgress) -> None:
        self._archive_lag = (time.monotonic(), p.lag)

    def _start_prometheus(self, health_port: int) -> None:
        binary = shutil.which("prometheus")
        if binary is None or self._exporter is None:
            self.paths.notes.append("Prometheus is not installed (Debian: apt-get install prometheus): not started")
            return
        if not (DEPLOY / "prometheus.yml").is_file():
            self.paths.notes.append(f"{DEPLOY} not found (run the demo from a checkout): Prometheus not started")
            return
        port = _port(PROMETHEUS_PORT)
        exporter_port = int(self.paths.exporter_url.rsplit(":", 1)[1].split("/")[0])
        conf = self.paths.out / "prometheus"
        conf.mkdir(parents=True, exist_ok=True)
        text = (DEPLOY / "prometheus.yml").read_text()
        for default, actual in ((f"localhost:{EXPORTER_PORT}", f"127.0.0.1:{exporter_port}"),
                                (f"localhost:{HEALTH_PORT}", f"127.0.0.1:{health_port}"),
                                (f"localhost:{PROMETHEUS_PORT}", f"127.0.0.1:{port}")):
            text = text.replace(default, actual)
        (conf / "prometheus.yml").write_text(text)
        shutil.copyfile(DEPLOY / "alerts.yml", conf / "alerts.yml")
        logfile = open(conf / "prometheus.log", "w")  # noqa: SIM115 - owned by the process below
        self._prometheus = subprocess.Popen(
            [binary, f"--config.file={conf / 'prometheus.yml'}", f"--storage.tsdb.path={conf / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], stdout=logfile, stderr=subprocess.STDOUT)
        logfile.close()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self._prometheus.poll() is None:
            try:
                if urllib.request.urlopen(f"{url}/-/ready", timeout=1).status == 200:
                    self.paths.prometheus_url = url
                    return
            except OSError:
                time.sleep(0.2)
        self.paths.notes.append(f"Prometheus did not become ready: see {conf / 'prometheus.log'}")

    # -- finish -------------------------------------------------------------------------

    def finish(self, run_id: str, timeout: float = 60.0) -> DemoPaths:
        """Wait until the archive and timeline sinks have consumed everything produced so
        far, close their files, and write the report of ``run_id``."""
        since = time.monotonic()
        deadline = since + timeout
        while time.monotonic() < deadline:
            seen_at, lag = self._archive_lag
            loop = self._timeline_loop
            if (seen_at > since + 1.0 and lag == 0 and loop is not None and loop.lag_checked_at > since + 1.0
                    and loop.lag == 0):
                break
            time.sleep(0.2)
        else:
            self.paths.notes.append("the archive or timeline sink had not caught up within "
                                    f"{timeout:.0f} s: their files may miss the last steps")
        self._stop_archive.set()
        self._stop_timeline.set()
        for t in self._threads:
            if t.name in ("demo-archive", "demo-timeline"):
                t.join(30)
        data = gather(self.paths.archive, run_id, self.paths.timeline)
        self.paths.report = write_report(data, self.paths.out / "report.html")
        return self.paths

    def close(self) -> None:
        """Stop everything still running (exporter, Prometheus)."""
        self._stop_archive.set()
        self._stop_timeline.set()
        if self._exporter is not None:
            self._exporter.stop()
        if self._prometheus is not None:
            self._prometheus.terminate()
            try:
                self._prometheus.wait(15)
            except subprocess.TimeoutExpired:
                self._prometheus.kill()
        for t in self._threads:
            t.join(15)
