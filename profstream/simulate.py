"""A synthetic training run, deterministic for a seed: the ground truth of the tests.

``plan_step`` lays out one step of one rank on a virtual clock: a data wait, forward
compute ops, backward compute ops with an all-reduce stream overlapping the second half
of backward, and an optimizer tail. Its ``truth`` holds the figures the processors must
compute, derived here from the layout by direct per-op arithmetic, independently of the
processors' code. ``run_simulation`` sends the plans through real ``Monitor`` objects.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from profstream.devices.backend import DeviceSample
from profstream.kafka.connection import Connection
from profstream.schema.batch import COMMUNICATION, COMPUTE
from profstream.schema.codec import OP_FIGURES
from profstream.simulate_resources import (
    ADVICE,
    FAULTS,
    LOADER_CAPACITY,
    LOADER_QUEUE,
    Readings,
    readings,
    record_readings,
    resources_truth,
)

FORWARD_TYPES = ("MatMul", "LayerNorm", "Softmax", "GeLU", "Add", "Conv2D")
BACKWARD_TYPES = ("MatMulGrad", "LayerNormGrad", "SoftmaxGrad", "GeLUGrad", "Conv2DGrad")
COMM_TYPE = "AllReduce"
OPTIMIZER_TYPE = "AdamW"
QUEUE_NAME = "device_queue"
QUEUE_CAPACITY = 8
DEVICE_MEMORY = 80_000_000_000
HW_THERMAL_SLOWDOWN = 0x40  # NVML clock event reason


@dataclass(frozen=True)
class SimConfig:
    run_id: str = "sim"
    ranks: int = 2
    steps: int = 50
    ops_per_step: int = 200
    step_time_ms: float = 100.0
    comm_share: float = 0.2  # all-reduce time / step time (0: no communication)
    seed: int = 0
    first_step: int = 0
    stall: tuple[int, int] | None = None  # inclusive step range with an empty data queue
    straggler_rank: int | None = None
    straggler_factor: float = 1.5
    leak_bytes_per_step: int = 0
    start_ns: int | None = None  # virtual clock origin (default: now)
    rate: str = "max"  # "max": as fast as possible; "realtime": steps take their virtual time
    device_counters: bool = False  # two device counter samples per step (rank r on cuda:r)
    throttle: tuple[int, int] | None = None  # inclusive step range with thermal throttling (and hot)
    # ops captured on every n-th step only (the Monitor's every_n_steps): the op figures of the
    # other steps are not measured (None in the truth)
    capture_every_n_steps: int | None = None
    # Work per step (docs/figures.md, "Throughput and MFU"); batch_size 0: the steps carry none.
    batch_size: int = 0  # samples per step
    seq_len: int = 512  # tokens per sample
    variable_tokens: bool = False  # packing: each step's tokens drawn in [seq_len/2, seq_len] per sample
    flops_per_token: float = 0.0  # model FLOPs of a token (0: no FLOPs)
    flops_source: str = "given"  # how the Monitor gets them: given (work(flops=...)) or counted (counted_flops)
    peak_tflops: float | None = None  # the Monitor's peak_tflops
    slowdown: tuple[int, int] | None = None  # inclusive step range whose steps take slowdown_factor longer
    slowdown_factor: float = 2.0
    # Host and data-loader readings (simulate_resources.py): one of each a step, the loader's
    # host queue at S; on the stalled steps, what starves them (loader_fault)
    resources: bool = False
    loader_fault: str | None = None  # cpu_bound, input_io, transfer or threads
    comm_tail: tuple[int, int] | None = None  # inclusive step range whose all-reduce runs unhidden after backward

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.steps < 1 or self.ops_per_step < 4:
            raise ValueError("ranks and steps must be >= 1 and ops_per_step >= 4")
        if not 0 <= self.comm_share < 0.5:
            raise ValueError("comm_share must be in [0, 0.5)")
        if self.step_time_ms <= 0:
            raise ValueError("step_time_ms must be > 0")
        if self.rate not in ("max", "realtime"):
            raise ValueError("rate must be 'max' or 'realtime'")
        if self.stall is not None and self.stall[0] > self.stall[1]:
            raise ValueError("stall range A:B needs A <= B")
        if self.throttle is not None and self.throttle[0] > self.throttle[1]:
            raise ValueError("throttle range A:B needs A <= B")
        if self.capture_every_n_steps is not None and self.capture_every_n_steps < 1:
            raise ValueError("capture_every_n_steps must be >= 1")
        if self.batch_size < 0 or self.seq_len < 1 or self.flops_per_token < 0:
            raise ValueError("batch_size and flops_per_token must be >= 0, seq_len >= 1")
        if self.flops_source not in ("given", "counted"):
            raise ValueError("flops_source must be 'given' or 'counted'")
        if self.slowdown is not None and (self.slowdown[0] > self.slowdown[1] or self.slowdown_factor <= 0):
            raise ValueError("slowdown range A:B needs A <= B and a factor > 0")
        if self.loader_fault is not None and (self.loader_fault not in FAULTS or not self.resources):
            raise ValueError(f"loader_fault must be one of {', '.join(FAULTS)}, with resources on")

    def is_stalled(self, step: int) -> bool:
        return self.stall is not None and self.stall[0] <= step <= self.stall[1]

    def captures(self, step: int) -> bool:
        """Whether the Monitor captures the step's ops (every_n_steps counts from step 0)."""
        return self.capture_every_n_steps is None or step % self.capture_every_n_steps == 0


