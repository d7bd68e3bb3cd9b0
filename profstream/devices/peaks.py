"""Dense peak FLOP/s of accelerators, by device model and compute dtype: the denominator of
model FLOPs utilization (docs/figures.md, "Throughput and MFU").

Every number is the vendor's data sheet's, dense (without 2:4 structured sparsity: where a
sheet gives only the sparse figure, marked with its footnote, the dense one is half of it),
in TFLOPS. A device or dtype the table does not know has no peak: MFU is then absent,
never computed against a guess; ``peak_tflops`` (Monitor option, PROFSTREAM_PEAK_TFLOPS)
gives it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


class DevicePeak(NamedTuple):
    model: str  # the table's name of the device
    pattern: str  # regular expression over the device name torch / NVML reports
    tflops: dict[str, float]  # dense peak TFLOPS by dtype
    source: str  # the data sheet


# First match wins: the more specific variants of a model come before its general entry.
PEAKS: tuple[DevicePeak, ...] = (
    # NVIDIA A100 Tensor Core GPU data sheet (PB-10577 / "nvidia-a100-datasheet-us-nvidia-1758950-r4-web"):
    # FP32 19.5, TF32 156 (312 sparse), BF16 312 (624 sparse), FP16 312 (624 sparse); the same for the
    # SXM4 and PCIe boards, 40 and 80 GB.
    DevicePeak("NVIDIA A100", r"\bA100\b", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
               "NVIDIA A100 Tensor Core GPU data sheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
               "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    # NVIDIA H100 Tensor Core GPU data sheet: H100 PCIe FP32 51, TF32 756*, BF16 1,513*, FP16 1,513*,
    # FP8 3,026* (* with sparsity); H100 NVL FP32 60, TF32 835*, BF16 1,671*, FP16 1,671*, FP8 3,341*;
    # H100 SXM FP32 67, TF32 989*, BF16 1,979*, FP16 1,979*, FP8 3,958*.
    DevicePeak("NVIDIA H100 PCIe", r"\bH100\b.*\bPCIe\b",
               {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0},
               "NVIDIA H100 Tensor Core GPU data sheet, https://resources.nvidia.com/en-us-tensor-core/"
               "nvidia-tensor-core-gpu-datasheet"),
    DevicePeak("NVIDIA H100 NVL", r"\bH100 NVL\b",
               {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
               "NVIDIA H100 Tensor Core GPU data sheet, https://resources.nvidia.com/en-us-tensor-core/"
               "nvidia-tensor-core-gpu-datasheet"),
    DevicePeak("NVIDIA H100 SXM", r"\bH100\b",
               {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
               "NVIDIA H100 Tensor Core GPU data sheet, https://resources.nvidia.com/en-us-tensor-core/"
               "nvidia-tensor-core-gpu-datasheet"),
    # NVIDIA H200 Tensor Core GPU data sheet: H200 NVL FP32 60, TF32 835*, BF16 1,671*, FP16 1,671*,
    # FP8 3,341*; H200 SXM FP32 67, TF32 989*, BF16 1,979*, FP16 1,979*, FP8 3,958* (* with sparsity).
    DevicePeak("NVIDIA H200 NVL", r"\bH200 NVL\b",
               {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
               "NVIDIA H200 Tensor Core GPU data sheet, https://nvdam.widen.net/s/nb5zzzsjdf/"
               "hpc-datasheet-sc23-h200-datasheet-3002446"),
    DevicePeak("NVIDIA H200 SXM", r"\bH200\b",
               {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
               "NVIDIA H200 Tensor Core GPU data sheet, https://nvdam.widen.net/s/nb5zzzsjdf/"
               "hpc-datasheet-sc23-h200-datasheet-3002446"),
    # NVIDIA HGX B200 specifications (per GPU, the 8-GPU board's figures / 8): FP32 75,
    # TF32 2.2 PF*, BF16 4.5 PF*, FP16 4.5 PF*, FP8 9 PF* (* with sparsity).
    DevicePeak("NVIDIA B200", r"\bB200\b",
               {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
               "NVIDIA HGX platform specifications (HGX B200), https://www.nvidia.com/en-us/data-center/hgx/"),
    # NVIDIA L40S data sheet: FP32 91.6; TF32 183 | 366*; BF16 362.05 | 733*; FP16 362.05 | 733*;
    # FP8 733 | 1,466* (dense | * with sparsity).
    DevicePeak("NVIDIA L40S", r"\bL40S\b",
               {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0},
               "NVIDIA L40S GPU data sheet, https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    # AMD Instinct MI300X accelerator data sheet: FP32 (matrix) 163.4, TF32 653.7, FP16 1307.4,
    # BF16 1307.4, FP8 2614.9 (dense; with sparsity twice these).
    DevicePeak("AMD Instinct MI300X", r"\bMI300X\b",
               {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
               "AMD Instinct MI300X accelerator data sheet, https://www.amd.com/content/dam/amd/en/documents/"
               "instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf"),
)
# Not in the table, for want of a vendor figure per chip to cite: Huawei Ascend 910B (its
# variants 910B1-B4 differ; give peak_tflops), NVIDIA GH200 and every other device.

_ALIASES = {"float32": "fp32", "float": "fp32", "tensorfloat32": "tf32", "bfloat16": "bf16", "float16": "fp16",
            "half": "fp16", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


def dtype_name(dtype: object) -> str | None:
    """A dtype (``torch.bfloat16``, "bfloat16", "bf16"...) as the table's key, None if unknown."""
    name = str(dtype).rsplit(".", 1)[-1].lower()
    name = _ALIASES.get(name, name)
    return name if name in DTYPES else None


def find_peak(device_name: str, dtype: object) -> tuple[DevicePeak | None, float | None]:
    """(the table's entry for the device, its dense peak FLOP/s for ``dtype``); None where
    the table does not know the device or the dtype."""
    for entry in PEAKS:
        if re.search(entry.pattern, device_name, re.IGNORECASE):
            tflops = entry.tflops.get(dtype_name(dtype) or "")
            return entry, None if tflops is None else tflops * 1e12
    return None, None


def how_to_set(device_name: str, dtype: object) -> str:
    """The one line said when a run has FLOPs but no peak to measure them against."""
    known = ", ".join(e.model for e in PEAKS)
    what = f"{device_name} in {dtype_name(dtype) or dtype}" if dtype is not None else device_name
    return (f"profstream: MFU is not computed: the dense peak FLOP/s of {what} is not in profstream's table "
            f"({known}); give it as peak_tflops (PROFSTREAM_PEAK_TFLOPS=<TFLOPS of one device>)")


def cuda_device_name(ordinal: int) -> str | None:
    """The name of CUDA device ``ordinal`` ("NVIDIA H100 80GB HBM3"), from torch when it has
    initialized CUDA, else from NVML; None where neither can say."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return str(torch.cuda.get_device_name(ordinal))
        except Exception:  # noqa: BLE001 - an odd torch: NVML may still say
            pass
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(ordinal))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library, no such device: nothing to say
        return None
    return name.decode() if isinstance(name, bytes) else str(name)
