"""The reference of a half-storage step (``--precision mixed16``): where PyTorch rounds.

A mixed16 step computes in float32 on layer outputs stored as float16
(:mod:`thomas_tune.half_storage`), so its gradients differ from a plain float64 step by the
rounding of every stored tensor (about 2^-11 of each value), far more than float32's own
rounding. Its reference is the float64 step with the same values rounded to float16 at the
same places, each rounding passed through unchanged by the backward (the build's gradient is
built before the storage is rounded, so no gradient passes through a cast). Then the build
and the reference differ by float32 rounding, and by one float16 step where a value lies
within float32 rounding of the midpoint between two float16 values.

The places are stated here from the model's layers, in PyTorch, not read from the project's
graph rewrite (an independent statement of the same rule, which ``tests/test_half_reference.py``
compares with the build):

* a convolution's output, and with a bias the sum with its bias too (two stores);
* a training-form BatchNorm's output after its activation (one kernel computes both in
  float32 and stores the result);
* an inference-form (frozen) BatchNorm's output before its activation (the activation reads
  the stored value), and where it follows a frozen convolution without bias, that convolution
  computed again with the BatchNorm folded into its weight (``w * gamma / sqrt(var + eps)``,
  shift ``beta - mean * gamma / sqrt(var + eps)``: the convolution's output and the sum with
  the shift, each stored; PyTorch's ``fuse_conv_bn_eval`` states the same fold);
* the ReLU or ReLU6 of a stored value (a frozen BatchNorm's, a convolution's or a linear
  layer's with its bias): stored again, the same float16 values, as rounding commutes with
  them (so that the next convolution reads a stored tensor);
* a residual sum, a linear layer's output (its bias added), an average pooling that is not
  the identity, a dropout's output;
* not a max pooling's output (the largest of float16 values is one) nor a flatten.

Used by :class:`thomas_tune.kinks.KinkGraph` with ``half=True``.

**Following the build's roundings.** Two steps that round at the same places decide
differently wherever a value lies within float32's error of a midpoint between two float16
values; the element moves by a float16 step, and within a few layers of training-form
BatchNorms the two steps' roundings are unrelated (MobileNetV2 0.35@64, batch 8: PyTorch's own
half-storage float32 step is 0.65 of a gradient's scale from the rounding float64 step,
docs/journal/precision.md). So the reference takes the build's decisions, as it takes them at
the kinks: given the float16 tensors the build stored (:func:`thomas_tune.step_run.stored_step`,
paired with the places here by their order, shape for shape), each place is rounded by
:func:`round_like`: the build's value where it is one of the two float16 neighbours of the
reference's own unrounded value (the build rounded the other way, within one float16 step),
else the reference's own rounding. Nothing beyond one float16 step is adopted, so whatever
tensors are given the reference stays its own forward, rounded within one float16 step at each
place (a stored value 1% off is not taken: such elements are counted, :class:`Aligned`). The
stored tensors come from the step's check-only form compiled again; that they are the build's
own is checked by its loss (:func:`thomas_tune.export_check.check_export`).
"""

from __future__ import annotations

from dataclasses import dataclass


def round_half(t):
    """``t`` (a float tensor) with each value rounded to the nearest float16 (ties to even,
    IEEE 754-2008), in ``t``'s dtype; its gradient (and its forward-mode tangent) passes
    unchanged, as the build's does."""
    import torch
    r = t.detach().to(torch.float16).to(t.dtype)
    # t + (r - t) is r exactly: r - t is exact (Sterbenz), and r is representable
    return t + (r - t.detach())


@dataclass
class Aligned:
    """What :func:`round_like` did over a forward pass: ``places`` rounded, ``elements`` in
    them, ``taken`` (the build's float16 value adopted where it is the other neighbour of
    the reference's own value) and ``beyond`` (the build's value more than one float16 step
    from the reference's unrounded value, or not finite: the reference's own kept)."""

    places: int = 0
    elements: int = 0
    taken: int = 0
    beyond: int = 0

    def add(self, other: "Aligned") -> "Aligned":
        return Aligned(self.places + other.places, self.elements + other.elements,
                       self.taken + other.taken, self.beyond + other.beyond)


def round_like(t, build, into: Aligned | None = None):
    """``t`` (a float tensor) rounded to float16 as the build rounded it (module docstring):
    per element, ``build``'s value (a float16 array or tensor of ``t``'s shape) where it is the
    float16 neighbour of ``t`` that ``t``'s own rounding (:func:`round_half`) is not, else that
    own rounding; in ``t``'s dtype, its gradient passing unchanged. ``into`` counts the
    elements taken and those beyond one step. Raises ValueError when the shapes differ."""
    import torch
    b = torch.as_tensor(build, device=t.device)
    if tuple(b.shape) != tuple(t.shape):
        raise ValueError(f"the build's stored tensor {tuple(b.shape)} is not the reference's "
                         f"place {tuple(t.shape)}: the places are paired by order")
    b = b.to(torch.float16)
    x = t.detach()
    own = x.to(torch.float16)
    ownx = own.to(x.dtype)
    # the other neighbour: one float16 step from the own rounding towards x (none where x is
    # a float16 value)
    toward = torch.where(x > ownx, torch.full_like(own, float("inf")),
                         torch.full_like(own, float("-inf")))
    other = torch.nextafter(own, toward)
    taken = (b != own) & (b == other) & (x != ownx)
    beyond = (b != own) & ~taken
    if into is not None:
        into.places += 1
        into.elements += x.numel()
        into.taken += int(taken.sum())
        into.beyond += int(beyond.sum())
    r = torch.where(taken, b, own).to(t.dtype)
    return t + (r - x)


def conv2d(g, name, x, stride, padding, groups, bias, rounded=True):
    """The convolution ``name`` of graph ``g`` (a :class:`thomas_tune.kinks.KinkGraph`, whose
    ``round_stored`` rounds a place) on ``x`` with its output rounded (unless not
    ``rounded``), and with ``bias`` its sum with the bias rounded too."""
    y = g.F.conv2d(x, g.p[f"{name}.weight"], None, stride, padding, 1, groups)
    y = g.round_stored(y) if rounded else y
    if bias:
        y = g.round_stored(y + g.p[f"{name}.bias"].reshape(1, -1, 1, 1))
    return y


def inference_batch_norm(g, name, x, eps, conv):
    """The inference form of BatchNorm ``name`` on ``x`` (before its activation), rounded:
    folded into ``conv`` when that is the record ``(output, input, name, stride, padding,
    groups)`` of the frozen convolution without bias that made ``x``, else the running
    statistics' affine map (module docstring)."""
    c = x.shape[1]
    s = g.p[f"{name}.weight"] / (g.s[f"{name}.running_var"] + eps).sqrt()
    shift = g.p[f"{name}.bias"] - g.s[f"{name}.running_mean"] * s
    if conv is not None:
        _, x_in, conv_name, stride, padding, groups = conv
        w = g.p[f"{conv_name}.weight"] * s.reshape(-1, 1, 1, 1)
        y = g.round_stored(g.F.conv2d(x_in, w, None, stride, padding, 1, groups))
        return g.round_stored(y + shift.reshape(1, c, 1, 1))
    return g.round_stored(x * s.reshape(1, c, 1, 1) + shift.reshape(1, c, 1, 1))
