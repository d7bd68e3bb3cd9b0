"""The processors over a stream of raw messages, without Kafka: raw batches in, figures out.

The public entry point for code that holds the messages already (offline replay, the
report, export, benchmarks). It runs the very stages the live processors run in Kafka
transactions (``runtime.StepStage``, ``runtime.RunStage``):

- ``StepFigures``: one StepStage per input partition (a rank's state lives in its
  partition), fed raw messages in partition order with the messages' own clock as
  ``now``; StepMetrics, RankEnds, Alerts and dead letters out.
- ``RunFigures``: the RunStage, fed those StepMetrics in the order they came out;
  RunStepMetrics out.
- ``figures(messages)``: both, as one iterator.

What they compute depends on each partition's own messages only: the same in one process
or in several (one StepFigures per share of the partitions, their outputs merged by
``Figure`` order), and the same as the live processors wherever the figures do not
depend on wall-clock timing (steps closed by the producers' watermarks).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from profstream.kafka.topics import Topics
from profstream.processors.figures import FigureOptions
from profstream.processors.health import StageCounts
from profstream.processors.runtime import RunStage, StepStage
from profstream.schema.codec import SCHEMAS, is_rank_progress

STEPS, ALERTS, DEAD_LETTERS, RUN, ENDS = "steps", "alerts", "dead_letters", "run", "ends"
_RANK_ENDS = {sv.header for sv in SCHEMAS.values() if sv.name == "RankEnd"}  # v1 and v2 are written


@dataclass(frozen=True)
class StreamOptions:
    """The processors' options (the same names and defaults as `profstream process`)."""

    grace_s: float = 2.0
    run_grace_s: float = 10.0
    idle_timeout_s: float = 60.0
    figures: FigureOptions = field(default_factory=FigureOptions)


class RawMessage(NamedTuple):
    """One message of the raw topic; ``clock`` (seconds) is the highest Kafka timestamp of
    its partition so far."""

    clock: float
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


class Figure(NamedTuple):
    """One output record, encoded as on its topic. Figures sort in the order the stages
    must see them: by clock (``math.inf`` when the stream ended), partition, then ``seq``
    (production order within one StepFigures)."""

    clock: float
    partition: int
    seq: int
    kind: str  # STEPS, ENDS (RankEnd: a rank that ended normally), ALERTS, DEAD_LETTERS or RUN
    value: bytes


class _Record(NamedTuple):  # what a stage's fold() reads of a consumer record
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


class StepFigures:
    """Raw messages -> StepMetrics, Alerts and dead letters, one StepStage per partition."""

    def __init__(self, options: StreamOptions | None = None, raw_topic: str = "offline.raw") -> None:
        self.options = options or StreamOptions()
        self.raw_topic = raw_topic
        topics = Topics(raw_topic[: -len(".raw")] if raw_topic.endswith(".raw") else raw_topic)
        self._kinds = {topics.steps: STEPS, topics.alerts: ALERTS, topics.dlq: DEAD_LETTERS}
        self._topics = topics
        self._counts = StageCounts(keep_step_ends=False)  # nothing commits offline: counted as folded
        self._stages: dict[int, list] = {}  # partition -> [StepStage, clock]
        self._seq = itertools.count()

    @property
    def events(self) -> int:
        """Op events folded in so far."""
        return self._counts.events["ops"]

    def feed(self, message: RawMessage) -> list[Figure]:
        """Fold one message in; the figures it (and the clock it brings) closed."""
        now, p = message.clock, message.partition
        entry = self._stages.get(p)
        if entry is None:
            o = self.options
            entry = self._stages[p] = [StepStage(self._topics, 1, self._counts, o.grace_s, o.idle_timeout_s,
                                                 o.figures, partials=False), now]  # RunFigures reads StepMetrics
        stage = entry[0]
        out = []
        if now > entry[1]:  # steps whose grace ran out before this message came
            entry[1] = now
            out = stage.ready(now)
        out += stage.fold(_Record(self.raw_topic, p, message.offset, message.key, message.value), now)
        out += stage.ready(now)
        return self._figures(now, p, out)

    def finish(self) -> list[Figure]:
        """Close every step left open, as the live processors do once the ranks fall idle."""
        o = self.options
        out = []
        for p, (stage, now) in sorted(self._stages.items()):
            final = now + o.idle_timeout_s + o.grace_s + 1.0
            for _ in range(2):  # close by grace, then the idle ranks
                out += self._figures(math.inf, p, stage.ready(final))
        return out

    def _figures(self, clock: float, partition: int, outputs) -> list[Figure]:
        kinds = self._kinds
        # RankProgress (where a rank is now) is the live run stage's, for hangs: not a figure of a replay
        return [Figure(clock, partition, next(self._seq), ENDS if o.value[:10] in _RANK_ENDS else kinds[o.topic],
                       o.value) for o in outputs if o.topic in kinds and not is_rank_progress(o.value)]


class RunFigures:
    """StepMetrics and RankEnds (STEPS and ENDS figures, in ``Figure`` order) -> RunStepMetrics."""

    def __init__(self, options: StreamOptions | None = None) -> None:
        self.options = o = options or StreamOptions()
        self._topics = Topics("offline")
        self._stage = RunStage(self._topics, StageCounts(keep_step_ends=False), o.run_grace_s, o.idle_timeout_s)
        self._offset = itertools.count()
        self._seq = itertools.count()
        self._now = -math.inf

    def feed(self, step: Figure) -> list[Figure]:
        """Fold one StepMetrics (or RankEnd) figure in; the RunStepMetrics it completed."""
        if step.clock != math.inf:
            self._now = step.clock
        elif self._now == -math.inf:
            self._now = 0.0
        self._stage.fold(_Record(self._topics.steps, 0, next(self._offset), None, step.value), self._now)
        return self._figures(self._stage.ready(self._now))

    def finish(self) -> list[Figure]:
        """Emit every step still waiting for ranks."""
        o = self.options
        now = self._now if self._now != -math.inf else 0.0
        return self._figures(self._stage.ready(now + o.run_grace_s + o.idle_timeout_s + o.grace_s + 1.0))

    def _figures(self, outputs) -> list[Figure]:
        return [Figure(self._now, 0, next(self._seq), RUN, o.value)
                for o in outputs if o.topic == self._topics.run and o.value is not None]


def figures(messages: Iterable[RawMessage], options: StreamOptions | None = None,
            raw_topic: str = "offline.raw") -> Iterator[Figure]:
    """Every figure the processors compute from ``messages`` (in partition order, partitions
    interleaved by clock): StepMetrics, Alerts and dead letters as they come out, each
    StepMetrics followed by the RunStepMetrics it completed, then what closes at the end."""
    steps = StepFigures(options, raw_topic)
    run = RunFigures(options)

    def with_run(out: list[Figure]) -> Iterator[Figure]:
        for f in out:
            yield f
            if f.kind in (STEPS, ENDS):
                yield from run.feed(f)

    for message in messages:
        yield from with_run(steps.feed(message))
    yield from with_run(steps.finish())
    yield from run.finish()
