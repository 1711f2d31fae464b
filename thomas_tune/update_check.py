"""The optimizer update of an export checked against ``torch.optim`` in float64.

:mod:`thomas_tune.step_check` checks a build's loss and gradients; the update a training
step applies to them (momentum SGD, SGD or Adam as multi-tensor kernels,
:mod:`thomas_tune.training_graph.optimizers`) is the function ``optimizer`` of ``train.so``
(:data:`thomas_tune.manifest.OPTIMIZER`), which ``train_step``, the function
``Session.train_step`` runs, inlines after the step's backward pass
(:func:`thomas_tune.training_graph.graph.add_train_step`). :func:`check_update` checks both:

- ``optimizer`` on fresh random float32 values, never zeros: per trainable parameter (the
  manifest's ``trainable``, shapes of ``params.npz``) the parameter, its gradient, its
  momentum buffer or Adam's first moment standard normal, Adam's second moment the square
  of a standard normal plus 1e-3 (positive); the step count drawn in 2..:data:`MAX_STEPS`
  with Adam's ``beta1^t``, ``beta2^t`` of that count; in the export's state layout
  (int64 steps, Adam's two float32 scalars, then each buffer of every parameter). Run on
  this machine or on a device server (:func:`export_update`).
- ``train_step`` (on this machine) on the first check batch of the seed with its dropout
  masks (:func:`thomas_tune.step_check.batch`), from the export's own parameters and the
  same fresh optimizer state, against the update of the gradients the export's
  ``train_adjoint`` gives on that batch (:func:`export_train_step`): what a training step
  applies, gradients included, must be that update.

The reference is PyTorch's own ``torch.optim.SGD`` (``momentum``, no dampening, no Nesterov:
the project's momentum SGD; no momentum for ``sgd``) or ``torch.optim.Adam`` (L2 weight
decay), single-tensor form, in float64 from the same values, with the manifest's
``optimizer`` (``name``, ``lr``, ``momentum``, ``weight_decay``, ``betas``, ``eps``:
:class:`thomas_tune.training_graph.optimizers.OptimizerConfig`) and the buffers given as its state;
never the project's optimizer code.

Errors, element by element on its own scale: ``|got - ref| / (u A)`` in float32 ulps, with
``u = 2^-24`` (float32's unit roundoff) and ``A`` the sum of the magnitudes of the values
the element's expression adds up; an output's error is the largest over its elements, the
check's the largest over every output (parameter ``name``, its state ``name:buffer``, the
scalars ``step``, ``beta1^t``, ``beta2^t``; ``train_step`` before those of the second leg).
The bounds (:func:`bounds`) count the float32 roundings of each expression to first order
(Higham, Accuracy and Stability of Numerical Algorithms, 2002, section 3.1: each operation
and each constant rounded to float32 adds at most ``u`` of its value; a fused multiply-add
rounds once, so it stays within them; below float32's normal range, :data:`TINY`, the error
of a rounding is absolute, so ``A`` is at least ``TINY / u``); float64's own rounding, 2^-29
ulps, is not counted. A division and a square root are counted at what OpenCL C allows for
float (3 and 4 ulps, the embedded profile's, the full profile's are smaller; OpenCL C 3.0
specification, section 7.4), 6u and 8u, since one ulp is at most ``2u`` of a value.
With ``d = g + wd p``, ``A_d = |g| + |wd p|`` (``wd``, the product, the sum: 3 roundings):

- momentum SGD: ``v' = mu v + d`` (``A_v = |mu v| + A_d``): ``mu``, the product, the sum
  and ``d``'s 3, at most 4 ulps; ``p' = p - lr v'`` (``A = |p| + |lr| A_v``): ``lr``, the
  product, ``v'``'s 4, the difference, 7 ulps;
- SGD: ``p' = p - lr d`` (``A = |p| + |lr| A_d``): 6 ulps;
- Adam (Kingma & Ba 2015, Algorithm 1, :func:`thomas_tune.training_graph.multi_tensor.adam_exprs`):
  ``m' = b1 m + (1 - b1) d`` (``A_m = |b1 m| + (1 - b1) A_d``): 6; ``v' = b2 v + (1 - b2)
  d^2`` (``A = b2 v + (1 - b2) A_d^2``): 10; ``beta^t' = beta^t beta`` (the input rounded
  from float64, ``beta``, the product; ``A = beta^(t+1)``): 3; ``p' = p - lr r``, ``r =
  (m' / (1 - b1^t')) / (sqrt(v' / (1 - b2^t')) + eps)`` (``A = |p| + |lr| (|r| + A_m /
  ((1 - b1^t') den))``, ``den`` the denominator): ``33 + 3 c1 + 1.5 c2`` ulps (14 + 3 c1
  + 1.5 c2 with a correctly rounded division and square root), ``cj = bj^t' / (1 -
  bj^t')``: ``1 - b^t'`` turns the 3 ulps of ``b^t'`` into ``3 cj`` of itself (float32
  Adam's own limit: some hundreds at ``b2 = 0.999`` after a few steps);
- the step count (int64): exactly one more.

A kernel whose update is 1% off moves an element by 1e-2 of the update's size: ``1e-2 / u``
= 1.7e5 ulps where the update is the larger part of ``A`` (some element of a random tensor
of more than a few values); the wrong sign by twice the update's size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

#: float32's unit roundoff (round to nearest), 2^-24
U = 2.0 ** -24
#: float32's smallest normal number: below it a rounding's error is absolute, at most this
#: much (flushed to zero, which OpenCL allows for float) or 2^-150 (gradual underflow)
TINY = 2.0 ** -126
#: the largest step count the check's optimizer state starts from (drawn in 2..MAX_STEPS):
#: Adam's beta1^t at the default 0.9 stays a normal float32 (above TINY) up to 836 steps
MAX_STEPS = 500
#: the names ``torch.optim`` gives each buffer of the export's optimizer state, in its order
BUFFERS = {"momentum_sgd": ("momentum_buffer",), "sgd": (), "adam": ("exp_avg", "exp_avg_sq")}


@dataclass
class UpdateCheck:
    """The export's optimizer update against ``torch.optim`` in float64: ``optimizer`` (the
    manifest's), ``errors`` (output -> its largest error in float32 ulps of the values
    involved; an output is a parameter ``name``, its state ``name:buffer`` or a scalar state
    ``step``, ``beta1^t``, ``beta2^t``; those of ``train_step`` named after ``"train_step
    "``), ``bounds`` (output -> ulps), ``failing`` (outputs
    over their bound, worst share first), ``steps`` (the step count the state started from)."""

    optimizer: dict
    errors: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)
    steps: int = 0

    @property
    def ok(self) -> bool:
        return not self.failing

    @property
    def worst(self) -> tuple[str, float]:
        """The output of the largest share of its bound, and its error (ulps)."""
        name = max(self.errors, key=self._share, default="")
        return name, self.errors.get(name, 0.0)

    def _share(self, name: str) -> float:
        err, bound = self.errors[name], self.bounds[name]
        return err / bound if bound else (float("inf") if err else 0.0)

    def line(self) -> str:
        name, err = self.worst
        head = (f"update ({self.optimizer.get('name')}, lr {self.optimizer.get('lr')}, from "
                f"step {self.steps}) vs torch.optim float64: {len(self.errors)} outputs, worst "
                f"{name} {err:.1f} ulps (bound {self.bounds.get(name, 0.0):.1f})")
        if self.ok:
            return head
        return f"{head}; WRONG: " + ", ".join(
            f"{n} {self.errors[n]:.3g} ulps (bound {self.bounds[n]:.1f})"
            for n in self.failing[:6]) + (" ..." if len(self.failing) > 6 else "")

    def as_dict(self) -> dict:
        return {"ok": self.ok, "line": self.line(), "optimizer": self.optimizer,
                "steps": self.steps, "worst": list(self.worst), "failing": self.failing,
                "errors": self.errors, "bounds": self.bounds}


def random_update_inputs(config: dict, shapes: list[tuple[int, ...]], seed: int):
    """Fresh inputs of one update (module docstring): ``(params, grads, state, steps)``, lists
    of float32 arrays of ``shapes`` and the state in the export's layout (int64 step count,
    Adam's float32 ``beta1^t``, ``beta2^t``, then each buffer of every parameter)."""
    rng = np.random.default_rng([seed, 66])
    name = config["name"]
    if name not in BUFFERS:
        raise ValueError(f"the export's optimizer {name!r} is not one this check knows "
                         f"({', '.join(BUFFERS)}): export it again")

    def normal(shape):
        return rng.standard_normal(shape).astype("float32")

    params, grads = [normal(s) for s in shapes], [normal(s) for s in shapes]
    steps = int(rng.integers(2, MAX_STEPS + 1))
    state: list[np.ndarray] = [np.array(steps, "int64")]
    if name == "adam":
        b1, b2 = config["betas"]
        state += [np.array(b1 ** steps, "float32"), np.array(b2 ** steps, "float32")]
        state += [normal(s) for s in shapes]
        state += [(rng.standard_normal(s) ** 2 + 1e-3).astype("float32") for s in shapes]
    elif name == "momentum_sgd":
        state += [normal(s) for s in shapes]
    return params, grads, state, steps


