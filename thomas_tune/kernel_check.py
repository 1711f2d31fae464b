"""Does a scheduled kernel compute what its workload says? Outputs compared with a reference.

A schedule changes loop order, tiling, thread binding and memory scopes, never the numbers
(up to the order of float32 sums). A wrong schedule (a race on shared memory, a bound check
that is missing, a launch that runs nothing, an out-of-range write) is usually *faster* than a
right one, so a tuner that only times candidates prefers it. Every candidate the tuner
measures, and every record ``export`` and ``replay`` apply, is therefore run once on random
inputs and its outputs compared with the task's **default schedule** run on the same inputs on
the same device (:func:`default_kernel`):

* inputs are random (:func:`random_inputs`: floats uniform on [-2, 2), or on [0.5, 1.5) where
  signed inputs leave most of the reference not finite, integer tensors of 0s and 1s, in range
  for every gather of the graphs), never zeros; they are a counter-based hash of (seed,
  argument, element) (:mod:`thomas_tune.counter_random`), so a kernel drawing them on the
  device (:func:`fill_kernel`) and numpy on the host give the same values;
* every output the kernel must write is filled with NaN before the run (:data:`POISON`), so a
  kernel that writes nothing, or part of its output, leaves NaN where the reference has a
  number; an argument that is read *and* written (an in-place update) is restored to its
  input value instead;
* the comparison (:func:`compare`) is ``max |got - ref| / max |ref|`` over the finite
  reference elements, per output, against a float32 tolerance that grows with the length of
  the kernel's reductions (:func:`tolerance`); a non-finite value where the reference is
  finite is an error of 1.

The check's cost is one extra run of the candidate per trial; the reference is computed once
per task and input set. Where the reference kernel was built for the device, the inputs are
drawn there, the reference's outputs stay there and candidates are compared there too
(:func:`fill_kernel`, :func:`finite_kernel`, :func:`compare_kernel`, built beside it, and run
by :mod:`thomas_tune.kernel_reference`): only the seed goes to the device, and two numbers per
output come back per candidate, instead of the inputs and outputs (tens of MB a task at 224
px, batch 32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tvm

#: what outputs hold before the checked run: a kernel that does not write an element leaves it
POISON = float("nan")

#: name of the comparison function built beside a reference kernel (:func:`compare_kernel`)
COMPARE = "compare"
#: name of the function built beside a reference kernel that draws the checked inputs on the
#: device (:func:`fill_kernel`)
FILL = "fill"
#: name of the function built beside a reference kernel that counts its outputs' finite
#: elements on the device (:func:`finite_kernel`)
FINITE = "finite"
#: what :func:`compare_kernel` gives as the difference where a candidate's output is not finite
#: and the reference's is (a float32 value far above any difference of finite checked outputs,
#: printed exactly in OpenCL C, where the largest float32 is not)
NOT_FINITE = 1e30

#: float32 unit roundoff, 2^-24 (IEEE 754-2008 binary32)
U32 = 2.0 ** -24

#: float32 1.0's bits: a float in [1, 2) is these with 23 bits of mantissa
_ONE_BITS = 0x3F800000


@dataclass(frozen=True)
class CheckSpec:
    """What to compare for one workload (a TIR function of ``n`` parameters).

    ``written``: indices of the parameters some block writes (the outputs); ``updated``: those
    of ``written`` that a block also reads (updated in place: restored before each run, not
    poisoned); ``terms``: the longest chain of summed terms, the product of the reduction
    extents of each reducing block, summed over blocks (1 without a reduction); ``half``:
    whether a block writes a float16 buffer (the kernel rounds to float16 on the way,
    ``--precision mixed16``; one that only reads float16 computes in float32)."""

    written: tuple[int, ...]
    updated: tuple[int, ...]
    terms: int
    half: bool = False

    @property
    def tol(self) -> float:
        return tolerance(self.terms, self.half)


#: the tolerance of a kernel that rounds to float16 on the way (:func:`tolerance`): four
#: float16 steps of the largest value, 2^-8 (IEEE 754-2008 binary16: 10 bits of mantissa)
HALF_TOLERANCE = 2.0 ** -8


def tolerance(terms: int, half: bool = False) -> float:
    """The largest ``max |got - ref| / max |ref|`` accepted between two float32 evaluations of
    a kernel that sums ``terms`` terms per output in different orders.

    The rounding error of a float32 sum of n terms grows like ``sqrt(n) * u`` for terms of
    random sign (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section
    4.2, the probabilistic bound) and at worst like ``n * u``. The tolerance is
    ``64 * sqrt(n) * u`` (u = 2^-24) with a floor of 2e-5, the room element-wise functions
    (exp, rsqrt) take on OpenCL devices (OpenCL C 3.0 spec, section 7.4: up to 4 ulp):
    5e-5 for 1,000 terms, 2.4e-3 for 400,000 terms (MobileNetV2's first weight gradient at
    batch 32). A kernel that writes nothing, zeros or the wrong elements is off by about 1.

    ``half``: the kernel rounds to float16 on the way (it writes a float16 buffer,
    ``--precision mixed16``); where two float32 orders put a value either side of the
    midpoint between two float16 values, the two evaluations differ by a float16 step, up to
    2^-10 of the value, and a later rounding of the same chain can add a step: at least
    :data:`HALF_TOLERANCE` (a value 1% off is 2.6x over it)."""
    floor = HALF_TOLERANCE if half else 2e-5
    return max(floor, 64.0 * math.sqrt(max(1, terms)) * U32)


def check_spec(func: tvm.tirx.PrimFunc) -> CheckSpec:
    """The :class:`CheckSpec` of a workload in block form (as task extraction gives it).
    Raises ValueError for a function none of whose parameters is written."""
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    index = [(p, i) for i, p in enumerate(func.params)]  # a tensor parameter is its buffer
    written, read, terms, half = set(), set(), 0, False

    def walk(block_rv):
        nonlocal terms, half
        block = sch.get(block_rv)
        half = half or any(str(r.source.dtype) == "float16" for r in block.writes)
        for region in block.writes:
            for buf, i in index:
                if region.source.same_as(buf):
                    written.add(i)
        for region in block.reads:
            for buf, i in index:
                if region.source.same_as(buf):
                    read.add(i)
        n = 1
        reduces = False
        for iv in block.iter_vars:
            if iv.iter_type == tvm.tirx.IterVar.CommReduce:
                reduces = True
                ext = iv.dom.extent
                n *= int(ext) if isinstance(ext, tvm.tirx.IntImm) else 1
        if reduces:
            terms += n
        for child in sch.get_child_blocks(block_rv):
            walk(child)

    walk(sch.get_sblock("root"))
    if not written:
        raise ValueError(f"kernel {func.attrs['global_symbol'] if func.attrs else ''}: no "
                         "parameter is written; nothing to check")
    return CheckSpec(tuple(sorted(written)), tuple(sorted(written & read)), max(1, terms),
                     half)


def arg_shapes(func: tvm.tirx.PrimFunc) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of each parameter of ``func``. Raises ValueError for a parameter that is
    not a tensor of static shape (no kernel of the graphs has one)."""
    out = []
    for p in func.params:
        try:
            shape = tuple(int(s) for s in p.shape)
        except (AttributeError, TypeError) as err:
            raise ValueError(f"parameter {p} of the kernel is not a tensor of static "
                             "shape") from err
        out.append((shape, str(p.dtype)))
    return out


