"""The cdcd daemon (DESIGN §6)."""

from cdcd.daemon.config import DaemonConfig, load_daemon_config
from cdcd.daemon.daemon import Daemon
from cdcd.daemon_state import DaemonState, Mode

__all__ = ["Daemon", "DaemonConfig", "DaemonState", "Mode", "load_daemon_config"]
