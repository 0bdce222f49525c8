"""capture: nn.Module -> forward Graph (through torch.export)."""

from meshplan.capture.cache import cached, capture_key
from meshplan.capture.export import capture

__all__ = ["capture", "cached", "capture_key"]
