"""The on-device part of the GPU check: runs on a bare GPU machine with its own ``python3``.

No network, no Java, no package registry, no broker: the Monitor records to a disk spool
(``record_only``), and what comes back is a handful of files for ``device_results.py`` to
judge here (publish the spool into a real broker and processors, compare with HTA).

Run from a device bundle (``device_bundle.py`` builds it: wheels the image lacks, the
profstream sources, this script and the job), it first installs the wheels into the
bundle's ``site/`` with pip (``--no-index``) and compiles the native Monitor from its
sources with the machine's C++ compiler; from a checkout with profstream installed it uses
that. Then, within ``--budget-s`` of wall time:

1. the live run: ``gpu_job.py`` under ``profstream run --record-only`` with op capture and
   device counters every 20 ms; its spool goes back as ``spool.tar.gz``;
2. the Chrome trace of a window of steps of the same job under torch.profiler alone
   (``trace.json.gz``), for the comparison with HTA;
3. the device sampler's CPU per reading on the real NVML;
4. the overhead series: the job plain, under ``profstream run --no-capture-ops``, under
   torch.profiler alone (one cycle per step) and under ``profstream run`` with op capture,
   in rotating order, as many rounds as the budget leaves (``--repeats`` wanted).

Writes ``summary.json`` (after every phase, so a run cut short still says how far it got),
``log.txt``, ``spool.tar.gz`` and ``trace.json.gz`` into ``--out``: 4 files. Exit status 0
when every phase ran, 1 when one failed (the summary says which and why).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SKIP = 10  # first steps of a run left out of its step times (warm-up, autotuning)
VARIANTS = ("plain", "capture_off", "profiler", "capture_on")
LOG_LIMIT = 8 * 1024 * 1024
PART_BYTES = 15 * 2**20  # a file that comes back from the device machine: at most 16 MiB
# `profstream run`'s launcher, called without the command line (typer there may differ from
# here: whether `python3 -m profstream.cli` works there is checked apart, in environment()).
LAUNCH = ("import json, sys; from profstream.integrations.launch import run_profiled; "
          "sys.exit(run_profiled(sys.argv[3:], json.loads(sys.argv[1]), json.loads(sys.argv[2])))")


class Check:
    """The summary and log, written to --out as they grow."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.out = out
        self.started = time.monotonic()
        self.summary: dict[str, Any] = {"benchmark": "device_check", "args": vars(args), "phases": {},
                                        "errors": [], "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.log = open(out / "log.txt", "w")

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, msg: str) -> None:
        line = f"[{self.elapsed():7.1f}s] {msg}"
        print(line, file=sys.stderr, flush=True)
        if self.log.tell() < LOG_LIMIT:
            self.log.write(line + "\n")
            self.log.flush()

    def save(self) -> None:
        self.summary["wall_s"] = round(self.elapsed(), 1)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=2, default=str))
        os.replace(tmp, self.out / "summary.json")

    def phase(self, name: str, fn, *a: Any) -> Any:
        t0 = time.monotonic()
        self.say(f"== {name}")
        try:
            got = fn(*a)
            self.summary["phases"][name] = {"ok": True, "s": round(time.monotonic() - t0, 1)}
            return got
        except Exception as e:  # one phase failing must not cost the others their results
            self.summary["phases"][name] = {"ok": False, "s": round(time.monotonic() - t0, 1),
                                            "error": f"{type(e).__name__}: {e}"}
            self.summary["errors"].append(f"{name}: {type(e).__name__}: {e}")
            self.say(f"{name} failed: {type(e).__name__}: {e}")
            return None
        finally:
            self.save()


# -- set-up ---------------------------------------------------------------------------

def install_bundle(check: Check, bundle: Path) -> dict[str, Any]:
    """The bundle's wheels into its site/ (pip, no index), and the native Monitor compiled
    from its sources into src/profstream/producers; both skipped when already done."""
    site, src = bundle / "site", bundle / "src"
    info: dict[str, Any] = {}
    if not (site / ".installed").exists():
        wheels = sorted(str(p) for p in (bundle / "wheels").glob("*.whl"))
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                               "--no-compile", "--disable-pip-version-check", "--target", str(site), *wheels],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"pip could not install the bundle's wheels: {done.stderr.strip()[-1500:]}")
        (site / ".installed").write_text("\n".join(wheels))
    info["wheels"] = len(list((bundle / "wheels").glob("*.whl")))
    info["native"] = compile_native(check, src / "profstream" / "producers")
    return info