@dataclass
class StepPlan:
    rank: int
    step: int
    start_ns: int
    end_ns: int
    fp_start_ns: int
    bp_end_ns: int
    names: list[str]
    op_types: list[str]
    kinds: list[int]
    streams: list[int]
    op_start_ns: list[int]
    op_dur_ns: list[int]
    memory: list[tuple[int, int, int, int]]  # (ts_ns, allocated, reserved, peak)
    queue: list[tuple[int, int]]  # (ts_ns, size)
    truth: dict = field(default_factory=dict)
    devices: list[tuple[int, DeviceSample]] = field(default_factory=list)  # (ts_ns, sample)
    work: dict | None = None  # tokens, samples, flops (and its split by category) the Monitor is given
    readings: Readings | None = None  # host and data-loader readings (simulate_resources.py)


def _split(total: int, parts: int, rng: np.random.Generator) -> list[int]:
    """``parts`` positive integer durations that add up to ``total``."""
    weights = rng.uniform(0.5, 1.5, parts)
    durs = np.floor(weights / weights.sum() * total).astype(np.int64)
    durs[-1] += total - durs.sum()
    return [int(d) for d in durs]


def plan_step(cfg: SimConfig, rank: int, step: int, start_ns: int) -> StepPlan:
    """The events of one step of one rank, and the figures they must produce."""
    rng = np.random.default_rng([cfg.seed, rank, step])
    base = int(cfg.step_time_ms * 1e6 * rng.uniform(0.97, 1.03))
    if cfg.straggler_rank == rank:
        base = int(base * cfg.straggler_factor)
    if cfg.slowdown is not None and cfg.slowdown[0] <= step <= cfg.slowdown[1]:
        base = int(base * cfg.slowdown_factor)
    stalled = cfg.is_stalled(step)
    data_wait = int(base * (0.6 if stalled else rng.uniform(0.03, 0.08)))
    optimizer = int(base * 0.08)
    fp_bp = base - int(base * 0.05) - optimizer  # compute phase; 5 % of base is slack
    forward = fp_bp * 2 // 5
    backward = fp_bp - forward
    S = start_ns
    F = S + data_wait
    B = F + fp_bp
    gap = int(base * 0.05) // 2
    tail_comm = cfg.comm_tail is not None and cfg.comm_tail[0] <= step <= cfg.comm_tail[1] and cfg.comm_share > 0
    unhidden = int(base * 0.35) if tail_comm else 0  # all-reduce after backward, before the optimizer
    opt_start = B + unhidden + gap
    E = opt_start + optimizer + gap

    n_comm = max(1, cfg.ops_per_step // 20) if cfg.comm_share > 0 else 0
    n_opt = max(1, cfg.ops_per_step // 20)
    n_fwd = (cfg.ops_per_step - n_comm - n_opt) * 2 // 5
    n_bwd = cfg.ops_per_step - n_comm - n_opt - n_fwd

    names: list[str] = []
    types: list[str] = []
    kinds: list[int] = []
    streams: list[int] = []
    starts: list[int] = []
    durs: list[int] = []

    def lay(t0: int, total: int, n: int, type_pool: tuple[str, ...], kind: int, stream: int, tag: str) -> None:
        t = t0
        for i, d in enumerate(_split(total, n, rng)):
            op_type = type_pool[i % len(type_pool)]
            names.append(f"{tag}{i // len(type_pool)}/{op_type}")
            types.append(op_type)
            kinds.append(kind)
            streams.append(stream)
            starts.append(t)
            durs.append(d)
            t += d

    lay(F, forward, n_fwd, FORWARD_TYPES, COMPUTE, 0, "fwd")
    lay(F + forward, backward, n_bwd, BACKWARD_TYPES, COMPUTE, 0, "bwd")
    comm_total = 0
    if n_comm:
        # All-reduce starts under backward and half of it runs past B: overlapped, then
        # partly pure communication, then overlapping the optimizer.
        comm_total = unhidden or int(base * cfg.comm_share)
        lay(B if unhidden else B - comm_total // 2, comm_total, n_comm, (COMM_TYPE,), COMMUNICATION, 1, "allreduce")
    lay(opt_start, optimizer, n_opt, (OPTIMIZER_TYPE,), COMPUTE, 0, "opt")

    allocated = 2_000_000_000 + 50_000_000 * rank + cfg.leak_bytes_per_step * (step - cfg.first_step)
    peak = allocated + 500_000_000
    reserved = allocated + 1_000_000_000
    memory = [(S, allocated, reserved, peak), (E, allocated, reserved, peak)]
    queue_at_start = 0 if stalled else int(rng.integers(2, QUEUE_CAPACITY + 1))
    queue = [(S, queue_at_start), (B, 0 if stalled else QUEUE_CAPACITY // 2)]

    plan = StepPlan(rank, step, S, E, F, B, names, types, kinds, streams, starts, durs,
                    memory, queue)
    plan.truth = _truth(plan, comm_total, allocated, reserved, peak)
    if cfg.device_counters:
        plan.devices = _device_samples(cfg, plan, rng)
        plan.truth["device"] = _device_truth(plan.devices)
    if cfg.batch_size:
        plan.work = _work(cfg, np.random.default_rng([cfg.seed, rank, step, 1]))
        plan.truth["work"] = _work_truth(cfg, plan)
    if cfg.resources:
        plan.readings = readings(cfg.loader_fault, stalled)
        plan.truth["resources"] = resources_truth(plan.readings)
    advice = [ADVICE[cfg.loader_fault]] if cfg.resources and stalled and cfg.loader_fault else []
    plan.truth["advice"] = advice + (["tail_allreduce"] if tail_comm else [])
    if not cfg.captures(step):  # the device ran the ops; no op event was sent
        plan.truth.update(NOT_MEASURED, op_types={})
        if plan.work is not None:
            plan.truth["work"]["op_categories"] = {}
    return plan


# The simulator's op types by category (processors/throughput.py names them so), and the
# share of a counted step's FLOPs each gets (the rest: other ops).
SIM_CATEGORIES = {"matmul": ("MatMul", "MatMulGrad"), "conv": ("Conv2D", "Conv2DGrad")}
SIM_FLOPS_SPLIT = {"matmul": 0.8, "conv": 0.15}


def _work(cfg: SimConfig, rng: np.random.Generator) -> dict:
    """What the Monitor is told of a step's work."""
    if cfg.variable_tokens:
        tokens = int(rng.integers(cfg.seq_len // 2, cfg.seq_len + 1, cfg.batch_size).sum())
    else:
        tokens = cfg.batch_size * cfg.seq_len
    flops = cfg.flops_per_token * tokens if cfg.flops_per_token else None
    return {"tokens": tokens, "samples": cfg.batch_size, "flops": flops, "source": cfg.flops_source}


def _work_truth(cfg: SimConfig, plan: StepPlan) -> dict:
    """Throughput and MFU of a step, by direct arithmetic (the definitions of docs/figures.md)."""
    work = plan.work
    seconds = (plan.end_ns - plan.start_ns) / 1e9
    flops = work["flops"]
    peak = cfg.peak_tflops * 1e12 if cfg.peak_tflops else None
    categories = {}
    if flops is not None and cfg.flops_source == "counted":
        for name, types in SIM_CATEGORIES.items():
            time_ns = sum(d for t, d in zip(plan.op_types, plan.op_dur_ns) if t in types)
            f = flops * SIM_FLOPS_SPLIT[name]
            categories[name] = (f, time_ns, f / (time_ns / 1e9))
    return {"tokens": work["tokens"], "samples": work["samples"], "flops": flops,
            "flops_source": cfg.flops_source if flops is not None else None, "peak_flops": peak,
            "tokens_per_s": work["tokens"] / seconds, "samples_per_s": work["samples"] / seconds,
            "flops_per_s": flops / seconds if flops is not None else None,
            "mfu": flops / (seconds * peak) if flops is not None and peak else None,
            "op_categories": categories}


# The op figures of a step whose ops were not captured (StepMetrics v6)
NOT_MEASURED = dict.fromkeys(OP_FIGURES)


def _device_samples(cfg: SimConfig, plan: StepPlan, rng: np.random.Generator) -> list[tuple[int, DeviceSample]]:
    """Two readings of the rank's device, at 1/3 and 2/3 of the step; a throttled step is
    hot, slower clocked and flagged with HW_THERMAL_SLOWDOWN."""
    S, E = plan.start_ns, plan.end_ns
    hot = cfg.throttle is not None and cfg.throttle[0] <= plan.step <= cfg.throttle[1]
    util = plan.truth["utilization"]
    out = []
    for k in (1, 2):
        out.append((S + (E - S) * k // 3, DeviceSample(
            device=plan.rank, gpu_util=round(util * rng.uniform(0.95, 1.0), 3), mem_util=round(rng.uniform(0.2, 0.4), 3),
            mem_used=plan.memory[0][2] + k * 1_000_000, mem_total=DEVICE_MEMORY,
            power_w=round(rng.uniform(250, 650), 1), power_limit_w=700.0,
            temperature_c=float(rng.integers(86, 92) if hot else rng.integers(55, 70)),
            sm_clock_mhz=1410.0 if hot else 1980.0, throttle_reasons=HW_THERMAL_SLOWDOWN if hot else 0,
            pcie_rx=float(rng.integers(1, 4) * 10**9), pcie_tx=float(rng.integers(1, 4) * 10**8),
            nvlink_rx=float(rng.integers(10, 40) * 10**9), nvlink_tx=float(rng.integers(10, 40) * 10**9))))
    return out


def _device_truth(samples: list[tuple[int, DeviceSample]]) -> dict:
    """The device figures of a step's samples, by direct arithmetic."""
    values = [s for _, s in samples]

    def mean(name: str) -> float:
        return sum(getattr(s, name) for s in values) / len(values)

    reasons = 0
    for s in values:
        reasons |= s.throttle_reasons
    return {"samples": len(values), "gpu_util": mean("gpu_util"), "mem_util": mean("mem_util"),
            "mem_used_peak": max(s.mem_used for s in values), "mem_total": DEVICE_MEMORY,
            "power_w": mean("power_w"), "power_peak_w": max(s.power_w for s in values), "power_limit_w": 700.0,
            "temperature_max_c": max(s.temperature_c for s in values), "sm_clock_mhz": mean("sm_clock_mhz"),
            "throttle_reasons": reasons, "throttled_power": False, "throttled_thermal": bool(reasons),
            "pcie_rx": mean("pcie_rx"), "pcie_tx": mean("pcie_tx"), "nvlink_rx": mean("nvlink_rx"),
            "nvlink_tx": mean("nvlink_tx")}


def _truth(plan: StepPlan, comm_total: int, allocated: int, reserved: int, peak: int) -> dict:
    """Figures of the plan by direct arithmetic over its ops (independent of processors/)."""
    S, E = plan.start_ns, plan.end_ns
    start = np.array(plan.op_start_ns, dtype=np.int64)
    end = start + np.array(plan.op_dur_ns, dtype=np.int64)
    kinds = np.array(plan.kinds)
    cs, ce = start[kinds == COMPUTE], end[kinds == COMPUTE]
    ms, me = start[kinds == COMMUNICATION], end[kinds == COMMUNICATION]
    compute_ns = int((ce - cs).sum())  # compute ops never overlap each other here
    comm_ns = int((me - ms).sum())  # neither do all-reduce ops
    # every (communication, compute) pair's intersection
    pairs = np.minimum.outer(me, ce) - np.maximum.outer(ms, cs)
    overlap_ns = int(np.clip(pairs, 0, None).sum())
    union_ns = compute_ns + comm_ns - overlap_ns
    step_time = E - S
    by_type: dict[str, list[int]] = {}
    for t, d in zip(plan.op_types, plan.op_dur_ns):
        entry = by_type.setdefault(t, [0, 0])
        entry[0] += d
        entry[1] += 1
    queue_sizes = [size for _, size in plan.queue]
    return {
        "step_time_ns": step_time,
        "data_wait_ns": plan.fp_start_ns - S,
        "fp_bp_ns": plan.bp_end_ns - plan.fp_start_ns,
        "tail_ns": E - plan.bp_end_ns,
        "compute_ns": compute_ns,
        "comm_ns": comm_ns,
        "overlap_ns": overlap_ns,
        "pure_comm_ns": comm_ns - overlap_ns,
        "idle_ns": step_time - union_ns,
        "utilization": compute_ns / step_time,
        "overlap_ratio": overlap_ns / comm_ns if comm_ns else 0.0,
        "op_types": {t: (v[0], v[1]) for t, v in by_type.items()},
        "memory": {"peak": peak, "allocated": allocated, "reserved": reserved},
        "queue": {"min": min(queue_sizes), "mean": sum(queue_sizes) / len(queue_sizes),
                  "last": queue_sizes[-1], "at_start": queue_sizes[0],
                  "empty_ratio": queue_sizes.count(0) / len(queue_sizes)},
        "comm_total_ns": comm_total,
    }


def plan_run(cfg: SimConfig, start_ns: int | None = None, ranks: range | None = None):
    """Yield the StepPlans of every rank (or of ``ranks`` only: a rank's plans do not depend
    on the others), step by step (all ranks of step s, then s+1)."""
    origin = start_ns if start_ns is not None else (cfg.start_ns if cfg.start_ns is not None else time.time_ns())
    ranks = range(cfg.ranks) if ranks is None else ranks
    clocks = dict.fromkeys(ranks, origin)
    for step in range(cfg.first_step, cfg.first_step + cfg.steps):
        for rank in ranks:
            plan = plan_step(cfg, rank, step, clocks[rank])
            clocks[rank] = plan.end_ns
            yield plan


def expected(cfg: SimConfig, start_ns: int = 0) -> dict[tuple[int, int], dict]:
    """Ground truth of a run: {(rank, step): truth} (independent of the start time)."""
    return {(p.rank, p.step): p.truth for p in plan_run(cfg, start_ns)}


PHASES = ("start", "body", "end")


def phase_time(plan: StepPlan, phase: str) -> int:
    """When a phase's events are recorded: S, B (forward and backward done), E."""
    return {"start": plan.start_ns, "body": plan.bp_end_ns, "end": plan.end_ns}[phase]


def record_phase(monitor, plan: StepPlan, phase: str) -> None:
    """Feed one phase of a planned step into a Monitor, as a training loop would record it
    while the step runs: the start at S, ops that ended by B at B, the rest at E."""
    if phase == "start":
        monitor.begin_step(plan.step, ts_ns=plan.start_ns)
        ts, size = plan.queue[0]
        monitor.queue(QUEUE_NAME, size, QUEUE_CAPACITY, ts_ns=ts)
        if plan.readings is not None:  # the loader's host queue at S
            monitor.queue(LOADER_QUEUE, plan.readings.queue_at_start, LOADER_CAPACITY, ts_ns=ts)
        monitor.memory(*plan.memory[0][1:], ts_ns=plan.memory[0][0])
        monitor.mark_fp_start(plan.fp_start_ns)
        return
    split = _ops_done_by(plan, plan.bp_end_ns)
    lo, hi = (0, split) if phase == "body" else (split, len(plan.names))
    if hi > lo:
        monitor.ops(plan.names[lo:hi], plan.op_start_ns[lo:hi], plan.op_dur_ns[lo:hi], plan.kinds[lo:hi],
                    plan.op_types[lo:hi], plan.streams[lo:hi])
    if phase == "body":
        monitor.mark_bp_end(plan.bp_end_ns)
        return
    for ts, size in plan.queue[1:]:
        monitor.queue(QUEUE_NAME, size, QUEUE_CAPACITY, ts_ns=ts)
    for ts, alloc, reserved, peak in plan.memory[1:]:
        monitor.memory(alloc, reserved, peak, ts_ns=ts)
    for ts, sample in plan.devices:
        monitor.device_sample(sample, ts_ns=ts, step=plan.step)
    if plan.readings is not None:
        record_readings(monitor, plan.readings, (plan.start_ns + plan.end_ns) // 2, plan.step)
    if plan.work is not None:
        work = plan.work
        monitor.work(tokens=work["tokens"], samples=work["samples"])
        if work["flops"] is not None and work["source"] == "counted":  # as the torch producer's count
            monitor.counted_flops(work["flops"], matmul=work["flops"] * SIM_FLOPS_SPLIT["matmul"],
                                  conv=work["flops"] * SIM_FLOPS_SPLIT["conv"])
        elif work["flops"] is not None:
            monitor.work(flops=work["flops"])
    monitor.end_step(plan.end_ns)


def _ops_done_by(plan: StepPlan, ts: int) -> int:
    """Ops are laid out forward, backward, all-reduce, optimizer: the prefix that ended by ts."""
    n = 0
    for start, dur, kind in zip(plan.op_start_ns, plan.op_dur_ns, plan.kinds):
        if kind != COMPUTE or start + dur > ts:
            break
        n += 1
    return n


def record_step(monitor, plan: StepPlan) -> None:
    """Feed one whole planned step into a Monitor with its exact timestamps."""
    for phase in PHASES:
        record_phase(monitor, plan, phase)


# What a run told to end (SIGTERM) gives its Monitors to flush and close, beyond the Monitors'
# own SIGNAL_FLUSH_S: launchers wait 30 s before SIGKILL.
TERMINATED_CLOSE_S = 10.0
# What the shared producer's close gets at a run's normal end: every rank's end mark sent and
# acknowledged, thousands of them a process, on a box the simulator shares with the broker
# and the processors (a 16,384-rank run at load ~10 took longer than 10 s).
SHARED_CLOSE_S = 60.0


class Terminated(Exception):
    """A signal told the simulation to end (SIGTERM): raised in the main thread."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def sigterm_ends_the_run() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` in the main thread (once) for the block, so that the run
    ends as a run does: Monitors flushed and closed (their end marks say the signal), the
    summary printed. Nothing off the main thread, or where SIGTERM is ignored."""
    if threading.current_thread() is not threading.main_thread() or (
            signal.getsignal(signal.SIGTERM) is signal.SIG_IGN):
        yield
        return
    told: list[int] = []

    def end(signum: int, frame: object) -> None:
        if not told:  # a second one while the first unwinds: the first is being acted on
            told.append(signum)
            raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, end)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class SimResult:
    steps_recorded: int
    ops_recorded: int
    wall_s: float
    flushed: bool
    dropped_ops: int
    stats: list[dict]  # each Monitor's, after its close
    ended_by: int = 0  # the signal that ended the run before its last step (SIGTERM), 0: none

    def dropped(self, what: str) -> int:
        """A drop count of every Monitor's stats(): dropped_samples, dropped_marks, partial_steps..."""
        return sum(s.get(what, 0) for s in self.stats)

    def summary(self, conn: Connection | str) -> str:
        """The line `profstream simulate` prints: what was sent (to ``conn``'s bootstrap; never
        a property of it), and every family dropped."""
        ended = f"; ended by {signal.Signals(self.ended_by).name}" if self.ended_by else ""
        return (f"{self.steps_recorded} steps, {self.ops_recorded} ops sent to {Connection.of(conn)} "
                f"in {self.wall_s:.1f} s; "
                f"dropped ops: {self.dropped_ops}, samples: {self.dropped('dropped_samples')} (step marks: "
                f"{self.dropped('dropped_marks')}, those steps lost whole); steps that lost events: "
                f"{self.dropped('partial_steps')}; {'all delivered' if self.flushed else 'NOT all delivered'}{ended}")


def run_simulation(cfg: SimConfig, monitor_options: dict | None = None, progress=None,
                   ranks: range | None = None, start=None, ended: bool = True,
                   shared_producer: bool = False) -> SimResult:
    """Simulate ``cfg`` through one real Monitor per rank; returns when all is flushed.
    ``ended=False``: the Monitors close as a failed run's do, without their end marks.
    ``shared_producer``: the Monitors (Python recording, no capture-request reader) send
    through one producer and one thread (``producers/shared_sender.py``), so that one
    process can run thousands of ranks; each still encodes its own batches.

    ``ranks`` simulates only those ranks of the run (the others run in other processes,
    :mod:`profstream.simulate_procs`); ``start``, if given, is called once the Monitors
    exist and returns the virtual clock's origin, in ns of ``time.time_ns()``, which every
    process of the run shares (``--rate realtime`` paces steps against it)."""
    from profstream.producers.monitor import Monitor

    ranks = range(cfg.ranks) if ranks is None else ranks
    opts = dict(monitor_options or {})
    opts["run_id"] = cfg.run_id
    opts["world_size"] = cfg.ranks
    opts.setdefault("host_sample_interval_s", 0)
    opts.setdefault("device_interval_ms", 0)  # simulated counters only, never the machine's
    if cfg.capture_every_n_steps is not None:
        opts["every_n_steps"] = cfg.capture_every_n_steps
    if cfg.peak_tflops is not None:
        opts["peak_tflops"] = cfg.peak_tflops
    pool = None
    if shared_producer:
        from profstream.producers.shared_sender import SenderPool

        pool = SenderPool()
        opts.update(native=False, control=False, sender_factory=pool.sender)
    delivered, result = True, None
    try:
        with sigterm_ends_the_run():  # before the Monitors: their SIGTERM handler chains to it
            result = _run(cfg, opts, progress, ranks, start, ended, Monitor)
    finally:
        if pool is not None:  # after every Monitor's close: their end marks' acknowledgements
            delivered = pool.close(SHARED_CLOSE_S if result is not None and not result.ended_by
                                   else TERMINATED_CLOSE_S)
    result.flushed = result.flushed and delivered
    return result


def _run(cfg: SimConfig, opts: dict, progress, ranks: range, start, ended: bool, monitor_type) -> SimResult:
    monitors = {r: monitor_type(rank=r, **{**opts, "device": opts.get("device", f"cuda:{r}" if cfg.device_counters
                                                                       else "cpu")}) for r in ranks}
    steps = ops = 0
    ended_by = 0
    wall0 = time.monotonic()
    try:
        if start is None:
            wall0 = time.monotonic()
            origin = cfg.start_ns if cfg.start_ns is not None else time.time_ns()
        else:
            origin = start()
            wall0 = time.monotonic() + (origin - time.time_ns()) / 1e9  # the monotonic time of origin
        if cfg.rate == "max":
            for plan in plan_run(cfg, origin, ranks):
                record_step(monitors[plan.rank], plan)
                steps += 1
                ops += len(plan.names)
                if progress is not None:
                    progress(plan)
        else:
            plans: list[StepPlan] = []
            for plan in plan_run(cfg, origin, ranks):  # all ranks of a step, then the next step
                plans.append(plan)
                if len(plans) < len(ranks):
                    continue
                for phase in PHASES:
                    delay = (phase_time(plans[0], phase) - origin) / 1e9 - (time.monotonic() - wall0)
                    if delay > 0:
                        time.sleep(delay)
                    for p in plans:
                        record_phase(monitors[p.rank], p, phase)
                for p in plans:
                    steps += 1
                    ops += len(p.names)
                    if progress is not None:
                        progress(p)
                plans = []
    except Terminated as t:  # the Monitors flushed on it already (producers/shutdown.py): close them, within bounds
        ended_by = t.signum
    finally:
        deadline = time.monotonic() + (TERMINATED_CLOSE_S if ended_by else 1e9)
        flushed = all([m.flush(timeout=min(30, max(0.0, deadline - time.monotonic()))) for m in monitors.values()])
        for m in monitors.values():
            m.close(timeout=min(5, max(0.1, deadline - time.monotonic())), ended=ended)
        stats = [m.stats() for m in monitors.values()]  # after close: what it could not deliver is counted
    return SimResult(steps, ops, time.monotonic() - wall0, flushed,
                     sum(s["dropped_ops"] for s in stats), stats, ended_by)
