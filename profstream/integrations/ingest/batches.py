"""A profile as the raw batches a live producer would send for it, without Kafka or a
Monitor: the input ``profstream analyze`` gives the processors' own entry point
(``processors.stream``).

Per step, in order: its ops (in batches of at most ``MAX_BATCH_OPS``), then one batch
with the step's mark, queue and memory samples and the watermark at the step, as the
Monitor's automatic watermark sends them: the processors close each step at once. The
op columns, names and types are those ``send_profile`` records into a Monitor. With
``ended``, a last batch carries the producer's end mark (step ``END_MARK``, at the last
step's end), as ``ingest``'s Monitor sends it when it closes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np

from profstream.integrations.ingest.model import Profile
from profstream.integrations.ingest.replay import ProfileSteps, StepSlice
from profstream.producers.sender import collective_columns
from profstream.schema.batch import END_MARK, I32, I64, NO_VALUE, SECTIONS, EventBatch

MAX_BATCH_OPS = 32768


def _dictionary(codes: np.ndarray, table: np.ndarray) -> tuple[list[str], np.ndarray]:
    present, idx = np.unique(codes, return_inverse=True)
    return [str(v) for v in table[present]], idx.astype(I32)


def profile_batches(profile: Profile, run_id: str, rank: int, host: str = "", device: str = "",
                    world_size: int | None = None, ended: bool = False) -> Iterator[EventBatch]:
    """The EventBatches of ``profile`` as rank ``rank`` of run ``run_id`` (seq from 0);
    ``ended``: then the end mark of a producer that closed after the last step."""
    steps = ProfileSteps(profile)
    producer_id = uuid.uuid4().hex
    seq = 0
    watermark: int | None = None

    def batch(**fields) -> EventBatch:
        nonlocal seq
        b = EventBatch(run_id=run_id, rank=rank, world_size=world_size, host=host, device=device,
                       producer_id=producer_id, seq=seq, complete_through_step=watermark, **fields)
        seq += 1
        return b

    for st in steps:
        for a in range(st.lo, st.hi, MAX_BATCH_OPS):
            b = min(a + MAX_BATCH_OPS, st.hi)
            yield batch(**_ops(profile, steps, st.step, a, b), sent_ns=st.end_ns)
        watermark = st.step
        yield batch(sent_ns=st.end_ns, **_samples(profile, st))
    if ended and watermark is not None:
        end = st.end_ns
        yield batch(sent_ns=end, steps={"step": np.array([END_MARK], I64), "start_ns": np.array([end], I64),
                                        "end_ns": np.array([end], I64), "fp_start_ns": np.array([NO_VALUE], I64),
                                        "bp_end_ns": np.array([NO_VALUE], I64)})


def _ops(profile: Profile, steps: ProfileSteps, step: int, a: int, b: int) -> dict:
    names, name_idx = _dictionary(steps.name_code[a:b], profile.name_table)
    types, type_idx = _dictionary(steps.type_code[a:b], profile.type_table)
    launch = steps.launches[a:b] if steps.launches is not None else np.full(b - a, NO_VALUE, I64)
    return {"op_names": names, "op_types": types, "ops": {
        "name_idx": name_idx, "type_idx": type_idx, "kind": steps.kinds[a:b], "stream": steps.streams[a:b],
        "step": np.full(b - a, step, I64), "start_ns": steps.starts[a:b], "dur_ns": steps.durs[a:b],
        "launch_ns": launch}}


def _samples(profile: Profile, st: StepSlice) -> dict:
    out: dict = {"steps": {"step": np.array([st.step], I64), "start_ns": np.array([st.start_ns], I64),
                           "end_ns": np.array([st.end_ns], I64), "fp_start_ns": np.array([st.fp_ns], I64),
                           "bp_end_ns": np.array([st.bp_ns], I64)}}
    if st.queues:
        names = sorted({q[0] for q in st.queues})
        code = {n: i for i, n in enumerate(names)}
        out["queue_names"] = names
        out["queues"] = {"name_idx": np.array([code[q[0]] for q in st.queues], I32),
                         **{col: np.array([q[i] for q in st.queues], I64)
                            for i, (col, _) in enumerate(SECTIONS["queues"][1:], start=1)}}
    if st.collectives:
        out["collective_names"], out["collectives"] = collective_columns(
            [(c, g, d, st.step, *rest) for c, g, d, *rest in st.collectives])
    if len(st.memory):
        j = st.memory
        out["memory"] = {"ts_ns": profile.mem_ts_ns[j], "step": np.full(len(j), st.step, I64),
                         "allocated": profile.mem_allocated[j], "reserved": profile.mem_reserved[j],
                         "peak": np.full(len(j), NO_VALUE, I64)}
    return out
