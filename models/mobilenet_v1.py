"""MobileNetV1 (Howard et al. 2017, "MobileNets: Efficient Convolutional Neural Networks for Mobile
Vision Applications"): a 3x3 convolution, 13 depthwise-separable blocks, global pooling, a linear
classifier. Names: ``features.{i}`` for the blocks (``dw``/``pw`` convs with their BatchNorms)."""

from __future__ import annotations

from .layers import Graph
from .network import Network, multiple_of_32

# (output channels, stride) of the 13 depthwise-separable blocks: Table 1 of the paper.
BLOCKS = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
          (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1)]


class MobileNetV1(Network):
    """MobileNetV1 with width multiplier, input resolution and class count as parameters.

    Input: float32 NCHW (batch, 3, resolution, resolution); output: logits (batch, num_classes).
    """

    arch = "mobilenet_v1"
    DROPOUT = 0.0

    def check_resolution(self, resolution: int) -> None:
        multiple_of_32("MobileNetV1", resolution)

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
