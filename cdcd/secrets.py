"""Masking secrets before anything is logged or printed."""

from __future__ import annotations

import re
from collections.abc import Mapping
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