def export_update(export_dir: str, params, grads, state, rpc_session=None, train_lib=None):
    """The export's ``optimizer`` function (the update ``Session.train_step`` applies) on
    ``params``, ``grads`` (lists of float32 arrays in the manifest's ``trainable`` order) and
    ``state`` (the optimizer state, its layout): ``(new params, new state)`` as lists of
    numpy arrays. Runs on this machine (the export target's device 0) or, with
    ``rpc_session``, on that device server, where ``train.so`` is uploaded and loaded, the
    inputs packed into tuples there (``pack_trainable``, ``pack_optimizer_state``) and the
    results read one by one (``ffi.ArrayGetItem``); ``train_lib``: ``train.so`` already loaded
    there (:func:`thomas_tune.remote.device_train_library`)."""
    import tvm
    from tvm.relax import VirtualMachine

    from .manifest import OPTIMIZER, PACK_OPTIMIZER_STATE, PACK_TRAINABLE, Manifest
    from .runtime import device_for
    m = Manifest.read(export_dir)
    dev = device_for(m.target["kind"], rpc_session)
    if rpc_session is None:
        lib = tvm.runtime.load_module(os.path.join(export_dir, "train.so"))
    else:
        from .remote import device_train_library
        lib = train_lib or device_train_library(export_dir, rpc_session)
    vm = VirtualMachine(lib, dev)
    ts = [[tvm.runtime.tensor(np.array(a, order="C"), dev) for a in group]
          for group in (params, grads, state)]
    if rpc_session is None:  # the update writes over its inputs: they are copies
        new_params, new_state = vm[OPTIMIZER](*ts)
        return [a.numpy() for a in new_params], [a.numpy() for a in new_state]
    get = rpc_session.get_function("ffi.ArrayGetItem")
    out = vm[OPTIMIZER](vm[PACK_TRAINABLE](*ts[0]), vm[PACK_TRAINABLE](*ts[1]),
                        vm[PACK_OPTIMIZER_STATE](*ts[2]))
    new_params, new_state = get(out, 0), get(out, 1)
    return ([get(new_params, i).numpy() for i in range(len(params))],
            [get(new_state, i).numpy() for i in range(len(state))])


