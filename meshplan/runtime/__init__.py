"""runtime: execute plans with torch kernels."""

from meshplan.runtime.executor import Executor

__all__ = ["Executor"]
