"""Pretrained weights from ONNX: a torchvision-layout AlexNet, MobileNetV1 or MobileNetV2 exported
with ``torch.onnx.export`` (or any exporter that keeps the layer order).

The importer does not rely on tensor names, which differ between exporters (``features.0.0.weight``,
``onnx::Conv_123``, ``p_features_0_0_weight``). It folds the constant parts of the graph (weights
reached through Identity, Cast, Expand, ... nodes), lists the layers that carry weights in graph
order (Conv, BatchNormalization, Gemm, MatMul + Add) and maps them one to one onto the model's
layers in forward order, checking every shape.

Two BatchNorm layouts are accepted:

* kept: ``Conv -> BatchNormalization`` (``torch.onnx.export(..., optimize=False)``, or the legacy
  exporter with ``training=TrainingMode.PRESERVE``): scale, bias and running statistics are
  imported as they are, so fine-tuning starts from the true statistics;
* fused into the convolution (the default of optimising exporters, and of the legacy exporter
  in eval mode): the convolution keeps the fused weight and bias, and the BatchNorm after it
  becomes an affine identity (gamma 1, beta = the fused bias, running mean 0, running variance
  ``1 - eps``), which gives the same inference output.

A fused BatchNorm has lost its scale and shift: the file holds ``W' = s W`` and
``b' = beta - s mean`` with ``s = gamma / sqrt(var + eps)`` per channel, and training-form
BatchNorm on the identity normalises ``W' x`` by its batch statistics, discarding every channel's
learned scale and shift (the network that trains is not the one imported).
:func:`calibrate_batchnorms` recovers them from data: with ``mu`` and ``sigma^2`` the per-channel
mean and variance of the convolution's output ``z = W' x`` over calibration images (the imported
network's inference forward), it sets

    running_mean = mu,  running_var = sigma^2,  gamma = sqrt(sigma^2 + eps),  beta = b' + mu.

The inference form is unchanged (``gamma (z - mu) / sqrt(sigma^2 + eps) + beta = z + b'``), and
the training form on a batch with the calibration images' statistics computes the same
function. When the calibration images follow the distribution the network was trained on (its
BatchNorm statistics ``m``, ``v`` describe ``W x`` there), ``mu = s m`` and ``sigma^2 = s^2 v``,
so ``beta`` is the original shift and ``gamma = sqrt(gamma_0^2 v / (v + eps) + eps)`` is the
original scale's magnitude up to ``eps`` (the sign of a negative ``gamma_0`` lives on in ``W'``).
What cannot be recovered is the scale of ``W`` itself (only ``s W`` is in the file): weights
train in the parametrisation ``W'``, where gradient steps on a channel differ from PyTorch's by
``1 / s^2``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import numpy as np

from . import build, init_params, spec

BN_EPS = 1e-5  # the models' BatchNorm epsilon (layers.Graph.batch_norm), PyTorch's default


@dataclass
class OnnxLayer:
    """One weighted layer of the ONNX graph: ``kind`` conv / bn / linear, its node and arrays."""

    kind: str
    node: str
    op: str
    arrays: dict[str, np.ndarray]
    eps: float = BN_EPS

    def describe(self) -> str:
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in self.arrays.items())
        return f"ONNX node {self.node!r} ({self.op}: {shapes})"


@dataclass
class ImportReport:
    """What the import did: layers mapped, BatchNorms that were fused, a head replaced."""

    layers: int = 0
    fused_batchnorms: list[str] = field(default_factory=list)
    replaced_head: str | None = None
    onnx_classes: int = 0


@dataclass
class Calibration:
    """What :func:`calibrate_batchnorms` did: the BatchNorm layers it set, the images it used,
    and the largest change of the inference logits it caused on the first calibration batch,
    relative to the largest logit (float32 rounding: about 1e-6)."""

    layers: list[str]
    images: int
    logits_change: float


def _load(path: str):
    import onnx
    try:
        proto = onnx.load(path)
    except FileNotFoundError as err:
        raise ValueError(f"ONNX file {path!r} does not exist") from err
    except Exception as err:  # onnx raises DecodeError and others for a file that is not ONNX
        raise ValueError(f"{path!r} is not a readable ONNX model ({type(err).__name__}: "
                         f"{err}); export it with torch.onnx.export") from err
    if not proto.graph.node:
        raise ValueError(f"{path!r} is not a readable ONNX model (its graph has no nodes)")
    return proto


def _constants(proto) -> dict[str, np.ndarray]:
    """Values of every tensor that depends on no graph input (initializers folded forward)."""
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator
    consts = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    inputs = {i.name for i in proto.graph.input} - set(consts)
    for node in proto.graph.node:
        ins = [i for i in node.input if i]
        if any(i in inputs or i not in consts for i in ins):
            continue
        if node.op_type in ("Conv", "BatchNormalization", "Gemm", "MatMul"):
            continue  # layers themselves are not folded
        try:
            outs = ReferenceEvaluator(node).run(None, {i: consts[i] for i in ins})
        except Exception:  # noqa: BLE001 - an op the reference cannot fold stays a graph value
            continue
        consts.update({name: np.asarray(v) for name, v in zip(node.output, outs) if name})
    return consts


def _attr(node, name, default):
    from onnx import helper
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def onnx_layers(proto) -> list[OnnxLayer]:
    """The weighted layers of ``proto`` in graph order (see the module docstring)."""
    consts = _constants(proto)
    producers = {o: n for n in proto.graph.node for o in n.output}
    layers = []

    def const(name):
        return consts.get(name) if name else None

    for i, node in enumerate(proto.graph.node):
        label = node.name or f"#{i} {node.op_type}"
        if node.op_type == "Conv" and const(node.input[1]) is not None:
            arrays = {"weight": const(node.input[1])}
            bias = const(node.input[2]) if len(node.input) > 2 else None
            if bias is not None:
                arrays["bias"] = bias
            layers.append(OnnxLayer("conv", label, "Conv", arrays))
        elif node.op_type == "BatchNormalization":
            vals = [const(n) for n in node.input[1:5]]
            if any(v is None for v in vals):
                raise ValueError(f"ONNX node {label!r} (BatchNormalization) has non-constant "
                                 "parameters; export the model in eval mode")
            layers.append(OnnxLayer("bn", label, "BatchNormalization",
                                    dict(zip(("weight", "bias", "running_mean", "running_var"),
                                             vals)), float(_attr(node, "epsilon", 1e-5))))
        elif node.op_type == "Gemm" and const(node.input[1]) is not None:
            w = const(node.input[1])
            if _attr(node, "transA", 0):
                raise ValueError(f"ONNX node {label!r} (Gemm) has transA=1, which no model "
                                 "layer computes")
            w = w if _attr(node, "transB", 0) else w.T
            w = w * float(_attr(node, "alpha", 1.0))
            arrays = {"weight": w}
            if len(node.input) > 2 and const(node.input[2]) is not None:
                arrays["bias"] = const(node.input[2]) * float(_attr(node, "beta", 1.0))
            layers.append(OnnxLayer("linear", label, "Gemm", arrays))
        elif node.op_type == "MatMul" and const(node.input[1]) is not None:
            arrays = {"weight": const(node.input[1]).T}
            layers.append(OnnxLayer("linear", label, "MatMul", arrays))
        elif node.op_type == "Add" and layers and layers[-1].op == "MatMul" \
                and "bias" not in layers[-1].arrays:
            src = [n for n in node.input if n in producers and
                   producers[n].op_type == "MatMul"]
            other = [n for n in node.input if n not in src]
            if src and other and const(other[0]) is not None:
                layers[-1].arrays["bias"] = const(other[0]).reshape(-1)
    return layers


def _model_layers(model) -> list[tuple[str, str, dict[str, tuple[int, ...]]]]:
    """(layer name, kind, {tensor suffix: shape}) of ``model`` in forward order."""
    s = spec(model)
    states = {q.name: q.shape for q in s.states}
    out: list[tuple[str, str, dict]] = []
    for p in s.params:
        prefix, suffix = p.name.rsplit(".", 1)
        if out and out[-1][0] == prefix:
            out[-1][2][suffix] = p.shape
            continue
        if f"{prefix}.running_mean" in states:
            kind = "bn"
        elif len(p.shape) == 4:
            kind = "conv"
        else:
            kind = "linear"
        out.append((prefix, kind, {suffix: p.shape}))
    for prefix, kind, shapes in out:
        if kind == "bn":
            shapes["running_mean"] = states[f"{prefix}.running_mean"]
            shapes["running_var"] = states[f"{prefix}.running_var"]
    return out


def _input_resolution(proto, path: str) -> int | None:
    consts = {t.name for t in proto.graph.initializer}
    inputs = [i for i in proto.graph.input if i.name not in consts]
    if len(inputs) != 1:
        raise ValueError(f"{path}: expected one image input, found {len(inputs)} "
                         f"({[i.name for i in inputs]})")
    dims = [d.dim_value if d.HasField("dim_value") else None
            for d in inputs[0].type.tensor_type.shape.dim]
    if len(dims) != 4 or dims[1] not in (None, 3):
        raise ValueError(f"{path}: input {inputs[0].name!r} has shape {dims}; expected an NCHW "
                         "image batch (N, 3, H, W)")
    if dims[2] is not None and dims[2] != dims[3]:
        raise ValueError(f"{path}: input {inputs[0].name!r} is {dims[2]}x{dims[3]}; the models "
                         "take square images")
    return dims[2]


def import_onnx(path: str, arch: str, width: float = 1.0, resolution: int | None = None,
                num_classes: int | None = None, seed: int = 0):
    """Build ``arch`` and fill its parameters and BatchNorm statistics from the ONNX file.

    ``resolution``: input size; by default the ONNX input's (which must then be static).
    ``num_classes``: by default the ONNX classifier's; a different number replaces the last
    linear layer (the head) with a freshly initialised one of that size (seeded by ``seed``).
    Returns (model, tensors float32 by name, :class:`ImportReport`).

    Raises ValueError for an unreadable file, an input that is not an (N, 3, R, R) image, a
    resolution that disagrees with the file, or a layer that does not map; the message names
    the first ONNX node that does not map and the model layer it was matched against.
    """
    proto = _load(path)
    onnx_res = _input_resolution(proto, path)
    if resolution is None:
        if onnx_res is None:
            raise ValueError(f"{path}: the input size is dynamic; pass the resolution")
        resolution = onnx_res
    elif onnx_res is not None and onnx_res != resolution:
        raise ValueError(f"{path}: the ONNX input is {onnx_res}x{onnx_res}, not the "
                         f"{resolution}x{resolution} asked for")
    layers = onnx_layers(proto)
    linears = [layer for layer in layers if layer.kind == "linear"]
    if not linears:
        raise ValueError(f"{path}: no classifier (Gemm or MatMul) found; is this a "
                         f"classification network?")
    onnx_classes = int(linears[-1].arrays["weight"].shape[0])
    model = build(arch, num_classes=num_classes or onnx_classes, resolution=resolution,
                  width=width)
    ours = _model_layers(model)
    tensors = init_params(model, seed=seed)
    report = ImportReport(onnx_classes=onnx_classes)
    i = 0
    for j, (name, kind, shapes) in enumerate(ours):
        where = f"model layer {name!r} ({kind}: " + ", ".join(
            f"{k} {v}" for k, v in shapes.items()) + f") of {arch} width {width:g}"
        if kind == "fused":  # filled from the convolution before it
            continue
        if i >= len(layers):
            raise ValueError(f"{path}: the ONNX graph ends before {where}; the file is not "
                             f"a {arch} of this width")
        layer = layers[i]
        if layer.kind != kind:
            raise ValueError(f"{path}: {layer.describe()} does not map to {where}")
        if kind == "bn":
            _check(path, layer, where, shapes)
            for k in ("weight", "bias", "running_mean"):
                tensors[f"{name}.{k}"] = layer.arrays[k]
            # same inference output with this model's epsilon: var + eps is what divides
            tensors[f"{name}.running_var"] = layer.arrays["running_var"] + (layer.eps - BN_EPS)
            i += 1
            report.layers += 1
            continue
        is_head = kind == "linear" and j == len(ours) - 1
        if is_head and layer.arrays["weight"].shape[0] != shapes["weight"][0]:
            report.replaced_head = name  # new class count: keep the fresh head
            i += 1
            continue
        _check(path, layer, where, {k: v for k, v in shapes.items() if k == "weight"})
        tensors[f"{name}.weight"] = layer.arrays["weight"]
        bias = layer.arrays.get("bias")
        if "bias" in shapes:
            tensors[f"{name}.bias"] = bias if bias is not None else np.zeros(shapes["bias"])
        elif bias is not None:
            nxt = ours[j + 1] if j + 1 < len(ours) else None
            next_onnx = layers[i + 1] if i + 1 < len(layers) else None
            if nxt is None or nxt[1] != "bn" or (next_onnx is not None and
                                                 next_onnx.kind == "bn"):
                if not np.any(bias != 0):  # an all-zero bias is no bias
                    i += 1
                    report.layers += 1
                    continue
                raise ValueError(f"{path}: {layer.describe()} has a bias, which {where} "
                                 "does not have")
            # BatchNorm fused into this convolution: the next BN becomes bias-only identity
            bn = nxt[0]
            tensors[f"{bn}.weight"] = np.ones(nxt[2]["weight"])
            tensors[f"{bn}.bias"] = bias
            tensors[f"{bn}.running_mean"] = np.zeros(nxt[2]["running_mean"])
            tensors[f"{bn}.running_var"] = np.full(nxt[2]["running_var"], 1.0 - BN_EPS)
            report.fused_batchnorms.append(bn)
            ours[j + 1] = (bn, "fused", nxt[2])
        i += 1
        report.layers += 1
    if i < len(layers):
        raise ValueError(f"{path}: {layers[i].describe()} is left over after the last layer "
                         f"of {arch}; the file has more layers than the model")
    return model, {k: np.asarray(v, dtype="float32") for k, v in tensors.items()}, report


def _check(path, layer: OnnxLayer, where: str, shapes: dict) -> None:
    for k, shape in shapes.items():
        got = tuple(layer.arrays[k].shape) if k in layer.arrays else None
        if got != tuple(shape):
            raise ValueError(f"{path}: {layer.describe()} does not map to {where} "
                             f"({k}: ONNX {got}, model {tuple(shape)})")


def identity_batchnorms(model, tensors: dict[str, np.ndarray]) -> list[str]:
    """Names of the BatchNorm layers of ``model`` that ``tensors`` hold as the identity of a
    fused import (weight exactly 1, running mean 0, running variance ``1 - eps`` in float32):
    the layers :func:`calibrate_batchnorms` sets. A trained BatchNorm is never exactly so."""
    out = []
    var = np.float32(1.0 - BN_EPS)
    for name, kind, _ in _model_layers(model):
        if kind != "bn":
            continue
        t = {k: np.asarray(tensors[f"{name}.{k}"], dtype="float32")
             for k in ("weight", "running_mean", "running_var")}
        if (np.all(t["weight"] == 1) and np.all(t["running_mean"] == 0)
                and np.all(t["running_var"] == var)):
            out.append(name)
    return out


def _statistics_module(model, batch: int, names: list[str]):
    """Relax module ``stats(x, params..., states...)`` -> (logits, mean, variance of each
    BatchNorm input in ``names`` over the batch and the spatial axes, per channel), the
    inference forward (float32); and the number of values per channel of each BatchNorm input
    (batch x height x width)."""
    from tvm import relax
    from tvm.relax import op as R

    from .layers import Graph, shape_of

    wanted = set(names)
    counts: dict[str, int] = {}

    class StatsGraph(Graph):
        def __init__(self, bb):
            super().__init__(bb, "infer")
            self.stats = {}

        def batch_norm(self, name, x, eps=BN_EPS, momentum=0.1, act=None):
            if name in wanted:
                n, _, h, w = shape_of(x)
                counts[name] = n * h * w
                self.stats[name] = (self.emit(R.mean(x, axis=[0, 2, 3])),
                                    self.emit(R.variance(x, axis=[0, 2, 3])))
            return super().batch_norm(name, x, eps, momentum, act)

    bb = relax.BlockBuilder()
    g = StatsGraph(bb)
    x = relax.Var("x", relax.TensorType(model.input_shape(batch), "float32"))
    with bb.function("stats"):
        with bb.dataflow():
            logits = model.forward(g, x)
            out = bb.emit_output(relax.Tuple(
                [logits, *(v for n in names for v in g.stats[n])]))
        bb.emit_func_output(out, params=[x] + [v for _, v in g.params.values()]
                            + [v for _, v in g.states.values()])
    return bb.get(), counts


@functools.lru_cache(maxsize=4)
def _compiled_statistics(arch: str, config: str, batch: int, names: tuple[str, ...]):
    """:func:`_statistics_module` of the model ``build(arch, **json.loads(config))`` compiled
    for this machine's CPU (llvm), and its counts; the last few kept."""
    import tvm
    mod, counts = _statistics_module(build(arch, **json.loads(config)), batch, list(names))
    return tvm.compile(mod, tvm.target.Target({"kind": "llvm"})), counts