def reference_update(config: dict, params, grads, state):
    """``torch.optim``'s step (float64, single-tensor form) from the same values: ``(new
    params, {buffer name: new buffers}, step count after)``. Needs torch."""
    import torch
    name, n = config["name"], len(params)
    ps = [torch.tensor(np.asarray(p, "float64"), requires_grad=True) for p in params]
    for p, g in zip(ps, grads):
        p.grad = torch.tensor(np.asarray(g, "float64"))
    steps = int(state[0])
    if name == "adam":
        opt = torch.optim.Adam(ps, lr=config["lr"], betas=tuple(config["betas"]),
                               eps=config["eps"], weight_decay=config["weight_decay"],
                               foreach=False)
        first = 3
    else:
        opt = torch.optim.SGD(ps, lr=config["lr"], weight_decay=config["weight_decay"],
                              momentum=config["momentum"] if name == "momentum_sgd" else 0.0,
                              dampening=0.0, nesterov=False, foreach=False)
        first = 1
    for j, p in enumerate(ps):
        buffers = {b: torch.tensor(np.asarray(state[first + k * n + j], "float64"))
                   for k, b in enumerate(BUFFERS[name])}
        if name == "adam":
            buffers["step"] = torch.tensor(float(steps), dtype=torch.float64)
        opt.state[p].update(buffers)
    opt.step()
    return ([p.detach().numpy() for p in ps],
            {b: [opt.state[p][b].numpy() for p in ps] for b in BUFFERS[name]}, steps + 1)


