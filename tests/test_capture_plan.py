"""Capture requests without a broker: the records, the rank's plan, the policy and its
decisions, Alertmanager's payload.

The plan and the autocapture decisions are driven step by step (and on a clock the test
moves), so that every refusal and every boundary is reached on purpose; the broker tests
(test_capture.py, test_autocapture.py) show the same through Kafka.
"""

from __future__ import annotations

import time

import pytest

from profstream.config import ConfigError
from profstream.control.autocapture import AUTO_BY, AutoCapture
from profstream.control.policy import CapturePolicy, RateLimiter
from profstream.control.records import (
    RequestError,
    check_request,
    decode_control,
    encode_request,
    encode_status,
    format_ranks,
    new_request,
    new_status,
    parse_ranks,
    rank_in,
    refusal_code,
)
from profstream.control.webhook import WebhookError, alerts_of
from profstream.producers.capture_plan import CapturePlan
from profstream.schema.codec import DecodeError, encode

# -- records -----------------------------------------------------------------------------

def test_ranks_are_all_or_lists_of_ranges():
    assert parse_ranks("all") is None and parse_ranks(None) is None
    ranges = parse_ranks("0, 3-5,9")
    assert ranges == [{"first": 0, "last": 0}, {"first": 3, "last": 5}, {"first": 9, "last": 9}]
    assert format_ranks(ranges) == "0,3-5,9"
    assert [r for r in range(11) if rank_in(ranges, r)] == [0, 3, 4, 5, 9]
    assert rank_in(None, 1234)
    for bad, said in (("0,x", "expected 'all' or a list such as 0,3-5"), ("5-3", "the range 5-3 ends before it starts"),
                      ("-1", "expected 'all'")):
        with pytest.raises(RequestError, match=said) as e:
            parse_ranks(bad)
        assert "\n" not in str(e.value)


def test_a_request_and_its_statuses_travel_as_avro_on_the_control_topic():
    request = new_request("run-1", ranks=parse_ranks("1-2"), start_step=40, steps=5, reason="why", requested_by="me")
    name, back = decode_control(encode_request(request))
    assert name == "CaptureRequest" and back == request
    status = new_status(request, "finished", 2, first_step=40, last_step=44, ops=1234, window_start_ns=1,
                        window_end_ns=2, world_size=4, host="h")
    assert decode_control(encode_status(status)) == ("CaptureStatus", status)
    with pytest.raises(DecodeError) as e:
        decode_control(b"not avro at all")
    assert e.value.reason == "not_avro"
    alert = {"name": "DataQueueStall", "state": "firing", "run_id": "r", "rank": 0, "step": 1, "ts_ns": 1,
             "summary": "", "evidence": {}}
    with pytest.raises(DecodeError) as e:
        decode_control(encode("Alert", alert))
    assert e.value.reason == "wrong_type"


def test_requests_no_rank_can_act_on_are_refused_as_invalid():
    good = new_request("r", steps=3)
    assert check_request(good) is None
    for change, said in (({"steps": 0}, "steps 0"), ({"run_id": "a/b"}, "run id 'a/b'"),
                         ({"start_step": -4}, "start step -4"), ({"ranks": []}, "no rank"),
                         ({"ranks": [{"first": 3, "last": 1}]}, "rank range 3-1"), ({"activities": []}, "no activity")):
        reason = check_request({**good, **change})
        assert refusal_code(reason) == "invalid" and said in reason, change
    with pytest.raises(RequestError, match="steps 0: ask for at least 1"):
        new_request("r", steps=0)
    with pytest.raises(RequestError, match="expires"):
        new_request("r", expires_s=0)


# -- the rank's plan ---------------------------------------------------------------------

def _plan(max_steps=100):
    return CapturePlan(rank=0, max_steps=max_steps)


def _states(plan):
    out = []
    while plan.outbox:
        state, cur, reason, _ts = plan.outbox.popleft()
        out.append((state, refusal_code(reason) if reason else "", plan.status_fields(state, cur)))
    return out


