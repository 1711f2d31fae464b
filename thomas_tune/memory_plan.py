"""Device memory of a compiled training step, from the build's own memory plan.

:func:`thomas_tune.memory.training_memory` counts tensors of the training graph; a compiled
step allocates otherwise. The build (:func:`thomas_tune.compiler.compile.compile_graph`) fuses the
graph into kernels, and Relax's ``StaticPlanBlockMemory`` places the tensors of a function in
*storages*: a tensor whose life has ended lends its storage to a later tensor of the same
bytes (TVM's ``src/relax/transform/static_plan_block_memory.cc``: storage tokens reused by
size, never split). ``KillAfterLastUse`` then releases a storage where its last tensor dies.
At run time the Relax VM takes storages from TVM's pooled allocator
(``src/runtime/memory/pooled_allocator.h``): a request is rounded up to a page of 4,096 bytes
and served by a released buffer of exactly that size when there is one; otherwise the device
allocates, and the pool never gives memory back. Tensors made with ``tvm.runtime.tensor``
(the session's parameters, states, optimizer state, each batch) are allocated directly, at
their size.

:func:`compiled_step_memory` runs the build's Relax passes on the export's training module up
to the release of storages, then replays the step's function the way the VM runs it: each
object counted by its references (a tensor keeps its storage alive, a tuple its items, a
register until it is killed or the function returns), storages taken from and given back to
a pool of the allocator's kind. Its result is the most bytes the device holds over
``steps`` training steps of a :class:`thomas_tune.runtime.Session`, the figure the OpenCL
sidecar measures (``device_peak_bytes``, :func:`thomas_tune.benchmark.exports.device_memory`).
With a tuning log (``database``), the scratch buffers its records' kernels allocate in
global memory (:func:`kernel_scratch`: the partial sums of an ``rfactor``, a padded copy of an
input) are counted as the sidecar's workspace pool holds them: a kernel's host code takes them
at each call and gives them back after; a freed buffer serves a later request of half to all
of its size, and one that serves none is allocated and kept for the life of the process
(``AllocWorkspace`` in ``thomas_tune/csrc/opencl_runtime.cc``). Not counted: the OpenCL
driver's own memory.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np
import tvm
from tvm import relax

from .recompute import LEVELS, BudgetError, RecomputePlan, apply_plan
from .storage_merge import merge_storages

#: TVM's pooled allocator rounds every request up to this many bytes (``kDefaultPageSize``)
PAGE = 4096


def _page(n: int) -> int:
    return -(-max(int(n), 1) // PAGE) * PAGE


def _tensor_bytes(ty) -> int:
    """Bytes of a Relax tensor type of static shape; 0 for anything else."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return 0
    shape = [int(v) for v in ty.shape.values]
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(str(ty.dtype)).itemsize


@dataclass
class StepMemory:
    """Bytes of a compiled training step on a device (module docstring).

    ``resident``: tensors the session holds (parameters, states, optimizer state, a batch's
    images and labels), allocated at their size; ``planned``: the storages of the step function
    the pool allocated (page-rounded: what the device holds for them after the first step);
    ``largest_storages``: the largest of them, (bytes, tensor shape first placed there);
    ``peak``: the most bytes on the device over the steps."""

    resident: int
    planned: int
    peak: int
    storages: int
    largest_storages: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


