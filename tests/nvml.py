"""NVML without a GPU: tests/nvml_double.c, built once per session and driven from here.

No GPU can run on the development and CI machines, so NVIDIA's libnvidia-ml is the one
part the tests replace: by a small C library with NVML's calls, structures and error
codes (tests/nvml_double.c). Everything above it is real: nvidia-ml-py's ``pynvml`` loads
it and makes every call through its own ctypes wrappers, error classes and structures,
and the sampler reads it as it reads a GPU's. ``make gpu-check`` runs the same code against
the real NVML of a GPU machine.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).with_name("nvml_double.c")
FILE_NAME = "libnvidia-ml.so.1"  # what pynvml (and the doctor) load by name, found on LD_LIBRARY_PATH
# Its own soname: loaded here by path, the double never answers a load by NVML's name in
# this process, so tests that expect no NVML stay right whatever ran before them.
SONAME = "libnvml-double.so"
QUANTITIES = ("gpu_util", "mem_util", "mem_used", "mem_total", "power_mw", "power_limit_mw", "temperature",
              "sm_clock", "reasons", "pcie_tx_rate", "pcie_rx_rate", "nvlink_tx_rate", "nvlink_rx_rate",
              "pcie_throughput")
NOT_SUPPORTED, NO_PERMISSION, NOT_FOUND, TIMEOUT, GPU_IS_LOST, UNKNOWN = 3, 4, 6, 10, 15, 999


def build(directory: Path) -> Path:
    """Compile the double into ``directory``/libnvidia-ml.so.1."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.fail("no C compiler for the NVML double: apt-get install g++ (.ci/check-system does)")
    library = directory / FILE_NAME
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-Wl,-soname,{SONAME}",
                    "-o", str(library), str(SOURCE)], check=True, timeout=120)
    return library


class NvmlDouble:
    """The built double, loaded in this process, with its controls."""

    def __init__(self, library: Path) -> None:
        self.library = library
        self.lib = ctypes.CDLL(str(library))
        self.lib.double_set.argtypes = [ctypes.c_uint, ctypes.c_int, ctypes.c_double]
        self.lib.double_calls.restype = ctypes.c_long

    def reset(self, devices: int = 1) -> None:
        """``devices`` devices with default values, none failing, no call counted."""
        self.lib.double_reset(devices)

    def set(self, device: int = 0, **values: float) -> None:
        """Set quantities of ``device``: gpu_util=70 (percent), power_mw=250000, reasons=0x40,
        pcie_rx_rate=1e9 (bytes/s from now on)..."""
        for name, value in values.items():
            assert self.lib.double_set(device, QUANTITIES.index(name), float(value)) == 0, name

    def fail(self, device: int, quantity: str, code: int) -> None:
        """Every read of ``quantity`` on ``device`` answers NVML error ``code`` (0: none)."""
        self.lib.double_fail(device, QUANTITIES.index(quantity), code)

    def lose(self, device: int = 0) -> None:
        """The device falls off the bus: every call answers NVML_ERROR_GPU_IS_LOST."""
        self.lib.double_lose(device)

    def calls(self, device: int, quantity: str) -> int:
        return self.lib.double_calls(device, QUANTITIES.index(quantity))

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make pynvml load this double as libnvidia-ml for the rest of the test."""
        import pynvml

        monkeypatch.setattr(pynvml, "nvmlLib", self.lib)
        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})  # pointers into the old library
        monkeypatch.setattr(pynvml, "_nvmlLib_refcount", 0)

    def environment(self, **values: float | int) -> dict[str, str]:
        """Variables under which a child process loads this double as its NVML, with
        every device set to ``values`` (devices=2, gpu_util=70, fail_power_mw=3, lose_after=5...)."""
        env = {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(self.library.parent),
                                                                os.environ.get("LD_LIBRARY_PATH")]))}
        if values:
            env["NVML_DOUBLE"] = ",".join(f"{k}={v}" for k, v in values.items())
        return env
