"""The whole training step checked: an export's loss and every gradient against PyTorch.

A build is timed only if its numbers are right. On :data:`CHECK_BATCHES` batches (fresh random
images, random labels) with every dropout mask set to ones (dropout off), the export's
``train_adjoint`` (loss, gradients of the trainable parameters, BatchNorm in its training form)
is compared with the same network in PyTorch (:mod:`thomas_tune.reference`, torchvision's
layout) in float64, from the same parameters and running statistics; PyTorch's own float32
step on the same batches is the yardstick.

The error formula (:func:`gradient_errors`, the one every check of the project uses): per
parameter, ``max |g - g_ref| / max(max |g_ref|, FLOOR * G)``, where ``G`` is the largest
absolute reference gradient of all parameters: a gradient that is zero in exact arithmetic (a
bias followed by BatchNorm: the normalisation removes it) is judged against a thousandth of the
step's gradients, not against its own rounding-level size. The loss is compared relative to its
value.

Why several batches. The gradient of a network of ReLUs and max pools is discontinuous: where a
pre-activation lies within float32 rounding of 0 (or of 6 for ReLU6), a float32 step may take
the other side of the kink than the float64 step, and the gradient of that element, with all
it feeds upstream, moves by up to its whole size: PyTorch's own float32 step is 2e-2 to 3e-1
from float64 on about a quarter of the batches of a small MobileNetV2 (``docs/journal/
precision.md``), while every kernel of the step, run alone on the float64 step's inputs, stays
within float32 rounding of float64 (``experiments/kernel_precision.py``). A wrong
kernel is wrong on every batch, a flip is on one: the error of a parameter is the smallest over
the batches (and the yardstick's likewise), the loss error the largest.

Bounds (measured over 40 groups of three batches, on llvm and on PoCL, of steps whose
BatchNorms normalise 8 or more values per channel: ``docs/journal/precision.md``,
``experiments/step_precision.py``): a gradient's error may be at
most :data:`FACTOR` times PyTorch float32's on the same batches, or :data:`FACTOR` times
:data:`ROUNDING` where PyTorch's is below that (float32 rounding of the step's sums, not a
defect of either). The loss error at most :data:`FACTOR` times PyTorch float32's, or
:data:`FACTOR` x :data:`LOSS_ROUNDING`. A kernel that writes nothing, zeros, a wrong sign or a
gradient 1% off moves a parameter's error to 1e-2..1, far above both. A weight whose reference
gradient is zero on the check batches (a dead layer: its input or its output gradient is all
zero) cannot show an error; the check fails and names it (:attr:`StepCheck.dead`). So does a
step whose training-form BatchNorm normalises fewer than :data:`MIN_BN_VALUES` values per
channel (:attr:`StepCheck.few_bn_values`): there rounding is amplified past any bound that
still sees a 1% error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

#: batches a step is checked on (module docstring: why more than one)
CHECK_BATCHES = 3
#: a gradient's (and the loss's) error may be this many times PyTorch float32's on the same
#: batches: the largest ratio of a right build's, over 40 groups of three batches, was 2.8
#: (docs/journal/precision.md), and a bound must hold on every draw
FACTOR = 4.0
#: the smallest yardstick of a gradient's error: float32 rounding of the step's sums
ROUNDING = 1e-4
#: the smallest yardstick of the loss's relative error
LOSS_ROUNDING = 2e-6
#: the floor of a gradient's scale, as a share of the step's largest gradient
FLOOR = 1e-3
#: a weight whose largest reference gradient is at most this share of the step's largest is dead
DEAD = 1e-12
#: the fewest values per channel a training-form BatchNorm may normalise in a checked step: the
#: bounds were measured on steps with 8 or more; over 4 values float32 rounding is amplified so
#: much that a right build's error reaches 2e-2 on some batches (docs/journal/precision.md)
MIN_BN_VALUES = 8


def gradient_errors(grads: dict[str, np.ndarray], grads_ref: dict[str, np.ndarray]
                    ) -> dict[str, float]:
    """Per parameter (name -> error, float; inf where not finite), ``max |g - g_ref| /
    max(max |g_ref|, FLOOR * G)`` with ``G`` the largest absolute reference gradient of all
    parameters (module docstring). ``grads`` and ``grads_ref``: name -> array (any float
    dtype, same shapes). Raises ValueError when the two name different parameters."""
    if set(grads) != set(grads_ref):
        raise ValueError(f"the build's trainable parameters {sorted(set(grads) ^ set(grads_ref))} "
                         "are not the reference's: compare builds of the same trainable set")
    top = max((float(np.max(np.abs(r))) for r in grads_ref.values() if np.size(r)), default=0.0)
    errors = {}
    for name, ref in grads_ref.items():
        ref = np.asarray(ref, "float64")
        got = np.asarray(grads[name], "float64")
        scale = max(float(np.max(np.abs(ref))) if ref.size else 0.0, FLOOR * top, 1e-30)
        err = float(np.max(np.abs(got - ref))) / scale if ref.size else 0.0
        errors[name] = err if np.isfinite(err) else float("inf")
    return errors


def dead_parameters(grads_ref: dict[str, np.ndarray]) -> list[str]:
    """Weights (tensors of 2 or more dimensions) whose reference gradient is zero (at most
    :data:`DEAD` of the step's largest): their layer's input or output gradient is all zero on
    this batch, so no error of theirs can be seen. Biases are left out: a bias followed by
    BatchNorm has a gradient of zero in exact arithmetic."""
    top = max((float(np.max(np.abs(r))) for r in grads_ref.values() if np.size(r)), default=0.0)
    return [n for n, r in grads_ref.items()
            if np.ndim(r) >= 2 and float(np.max(np.abs(r))) <= DEAD * top]


def loss_error(loss: float, loss_ref: float) -> float:
    """``|loss - loss_ref| / |loss_ref|`` (inf where not finite)."""
    err = abs(loss - loss_ref) / max(abs(loss_ref), 1e-30)
    return err if np.isfinite(err) else float("inf")


@dataclass
class StepCheck:
    """The comparison of one build's step with the reference: ``loss`` and ``loss_ref`` (of the
    first batch), ``loss_err`` (relative, the largest over the batches), ``errors`` (parameter
    name -> error, the smallest over the batches, :func:`gradient_errors`), ``bounds``
    (parameter name -> the largest error accepted), ``loss_bound``, ``failing`` (names over
    their bound, worst first), ``dead`` (weights whose reference gradient is zero on every
    batch: unchecked, :func:`dead_parameters`), ``yardstick`` (PyTorch float32's errors, the
    same way; empty when the bounds are the rounding floors alone)."""

    loss: float
    loss_ref: float
    loss_err: float
    errors: dict[str, float] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)
    bounds: dict[str, float] = field(default_factory=dict)
    loss_bound: float = FACTOR * LOSS_ROUNDING
    dead: list[str] = field(default_factory=list)
    yardstick: dict[str, float] = field(default_factory=dict)
    yardstick_loss_err: float | None = None
    #: (layer, values per channel) of the training-form BatchNorm that normalises the fewest,
    #: when that is under MIN_BN_VALUES: the step cannot be checked to the bounds
    few_bn_values: tuple[str, int] | None = None

    @property
    def ok(self) -> bool:
        return (self.loss_err <= self.loss_bound and not self.failing and not self.dead
                and self.few_bn_values is None)

    @property
    def worst(self) -> tuple[str, float]:
        name = max(self.errors, key=self.errors.get) if self.errors else ""
        return name, self.errors.get(name, 0.0)

    def line(self) -> str:
        """One line: right or wrong, the loss, the worst gradient (beside PyTorch float32's
        error of that parameter), the failing and the dead ones."""
        name, err = self.worst
        torch_part = (f", PyTorch float32 {self.yardstick[name]:.1e}"
                      if name in self.yardstick else "")
        head = (f"loss {self.loss:.6f} (PyTorch {self.loss_ref:.6f}); {len(self.errors)} "
                f"gradients, worst {name} {err:.1e}{torch_part}")
        if self.ok:
            return f"right: {head}"
        fail = ", ".join(f"{n} {self.errors[n]:.1e} (bound {self.bounds[n]:.1e})"
                         for n in self.failing[:6]) + (" ..." if len(self.failing) > 6 else "")
        parts = [f"WRONG: {head}"]
        if self.failing:
            parts.append(f"{len(self.failing)} over their bound: {fail}")
        if self.loss_err > self.loss_bound:
            parts.append(f"loss error {self.loss_err:.1e} (bound {self.loss_bound:.1e})")
        if self.few_bn_values is not None:
            layer, k = self.few_bn_values
            parts.append(f"not checkable: BatchNorm {layer} normalises {k} values per channel "
                         f"(batch x height x width), under the {MIN_BN_VALUES} the bounds hold "
                         "for; check at a larger batch or resolution")
        if self.dead:
            parts.append(f"{len(self.dead)} weight(s) with a zero gradient on the check "
                         f"batches, whose errors cannot be seen (a dead layer: check other "
                         f"weights): {', '.join(self.dead[:6])}")
        return "; ".join(parts)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "line": self.line(), "loss": self.loss, "loss_ref": self.loss_ref,
                "loss_err": self.loss_err, "loss_bound": self.loss_bound,
                "worst": list(self.worst), "failing": self.failing, "dead": self.dead,
                "errors": self.errors, "bounds": self.bounds,
                "torch_float32_errors": self.yardstick,
                "torch_float32_loss_err": self.yardstick_loss_err,
                "few_bn_values": self.few_bn_values}


def batch(model, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch to check on: images standard normal (float32, the model's input shape), labels
    uniform over the classes (int64)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(model.input_shape(batch_size)).astype("float32")
    return x, rng.integers(0, model.num_classes, batch_size).astype("int64")


def export_step(export_dir: str, x: np.ndarray, y: np.ndarray, device=None, rpc_session=None,
                cached: bool = False) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients (parameter name -> float64 array) of the export's training step on
    ``x`` (float32, the export's batch) and ``y`` (int64), dropout masks of ones, from the
    export's own parameters, run on this machine (``device``: default, the export target's
    device 0) or, with ``rpc_session`` (a ``tvm.rpc`` session), on that device server: there
    ``train.so`` is uploaded and loaded, and the step's tuple of results stays on the device,
    its tensors read one by one (``ffi.ArrayGetItem``, which every TVM runtime registers).
    ``cached``: the step as ``train --cache-features`` takes it, the export's ``features`` of
    ``x`` then ``train_head_adjoint`` on them (an export made with ``--cache-features``; runs
    on this machine only)."""
    import tvm
    from tvm.relax import VirtualMachine

    from .manifest import (ADJOINT, ADJOINT_FROZEN, FEATURES, FEATURES_FROZEN, HEAD_ADJOINT,
                           lifted_values, read_manifest, slot_arguments)
    from .models import load_checkpoint
    from .runtime import device_for
    m = read_manifest(export_dir)
    dev = device or device_for(m["target"]["kind"], rpc_session)
    if rpc_session is None:
        lib = tvm.runtime.load_module(os.path.join(export_dir, "train.so"))
    else:
        # its own name: writing over a library the server has loaded (a Session's train.so)
        # ends the server's session process
        rpc_session.upload(os.path.join(export_dir, "train.so"), "step_check_train.so")
        lib = rpc_session.load_module("step_check_train.so")
    vm = VirtualMachine(lib, dev)
    _, tensors, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))

    def t(a):
        return tvm.runtime.tensor(np.ascontiguousarray(a), dev)

    get = rpc_session.get_function("ffi.ArrayGetItem") if rpc_session is not None else None
    masks = [t(np.ones(v["shape"], "float32")) for v in m["masks"].values()]
    if cached:
        if rpc_session is not None or not m.get("features"):
            raise ValueError("export_step(cached=True) runs an export made with "
                             "--cache-features on this machine")
        split = m["features"]
        constants = [t(tensors[n]) for n in (*m["frozen"], *split["frozen_states"])]
        slots = m.get("features_slots")
        if slots:  # what reads constants only, lifted out (thomas_tune.lift)
            constants = slot_arguments(slots, lambda s: t(tensors[s]), lifted_values(
                vm[FEATURES_FROZEN](*constants), slots))
        feats = vm[FEATURES](t(x), *constants)
        states = split["head_states"]
        out = vm[HEAD_ADJOINT](feats, *masks, *(t(tensors[n]) for n in (*m["trainable"],
                                                                      *states)),
                               t(y.astype("int64")))
    else:
        states = m["states"]
        frozen = [t(tensors[n]) for n in m["frozen"]]
        slots = m.get("frozen_slots")
        if slots:  # the frozen parameters' transforms lifted out of the step
            out = vm[ADJOINT_FROZEN](*(t(tensors[n]) for n in m["frozen_lift_inputs"]))
            frozen = slot_arguments(slots, lambda s: t(tensors[s]),
                                    lifted_values(out, slots, get))
        ordered = [t(tensors[n]) for n in (*m["trainable"], *m["states"])]
        out = vm[ADJOINT](t(x), *masks, *frozen, *ordered, t(y.astype("int64")))
    if rpc_session is None:
        ret, grads = out
        loss = ret[0] if states else ret
    else:
        ret, handle = get(out, 0), get(out, 1)
        loss = get(ret, 0) if m["states"] else ret
        grads = [get(handle, i) for i in range(len(m["trainable"]))]
    return (float(loss.numpy()),
            {n: g.numpy().astype("float64") for n, g in zip(m["trainable"], grads)})