def test_a_request_captures_exactly_its_steps_from_the_next_boundary():
    plan = _plan()
    assert plan.claim(0) is None  # nothing asked: the fast path
    assert plan.offer(new_request("r", steps=3)) is None
    assert [plan.claim(s) is not None for s in (5, 6, 7)] == [True, True, True]
    for step in (5, 6):
        plan.ended(step, 1000 + step)
        plan.captured(step, 10)
    assert plan.current is not None  # not finished before its last step's ops are sent
    plan.ended(7, 2000)
    plan.captured(7, 5)
    assert plan.current is None and plan.claim(8) is None
    started, finished = _states(plan)
    assert started == ("started", "", {"first_step": 5, "last_step": 7})
    window_start = finished[2].pop("window_start_ns")  # when step 5 was taken up
    assert finished == ("finished", "", {"first_step": 5, "last_step": 7, "ops": 25, "window_end_ns": 2000})
    assert abs(window_start - time.time_ns()) < 60e9


def test_a_request_for_step_n_waits_for_it_and_one_whose_step_passed_is_refused():
    plan = _plan()
    assert plan.offer(new_request("r", start_step=10, steps=2)) is None
    assert [plan.claim(s) for s in (8, 9)] == [None, None]
    assert plan.claim(10) is not None and plan.claim(11) is not None
    plan.ended(11, 5)
    plan.captured(11, 1)
    assert plan.offer(new_request("r", start_step=3, steps=2)) is None
    assert plan.claim(12) is None
    assert [s[:2] for s in _states(plan)] == [("started", ""), ("finished", ""), ("refused", "start_passed")]


def test_busy_over_limit_expired_and_unavailable_requests_are_refused():
    plan = _plan(max_steps=10)
    first = new_request("r", steps=5)
    assert plan.offer(first) is None
    assert refusal_code(plan.offer(new_request("r", steps=5))) == "busy"  # offered, not yet taken up
    plan.claim(0)
    busy = plan.offer(new_request("r", steps=5))
    assert refusal_code(busy) == "busy" and "steps 0-4" in busy and first["request_id"] in busy
    assert refusal_code(plan.offer(new_request("r", steps=11))) == "over_limit"
    stale = new_request("r", steps=2, expires_s=1, now_ns=time.time_ns() - 5 * 10**9)
    assert refusal_code(plan.offer(stale)) == "expired"
    plan.unavailable = "op capture is off"
    assert plan.offer(new_request("r")) == "unavailable: op capture is off"
    cpu_only = CapturePlan(0, 10, frozenset({"cpu"}))
    assert refusal_code(cpu_only.offer(new_request("r", steps=5, activities=("cuda",)))) == "unavailable"


def test_an_offer_that_expires_before_a_step_begins_is_refused_then():
    plan = _plan()
    assert plan.offer(new_request("r", steps=2, expires_s=0.05)) is None
    time.sleep(0.06)
    assert plan.claim(3) is None and plan.current is None
    assert [s[:2] for s in _states(plan)] == [("refused", "expired")]


def test_closing_finishes_the_running_capture_with_what_it_has_and_refuses_the_rest():
    plan = _plan()
    plan.offer(new_request("r", steps=10))
    plan.claim(0)
    plan.ended(0, 1)
    plan.captured(0, 7)
    plan.claim(1)  # began, never ended
    plan.close("the Monitor closed")
    (started, _, _), (state, code, fields) = _states(plan)
    assert started == "started" and (state, code, fields["first_step"], fields["last_step"], fields["ops"]) == ("finished", "ended", 0, 0, 7)
    assert refusal_code(plan.offer(new_request("r"))) == "unavailable"


# -- policy ------------------------------------------------------------------------------

