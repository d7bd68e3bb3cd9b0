"""`.ci/check-system`: what `make test` and .ci/run need from the system, or one line that
says how to get it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "check-system"
EVERY_PACKAGE = ["openjdk-17-jre-headless", "maven", "make", "prometheus", "prometheus-alertmanager", "chromium",
                 "g++"]


def _bare_path(tmp_path: Path) -> str:
    """A PATH with a shell, id and this Python as python3, and none of the packages."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id", "env"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    return str(bin_dir)


def _check(path: str, environ: dict | None = None, **env: str) -> subprocess.CompletedProcess:
    if environ is None:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("PROFSTREAM_SKIP") and k != "KAFKA_HOME"}
    return subprocess.run([shutil.which("bash"), str(SCRIPT), "--check"], env={**environ, "PATH": path, **env},
                          capture_output=True, text=True, timeout=60)


def test_a_bare_machine_gets_one_line_naming_the_command_and_the_skip_variables(tmp_path):
    done = _check(_bare_path(tmp_path))
    assert done.returncode == 1 and done.stdout == ""
    line = done.stderr.strip()
    assert "\n" not in line
    assert "`sudo apt-get install -y --no-install-recommends openjdk-17-jre-headless maven make " in line
    assert all(f" {package}" in line for package in EVERY_PACKAGE), line
    assert "PROFSTREAM_SKIP_PROMETHEUS=1" in line and "PROFSTREAM_SKIP_CHROMIUM=1" in line


def test_the_skip_variables_and_kafka_home_leave_their_packages_out(tmp_path):
    done = _check(_bare_path(tmp_path), PROFSTREAM_SKIP_PROMETHEUS="1", PROFSTREAM_SKIP_CHROMIUM="1",
                  KAFKA_HOME=str(tmp_path))
    assert done.returncode == 1
    named = done.stderr.split("--no-install-recommends ", 1)[1].split("`")[0].split()
    assert "openjdk-17-jre-headless" in named and "g++" in named
    assert not {"maven", "prometheus", "prometheus-alertmanager", "chromium"} & set(named)
    assert "PROFSTREAM_SKIP" not in done.stderr  # nothing left to skip


def test_this_machine_has_everything_the_tests_need():
    """What `make test` checked before it started: the check passes silently."""
    done = _check(os.environ["PATH"], dict(os.environ))
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
