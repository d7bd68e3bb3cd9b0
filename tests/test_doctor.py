"""`profstream doctor`: every check a user needs, what to do about each failure, and its exit code."""

from __future__ import annotations

import subprocess
import sys

from profstream import doctor
from profstream.doctor import FAIL, INFO, OK, WARN, run_checks


def _doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profstream.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def _by_check(findings) -> dict:
    return {f.check: f for f in findings}


def test_a_reachable_broker_with_its_topics_passes(kafka_bootstrap, topics):
    found = _by_check(run_checks(kafka_bootstrap, topics.prefix))
    assert [found[name].status for name in ("Python", "Java", "Kafka jars", "broker", "topics")] == [OK] * 5
    assert kafka_bootstrap in found["broker"].found
    done = _doctor("--bootstrap", kafka_bootstrap, "--topic-prefix", topics.prefix)
    assert done.returncode == 0, done.stdout + done.stderr
    for check in ("Python", "options", "native Monitor", "Java", "Kafka jars", "broker", "topics", "Prometheus", "torch", "compiled walk", "NVML",
                  "ports"):
        assert check in done.stdout, check


def test_a_bad_option_in_the_environment_fails_naming_it(monkeypatch):
    monkeypatch.delenv("PROFSTREAM_PROGRESS_INTERVAL_S", raising=False)  # tests/conftest.py's: another variable
    monkeypatch.setenv("PROFSTREAM_OPTIONS", '{"run_id": "r1", "every_n_step": 5}')
    finding = doctor.check_options()
    assert finding.status == FAIL and "unknown option 'every_n_step' in PROFSTREAM_OPTIONS" in finding.fix
    monkeypatch.setenv("PROFSTREAM_OPTIONS", '{"run_id": "r1", "profile": true, "profile_start_step": 5}')
    assert doctor.check_options() == doctor.Finding("options", OK, "PROFSTREAM_OPTIONS valid")


def test_a_broken_profstream_options_does_not_hide_the_broker_of_profstream_bootstrap(monkeypatch):
    """The options row fails on the bad JSON; the broker row still checks $PROFSTREAM_BOOTSTRAP
    (it said "none given")."""
    monkeypatch.setenv("PROFSTREAM_OPTIONS", "{not json")
    monkeypatch.setenv("PROFSTREAM_BOOTSTRAP", "127.0.0.1:1")
    found = _by_check(run_checks(broker_timeout_s=0.5))
    assert found["options"].status == FAIL
    assert found["broker"].status == FAIL and "127.0.0.1:1 does not answer" in found["broker"].found


def test_the_native_monitor_row_says_which_monitor_runs_and_why_not_native(monkeypatch):
    from profstream.producers import native

    found = doctor.check_native_monitor()
    assert found.status == OK and "librdkafka" in found.found  # built by this checkout's install
    monkeypatch.setattr(native, "_loaded", (None, "the compiled extension is not there (test)"))
    found = doctor.check_native_monitor()
    assert found.status == WARN and "not there (test)" in found.found and "runs in Python" in found.found
    assert "g++" in found.fix


def test_missing_topics_are_a_warning_that_says_who_creates_them(kafka_bootstrap):
    found = _by_check(run_checks(kafka_bootstrap, "no-such-deployment"))
    assert found["topics"].status == WARN and "no-such-deployment.raw" in found["topics"].found
    assert "profstream process" in found["topics"].fix


def test_a_broker_that_does_not_answer_fails_and_says_what_to_do():
    found = _by_check(run_checks("127.0.0.1:1", broker_timeout_s=1))
    assert found["broker"].status == FAIL and "stack up" in found["broker"].fix
    assert "topics" not in found
    done = _doctor("--bootstrap", "127.0.0.1:1", "--timeout", "1")
    assert done.returncode == 1 and "does not answer" in done.stdout


def test_without_java_and_maven_a_local_broker_cannot_run(tmp_path, monkeypatch):
    for var in ("JAVA_HOME", "KAFKA_HOME", "PROFSTREAM_BOOTSTRAP", "PROFSTREAM_OPTIONS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no java, no mvn
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no jars fetched before, no local broker
    found = _by_check(run_checks())
    assert found["Java"].status == FAIL and "install a Java 17+ runtime" in found["Java"].fix
    assert found["Kafka jars"].status == FAIL and "apt-get install maven" in found["Kafka jars"].fix
    done = _doctor()  # the same environment
    assert done.returncode == 1 and "Java" in done.stdout


def test_no_nvml_is_information_unless_gpu_checks_are_asked_for(monkeypatch):
    monkeypatch.setattr(doctor, "NVML_LIBRARY", "libnvidia-ml-that-is-not-there.so.1")
    assert doctor.check_nvml(gpu=False).status == INFO
    finding = doctor.check_nvml(gpu=True)
    assert finding.status == FAIL and "NVIDIA driver" in finding.fix


def test_gpu_checks_pass_where_nvml_sees_gpus(monkeypatch, nvml):
    nvml.reset(devices=2)
    monkeypatch.setattr(doctor, "NVML_LIBRARY", str(nvml.library))
    finding = doctor.check_nvml(gpu=True)
    assert (finding.status, finding.found) == (OK, "2 GPUs visible")


def test_a_busy_port_is_named_with_the_option_that_moves_it():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        finding = doctor.check_ports({port: "profstream sink prometheus --port"})
    assert finding.status == WARN and f"{port} (profstream sink prometheus --port)" in finding.found
