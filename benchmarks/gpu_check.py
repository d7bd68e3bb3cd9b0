"""``make gpu-check``: the GPU check on a machine with an NVIDIA GPU and this checkout.

The same check as on a borrowed GPU machine (docs/benchmarks.md, "GPU check"), in one
command where Java and the Kafka jars are at hand: ``device_check.py`` runs the training
job and the overhead series there (the live run recording to a disk spool), then
``device_results.py`` publishes the spool into a broker of its own with a processor,
checks the StepMetrics and compares ``profstream analyze`` with HTA. Prints the results'
JSON summary; exit status 0 when every check passed, 1 when one failed, 2 when this machine
has no CUDA GPU (one line says so).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="where the on-device files go (default: a temporary folder)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print(json.dumps({"ok": False, "error": "torch is not installed: make gpu-check installs it"}))
        return 2
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA GPU on this machine (torch.cuda.is_available() is false): "
                                                "make gpu-check needs one; make device-bundle builds what a GPU "
                                                "machine without a registry runs"}))
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    subprocess.run([sys.executable, str(HERE / "device_check.py"), "--out", str(out), "--budget-s",
                    str(args.budget_s), "--repeats", str(args.repeats)], check=False)
    return subprocess.run([sys.executable, str(HERE / "device_results.py"), str(out)]).returncode


if __name__ == "__main__":
    sys.exit(main())