class _Pool:
    """TVM's pooled allocator (page-rounded sizes, exact-size reuse, memory never returned),
    with the device's count of bytes: ``device`` now and ``peak``."""

    def __init__(self):
        self.free: Counter = Counter()
        self.allocated = 0  # bytes the pool took from the device
        self.direct = 0  # bytes allocated outside the pool, alive
        self.scratch_free: list[int] = []  # the workspace pool's free buffers, sorted
        self.peak = 0

    def take(self, nbytes: int) -> int:
        size = _page(nbytes)
        if self.free[size]:
            self.free[size] -= 1
        else:
            self.allocated += size
            self._mark()
        return size

    def give(self, size: int) -> None:
        self.free[size] += 1

    def scratch(self, sizes: list[int]) -> None:
        """One kernel call's scratch buffers of ``sizes`` bytes, taken from the workspace pool
        (the smallest free buffer of at least the size and at most twice it plus a page, else
        a new one, kept) and given back after the call."""
        import bisect
        taken = []
        for n in sizes:
            i = bisect.bisect_left(self.scratch_free, n)
            if i < len(self.scratch_free) and self.scratch_free[i] <= 2 * n + PAGE:
                taken.append(self.scratch_free.pop(i))
            else:
                self.direct_alloc(n)
                taken.append(n)
        for n in taken:
            bisect.insort(self.scratch_free, n)

    def direct_alloc(self, nbytes: int) -> None:
        self.direct += max(int(nbytes), 1)
        self._mark()

    def _mark(self) -> None:
        self.peak = max(self.peak, self.allocated + self.direct)


class _Obj:
    """A run-time object of the VM: a storage (``size``), a tensor (``refs``: its storage), a
    tuple (``refs``: its items) or an argument (nothing)."""

    __slots__ = ("size", "refs", "count")

    def __init__(self, size: int = 0, refs=()):
        self.size, self.refs, self.count = size, list(refs), 0


class _Run:
    """One call of a lowered Relax function, objects counted by their references."""

    def __init__(self, pool: _Pool, storages: list, mod: tvm.IRModule | None = None,
                 scratch: dict | None = None):
        self.pool, self.storages, self.regs, self.mod = pool, storages, {}, mod
        self.scratch = scratch or {}

    def hold(self, obj: _Obj) -> _Obj:
        obj.count += 1
        return obj

    def drop(self, obj: _Obj) -> None:
        obj.count -= 1
        if obj.count > 0:
            return
        if obj.size:
            self.pool.give(obj.size)
        for r in obj.refs:
            self.drop(r)

    def set(self, var, obj: _Obj) -> None:
        old = self.regs.get(var)
        self.regs[var] = self.hold(obj)
        if old is not None:
            self.drop(old)

    def kill(self, var) -> None:
        obj = self.regs.pop(var, None)
        if obj is not None:
            self.drop(obj)

    def value(self, expr) -> _Obj | None:
        if isinstance(expr, relax.Var):
            return self.regs.get(expr)
        if isinstance(expr, relax.Tuple):
            items = [self.value(f) for f in expr.fields]
            return _Obj(refs=[self.hold(i) for i in items if i is not None])
        if isinstance(expr, relax.TupleGetItem):
            tup = self.value(expr.tuple_value)
            if tup is not None and expr.index < len(tup.refs):
                return tup.refs[expr.index]
            return None
        return None

    def bind(self, b) -> None:
        v = b.value
        if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op):
            name = v.op.name
            if name == "relax.memory.alloc_storage":
                nbytes = int(v.args[0].values[0])
                size = self.pool.take(nbytes)
                self.storages.append((size, None))
                self.set(b.var, _Obj(size=size))
                return
            if name == "relax.memory.alloc_tensor":
                storage = self.value(v.args[0])
                if self.storages and self.storages[-1][1] is None and storage is not None \
                        and storage.size == self.storages[-1][0]:
                    self.storages[-1] = (storage.size, [int(s) for s in v.args[2].values])
                self.set(b.var, _Obj(refs=[self.hold(storage)] if storage else []))
                return
            if name in ("relax.memory.kill_storage", "relax.memory.kill_tensor",
                        "relax.vm.kill_object"):
                self.kill(v.args[0])
                return
            if name == "relax.reshape" and v.args[0] in self.regs:  # a view of its input
                self.set(b.var, _Obj(refs=[self.hold(self.regs[v.args[0]])]))
                return
        if isinstance(v, relax.Call) and isinstance(v.op, relax.GlobalVar) and \
                self.mod is not None and isinstance(self.mod[v.op], relax.Function):
            # a Relax function of the module (the lifted transform of frozen parameters)
            args = [self.value(a) or _Obj() for a in v.args]
            out = _Run(self.pool, self.storages, self.mod, self.scratch).call(self.mod[v.op],
                                                                             args)
            if out is not None:
                self.set(b.var, out)
                self.drop(out)
            return
        if isinstance(v, relax.Call) and isinstance(v.op, relax.GlobalVar) and \
                v.op.name_hint in self.scratch:  # a kernel with scratch buffers
            self.pool.scratch(self.scratch[v.op.name_hint])
        obj = self.value(v)
        if obj is not None:
            self.set(b.var, obj)

    def call(self, func: relax.Function, args: list[_Obj]) -> _Obj | None:
        for p, a in zip(func.params, args):
            self.set(p, a)
        for block in func.body.blocks:
            for b in block.bindings:
                self.bind(b)
        out = self.value(func.body.body)
        if out is not None:
            self.hold(out)
        for var in list(self.regs):
            self.kill(var)
        return out


