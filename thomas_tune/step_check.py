"""The whole training step checked: an export's loss and every gradient against PyTorch.

A build is timed only if its numbers are right. On one batch (fresh random images, random
labels) with every dropout mask set to ones (dropout off), the export's ``train_adjoint``
(loss, gradients of the trainable parameters, BatchNorm in its training form) is compared with
the same network in PyTorch (:mod:`thomas_tune.reference`, torchvision's layout) in float64,
from the same parameters and running statistics.

Per parameter the error is ``max |g - g_ref| / max(max |g_ref|, 1e-3 * G)``, where ``G`` is the
largest absolute reference gradient of all parameters: a gradient that is zero in exact
arithmetic (a bias followed by BatchNorm: the normalisation removes it) is judged against a
thousandth of the step's gradients, not against its own rounding-level size. The loss is
compared relative to its value.

Tolerances. The loss: 1e-3 relative (float32 rounding reaches 1.8e-4 on a right build of a small
MobileNetV2 whose last BatchNorms normalise 4 values per channel; a kernel that writes nothing or
wrong elements moves the loss by far more). A gradient: a build with default schedules (untuned)
may differ from float64 by up to :data:`BROKEN` = 0.5 of the gradient's scale; any other build by
up to ``max(GRAD_TOL, 4 x the untuned build's error for that parameter)`` (:data:`GRAD_TOL` =
2e-2). The float32 step's own rounding, which grows with depth, with the sums' lengths and with
BatchNorm over few elements, is what the untuned build's error measures on the same graph, batch
and device: a tuned kernel sums in another order, not less precisely. A kernel that writes nothing,
zeros or wrong elements moves a gradient by about 1 (every gradient upstream of it is then 0 or
unrelated), over both bounds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

#: smallest bound on a tuned build's gradient error (see the module docstring)
GRAD_TOL = 2e-2
#: largest accepted gradient error of an untuned build: a wrong kernel gives about 1
BROKEN = 0.5
#: a tuned build's gradient error may be this many times the untuned build's
YARDSTICK_FACTOR = 4.0
#: largest accepted relative loss error
LOSS_TOL = 1e-3
#: the floor of a gradient's scale, as a share of the step's largest gradient
FLOOR = 1e-3


@dataclass
class StepCheck:
    """The comparison of one build's step with the reference: ``loss`` and ``loss_ref``,
    ``loss_err`` (relative), ``errors`` (parameter name -> error, see the module docstring),
    ``bounds`` (parameter name -> the largest error accepted), ``failing`` (names over their
    bound, worst first)."""

    loss: float
    loss_ref: float
    loss_err: float
    errors: dict[str, float] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)
    bounds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.loss_err <= LOSS_TOL and not self.failing

    @property
    def worst(self) -> tuple[str, float]:
        name = max(self.errors, key=self.errors.get) if self.errors else ""
        return name, self.errors.get(name, 0.0)

    def line(self) -> str:
        """One line: right or wrong, the loss, the worst gradient and the failing ones."""
        name, err = self.worst
        head = (f"loss {self.loss:.6f} (PyTorch {self.loss_ref:.6f}); {len(self.errors)} "
                f"gradients, worst {name} {err:.1e}")
        if self.ok:
            return f"right: {head}"
        fail = ", ".join(f"{n} {self.errors[n]:.1e} (bound {self.bounds[n]:.1e})"
                         for n in self.failing[:6]) + (" ..." if len(self.failing) > 6 else "")
        return (f"WRONG: {head}; {len(self.failing)} over their bound: {fail}"
                + (f"; loss error {self.loss_err:.1e}" if self.loss_err > LOSS_TOL else ""))

    def as_dict(self) -> dict:
        return {"ok": self.ok, "loss": self.loss, "loss_ref": self.loss_ref,
                "loss_err": self.loss_err, "worst": list(self.worst),
                "failing": self.failing, "errors": self.errors}


def batch(model, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch to check on: images standard normal (float32, the model's input shape), labels
    uniform over the classes (int64)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(model.input_shape(batch_size)).astype("float32")
    return x, rng.integers(0, model.num_classes, batch_size).astype("int64")


def export_step(export_dir: str, x: np.ndarray, y: np.ndarray, device=None, rpc_session=None
                ) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients (parameter name -> float64 array) of the export's training step on
    ``x`` (float32, the export's batch) and ``y`` (int64), dropout masks of ones, from the
    export's own parameters, run on this machine (``device``: default, the export target's
    device 0) or, with ``rpc_session`` (a ``tvm.rpc`` session), on that device server: there
    ``train.so`` is uploaded and loaded, and the step's tuple of results stays on the device,
    its tensors read one by one (``ffi.ArrayGetItem``, which every TVM runtime registers)."""
    import tvm
    from tvm.relax import VirtualMachine

    from .manifest import ADJOINT, read_manifest
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

    masks = [t(np.ones(v["shape"], "float32")) for v in m["masks"].values()]
    ordered = [t(tensors[n]) for n in (*m["frozen"], *m["trainable"], *m["states"])]
    out = vm[ADJOINT](t(x), *masks, *ordered, t(y.astype("int64")))
    if rpc_session is None:
        ret, grads = out
        loss = ret[0] if m["states"] else ret
    else:
        get = rpc_session.get_function("ffi.ArrayGetItem")
        ret, handle = get(out, 0), get(out, 1)
        loss = get(ret, 0) if m["states"] else ret
        grads = [get(handle, i) for i in range(len(m["trainable"]))]
    return (float(loss.numpy()),
            {n: g.numpy().astype("float64") for n, g in zip(m["trainable"], grads)})


