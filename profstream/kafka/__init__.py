"""Kafka for profstream: topic names and creation, producer and consumer factories."""

from profstream.kafka.topics import BASE_TOPICS, DEFAULT_PREFIX, Topics, ensure_topics

__all__ = [
    "BASE_TOPICS",
    "DEFAULT_PREFIX",
    "Topics",
    "ensure_topics",
]
