"""Device counters in the training process: the NVML backend read through the real pynvml
(against tests/nvml_double.c, as no GPU can run here), the sampler thread, and the
Monitor that sends what it reads to Kafka, where the processors turn it into figures."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from profstream.devices import DeviceSample
from profstream.devices.backend import DeviceUnavailable, device_ordinals
from profstream.devices.nvml import nvml_index_of, open_nvml
from profstream.devices.sampler import DeviceSampler, start_sampler
from profstream.kafka.clients import read_topic
from profstream.processors.stream import RawMessage, figures
from profstream.producers.monitor import Monitor
from profstream.producers.sender import DEVICE_PRODUCER_SUFFIX
from profstream.schema import decode, decode_batch
from profstream.schema.codec import VERSIONS
from tests.helpers import topic_size, wait_until
from tests.nvml import NOT_SUPPORTED, UNKNOWN


def _read_twice(backend):
    """Two readings 30 ms apart: the second has rates."""
    backend.read()
    time.sleep(0.03)  # the counters must grow between the readings: time has to pass, no condition to poll
    return backend.read()


def test_nvml_readings_come_in_our_units(nvml):
    nvml.set(0, gpu_util=73, mem_util=41, mem_used=30 * 10**9, mem_total=80 * 10**9, power_mw=412_500,
             power_limit_mw=700_000, temperature=67, sm_clock=1755, reasons=0x44,
             pcie_rx_rate=2e9, pcie_tx_rate=5e8, nvlink_rx_rate=3e10, nvlink_tx_rate=1e10)
    backend = open_nvml([0], {})
    try:
        first = backend.read()[0]
        (s,) = _read_twice(backend)
    finally:
        backend.close()
    assert math.isnan(first.pcie_rx)  # no rate before a second reading
    assert (s.device, s.gpu_util, s.mem_util) == (0, 0.73, 0.41)
    assert (s.mem_used, s.mem_total) == (30 * 10**9, 80 * 10**9)
    assert (s.power_w, s.power_limit_w, s.temperature_c, s.sm_clock_mhz) == (412.5, 700.0, 67.0, 1755.0)
    assert s.throttle_reasons == 0x44
    assert s.pcie_rx == pytest.approx(2e9, rel=0.01) and s.pcie_tx == pytest.approx(5e8, rel=0.01)
    assert s.nvlink_rx == pytest.approx(3e10, rel=0.01) and s.nvlink_tx == pytest.approx(1e10, rel=0.01)
    assert backend.unsupported == set() and backend.read_errors == 0


def test_a_field_the_device_lacks_is_left_empty_named_once_and_never_asked_again(nvml, caplog):
    nvml.fail(0, "power_mw", NOT_SUPPORTED)
    nvml.fail(0, "nvlink_rx_rate", NOT_SUPPORTED)
    backend = open_nvml([0], {})
    with caplog.at_level(logging.INFO, logger="profstream"):
        readings = [backend.read()[0] for _ in range(5)]
    backend.close()
    assert all(math.isnan(r.power_w) and math.isnan(r.nvlink_rx) for r in readings)
    assert all(r.temperature_c == 45.0 for r in readings)  # the rest is read as ever
    assert backend.unsupported == {"cuda:0 power_w", "cuda:0 nvlink_rx"}
    assert nvml.calls(0, "power_mw") == 1 and nvml.calls(0, "nvlink_rx_rate") == 1
    assert backend.read_errors == 0
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]  # not logged per sample


def test_a_failing_read_leaves_that_sample_empty_counts_each_failure_and_warns_once(nvml, caplog):
    nvml.fail(0, "temperature", UNKNOWN)
    backend = open_nvml([0], {})
    with caplog.at_level(logging.WARNING, logger="profstream"):
        readings = [backend.read()[0] for _ in range(3)]
        nvml.fail(0, "temperature", 0)
        recovered = backend.read()[0]
    backend.close()
    assert all(math.isnan(r.temperature_c) for r in readings) and recovered.temperature_c == 45.0
    assert backend.read_errors == 3 and backend.unsupported == set()
    assert len([r for r in caplog.records if "temperature" in r.getMessage()]) == 1


def test_pcie_throughput_stands_in_where_the_driver_has_no_pcie_counters(nvml):
    nvml.set(0, pcie_rx_rate=4 * 1024**3, pcie_tx_rate=1024**3)
    nvml.fail(0, "pcie_rx_rate", NOT_SUPPORTED)
    nvml.fail(0, "pcie_tx_rate", NOT_SUPPORTED)
    backend = open_nvml([0], {})
    (s,) = _read_twice(backend)
    backend.close()
    assert (s.pcie_rx, s.pcie_tx) == (4 * 1024**3, 1024**3)
    assert backend.unsupported == set()


def test_cuda_ordinals_follow_cuda_visible_devices(nvml):
    assert nvml_index_of(1, {}) == 1
    assert nvml_index_of(1, {"CUDA_VISIBLE_DEVICES": "2,3"}) == 3
    assert nvml_index_of(0, {"CUDA_VISIBLE_DEVICES": "GPU-d0b1e000"}) == "GPU-d0b1e000"
    with pytest.raises(DeviceUnavailable, match="not among CUDA_VISIBLE_DEVICES"):
        nvml_index_of(2, {"CUDA_VISIBLE_DEVICES": "0,1"})
    nvml.reset(devices=3)
    nvml.set(2, gpu_util=90)
    backend = open_nvml([0], {"CUDA_VISIBLE_DEVICES": "GPU-d0b1e000-0000-4000-8000-000000000002"})
    assert backend.read()[0].gpu_util == 0.9  # NVML's device 2, read as cuda:0
    backend.close()
    with pytest.raises(DeviceUnavailable, match="cuda:5"):
        open_nvml([5], {})
    assert device_ordinals("cuda:3", None) == ("cuda", [3])
    assert device_ordinals("cuda", "0,2") == ("cuda", [0, 2])


def test_a_device_lost_mid_run_stops_the_sampler_with_one_warning_and_nothing_else(nvml, caplog):
    nvml.reset(devices=2)
    got: list[DeviceSample] = []
    sampler = DeviceSampler(open_nvml([0, 1], {}), got.append, interval_s=0.01)
    with caplog.at_level(logging.WARNING, logger="profstream"):
        sampler.start()
        wait_until(lambda: len(got) >= 6, 10, "readings of both devices")
        nvml.lose(1)
        sampler.join(10)
    assert not sampler.is_alive()
    assert "cuda:1" in sampler.stats()["device_lost"]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "training goes on" in warnings[0].getMessage()
    assert {s.device for s in got} == {0, 1}


def test_the_sampler_reads_on_its_own_thread_at_its_interval(nvml):
    threads: set[str] = set()

    def record(sample: DeviceSample) -> None:
        threads.add(threading.current_thread().name)

    sampler = DeviceSampler(open_nvml([0], {}), record, interval_s=0.02, name="profstream-devices-t")
    started = time.monotonic()
    sampler.start()
    wait_until(lambda: sampler.readings >= 10, 10, "ten readings")
    elapsed = time.monotonic() - started
    sampler.stop()
    assert threads == {"profstream-devices-t"}
    assert elapsed >= 9 * 0.02  # not faster than the interval
    assert sampler.stats()["device_sampler_cpu_s"] > 0


def test_no_sampler_and_no_thread_for_cpu_producers_or_interval_zero(nvml):
    opts = {"device": "cpu", "counter_devices": None, "device_interval_ms": 500.0, "run_id": "r", "rank": 0}
    assert start_sampler(opts, print) is None
    assert start_sampler({**opts, "device": "cuda:0", "device_interval_ms": 0}, print) is None


def test_an_ascend_producer_is_told_in_one_line_that_no_backend_reads_npus_yet(caplog):
    opts = {"device": "npu:0", "counter_devices": None, "device_interval_ms": 500.0, "run_id": "r", "rank": 0}
    with caplog.at_level(logging.INFO, logger="profstream"):
        assert start_sampler(opts, print) is None
    (line,) = caplog.records
    assert line.levelno == logging.INFO and "Ascend" in line.getMessage()


def test_without_nvml_a_gpu_monitor_says_so_in_one_information_line_and_starts_no_thread(kafka_bootstrap, topics):
    """No NVIDIA driver here: a child process, whose pynvml finds no libnvidia-ml."""
    script = textwrap.dedent(f"""
        import logging, threading
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
        from profstream import Monitor
        mon = Monitor(run_id="no-nvml", device="cuda:0", bootstrap="{kafka_bootstrap}",
                      topic_prefix="{topics.prefix}")
        with mon.step():
            pass
        print("threads:", sorted(t.name.split("-")[1] for t in threading.enumerate() if t.name.startswith("profstream")))
        print("closed:", mon.close())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "profstream" in line and "kafka" not in line]
    assert lines == ["INFO profstream.devices profstream: device counters are off: no NVML library "
                     "(libnvidia-ml.so.1): no NVIDIA driver on this machine"], done.stderr
    # the Sender and the capture request reader run; no device sampler thread
    assert "threads: ['control', 'sender']" in done.stdout and "closed: True" in done.stdout


