"""Kafka errors as one line naming the setting to look at; which ones retrying cannot fix."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException

from cdcd.secrets import mask_value


class KafkaSetupError(Exception):
    """A Kafka error retrying cannot fix (authorization, a message over the size limit, a topic
    too small): the caller fails with this one line, its position not advanced."""


_PERMANENT: dict[int, str] = {
    KafkaError.MSG_SIZE_TOO_LARGE: "max_message_bytes",
    KafkaError.RECORD_LIST_TOO_LARGE: "max_message_bytes",
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "topic",
    KafkaError.GROUP_AUTHORIZATION_FAILED: "group_id",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "bootstrap_servers",
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "transactional_id",
    KafkaError.SASL_AUTHENTICATION_FAILED: "sasl_username",
    KafkaError._AUTHENTICATION: "sasl_username",
    KafkaError._SSL: "ssl_ca_location",
    KafkaError.INVALID_CONFIG: "client_config",
    KafkaError._INVALID_ARG: "client_config",
    KafkaError.UNSUPPORTED_VERSION: "bootstrap_servers",
}


def error_of(exc: BaseException) -> KafkaError | None:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def setting_of(err: KafkaError) -> str | None:
    """The setting a permanent error is about; None for errors a new attempt may get past."""
    return _PERMANENT.get(err.code())


def describe(exc: BaseException) -> str:
    err = error_of(exc)
    if err is None:
        return mask_value(f"{type(exc).__name__}: {exc}")
    return mask_value(f"{err.name()}: {err.str()}")


def missing_topic(topic: str, bootstrap_servers: str) -> str:
    """How a topic that does not exist (never made, or deleted) is named in an error line."""
    return f"topic '{topic}' does not exist on {mask_value(bootstrap_servers)}"


def unknown_topic(err: KafkaError | None) -> bool:
    """The error a broker or librdkafka gives for a topic it does not have."""
    return err is not None and err.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)
