"""``kind = "python"``: a user class ``class = "pkg.module:Class"`` built with its ``[consumer.options]``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from cdcd.config import ConfigError, convert, import_object
from cdcd.consumer import Consumer


class PythonOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename={"class_": "class"}):
    class_: str
    options: dict[str, Any] = {}


def load_python_consumer(options: Mapping[str, Any], source: str) -> Consumer:
    opts = convert(options, PythonOptions, source)
    cls = import_object(opts.class_, source, "class")
    try:
        consumer = cls(**opts.options)
    except TypeError as exc:
        raise ConfigError(f"{source}.options: {exc}") from None
    for method in ("on_events", "start", "stop"):
        if not callable(getattr(consumer, method, None)):
            raise ConfigError(f"{source}: key 'class': {opts.class_} has no {method}() (see cdcd.consumer.Consumer)")
    return consumer  # type: ignore[no-any-return]