def test_a_gpu_monitor_streams_device_counters_that_become_figures_of_its_steps(nvml, kafka_bootstrap, topics):
    nvml.set(0, gpu_util=81, power_mw=355_000, temperature=71, reasons=0x20, mem_used=12 * 10**9)
    mon = Monitor(run_id="devices-e2e", device="cuda:0", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix,
                  device_interval_ms=10)
    for _ in range(4):
        with mon.step():
            first = mon.stats().get("device_readings", 0)
            wait_until(lambda f=first: mon.stats()["device_readings"] >= f + 3, 10, "three readings in the step")
    assert mon.close()
    stats = mon.stats()
    assert stats["dropped_samples"] == 0 and stats["device_fields_unsupported"] == []

    total = topic_size(kafka_bootstrap, topics.raw)
    messages = read_topic(kafka_bootstrap, topics.raw, lambda m: True, total, 30, decode=bytes)
    assert len(messages) == total
    device_batches = [m for m in messages if m[:10] == VERSIONS[("EventBatch", 5)].header]  # v5: device samples
    others = [m for m in messages if m[:10] != VERSIONS[("EventBatch", 5)].header]
    assert device_batches and others
    assert all(m[:10] in (VERSIONS[("EventBatch", 4)].header, VERSIONS[("EventBatch", 8)].header)
               for m in others)  # v4, or v8 where a mark carries work
    assert {decode_batch(m).producer_id for m in device_batches} == {mon.producer_id + DEVICE_PRODUCER_SUFFIX}

    steps = [f for f in figures(RawMessage(time.time(), 0, i, b"devices-e2e/0", m) for i, m in enumerate(messages))
             if f.kind == "steps"]
    records = [decode("StepMetrics", f.value) for f in steps]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records:
        (d,) = r["devices"]
        assert d["device"] == "cuda:0" and d["samples"] >= 3
        assert (d["gpu_util"], d["power_w"], d["temperature_max_c"]) == (pytest.approx(0.81), 355.0, 71.0)
        assert d["mem_used_peak"] == 12 * 10**9 and d["throttled_thermal"] and not d["throttled_power"]


@pytest.mark.parametrize("value, interval_s", [("20", 0.02), ("0", None)])
def test_profstream_device_interval_ms_sets_the_sampling_interval_or_turns_it_off(nvml, kafka_bootstrap, topics,
                                                                                  monkeypatch, value, interval_s):
    monkeypatch.setenv("PROFSTREAM_DEVICE_INTERVAL_MS", value)
    mon = Monitor(run_id="env-interval", device="cuda:0", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix)
    try:
        sampler = mon._device_sampler
        if interval_s is None:
            assert sampler is None
            assert not [t for t in threading.enumerate() if t.name.startswith("profstream-devices")]
        else:
            assert sampler.interval_s == interval_s
            wait_until(lambda: mon.stats()["device_readings"] >= 3, 10, "three readings")
    finally:
        assert mon.close()
