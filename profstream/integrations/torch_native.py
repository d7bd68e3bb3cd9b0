"""The compiled event-tree walk of op capture (``torch_tree.cpp``): built once, used when there.

Reading a captured step's outermost ops through torch's Python bindings costs ~5 calls a
tree node, 0.7-1 ms a step in a training loop (docs/benchmarks.md section 12); the same
walk in C++ is one call, ~0.05 ms. It is compiled with ``torch.utils.cpp_extension``
against the installed torch's own headers (a C++ compiler, the Python headers and ninja
are needed; ~25 s of one core), in a child process at low priority that the first
CPU-only capture starts, into ``profstream/<name>`` of torch's extension directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), the name carrying the
source's and torch's versions, so an upgraded torch gets a build of its own and later
runs load the module without starting a compiler. Until it is loaded, or where it cannot
be built (logged once), capture uses the Python walk, which gives the same ops; the first
trace read both ways must agree before the compiled one is trusted (``OpCapture``).

``python -m profstream.integrations.torch_native`` builds it ahead (for an image, or to see
the compiler's output) and prints where the module is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from profstream.integrations.startup_hook import without_profiling

log = logging.getLogger("profstream.torch")

SOURCE = Path(__file__).with_name("torch_tree.cpp")
BUILD_TIMEOUT_S = 900

# The child that compiles: cpp_extension.load with the parent's arguments; the last line
# it prints is the built module's path.
_CHILD = """\
import json, os, sys
try:
    import ninja
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
except ImportError:
    pass
from torch.utils.cpp_extension import load
args = json.loads(sys.argv[1])
os.makedirs(args["build_directory"], exist_ok=True)
print(load(**args).__file__)
"""


class _Native:
    """Process-wide state of the compiled walk: one build and one load per process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ready = threading.Event()  # set when the build ended, loaded or not
        self.status = "idle"  # idle -> building -> ready | failed
        self.reason = ""
        self.module: Any = None
        self.thread: threading.Thread | None = None


_native = _Native()


def build_arguments() -> dict[str, Any]:
    """``torch.utils.cpp_extension.load`` arguments of this torch (raises RuntimeError
    where the walk cannot be built for it)."""
    import torch

    if not torch.autograd.kineto_available():
        raise RuntimeError("this torch is built without kineto")
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(f"{torch.__version__} {getattr(torch.version, 'git_version', '')}".encode())
    name = f"profstream_tree_{digest.hexdigest()[:16]}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    return {"name": name, "sources": [str(SOURCE)], "extra_cflags": ["-O2", "-DUSE_KINETO"],
            "extra_include_paths": [str(Path(torch.__file__).parent / "include" / "kineto")],
            "build_directory": str(root / "profstream" / name), "verbose": False}


def built_path(args: dict[str, Any]) -> Path:
    """Where the module of these build arguments is, once built."""
    return Path(args["build_directory"]) / f"{args['name']}.so"


def compile_module(args: dict[str, Any], timeout: float = BUILD_TIMEOUT_S, nice: int = 10) -> str:
    """Build (or find built) the module in a child process; returns its path.

    Raises RuntimeError with the compiler's first error line when it cannot be built."""
    command = [sys.executable, "-c", _CHILD, json.dumps(args)]
    if nice:
        command = ["nice", "-n", str(nice), *command]
    env = {**without_profiling(os.environ), "MAX_JOBS": os.environ.get("MAX_JOBS", "1")}  # not a profiled process
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not run the build: {e}") from None
    path = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else ""
    if not path.endswith(".so") or not os.path.exists(path):
        raise RuntimeError(f"build failed (exit {proc.returncode}): {_reason(proc.stdout + proc.stderr)}")
    return path


def _reason(output: str) -> str:
    """The line of a failed build that says why: the compiler's first error, a missing
    tool, or the exception the build ended with."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()] or ["no output"]
    for pattern in (r":\d+:\d+: (?:fatal )?error: ", r"not found|No such file", r"^\w*(?:Error|Exception): "):
        found = [ln for ln in lines if re.search(pattern, ln)]
        if found:
            return (found[0] if pattern.startswith(":") else found[-1])[:300]
    return lines[-1][:300]


def load_module(path: str) -> Any:
    """Import a built module from its path."""
    name = Path(path).name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"{path} is not an importable module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start() -> None:
    """Build and load the walk in the background, once per process."""
    with _native.lock:
        if _native.status != "idle":
            return
        _native.status = "building"
        _native.thread = threading.Thread(target=_build_and_load, name="profstream-native-build", daemon=True)
        _native.thread.start()


def _build_and_load() -> None:
    try:
        args = build_arguments()
        module = None
        if built_path(args).exists():  # built by an earlier run: no compiler started
            try:
                module = load_module(str(built_path(args)))
            except ImportError:  # a build cut short: build it again
                module = None
        module = module or load_module(compile_module(args))
    except Exception as e:  # anything: capture goes on with the Python walk
        disable(str(e) or type(e).__name__)
    else:
        with _native.lock:
            _native.module, _native.status = module, "ready"
        log.debug("profstream: compiled event-tree walk loaded from %s", module.__file__)
    finally:
        _native.ready.set()


def walker() -> Any:
    """``outermost_ops(result, through, offset_ns, data_until_ns, previous)`` of the
    compiled module (``torch_ops.native_op_columns`` calls it), or None until it is there."""
    module = _native.module
    return module.outermost_ops if module is not None else None


def disable(reason: str) -> None:
    """Use the Python walk from now on (logged once)."""
    with _native.lock:
        first = _native.status != "failed"
        _native.module, _native.status, _native.reason = None, "failed", reason
    _native.ready.set()
    if first:
        log.warning("profstream: op capture reads the profiler's trace in Python (about 0.5 ms more per captured "
                    "step): the compiled walk is unavailable: %s", reason)


def status() -> tuple[str, str]:
    """(idle | building | ready | failed, why it failed)."""
    return _native.status, _native.reason


def wait(timeout: float) -> bool:
    """Wait until a started build has ended (loaded or failed); False on timeout."""
    return _native.ready.wait(timeout)


def main() -> None:
    try:
        path = compile_module(build_arguments(), nice=0)
    except RuntimeError as e:
        sys.exit(f"profstream: cannot build the compiled event-tree walk: {e}. Install a C++ compiler, the "
                 "Python headers and ninja (pip install ninja); op capture works without it, in Python.")
    print(path)


if __name__ == "__main__":
    main()
