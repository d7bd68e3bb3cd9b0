"""Device counters read inside the training process, on a thread of their own.

- ``backend``: what a backend is (``DeviceBackend``) and one reading (``DeviceSample``);
- ``nvml``: NVIDIA GPUs through NVML (nvidia-ml-py's ``pynvml``);
- ``sampler``: ``open_backend``, which picks the backend for a producer's devices, the
  thread that reads it every interval and hands the samples to the Monitor
  (``Monitor.device_sample``), and ``start_sampler``.

An Ascend backend (npu-smi / DCMI) would be one more module beside ``nvml``;
docs/monitor.md#ascend maps its fields to ours.
"""

from profstream.devices.backend import DeviceBackend, DeviceLost, DeviceSample

__all__ = ["DeviceBackend", "DeviceLost", "DeviceSample"]
