"""autodiff: forward Graph -> train-step Graph."""

from meshplan.autodiff.backward import build_train_step
from meshplan.autodiff.optimizer import OptimizerConfig

__all__ = ["OptimizerConfig", "build_train_step"]