def torch_step(model, tensors: dict[str, np.ndarray], trainable: list[str], x: np.ndarray,
               y: np.ndarray, frozen_bn: bool = False, device: str | None = None,
               dtype: str = "float64") -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients (float64 arrays) of ``trainable`` of the same step in PyTorch,
    computed in ``dtype``, dropout off, BatchNorm in training form (``frozen_bn``: inference
    form, True for every BatchNorm or a set of names). ``device``: a torch device (default: CUDA
    when available, else the CPU). Needs
    torch."""
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
    loss = F.cross_entropy(logits, torch.tensor(np.asarray(y, "int64"), device=dev))
    names = [n for n in params if n in train]
    grads = torch.autograd.grad(loss, [params[n] for n in names])
    return float(loss.detach()), {n: gr.detach().cpu().numpy().astype("float64")
                                  for n, gr in zip(names, grads)}


def compare_step(loss: float, grads: dict[str, np.ndarray], loss_ref: float,
                 grads_ref: dict[str, np.ndarray],
                 yardstick: dict[str, float] | None = None) -> StepCheck:
    """The :class:`StepCheck` of a step against its reference. ``yardstick``: the errors of
    the untuned build of the same step (parameter name -> error), which bound a tuned build's
    errors; None judges the step as an untuned build (:data:`BROKEN`). Raises ValueError when
    the two steps name different parameters."""
    if set(grads) != set(grads_ref):
        raise ValueError(f"the build's trainable parameters {sorted(set(grads) ^ set(grads_ref))} "
                         "are not the reference's: compare builds of the same trainable set")
    top = max((float(np.max(np.abs(r))) for r in grads_ref.values() if r.size), default=0.0)
    errors = {}
    for name, ref in grads_ref.items():
        got = grads[name]
        scale = max(float(np.max(np.abs(ref))) if ref.size else 0.0, FLOOR * top, 1e-30)
        err = float(np.max(np.abs(got - ref))) / scale if ref.size else 0.0
        errors[name] = err if np.isfinite(err) else float("inf")
    bounds = {n: BROKEN if yardstick is None else
              max(GRAD_TOL, YARDSTICK_FACTOR * yardstick.get(n, GRAD_TOL)) for n in errors}
    failing = sorted((n for n, e in errors.items() if e > bounds[n]), key=lambda n: -errors[n])
    loss_err = abs(loss - loss_ref) / max(abs(loss_ref), 1e-30)
    return StepCheck(loss, loss_ref, loss_err if np.isfinite(loss_err) else float("inf"),
                     errors, failing, bounds)


def check_export(export_dir: str, seed: int = 0, frozen_bn: bool | set | None = None,
                 yardstick: StepCheck | None = None, rpc_session=None) -> StepCheck:
    """Check an export's training step against PyTorch (see the module docstring) on a batch
    drawn from ``seed`` (:func:`batch`), from the export's own parameters. ``yardstick``: the
    check of the untuned export of the same step and seed, whose errors bound this one's
    (None: this export is judged as an untuned build). ``frozen_bn``: the BatchNorms of the
    reference in inference form (None: those the export's step runs so, from its manifest).
    ``rpc_session``: run the export's step on that device server (:func:`export_step`).
    Needs torch."""
    from .manifest import read_manifest
    from .models import load_checkpoint
    m = read_manifest(export_dir)
    model, tensors, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))
    x, y = batch(model, m["batch"], seed)
    loss, grads = export_step(export_dir, x, y, rpc_session=rpc_session)
    if frozen_bn is None:
        frozen_bn = set(m.get("frozen_bn", []))
    loss_ref, grads_ref = torch_step(model, tensors, m["trainable"], x, y, frozen_bn)
    return compare_step(loss, grads, loss_ref, grads_ref,
                        yardstick.errors if yardstick is not None else None)
