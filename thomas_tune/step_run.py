"""An export's training step run for its numbers: loss and gradients as float64 arrays, on this
machine or on a device server, the step's check (:mod:`thomas_tune.step_check`) compares them."""

from __future__ import annotations

import json
import os

import numpy as np


def export_step(export_dir: str, x: np.ndarray, y: np.ndarray, device=None, rpc_session=None,
                cached: bool = False, masks: dict | None = None, tensors: dict | None = None,
                train_lib=None, loss_scale: float | None = None
                ) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients (parameter name -> float64 array) of the export's training step on
    ``x`` (float32, the export's batch) and ``y`` (int64), dropout ``masks`` (name -> array of
    the manifest's shape; None: ones, dropout off), from ``tensors`` (name -> array; None: the
    export's own parameters), run on this machine (``device``: default, the export target's
    device 0) or, with ``rpc_session`` (a ``tvm.rpc`` session), on that device server: there
    ``train.so`` is uploaded and loaded, and the step's tuple of results stays on the device,
    its tensors read one by one (``ffi.ArrayGetItem``, which every TVM runtime registers).
    ``cached``: the step as ``train --cache-features`` takes it, the export's ``features`` of
    ``x`` then ``train_head_adjoint`` on them (an export made with ``--cache-features``; runs
    on this machine only). ``train_lib``: the export's ``train.so`` already loaded on
    ``rpc_session``'s server (:func:`thomas_tune.remote.device_train_library`, or a
    :class:`thomas_tune.runtime.Session`'s own), used instead of loading it again.
    ``loss_scale``: the scale a loss-scaled export's step is given (the manifest's
    ``loss_scale``, :mod:`thomas_tune.half_grads`; None: its ``init_scale``); its gradients are
    returned divided by it (unscaled), comparable to another build's."""
    import tvm
    from tvm.relax import VirtualMachine

    from .manifest import ADJOINT, ADJOINT_FROZEN, lifted_values, Manifest, slot_arguments
    from .models import load_checkpoint
    from .runtime import device_for
    m = Manifest.read(export_dir)
    dev = device or device_for(m.target["kind"], rpc_session)
    if rpc_session is None:
        lib = tvm.runtime.load_module(os.path.join(export_dir, "train.so"))
    else:
        from .remote import device_train_library
        lib = train_lib or device_train_library(export_dir, rpc_session)
    vm = VirtualMachine(lib, dev)
    if tensors is None:
        _, tensors, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))

    def t(a):
        return tvm.runtime.tensor(np.ascontiguousarray(a), dev)

    get = rpc_session.get_function("ffi.ArrayGetItem") if rpc_session is not None else None
    masks = [t(np.asarray((masks or {}).get(k, np.ones(v["shape"])), "float32"))
             for k, v in m.masks.items()]
    # a loss-scaled step's scale (float32, as the step takes it); its gradients are divided by it
    unscale = float(np.float32(loss_scale or m.loss_scale["init_scale"])) if m.loss_scale \
        else 1.0
    if cached:
        if rpc_session is not None or not m.features:
            raise ValueError("export_step(cached=True) runs an export made with "
                             "--cache-features on this machine")
        states = m.features["head_states"]
        out = _cached_step(vm, m, t, tensors, x, y, masks)
    else:
        states = m.states
        frozen = [t(tensors[n]) for n in m.frozen]
        slots = m.frozen_slots
        if slots:  # the frozen parameters' transforms lifted out of the step
            out = vm[ADJOINT_FROZEN](*(t(tensors[n]) for n in m.frozen_lift_inputs))
            frozen = slot_arguments(slots, lambda s: t(tensors[s]),
                                    lifted_values(out, slots, get))
        ordered = [t(tensors[n]) for n in (*m.trainable, *m.states)]
        # (not t(): np.ascontiguousarray makes a 0-d array 1-d)
        scale = [tvm.runtime.tensor(np.asarray(unscale, "float32"), dev)] if m.loss_scale \
            else []
        out = vm[ADJOINT](t(x), *masks, *frozen, *ordered, t(y.astype("int64")), *scale)
    if rpc_session is None:
        ret, grads = out
        loss = ret[0] if states else ret
    else:
        ret, handle = get(out, 0), get(out, 1)
        loss = get(ret, 0) if m.states else ret
        grads = [get(handle, i) for i in range(len(m.trainable))]
    return (float(loss.numpy()),
            {n: g.numpy().astype("float64") / unscale for n, g in zip(m.trainable, grads)})


def _cached_step(vm, m, t, tensors: dict, x: np.ndarray, y: np.ndarray, masks: list):
    """The step on cached features (:func:`export_step` with ``cached``): the export's
    ``features`` of ``x`` (its frozen part, with what reads constants only lifted out,
    :mod:`thomas_tune.training_graph.lift`), then ``train_head_adjoint`` on them; ``m`` the
    manifest, ``t`` the function making a device tensor. Returns the VM's result."""
    from .manifest import FEATURES, FEATURES_FROZEN, HEAD_ADJOINT, lifted_values, slot_arguments
    split = m.features
    constants = [t(tensors[n]) for n in (*m.frozen, *split["frozen_states"])]
    slots = m.features_slots
    if slots:
        constants = slot_arguments(slots, lambda s: t(tensors[s]), lifted_values(
            vm[FEATURES_FROZEN](*constants), slots))
    feats = vm[FEATURES](t(x), *constants)
    return vm[HEAD_ADJOINT](feats, *masks, *(t(tensors[n]) for n in (*m.trainable,
                                                                  *split["head_states"])),
                            t(y.astype("int64")))