def random_inputs(shapes: list[tuple[tuple[int, ...], str]], seed: int,
                  positive: bool = False) -> list[np.ndarray]:
    """One array per (shape, dtype), argument ``t`` in order: floats uniform on [-2, 2) (mean 0,
    variance 4/3; ``positive``: uniform on [0.5, 1.5), for kernels whose reference is not
    finite on signed inputs, such as a square root of a variance) on a grid of 2^-21 (2^-23),
    integers and booleans 0 or 1 (in range for every gather and label of the graphs).
    Element ``n`` is a function of hash ``h`` of (``seed``, ``t``, ``n``)
    (:mod:`thomas_tune.counter_random`; ``seed`` mod 2^64, as two 32-bit halves): with ``v``
    the float32 in [1, 2) whose mantissa is ``h >> 9``, ``(v - 1.5) * 4``, ``v - 0.5`` and
    ``h >> 31``, all exact in float32 (no constant that OpenCL C prints rounded), so
    :func:`fill_kernel` gives the same values on every device."""
    from . import counter_random as cr
    out = []
    for (shape, dtype), key in zip(shapes, fill_keys(len(shapes), seed)):
        h = cr.hash_numpy(math.prod(shape), np.array([key], np.uint64))
        if not np.issubdtype(np.dtype(dtype), np.floating):
            out.append((h >> np.uint64(31)).astype(dtype).reshape(shape))
            continue
        v = ((h >> np.uint64(9)) | np.uint64(_ONE_BITS)).astype(np.uint32).view(np.float32)
        v = v - np.float32(0.5) if positive else (v - np.float32(1.5)) * np.float32(4.0)
        out.append(v.astype(dtype).reshape(shape))
    return out


