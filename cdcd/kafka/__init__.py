"""Kafka transport: the ``kafka`` sink (cdcd -> Kafka, exactly once, Debezium's envelope) and
``cdcd kafka-to-node`` (Kafka -> a node through its replication endpoint)."""