def torch_step(model, tensors: dict[str, np.ndarray], trainable: list[str], x: np.ndarray,
               y: np.ndarray, frozen_bn: bool = False, device: str | None = None,
               dtype: str = "float64", bn_values: dict | None = None
               ) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients (float64 arrays) of ``trainable`` of the same step in PyTorch,
    computed in ``dtype``, dropout off, BatchNorm in training form (``frozen_bn``: inference
    form, True for every BatchNorm or a set of names). ``device``: a torch device (default:
    CUDA when available, else the CPU). ``bn_values``: a dict that gets, per training-form
    BatchNorm layer, the values per channel it normalised (N*H*W). Needs torch."""
    import torch
    import torch.nn.functional as F

    from .models import spec
    from .reference import TorchGraph
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    s = spec(model)
    train = set(trainable)
    if torch.cuda.is_available() and dtype == "float32":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here
        torch.backends.cudnn.allow_tf32 = False
    params = {p.name: torch.tensor(np.asarray(tensors[p.name], dtype), device=dev,
                                   requires_grad=p.name in train) for p in s.params}
    states = {q.name: torch.tensor(np.asarray(tensors[q.name], dtype), device=dev)
              for q in s.states}
    masks = {name: torch.ones(shape, dtype=getattr(torch, dtype), device=dev)  # "<layer>.mask"
             for name, (shape, _) in s.masks.items()}
    g = TorchGraph(params, states, masks, training=True, frozen_bn=frozen_bn)
    logits = model.forward(g, torch.tensor(np.asarray(x, dtype), device=dev))
    if bn_values is not None:
        bn_values.update(g.bn_values)
    loss = F.cross_entropy(logits, torch.tensor(np.asarray(y, "int64"), device=dev))
    names = [n for n in params if n in train]
    grads = torch.autograd.grad(loss, [params[n] for n in names])
    return float(loss.detach()), {n: gr.detach().cpu().numpy().astype("float64")
                                  for n, gr in zip(names, grads)}


def compare_step(loss: float | list[float], grads, loss_ref, grads_ref,
                 yardstick: dict[str, float] | None = None,
                 yardstick_loss_err: float | None = None) -> StepCheck:
    """The :class:`StepCheck` of a step against its reference, on one batch or several.

    ``loss``/``loss_ref``: floats, or lists of one per batch; ``grads``/``grads_ref``: name ->
    array, or lists of such dicts, one per batch. Per parameter the error is the smallest over
    the batches (:func:`gradient_errors`), the loss error the largest. ``yardstick``: PyTorch
    float32's errors on the same batches (name -> error, the same way), and
    ``yardstick_loss_err`` its loss error: a parameter may be off by :data:`FACTOR` x
    max(its yardstick, :data:`ROUNDING`), the loss by :data:`FACTOR` x max(the loss
    yardstick, :data:`LOSS_ROUNDING`); None: the rounding floors alone. Raises ValueError when
    the steps name different parameters or the lists differ in length."""
    many = isinstance(grads, (list, tuple))
    losses, refs_l = (list(loss), list(loss_ref)) if many else ([loss], [loss_ref])
    gs, rs = (list(grads), list(grads_ref)) if many else ([grads], [grads_ref])
    if not (len(losses) == len(refs_l) == len(gs) == len(rs) >= 1):
        raise ValueError("compare_step: one loss and one set of gradients per batch, on both "
                         "sides")
    per_batch = [gradient_errors(g, r) for g, r in zip(gs, rs)]
    errors = {n: min(e[n] for e in per_batch) for n in per_batch[0]}
    dead = sorted(set.intersection(*(set(dead_parameters(r)) for r in rs)))
    loss_err = max(loss_error(a, b) for a, b in zip(losses, refs_l))
    yard = dict(yardstick or {})
    bounds = {n: FACTOR * max(yard.get(n, 0.0), ROUNDING) for n in errors}
    failing = sorted((n for n, e in errors.items() if e > bounds[n]), key=lambda n: -errors[n])
    loss_bound = FACTOR * max(yardstick_loss_err or 0.0, LOSS_ROUNDING)
    return StepCheck(losses[0], refs_l[0], loss_err, errors, failing, bounds, loss_bound,
                     dead, yard, yardstick_loss_err)


def manifest_frozen_bn(m: dict) -> bool | set:
    """The BatchNorms an export's step runs in inference form, from its manifest: the names of
    ``frozen_bn``; in a manifest without them, True when its ``batchnorm`` is ``frozen``."""
    if "frozen_bn" in m:
        return set(m["frozen_bn"])
    return m.get("batchnorm", "train") == "frozen"


def reference_steps(model, tensors: dict[str, np.ndarray], trainable: list[str], batch_size: int,
                    seed: int, frozen_bn: bool | set = False,
                    batches: int = CHECK_BATCHES) -> dict:
    """The check batches of ``seed`` (:func:`batch` of ``seed``, ``seed + 1``, ...) and
    PyTorch's steps on them: ``{"batches": [(x, y)...], "float64": [(loss, grads)...],
    "float32": [(loss, grads)...], "yardstick": PyTorch float32's StepCheck against float64,
    "few_bn_values": (layer, values) of a training-form BatchNorm over fewer than
    :data:`MIN_BN_VALUES` values per channel, or None}``. Needs torch."""
    xs = [batch(model, batch_size, seed + i) for i in range(batches)]
    counts: dict[str, int] = {}
    f64 = [torch_step(model, tensors, trainable, x, y, frozen_bn, bn_values=counts)
           for x, y in xs]
    f32 = [torch_step(model, tensors, trainable, x, y, frozen_bn, dtype="float32")
           for x, y in xs]
    yard = compare_step([r[0] for r in f32], [r[1] for r in f32], [r[0] for r in f64],
                        [r[1] for r in f64])
    fewest = min(counts.items(), key=lambda kv: kv[1]) if counts else None
    few = fewest if fewest is not None and fewest[1] < MIN_BN_VALUES else None
    yard.few_bn_values = few
    return {"batches": xs, "float64": f64, "float32": f32, "yardstick": yard,
            "few_bn_values": few}


def check_export(export_dir: str, seed: int = 0, frozen_bn: bool | set | None = None,
                 reference: dict | None = None, rpc_session=None,
                 cached: bool = False) -> StepCheck:
    """Check an export's training step against PyTorch (see the module docstring) on the
    :data:`CHECK_BATCHES` batches of ``seed`` (:func:`reference_steps`), from the export's own
    parameters, with PyTorch float32's errors on the same batches as the yardstick.
    ``frozen_bn``: the BatchNorms in inference form, True for all or a set of names (None: as
    the export's manifest says); ``rpc_session``: run the export's step on that device server
    (:func:`export_step`);
    ``reference``: :func:`reference_steps` already computed for this model, parameters and
    seed (several exports of one step share it); ``cached``: check the step on cached
    features (:func:`export_step`). Needs torch."""
    from .manifest import read_manifest
    from .models import load_checkpoint
    m = read_manifest(export_dir)
    if frozen_bn is None:
        frozen_bn = manifest_frozen_bn(m)
    if reference is None:
        model, tensors, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))
        reference = reference_steps(model, tensors, m["trainable"], m["batch"], seed, frozen_bn)
    ours = [export_step(export_dir, x, y, rpc_session=rpc_session, cached=cached)
            for x, y in reference["batches"]]
    yard = reference["yardstick"]
    check = compare_step([o[0] for o in ours], [o[1] for o in ours],
                         [r[0] for r in reference["float64"]],
                         [r[1] for r in reference["float64"]], yard.errors, yard.loss_err)
    check.few_bn_values = reference.get("few_bn_values")
    return check
