"""Masking secrets before anything is logged or printed."""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from typing import Any

_SECRET_KEY = re.compile(r"(pass(word)?|secret|token|credential|private|auth|key\b|\.key$)", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://[^:/@\s]+):(?P<pw>[^@\s]+)@", re.IGNORECASE)
_PARAM_PASSWORD = re.compile(r"(?P<k>(password|pwd|secret|token)=)[^&;\s]+", re.IGNORECASE)
MASK = "***"


def mask_value(value: str) -> str:
    """Hide passwords inside URLs (``jdbc:x://u:pw@h``) and ``password=`` parameters."""
    value = _URL_PASSWORD.sub(lambda m: f"{m.group('scheme')}:{MASK}@", value)
    return _PARAM_PASSWORD.sub(lambda m: f"{m.group('k')}{MASK}", value)


def mask_mapping(data: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out[key] = mask_mapping(value)
        elif _SECRET_KEY.search(key):
            out[key] = MASK
        elif isinstance(value, str):
            out[key] = mask_value(value)
        else:
            out[key] = value
    return out


_SECRET_LOG_FIELD = re.compile(r"(pass(word)?|secret|token|credential|private)", re.IGNORECASE)
"""Narrower than _SECRET_KEY: log events have fields like ``key`` (a cache key) that are not secrets."""


def _mask_any(value: Any) -> Any:
    if isinstance(value, str):
        return mask_value(value)
    if isinstance(value, Mapping):
        return {k: MASK if isinstance(k, str) and _SECRET_KEY.search(k) else _mask_any(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mask_any(v) for v in value]
    return value


def mask_log_event(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
    """structlog processor: the last line of defence, whatever a log call passes (exception texts
    with a JDBC URL, a config table): secret-named fields and passwords inside strings are masked."""
    return {k: MASK if _SECRET_LOG_FIELD.search(k) else _mask_any(v) for k, v in event.items()}
