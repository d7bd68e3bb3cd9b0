"""The local development Kafka (KRaft) for `profstream stack up`, the demo and the tests: a
single broker, or a cluster of several on loopback for fault tests.

One module per concern: ``java`` (the runtime), ``jars`` (the Kafka jars, fetched with
Maven), ``probe`` (is a broker answering?), ``process`` (the broker's process), ``state``
(its state directory), ``logs`` (its log configuration and start-up failures),
``properties`` (a node's server.properties), ``node`` (configure, format and launch one
node), ``cluster`` (several nodes, one quorum) and ``broker`` (up, down, status).
"""

from profstream.stack.broker import kill_broker, stack_down, stack_status, stack_up, start_broker
from profstream.stack.cluster import Cluster
from profstream.stack.errors import StackError
from profstream.stack.jars import KAFKA_VERSION, kafka_libs
from profstream.stack.java import find_java
from profstream.stack.probe import wait_for_broker
from profstream.stack.state import Broker, default_state_dir

__all__ = [
    "KAFKA_VERSION",
    "Broker",
    "Cluster",
    "StackError",
    "default_state_dir",
    "find_java",
    "kafka_libs",
    "kill_broker",
    "stack_down",
    "stack_status",
    "stack_up",
    "start_broker",
    "wait_for_broker",
]