def step_graph(tg, batch: int, budget_plan=None, precision: str = "float32",
               loss_scale=None):
    """The training graph ``tg`` (:class:`thomas_tune.training_graph.graph.TrainingGraph`, not
    changed) as an export builds its step: rewritten with ``budget_plan`` (a
    :class:`thomas_tune.recompute.RecomputePlan`, None: none), then its functions at
    ``batch`` images rewritten for ``precision`` (:data:`thomas_tune.half_storage.PRECISIONS`;
    :func:`thomas_tune.half_storage.training_precision`): the graph
    :func:`thomas_tune.compiler.export.export` compiles. Raises ValueError for an unknown
    precision. ``loss_scale`` (a :class:`thomas_tune.loss_scale.LossScale`, mixed16 only):
    the activation gradients stored as float16 too, the step loss-scaled
    (:func:`thomas_tune.half_grads.apply_loss_scaling`); ValueError at another precision."""
    import dataclasses

    from .half_arith import rewrite_for
    from .half_storage import training_precision
    if budget_plan is not None:
        tg = apply_plan(tg, budget_plan)
    if loss_scale is not None:
        from .half_grads import apply_loss_scaling
        from .loss_scale import require_mixed16
        require_mixed16(precision)
        return apply_loss_scaling(tg, batch)
    if precision != "float32":
        tg = dataclasses.replace(tg, mod=training_precision(precision, tg.mod, batch,
                                                            rewrite_for(precision)))
    return tg


def lowered_training_module(model, batch: int, trainable: str = "all", optimizer=None,
                            winograd=None, budget_plan=None, tg=None,
                            precision: str = "float32", loss_scale=None
                            ) -> tuple[tvm.IRModule, object]:
    """The training module an export compiles (``library_module.training_library_module``), through
    the build's Relax passes up to ``KillAfterLastUse``
    (:func:`thomas_tune.compiler.compile._pipeline` without the kernels' schedules, which allocate
    nothing): storages planned, their releases placed. ``winograd``: the training convolutions in
    the Winograd form (as ``compile_graph`` takes them). ``budget_plan``: a
    :class:`thomas_tune.recompute.RecomputePlan` the step is rewritten with. ``tg``: the
    training graph of these arguments when it is already built (it is not changed; at
    float32, without a plan applied). ``precision``, ``loss_scale``: the step at that precision
    (:func:`step_graph`: layer outputs stored as float16 for ``mixed16``, activation gradients
    too with a loss scale). Returns (module,
    the :class:`thomas_tune.training_graph.graph.TrainingGraph` compiled, plan and precision
    applied). Raises ValueError as :func:`thomas_tune.training_graph.graph.training_module`, and for
    an unknown precision."""
    from .training_graph import graph as G
    from .training_graph.library_module import training_library_module
    from .tasks import fuse
    tg = step_graph(tg or G.training_module(model, batch, trainable, optimizer), batch,
                    budget_plan, precision, loss_scale)
    mod, _ = training_library_module(tg)
    passes = [relax.transform.RewriteDataflowReshape(), relax.transform.ToNonDataflow(),
              relax.transform.RemovePurityChecking(), relax.transform.CallTIRRewrite(),
              relax.transform.StaticPlanBlockMemory(), merge_storages,
              relax.transform.LowerAllocTensor(),
              relax.transform.KillAfterLastUse()]
    with tvm.transform.PassContext(opt_level=3):
        mod = fuse(mod, winograd)
        mod = tvm.transform.Sequential(passes)(mod)
    return mod, tg


