"""The compiled event-tree walk of op capture: built for the installed torch, it reads a
real trace exactly as the Python walk does, capture switches to it after one checked
trace, and a walk that reads differently is dropped for the Python one."""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from profstream.integrations import torch_native  # noqa: E402
from profstream.integrations.torch_ops import (  # noqa: E402
    HostThreads,
    NodeNames,
    native_op_columns,
    tree_op_columns,
)
from profstream.schema.batch import COMMUNICATION, COMPUTE, DATA  # noqa: E402
from tests.test_torch import FailingOpsMonitor, _rows, make, rich_capture, train  # noqa: E402


@pytest.fixture(scope="module")
def walk():
    """The compiled walk, built (or found built) and loaded in this process."""
    torch_native.start()
    assert torch_native.wait(900), "the build did not end in 15 minutes"
    state, reason = torch_native.status()
    assert state == "ready", f"the compiled walk did not build: {reason} (.ci/run installs g++ and ninja)"
    return torch_native.walker()


def test_the_compiled_walk_reads_a_trace_as_the_python_walk_does(walk):
    results, two_threads = rich_capture()
    roots = results.experimental_event_tree()
    data_until = int(np.median(tree_op_columns(roots).start_ns)) + 1_000  # some ops load data, some not
    by_python = tree_op_columns(roots, 1_000, HostThreads(), data_until, NodeNames())
    by_compiled = native_op_columns(walk, results, 1_000, HostThreads(), data_until, NodeNames())
    assert _rows(by_compiled) == _rows(by_python)
    assert by_compiled.op_types == by_python.op_types
    names = set(by_compiled.names)
    assert {"aten::linear", "gloo:all_reduce"} <= names and not names & {"outer", "inner", "empty", "aten::addmm"}
    assert set(by_compiled.streams.tolist()) == ({0, 1} if two_threads else {0})
    assert {DATA, COMPUTE, COMMUNICATION} <= set(by_compiled.kinds.tolist())


