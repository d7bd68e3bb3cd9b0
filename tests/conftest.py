"""Shared fixtures: one real local Kafka broker per test session, fresh topics per test.

Set PROFSTREAM_TEST_BOOTSTRAP=host:port to run against a broker that is already up
(e.g. one from `profstream stack up`) instead of starting one for the session.

Every test that uses ``kafka_bootstrap`` (directly or through ``topics``) is marked
``kafka``, so ``pytest -m kafka`` runs only those and ``pytest -m "not kafka"`` skips them.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator

import pytest

from profstream.kafka.topics import Topics, delete_topics, ensure_topics
from profstream.stack import stack_down, stack_up, wait_for_broker

BOOTSTRAP_ENV = "PROFSTREAM_TEST_BOOTSTRAP"


def pytest_configure(config: pytest.Config) -> None:
    # Monitors of the tests send no RankProgress unless a test asks for it (test_hangs.py,
    # test_hang_e2e.py give progress_interval_s): those records leave on a timer, so counts of
    # the raw and steps topics' messages would depend on how long a test's Monitors lived.
    os.environ.setdefault("PROFSTREAM_PROGRESS_INTERVAL_S", "0")
    # kafka-python 3.x loads its protocol schemas with the deprecated
    # importlib.resources.read_text/open_text: hundreds of warnings that are not ours.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:read_text is deprecated:DeprecationWarning:kafka.protocol.schemas.load_json",
    )
    config.addinivalue_line(
        "filterwarnings",
        "ignore:open_text is deprecated:DeprecationWarning:importlib.resources._legacy",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "kafka_bootstrap" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kafka)
        if "secure_stack" in getattr(item, "fixturenames", ()):  # a broker too: not for `-m "not kafka"`
            item.add_marker(pytest.mark.secure)
            item.add_marker(pytest.mark.kafka)


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``host:port`` of a Kafka broker that answers; started once per session."""
    external = os.environ.get(BOOTSTRAP_ENV, "").strip()
    if external:
        wait_for_broker(external, timeout=30.0)
        yield external
        return
    state_dir = tmp_path_factory.mktemp("kafka-stack")
    broker = stack_up(state_dir=state_dir)
    try:
        yield broker.bootstrap
    finally:
        stack_down(state_dir=state_dir)


@pytest.fixture(scope="session")
def secure_stack(tmp_path_factory: pytest.TempPathFactory):
    """The secured broker of `profstream stack up --secure` (SASL_SSL with SCRAM users,
    mutual TLS, ACLs), started once per session: ``tests.secure.SecureStack``. Every test
    using it is marked ``secure`` (make test-secure)."""
    from tests.secure import SecureStack

    state_dir = tmp_path_factory.mktemp("secure-stack")
    stack_up(state_dir=state_dir, secure=True)
    try:
        yield SecureStack(state_dir)
    finally:
        stack_down(state_dir=state_dir)


@pytest.fixture(scope="session")
def _nvml_library(tmp_path_factory: pytest.TempPathFactory):
    from tests.nvml import build

    return build(tmp_path_factory.mktemp("nvml-double"))


@pytest.fixture
def nvml(_nvml_library, monkeypatch: pytest.MonkeyPatch):
    """NVML without a GPU (tests/nvml.py): one device at default values, loaded by pynvml
    for this test; ``nvml.environment()`` gives a child process the same double."""
    from tests.nvml import NvmlDouble

    double = NvmlDouble(_nvml_library)
    double.reset(1)
    double.install(monkeypatch)
    return double


def _prefix_for(node_name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", node_name).strip("-.") or "test"
    return f"t-{name[:60]}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def topics(kafka_bootstrap: str, request: pytest.FixtureRequest) -> Iterator[Topics]:
    """The five profstream topics under a prefix unique to this test (raw: 4 partitions)."""
    t = Topics(prefix=_prefix_for(request.node.name))
    ensure_topics(kafka_bootstrap, t, raw_partitions=4, partitions=3)
    yield t
    try:
        delete_topics(kafka_bootstrap, t, timeout=5.0)
    except Exception:  # cleanup only: a leftover topic on a throwaway broker is harmless
        pass