def bounds(config: dict, steps: int) -> dict[str, float]:
    """The bound in float32 ulps of each kind of output (module docstring) of ``config``'s
    update from step count ``steps``: keys ``param`` and the buffer names of
    :data:`BUFFERS`, and for Adam ``beta^t``."""
    name = config["name"]
    if name == "momentum_sgd":
        return {"param": 7.0, "momentum_buffer": 4.0}
    if name == "sgd":
        return {"param": 6.0}
    b1, b2 = config["betas"]
    c1, c2 = (b ** (steps + 1) / (1.0 - b ** (steps + 1)) for b in (b1, b2))
    return {"param": 33.0 + 3.0 * c1 + 1.5 * c2, "exp_avg": 6.0, "exp_avg_sq": 10.0,
            "beta^t": 3.0}


def magnitudes(config: dict, p, g, buffers: dict, steps: int) -> dict[str, np.ndarray]:
    """Per output of one parameter's update, ``A`` of each element (module docstring;
    float64 arrays): ``p``, ``g`` its float64 inputs, ``buffers`` its state before the update
    by :data:`BUFFERS` name, ``steps`` the count before."""
    name, lr, wd = config["name"], abs(config["lr"]), abs(config["weight_decay"])
    a_d = np.abs(g) + wd * np.abs(p)
    if name == "sgd":
        return {"param": np.abs(p) + lr * a_d}
    if name == "momentum_sgd":
        a_v = abs(config["momentum"]) * np.abs(buffers["momentum_buffer"]) + a_d
        return {"param": np.abs(p) + lr * a_v, "momentum_buffer": a_v}
    b1, b2 = config["betas"]
    t = steps + 1
    a_m = b1 * np.abs(buffers["exp_avg"]) + (1.0 - b1) * a_d
    m = b1 * buffers["exp_avg"] + (1.0 - b1) * (g + config["weight_decay"] * p)
    v = b2 * buffers["exp_avg_sq"] + (1.0 - b2) * (g + config["weight_decay"] * p) ** 2
    den = np.sqrt(v / (1.0 - b2 ** t)) + config["eps"]
    r = np.abs(m) / (1.0 - b1 ** t) / den
    return {"param": np.abs(p) + lr * (r + a_m / ((1.0 - b1 ** t) * den)),
            "exp_avg": a_m, "exp_avg_sq": b2 * buffers["exp_avg_sq"] + (1.0 - b2) * a_d ** 2}


def ulps(got, ref, a) -> float:
    """``max |got - ref| / (u max(a, TINY / u))`` over the elements (inf where not finite):
    below float32's normal range a rounding's error is absolute (module docstring)."""
    err = np.abs(np.asarray(got, "float64") - ref) / (U * np.maximum(a, TINY / U))
    worst = float(np.max(err)) if err.size else 0.0
    return worst if np.isfinite(worst) else float("inf")


def export_train_step(export_dir: str, x, y, masks: dict, tensors: dict, state):
    """The export's ``train_step`` (the step and the update in one function, which
    ``Session.train_step`` runs; :func:`thomas_tune.training_graph.graph.add_train_step`) on this
    machine, on ``x``, ``y``, dropout ``masks`` (name -> array) and ``tensors`` (name -> array) as
    :func:`thomas_tune.step_check.export_step` takes them, from optimizer ``state``: ``(new
    trainable parameters, new state)`` as lists of numpy arrays."""
    import tvm
    from tvm.relax import VirtualMachine

    from .manifest import (TRAIN_STEP, TRAIN_STEP_FROZEN, lifted_values, Manifest,
                           slot_arguments)
    from .runtime import device_for
    m = Manifest.read(export_dir)
    dev = device_for(m.target["kind"])
    vm = VirtualMachine(tvm.runtime.load_module(os.path.join(export_dir, "train.so")), dev)

    def t(a):
        return tvm.runtime.tensor(np.array(a, order="C"), dev)

    slots = m.train_step_slots
    frozen = [t(tensors[n]) for n in m.frozen]
    # the frozen parameters' transforms lifted out of the step (thomas_tune.training_graph.lift)
    if slots:
        lifted = vm[TRAIN_STEP_FROZEN](*(t(tensors[n]) for n in m.frozen_lift_inputs))
        frozen = slot_arguments(slots, lambda n: t(tensors[n]), lifted_values(lifted, slots))
    args = [t(x), *(t(np.asarray(masks.get(k, np.ones(v["shape"])), "float32"))
                    for k, v in m.masks.items()),
            *frozen, *(t(tensors[n]) for n in (*m.trainable, *m.states)),
            t(np.asarray(y, "int64"))]
    _, new_params, new_state = vm[TRAIN_STEP](*args, [t(a) for a in state])
    return [a.numpy() for a in new_params], [a.numpy() for a in new_state]