def compile_native(check: Check, producers: Path) -> dict[str, Any]:
    """profstream's compiled Monitor, built here from its sources (the same flags as
    pyproject.toml's extension); a failure leaves the pure-Python Monitor, said so."""
    import sysconfig

    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = producers / f"_native{suffix}"
    if target.exists():
        return {"built": True, "path": str(target), "cached": True}
    sources = sorted(str(p) for p in (producers / "csrc").glob("*.cpp"))
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return {"built": False, "why": "no C++ compiler"}
    include = sysconfig.get_paths()["include"]
    cmd = [cxx, "-std=c++17", "-O2", "-fvisibility=hidden", "-shared", "-fPIC", f"-I{include}", *sources, "-ldl",
           "-o", str(target)]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        check.say(f"the native Monitor did not compile ({cxx}): {done.stderr.strip()[-800:]}")
        return {"built": False, "why": done.stderr.strip()[-800:]}
    return {"built": True, "path": str(target), "compile_s": round(time.monotonic() - t0, 1)}


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cpu_count": os.cpu_count(), "platform": platform.platform()}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
            env["nvml"] = pynvml.nvmlSystemGetNVMLVersion()
        except Exception as e:
            env["driver"] = f"unknown ({type(e).__name__}: {e})"
    from profstream.producers import native

    module, why = native.load()
    env["native_monitor"] = "loaded" if module is not None else f"not loaded: {why}"
    cli = subprocess.run([sys.executable, "-m", "profstream.cli", "run", "--help"], capture_output=True, text=True,
                         timeout=60)
    env["cli"] = "works" if cli.returncode == 0 else f"fails: {cli.stderr.strip()[-300:]}"
    env["packages"] = {name: _version(name) for name in ("typer", "rich", "numpy", "pandas", "pyarrow",
                                                          "nvidia-ml-py", "setuptools", "ninja")}
    return env


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# -- the jobs --------------------------------------------------------------------------

def job(check: Check, args: argparse.Namespace, work: Path, variant: str, steps: int, run_id: str | None = None,
        spool: Path | None = None, trace_dir: Path | None = None, env_extra: dict[str, str] | None = None
        ) -> list[float]:
    out = work / f"{variant}-{uuid.uuid4().hex[:6]}.json"
    cmd = [sys.executable, str(HERE / "gpu_job.py"), "--device", args.device, "--size", args.size,
           "--steps", str(steps), "--out", str(out),
           "--mode", "profiler" if variant in ("profiler", "trace") else "plain"]
    if trace_dir is not None:
        cmd += ["--trace-dir", str(trace_dir), "--trace-steps", args.trace_steps]
    if variant in ("capture_off", "capture_on", "live"):
        spool = spool or work / f"spool-{variant}"
        options = {"record_only": True, "spool_dir": str(spool),
                   "run_id": run_id or f"device-{variant}-{uuid.uuid4().hex[:6]}"}
        cmd = [sys.executable, "-c", LAUNCH, json.dumps(options),
               json.dumps({"capture_ops": variant != "capture_off"}), *cmd]
    env = dict(os.environ, **(env_extra or {}))
    t0 = time.monotonic()
    timeout = args.job_timeout_s * (2 if variant == "live" else 1)  # the first capture compiles the trace walk
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    tail = (done.stderr or "")[-3000:]
    if tail.strip():
        check.say(f"{variant} stderr (tail):\n{tail}")
    if done.returncode != 0:
        raise RuntimeError(f"the job ({variant}) exited with {done.returncode}: {tail[-1500:]}")
    check.say(f"{variant}: {steps} steps in {time.monotonic() - t0:.1f} s")
    if variant in ("capture_off", "capture_on") and spool is not None:
        shutil.rmtree(spool, ignore_errors=True)  # the overhead runs' spools are not sent back
    return json.loads(out.read_text())


def median_step(times: list[float]) -> float:
    return statistics.median(times[SKIP:] if len(times) > 2 * SKIP else times)


