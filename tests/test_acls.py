"""Least privilege, enforced by the real broker's StandardAuthorizer: each role's ACLs
(profstream.kafka.acls) let it do its work and nothing else, and who asked for a capture is
what the broker authenticated."""

from __future__ import annotations

import threading

import pytest
from typer.testing import CliRunner

from profstream.cli import app
from profstream.control.autocapture import AUTO_BY
from profstream.control.client import follow, send_request
from profstream.control.policy import CapturePolicy
from profstream.control.records import new_request
from profstream.control.service import AutoCaptureService
from profstream.kafka.clients import make_transactional_producer
from tests.helpers import wait_until
from tests.secure import consume_error, produce_error

DENIED_TOPIC = "TOPIC_AUTHORIZATION_FAILED"


@pytest.fixture(scope="module")
def acl_topics(secure_stack):
    return secure_stack.topics("acls", {"processor": ("proc-acls",), "sink": ("sink-acls",)})


def test_a_training_job_writes_raw_events_and_statuses_and_cannot_forge_figures_or_requests(secure_stack, acl_topics):
    t, trainer = acl_topics, secure_stack.conn("trainer")
    assert produce_error(trainer, t.raw) is None
    assert produce_error(trainer, t.control) is None  # capture statuses
    for forged in (t.steps, t.partials, t.run, t.alerts, t.requests("capture"), t.requests("autocapture")):
        assert produce_error(trainer, forged) == DENIED_TOPIC, forged
    for other in (t.steps, t.partials, t.run, t.alerts, t.control, t.state):
        assert consume_error(trainer, other) == DENIED_TOPIC, other
    with pytest.raises(LookupError) as e:  # it has no request topic of its own either
        send_request(trainer, t, new_request("r1"))
    assert "trainer" in str(e.value) and "\n" not in str(e.value)


def test_a_sink_reads_and_writes_nothing(secure_stack, acl_topics):
    t, sink = acl_topics, secure_stack.conn("sink", mtls=True)
    assert consume_error(sink, t.steps, group="sink-acls") is None
    for topic in (t.raw, t.steps, t.partials, t.run, t.alerts, t.control, t.dlq, t.requests("capture")):
        assert produce_error(sink, topic) == DENIED_TOPIC, topic
    assert consume_error(sink, t.partials, group="sink-acls") == DENIED_TOPIC  # the run stage's input only
    assert consume_error(sink, t.steps, group="some-other-group") == "GROUP_AUTHORIZATION_FAILED"


def test_a_processor_keeps_to_its_transactional_ids_and_groups(secure_stack, acl_topics):
    import confluent_kafka

    processor = secure_stack.conn("processor")
    own = make_transactional_producer(processor, "proc-acls-7")
    own.init_transactions(30)  # its prefix: allowed
    other = make_transactional_producer(processor, "someone-else-0")
    with pytest.raises(confluent_kafka.KafkaException) as e:
        other.init_transactions(30)
    assert e.value.args[0].name() == "TRANSACTIONAL_ID_AUTHORIZATION_FAILED"
    assert consume_error(processor, acl_topics.raw, group="proc-acls") is None
    assert consume_error(processor, acl_topics.raw, group="profstream-prometheus") == "GROUP_AUTHORIZATION_FAILED"
    assert produce_error(processor, acl_topics.control) == DENIED_TOPIC  # no forged capture statuses either
    # the step stage writes the run stage's input, the run stage reads it; no stage reads the steps topic
    assert produce_error(processor, acl_topics.partials) is None
    assert consume_error(processor, acl_topics.partials, group="proc-acls-run") is None
    assert consume_error(processor, acl_topics.steps, group="proc-acls") == DENIED_TOPIC


def test_a_requester_writes_only_its_own_request_topic_and_is_known_by_what_the_broker_authenticated(
        secure_stack, acl_topics):
    t = acl_topics
    capture = secure_stack.conn("capture")
    with pytest.raises(LookupError) as e:
        send_request(capture, t, new_request("r1"), requester="autocapture")  # posing as the service
    said = str(e.value)
    assert said == (f"the broker denied User:capture WRITE on topic {t.requests('autocapture')}: missing ACL 'ALLOW "
                    f"User:capture WRITE TOPIC {t.requests('autocapture')}'; a requester writes its own request "
                    "topic only (`profstream acl show --role capture`); check --kafka-config")


def test_forged_automatic_requests_of_another_principal_do_not_use_up_autocapture_s_allowance(secure_stack,
                                                                                               acl_topics):
    t = acl_topics
    policy = CapturePolicy(max_per_day=1, healthy_ranks=0, unknown_run_after_s=0.5, run_ttl_s=1.0)
    service = AutoCaptureService(secure_stack.conn("autocapture"), t, policy)
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=service.run, args=(stop, ready.set), daemon=True)
    thread.start()
    try:
        assert ready.wait(60)
        capture = secure_stack.conn("capture", mtls=True)
        forged = [new_request(f"victim-{i}", requested_by=AUTO_BY) for i in range(5)]
        for request in forged:
            send_request(capture, t, request)
        # the guard read them (it refuses each: no rank of those runs answers), and said who sent them
        for request in forged:
            progress = follow(capture, t, request, timeout=30)
            assert progress.whole is not None and progress.whole["requester"] == "capture"
        first = service.webhook_alert("StepTimeRegression", "real-run", 0, "firing")
        assert first.action == "requested", first.line()  # the forged five did not count
        second = service.webhook_alert("StepTimeRegression", "other-run", 0, "firing")
        assert second.action == "skipped" and "max_per_day" in second.detail  # its own request did
        wait_until(lambda: service.requests_sent == 1, 10, "the request to be sent")
    finally:
        stop.set()
        thread.join(30)


def test_acl_show_lists_a_role_s_acls_and_apply_gives_them(secure_stack, tmp_path):
    shown = CliRunner().invoke(app, ["acl", "show", "--role", "capture", "--user", "alice", "--topic-prefix", "pq"])
    assert shown.exit_code == 0
    assert shown.output.splitlines() == [
        "ALLOW User:alice WRITE TOPIC pq.requests.alice", "ALLOW User:alice DESCRIBE TOPIC pq.requests.alice",
        "ALLOW User:alice READ TOPIC pq.requests. (prefixed)", "ALLOW User:alice DESCRIBE TOPIC pq.requests. (prefixed)",
        "ALLOW User:alice READ TOPIC pq.control", "ALLOW User:alice DESCRIBE TOPIC pq.control",
        "ALLOW User:alice READ TOPIC pq.run", "ALLOW User:alice DESCRIBE TOPIC pq.run"]
    admin = str(secure_stack.material / "admin.properties")
    applied = CliRunner().invoke(app, ["acl", "apply", "--role", "sink", "--user", "trainer", "--topic-prefix",
                                       "pq-applied", "-F", admin, "--group", "g-applied"])
    assert applied.exit_code == 0, applied.output
    # the authorizer learns new ACLs through the metadata log: within moments, not at once
    wait_until(lambda: consume_error(secure_stack.conn("trainer"), "pq-applied.steps", group="g-applied") is None,
               30, "the applied ACLs to let the user read as a sink")
    # a user without the right to give ACLs is told in one line
    refused = CliRunner().invoke(app, ["acl", "apply", "--role", "sink", "--user", "x", "--topic-prefix", "pq-applied",
                                       "-F", str(secure_stack.material / "trainer.properties")])
    assert refused.exit_code != 0 and "error:" in refused.output