def compare(got: dict[int, np.ndarray], ref: dict[int, np.ndarray], tol: float) -> str | None:
    """None when every output of ``got`` (argument index -> array) agrees with ``ref`` within
    ``tol`` (``max |got - ref| / max |ref|`` over the elements where ``ref`` is finite; a
    non-finite ``got`` there counts as an error of 1, and so does an output whose reference
    is 0 everywhere while ``got`` is not); else the reason, ``"wrong result: max rel err X at
    output Y (tolerance T)"``, naming the worst output by argument index."""
    pairs = {}
    for i, r in ref.items():
        r64 = r.astype("float64", copy=False)
        finite = np.isfinite(r64)
        if not finite.any():
            continue
        rf, gf = r64[finite], got[i].astype("float64", copy=False)[finite]
        scale = float(np.max(np.abs(rf)))
        diff = float(np.max(np.abs(gf - rf))) if np.isfinite(gf).all() else math.inf
        pairs[i] = (diff, scale)
    return verdict(pairs, tol)


def verdict(diff_scale: dict[int, tuple[float, float]], tol: float) -> str | None:
    """:func:`compare`'s verdict from, per output (argument index), the largest ``|got - ref|``
    over the elements where ``ref`` is finite (``inf``, or at least :data:`NOT_FINITE`, where
    ``got`` is not finite there: an error of 1) and the largest ``|ref|`` there."""
    worst, where = 0.0, None
    for i, (diff, scale) in diff_scale.items():
        if not math.isfinite(diff) or diff >= NOT_FINITE:
            err = 1.0
        else:
            err = diff / scale if scale > 0 else (1.0 if diff > 0 else 0.0)
        if err > worst:
            worst, where = err, i
    if worst > tol:
        return f"wrong result: max rel err {worst:.3g} at output {where} (tolerance {tol:.2g})"
    return None


def finite_share(ref: dict[int, np.ndarray]) -> float:
    """The smallest share (0..1) of finite elements over the outputs of ``ref``."""
    shares = [float(np.isfinite(r).mean()) if r.size else 1.0 for r in ref.values()]
    return min(shares, default=1.0)


def default_kernel(mod: tvm.IRModule, target) -> tvm.IRModule:
    """Workload ``mod``'s function alone in a module (function ``main``), scheduled as an
    untuned build schedules it (:func:`thomas_tune.schedules.default_schedules`: default GPU
    schedules, or on a CPU its long sums and loops split): the reference of every check and
    the kernel a default-schedule time is measured on."""
    from .schedules import default_schedules
    return default_schedules(tvm.IRModule({"main": mod["main"]}), target)


