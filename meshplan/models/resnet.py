"""ResNet with Bottleneck blocks (v1.5: the stride sits on the 3x3 conv).

Invariants:
- `blocks` is one flat `nn.ModuleList` of every Bottleneck across all four
  stages, so `blocks.{i}` is a layer instance just as in GPT and BERT; a
  stage's stride (1, 2, 2, 2) is applied by its first block.
- Module paths: `stem.{0: conv, 1: bn}`, `blocks.{i}.{conv1,bn1,conv2,bn2,
  conv3,bn3}`, `blocks.{i}.downsample.{0: conv, 1: bn}` where the shape
  changes, then `fc`.
- Images smaller than 64 px get a 3x3 stride-1 stem (CIFAR style) so tiny
  test images are not pooled away; larger ones get the ImageNet 7x7/2 stem
  and a 3x3/2 max-pool.
- `forward(images, labels)` returns the scalar mean cross-entropy loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EXPANSION = 4
STAGE_STRIDES = (1, 2, 2, 2)
SMALL_IMAGE = 64


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    """A bias-free conv (BN supplies the shift) followed by BatchNorm2d."""
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(cout))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand, plus a residual connection."""

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        cout = planes * EXPANSION
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        # Only project the shortcut when its shape would not match the output.
        self.downsample = (
            conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return relu(branch(x) + shortcut(x))."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNet(nn.Module):
    """Bottleneck ResNet classifier whose forward returns the loss."""

    def __init__(self, blocks: tuple[int, ...], width: int, image_size: int,
                 num_classes: int):
        super().__init__()
        if image_size < SMALL_IMAGE:
            self.stem = conv_bn(3, width, 3)
            self.pool = nn.Identity()
        else:
            self.stem = conv_bn(3, width, 7, stride=2)
            self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        layers: list[Bottleneck] = []
        cin = width
        strides = STAGE_STRIDES[: len(blocks)]
        for stage, (count, stride) in enumerate(zip(blocks, strides, strict=True)):
            planes = width * 2**stage
            for i in range(count):
                layers.append(Bottleneck(cin, planes, stride if i == 0 else 1))
                cin = planes * EXPANSION
        self.blocks = nn.ModuleList(layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Return mean cross-entropy of classifying `images` (B, 3, S, S)."""
        x = self.pool(F.relu(self.stem(images)))
        for block in self.blocks:
            x = block(x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return F.cross_entropy(self.fc(x), labels)