def _compare(check: UpdateCheck, names: list[str], inputs: tuple, outputs: tuple,
             prefix: str = "") -> None:
    """Add to ``check`` the errors and bounds of one update: ``inputs`` (params, grads,
    state, steps as :func:`random_update_inputs` returns them) and the export's ``outputs``
    (new params, new state), each output's name after ``prefix``."""
    config = check.optimizer
    params, grads, state, steps = inputs
    new_params, new_state = outputs
    ref_params, ref_buffers, ref_steps = reference_update(config, params, grads, state)
    kinds = bounds(config, steps)
    n, first = len(names), 3 if config["name"] == "adam" else 1
    errors, limits = {"step": 0.0 if int(new_state[0]) == ref_steps else float("inf")}, {
        "step": 0.0}
    if config["name"] == "adam":
        for i, beta in enumerate(config["betas"]):
            exact = beta ** ref_steps
            errors[f"beta{i + 1}^t"] = ulps(new_state[1 + i], exact, exact)
            limits[f"beta{i + 1}^t"] = kinds["beta^t"]
    for j, name in enumerate(names):
        p, g = (np.asarray(a[j], "float64") for a in (params, grads))
        before = {b: np.asarray(state[first + k * n + j], "float64")
                  for k, b in enumerate(BUFFERS[config["name"]])}
        a = magnitudes(config, p, g, before, steps)
        errors[name], limits[name] = ulps(new_params[j], ref_params[j], a["param"]), kinds["param"]
        for k, b in enumerate(BUFFERS[config["name"]]):
            errors[f"{name}:{b}"] = ulps(new_state[first + k * n + j], ref_buffers[b][j], a[b])
            limits[f"{name}:{b}"] = kinds[b]
    check.errors.update({prefix + o: e for o, e in errors.items()})
    check.bounds.update({prefix + o: b for o, b in limits.items()})


def check_update(export_dir: str, seed: int = 0, rpc_session=None,
                 first_batch: tuple | None = None, train_lib=None) -> UpdateCheck:
    """Check the export's optimizer update against ``torch.optim`` in float64 on the fresh
    inputs of ``seed`` (module docstring), on this machine or on ``rpc_session``'s device
    server (:func:`export_update`). On this machine, an export with ``train_step`` is also
    checked as ``Session.train_step`` updates: its ``train_step`` (:func:`export_train_step`)
    on ``first_batch`` (``(x, y, masks, grads)``: the first check batch of ``seed`` as
    :func:`thomas_tune.export_check.check_export` draws it, its dropout masks and the gradients
    the export's ``train_adjoint`` gives for it; None: this part is left out) from the
    export's parameters and fresh optimizer state, against ``torch.optim`` on those gradients
    (outputs named ``train_step <output>``). ``train_lib``: as :func:`export_update` takes it.
    Raises ValueError for an optimizer the check does not know. Needs torch."""
    from .manifest import Manifest
    from .models import load_checkpoint
    m = Manifest.read(export_dir)
    config, names = m.optimizer, m.trainable
    _, tensors, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))
    inputs = random_update_inputs(config, [tuple(np.shape(tensors[n])) for n in names], seed)
    check = UpdateCheck(dict(config), steps=inputs[3])
    _compare(check, names, inputs, export_update(export_dir, *inputs[:3], rpc_session,
                                                   train_lib))
    if rpc_session is None and first_batch is not None:
        x, y, masks, grads = first_batch
        step_inputs = ([tensors[n] for n in names], [grads[n] for n in names], *inputs[2:])
        _compare(check, names, step_inputs,
                 export_train_step(export_dir, x, y, masks, tensors, inputs[2]), "train_step ")
    check.failing = sorted((o for o, e in check.errors.items() if e > check.bounds[o]),
                           key=lambda o: -check._share(o))
    return check
