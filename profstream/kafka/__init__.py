"""Local Kafka broker (launcher) and topic administration for profstream."""

from profstream.kafka.launcher import (
    KAFKA_VERSION,
    Broker,
    StackError,
    default_state_dir,
    find_java,
    kafka_libs,
    stack_down,
    stack_status,
    stack_up,
    wait_for_broker,
)
from profstream.kafka.topics import BASE_TOPICS, DEFAULT_PREFIX, Topics, ensure_topics

__all__ = [
    "BASE_TOPICS",
    "DEFAULT_PREFIX",
    "KAFKA_VERSION",
    "Broker",
    "StackError",
    "Topics",
    "default_state_dir",
    "ensure_topics",
    "find_java",
    "kafka_libs",
    "stack_down",
    "stack_status",
    "stack_up",
    "wait_for_broker",
]
