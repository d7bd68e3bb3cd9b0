"""``make device-bundle``: what the GPU check needs on a GPU machine that reaches no registry.

The machines this project borrows for GPU checks have Python 3.12 with torch, numpy,
pandas, pyarrow and the rest of ``IMAGE_PACKAGES``, a C++ compiler and no network, no
Java. This builds a folder (at most ``MAX_BYTES``) to carry there:

- ``wheels/``: the manylinux x86-64 wheels, for ``--python-version``, of every runtime
  dependency of profstream the image lacks (the versions installed here, so that what
  runs there is what the tests ran), fetched with ``pip download``;
- ``src/profstream``: profstream's sources (``git ls-files``, new files too), with the
  compiled Monitor's C++ sources, which ``device_check.py`` compiles there;
- ``device_check.py``, ``gpu_job.py``: the on-device script and its training job;
- ``BUNDLE.json``: what is in it (commit, Python version, wheels and sizes).

On the GPU machine: ``python3 build/device-bundle/device_check.py --out $OUT``; here:
``python benchmarks/device_results.py DIR`` on the files that came back (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_BYTES = 60 * 2**20

# The Python packages of the GPU machines' image ('cuda'), as the device tool's KINDS.md
# listed them on 2026-11-17: a bundle carries what profstream needs beyond these.
IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())

# Dependencies the GPU check never imports: the Grafana sink's client (sinks/grafana.py
# alone) and what it pulls in (an HTTP/3 stack, ~10 MB of wheels).
NOT_NEEDED = frozenset({"grafana-client"})

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_5_x86_64")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed_wheels(python_version: str) -> dict[str, str]:
    """{distribution: version installed here} of profstream's runtime dependencies (and
    theirs, extras followed) that the image lacks, for ``python_version``."""
    from packaging.requirements import Requirement

    env = {"python_version": python_version, "python_full_version": f"{python_version}.0", "sys_platform": "linux",
           "platform_system": "Linux", "implementation_name": "cpython", "os_name": "posix",
           "platform_python_implementation": "CPython", "platform_machine": "x86_64"}
    need: dict[str, str] = {}
    todo = [Requirement(r) for r in md.requires("profstream") or [] if "extra ==" not in r]
    while todo:
        req = todo.pop()
        name = normalize(req.name)
        if name in IMAGE_PACKAGES or name in NOT_NEEDED:
            continue
        dist = md.distribution(req.name)
        first = name not in need
        need[name] = dist.version
        for sub in dist.requires or []:
            sreq = Requirement(sub)
            if sreq.marker is not None and not any(sreq.marker.evaluate({**env, "extra": e})
                                                   for e in (req.extras or {""})):
                continue
            if first or sreq.marker is not None:  # an extra's requirement on a second visit too
                sreq.marker = None
                todo.append(sreq)
    return dict(sorted(need.items()))


def download(wheels: dict[str, str], python_version: str, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp", *platform_args,
           "-d", str(dest), *(f"{n}=={v}" for n, v in wheels.items())]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"pip could not fetch the wheels for Python {python_version}: {done.stderr.strip()[-2000:]}")


def copy_sources(dest: Path) -> str:
    """profstream/ as the working tree has it (tracked files and new ones git does not
    ignore: no caches, no builds) into dest; the commit, "+changes" when they differ."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "profstream"],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if not (ROOT / rel).exists():  # deleted in the working tree
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
                            ).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "profstream"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return commit + ("+changes" if dirty else "")


def build(out: Path, python_version: str) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    wheels = needed_wheels(python_version)
    download(wheels, python_version, out / "wheels")
    commit = copy_sources(out / "src")
    for script in ("device_check.py", "gpu_job.py"):
        shutil.copy2(ROOT / "benchmarks" / script, out / script)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    manifest = {"built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "profstream_commit": commit,
                "python_version": python_version, "bytes": size, "files": len(files),
                "wheels": {p.name: p.stat().st_size for p in sorted((out / "wheels").glob("*.whl"))},
                "image_packages_assumed": "IMAGE_PACKAGES of benchmarks/device_bundle.py (KINDS.md, 2026-11-17)"}
    (out / "BUNDLE.json").write_text(json.dumps(manifest, indent=2))
    if size > MAX_BYTES:
        raise SystemExit(f"the bundle is {size / 2**20:.1f} MiB, over its {MAX_BYTES >> 20} MiB limit: see "
                         f"{out / 'BUNDLE.json'} for what takes the room")
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "device-bundle")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (X.Y)")
    args = ap.parse_args()
    manifest = build(args.out, args.python_version)
    print(json.dumps({k: manifest[k] for k in ("profstream_commit", "python_version", "bytes", "files")}
                     | {"wheels": list(manifest["wheels"]), "out": str(args.out)}, indent=2))


if __name__ == "__main__":
    main()
