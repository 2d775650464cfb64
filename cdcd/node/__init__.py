"""The storage node (DESIGN §4)."""

from cdcd.node.cache import Cache
from cdcd.node.config import NodeConfig
from cdcd.node.node import Node, NodeLocked
from cdcd.node.transaction import Transaction

__all__ = ["Cache", "Node", "NodeConfig", "NodeLocked", "Transaction"]
