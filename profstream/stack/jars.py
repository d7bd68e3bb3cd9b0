"""The Kafka broker's jars: an installed distribution (``KAFKA_HOME``) or fetched once with
Maven (``mvn dependency:copy-dependencies`` on the ``pom.xml`` shipped in this package) into
a cache directory."""

from __future__ import annotations

import importlib.resources
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from profstream.stack.errors import StackError
from profstream.stack.state import LOCK_FILE, cache_home, locked

KAFKA_VERSION = "3.9.1"
"""Kafka release fetched by ``pom.xml`` (property ``kafka.version``); kept equal by a test."""

COMPLETE_MARKER = ".complete"

def _libs_complete(libs: Path) -> bool:
    return (libs / COMPLETE_MARKER).is_file() and any(libs.glob("kafka_2.13-*.jar"))


def cached_kafka_libs(cache_dir: Path | None = None) -> Path | None:
    """The directory of the broker jars fetched earlier into the cache, None if they are not there."""
    libs = (Path(cache_dir).expanduser() if cache_dir else cache_home()) / f"kafka-{KAFKA_VERSION}" / "libs"
    return libs if _libs_complete(libs) else None


def kafka_libs(cache_dir: Path | None = None) -> Path:
    """Directory holding the broker jars.

    ``$KAFKA_HOME/libs`` when KAFKA_HOME is set; otherwise
    ``<cache_dir>/kafka-<KAFKA_VERSION>/libs``, fetched with Maven when missing or
    incomplete. The fetch goes to a temporary directory that is renamed into place only
    when complete, so an interrupted fetch never leaves a half-filled cache.
    """
    kafka_home = os.environ.get("KAFKA_HOME", "").strip()
    if kafka_home:
        libs = Path(kafka_home).expanduser() / "libs"
        if not any(libs.glob("kafka_*.jar")):
            raise StackError(
                f"KAFKA_HOME={kafka_home} has no libs/kafka_*.jar: point KAFKA_HOME at an "
                f"unpacked Apache Kafka {KAFKA_VERSION} distribution or unset it to fetch "
                "the jars with Maven"
            )
        return libs

    base = (Path(cache_dir).expanduser() if cache_dir else cache_home()) / f"kafka-{KAFKA_VERSION}"
    libs = base / "libs"
    if _libs_complete(libs):
        return libs

    mvn = shutil.which("mvn")
    if not mvn:
        raise StackError(
            "mvn not found: install Maven (e.g. apt-get install maven) so the Kafka jars can "
            f"be fetched, or set KAFKA_HOME to an unpacked Apache Kafka {KAFKA_VERSION} "
            "distribution"
        )
    base.mkdir(parents=True, exist_ok=True)
    with locked(base / LOCK_FILE):
        if _libs_complete(libs):  # fetched by someone else while we waited
            return libs
        for stale in base.glob("libs.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix="libs.tmp-", dir=base))
        try:
            _mvn_fetch(mvn, tmp)
            (tmp / COMPLETE_MARKER).write_text(KAFKA_VERSION + "\n")
            if libs.exists():
                shutil.rmtree(libs)
            os.replace(tmp, libs)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return libs


def _mvn_fetch(mvn: str, out_dir: Path) -> None:
    # Run Maven on a private copy of the pom, so nothing is written next to the installed
    # package (which may be read-only) and `target/` never lands in the source tree.
    work = out_dir / ".mvn-work"
    work.mkdir()
    pom_res = importlib.resources.files("profstream.stack") / "pom.xml"
    pom = work / "pom.xml"
    pom.write_bytes(pom_res.read_bytes())
    cmd = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(pom),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={out_dir}",
        "-DincludeScope=runtime",
    ]
    try:
        proc = subprocess.run(
            cmd, cwd=work, capture_output=True, text=True, timeout=900, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise StackError(
            "fetching the Kafka jars with mvn took over 15 min: check network access to "
            "the Maven repository, or set KAFKA_HOME to an unpacked Kafka distribution"
        ) from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0 or not any(out_dir.glob("kafka_2.13-*.jar")):
        out = (proc.stdout + proc.stderr).strip().splitlines()
        errors = [ln for ln in out if "ERROR" in ln] or out
        last = errors[0] if errors else f"exit code {proc.returncode}"
        raise StackError(
            f"mvn could not fetch the Kafka {KAFKA_VERSION} jars ({last.strip()[:200]}): "
            "check network access to the Maven repository (or ~/.m2/settings.xml), or set "
            "KAFKA_HOME to an unpacked Kafka distribution",
            detail="\n".join(out[-40:]),
        )
