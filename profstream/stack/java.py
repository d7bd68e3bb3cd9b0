"""The Java runtime the broker runs on: ``$JAVA_HOME/bin/java`` or ``java`` on PATH, 17 or newer."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from profstream.stack.errors import StackError
from profstream.stack.jars import KAFKA_VERSION

MIN_JAVA_MAJOR = 17


_java_checked: dict[str, int] = {}


def _java_major(java: str) -> int:
    if java in _java_checked:
        return _java_checked[java]
    try:
        proc = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StackError(
            f"cannot run {java} -version ({exc}): install a Java {MIN_JAVA_MAJOR}+ runtime "
            "(e.g. apt-get install openjdk-17-jre-headless) or set JAVA_HOME"
        ) from exc
    out = proc.stderr + proc.stdout
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not m:
        raise StackError(
            f"cannot tell the version of {java} (output: {out.strip()[:80]!r}): install a "
            f"Java {MIN_JAVA_MAJOR}+ runtime or set JAVA_HOME to one"
        )
    major = int(m.group(1))
    if major == 1 and m.group(2):  # "1.8.0_x" style
        major = int(m.group(2))
    _java_checked[java] = major
    return major


def find_java() -> str:
    """Path of a Java 17+ executable: ``$JAVA_HOME/bin/java`` or ``java`` on PATH."""
    java_home = os.environ.get("JAVA_HOME", "").strip()
    if java_home:
        java = Path(java_home) / "bin" / "java"
        if not (java.is_file() and os.access(java, os.X_OK)):
            raise StackError(
                f"JAVA_HOME={java_home} has no bin/java: point JAVA_HOME at a Java "
                f"{MIN_JAVA_MAJOR}+ runtime or unset it to use java from PATH"
            )
        found = str(java)
    else:
        which = shutil.which("java")
        if not which:
            raise StackError(
                f"java not found: install a Java {MIN_JAVA_MAJOR}+ runtime "
                "(e.g. apt-get install openjdk-17-jre-headless) or set JAVA_HOME"
            )
        found = which
    major = _java_major(found)
    if major < MIN_JAVA_MAJOR:
        raise StackError(
            f"{found} is Java {major}, Kafka {KAFKA_VERSION} here needs Java "
            f"{MIN_JAVA_MAJOR}+: install openjdk-17-jre-headless (or newer) and set JAVA_HOME"
        )
    return found
