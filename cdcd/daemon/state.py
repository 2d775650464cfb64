"""Moved to ``cdcd.daemon_state`` (the node reads it too, and sits below the daemon); kept so
older imports work."""

from cdcd.daemon_state import *  # noqa: F403
from cdcd.daemon_state import __all__  # noqa: F401
