"""Automatic capture through the real broker and the real processor.

A simulated run whose data queue stalls makes the processor fire DataQueueStall on the
alerts topic; ``profstream autocapture`` (the service) turns the first alert into a
capture request after the policy's delay, the rate limit keeps the second rank's alert
from asking again, and the Monitors capture exactly the steps asked. Alertmanager's
webhook is driven with its documented JSON over real HTTP.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

from profstream.control.autocapture import AUTO_BY
from profstream.control.policy import CapturePolicy
from profstream.control.service import AutoCaptureService
from profstream.simulate import SimConfig, run_simulation
from tests.helpers import raw_batches, wait_until
from tests.test_capture import control_records, steps_with_ops
from tests.test_processor import RunningProcessor, _alerts

TOKEN = "a-test-token"


class RunningService:
    """An AutoCaptureService on a thread, ready when entered, stopped on exit."""

    def __init__(self, bootstrap, topics, policy, webhook=False):
        self.outcomes = []
        self.service = AutoCaptureService(bootstrap, topics, policy, on_outcome=self.outcomes.append)
        self.url = self.service.serve_webhook(0, "127.0.0.1", TOKEN) if webhook else None
        self.stop, self.ready = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self.service.run, args=(self.stop, self.ready.set), daemon=True)

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(30), "the service did not start"
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)


def _requests(bootstrap, topics, run_id, count, timeout=30.0):
    """The service's requests: on its own request topic (no authentication: ANONYMOUS's)."""
    from profstream.control.records import decode_control
    from profstream.kafka.clients import read_topic

    return [r for _n, r in read_topic(bootstrap, topics.requests("ANONYMOUS"), lambda x: x[0] == "CaptureRequest"
                                      and x[1]["run_id"] == run_id, count, timeout, decode=decode_control)]


def test_a_data_stall_asks_for_one_capture_after_the_delay_and_the_rate_limit_holds(kafka_bootstrap, topics):
    policy = CapturePolicy(steps=5, delay_s=1.0, healthy_ranks=1)
    cfg = SimConfig(run_id="stalled", ranks=2, steps=150, step_time_ms=40, ops_per_step=20, stall=(20, 80),
                    rate="realtime")
    with RunningProcessor(kafka_bootstrap, topics), RunningService(kafka_bootstrap, topics, policy) as svc:
        result = run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix,
                                      "scheduled_capture": False})
        assert result.flushed
        firing = [a for a in _alerts(kafka_bootstrap, topics, "stalled", 2) if a["state"] == "firing"]
        wait_until(lambda: [o for o in svc.outcomes if "rate limit" in o.detail], 30,
                   "the second rank's alert to be weighed")
    assert sorted(a["rank"] for a in firing) == [0, 1]
    (request,) = _requests(kafka_bootstrap, topics, "stalled", 2, timeout=5)  # one request: the second was limited
    assert request["requested_by"] == AUTO_BY and request["steps"] == 5
    asked = [r["first"] for r in request["ranks"]]
    assert len(asked) == 1 and asked[0] in (0, 1)  # the other rank was stalled too: no healthy rank to compare
    alert = next(a for a in firing if a["rank"] == asked[0])
    assert request["requested_ns"] >= alert["ts_ns"] + policy.delay_s * 1e9  # it waited for the delay
    statuses = [r for _n, r in control_records(kafka_bootstrap, topics, lambda x: x[0] == "CaptureStatus"
                                               and x[1]["request_id"] == request["request_id"], 3)]
    started = next(s for s in statuses if s["state"] == "started")
    finished = next(s for s in statuses if s["state"] == "finished")
    # it started at the rank's next step after the request (the slack covers a loaded test machine)
    assert 0 <= started["ts_ns"] - request["requested_ns"] <= 10e9
    sent = steps_with_ops(raw_batches(kafka_bootstrap, topics.raw, "stalled", 10**6, timeout=5, full=False))
    assert list(sent) == asked
    assert sorted(sent[asked[0]]) == list(range(finished["first_step"], finished["last_step"] + 1))
    assert finished["last_step"] - finished["first_step"] == 4 and finished["ops"] == 5 * cfg.ops_per_step
    (limited,) = [o for o in svc.outcomes if "rate limit" in o.detail]
    assert limited.rank != asked[0] and "min_interval_s" in limited.detail


def _post(url, body: bytes):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                          "Authorization": f"Bearer {TOKEN}"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_alertmanager_s_straggler_alert_asks_for_the_straggler_and_a_healthy_rank(kafka_bootstrap, topics):
    cfg = SimConfig(run_id="slow-rank", ranks=3, steps=20, ops_per_step=8, straggler_rank=2, straggler_factor=2.0)
    with RunningProcessor(kafka_bootstrap, topics):
        run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix, "control": False})
        with RunningService(kafka_bootstrap, topics, CapturePolicy(), webhook=True) as svc:
            seen = wait_until(lambda: svc.service.auto.runs.get("slow-rank"), 60, "the run topic's figures of the run")
            wait_until(lambda: svc.service.auto.runs["slow-rank"].step == cfg.steps - 1, 30, "the run's last step")
            times = seen.step_times if seen.step == cfg.steps - 1 else svc.service.auto.runs["slow-rank"].step_times
            healthy = min((t, r) for r, t in times.items() if r != 2)[1]
            notification = {
                "version": "4", "groupKey": "{}:{alertname=\"RankStraggler\"}", "truncatedAlerts": 0,
                "status": "firing", "receiver": "profstream-capture", "groupLabels": {"alertname": "RankStraggler"},
                "commonLabels": {"alertname": "RankStraggler", "run": "slow-rank"}, "commonAnnotations": {},
                "externalURL": "http://alertmanager:9093",
                "alerts": [{"status": "firing", "labels": {"alertname": "RankStraggler", "run": "slow-rank",
                                                           "severity": "warning"},
                            "annotations": {"summary": "Run slow-rank: rank 2 is a straggler"},
                            "startsAt": "2026-11-24T10:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
                            "generatorURL": "http://prometheus:9090/graph", "fingerprint": "5f1c"}]}
            status, answer = _post(svc.url, json.dumps(notification).encode())
            assert status == 200 and answer["outcomes"] == [f"RankStraggler run slow-rank: requested (ranks 2, {healthy})"]
            status, again = _post(svc.url, json.dumps(notification).encode())  # Alertmanager repeats itself
            assert status == 200 and "rate limit" in again["outcomes"][0]
            status, bad = _post(svc.url, b"{not json")
            assert status == 400 and bad["error"].startswith("the body is not JSON")
            with urllib.request.urlopen(svc.url.replace("/alerts", "/healthz"), timeout=10) as health:
                assert health.status == 200
    (request,) = _requests(kafka_bootstrap, topics, "slow-rank", 2, timeout=5)
    assert [r["first"] for r in request["ranks"]] == [2, healthy]  # the straggler, then the fastest other rank
    assert request["reason"] == "RankStraggler firing (Alertmanager)"