def record_kernel(record) -> tvm.IRModule:
    """The kernel a tuning record's schedule makes of its workload (module with ``main``), as
    a build applies it (the trace with its postprocessing)."""
    sch = tvm.s_tir.Schedule(record.workload.mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    return sch.mod




def _float_outputs(func: tvm.tirx.PrimFunc, spec: CheckSpec) -> list[tuple[tuple[int, ...], str]]:
    shapes = arg_shapes(func)
    return [shapes[i] for i in spec.written]


def compared_dtype(dtype: str) -> str:
    """The dtype :func:`compare_kernel` computes and returns the comparison of outputs of
    ``dtype`` in: float32 for float16, else ``dtype``."""
    return "float32" if dtype == "float16" else dtype


def compare_kernel(func: tvm.tirx.PrimFunc, spec: CheckSpec, target) -> tvm.tirx.PrimFunc | None:
    """The comparison of :func:`compare` as a kernel for ``target``, so that a candidate's
    outputs are compared with the reference's where both are, and only two numbers per
    output cross to the host: for written argument ``k`` of ``spec`` (in order), ``got_k``
    and ``ref_k`` of its shape and dtype, then per output ``diff_k`` = max over the elements
    where ``ref_k`` is finite of ``|got_k - ref_k|`` (:data:`NOT_FINITE` where ``got_k`` is
    not finite) and ``scale_k`` = max ``|ref_k|`` there, each of shape (1,), of
    :func:`compared_dtype` (a float16 output's in float32: float16 holds no
    :data:`NOT_FINITE`, and its differences are exact in float32).
    Maxima are exact in floating point, so :func:`verdict` on these gives what :func:`compare`
    gives on the host. Each reduction is one work-group on a GPU (its work-items split the
    elements, then TVM's cross-thread reduction). None when an output is not floating point
    (those are compared on the host)."""
    from tvm import te, tirx
    outputs = _float_outputs(func, spec)
    if not outputs or any(not dt.startswith("float") for _, dt in outputs):
        return None

    def pair(k, shape, dt):
        got = te.placeholder(shape, dt, f"got{k}")
        ref = te.placeholder(shape, dt, f"ref{k}")
        cdt = compared_dtype(dt)
        zero, big = tirx.const(0.0, cdt), tirx.const(NOT_FINITE, cdt)
        rd = [te.reduce_axis((0, n), f"d{k}_{j}") for j, n in enumerate(shape)]
        rs = [te.reduce_axis((0, n), f"s{k}_{j}") for j, n in enumerate(shape)]

        def diff(_):
            g, r = (tirx.Cast(cdt, t[tuple(rd)]) for t in (got, ref))
            v = tirx.Select(tirx.isfinite(g), tirx.abs(g - r), big)
            return te.max(tirx.Select(tirx.isfinite(r), v, zero), axis=rd)

        def scale(_):
            r = tirx.Cast(cdt, ref[tuple(rs)])
            return te.max(tirx.Select(tirx.isfinite(r), tirx.abs(r), zero), axis=rs)

        return [got, ref], [te.compute((1,), diff, name=f"diff{k}"),
                            te.compute((1,), scale, name=f"scale{k}")]

    ins, outs, names = [], [], []
    for k, (shape, dt) in enumerate(outputs):
        i, o = pair(k, shape, dt)
        ins += i
        outs += o
        names += [f"diff{k}", f"scale{k}"]
    return _one_group_each(te.create_prim_func(ins + outs), names, target)


def _one_group_each(prim: tvm.tirx.PrimFunc, names: list[str], target) -> tvm.tirx.PrimFunc:
    """``prim`` (made by ``te.create_prim_func``) scheduled for a GPU ``target``: each block of
    ``names`` (outputs of shape (1,), a reduction over all of one tensor) is one work-group
    whose work-items split the elements (TVM's cross-thread reduction); as it is elsewhere."""
    from .target import is_gpu
    if not is_gpu(target):
        return prim
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": prim}))
    threads = int(target.attrs.get("max_threads_per_block", 256))
    for name in names:
        block = sch.get_sblock(name)
        loops = sch.get_loops(block)
        if len(loops) == 1:  # a 0-d tensor's: one element, nothing to split
            outer, inner = sch.split(loops[0], [None, 1])
            sch.bind(outer, "blockIdx.x")
            sch.bind(inner, "threadIdx.x")
            continue
        r = sch.fuse(*loops[1:]) if len(loops) > 2 else loops[1]
        _, inner = sch.split(r, [None, threads])
        sch.bind(loops[0], "blockIdx.x")
        sch.bind(inner, "threadIdx.x")
    return sch.mod["main"].with_attr("tir.is_scheduled", True)


def poisoned_args(spec: CheckSpec) -> list[int]:
    """The written arguments of ``spec`` that are filled with :data:`POISON` before a run."""
    return [i for i in spec.written if i not in spec.updated]


def poison_value(dtype: str):
    """What an output of ``dtype`` holds before a checked run: NaN for floats, the largest
    value for integers, True for booleans."""
    if np.issubdtype(np.dtype(dtype), np.floating):
        return POISON
    if dtype == "bool":
        return True
    return int(np.iinfo(np.dtype(dtype)).max)


def fill_keys(count: int, seed: int) -> list[int]:
    """The keys (ints in [0, 2^32)) of the first ``count`` arguments' streams under ``seed``
    (mod 2^64, as two 32-bit halves; :func:`thomas_tune.counter_random.key_numpy`): what
    :func:`random_inputs` hashes with, and what a :func:`fill_kernel` receives."""
    from . import counter_random as cr
    s0, s1 = seed & cr.M32, (seed >> 32) & cr.M32
    return [int(cr.key_numpy(s0, s1, t)[0]) for t in range(count)]


def fill_kernel(func: tvm.tirx.PrimFunc, spec: CheckSpec, target) -> tvm.tirx.PrimFunc:
    """The checked inputs of workload ``func`` drawn on the device: a kernel for ``target`` of
    parameters ``key0 .. key{n-1}`` (uint32, :func:`fill_keys` ``(n, seed)`` for the ``n``
    parameters of ``func``), ``positive`` (int32, 0 or 1), then one tensor per parameter of
    ``func`` (its shape and dtype), filled with :func:`random_inputs` ``(shapes, seed,
    positive)`` bit for bit, then one tensor per written, not updated, argument of ``spec``
    (:func:`_poisoned`), filled with what it holds before a checked run (:data:`POISON` for
    floats). Each tensor is one block, its elements spread over work-groups on a GPU.

    The seed arrives as one 32-bit key per tensor, each used once per element, because TVM's
    OpenCL runtime passes no 64-bit unsigned kernel argument (:mod:`.kernel_signature`): a
    64-bit seed split into halves inside the kernel would have its halves computed once on
    the host and passed as ``ulong`` arguments."""
    from tvm import te, tirx

    from . import counter_random as cr
    from .target import is_gpu
    shapes = arg_shapes(func)
    keys = [tirx.Var(f"key{t}", "uint32") for t in range(len(shapes))]
    positive = tirx.Var("positive", "int32")

    def u64(v):
        return tirx.const(v, "uint64")

    def flat(shape, idx):
        n = tirx.const(0, "int64")
        for dim, i in zip(shape, idx):
            n = n * dim + tirx.Cast("int64", i)
        return n

    def draw(t, shape, dtype):
        def element(*idx):
            hashed = cr.hash_te(flat(shape, idx), tirx.Cast("uint64", keys[t]))
            if not np.issubdtype(np.dtype(dtype), np.floating):
                return tirx.Cast(dtype, hashed >> u64(31))
            v = tirx.Var("v", "float32")  # in [1, 2), mantissa h >> 9
            bits = tirx.Cast("uint32", (hashed >> u64(9)) | u64(_ONE_BITS))
            signed = (v - tirx.const(1.5, "float32")) * tirx.const(4.0, "float32")
            above = v - tirx.const(0.5, "float32")
            v = tirx.Let(v, tirx.reinterpret("float32", bits),
                         tirx.Select(positive != 0, above, signed))
            return v if dtype == "float32" else tirx.Cast(dtype, v)
        return te.compute(shape, element, name=f"arg{t}")

    def constant(value):
        return lambda *_: value

    outs = [draw(t, shape, dt) for t, (shape, dt) in enumerate(shapes)]
    for i in poisoned_args(spec):
        shape, dt = shapes[i]
        outs.append(te.compute(shape, constant(tirx.const(poison_value(dt), dt)),
                               name=f"poison{i}"))
    prim = te.create_prim_func([*keys, positive, *outs])
    if not is_gpu(target):
        return prim
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": prim}))
    threads = int(target.attrs.get("max_threads_per_block", 256))
    for out in outs:
        block = sch.get_sblock(out.op.name)
        loops = sch.get_loops(block)
        loop = sch.fuse(*loops) if len(loops) > 1 else loops[0] if loops else \
            sch.add_unit_loop(block)
        bx, tx = sch.split(loop, [None, threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    return sch.mod["main"].with_attr("tir.is_scheduled", True)


def finite_kernel(func: tvm.tirx.PrimFunc, spec: CheckSpec, target) -> tvm.tirx.PrimFunc | None:
    """A kernel for ``target`` that counts the finite elements of the outputs of workload
    ``func``: for written argument ``k`` of ``spec`` (in order), ``out_k`` of its shape and
    dtype, then per output ``count_k`` (int64, shape (1,)), the number of its finite elements,
    each one work-group on a GPU. None when an output is not floating point (those outputs are
    looked at on the host)."""
    from tvm import te, tirx
    outputs = _float_outputs(func, spec)
    if not outputs or any(not dt.startswith("float") for _, dt in outputs):
        return None
    def counter(out, axes):
        def count(_):
            one = tirx.Select(tirx.isfinite(out[tuple(axes)]), tirx.const(1, "int64"),
                              tirx.const(0, "int64"))
            return te.sum(one, axis=axes)
        return count

    ins, outs, names = [], [], []
    for k, (shape, dt) in enumerate(outputs):
        out = te.placeholder(shape, dt, f"out{k}")
        axes = [te.reduce_axis((0, n), f"c{k}_{j}") for j, n in enumerate(shape)]
        ins.append(out)
        outs.append(te.compute((1,), counter(out, axes), name=f"count{k}"))
        names.append(f"count{k}")
    return _one_group_each(te.create_prim_func(ins + outs), names, target)
