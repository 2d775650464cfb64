"""Defaults a lower layer asks for and only the composition root (``cdcd/__init__.py``) may know:
the root registers factories here without importing what they build, so ``import cdcd`` stays cheap."""

from __future__ import annotations

_defaults: dict[str, object] = {}


def set_default(name: str, factory: object) -> None:
    _defaults[name] = factory


def default(name: str) -> object | None:
    return _defaults.get(name)
