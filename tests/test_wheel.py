"""The sdist, and the wheel built from it, installed alone into a clean virtual environment
(no checkout beside it): its commands run, its base install has no torch, its Monitor runs
the compiled hot path built into the wheel, and `profstream doctor` reaches the broker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DATA = ("profstream/schema/event_batch.avsc", "profstream/schema/capture_request.avsc",
                "profstream/stack/pom.xml", "profstream/integrations/torch_tree.cpp",
                "profstream/integrations/transformers.py", "profstream/integrations/lightning.py")


def _run(*command: str | Path, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout, **kw)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done


def test_the_wheel_installs_alone_and_its_doctor_runs(tmp_path, kafka_bootstrap, topics):
    # build from a copy of what the wheel is made of, so no build/ is left in the checkout
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # (without the checkout's own build of the extension: the wheel builds its own)
    shutil.copytree(ROOT / "profstream", source / "profstream", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    # the sdist, and the wheel built from it: what pip does on a platform without a wheel
    _run(sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(tmp_path / 'sdist')!r})",
         cwd=source)
    (sdist,) = (tmp_path / "sdist").glob("profstream-*.tar.gz")
    with tarfile.open(sdist) as tar:
        assert [n for n in tar.getnames() if n.endswith("producers/csrc/recorder.h")]  # the extension's sources
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist",
         sdist)
    (wheel,) = (tmp_path / "dist").glob("profstream-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    assert set(PACKAGE_DATA) <= files
    assert [f for f in files if f.startswith("profstream/producers/_native") and f.endswith(".so")], sorted(files)
    assert not [f for f in files if "/csrc/" in f]  # sources stay in the source tree

    # a venv without pip: this environment's pip installs into it, dependencies from the index
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    # (without PYTHONPATH: a checkout on it is a profstream already installed to pip, which then skips the wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--quiet", "--prefer-binary",
         wheel, env=env)
    elsewhere = tmp_path / "elsewhere"  # nothing of the checkout importable from here
    elsewhere.mkdir()
    assert "doctor" in _run(venv / "bin" / "profstream", "--help", cwd=elsewhere, env=env).stdout
    loaded = _run(venv / "bin" / "python", "-c", "from profstream.producers import native; m, why = native.load(); "
                  "print(m.__file__ if m else 'NOT LOADED: ' + why)", cwd=elsewhere, env=env).stdout
    assert loaded.startswith(str(venv)), loaded  # the wheel's own compiled Monitor
    done = subprocess.run([venv / "bin" / "profstream", "doctor", "--bootstrap", kafka_bootstrap, "--topic-prefix",
                           topics.prefix], capture_output=True, text=True, timeout=120, cwd=elsewhere, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split("│")[1].strip(): line for line in done.stdout.splitlines() if line.count("│") > 3}
    assert "answers" in rows["broker"] and " ok " in rows["topics"]
    assert "not installed" in rows["torch"]  # the base install pulls no torch
    assert "pip install 'profstream[torch]'" in rows["torch"]
    # the docker image's install: `profstream autocapture --policy` reads its YAML file
    done = _run(venv / "bin" / "python", "-c", "import sys; from profstream.control.policy import CapturePolicy; "
                "print(CapturePolicy.load(sys.argv[1]).min_interval_s)", ROOT / "deploy" / "autocapture.yml",
                cwd=elsewhere, env=env)
    assert done.stdout.strip() == "600.0"
