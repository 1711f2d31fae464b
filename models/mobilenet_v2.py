"""MobileNetV2 (Sandler et al. 2018, "MobileNetV2: Inverted Residuals and Linear Bottlenecks").

Layer names follow torchvision's ``mobilenet_v2`` (``features.{i}.conv.{j}``, ``classifier.1``),
so that weights exported from torchvision map one to one.
"""

from __future__ import annotations

from .layers import Graph
from .network import Network, multiple_of_32

# (expansion t, output channels c, repeats n, first stride s): Table 2 of the paper.
INVERTED_RESIDUAL_SETTING = [
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
]


def make_divisible(v: float, divisor: int = 8) -> int:
    """Round channels to a multiple of ``divisor``, never below 90% of ``v`` (paper's code)."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class MobileNetV2(Network):
    """MobileNetV2 with width multiplier, input resolution and class count as parameters.

    Input: float32 NCHW (batch, 3, resolution, resolution); output: logits (batch, num_classes).
    """

    arch = "mobilenet_v2"
    DROPOUT = 0.2

    def check_resolution(self, resolution: int) -> None:
        multiple_of_32("MobileNetV2", resolution)

    def _conv_bn(self, g: Graph, name: str, x, out, k, stride, groups=1, act=True):
        x = g.conv2d(f"{name}.0", x, out, k, stride, (k - 1) // 2, groups)
        return g.batch_norm(f"{name}.1", x, act="relu6" if act else None)

    def forward(self, g: Graph, x):
        in_ch = make_divisible(32 * self.width)
        last_ch = make_divisible(1280 * max(1.0, self.width))
        idx = 0
        with g.block(f"features.{idx}"):
            x = self._conv_bn(g, "features.0", x, in_ch, 3, 2)
        for t, c, n, s in INVERTED_RESIDUAL_SETTING:
            out_ch = make_divisible(c * self.width)
            for i in range(n):
                idx += 1
                stride = s if i == 0 else 1
                name = f"features.{idx}.conv"
                with g.block(f"features.{idx}"):
                    y, j = x, 0
                    hidden = int(round(in_ch * t))
                    if t != 1:
                        y = self._conv_bn(g, f"{name}.{j}", y, hidden, 1, 1)
                        j += 1
                    y = self._conv_bn(g, f"{name}.{j}", y, hidden, 3, stride, groups=hidden)
                    y = g.conv2d(f"{name}.{j + 1}", y, out_ch, 1)
                    y = g.batch_norm(f"{name}.{j + 2}", y)
                    x = g.residual(x, y) if stride == 1 and in_ch == out_ch else y
                in_ch = out_ch
        idx += 1
        with g.block(f"features.{idx}"):
            x = self._conv_bn(g, f"features.{idx}", x, last_ch, 1, 1)
        with g.block("classifier"):
            x = g.flatten(g.adaptive_avg_pool2d(x, 1))
            x = g.dropout("classifier.0", x, self.dropout)
            x = g.linear("classifier.1", x, self.num_classes)
        return x