def step_memory(mod: tvm.IRModule, tg, steps: int = 3, scratch: dict | None = None
                ) -> StepMemory:
    """Replay ``steps`` calls of the step of ``mod`` (:func:`lowered_training_module`) as a
    :class:`thomas_tune.runtime.Session` makes them (module docstring), each kernel named in
    ``scratch`` (:func:`kernel_scratch`) taking its scratch buffers from the workspace pool;
    bytes in a :class:`StepMemory`."""
    from .manifest import TRAIN_STEP, TRAIN_STEP_FROZEN
    from .models import spec
    pool, storages = _Pool(), []
    s = spec(tg.model, tg.batch)
    for p in s.params + s.states:  # the session's tensors (tvm.runtime.tensor)
        pool.direct_alloc(4 * int(np.prod(p.shape)))
    for a in tg.optim_state:
        pool.direct_alloc(np.asarray(a).nbytes)
    resident = pool.direct
    func = mod[TRAIN_STEP]
    run = _Run(pool, storages, mod, scratch)
    frozen_out = None
    if TRAIN_STEP_FROZEN in [gv.name_hint for gv in mod.get_global_vars()]:
        lifted = mod[TRAIN_STEP_FROZEN]
        frozen_out = run.call(lifted, [_Obj() for _ in lifted.params])
    # the labels, and a loss-scaled step's scale (thomas_tune.half_grads), after the batch
    after = [p for p in func.params if p.name in ("targets", "loss_scale")]
    images, labels = (_tensor_bytes(func.params[0].ty), sum(_tensor_bytes(p.ty) for p in after))
    kept: list[_Obj] = []  # the running statistics the session holds from the last step
    for step in range(steps):
        pool.direct_alloc(images + labels)  # the batch, uploaded for the call
        run = _Run(pool, storages if step == 0 else [], mod, scratch)
        out = run.call(func, [_Obj() for _ in func.params])
        pool.direct -= images + labels
        # (loss and new states, new parameters, new optimizer state): the session keeps the
        # new states and lets go of the old ones; the parameters and the optimizer state are
        # updated in place
        head = out.refs[0] if out is not None and out.refs else None
        new = [run.hold(r) for r in head.refs[1:]] if head is not None and head.refs else []
        if out is not None:
            run.drop(out)
        for old in kept:
            run.drop(old)
        kept = new
    del frozen_out
    sizes = sorted(((n, shape) for n, shape in storages), key=lambda t: -t[0])
    return StepMemory(resident=resident + images + labels,
                      planned=sum(n for n, _ in storages), peak=pool.peak,
                      storages=len(storages), largest_storages=sizes[:8])


def compiled_step_memory(model, batch: int, trainable: str = "all", optimizer=None,
                         winograd=None, budget_plan=None, steps: int = 3,
                         tg=None, precision: str = "float32", loss_scale=None,
                         database=None, target=None) -> StepMemory:
    """Bytes the compiled training step of ``model`` at ``batch`` holds on a device over
    ``steps`` steps (module docstring): what ``thomas-tune memory`` reports as the compiled
    step's peak. ``database`` (the records an export applies, with their ``target``): their
    kernels' scratch buffers counted (:func:`kernel_scratch`). Other arguments as
    :func:`lowered_training_module`; raises what it raises."""
    mod, tg = lowered_training_module(model, batch, trainable, optimizer, winograd, budget_plan,
                                      tg, precision, loss_scale)
    scratch = kernel_scratch(mod, target, database) if database is not None else None
    return step_memory(mod, tg, steps, scratch)


