"""The cdcd daemon (DESIGN §6)."""

from cdcd.daemon.config import DaemonConfig, load_daemon_config
from cdcd.daemon.daemon import Daemon
from cdcd.daemon_state import CdcMode, DaemonState

__all__ = ["Daemon", "DaemonConfig", "DaemonState", "CdcMode", "load_daemon_config"]