def test_the_policy_file_sets_keys_and_names_the_bad_ones(tmp_path):
    assert CapturePolicy.load(None) == CapturePolicy()
    f = tmp_path / "policy.yml"
    f.write_text("steps: 8\ndelay_s: 2\nalerts: [DataQueueStall]\n")
    p = CapturePolicy.load(f)
    assert (p.steps, p.delay_s, p.alerts, p.min_interval_s) == (8, 2.0, ("DataQueueStall",), 600.0)
    for text, said in (("stepz: 3", "unknown key 'stepz'"), ("steps: 0", "steps=0: expected an integer >= 1"),
                       ("delay_s: -1", "expected a number of seconds >= 0"), ("activities: [tpu]", "activities"),
                       ("- 1", "must hold a mapping"), (": :", "is not valid YAML")):
        f.write_text(text)
        with pytest.raises(ConfigError, match=said) as e:
            CapturePolicy.load(f)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="cannot read the policy file"):
        CapturePolicy.load(tmp_path / "missing.yml")


def test_the_repository_policy_file_holds_the_defaults():
    from pathlib import Path

    assert CapturePolicy.load(Path(__file__).resolve().parents[1] / "deploy" / "autocapture.yml") == CapturePolicy()


def test_rate_limits_per_run_per_interval_per_day_and_in_all():
    limiter = RateLimiter(CapturePolicy(min_interval_s=600, max_per_run_per_day=3, max_per_day=4))
    t = 1_000_000.0
    assert limiter.refusal("a", t) is None
    limiter.record("1", "a", t)
    limiter.record("1", "a", t)  # the same request read back from the topic counts once
    assert "min_interval_s" in limiter.refusal("a", t + 599)
    assert limiter.refusal("a", t + 600) is None and limiter.refusal("b", t + 1) is None
    limiter.record("2", "a", t + 600)
    limiter.record("3", "a", t + 1200)
    assert "max_per_run_per_day" in limiter.refusal("a", t + 1800)
    limiter.record("4", "b", t + 10)
    assert "max_per_day" in limiter.refusal("c", t + 1800)
    assert limiter.refusal("a", t + 86_400 + 1201) is None  # a day later, they are forgotten


# -- autocapture's decisions ---------------------------------------------------------------

class Recorded:
    """The Outlet of the decisions under test: keeps what would go to the control topic."""

    def __init__(self):
        self.requests, self.statuses = [], []

    def send_request(self, request):
        self.requests.append(request)

    def send_status(self, status):
        self.statuses.append(status)