def kernel_scratch(mod: tvm.IRModule, target: tvm.target.Target, database) -> dict:
    """The scratch buffers each kernel of ``mod`` allocates in global memory once the records
    of ``database`` (a MetaSchedule database) for ``target`` are applied: {kernel name: [bytes
    per buffer]}, for the kernels a record changed that allocate any (an ``rfactor``'s partial
    sums, a padded copy of an input: blocks' ``alloc_buffers`` in global scope, which the
    kernel's host code takes from the device's workspace pool at each call). The default
    schedules of the others allocate none."""
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms  # noqa: F401 (registers ApplyDatabase)
    before = dict(mod.functions)
    with target, database, tvm.transform.PassContext(opt_level=3):
        applied = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
    out = {}
    for gv, func in applied.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc) or tvm_ffi.structural_equal(
                func, before.get(gv)):
            continue
        sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
        todo, sizes = [sch.get_sblock("root")], []
        while todo:
            rv = todo.pop()
            sizes += [int(np.prod([int(x) for x in b.shape], dtype=np.int64))
                      * tvm.runtime.DataType(str(b.dtype)).bits // 8
                      for b in sch.get(rv).alloc_buffers if b.scope() == "global"]
            todo.extend(sch.get_child_blocks(rv))
        if sizes:
            out[gv.name_hint] = sizes
    return out


def trade_records(mod: tvm.IRModule, tg, scratch: dict, budget_bytes: int, record_gain,
                  steps: int = 3) -> tuple[StepMemory | None, dict]:
    """Leave out records of the kernels of ``mod`` with scratch buffers (``scratch``,
    :func:`kernel_scratch`) until the step (:func:`step_memory`) fits ``budget_bytes``: the
    records whose kernels' default schedules lose the fewest milliseconds per byte of scratch
    first, then each of those put back (the costliest first) where the step still fits without
    it. ``record_gain({workload key: IRModule})`` gives ms per call a record saves over its
    kernel's default schedule as timed on the device; a record it gives no time for is never
    left out (what it would cost is not known). Returns the step's memory once it fits (None
    when it does not with every tradeable record left out) and the records left out:
    {workload key: {"kernel": name, "scratch_bytes": bytes, "ms_added": ms per step (calls per
    step x ms per call)}}."""
    from .manifest import TRAIN_STEP, TRAIN_STEP_FROZEN
    from .tasks import callees, workload_key, workload_module
    calls: Counter = Counter()  # kernel calls per step, of the step's functions
    for gv, func in mod.functions.items():
        if gv.name_hint in (TRAIN_STEP, TRAIN_STEP_FROZEN):
            calls.update(callees(func))
    keys = {name: workload_key(mod[name]) for name in scratch}
    gain = record_gain({keys[n]: workload_module(mod[n]) for n in scratch})
    cost = {n: max(gain[keys[n]], 0.0) * max(calls[n], 1) for n in scratch if keys[n] in gain}

    def without(names: list[str]) -> StepMemory:
        return step_memory(mod, tg, steps, {n: v for n, v in scratch.items() if n not in names})

    left: list[str] = []
    mem = None
    for name in sorted(cost, key=lambda n: cost[n] / sum(scratch[n])):
        left.append(name)
        mem = without(left)
        if mem.peak <= budget_bytes:
            break
    else:
        return None, {}
    for name in sorted(left, key=lambda n: -cost[n]):  # put back what the fit does not need
        trial = [n for n in left if n != name]
        again = without(trial)
        if again.peak <= budget_bytes:
            left, mem = trial, again
    return mem, {keys[n]: {"kernel": n, "scratch_bytes": int(sum(scratch[n])),
                           "ms_added": cost[n]} for n in left}


