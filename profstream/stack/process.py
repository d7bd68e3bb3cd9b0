"""The broker's process: alive or not, its command line, stopping its process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)  # reap it if it is our own exited child
        if done == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        pass
    return True


def cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        pass
    try:
        return subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def terminate(pid: int, timeout: float) -> None:
    """SIGTERM the process group of ``pid``, wait up to ``timeout``, then SIGKILL."""

    def signal_group(sig: int) -> None:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    signal_group(signal.SIGTERM)
    deadline = time.monotonic() + max(timeout, 0.0)
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            signal_group(signal.SIGKILL)
            kill_deadline = time.monotonic() + 10.0
            while pid_alive(pid) and time.monotonic() < kill_deadline:
                time.sleep(0.05)
            break
        time.sleep(0.1)
