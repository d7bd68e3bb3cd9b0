"""When an alert asks for a capture: ``CapturePolicy`` (one YAML file) and ``RateLimiter``.

Every key of the policy file is optional; ``CapturePolicy``'s fields are the keys with their
defaults, and deploy/autocapture.yml documents each (a test holds the two equal). A key the policy does not know, or
a value of the wrong kind, is a ``ConfigError`` naming it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from profstream.config import ConfigError
from profstream.control.records import ACTIVITIES

ALERTS = ("StepTimeRegression", "RankStraggler", "DataQueueStall", "TrainingHang")
STACKS_ALERTS = ("TrainingHang",)  # a hung run starts no next step to capture: its stacks say where it is
DAY_S = 86_400.0


@dataclass(frozen=True)
class CapturePolicy:
    """Which alerts ask for captures, of what, and how often."""

    alerts: tuple[str, ...] = ALERTS
    stacks_alerts: tuple[str, ...] = STACKS_ALERTS
    steps: int = 20
    delay_s: float = 0.0
    healthy_ranks: int = 1
    min_interval_s: float = 600.0
    max_per_run_per_day: int = 24
    max_per_day: int = 200
    expires_s: float = 120.0
    activities: tuple[str, ...] = ACTIVITIES
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    unknown_run_after_s: float = 10.0
    run_ttl_s: float = 900.0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "policy") -> CapturePolicy:
        known = {f.name: f for f in fields(cls)}
        out: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"{source}: unknown key {key!r}; known keys: {', '.join(known)}")
            out[key] = _parse(key, value, getattr(cls, key), source)
        policy = cls(**out)
        unknown = [a for a in policy.activities if a not in ACTIVITIES]
        if unknown or not policy.activities:
            raise ConfigError(f"{source}: activities {list(policy.activities)}: use some of {', '.join(ACTIVITIES)}")
        return policy

    @classmethod
    def load(cls, path: str | Path | None) -> CapturePolicy:
        """The policy of a YAML file (None: the defaults)."""
        if path is None:
            return cls()
        import yaml

        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as e:
            raise ConfigError(f"cannot read the policy file {path} ({e.strerror}): give an existing file") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML ({str(e).splitlines()[0]}): fix it") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping of policy keys (see deploy/autocapture.yml)")
        return cls.from_mapping(data, str(path))


def _parse(key: str, value: Any, default: Any, source: str) -> Any:
    def bad(expect: str) -> ConfigError:
        return ConfigError(f"{source}: {key}={value!r}: expected {expect}")

    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if isinstance(default, tuple):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(v, str) and v.strip() for v in items):
            raise bad("a list of names")
        return tuple(v.strip() for v in items)
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "steps" else 0):
            raise bad("an integer >= 1" if key == "steps" else "an integer >= 0")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise bad("a number of seconds >= 0")
    if key == "expires_s" and value <= 0:
        raise bad("a number of seconds > 0")
    return float(value)


class RateLimiter:
    """At most one automatic request per run per ``min_interval_s``, ``max_per_run_per_day``
    per run and ``max_per_day`` in all, over the last 24 hours. Fed every automatic
    request of one kind (AutoCapture keeps one limiter for op captures, one for stacks),
    ours and those other services sent (read back from the control topic)."""

    def __init__(self, policy: CapturePolicy) -> None:
        self.policy = policy
        self._by_run: dict[str, deque[float]] = {}
        self._all: deque[float] = deque()
        self._seen: dict[str, float] = {}  # request ids of the last 24 hours

    def record(self, request_id: str, run_id: str, at_s: float) -> None:
        if request_id in self._seen:
            return
        self._seen[request_id] = at_s
        self._by_run.setdefault(run_id, deque()).append(at_s)
        self._all.append(at_s)

    def refusal(self, run_id: str, now_s: float) -> str | None:
        """None when a request for ``run_id`` may go now, else why not."""
        self._forget(now_s)
        p = self.policy
        times = self._by_run.get(run_id, ())
        if times and now_s - times[-1] < p.min_interval_s:
            return (f"run {run_id} had an automatic capture {now_s - times[-1]:.0f} s ago "
                    f"(min_interval_s {p.min_interval_s:g})")
        if len(times) >= p.max_per_run_per_day:
            return f"run {run_id} had {len(times)} automatic captures in 24 h (max_per_run_per_day)"
        if len(self._all) >= p.max_per_day:
            return f"{len(self._all)} automatic captures in 24 h (max_per_day)"
        return None

    def _forget(self, now_s: float) -> None:
        horizon = now_s - DAY_S
        for times in (self._all, *self._by_run.values()):
            while times and times[0] < horizon:
                times.popleft()
        if len(self._seen) > 2 * len(self._all) + 64:
            self._seen = {rid: at for rid, at in self._seen.items() if at >= horizon}
