"""A real distributed job: torch.distributed (gloo, CPU), three processes launched through
`profstream run`, DDP on a small model (its gradients all_reduced) and an explicit
all_gather each step. Rank 1 sleeps DELAY_S before its collectives on the SLOW steps.

What the run's cross-rank figures must say: every collective matched on every rank; on
the slowed steps rank 1 is the late rank and the other ranks waited about DELAY_S for it
(within TOLERANCE: the delay sits in each rank's arrival, which also holds its own compute
of a few ms, on a machine shared with the other two ranks); bandwidth is bytes / transfer
time with the message sizes of the real tensors; the step-time figures from the real
processes (ranks reported, skew) show all ranks held alike on the slowed steps, which is
why the late rank is found from the collectives and not from step times. On the other
steps no rank is held for more than half the delay, from step 2 on: in steps 0-1 each rank
starts its profiler and DDP warms up, up to a second apart on a shared machine (the
figures then rightly name a late rank). The ranks share one host's clock: the offsets the
run stage learns from the real calls are 0 within their error bounds, every step.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from profstream.producers import native
from profstream.producers.sender import COLLECTIVE_PRODUCER_SUFFIX
from profstream.schema.batch import decode_batch
from profstream.schema.codec import decode
from tests.helpers import read_full
from tests.test_processor import RunningProcessor

pytestmark = pytest.mark.multiproc
torch = pytest.importorskip("torch")

WORLD = 3
STEPS = 8
SLOW = (3, 6)
DELAY_S = 0.3
TOLERANCE = 0.25  # of DELAY_S
HIDDEN = 64
PARAM_BYTES = 4 * (32 * HIDDEN + HIDDEN + HIDDEN * 4 + 4)  # float32 weights and biases of the model
GATHER_BYTES = 4 * 16  # each rank's per-sample losses of a batch

SCRIPT = textwrap.dedent(f'''
    import os, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16 * {STEPS}, 32), torch.randn(16 * {STEPS}, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(32, {HIDDEN}), torch.nn.ReLU(), torch.nn.Linear({HIDDEN}, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(loader):
        if rank == 1 and step in {SLOW}:
            time.sleep({DELAY_S})  # late to this step's collectives
        optimizer.zero_grad()
        losses = ((model(x) - y) ** 2).mean(dim=1)
        losses.mean().backward()  # DDP: all_reduce of the gradients
        gathered = [torch.zeros(16) for _ in range({WORLD})]
        dist.all_gather(gathered, losses.detach())
        optimizer.step()
    dist.destroy_process_group()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(kafka_bootstrap, topics, tmp_path, run_id: str, script_text: str = SCRIPT, world: int = WORLD,
               options: dict | None = None) -> None:
    script = tmp_path / f"{run_id}.py"
    script.write_text(script_text)
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "PROFSTREAM_OPTIONS": json.dumps({"host_sample_interval_s": 0, **(options or {})}),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "profstream.cli", "run", "--bootstrap", kafka_bootstrap, "--run-id", run_id,
             "--topic-prefix", topics.prefix, "--collective-bytes", "--", sys.executable, str(script)],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-3000:]}"
        # the compiled Monitor where it builds (it says so when it falls back to Python)
        assert native.load()[0] is None or "Monitor runs in Python" not in out, f"rank {rank}:\n{out[-3000:]}"
    if native.load()[0] is not None:  # and its collective calls went in batches of their own
        ranks: set[int] = set()

        def first_of_rank(b) -> bool:  # one batch of calls per rank
            new = b.run_id == run_id and b.producer_id.endswith(COLLECTIVE_PRODUCER_SUFFIX) and b.rank not in ranks
            if new:
                ranks.add(b.rank)
            return new

        calls = read_full(kafka_bootstrap, topics.raw, first_of_rank, world, 60, decode=decode_batch,
                          what="ranks' collective batches")
        assert {b.rank for b in calls} == set(range(world)), [(b.rank, b.producer_id) for b in calls]


def test_a_late_rank_is_named_and_the_others_wait_for_it(kafka_bootstrap, topics, tmp_path):
    run_id = "ddp-late"
    _run_ranks(kafka_bootstrap, topics, tmp_path, run_id)
    with RunningProcessor(kafka_bootstrap, topics, run_grace_s=20.0):
        steps = read_full(kafka_bootstrap, topics.run, lambda r: r["run_id"] == run_id, STEPS, 120,
                          decode=lambda v: decode("RunStepMetrics", v), what="RunStepMetrics")
    assert sorted(s["step"] for s in steps) == list(range(STEPS))
    delay_ns = DELAY_S * 1e9
    for s in steps:
        where = f"step {s['step']}: {s}"
        # every rank reported the step, and each step's collectives matched on all of them (DDP
        # adds broadcasts of its own in its first steps)
        assert s["ranks_reported"] == WORLD and sorted(s["step_times_ns"]) == [str(r) for r in range(WORLD)], where
        assert s["collectives_matched"] >= 2 and s["unmatched_collectives"] == [], where
        by = {c["collective"]: c for c in s["by_collective"]}
        assert {"all_reduce", "all_gather"} <= set(by), where
        assert by["all_reduce"]["calls"] == by["all_gather"]["calls"] == 1, where
        # bytes are the real tensors': the gradients' bucket, the gathered losses (output = n x input)
        assert by["all_reduce"]["bytes"] == WORLD * PARAM_BYTES, where
        assert by["all_gather"]["bytes"] == WORLD * WORLD * GATHER_BYTES, where
        for c in by.values():
            assert c["transfer_ns"] > 0, where
            assert c["algbw_bytes_per_s"] == pytest.approx(c["bytes"] / c["transfer_ns"] * 1e9), where
        factor = 2 * (WORLD - 1) / WORLD
        assert by["all_reduce"]["busbw_bytes_per_s"] == pytest.approx(by["all_reduce"]["algbw_bytes_per_s"] * factor)
        waits = {r["rank"]: r["wait_ns"] for r in s["collective_ranks"]}
        if s["step"] in SLOW:
            assert s["late_rank"] == 1, where
            assert abs(s["late_rank_held_ns"] - delay_ns) < TOLERANCE * delay_ns, where
            for rank in (0, 2):
                assert abs(waits[rank] - delay_ns) < TOLERANCE * delay_ns, where
            assert waits[1] < TOLERANCE * delay_ns, where
            # the collectives hold every rank: all step times carry the delay, so they do not
            # tell the late rank apart (skew stays small)
            assert s["min_step_time_ns"] >= (1 - TOLERANCE) * delay_ns, where
            assert s["skew"] < 0.5, where
        elif s["step"] >= 2:  # steps 0-1: the ranks start their profilers and DDP warms up
            assert s["late_rank_held_ns"] < 0.5 * delay_ns, where
        # one host, one clock: every rank's learned offset is 0 within its error bound, which
        # the real calls keep well under the delay the figures measure
        offsets = {c["rank"]: c for c in s["clock_offsets"]}
        assert sorted(offsets) == list(range(WORLD)), where
        for c in offsets.values():
            assert abs(c["offset_ns"]) <= c["error_ns"] < TOLERANCE * delay_ns, where


# -- every collective of every process group, op capture off: torch's Flight Recorder ------

MESH_WORLD = 4
MESH_STEPS = 6
MESH_SLOW = (3,)
MESH_SCRIPT = textwrap.dedent(f'''
    import time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # a 2 x 2 mesh: "TP" pairs (0, 1), (2, 3); "DP" pairs (0, 2), (1, 3). Every rank makes every group
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16 * {MESH_STEPS}, 32), torch.randn(16 * {MESH_STEPS}, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 4), process_group=dp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(loader):
        if rank == 1 and step in {MESH_SLOW}:
            time.sleep({DELAY_S})  # late to its TP group's all_reduce
        optimizer.zero_grad()
        h = x.clone()
        dist.all_reduce(h, group=tp)  # "TP": the activations summed over the pair
        ((model(h) - y) ** 2).mean().backward()  # "DP": DDP's bucket all_reduced over the other pair
        optimizer.step()
    dist.destroy_process_group()
''')


def _mesh_run(kafka_bootstrap, topics, tmp_path, run_id: str, capture: bool) -> dict[int, dict]:
    _run_ranks(kafka_bootstrap, topics, tmp_path, run_id, MESH_SCRIPT, MESH_WORLD,
               {"scheduled_capture": capture})
    with RunningProcessor(kafka_bootstrap, topics, run_grace_s=20.0):
        steps = read_full(kafka_bootstrap, topics.run, lambda r: r["run_id"] == run_id, MESH_STEPS, 120,
                          decode=lambda v: decode("RunStepMetrics", v), what="RunStepMetrics")
    return {s["step"]: s for s in steps}


def test_every_collective_of_two_process_groups_is_matched_with_capture_off(kafka_bootstrap, topics, tmp_path):
    """Four ranks, two groups each (2 x 2 "TP" x "DP") and DDP on the "DP" group, ops not
    captured: each step's four all_reduces (one per TP pair, one DDP bucket per DP pair)
    are matched across their members; rank 1, late to its TP pair on a slowed step, is the
    late rank and rank 0, its partner, waited for it. A run with op capture on gives the
    same figures (its calls come from the same recorder: op capture numbers none of a run
    with more than one group). gloo's recorder keeps no end: no transfer figures."""
    off = _mesh_run(kafka_bootstrap, topics, tmp_path, "mesh-off", capture=False)
    on = _mesh_run(kafka_bootstrap, topics, tmp_path, "mesh-on", capture=True)
    delay_ns = DELAY_S * 1e9
    for figures in (off, on):
        assert sorted(figures) == list(range(MESH_STEPS))
        for step, s in figures.items():
            where = f"step {step}: {s}"
            assert s["ranks_reported"] == MESH_WORLD and s["unmatched_collectives"] == [], where
            by = {c["collective"]: c for c in s["by_collective"]}
            # DDP broadcasts in its first steps besides
            assert by["all_reduce"]["calls"] == 4, where
            assert s["collectives_matched"] == sum(c["calls"] for c in by.values()), where
            waits = {r["rank"]: r["wait_ns"] for r in s["collective_ranks"]}
            assert sorted(waits) == list(range(MESH_WORLD)), where
            if step in MESH_SLOW:
                assert s["late_rank"] == 1, where
                assert abs(waits[0] - delay_ns) < TOLERANCE * delay_ns, where
                assert waits[1] < TOLERANCE * delay_ns, where
    for step in MESH_SLOW:  # the capture-on run's figures within timing noise of the capture-off run's
        w_off = {r["rank"]: r["wait_ns"] for r in off[step]["collective_ranks"]}
        w_on = {r["rank"]: r["wait_ns"] for r in on[step]["collective_ranks"]}
        assert abs(w_off[0] - w_on[0]) < TOLERANCE * delay_ns, (off[step], on[step])
        assert off[step]["late_rank"] == on[step]["late_rank"] == 1
