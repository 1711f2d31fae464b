"""Model zoo: AlexNet, MobileNetV1, MobileNetV2 as Relax graphs with named parameters, their
initialisation and checkpoints.

A checkpoint is one ``.npz`` file: every parameter and state under its name, plus ``__header__``,
a JSON string ``{"format": "thomas_tune.checkpoint/1", "arch", "config", "classes", "shapes"}``.

Building graphs (:func:`trace`) needs TVM's compiler (``tvm.relax``). The rest (``build``,
``spec``, ``init_params``, checkpoints) also works in a process whose TVM loaded only its runtime
library (``TVM_USE_RUNTIME_LIB=1``, as a deployed export runs): :func:`spec` then runs the
model's forward pass on shapes alone (:class:`ShapeGraph`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..files import replacing
from .alexnet import AlexNet
from .layers import Graph, ParamSpec, Records, compiler_available, require_compiler
from .mobilenet_v1 import MobileNetV1
from .mobilenet_v2 import MobileNetV2

ARCHS = {m.arch: m for m in (MobileNetV2, MobileNetV1, AlexNet)}
CHECKPOINT_FORMAT = "thomas_tune.checkpoint/1"


def build(arch: str, **config):
    """Instantiate a model by architecture name (``mobilenet_v2``, ``mobilenet_v1``, ``alexnet``).

    Raises ValueError naming the known architectures for an unknown name.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown model {arch!r}; choose one of {sorted(ARCHS)}")
    return ARCHS[arch](**config)


@dataclass
class ModelSpec:
    """What one forward pass needs: parameters and states in graph order, blocks, dropout masks."""

    params: list[ParamSpec]
    states: list[ParamSpec]
    blocks: list[str]
    masks: dict[str, tuple[tuple[int, ...], float]]


def trace(model, batch: int, mode: str, dtype: str = "float32"):
    """A fresh BlockBuilder, a :class:`Graph` for ``mode`` and the input variable ``x``;
    callers open a function and emit ``model.forward(g, x)`` into it.

    Used by the graph builders; callers close the function themselves. ``dtype``: float32 for
    the product, float64 for reference computations. Raises RuntimeError in a process without
    TVM's compiler (``TVM_USE_RUNTIME_LIB=1``).
    """
    require_compiler("tracing a model into Relax")
    from tvm import relax
    bb = relax.BlockBuilder()
    g = Graph(bb, mode, dtype)
    x = relax.Var("x", relax.TensorType(model.input_shape(batch), dtype))
    return bb, g, x


