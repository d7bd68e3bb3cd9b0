"""The local development broker: a single-node Apache Kafka (KRaft) for `profstream stack up`,
the demo and the tests.

One module per concern: ``java`` (the runtime), ``jars`` (the Kafka jars, fetched with
Maven), ``probe`` (is a broker answering?), ``process`` (the broker's process), ``state``
(its state directory), ``logs`` (its log configuration and start-up failures) and
``broker`` (up and down).
"""

from profstream.stack.broker import stack_down, stack_up
from profstream.stack.errors import StackError
from profstream.stack.jars import KAFKA_VERSION, kafka_libs
from profstream.stack.java import find_java
from profstream.stack.probe import wait_for_broker
from profstream.stack.state import Broker, default_state_dir, stack_status

__all__ = [
    "KAFKA_VERSION",
    "Broker",
    "StackError",
    "default_state_dir",
    "find_java",
    "kafka_libs",
    "stack_down",
    "stack_status",
    "stack_up",
    "wait_for_broker",
]
