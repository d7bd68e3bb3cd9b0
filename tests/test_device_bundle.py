"""The GPU check's device bundle, proven without a GPU (docs/benchmarks.md, "GPU check").

The bundle is built for this Python, installed into a fresh virtual environment whose
only other packages are the GPU image's (``IMAGE_PACKAGES``, linked from this one:
torch CPU and the rest as installed here), and the on-device script runs there with
``--device cpu`` in a network namespace of its own with Java hidden: what would need the
network, a broker or Java on the GPU machine fails here. The results command then
publishes its spool into the real broker and judges the StepMetrics.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from device_bundle import IMAGE_PACKAGES, MAX_BYTES, build, normalize  # noqa: E402

pytestmark = pytest.mark.bundle


def image_closure() -> set[str]:
    """The image's packages and, as pip installed them there, what they require: here, as
    installed here (typer here needs pydantic, say)."""
    from packaging.requirements import Requirement

    names, todo = set(), list(IMAGE_PACKAGES)
    while todo:
        name = todo.pop()
        if name in names:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        names.add(name)
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(normalize(req.name))
    return names


def image_like_site(dest: Path) -> Path:
    """A folder of links to this environment's installs of the image's packages and their
    requirements (modules and dist-info), and nothing else."""
    dest.mkdir(parents=True)
    purelib = Path(sysconfig.get_paths()["purelib"]).resolve()
    wanted = image_closure()
    for dist in md.distributions():
        if normalize(dist.metadata["Name"]) not in wanted:
            continue
        for f in dist.files or []:
            real = Path(dist.locate_file(f)).resolve()
            if purelib not in real.parents or real.suffix == ".pth":
                continue
            top = real.relative_to(purelib).parts[0]
            if not (dest / top).exists():
                (dest / top).symlink_to(purelib / top)
    return dest


def isolation() -> list[str]:
    """The command prefix of a network namespace of its own with Java hidden; the test is
    skipped (with the reason) where this machine allows no namespaces."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--net", "--mount", "--map-root-user", "true"],
                                         capture_output=True).returncode != 0:
        pytest.skip("no network namespace can be made here (unshare --net --map-root-user failed)")
    java = shutil.which("java")
    hide = f'mount --bind /bin/false "{os.path.realpath(java)}" && ' if java else ""
    return [unshare, "--net", "--mount", "--map-root-user", "sh", "-c", hide + 'exec "$@"', "sh"]


@pytest.mark.timeout(900)
def test_the_bundle_runs_the_gpu_check_path_offline_and_its_results_pass(kafka_bootstrap, tmp_path):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    bundle = tmp_path / "bundle"
    manifest = build(bundle, version)
    assert manifest["bytes"] <= MAX_BYTES
    assert manifest["wheels"], "the image lacks profstream's Kafka and Avro clients: the bundle must carry them"

    venv = tmp_path / "image-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "image-packages.pth").write_text(str(image_like_site(tmp_path / "image-site")) + "\n")
    tools = tmp_path / "image-bin"
    tools.mkdir()
    ninja = Path(sys.executable).parent / "ninja"  # the image's ninja builds torch extensions
    if ninja.exists():
        (tools / "ninja").symlink_to(ninja)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROFSTREAM_") and k not in (
        "PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), str(tools), "/usr/bin", "/bin"])
    env["TORCH_EXTENSIONS_DIR"] = str(Path.home() / ".cache" / "torch_extensions")
    out = tmp_path / "out"
    check = subprocess.run(
        [*isolation(), str(venv / "bin" / "python"), str(bundle / "device_check.py"), "--device", "cpu", "--out",
         str(out), "--steps", "14", "--live-steps", "12", "--trace-steps", "6:8", "--repeats", "1",
         "--budget-s", "400"], env=env, capture_output=True, text=True, timeout=800, cwd=tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert check.returncode == 0, (summary["errors"], check.stderr[-3000:])
    assert summary["install"]["native"]["built"], summary["install"]
    assert summary["environment"]["native_monitor"] == "loaded"
    assert summary["environment"]["cli"] == "works"
    assert sorted(os.listdir(out)) == ["log.txt", "spool.tar.gz", "summary.json", "trace.json.gz"]
    assert all((out / f).stat().st_size < 16 * 2**20 for f in os.listdir(out))
    assert summary["overhead"]["rounds"] == 1

    results = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_results.py"), str(out),
                              "--bootstrap", kafka_bootstrap], capture_output=True, text=True, timeout=400)
    verdict = json.loads(results.stdout)
    assert results.returncode == 0, (verdict["checks"], results.stderr[-3000:])
    assert verdict["checks"]["step_metrics_for_every_step"] is True
    assert verdict["live_run"]["figures"]["steps"] >= 12
    # every step's work: the tiny job's batches of 4 x 65 token ids, its FLOPs counted; no
    # MFU on a CPU (no peak to measure it against), so that check does not apply
    assert verdict["checks"]["work_figures_every_step"] is True
    assert verdict["checks"]["mfu_against_the_cards_peak"] is None
    assert verdict["live_run"]["work"]["tokens_per_step"] == 4 * 65 and verdict["live_run"]["work"]["mfu"] is None
    assert verdict["live_run"]["work"]["flops_source"] == {"counted": verdict["live_run"]["work"]["steps_with_work"]}
    assert verdict["spool"][0]["records"] > 0 and verdict["spool"][0]["damaged"] == 0
