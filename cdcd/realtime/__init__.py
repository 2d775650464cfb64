"""Realtime CDC from inside the node (IEP-104, DESIGN §5): the worker the node attaches."""

from cdcd.realtime.worker import RealtimeError, RealtimeMode, RealtimeWorker

__all__ = ["RealtimeError", "RealtimeMode", "RealtimeWorker"]
