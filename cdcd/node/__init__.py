"""The storage node (DESIGN §4)."""

from cdcd.node.cache import Cache
from cdcd.node.config import NodeConfig
from cdcd.node.node import Node, NodeLocked
from cdcd.node.transaction import Transaction
from cdcd.node.writes import ValueRefused

__all__ = ["Cache", "Node", "NodeConfig", "NodeLocked", "Transaction", "ValueRefused"]
