"""capture: nn.Module -> forward Graph (through torch.export)."""

from meshplan.capture.export import DEVICE, capture

__all__ = ["DEVICE", "capture"]
