"""A task's check run on a device: the checked arguments, the reference's outputs, the
comparison of a candidate with them, and the references a tuning run builds once.

What is compared and how is :mod:`thomas_tune.kernel_check`'s (the random inputs, the poison,
the tolerance, the kernels built beside a reference). Here the inputs are uploaded or drawn on
the device (:class:`DeviceArgs`), the reference runs there (:func:`reference_outputs`,
:func:`device_reference`) and a candidate is compared there where the device can
(:class:`DeviceComparison`): only the seed goes to the device, and two numbers per output come
back per candidate. :func:`build_references` builds each task's reference library once for a
tuning run (:class:`Reference`, what a device server receives).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tvm

from .kernel_check import (COMPARE, FILL, FINITE, CheckSpec, arg_shapes, check_spec,
                           compare_kernel, compared_dtype, default_kernel, fill_keys,
                           fill_kernel, finite_kernel, finite_share, poison_value, poisoned_args,
                           random_inputs)


# ---- running on a device (local, or a session's) ----------------------------------------------
class DeviceArgs:
    """The arguments of one kernel on ``dev`` (a local device, or one of an RPC session):
    ``inputs`` (host arrays) uploaded once, or drawn on the device (:meth:`drawn`);
    :meth:`reset` puts the written arguments back to :data:`POISON` (or, for arguments updated
    in place, to their input) on the device, with device-side copies, before each checked run;
    :meth:`outputs` copies the written arguments back to the host."""

    def __init__(self, inputs: list[np.ndarray], spec: CheckSpec, dev):
        self.spec = spec
        self.args = [tvm.runtime.tensor(a, dev) for a in inputs]
        self.initial = {}
        for i in spec.written:
            fill = inputs[i] if i in spec.updated else \
                np.full_like(inputs[i], poison_value(str(inputs[i].dtype)))
            self.initial[i] = tvm.runtime.tensor(fill, dev)

    @classmethod
    def drawn(cls, fill, func: tvm.tirx.PrimFunc, spec: CheckSpec, dev, seed: int,
              positive: bool = False) -> "DeviceArgs":
        """The arguments of workload ``func`` made on ``dev`` by ``fill`` (its
        :func:`fill_kernel`, loaded for ``dev``): the values of :func:`random_inputs`
        ``(arg_shapes(func), seed, positive)``; nothing but the seed crosses to the device."""
        self = cls.__new__(cls)
        self.spec = spec
        self.args = [tvm.runtime.empty(shape, dt, dev) for shape, dt in arg_shapes(func)]
        poisoned = poisoned_args(spec)
        self.initial = {i: tvm.runtime.empty(self.args[i].shape, self.args[i].dtype, dev)
                        for i in poisoned}
        fill(*fill_keys(len(self.args), seed), int(positive), *self.args,
             *(self.initial[i] for i in poisoned))
        for i in spec.updated:
            self.initial[i] = tvm.runtime.empty(self.args[i].shape, self.args[i].dtype, dev)
            self.initial[i].copyfrom(self.args[i])
        return self

    def reset(self) -> None:
        for i, src in self.initial.items():
            self.args[i].copyfrom(src)

    def outputs(self) -> dict[int, np.ndarray]:
        return {i: self.args[i].numpy() for i in self.spec.written}


def run_checked(fn, dev, args: DeviceArgs) -> dict[int, np.ndarray]:
    """Run kernel ``fn`` (a packed function of the kernel's module) once on ``args`` after
    :meth:`DeviceArgs.reset`; returns its outputs on the host."""
    args.reset()
    fn(*args.args)
    dev.sync()
    return args.outputs()


class DeviceComparison:
    """A task's candidates compared with its reference on the device, with ``compare`` (the
    task's :func:`compare_kernel`, loaded for ``args``' device): made right after the reference
    ran on ``args`` (:func:`reference_outputs`, :func:`device_reference`), whose written
    arguments it copies there as the expected outputs."""

    def __init__(self, compare, args: DeviceArgs, dev):
        self.compare, self.args = compare, args
        self.expected, self.sums = [], []
        for i in args.spec.written:
            src = args.args[i]
            copy = tvm.runtime.empty(src.shape, src.dtype, dev)
            copy.copyfrom(src)
            self.expected.append(copy)
            self.sums += [tvm.runtime.empty((1,), compared_dtype(src.dtype), dev)
                          for _ in range(2)]

    def run(self, fn, dev) -> dict[int, tuple[float, float]]:
        """Run kernel ``fn`` once on the checked inputs (:meth:`DeviceArgs.reset` first) and
        compare on the device: per written argument, (largest difference, largest reference
        value) for :func:`verdict`; two numbers per output come back to the host."""
        self.args.reset()
        fn(*self.args.args)
        pairs = []
        for k, i in enumerate(self.args.spec.written):
            pairs += [self.args.args[i], self.expected[k]]
        self.compare(*pairs, *self.sums)
        dev.sync()
        values = [float(t.numpy()[0]) for t in self.sums]
        return dict(zip(self.args.spec.written, zip(values[0::2], values[1::2])))


def reference_outputs(fn, dev, func: tvm.tirx.PrimFunc, seed: int, spec: CheckSpec | None = None
                      ) -> tuple[DeviceArgs, dict[int, np.ndarray]]:
    """Inputs for workload ``func`` on ``dev`` and the outputs of the reference kernel ``fn``
    (its default schedule, built for that device) on them. Inputs are drawn on the host and
    uploaded; signed, and where that leaves over half of an output non-finite (a square root of
    a random variance), drawn again positive (:func:`random_inputs`)."""
    spec = spec or check_spec(func)
    shapes = arg_shapes(func)
    for positive in (False, True):
        args = DeviceArgs(random_inputs(shapes, seed, positive), spec, dev)
        ref = run_checked(fn, dev, args)
        if finite_share(ref) >= 0.5:
            break
    return args, ref


def library_function(lib, name: str):
    """``lib``'s function ``name`` (imports included), or None where it has none."""
    try:
        return lib.get_function(name, query_imports=True)
    except Exception:  # e.g. a reference of outputs that are not all floats has no comparison
        return None