#: check-only libraries of mixed16 exports already compiled in this process, by the inputs of
#: the graph compiled (:func:`stored_library`) -> the loaded library (:func:`stored_step`):
#: exports of one step (several folders, fresh tensors) share one compile
_STORED_LIBRARIES: dict = {}


def stored_library(export_dir: str):
    """The check-only form of a mixed16 export's training step, compiled for the export's
    target on this machine (once per process) and loaded: its ``train_adjoint`` is the
    export's step graph (the same graph :func:`thomas_tune.compiler.export.export` builds:
    :func:`thomas_tune.memory_plan.step_graph` of the manifest's model, batch, trainable set,
    BatchNorm mode and optimizer) rewritten by
    :func:`thomas_tune.half_storage.returning_stored`, so it returns the float16 tensors the
    step stores beside its loss and gradients; default schedules (no tuning log). Raises
    ValueError for an export that is not mixed16, was built with a tuning log or a memory
    budget, or whose frozen parameters' transforms are lifted out of the step (its step is
    not this graph), naming why. Compiled once per process for each set of the inputs of that
    graph (the model's architecture and configuration, the batch, the trainable set, the
    optimizer, the BatchNorm mode, the target), whichever export folder states them."""
    import tvm

    from .compiler.compile import compile_library
    from .half_storage import returning_stored
    from .manifest import ADJOINT, Manifest
    from .memory_plan import step_graph
    from .models import load_checkpoint
    from .training_graph import graph as G
    m = Manifest.read(export_dir)
    why = ("it is not a mixed16 export" if m.precision != "mixed16" else
           "it was built with a tuning log" if m.tuning_log else
           "it was built with a memory budget" if m.memory_budget else
           "its frozen parameters' transforms are lifted" if m.frozen_slots else None)
    if why is not None:
        raise ValueError(f"{export_dir}: the check-only form of its step (the float16 tensors "
                         f"it stores) is built for untuned mixed16 exports only: {why}")
    model, _, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))
    key = json.dumps([model.arch, model.config(), m.batch, list(m.trainable), m.optimizer,
                      m.batchnorm, m.target], sort_keys=True, default=str)
    if key not in _STORED_LIBRARIES:
        tg = G.training_module(model, m.batch, list(m.trainable), G.OptimizerConfig(
            **m.optimizer), batchnorm=m.batchnorm)
        mod = step_graph(tg, m.batch, None, "float32").mod
        keep = tvm.IRModule({gv: f for gv, f in mod.functions.items()
                             if isinstance(f, tvm.tirx.PrimFunc)})
        keep[ADJOINT] = returning_stored(mod[ADJOINT], m.batch)
        exe, _ = compile_library(keep, tvm.target.Target(m.target))
        _STORED_LIBRARIES[key] = tvm.runtime.load_module(_saved(exe))
    return _STORED_LIBRARIES[key]


def _saved(exe) -> str:
    """``exe`` (a Relax VM executable) written as a shared library in a temporary folder that
    lives as long as the process; its path."""
    import tempfile
    folder = tempfile.mkdtemp(prefix="thomas_tune_stored_")
    path = os.path.join(folder, "stored.so")
    exe.export_library(path)
    return path


def stored_step(export_dir: str, x: np.ndarray, y: np.ndarray, masks: dict | None = None,
                tensors: dict | None = None
                ) -> tuple[float, dict[str, np.ndarray], list[np.ndarray]]:
    """:func:`export_step` of a mixed16 export run through its check-only form
    (:func:`stored_library`) on this machine: loss, gradients (parameter name -> float64
    array) and the float16 tensors the step stores (float16 arrays, in the order the step
    makes them, the order :mod:`thomas_tune.half_reference` rounds them). Same arguments as
    :func:`export_step`; raises ValueError as :func:`stored_library`."""
    import tvm
    from tvm.relax import VirtualMachine

    from .manifest import ADJOINT, Manifest
    from .models import load_checkpoint
    from .runtime import device_for
    m = Manifest.read(export_dir)
    dev = device_for(m.target["kind"])
    vm = VirtualMachine(stored_library(export_dir), dev)
    if tensors is None:
        _, tensors, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))

    def t(a):
        return tvm.runtime.tensor(np.ascontiguousarray(a), dev)

    masks = [t(np.asarray((masks or {}).get(k, np.ones(v["shape"])), "float32"))
             for k, v in m.masks.items()]
    args = [t(tensors[n]) for n in (*m.frozen, *m.trainable, *m.states)]
    (ret, grads), halves = vm[ADJOINT](t(x), *masks, *args, t(y.astype("int64")))
    loss = ret[0] if m.states else ret
    return (float(loss.numpy()),
            {n: g.numpy().astype("float64") for n, g in zip(m.trainable, grads)},
            [h.numpy() for h in halves])