class Clock:
    def __init__(self, t=1_800_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def _run_step(run_id, step, times):
    straggler = max(times, key=times.get)
    return {"run_id": run_id, "step": step, "straggler_rank": straggler,
            "step_times_ns": {str(r): t for r, t in times.items()}}


def test_a_straggler_alert_asks_for_the_straggler_and_the_fastest_other_rank_once_per_interval():
    out, clock = Recorded(), Clock()
    auto = AutoCapture(CapturePolicy(steps=7), out, clock)
    auto.run_step(_run_step("r", 100, {0: 110, 1: 100, 2: 300, 3: 105}))
    outcome = auto.alert("RankStraggler", "r", None, "firing", "Alertmanager")
    assert outcome.action == "requested"
    (request,) = out.requests
    assert [r["first"] for r in request["ranks"]] == [2, 1] and request["steps"] == 7
    assert request["requested_by"] == AUTO_BY and request["reason"].startswith("RankStraggler firing")
    clock.t += 599
    again = auto.alert("StepTimeRegression", "r", None, "firing", "Alertmanager")
    assert again.action == "skipped" and "min_interval_s" in again.detail and len(out.requests) == 1
    assert auto.alert("Other", "r", 1, "firing", "x").detail == "not in the policy's alerts"
    assert "no straggler known" in auto.alert("RankStraggler", "unseen", None, "firing", "x").detail


def test_a_delayed_alert_asks_after_its_delay_and_not_when_it_resolved_meanwhile():
    out, clock = Recorded(), Clock()
    auto = AutoCapture(CapturePolicy(delay_s=30, healthy_ranks=0), out, clock)
    assert auto.alert("DataQueueStall", "r", 3, "firing", "alerts topic").action == "delayed"
    assert auto.alert("DataQueueStall", "q", 1, "firing", "alerts topic").action == "delayed"
    clock.t += 10
    assert auto.alert("DataQueueStall", "q", 1, "resolved", "alerts topic").detail == "resolved within delay_s"
    assert auto.tick() == [] and out.requests == []
    clock.t += 20
    (outcome,) = auto.tick()
    assert outcome.action == "requested" and [r["first"] for r in out.requests[0]["ranks"]] == [3]
    assert outcome.request["requested_ns"] == int(clock.t * 1e9)


def test_the_guard_refuses_invalid_requests_and_requests_for_runs_nobody_runs():
    out, clock = Recorded(), Clock()
    auto = AutoCapture(CapturePolicy(unknown_run_after_s=10), out, clock)
    auto.run_step(_run_step("alive", 5, {0: 1}))
    bad = {**new_request("alive"), "steps": 0}
    auto.control("CaptureRequest", bad, live=True)
    assert [(s["rank"], refusal_code(s["reason"])) for s in out.statuses] == [(None, "invalid")]
    ghost, answered = new_request("ghost"), new_request("late-starter")
    auto.control("CaptureRequest", ghost, live=True)
    auto.control("CaptureRequest", answered, live=True)
    auto.control("CaptureRequest", new_request("alive"), live=True)
    auto.control("CaptureRequest", new_request("old-ghost"), live=False)  # read at start: history only
    auto.control("CaptureStatus", new_status(answered, "armed", 0), live=True)
    clock.t += 9
    auto.tick()
    assert len(out.statuses) == 1
    clock.t += 1
    auto.tick()
    (refused,) = out.statuses[1:]
    assert refused["request_id"] == ghost["request_id"] and refused["rank"] is None
    assert refusal_code(refused["reason"]) == "unknown_run" and "ghost" in refused["reason"]


def test_automatic_requests_read_back_from_the_topic_count_against_the_limits():
    out, clock = Recorded(), Clock()
    auto = AutoCapture(CapturePolicy(), out, clock)
    earlier = new_request("r", requested_by=AUTO_BY, now_ns=int((clock.t - 60) * 1e9))
    auto.control("CaptureRequest", earlier, live=False)
    outcome = auto.alert("DataQueueStall", "r", 0, "firing", "alerts topic")
    assert outcome.action == "skipped" and "60 s ago" in outcome.detail


def test_a_hang_asks_every_rank_for_its_stacks_once_while_it_fires_and_not_when_it_resolved_first():
    out, clock = Recorded(), Clock()
    auto = AutoCapture(CapturePolicy(delay_s=5), out, clock)
    auto.run_step(_run_step("hung", 9, {0: 100, 1: 900}))
    assert auto.alert("RankStraggler", "hung", None, "firing", "Alertmanager").action == "delayed"
    assert auto.alert("TrainingHang", "hung", None, "firing", "alerts topic").action == "delayed"
    assert auto.alert("TrainingHang", "brief", None, "firing", "alerts topic").action == "delayed"
    clock.t += 2
    assert auto.alert("TrainingHang", "brief", None, "resolved", "alerts topic").detail == "resolved within delay_s"
    clock.t += 3
    straggler, hang = auto.tick()
    assert (straggler.action, hang.action, hang.detail) == ("requested", "requested", "stacks of every rank")
    ops, stacks = out.requests  # an op capture just before does not keep the hang's stacks from being asked
    assert ops["kind"] == "ops" and stacks["kind"] == "stacks" and stacks["ranks"] is None
    assert stacks["run_id"] == "hung" and stacks["requested_by"] == AUTO_BY
    assert stacks["reason"] == "TrainingHang firing (alerts topic)" and decode_control(encode_request(stacks))[1] == stacks

    clock.t += 3600  # past every interval: the same hang, told again (Alertmanager repeats; a restarted
    again = auto.alert("TrainingHang", "hung", None, "firing", "Alertmanager")  # run stage fires it again)
    clock.t += 5
    assert again.action == "delayed" and auto.tick()[0].detail == "its stacks were asked for while it fires"
    auto.alert("TrainingHang", "hung", None, "resolved", "alerts topic")
    auto.alert("TrainingHang", "hung", None, "firing", "alerts topic")  # a new hang of the run, 10 s after
    clock.t += 5
    assert auto.tick()[0].action == "requested" and len(out.requests) == 3
    clock.t += 60
    auto.alert("TrainingHang", "hung", None, "resolved", "alerts topic")
    auto.alert("TrainingHang", "hung", None, "firing", "alerts topic")  # a third, a minute later: rate limited
    clock.t += 5
    (limited,) = auto.tick()
    assert "min_interval_s" in limited.detail and len(out.requests) == 3
    # another service's automatic stacks request, read back from the topic, counts against stacks only
    auto.control("CaptureRequest", {**new_request("other", requested_by=AUTO_BY, now_ns=int(clock.t * 1e9),
                                                  kind="stacks"), "requester": None}, live=False)
    auto.alert("TrainingHang", "other", None, "firing", "alerts topic")
    clock.t += 5
    assert "rate limit" in auto.tick()[0].detail
    hang_off = AutoCapture(CapturePolicy(alerts=("TrainingHang",), stacks_alerts=()), Recorded(), clock)
    assert "no straggler known" in hang_off.alert("TrainingHang", "x", None, "firing", "x").detail  # an op capture


# -- Alertmanager's webhook payload ----------------------------------------------------------

def test_alertmanager_notifications_give_each_alert_of_a_run():
    payload = {  # the shape of Alertmanager's documented webhook_config payload, version 4
        "version": "4", "groupKey": '{}:{alertname="RankStraggler"}', "truncatedAlerts": 0, "status": "firing",
        "receiver": "profstream-capture", "groupLabels": {"alertname": "RankStraggler", "run": "llm"},
        "commonLabels": {"alertname": "RankStraggler", "run": "llm", "severity": "warning"},
        "commonAnnotations": {"summary": "Run llm: rank 3 is a straggler"}, "externalURL": "http://am:9093",
        "alerts": [
            {"status": "firing", "labels": {"alertname": "RankStraggler", "run": "llm", "severity": "warning"},
             "annotations": {}, "startsAt": "2026-11-24T10:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
             "generatorURL": "http://prom:9090/graph", "fingerprint": "a1"},
            {"status": "resolved", "labels": {"alertname": "DataQueueStall", "run": "llm", "rank": "2"},
             "annotations": {}, "startsAt": "2026-11-24T09:00:00Z", "endsAt": "2026-11-24T09:05:00Z",
             "generatorURL": "", "fingerprint": "b2"},
            {"status": "firing", "labels": {"alertname": "PipelineLagging", "job": "p"}, "annotations": {},
             "startsAt": "2026-11-24T09:00:00Z", "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "",
             "fingerprint": "c3"},
        ]}
    assert alerts_of(payload) == [("RankStraggler", "llm", None, "firing"), ("DataQueueStall", "llm", 2, "resolved")]
    for bad, said in (([], "an 'alerts' list"), ({"alerts": [1]}, "alerts\\[0\\] has no 'labels'"),
                      ({"alerts": [{"labels": {}, "status": "odd"}]}, "expected firing or resolved"),
                      ({"alerts": [{"labels": {"alertname": "A", "run": "r", "rank": "x"}, "status": "firing"}]},
                       "label rank='x'")):
        with pytest.raises(WebhookError, match=said):
            alerts_of(bad)