def device_reference(lib, dev, func: tvm.tirx.PrimFunc, seed: int, spec: CheckSpec) -> tuple[
        DeviceArgs, DeviceComparison | None, dict[int, np.ndarray] | None]:
    """The checked inputs of workload ``func`` and its reference's outputs, made on ``dev``
    with ``lib``, the library :func:`build_references` built (function ``main``, the default
    schedule, with :data:`FILL` and, for float outputs, :data:`FINITE` and :data:`COMPARE`
    beside it): inputs drawn there (:meth:`DeviceArgs.drawn`), again positive where over half
    of an output is not finite (as :func:`reference_outputs`), the reference run there.

    Returns ``(args, comparison, expected)``: where ``lib`` compares on the device, the
    :class:`DeviceComparison` and None (the outputs stay on the device: only the seed and the
    finite counts cross); else None and the reference's outputs on the host."""
    fill, main = library_function(lib, FILL), lib["main"]
    finite, compare = library_function(lib, FINITE), library_function(lib, COMPARE)
    for positive in (False, True):
        args = DeviceArgs.drawn(fill, func, spec, dev, seed, positive)
        args.reset()
        main(*args.args)
        if finite is None or compare is None:
            expected = args.outputs()
            share = finite_share(expected)
        else:
            expected = None
            counts = [tvm.runtime.empty((1,), "int64", dev) for _ in spec.written]
            finite(*(args.args[i] for i in spec.written), *counts)
            dev.sync()
            share = min((int(c.numpy()[0]) / max(1, math.prod(args.args[i].shape))
                         for c, i in zip(counts, spec.written)), default=1.0)
        if share >= 0.5:
            break
    dev.sync()
    if expected is not None:
        return args, None, expected
    return args, DeviceComparison(compare, args, dev), None


# ---- references of a tuning run -------------------------------------------------------------
@dataclass(frozen=True)
class Reference:
    """What a device server needs to check the candidates of one task: ``key`` (the workload
    key), ``artifact`` (the task's default-schedule kernel built as a shared library for the
    target, or None to compute the reference on the host with llvm), ``workload_json`` (the
    workload's function, ``tvm.ir.save_json``), its :class:`CheckSpec` and the input seed."""

    key: str
    artifact: str | None
    workload_json: str
    spec: CheckSpec
    seed: int = 0

    def wire(self) -> tuple:
        """The plain tuple a measuring worker process receives."""
        return (self.key, self.artifact, self.workload_json, self.spec, self.seed)


def build_references(mods: list[tvm.IRModule], target, builder, seed: int = 0
                     ) -> tuple[list[Reference], list[str]]:
    """One :class:`Reference` per workload of ``mods`` (one function ``main`` each): its
    default-schedule kernel, with the :func:`fill_kernel` of its checked inputs (function
    :data:`FILL`) and, for float outputs, the :func:`finite_kernel` and :func:`compare_kernel`
    of its outputs (:data:`FINITE`, :data:`COMPARE`) beside it (:func:`device_reference`),
    built once with ``builder`` (a MetaSchedule builder, e.g.
    :class:`thomas_tune.measure.builder.Builder`) for ``target``. Where that build fails, the
    reference is computed on the measuring host with llvm instead. Returns the references and
    the artifact paths to remove once the run is over."""
    from tvm.s_tir import meta_schedule as ms

    from .tasks import workload_key
    def with_checks(mod):
        kernel = default_kernel(mod, target)
        func, spec = mod["main"], check_spec(mod["main"])
        for name, make in ((FILL, fill_kernel), (FINITE, finite_kernel),
                           (COMPARE, compare_kernel)):
            extra = make(func, spec, target)
            if extra is not None:
                kernel[name] = extra.with_attr("global_symbol", name)
        return kernel

    built = builder.build([ms.builder.BuilderInput(with_checks(m), target) for m in mods])
    refs, paths = [], []
    for mod, b in zip(mods, built):
        artifact = None if b.error_msg is not None else str(b.artifact_path)
        if artifact is not None:
            paths.append(artifact)
        refs.append(Reference(workload_key(mod["main"]), artifact, tvm.ir.save_json(mod["main"]),
                              check_spec(mod["main"]), seed))
    return refs, paths
