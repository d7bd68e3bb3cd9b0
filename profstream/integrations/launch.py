"""``profstream run -- python train.py ...``: profile a training script without changing it.

The launcher puts the options into the child's environment (Monitor options as
PROFSTREAM_OPTIONS JSON, the torch producer's own as PROFSTREAM_<NAME>) and prepends a
directory holding a generated ``sitecustomize.py`` to PYTHONPATH. Every Python process
started under it then installs a one-shot import hook; when the script imports torch, the
hook calls ``instrument()`` with global hooks (every module, optimizer and DataLoader).
The Monitor itself is made at the first step, so processes that never train (a torchrun
launcher, DataLoader workers) never send anything. An existing sitecustomize still runs.

This module is imported at start-up of the child: it imports nothing heavy at the top.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from profstream.integrations.startup_hook import CHILD_MARK, SITECUSTOMIZE


def child_environment(options: Mapping[str, Any], torch_options: Mapping[str, Any],
                      hook_dir: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the profiled command: options checked and merged into
    PROFSTREAM_OPTIONS, one run id for every process of the run, the start-up hook first
    on PYTHONPATH. A bad option raises ConfigError before anything starts."""
    from profstream.config import (
        MONITOR_OPTIONS,
        _default_run_id,
        _env_options,
        check_monitor_options,
        resolve,
    )
    from profstream.integrations.torch import TORCH_OPTIONS

    env = dict(os.environ if environ is None else environ)
    given = {k: v for k, v in options.items() if v is not None}
    if given.get("spool_dir"):  # the child may change its directory
        given["spool_dir"] = str(Path(given["spool_dir"]).resolve())
    merged = {**_env_options(env), **given}
    check_monitor_options(resolve(MONITOR_OPTIONS, merged, environ={}))  # every value checked now, with its name
    if "run_id" not in merged and "PROFSTREAM_RUN_ID" not in env:
        merged["run_id"] = _default_run_id(env)  # ranks of one launch share it
    env["PROFSTREAM_OPTIONS"] = json.dumps(merged)
    for opt in TORCH_OPTIONS:
        value = torch_options.get(opt.name)
        if value is not None:
            env[opt.env] = json.dumps(value) if isinstance(value, bool) else str(value)
    resolve(TORCH_OPTIONS, {}, environ={k: v for k, v in env.items() if k != "PROFSTREAM_OPTIONS"})
    env["PYTHONPATH"] = os.pathsep.join([hook_dir] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env[CHILD_MARK] = "1"
    return env


# Every signal a launcher may send to end or poke a job (torchrun, Slurm, Kubernetes: TERM,
# then KILL; USR1/USR2 for a checkpoint or a requeue): the wrapper passes each on to the
# training process, which is what the sender meant to reach.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_SI_KERNEL = 0x80  # si_code of a signal the kernel sent: a terminal's Ctrl-C, Ctrl-\\, hang-up
_PR_SET_PDEATHSIG = 1


def run_profiled(command: Sequence[str], options: Mapping[str, Any] | None = None,
                 torch_options: Mapping[str, Any] | None = None,
                 say: Callable[[str], None] | None = None) -> int:
    """Run ``command`` with profiling switched on; returns its exit code (128 + n when
    a signal n ended it). Raises FileNotFoundError when the command does not exist.

    Every catchable signal the wrapper gets (``FORWARDED``) is passed on to the command,
    ``say`` telling each; and the command dies with the wrapper (Linux: SIGKILL when the
    wrapper is killed), so no training process is ever left behind."""
    if not command:
        raise ValueError("no command given: write it after --, e.g. profstream run -- python train.py")
    with tempfile.TemporaryDirectory(prefix="profstream-run-") as hook_dir:
        Path(hook_dir, "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = child_environment(options or {}, torch_options or {}, hook_dir)
        code = run_child(list(command), env, say)
    return 128 - code if code < 0 else code


def run_child(command: list[str], env: Mapping[str, str], say: Callable[[str], None] | None = None) -> int:
    """Run ``command`` and wait for it, passing on the signals of ``FORWARDED``: they are
    blocked here and taken one by one (``sigtimedwait``), so none is lost and none runs a
    handler in the middle of anything. A signal the terminal sent to its foreground group
    (Ctrl-C) reached the command too when it shares our group: that one is not sent twice.
    Returns Popen's returncode (-n: signal n ended it)."""
    if not hasattr(signal, "sigtimedwait"):  # not POSIX: the child gets the terminal's signals itself
        return _wait_plain(subprocess.Popen(command, env=env))
    watched = {*FORWARDED, signal.SIGCHLD}
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    try:
        child = subprocess.Popen(command, env=env, preexec_fn=_child_setup(unblocked, os.getpid()))
        same_group = os.getpgid(child.pid) == os.getpgrp() if child.poll() is None else False
        while (code := child.poll()) is None:
            info = signal.sigtimedwait(watched, 1.0)  # SIGCHLD wakes it; a second's timeout covers a missed one
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            if info.si_code == _SI_KERNEL and same_group:  # the terminal sent it to the child as well
                continue
            try:
                os.kill(child.pid, info.si_signo)
            except ProcessLookupError:  # it just ended
                continue
            if say is not None:
                say(f"passed {signal.Signals(info.si_signo).name} on to {command[0]} (pid {child.pid})")
        return code
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)


def _child_setup(unblocked: Any, parent: int) -> Callable[[], None]:
    """What the child runs between fork and exec: the signal mask it would have had, and
    death with its parent (Linux's PR_SET_PDEATHSIG: a wrapper killed with SIGKILL takes
    the training process with it, and the DataLoader workers follow it)."""
    import ctypes

    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # the wrapper died before that: follow it now
                os.kill(os.getpid(), signal.SIGKILL)

    return setup


def _wait_plain(child: subprocess.Popen) -> int:
    while True:
        try:
            return child.wait()
        except KeyboardInterrupt:  # the child got the same Ctrl-C: let it finish
            continue


# -- in the profiled process ---------------------------------------------------------

class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch`` is about to be imported it wraps torch's
    loader so that ``instrument()`` runs right after torch has finished importing."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot; also keeps find_spec below from recursing
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_instrument(module: Any) -> None:
            exec_module(module)
            instrument_from_environment()

        loader.exec_module = exec_then_instrument
        return spec


def install_import_hook() -> None:
    """Instrument this process once torch is imported (now, if it already is)."""
    if "torch" in sys.modules:
        instrument_from_environment()
    elif not any(isinstance(f, _TorchImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportHook())


_handle: Any = None


def instrument_from_environment() -> Any:
    """``instrument()`` with global hooks and options from the environment; the Monitor
    is made at the first step. Never raises: a problem is printed on one line."""
    global _handle
    if _handle is not None:
        return _handle
    try:
        from profstream.config import MONITOR_OPTIONS, resolve
        from profstream.integrations.torch import TORCH_OPTIONS, TorchInstrumentation, close_at_exit

        resolve(MONITOR_OPTIONS)  # a bad PROFSTREAM_* value is reported now, not at step 0
        torch_opts = resolve(TORCH_OPTIONS, environ={k: v for k, v in os.environ.items()
                                                     if k != "PROFSTREAM_OPTIONS"})
        handle = TorchInstrumentation(None, {}, torch_opts["capture_ops"], mark_steps=True, lazy=True,
                                      compiled_walk=torch_opts["compiled_walk"], work_figures=torch_opts["work_figures"],
                                      count_flops=torch_opts["count_flops"],
                                      collectives_interval_s=torch_opts["collectives_interval_s"])
        handle.attach(None, None, None)
        close_at_exit(handle)
        _handle = handle
    except Exception as e:  # the training must run even when profiling cannot
        print(f"profstream: profiling is off for this process: {e}", file=sys.stderr)
    return _handle
