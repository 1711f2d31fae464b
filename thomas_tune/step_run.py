"""An export's training step run for its numbers: loss and gradients as float64 arrays, on this
machine or on a device server, the step's check (:mod:`thomas_tune.step_check`) compares them."""

from __future__ import annotations

import os

import numpy as np


def export_step(export_dir: str, x: np.ndarray, y: np.ndarray, device=None, rpc_session=None,
                cached: bool = False, masks: dict | None = None, tensors: dict | None = None,
                train_lib=None) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients (parameter name -> float64 array) of the export's training step on
    ``x`` (float32, the export's batch) and ``y`` (int64), dropout ``masks`` (name -> array of
    the manifest's shape; None: ones, dropout off), from ``tensors`` (name -> array; None: the
    export's own parameters), from the
    export's own parameters, run on this machine (``device``: default, the export target's
    device 0) or, with ``rpc_session`` (a ``tvm.rpc`` session), on that device server: there
    ``train.so`` is uploaded and loaded, and the step's tuple of results stays on the device,
    its tensors read one by one (``ffi.ArrayGetItem``, which every TVM runtime registers).
    ``cached``: the step as ``train --cache-features`` takes it, the export's ``features`` of
    ``x`` then ``train_head_adjoint`` on them (an export made with ``--cache-features``; runs
    on this machine only). ``train_lib``: the export's ``train.so`` already loaded on
    ``rpc_session``'s server (:func:`thomas_tune.remote.device_train_library`, or a
    :class:`thomas_tune.runtime.Session`'s own), used instead of loading it again."""
    import tvm
    from tvm.relax import VirtualMachine

    from .manifest import (ADJOINT, ADJOINT_FROZEN, FEATURES, FEATURES_FROZEN, HEAD_ADJOINT,
                           lifted_values, Manifest, slot_arguments)
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
    if cached:
        if rpc_session is not None or not m.features:
            raise ValueError("export_step(cached=True) runs an export made with "
                             "--cache-features on this machine")
        split = m.features
        constants = [t(tensors[n]) for n in (*m.frozen, *split["frozen_states"])]
        slots = m.features_slots
        if slots:  # what reads constants only, lifted out (thomas_tune.training_graph.lift)
            constants = slot_arguments(slots, lambda s: t(tensors[s]), lifted_values(
                vm[FEATURES_FROZEN](*constants), slots))
        feats = vm[FEATURES](t(x), *constants)
        states = split["head_states"]
        out = vm[HEAD_ADJOINT](feats, *masks, *(t(tensors[n]) for n in (*m.trainable,
                                                                      *states)),
                               t(y.astype("int64")))
    else:
        states = m.states
        frozen = [t(tensors[n]) for n in m.frozen]
        slots = m.frozen_slots
        if slots:  # the frozen parameters' transforms lifted out of the step
            out = vm[ADJOINT_FROZEN](*(t(tensors[n]) for n in m.frozen_lift_inputs))
            frozen = slot_arguments(slots, lambda s: t(tensors[s]),
                                    lifted_values(out, slots, get))
        ordered = [t(tensors[n]) for n in (*m.trainable, *m.states)]
        out = vm[ADJOINT](t(x), *masks, *frozen, *ordered, t(y.astype("int64")))
    if rpc_session is None:
        ret, grads = out
        loss = ret[0] if states else ret
    else:
        ret, handle = get(out, 0), get(out, 1)
        loss = get(ret, 0) if m.states else ret
        grads = [get(handle, i) for i in range(len(m.trainable))]
    return (float(loss.numpy()),
            {n: g.numpy().astype("float64") for n, g in zip(m.trainable, grads)})