def calibrate_batchnorms(model, tensors: dict[str, np.ndarray], images: np.ndarray,
                         names: list[str] | None = None, batch: int = 32):
    """Recover the scale, shift and running statistics of BatchNorms fused in an ONNX file
    (module docstring) from the per-channel statistics of their inputs over ``images``.

    ``tensors``: the model's parameters and states (float32, e.g. :func:`import_onnx`'s);
    ``images``: float32 (N, 3, R, R), normalised as ``thomas_tune.data`` does, N >= 1: a
    representative sample (drawn at random, not the first images of a set sorted by class;
    images like those the network was trained on recover the original BatchNorms best, a
    few hundred suffice); ``names``:
    the BatchNorm layers to set (default: :func:`identity_batchnorms`); ``batch``: images per
    run of the statistics module (compiled for this machine's CPU, llvm; lowered to a divisor
    of N down to a quarter of it, else the remainder is left out). The statistics are the
    inference forward's, per batch, pooled in float64 (Chan, Golub & LeVeque 1979). Returns
    (new tensors,
    :class:`Calibration`); ``tensors`` is not changed. Raises ValueError for images of another
    shape or dtype, a name that is not a BatchNorm of the model, or a layer that is not the
    identity of a fused import (calibrating a trained BatchNorm would discard its statistics).
    """
    import tvm
    from tvm import relax

    images = np.asarray(images)
    want = model.input_shape(1)[1:]
    if images.ndim != 4 or images.shape[1:] != want or images.dtype != np.float32:
        raise ValueError(f"calibration images: expected float32 (N, {', '.join(map(str, want))}),"
                         f" got {images.dtype} {images.shape}")
    if len(images) == 0:
        raise ValueError("calibration images: none given; give a folder of images like the "
                         "ones the network was trained on")
    identity = identity_batchnorms(model, tensors)
    names = identity if names is None else list(names)
    bns = {n for n, kind, _ in _model_layers(model) if kind == "bn"}
    for n in names:
        if n not in bns:
            raise ValueError(f"calibrate_batchnorms: {n!r} is not a BatchNorm layer of "
                             f"{model.arch} (e.g. {sorted(bns)[:2]})")
        if n not in identity:
            raise ValueError(f"calibrate_batchnorms: BatchNorm {n!r} holds trained statistics, "
                             "not the identity of a BatchNorm fused in an ONNX file; only "
                             "fused layers are calibrated")
    if not names:
        return dict(tensors), Calibration([], 0, 0.0)
    # the largest batch of at most ``batch`` that divides N, down to a quarter of it; else
    # ``batch`` and the remainder left out
    top = max(1, min(batch, len(images)))
    batch = next((b for b in range(top, max(1, top // 4) - 1, -1) if len(images) % b == 0), top)
    used = len(images) // batch * batch
    s = spec(model)
    order = [q.name for q in s.params + s.states]
    exe, counts = _compiled_statistics(model.arch, json.dumps(model.config(), sort_keys=True),
                                       batch, tuple(names))
    vm = relax.VirtualMachine(exe, tvm.cpu())

    def run(t, x):
        out = vm["stats"](tvm.runtime.tensor(np.ascontiguousarray(x)),
                          *[tvm.runtime.tensor(np.asarray(t[k], dtype="float32")) for k in order])
        return [o.numpy().astype("float64") for o in out]

    count = {n: 0 for n in names}
    mean = {n: 0.0 for n in names}
    m2 = {n: 0.0 for n in names}
    first = None
    for i in range(0, used, batch):
        out = run(tensors, images[i:i + batch])
        first = out[0] if first is None else first
        for k, n in enumerate(names):
            bm, bv = out[1 + 2 * k], out[2 + 2 * k]  # this batch's mean and biased variance
            na, nb = count[n], counts[n]
            delta = bm - mean[n]
            mean[n] = mean[n] + delta * nb / (na + nb)
            m2[n] = m2[n] + bv * nb + delta ** 2 * na * nb / (na + nb)
            count[n] = na + nb
    new = dict(tensors)
    for n in names:
        var = m2[n] / count[n]
        new[f"{n}.running_mean"] = mean[n].astype("float32")
        new[f"{n}.running_var"] = var.astype("float32")
        new[f"{n}.weight"] = np.sqrt(var + BN_EPS).astype("float32")
        new[f"{n}.bias"] = (np.asarray(tensors[f"{n}.bias"], "float64") + mean[n]).astype(
            "float32")
    after = run(new, images[:batch])[0]
    change = float(np.abs(after - first).max() / max(np.abs(first).max(), 1e-12))
    return new, Calibration(names, used, change)
