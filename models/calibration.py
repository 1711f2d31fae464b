"""Calibration of the BatchNorms that an ONNX file fused into its convolutions, from data.

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
from dataclasses import dataclass

import numpy as np

from . import build, spec
from .onnx_import import BN_EPS, model_layers


@dataclass
class Calibration:
    """What :func:`calibrate_batchnorms` did: the BatchNorm layers it set, the images it used,
    and the largest change of the inference logits it caused on the first calibration batch,
    relative to the largest logit (float32 rounding: about 1e-6)."""

    layers: list[str]
    images: int
    logits_change: float


def identity_batchnorms(model, tensors: dict[str, np.ndarray]) -> list[str]:
    """Names of the BatchNorm layers of ``model`` that ``tensors`` hold as the identity of a
    fused import (weight exactly 1, running mean 0, running variance ``1 - eps`` in float32):
    the layers :func:`calibrate_batchnorms` sets. A trained BatchNorm is never exactly so."""
    out = []
    var = np.float32(1.0 - BN_EPS)
    for name, kind, _ in model_layers(model):
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
    names = _calibrated_names(model, tensors, images, names)
    if not names:
        return dict(tensors), Calibration([], 0, 0.0)
    batch, used = _calibration_batch(len(images), batch)
    s = spec(model)
    order = [q.name for q in s.params + s.states]
    exe, counts = _compiled_statistics(model.arch, json.dumps(model.config(), sort_keys=True),
                                       batch, tuple(names))
    vm = relax.VirtualMachine(exe, tvm.cpu())

    def run(t, x):
        out = vm["stats"](tvm.runtime.tensor(np.ascontiguousarray(x)),
                          *[tvm.runtime.tensor(np.asarray(t[k], dtype="float32")) for k in order])
        return [o.numpy().astype("float64") for o in out]

    first, mean, var = _pooled_statistics(run, tensors, images, names, counts, batch, used)
    new = dict(tensors)
    for n in names:
        new[f"{n}.running_mean"] = mean[n].astype("float32")
        new[f"{n}.running_var"] = var[n].astype("float32")
        new[f"{n}.weight"] = np.sqrt(var[n] + BN_EPS).astype("float32")
        new[f"{n}.bias"] = (np.asarray(tensors[f"{n}.bias"], "float64") + mean[n]).astype(
            "float32")
    after = run(new, images[:batch])[0]
    change = float(np.abs(after - first).max() / max(np.abs(first).max(), 1e-12))
    return new, Calibration(names, used, change)


def _calibrated_names(model, tensors: dict[str, np.ndarray], images,
                      names: list[str] | None) -> list[str]:
    """The BatchNorm layers to calibrate: ``names``, or by default every identity of a fused
    import (:func:`identity_batchnorms`). Raises ValueError for images that are not float32
    (N, C, R, R) of the model's input, none at all, a name that is not a BatchNorm of the
    model, or a layer that is not the identity of a fused import."""
    want = model.input_shape(1)[1:]
    if images.ndim != 4 or images.shape[1:] != want or images.dtype != np.float32:
        raise ValueError(f"calibration images: expected float32 (N, {', '.join(map(str, want))}),"
                         f" got {images.dtype} {images.shape}")
    if len(images) == 0:
        raise ValueError("calibration images: none given; give a folder of images like the "
                         "ones the network was trained on")
    identity = identity_batchnorms(model, tensors)
    names = identity if names is None else list(names)
    bns = {n for n, kind, _ in model_layers(model) if kind == "bn"}
    for n in names:
        if n not in bns:
            raise ValueError(f"calibrate_batchnorms: {n!r} is not a BatchNorm layer of "
                             f"{model.arch} (e.g. {sorted(bns)[:2]})")
        if n not in identity:
            raise ValueError(f"calibrate_batchnorms: BatchNorm {n!r} holds trained statistics, "
                             "not the identity of a BatchNorm fused in an ONNX file; only "
                             "fused layers are calibrated")
    return names


def _calibration_batch(n_images: int, batch: int) -> tuple[int, int]:
    """The largest batch of at most ``batch`` that divides ``n_images``, down to a quarter of
    it; else ``batch`` (at most ``n_images``) and the remainder left out. Returns the batch
    and the images used."""
    top = max(1, min(batch, n_images))
    batch = next((b for b in range(top, max(1, top // 4) - 1, -1) if n_images % b == 0), top)
    return batch, n_images // batch * batch


def _pooled_statistics(run, tensors: dict, images: np.ndarray, names: list[str],
                       counts: dict[str, int], batch: int, used: int):
    """Per BatchNorm of ``names``, the mean and (biased) variance of its input per channel
    over the first ``used`` images, pooled in float64 from ``run(tensors, x)``'s per-batch
    ones (``counts``: values per channel in a batch; Chan, Golub & LeVeque 1979). Returns the
    first batch's logits and the means and variances by name (float64 arrays)."""
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
    return first, mean, {n: m2[n] / count[n] for n in names}