def plan_for_budget(model, batch: int, trainable: str, optimizer, budget_bytes: int,
                    winograd=None, say=lambda m: None, precision: str = "float32",
                    loss_scale=None, database=None, target=None, record_gain=None
                    ) -> tuple[RecomputePlan, list[dict]]:
    """The cheapest plan of :data:`LEVELS` whose compiled step at ``precision`` (with
    ``loss_scale``, :func:`step_graph`) fits ``budget_bytes`` (peak device bytes by
    :func:`compiled_step_memory`; with ``database`` and ``target``, the records an export
    applies, their kernels' scratch buffers counted), and the figures of every level tried
    (level, peak bytes, bytes saved, FLOPs added, tensors recomputed, bytes of forward
    tensors the backward still reads: ``kept_bytes``; ``records_left_out``, below). The levels
    are tried in order, the phases of one segment length together (``segments:k@p``,
    :mod:`thomas_tune.recompute`): of the first group with a plan that fits, the fitting one
    that adds the fewest FLOPs, then the fewest ms of records left out. With ``record_gain``
    (:func:`trade_records`), a level over the budget with its kernels' scratch buffers may fit
    with records of scratch-heavy kernels left out (their kernels then run their default
    schedules): the level's ``records_left_out`` names them, which the build must leave out.
    Raises :class:`BudgetError` (a ValueError) when no level fits; its message names the
    smallest budget that does, in MB (10^6 bytes), and it holds the levels tried."""
    from .training_graph.graph import ADJOINT, training_module
    from .memory import _liveness_peak
    from .recompute import segment_of
    tried, base = [], None
    tg = training_module(model, batch, trainable, optimizer)
    groups: dict = {}
    for level in LEVELS:  # none, elementwise, then one group per segment length
        groups.setdefault((segment_of(level) or (level,))[0], []).append(level)
    for levels in groups.values():
        fits = []
        for level in levels:
            plan = RecomputePlan(level)
            mod, planned = lowered_training_module(model, batch, trainable, optimizer,
                                                   winograd, plan, tg, precision, loss_scale)
            scratch = kernel_scratch(mod, target, database) if database is not None else None
            mem = step_memory(mod, planned, scratch=scratch)
            base = mem.peak if base is None else base
            left = {}
            if mem.peak > budget_bytes and scratch and record_gain is not None:
                traded, left = trade_records(mod, planned, scratch, budget_bytes, record_gain)
                mem = traded or mem
            tried.append({"level": level, "peak_bytes": mem.peak,
                          "saved_bytes": base - mem.peak, "flops_added": plan.flops_added,
                          "recomputed": len(plan.recomputed),
                          "kept_bytes": _liveness_peak(planned.mod[ADJOINT])[1],
                          "records_left_out": left})
            say(f"{level}: {mem.peak / 1e6:.1f} MB" + (
                f" with {len(left)} tuning record(s) of kernels with scratch buffers left out"
                if left else ""))
            if mem.peak <= budget_bytes:
                fits.append((plan.flops_added, sum(v["ms_added"] for v in left.values()),
                             mem.peak, plan))
        if fits:
            return min(fits, key=lambda f: f[:3])[3], tried
    least = min(tried, key=lambda t: t["peak_bytes"])
    smallest = least["peak_bytes"]
    raise BudgetError(
        f"no recomputation plan fits a memory budget of {budget_bytes / 1e6:.1f} MB: the "
        f"smallest step ({least['level']} recomputation) needs "
        f"{-(-smallest // 10**5) / 10:.1f} MB; give --memory-budget "
        f"{-(-smallest // 10**5) / 10:.1f} or more, a smaller --batch, or train fewer layers "
        "(--trainable last:K)", smallest, tried)
