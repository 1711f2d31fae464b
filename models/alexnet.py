"""AlexNet (Krizhevsky et al. 2012) in torchvision's single-tower layout (``features.{i}``,
``classifier.{i}``): five convolutions with ReLU and max pooling, adaptive average pooling to 6x6,
and three linear layers with dropout before the first two."""

from __future__ import annotations

from .layers import Graph
from .network import Network

# (index in torchvision's features, out channels, kernel, stride, padding, max-pool after)
CONVS = [(0, 64, 11, 4, 2, True), (3, 192, 5, 1, 2, True), (6, 384, 3, 1, 1, False),
         (8, 256, 3, 1, 1, False), (10, 256, 3, 1, 1, True)]


class AlexNet(Network):
    """AlexNet with width multiplier (channels and hidden units), resolution and class count.

    Input: float32 NCHW (batch, 3, resolution, resolution), resolution >= 63; output: logits.
    """

    arch = "alexnet"
    DROPOUT = 0.5

    def check_resolution(self, resolution: int) -> None:
        if resolution < 63:
            raise ValueError(f"AlexNet resolution must be at least 63, got {resolution}")

    def forward(self, g: Graph, x):
        for idx, out, k, s, p, pool in CONVS:
            with g.block(f"features.{idx}"):
                x = g.relu(g.conv2d(f"features.{idx}", x, max(8, int(out * self.width)), k, s, p,
                                    bias=True))
                if pool:
                    x = g.max_pool2d(x, 3, 2)
        hidden = max(16, int(4096 * self.width))
        with g.block("classifier.1"):
            x = g.flatten(g.adaptive_avg_pool2d(x, 6))
            x = g.dropout("classifier.0", x, self.dropout)
            x = g.relu(g.linear("classifier.1", x, hidden))
        with g.block("classifier.4"):
            x = g.dropout("classifier.3", x, self.dropout)
            x = g.relu(g.linear("classifier.4", x, hidden))
        with g.block("classifier.6"):
            x = g.linear("classifier.6", x, self.num_classes)
        return x
