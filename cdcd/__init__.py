"""cdcd: change-data-capture for an embedded key-value node, modelled on Apache Ignite CDC."""

__version__ = "0.1.0"

from cdcd.logging import configure_library as _configure_library

_configure_library()
