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

A fused BatchNorm has lost its scale and shift:
:func:`thomas_tune.models.calibration.calibrate_batchnorms` recovers them from data.
"""

from __future__ import annotations

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


def model_layers(model) -> list[tuple[str, str, dict[str, tuple[int, ...]]]]:
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
    resolution = _resolution(proto, path, resolution)
    layers = onnx_layers(proto)
    linears = [layer for layer in layers if layer.kind == "linear"]
    if not linears:
        raise ValueError(f"{path}: no classifier (Gemm or MatMul) found; is this a "
                         f"classification network?")
    onnx_classes = int(linears[-1].arrays["weight"].shape[0])
    model = build(arch, num_classes=num_classes or onnx_classes, resolution=resolution,
                  width=width)
    tensors = init_params(model, seed=seed)
    report = ImportReport(onnx_classes=onnx_classes)
    _map_layers(path, arch, width, layers, model_layers(model), tensors, report)
    return model, {k: np.asarray(v, dtype="float32") for k, v in tensors.items()}, report


def _resolution(proto, path: str, resolution: int | None) -> int:
    """The input size (pixels): ``resolution``, or by default the ONNX input's. Raises
    ValueError for a dynamic input size without ``resolution``, or one that disagrees."""
    onnx_res = _input_resolution(proto, path)
    if resolution is None:
        if onnx_res is None:
            raise ValueError(f"{path}: the input size is dynamic; pass the resolution")
        return onnx_res
    if onnx_res is not None and onnx_res != resolution:
        raise ValueError(f"{path}: the ONNX input is {onnx_res}x{onnx_res}, not the "
                         f"{resolution}x{resolution} asked for")
    return resolution


def _map_layers(path: str, arch: str, width: float, layers: list[OnnxLayer], ours: list,
                tensors: dict, report: ImportReport) -> None:
    """Fill ``tensors`` (the model's, by name) from the ONNX ``layers`` mapped one to one onto
    the model's layers ``ours`` (:func:`model_layers` of ``arch`` at ``width``) in forward
    order, counting in ``report``; a BatchNorm fused into the convolution before it
    is marked "fused" in ``ours`` (and filled from that convolution). A head of another
    class count keeps its fresh initialisation. Raises ValueError naming the first ONNX node
    that does not map and the model layer it was matched against, or a graph that ends too
    soon or goes on after the model's last layer."""
    i = 0
    for j, (name, kind, shapes) in enumerate(ours):
        if kind == "fused":  # filled from the convolution before it
            continue
        where = f"model layer {name!r} ({kind}: " + ", ".join(
            f"{k} {v}" for k, v in shapes.items()) + f") of {arch} width {width:g}"
        if i >= len(layers):
            raise ValueError(f"{path}: the ONNX graph ends before {where}; the file is not "
                             f"a {arch} of this width")
        layer = layers[i]
        if layer.kind != kind:
            raise ValueError(f"{path}: {layer.describe()} does not map to {where}")
        i += 1
        if kind == "bn":
            _check(path, layer, where, shapes)
            for k in ("weight", "bias", "running_mean"):
                tensors[f"{name}.{k}"] = layer.arrays[k]
            # same inference output with this model's epsilon: var + eps is what divides
            tensors[f"{name}.running_var"] = layer.arrays["running_var"] + (layer.eps - BN_EPS)
        elif (kind == "linear" and j == len(ours) - 1
              and layer.arrays["weight"].shape[0] != shapes["weight"][0]):
            report.replaced_head = name  # new class count: keep the fresh head
            continue
        else:
            _fill_weights(path, layer, where, ours, j, layers[i] if i < len(layers) else None,
                          tensors, report)
        report.layers += 1
    if i < len(layers):
        raise ValueError(f"{path}: {layers[i].describe()} is left over after the last layer "
                         f"of {arch}; the file has more layers than the model")


def _fill_weights(path: str, layer: OnnxLayer, where: str, ours: list, j: int,
                  next_onnx: OnnxLayer | None, tensors: dict, report: ImportReport) -> None:
    """Fill the weight (and bias) of the model's convolution or linear layer ``ours[j]``
    from ``layer``. A bias the model's layer does not have is dropped where it is all zeros;
    where a BatchNorm follows in the model and not in the file (``next_onnx``), it was fused:
    that BatchNorm becomes the bias-only identity (marked "fused" in ``ours``). Raises
    ValueError for a mis-shaped weight or a bias that has nowhere to go."""
    name, _, shapes = ours[j]
    _check(path, layer, where, {k: v for k, v in shapes.items() if k == "weight"})
    tensors[f"{name}.weight"] = layer.arrays["weight"]
    bias = layer.arrays.get("bias")
    if "bias" in shapes:
        tensors[f"{name}.bias"] = bias if bias is not None else np.zeros(shapes["bias"])
        return
    if bias is None:
        return
    nxt = ours[j + 1] if j + 1 < len(ours) else None
    if nxt is None or nxt[1] != "bn" or (next_onnx is not None and next_onnx.kind == "bn"):
        if not np.any(bias != 0):  # an all-zero bias is no bias
            return
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


def _check(path, layer: OnnxLayer, where: str, shapes: dict) -> None:
    for k, shape in shapes.items():
        got = tuple(layer.arrays[k].shape) if k in layer.arrays else None
        if got != tuple(shape):
            raise ValueError(f"{path}: {layer.describe()} does not map to {where} "
                             f"({k}: ONNX {got}, model {tuple(shape)})")