class ShapeGraph(Records):
    """The :class:`Graph` API on shapes alone: a tensor is its shape (a tuple of ints), and the
    parameters, states, blocks and dropout masks are recorded as :class:`Graph` records them
    (same names, shapes, blocks and order), with no Relax. What :func:`spec` runs where TVM's
    compiler is not loaded. Shapes follow Relax's operators: a convolution or max pooling of
    kernel k, stride s and padding p gives ``(n + 2p - k) // s + 1`` (no dilation, floor)."""

    def _value(self, name, shape):
        return shape

    @staticmethod
    def _pair(v) -> tuple[int, int]:
        return (int(v), int(v)) if np.isscalar(v) else (int(v[0]), int(v[1]))

    @classmethod
    def _window(cls, x, kernel, stride, padding, channels):
        """(N, channels, H', W') of a sliding window over x (N, C, H, W)."""
        kh, kw = cls._pair(kernel)
        sh, sw = cls._pair(stride)
        if np.isscalar(padding):
            top = left = bottom = right = int(padding)
        elif len(padding) == 2:
            (top, left), (bottom, right) = cls._pair(padding), cls._pair(padding)
        else:
            top, left, bottom, right = (int(p) for p in padding)
        n, _, h, w = x
        return (n, channels, (h + top + bottom - kh) // sh + 1, (w + left + right - kw) // sw + 1)

    def conv2d(self, name, x, out_channels, kernel, stride=1, padding=0, groups=1, bias=False):
        kh, kw = self._pair(kernel)
        self.param(f"{name}.weight", (out_channels, x[1] // groups, kh, kw), "kaiming_out")
        if bias:
            self.param(f"{name}.bias", (out_channels,), "zeros")
        return self._window(x, kernel, stride, padding, out_channels)

    def batch_norm(self, name, x, eps=1e-5, momentum=0.1, act=None):
        c = x[1]
        self.param(f"{name}.weight", (c,), "ones")
        self.param(f"{name}.bias", (c,), "zeros")
        self.state(f"{name}.running_mean", (c,), "zeros")
        self.state(f"{name}.running_var", (c,), "ones")
        return x

    def relu(self, x):
        return x

    def relu6(self, x):
        return x

    def max_pool2d(self, x, kernel, stride, padding=0):
        return self._window(x, kernel, stride, padding, x[1])

    def adaptive_avg_pool2d(self, x, output_size):
        return (x[0], x[1], *self._pair(output_size))

    def flatten(self, x):
        return (x[0], int(np.prod(x[1:])))

    def residual(self, a, b):
        return tuple(np.broadcast_shapes(a, b))

    def linear(self, name, x, out_features):
        self.param(f"{name}.weight", (out_features, x[1]), "linear")
        self.param(f"{name}.bias", (out_features,), "zeros")
        return (x[0], out_features)

    def dropout(self, name, x, p):
        if self.training and p != 0.0:
            self.masks[f"{name}.mask"] = (x, p, x)
        return x


def spec(model, batch: int = 1, mode: str = "train") -> ModelSpec:
    """Parameters, states, blocks and dropout masks of ``model`` (shapes for ``batch``).

    Traced with Relax where TVM's compiler is loaded, else with :class:`ShapeGraph` (same
    result). ``mode``: ``"train"`` (dropout masks listed) or ``"infer"``; ValueError for
    another."""
    if compiler_available():
        bb, g, x = trace(model, batch, mode)
        with bb.function("spec"):
            with bb.dataflow():
                y = bb.emit_output(model.forward(g, x))
            bb.emit_func_output(y, params=[x])
    else:
        g = ShapeGraph(mode)
        model.forward(g, tuple(model.input_shape(batch)))
    return ModelSpec([p for p, _ in g.params.values()], [s for s, _ in g.states.values()],
                     list(g.blocks), {k: (v[0], v[1]) for k, v in g.masks.items()})


def _init_tensor(p: ParamSpec, rng: np.random.Generator) -> np.ndarray:
    if p.init == "kaiming_out":
        fan_out = p.shape[0] * int(np.prod(p.shape[2:]))
        out = rng.normal(0.0, np.sqrt(2.0 / fan_out), p.shape)
    elif p.init == "linear":
        out = rng.normal(0.0, 0.01, p.shape)
    elif p.init == "ones":
        out = np.ones(p.shape)
    elif p.init == "zeros":
        out = np.zeros(p.shape)
    else:
        raise ValueError(f"unknown initialiser {p.init!r} for {p.name}")
    return out.astype("float32")


def init_params(model, seed: int = 0) -> dict[str, np.ndarray]:
    """Fresh float32 parameters and states for ``model`` (initialisers in :class:`ParamSpec`)."""
    rng = np.random.default_rng(seed)
    s = spec(model)
    return {p.name: _init_tensor(p, rng) for p in s.params + s.states}


def save_checkpoint(path: str, model, tensors: dict[str, np.ndarray],
                    classes: list[str] | None = None) -> None:
    """Write ``tensors`` (parameters and states) of ``model`` to ``path`` atomically.

    The file appears complete or not at all: it is written to a temporary file in the same folder,
    flushed, fsync'ed and renamed. Raises ValueError when a tensor is missing or mis-shaped.
    """
    s = spec(model)
    shapes = {}
    for p in s.params + s.states:
        if p.name not in tensors:
            raise ValueError(f"checkpoint for {model.arch}: tensor {p.name!r} is missing")
        arr = np.asarray(tensors[p.name], dtype="float32")
        if arr.shape != p.shape:
            raise ValueError(f"checkpoint for {model.arch}: {p.name!r} has shape {arr.shape}, "
                             f"the model needs {p.shape}")
        shapes[p.name] = list(p.shape)
    header = {"format": CHECKPOINT_FORMAT, "arch": model.arch, "config": model.config(),
              "classes": list(classes) if classes else None, "shapes": shapes}
    with replacing(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, __header__=np.array(json.dumps(header)),
                 **{k: np.asarray(tensors[k], dtype="float32") for k in shapes})


def load_checkpoint(path: str):
    """Read a checkpoint written by :func:`save_checkpoint`.

    Returns (model, tensors, classes). Raises ValueError for a file that is not a thomas_tune
    checkpoint or whose tensors do not match the model it names.
    """
    try:
        data = np.load(path, allow_pickle=False)
        header = json.loads(str(data["__header__"]))
    except (OSError, KeyError, ValueError) as err:
        raise ValueError(f"{path}: not a thomas_tune checkpoint ({err})") from err
    if header.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {header.get('format')!r}")
    model = build(header["arch"], **header["config"])
    tensors = {k: data[k] for k in header["shapes"]}
    s = spec(model)
    for p in s.params + s.states:
        if p.name not in tensors or tensors[p.name].shape != p.shape:
            raise ValueError(f"{path}: tensor {p.name!r} missing or mis-shaped for {model.arch}")
    return model, tensors, header.get("classes")


def head_name(model) -> str:
    """Name prefix of the classifier's last linear layer (``classifier.1`` for MobileNetV2)."""
    return spec(model).params[-1].name.rsplit(".", 1)[0]


def replace_head(model, tensors: dict[str, np.ndarray], num_classes: int, seed: int = 0):
    """The same network with a new classifier head of ``num_classes`` outputs.

    Every tensor is kept except the last linear layer's weight (num_classes, features) and bias
    (num_classes,), which are freshly initialised (seeded by ``seed``). Returns (new model,
    new tensors). Raises ValueError for num_classes < 2.
    """
    if num_classes < 2:
        raise ValueError(f"a classifier needs at least 2 classes, got {num_classes}")
    new = build(model.arch, **{**model.config(), "num_classes": num_classes})
    head = head_name(new) + "."
    # the head's own random stream: not the one init_params(seed) would give it, which may be
    # the very initialisation the pretrained head started from
    rng = np.random.default_rng([seed, 0x4EAD])
    s = spec(new)
    return new, {p.name: (_init_tensor(p, rng) if p.name.startswith(head)
                          else np.asarray(tensors[p.name], dtype="float32"))
                 for p in s.params + s.states}
