"""Bad credentials, certificates and protocols against the real secured broker: each is one
line that says what to fix, at once (never a wait for a timeout), and never shows a secret;
a training process with wrong credentials or a missing ACL trains on, drops and counts,
and says once what is wrong."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from profstream.producers.monitor import Monitor
from tests.helpers import wait_until

SECRET = "Wr0ng-but-Secret-77"
CLI = [sys.executable, "-c", "from profstream.cli import main; main()"]


def _cli(*args: str, env: dict | None = None) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PROFSTREAM_TEST": "1", **(env or {})})
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def _case(secure_stack, kafka_bootstrap, name):
    m = secure_stack.material
    trainer, mtls = str(m / "trainer.properties"), str(m / "trainer-mtls.properties")
    if name == "wrong password":
        return ["-F", trainer, "-X", f"sasl.password={SECRET}"], (
            "the broker refused the credentials of 'trainer' (SCRAM-SHA-512): wrong password or unknown user; check "
            f"sasl.username and sasl.password in {trainer} + kafka_properties")
    if name == "unknown user":
        return ["-F", trainer, "-X", "sasl.username=nobody"], "the broker refused the credentials of 'nobody'"
    if name == "untrusted broker certificate":
        return ["-F", trainer, "-X", f"ssl.ca.location={secure_stack.other_ca()}"], (
            f"the broker's certificate at {secure_stack.sasl_bootstrap} is not trusted: it is not signed by the CA of "
            f"ssl.ca.location ({secure_stack.other_ca()}): give the CA that signed it")
    if name == "client certificate of another CA":
        secure_stack.other_ca()
        cert, key = secure_stack.certificate("intruder", ca="stranger-ca")
        return ["-F", mtls, "-X", f"ssl.certificate.location={cert}", "-X", f"ssl.key.location={key}"], (
            f"the broker does not trust our client certificate ({cert})")
    if name == "expired client certificate":
        cert, key = secure_stack.expired_certificate()
        return ["-F", mtls, "-X", f"ssl.certificate.location={cert}", "-X", f"ssl.key.location={key}"], (
            f"our client certificate (ssl.certificate.location={cert}) expired on 2020-02-01 00:00 UTC: renew it")
    if name == "plaintext to a TLS port":
        return ["--bootstrap", secure_stack.ssl_bootstrap], (
            f"{secure_stack.ssl_bootstrap} is a TLS listener and this client speaks plaintext: set "
            "security.protocol=SSL or SASL_SSL")
    if name == "TLS to a plaintext port":
        return ["--bootstrap", kafka_bootstrap, "-X", "security.protocol=SSL", "-X",
                f"ssl.ca.location={m / 'ca.pem'}"], (
            f"{kafka_bootstrap} does not speak TLS (a plaintext listener?) and this client has security.protocol=SSL")
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["wrong password", "unknown user", "untrusted broker certificate",
                                  "client certificate of another CA", "expired client certificate",
                                  "plaintext to a TLS port", "TLS to a plaintext port"])
def test_each_connection_fault_is_one_line_at_once(secure_stack, kafka_bootstrap, name):
    args, said = _case(secure_stack, kafka_bootstrap, name)
    code, output, took = _cli("capture", "--list", "--topic-prefix", "faults", *args)
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert code == 2 and lines[-1].startswith("error: "), output
    assert said in " ".join(lines[-1].split()), output
    assert len(lines) == 1, output  # the one line, nothing else
    assert took < 30, took  # said at once: not after a client's retries ran out
    assert SECRET not in output


def test_doctor_and_help_never_show_a_secret(secure_stack):
    trainer = str(secure_stack.material / "trainer.properties")
    code, output, _ = _cli("doctor", "-F", trainer, "-X", f"sasl.password={SECRET}")
    assert code == 1 and "refused the credentials of 'trainer'" in " ".join(output.split())
    assert SECRET not in output
    password = (secure_stack.material / "trainer.password").read_text().strip()
    code, output, _ = _cli("doctor", "-F", trainer, "--role", "trainer")
    assert "ACLs of a trainer granted to User:trainer" in " ".join(output.split()) and password not in output
    env = {"PROFSTREAM_KAFKA_PROPERTIES": f"sasl.password={SECRET}", "PROFSTREAM_KAFKA_CONFIG": trainer}
    for command in (["capture", "--help"], ["sink", "prometheus", "--help"], ["--help"]):
        code, output, _ = _cli(*command, env=env)
        assert code == 0 and SECRET not in output and password not in output


def test_doctor_names_the_acl_a_role_is_missing(secure_stack):
    sink = str(secure_stack.material / "sink.properties")
    code, output, _ = _cli("doctor", "-F", sink, "--role", "processor")
    text = " ".join(output.split())
    assert code == 1
    assert "ALLOW User:sink WRITE TOPIC profstream.steps: missing" in text
    assert "an admin gives them: profstream acl apply --role" in text  # (the table wraps the rest)


def test_a_training_process_with_wrong_credentials_trains_on_drops_counts_and_says_so_once(secure_stack, caplog):
    topics = secure_stack.topics("wrong-credentials")
    conn = secure_stack.conn("trainer", sasl_password=SECRET)
    caplog.set_level(logging.INFO)
    m = Monitor(connection=conn, topic_prefix=topics.prefix, run_id="locked-out", connect_timeout_s=2.0,
                host_sample_interval_s=0, device_interval_ms=0)
    slowest = 0.0
    for _ in range(50):
        started = time.monotonic()
        with m.step():
            for i in range(20):
                m.op(f"op{i}", time.time_ns(), 100)
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.02)
    assert slowest < 0.05  # no step waited for Kafka
    wait_until(lambda: any("refused this Monitor" in r.getMessage() for r in caplog.records), 30,
               "the Monitor to say what is wrong")
    m.close(timeout=2)
    wait_until(lambda: m.stats()["dropped_ops"] == 50 * 20, 30, "every op counted as dropped")
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "refused" in r.getMessage()]
    assert len(said) == 1, said
    assert ("refused this Monitor: the broker refused the credentials of 'trainer' (SCRAM-SHA-512): wrong password or "
            "unknown user") in said[0] and "training continues" in said[0]
    assert not any(SECRET in r.getMessage() for r in caplog.records)


def test_a_training_process_without_the_write_acl_names_it_once(secure_stack, caplog):
    topics = secure_stack.topics("no-write-acl")
    caplog.set_level(logging.WARNING)
    # a sink's credentials may read the raw topic (so the Monitor sees it) but not write it
    m = Monitor(connection=secure_stack.conn("sink"), topic_prefix=topics.prefix, run_id="read-only", control=False,
                host_sample_interval_s=0, device_interval_ms=0)
    for _ in range(5):
        with m.step():
            m.op("op", time.time_ns(), 100)
    wait_until(lambda: any("missing ACL" in r.getMessage() for r in caplog.records), 60,
               "the Monitor to name the missing ACL")
    m.close(timeout=2)
    (line,) = [r.getMessage() for r in caplog.records if "missing ACL" in r.getMessage()]
    assert f"missing ACL 'ALLOW User:sink WRITE TOPIC {topics.raw}'" in line
    wait_until(lambda: m.stats()["dropped_ops"] == 5, 30, "the refused ops counted as dropped")


def test_a_processor_with_a_sink_s_credentials_is_told_which_acl_it_lacks(secure_stack):
    topics = secure_stack.topics("sink-as-processor")
    code, output, took = _cli("process", "-F", str(secure_stack.material / "sink.properties"), "--topic-prefix",
                              topics.prefix, "--metrics-port", "0")
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and took < 60, output
    assert lines[0].startswith("error: the broker denied User:sink ") and "missing ACL 'ALLOW User:sink " in lines[0]
