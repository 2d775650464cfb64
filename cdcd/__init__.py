"""cdcd: change-data-capture for an embedded key-value node, modelled on Apache Ignite CDC."""

__version__ = "0.1.0"
