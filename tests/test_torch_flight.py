"""Always-on collectives of the torch producer (integrations/torch_flight.py): torch's own
Flight Recorder read by a thread of the Monitor, in real gloo processes; the watermark the
reader holds until a step's calls are in."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.test_collectives import _monitor_without_sender_thread

torch = pytest.importorskip("torch")


def test_a_source_that_holds_the_watermark_keeps_it_at_the_steps_it_completed():
    mon, _sender = _monitor_without_sender_thread()
    mon.hold_watermark("collectives")
    for _ in range(3):
        with mon.step():
            pass
    assert mon.buffer.watermark is None  # the steps ended; the reader has said nothing yet
    mon.complete_through(1, source="collectives")
    assert mon.buffer.watermark == 1
    mon.complete_through(5, source="collectives")
    assert mon.buffer.watermark == 2  # no further than the steps themselves
    mon.release_watermark("collectives")
    assert mon.buffer.watermark == 2
    mon.close()


def test_steps_are_found_by_time_and_complete_once_the_next_began():
    mon, _sender = _monitor_without_sender_thread()
    for _step, start in ((0, 100), (1, 200), (2, 300)):
        mon.begin_step(ts_ns=start)
        mon.end_step(ts_ns=start + 50)
    assert [mon.step_at(t) for t in (99, 100, 180, 250, 1000)] == [None, 0, 0, 1, 2]
    assert [mon.complete_before(t) for t in (150, 200, 299, 300)] == [None, 0, 0, 1]
    mon.close()


SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    from tests.test_collectives import _monitor_without_sender_thread
    from profstream.integrations.torch_flight import FlightReader

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    mon, sender = _monitor_without_sender_thread()
    reader = FlightReader(mon, interval_s=3600)  # read by the test's calls
    t = torch.ones(256)
    dist.all_reduce(t)  # before the first step: in no step
    with mon.step():
        dist.all_reduce(t, group=pair)
        dist.all_gather_into_tensor(torch.empty(4 * 256), t)
    mon.begin_step()
    if rank == 2:
        time.sleep(1.0)  # late: rank 3 sits in the pair's call meanwhile
    work = dist.all_reduce(t, group=pair, async_op=True)
    time.sleep(0.5)
    reader.read()
    open_call = reader.open_call
    work.wait()
    mon.end_step()
    mon.begin_step()  # step 1 is complete once step 2 began
    time.sleep(0.2)  # torch marks a call completed a moment after it returned
    reader.read()
    drained = mon.buffer.drain(10000)
    rows = [list(r) for r in drained.collectives]
    print("RESULT", json.dumps({"rows": rows, "open": open_call, "watermark": mon.buffer.watermark}))
    dist.destroy_process_group()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, text: str) -> dict[int, dict]:
    """``text`` run by four gloo processes; each one's RESULT line."""
    script = tmp_path / "flight.py"
    script.write_text(text)
    port = str(_free_port())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
                                   "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])})
             for r in range(4)]
    results = {}
    try:
        for r, p in enumerate(procs):
            out = p.communicate(timeout=120)[0]
            assert p.returncode == 0, out[-3000:]
            line = next(x for x in out.splitlines() if x.startswith("RESULT "))
            results[r] = json.loads(line[len("RESULT "):])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def test_the_reader_records_every_group_with_members_sizes_and_the_open_call(tmp_path):
    """Four gloo processes, pairs (0, 1) and (2, 3) besides the default group: each rank's
    calls of a step come with their group (named with its members), sequence number,
    sizes and start, in the step they were issued in; a call before the first step is in
    none; rank 3, in its pair's all_reduce while rank 2 sleeps, has it as its open call."""
    results = _run(tmp_path, SCRIPT)
    for r, got in results.items():
        pair = "1@0,1" if r < 2 else "2@2,3"
        # (collective, group, dtype, step, seq, start_ns, dur_ns, in_bytes, out_bytes, group_size)
        calls = [(c[0], c[1], c[2], c[3], c[4], c[7], c[8], c[9]) for c in got["rows"]]
        assert calls == [("all_reduce", pair, "Float", 0, 1, 1024, 1024, 2),
                         ("all_gather", "0", "Float", 0, 2, 1024, 4096, 4),
                         ("all_reduce", pair, "Float", 1, 2, 1024, 1024, 2)], (r, got)
        assert all(c[6] == -1 for c in got["rows"])  # gloo's recorder keeps no end
        assert got["watermark"] == 1, got
    assert results[3]["open"][:3] == ["all_reduce", "2@2,3", 2], results[3]
    assert results[2]["open"] is None  # it had not entered it when read (it slept)


FSDP_SCRIPT = textwrap.dedent('''
    import json, time
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from tests.test_collectives import _monitor_without_sender_thread
    from profstream.integrations.torch_flight import FlightReader

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mon, sender = _monitor_without_sender_thread()
    reader = FlightReader(mon, interval_s=3600)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=mesh["dp"])
    with mon.step():
        model(torch.randn(4, 16)).sum().backward()
        t = torch.ones(4)
        dist.all_reduce(t, group=mesh["tp"].get_group())
    mon.begin_step()
    time.sleep(0.2)  # torch marks a call completed a moment after it returned
    reader.read()
    rows = [[r[0], r[1], r[3], r[9]] for r in mon.buffer.drain(10000).collectives]
    print("RESULT", json.dumps({"rows": rows}))
    dist.destroy_process_group()
''')


def test_fsdp_on_a_device_mesh_is_recorded_in_the_mesh_groups(tmp_path):
    """FSDP2 (``fully_shard``) on the "dp" dimension of a 2 x 2 DeviceMesh and a user call on
    "tp": FSDP's parameter all_gather and its gradient reduction (an all_reduce: gloo has no
    reduce_scatter) come in the dp group, the user's all_reduce in the tp group, each group
    named with its members."""
    results = _run(tmp_path, FSDP_SCRIPT)
    for r, got in results.items():
        dp = "@" + ("0,2" if r % 2 == 0 else "1,3")
        tp = "@" + ("0,1" if r < 2 else "2,3")
        calls = {(c[0], c[1].partition("@")[1] + c[1].partition("@")[2], c[2], c[3]) for c in got["rows"]}
        assert ("all_gather", dp, 0, 2) in calls, (r, got)
        assert ("all_reduce", dp, 0, 2) in calls, (r, got)
        assert ("all_reduce", tp, 0, 2) in calls, (r, got)
