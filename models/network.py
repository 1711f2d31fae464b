"""What the model classes share: their configuration (class count, input resolution, width
multiplier, dropout rate, input channels), its dict, and the input shape it gives.

Each model (``models/alexnet.py``, ``models/mobilenet_v1.py``, ``models/mobilenet_v2.py``)
subclasses :class:`Network`, names its ``arch``, its default dropout rate and the resolutions
it takes, and writes its own ``forward``.
"""

from __future__ import annotations


class Network:
    """A convolutional network's configuration. ``num_classes``: logits per image;
    ``resolution``: the input's side in pixels (square NCHW images); ``width``: the width
    multiplier of the channels; ``dropout``: the dropout rate of the classifier (None: the
    model's :attr:`DROPOUT`); ``in_channels``: the input's channels. Raises ValueError for a
    resolution the model does not take (:meth:`check_resolution`)."""

    arch = ""
    #: the default dropout rate (torchvision's for the model)
    DROPOUT = 0.0

    def __init__(self, num_classes: int = 1000, resolution: int = 224, width: float = 1.0,
                 dropout: float | None = None, in_channels: int = 3):
        self.check_resolution(resolution)
        self.num_classes, self.resolution, self.width = num_classes, resolution, width
        self.dropout = self.DROPOUT if dropout is None else dropout
        self.in_channels = in_channels

    def check_resolution(self, resolution: int) -> None:
        """Raise ValueError where the model cannot take ``resolution`` (every side goes here)."""

    def config(self) -> dict:
        """The keyword arguments that make this network again (a checkpoint stores them)."""
        return {"num_classes": self.num_classes, "resolution": self.resolution,
                "width": self.width, "dropout": self.dropout, "in_channels": self.in_channels}

    def input_shape(self, batch: int) -> tuple[int, int, int, int]:
        """(batch, channels, resolution, resolution): the NCHW shape of a batch of images."""
        return (batch, self.in_channels, self.resolution, self.resolution)


def multiple_of_32(name: str, resolution: int) -> None:
    """Raise ValueError unless ``resolution`` is a multiple of 32 (five stride-2 stages)."""
    if resolution < 32 or resolution % 32:
        raise ValueError(f"{name} resolution must be a multiple of 32 (>= 32), got {resolution}")