def live_run(check: Check, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_id = f"device-live-{uuid.uuid4().hex[:6]}"
    spool = work / "spool"
    times = job(check, args, work, "live", args.live_steps, run_id=run_id, spool=spool,
                env_extra={"PROFSTREAM_DEVICE_INTERVAL_MS": "20"})
    packed = work / "spool.tar.gz"
    with tarfile.open(packed, "w:gz") as tar:
        tar.add(spool, arcname="spool")
    return {"run_id": run_id, "steps": args.live_steps, "step_time_s": median_step(times),
            "spool_tar_bytes": packed.stat().st_size, "files": split_into(packed, check.out)}


def split_into(path: Path, out: Path) -> list[str]:
    """``path`` into ``out`` as itself, or as ``NAME.0``, ``NAME.1``... of at most PART_BYTES
    each when it is larger (device_results.py joins them)."""
    data = path.read_bytes()
    if len(data) <= PART_BYTES:
        shutil.copyfile(path, out / path.name)
        return [path.name]
    names = []
    for i in range(0, len(data), PART_BYTES):
        names.append(f"{path.name}.{i // PART_BYTES}")
        (out / names[-1]).write_bytes(data[i:i + PART_BYTES])
    return names


def trace(check: Check, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    trace_dir = work / "trace"
    first, last = (int(x) for x in args.trace_steps.split(":"))
    job(check, args, work, "trace", last + 2, trace_dir=trace_dir)
    files = sorted(glob.glob(str(trace_dir / "*.json*")))
    if not files:
        raise RuntimeError(f"torch.profiler wrote no trace into {trace_dir}")
    packed = work / "trace.json.gz"
    shutil.copyfile(files[0], packed)
    return {"file": os.path.basename(files[0]), "bytes": packed.stat().st_size, "steps": f"{first}:{last}",
            "files": split_into(packed, check.out)}


def sampler_cost(readings: int = 200, interval_s: float = 0.02) -> dict[str, Any]:
    from profstream.devices.nvml import open_nvml
    from profstream.devices.sampler import DeviceSampler

    sampler = DeviceSampler(open_nvml([0]), lambda sample: None, interval_s)
    sampler.start()
    deadline = time.monotonic() + 30
    while sampler.readings < readings and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    per_reading = sampler.cpu_s / max(sampler.readings, 1)
    return {"readings": sampler.readings, "cpu_us_per_reading": per_reading * 1e6,
            "core_share_at_500ms": per_reading / 0.5, "unsupported_fields": sorted(sampler.backend.unsupported)}


def overhead(check: Check, args: argparse.Namespace, work: Path, deadline: float) -> dict[str, Any]:
    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    medians: dict[str, list[float]] = {v: [] for v in variants}
    round_s: list[float] = []
    for r in range(args.repeats):
        left = deadline - time.monotonic()
        if round_s and left < 1.2 * max(round_s):
            check.say(f"overhead: stopping after {r} rounds, {left:.0f} s of the budget left")
            break
        t0 = time.monotonic()
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            medians[v].append(median_step(job(check, args, work, v, args.steps)))
        round_s.append(time.monotonic() - t0)
        check.summary["overhead"] = _overhead_figures(medians)
        check.save()
    return _overhead_figures(medians)


def _overhead_figures(medians: dict[str, list[float]]) -> dict[str, Any]:
    rounds = min(len(x) for x in medians.values())
    if not rounds:
        return {"rounds": 0}
    med = {v: statistics.median(x[:rounds]) for v, x in medians.items()}
    out = {"rounds": rounds, "step_time_s": {v: x[:rounds] for v, x in medians.items()}, "median_s": med}
    for over, base in (("capture_off", "plain"), ("capture_on", "profiler"), ("profiler", "plain")):
        if over in med and base in med:
            out[f"{over}_over_{base}"] = med[over] / med[base] - 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "device-out")))
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to try the whole path without a GPU")
    ap.add_argument("--size", default=None, choices=("gpu", "tiny"), help="the job's size (default: gpu on "
                    "cuda, tiny on cpu)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall time for everything (the overhead "
                    "series gets what the rest leaves)")
    ap.add_argument("--steps", type=int, default=30, help="steps per overhead run")
    ap.add_argument("--live-steps", type=int, default=40, help="steps of the live run")
    ap.add_argument("--trace-steps", default="20:24", help="steps A:B of the exported trace")
    ap.add_argument("--repeats", type=int, default=8, help="rounds of the overhead series wanted")
    ap.add_argument("--job-timeout-s", type=float, default=120.0, help="longest one job may run (the live run "
                    "twice that)")
    ap.add_argument("--phases", default="live,trace,sampler,overhead")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="the overhead series' variants (rotating)")
    args = ap.parse_args()
    args.size = args.size or ("gpu" if args.device.startswith("cuda") else "tiny")
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(args.out, args)
    deadline = check.started + args.budget_s
    bundle = HERE if (HERE / "BUNDLE.json").exists() else None
    if bundle is not None:
        check.summary["bundle"] = json.loads((bundle / "BUNDLE.json").read_text())
        check.summary["install"] = check.phase("install", install_bundle, check, bundle)
        paths = [str(bundle / "src"), str(bundle / "site")]
        sys.path[:0] = paths
        os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(tempfile.gettempdir()) / "profstream-torch-ext"))
    check.summary["environment"] = check.phase("environment", environment, args.device)
    work = Path(tempfile.mkdtemp(prefix="device-check-"))
    phases = args.phases.split(",")
    if "live" in phases:
        check.summary["live_run"] = check.phase("live", live_run, check, args, work)
    if "trace" in phases:
        check.summary["trace"] = check.phase("trace", trace, check, args, work)
    if "sampler" in phases:
        if args.device.startswith("cuda"):
            check.summary["sampler"] = check.phase("sampler", sampler_cost)
        else:
            check.summary["sampler"] = {"skipped": "no NVML device on --device cpu"}
    if "overhead" in phases:
        check.summary["overhead"] = check.phase("overhead", overhead, check, args, work, deadline)
    check.summary["ok"] = not check.summary["errors"]
    check.save()
    check.say(f"done in {check.elapsed():.0f} s; files in {args.out}: {sorted(os.listdir(args.out))}")
    check.log.close()
    shutil.rmtree(work, ignore_errors=True)
    return 0 if check.summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