def test_the_compiled_walk_hands_back_the_step_befores_names_only_when_they_are_the_same(walk):
    results, _ = rich_capture()
    through = NodeNames.through
    found = walk(results, through, 0, None, [])[0]
    assert walk(results, through, 0, None, found)[0] is found  # the same ops: that list, no new strings
    changed = list(found)
    changed[len(changed) // 2] += "x"  # a step before that differs in one name, by one character
    again = walk(results, through, 0, None, changed)[0]
    assert again is not changed and again == found
    assert walk(results, through, 0, None, found[:-1])[0] == found  # one op fewer
    names = NodeNames()  # and what capture sends is the same either way
    first = native_op_columns(walk, results, 0, HostThreads(), None, names)
    assert _rows(native_op_columns(walk, results, 0, HostThreads(), None, names)) == _rows(first)


def test_the_compiled_walk_asks_python_about_an_annotation_once_and_the_same_through_each_step(walk):
    """The walk runs with the GIL released and takes it back only for a name it has not
    seen: the next step's walk asks nothing, and a different rule starts afresh."""
    results, _ = rich_capture()
    asked: list[str] = []

    def through(name: str) -> bool:
        asked.append(name)
        return NodeNames.through(name)

    first = walk(results, through, 0, None, [])
    assert {"outer", "inner"} <= set(asked) and len(asked) == len(set(asked))
    del asked[:]
    assert walk(results, through, 0, None, [])[0] == first[0]
    assert asked == []  # every answer kept
    never: list[str] = []
    assert walk(results, lambda name: never.append(name) or False, 0, None, [])[0] != first[0]
    assert never  # another rule: asked again, and its answers used


def test_the_compiled_walk_leaves_a_tree_with_other_events_to_the_event_conversion(walk):
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("block"):
            x = torch.ones(1024)
            del x  # a memory event right under the annotation
    assert native_op_columns(walk, prof.profiler.kineto_results) is None


class OpsMonitor(FailingOpsMonitor):
    """A Monitor stand-in (no Kafka) that keeps, step by step, the ops it is given
    instead of failing on them."""

    def __init__(self):
        super().__init__()
        self.ops_of: dict[int, list[str]] = {}

    def ops(self, names, start_ns, dur_ns, kinds=0, op_types=None, streams=0, step=None):
        self.ops_of[step] = list(names)


def _capture(compiled_walk: bool, steps: int = 8):
    import profstream.torch as pst

    model, optimizer, loader = make(steps)
    monitor = OpsMonitor()
    handle = pst.instrument(model, optimizer, loader, monitor=monitor, compiled_walk=compiled_walk)
    train(model, optimizer, loader)
    handle.close()
    assert handle.error is None
    return handle.capture, monitor.ops_of


def test_capture_reads_with_the_compiled_walk_after_one_checked_trace(walk):
    capture, ops_of = _capture(compiled_walk=True)
    _, python_ops_of = _capture(compiled_walk=False)
    assert capture.steps_captured >= 6
    assert capture.steps_compiled == capture.steps_captured - 1  # the first trace is read both ways
    assert ops_of.keys() == python_ops_of.keys()
    for step, names in ops_of.items():  # the same ops as the Python walk's run
        assert sorted(names) == sorted(python_ops_of[step]), step
        assert "aten::linear" in names


def test_a_compiled_walk_that_reads_differently_is_dropped_for_the_python_walk(walk, monkeypatch, caplog):
    def off_by_one(*args):
        names, start, dur, tid, *flags = walk(*args)
        return names, start, (np.frombuffer(dur, np.int64) + 1).tobytes(), tid, *flags

    state = torch_native._Native()  # this test's own: the real one stays usable
    state.status, state.module = "ready", type("Broken", (), {"outermost_ops": staticmethod(off_by_one)})
    monkeypatch.setattr(torch_native, "_native", state)
    with caplog.at_level(logging.WARNING, logger="profstream.torch"):
        capture, ops_of = _capture(compiled_walk=True)
    assert torch_native.status() == ("failed", "it read a trace differently from the Python walk")
    assert capture.steps_compiled == 0 and len(ops_of) == capture.steps_captured >= 6
    assert [r.getMessage() for r in caplog.records] == [
        "profstream: op capture reads the profiler's trace in Python (about 0.5 ms more per captured step): the "
        "compiled walk is unavailable: it read a trace differently from the Python walk"]


def test_a_process_after_the_first_loads_the_built_walk_without_a_compiler(walk, monkeypatch):
    def no_compiler(*a, **k):
        raise AssertionError("a compiler was started although the module is built")

    monkeypatch.setattr(torch_native, "compile_module", no_compiler)
    monkeypatch.setattr(torch_native, "_native", torch_native._Native())  # a process that has loaded nothing
    torch_native.start()
    assert torch_native.wait(60)
    assert torch_native.status() == ("ready", "")
    assert torch_native.walker() is not None


def test_a_walk_that_cannot_be_built_says_why_once_and_capture_goes_on_in_python(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "torch_tree.cpp"
    broken.write_text('#error "no compiler for this test"\n')
    monkeypatch.setattr(torch_native, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(torch_native, "_native", torch_native._Native())
    with caplog.at_level(logging.WARNING, logger="profstream.torch"):
        torch_native.start()
        assert torch_native.wait(300)
        capture, ops_of = _capture(compiled_walk=True)
    state, reason = torch_native.status()
    assert state == "failed" and reason.startswith("build failed (exit 1): ") and "no compiler for this test" in reason
    assert capture.steps_compiled == 0 and len(ops_of) == capture.steps_captured >= 6
    assert len(caplog.records) == 1 and "no compiler for this test" in caplog.records[0].getMessage()


def test_a_failed_build_is_told_by_the_line_that_says_why():
    compiler = ("[1/2] c++ -c torch_tree.cpp", "FAILED: torch_tree.o",
                "torch_tree.cpp:9:10: fatal error: ActivityType.h: No such file or directory", "ninja: build stopped")
    no_cxx = ("Traceback (most recent call last):", "/bin/sh: 1: c++: not found",
              "RuntimeError: Error building extension 'x': [1/2] c++ ...")
    no_ninja = ("Traceback (most recent call last):", "  File x", "RuntimeError: Ninja is required to load C++ extensions")
    assert torch_native._reason("\n".join(compiler)) == compiler[2]
    assert torch_native._reason("\n".join(no_cxx)) == no_cxx[1]
    assert torch_native._reason("\n".join(no_ninja)) == no_ninja[2]
    assert torch_native._reason("") == "no output"
