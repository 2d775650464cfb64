"""The lake sink's former names (``kind = "spark"``, ``SparkLakeConsumer``): see cdcd/sinks/lake.py."""

from __future__ import annotations

from cdcd.sinks.lake import LakeConsumer, LakeOptions, LakeWriteError, root_cause

SparkLakeConsumer = LakeConsumer
SparkOptions = LakeOptions

__all__ = ["LakeWriteError", "SparkLakeConsumer", "SparkOptions", "root_cause"]
