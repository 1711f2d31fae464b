"""MobileNetV1 (Howard et al. 2017, "MobileNets: Efficient Convolutional Neural Networks for Mobile
Vision Applications"): a 3x3 convolution, 13 depthwise-separable blocks, global pooling, a linear
classifier. Names: ``features.{i}`` for the blocks (``dw``/``pw`` convs with their BatchNorms)."""

from __future__ import annotations

from .layers import Graph

# (output channels, stride) of the 13 depthwise-separable blocks: Table 1 of the paper.
BLOCKS = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
          (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1)]


class MobileNetV1:
    """MobileNetV1 with width multiplier, input resolution and class count as parameters.

    Input: float32 NCHW (batch, 3, resolution, resolution); output: logits (batch, num_classes).
    """

    arch = "mobilenet_v1"

    def __init__(self, num_classes: int = 1000, resolution: int = 224, width: float = 1.0,
                 dropout: float = 0.0, in_channels: int = 3):
        if resolution < 32 or resolution % 32:
            raise ValueError(f"MobileNetV1 resolution must be a multiple of 32 (>= 32), "
                             f"got {resolution}")
        self.num_classes, self.resolution, self.width = num_classes, resolution, width
        self.dropout, self.in_channels = dropout, in_channels

    def config(self) -> dict:
        return {"num_classes": self.num_classes, "resolution": self.resolution,
                "width": self.width, "dropout": self.dropout, "in_channels": self.in_channels}

    def input_shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch, self.in_channels, self.resolution, self.resolution)

    def forward(self, g: Graph, x):
        ch = max(8, int(32 * self.width))
        with g.block("features.0"):
            x = g.batch_norm("features.0.bn", g.conv2d("features.0.conv", x, ch, 3, 2, 1),
                             act="relu")
        for i, (out, stride) in enumerate(BLOCKS, start=1):
            out = max(8, int(out * self.width))
            with g.block(f"features.{i}"):
                x = g.conv2d(f"features.{i}.dw", x, ch, 3, stride, 1, groups=ch)
                x = g.batch_norm(f"features.{i}.dw_bn", x, act="relu")
                x = g.conv2d(f"features.{i}.pw", x, out, 1)
                x = g.batch_norm(f"features.{i}.pw_bn", x, act="relu")
            ch = out
        with g.block("classifier"):
            x = g.flatten(g.adaptive_avg_pool2d(x, 1))
            x = g.dropout("classifier.dropout", x, self.dropout)
            x = g.linear("classifier.fc", x, self.num_classes)
        return x
