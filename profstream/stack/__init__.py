"""The local development broker: a single-node Apache Kafka (KRaft) for `profstream stack up`,
the demo and the tests."""
