"""capture: nn.Module -> forward Graph (through torch.export)."""

from meshplan.capture.cache import cached, capture_key
from meshplan.capture.export import DEVICE, capture

__all__ = ["DEVICE", "capture", "cached", "capture_key"]
