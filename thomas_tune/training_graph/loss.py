"""The training step's loss: softmax cross-entropy, averaged over the batch, in one kernel.

The generic form (``relax.training.loss.CrossEntropyLoss``: ``log_softmax`` then ``nll_loss``,
and their gradients) takes about ten kernel launches a step for what is, on a batch of logits,
a few microseconds of arithmetic; on a phone each launch costs more than that. Here one
kernel, :func:`cross_entropy`, computes the loss and its gradient with respect to the logits
``x`` (N, C) together:

* per row ``i``, the running maximum and the sum of ``exp(x_ij - max)`` in one pass, in 16
  lanes of a tuple reduction ("online softmax", Milakov & Gimelshein 2018,
  arXiv:1805.02867), joined pairwise into ``m_i`` and ``s_i``;
* ``loss = sum_i (m_i + log s_i - x_{i,y_i}) / N``;
* ``dx_ij = (exp(x_ij - m_i) / s_i - [j = y_i]) / N``, the gradient of the mean softmax
  cross-entropy (softmax minus the one-hot target) for a loss gradient of 1.

A training step's loss gradient is 1 (``Gradient`` seeds the loss with ones), so the backward
(registered as the gradient of the forward's ``call_tir_with_grad``, :data:`GRADIENT`) is the
forward's second output itself; any other loss gradient scales it in a kernel of its own.

On a CPU the kernel is its TE stages under the default schedules. On a GPU its stages are
four kernels once scheduled; :func:`gpu_kernel` writes it as one work-group instead (the
stages in turn, separated by barriers, their intermediates in local memory), which the build
puts in its place (``thomas_tune.compiler.compile``): one launch where the scheduled stages take
four. The same arithmetic as PyTorch's ``F.cross_entropy(x, y)`` (reduction "mean", no class
weights, every target counted): targets are class indices in ``[0, C)``; one outside it reads
outside the row, so the runtime checks labels against the model's classes before they reach
the device (``Session``).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax.training import loss as rloss

GRADIENT = "thomas_tune.cross_entropy"  # the te_grad_name of the forward's call_tir_with_grad
#: relax's pattern kind of an opaque kernel (``tvm.relax.transform.AnnotateTIROpPattern``):
#: the loss's kernel is fused with nothing, so that the build finds it whole
OPAQUE = 8


LANES = 16  # partial sums per row (below)


def _combine(a, b):
    """Two (running maximum, sum of exp(x - maximum)) pairs as one."""
    m = te.max(a[0], b[0])
    return m, a[1] * te.exp(a[0] - m) + b[1] * te.exp(b[0] - m)


def _lanes(x: te.Tensor):
    """(m, s), each (N, LANES): per row ``i`` and lane ``l`` the largest of the logits
    ``x[i, k * LANES + l]`` and the sum of their ``exp(x - m)``, in one tuple reduction
    ("online softmax", Milakov & Gimelshein 2018, arXiv:1805.02867). A float32 sum of C terms
    in one chain loses about sqrt(C) roundings (1,000 classes: 2e-6 of the sum, ten times
    PyTorch's on a CPU, whose sums run in vector lanes); sixteen chains of C/16 terms, joined
    pairwise by :func:`_row`, lose about a quarter of that, whatever the schedule. (A
    compensated sum would do better, but TVM's simplifier folds its error term away.)"""
    n, c = (int(d) for d in x.shape)
    dt = x.dtype
    low, one, zero = tvm.tirx.min_value(dt), tvm.tirx.const(1, dt), tvm.tirx.const(0, dt)

    def identity(t0, t1):  # the lowest finite value, so that exp(identity - m) is 0, not NaN
        return tvm.tirx.min_value(t0), tvm.tirx.const(0, t1)

    reducer = te.comm_reducer(_combine, identity, name="logsumexp")
    k = te.reduce_axis((0, -(-c // LANES)), "k")

    def body(i, lane):
        j = k * LANES + lane
        inside = j < c
        return reducer((te.if_then_else(inside, x[i, te.min(j, c - 1)], low),
                        te.if_then_else(inside, one, zero)), axis=k)

    return te.compute((n, LANES), body, name="ce_lanes")


def _row(lanes, i):
    """(m_i, s_i): row ``i``'s largest logit and sum of ``exp(x_ij - m_i)``, its lanes joined
    pairwise (an expression of 2 x LANES loads)."""
    m, s = lanes
    parts = [(m[i, lane], s[i, lane]) for lane in range(LANES)]
    while len(parts) > 1:
        parts = [_combine(parts[j], parts[j + 1]) if j + 1 < len(parts) else parts[j]
                 for j in range(0, len(parts), 2)]
    return parts[0]


def cross_entropy(x: te.Tensor, y: te.Tensor):
    """The mean softmax cross-entropy of logits ``x`` (N, C) float against class indices ``y``
    (N,) int, and its gradient: (loss, dx, dx_sum), the loss a 0-d tensor of ``x``'s dtype,
    ``dx`` (N, C) its gradient with respect to ``x`` for a loss gradient of 1 (module
    docstring) and ``dx_sum`` (C,) the sum of ``dx`` over the batch in a pairwise tree: the
    gradient of the bias of the layer that makes the logits (:func:`batch_sums`)."""
    n, c = (int(d) for d in x.shape)
    dt = x.dtype
    lanes = _lanes(x)
    row_max = te.compute((n,), lambda i: _row(lanes, i)[0], name="ce_row_max")
    row_sum = te.compute((n,), lambda i: _row(lanes, i)[1], name="ce_row_sum")
    j = te.reduce_axis((0, n), "j")
    inv_n = tvm.tirx.const(1.0 / n, dt)
    loss = te.compute((), lambda: te.sum(
        (row_max[j] + te.log(row_sum[j]) - x[j, y[j]]) * inv_n, axis=j), name="ce_loss")

    def grad(i, k):
        hit = tvm.tirx.Select(y[i] == k.astype(y.dtype), tvm.tirx.const(1, dt),
                              tvm.tirx.const(0, dt))
        return (te.exp(x[i, k] - row_max[i]) / row_sum[i] - hit) * inv_n

    dx = te.compute((n, c), grad, name="ce_dx")
    return loss, dx, te.compute((c,), lambda k: _pairwise([dx[i, k] for i in range(n)]),
                                name="ce_dx_sum")


def _pairwise(terms: list):
    """The sum of ``terms`` (expressions) as a pairwise tree: neighbours first, then the sums
    of neighbouring pairs, and so on (the order :func:`gpu_kernel` adds them in). A float32
    sum of n terms in a tree rounds about log2(n) times where a chain rounds n - 1 times
    (Higham 2002, "Accuracy and Stability of Numerical Algorithms", 2nd ed., sec. 4.2)."""
    while len(terms) > 1:
        terms = [terms[j] + terms[j + 1] if j + 1 < len(terms) else terms[j]
                 for j in range(0, len(terms), 2)]
    return terms[0]


#: the attribute that marks the loss's kernel (:func:`cross_entropy`) for :func:`gpu_kernel`
KERNEL_ATTR = "thomas_tune.loss"
#: local memory the one-work-group kernel may take, bytes: half the 32 KiB every full-profile
#: OpenCL device has (OpenCL 3.0 specification, ``CL_DEVICE_LOCAL_MEM_SIZE``)
LOCAL_BYTES = 16 * 1024
#: rows (batch) above which the loss keeps its scheduled stages on a GPU: a work-item holds a
#: column of this many values in registers for its pairwise sum
MAX_ROWS = 64


def gpu_kernel(func: tvm.tirx.PrimFunc, threads: int) -> tvm.tirx.PrimFunc | None:
    """The loss's kernel ``func`` (:func:`cross_entropy`, marked with :data:`KERNEL_ATTR`;
    arguments x (N, C) float, y (N,) int, loss (), dx (N, C), dx_sum (C,)) as one GPU
    work-group of ``threads`` work-items, scheduled (``tir.is_scheduled``): the rows' lanes,
    each lane by one work-item; a barrier; each row's maximum and sum from its lanes, joined
    pairwise in the order :func:`_row` joins them, by one work-item; a barrier; then each
    column of ``dx`` by one work-item (neighbouring work-items write neighbouring columns),
    which keeps the column in its registers and sums it over the rows in :func:`_pairwise`'s
    tree, and the loss by the first work-item (a sum over the rows in order). The same
    arithmetic as the scheduled stages but for the order of the loss's sum over the N rows.
    None when ``func`` is not the loss's kernel, its lanes and rows (136 bytes a row in
    float32) take more than :data:`LOCAL_BYTES`, or it has more than :data:`MAX_ROWS` rows."""
    from tvm.script import tirx as T

    if func.attrs is None or KERNEL_ATTR not in func.attrs or len(func.params) != 5:
        return None
    x_buf, y_buf = func.params[0], func.params[1]
    n, c = (int(d) for d in x_buf.shape)
    dt, yt = str(x_buf.dtype), str(y_buf.dtype)
    if (2 * LANES + 2) * n * tvm.DataType(dt).bits // 8 > LOCAL_BYTES or n > MAX_ROWS:
        return None
    nl, kk = n * LANES, -(-c // LANES)
    low = float(np.finfo(dt).min)
    levels = LANES.bit_length() - 1  # pairwise joins: LANES a power of two
    half = LANES // 2
    columns, total = _gpu_tail(n, c, dt, yt, threads)

    @T.prim_func
    def main(x: T.Buffer((n, c), dt), y: T.Buffer((n,), yt), loss: T.Buffer((), dt),
             dx: T.Buffer((n, c), dt), dx_sum: T.Buffer((c,), dt)):
        T.func_attr({"tir.is_scheduled": True, "tir.noalias": True})
        T.launch_thread("blockIdx.x", 1)
        tx = T.launch_thread("threadIdx.x", threads)
        lane_max = T.alloc_shared((nl,), dt)
        lane_sum = T.alloc_shared((nl,), dt)
        row_max = T.alloc_shared((n,), dt)
        row_sum = T.alloc_shared((n,), dt)
        acc = T.alloc_local((3,), dt)
        part_max = T.alloc_local((LANES,), dt)
        part_sum = T.alloc_local((LANES,), dt)
        column = T.alloc_local((n,), dt)
        for q in range((nl + threads - 1) // threads):
            if q * threads + tx < nl:
                acc[0] = T.Cast(dt, low)
                acc[1] = T.Cast(dt, 0)
                for k in range(kk):
                    if k * LANES + (q * threads + tx) % LANES < c:
                        acc[2] = T.max(acc[0], x[(q * threads + tx) // LANES,
                                                 k * LANES + (q * threads + tx) % LANES])
                        acc[1] = acc[1] * T.exp(acc[0] - acc[2]) + T.exp(
                            x[(q * threads + tx) // LANES, k * LANES + (q * threads + tx) % LANES]
                            - acc[2])
                        acc[0] = acc[2]
                lane_max[q * threads + tx] = acc[0]
                lane_sum[q * threads + tx] = acc[1]
        T.tvm_storage_sync("shared")
        for q in range((n + threads - 1) // threads):
            if q * threads + tx < n:
                for lane in T.unroll(LANES):
                    part_max[lane] = lane_max[(q * threads + tx) * LANES + lane]
                    part_sum[lane] = lane_sum[(q * threads + tx) * LANES + lane]
                for level in T.unroll(levels):
                    for a in T.unroll(half):
                        if a < half >> level:
                            acc[2] = T.max(part_max[a * (2 << level)],
                                           part_max[a * (2 << level) + (1 << level)])
                            part_sum[a * (2 << level)] = part_sum[a * (2 << level)] * T.exp(
                                part_max[a * (2 << level)] - acc[2]) + part_sum[
                                a * (2 << level) + (1 << level)] * T.exp(
                                part_max[a * (2 << level) + (1 << level)] - acc[2])
                            part_max[a * (2 << level)] = acc[2]
                row_max[q * threads + tx] = part_max[0]
                row_sum[q * threads + tx] = part_sum[0]
        T.tvm_storage_sync("shared")
        columns(x, y, row_max, row_sum, column, dx, dx_sum, tx)
        if tx == 0:
            total(x, y, row_max, row_sum, acc, loss)

    return main


def _gpu_tail(n: int, c: int, dt: str, yt: str, threads: int):
    """The last two stages of :func:`gpu_kernel` as TVMScript macros (inlined where they are
    called): ``columns``, each column of ``dx`` by one work-item, kept in its registers and
    summed over the rows in :func:`_pairwise`'s tree into ``dx_sum``; ``total``, the loss (a
    sum over the rows in order)."""
    from tvm.script import tirx as T

    inv_n = 1.0 / n
    row_levels = (n - 1).bit_length()  # levels of the pairwise sum over the rows

    @T.macro
    def columns(x, y, row_max, row_sum, column, dx, dx_sum, tx):
        for q in range((c + threads - 1) // threads):
            if q * threads + tx < c:
                for i in T.unroll(n):
                    column[i] = (T.exp(x[i, q * threads + tx] - row_max[i]) / row_sum[i]
                                 - T.Select(y[i] == T.Cast(yt, q * threads + tx), T.Cast(dt, 1),
                                            T.Cast(dt, 0))) * T.Cast(dt, inv_n)
                    dx[i, q * threads + tx] = column[i]
                for level in T.unroll(row_levels):
                    for a in T.unroll((n + 1) // 2):
                        if a * (2 << level) + (1 << level) < n:
                            column[a * (2 << level)] = column[a * (2 << level)] + column[
                                a * (2 << level) + (1 << level)]
                dx_sum[q * threads + tx] = column[0]

    @T.macro
    def total(x, y, row_max, row_sum, acc, loss):
        acc[0] = T.Cast(dt, 0)
        for i in range(n):
            acc[0] = acc[0] + (row_max[i] + T.log(row_sum[i]) - x[i, y[i]]) * T.Cast(
                dt, inv_n)
        loss[()] = acc[0]

    return columns, total


def one_group_kernels(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """``mod`` (fused, to be built for the GPU target ``target``) with each of the loss's kernels
    replaced by :func:`gpu_kernel` (work-groups of the target's ``max_threads_per_block``,
    at most 256) where it fits; every other function unchanged."""
    threads = min(256, int(target.attrs.get("max_threads_per_block", 256)))
    out = tvm.IRModule(mod.functions, attrs=mod.attrs)
    for gv, func in mod.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc):
            one = gpu_kernel(func, threads)
            if one is not None:
                out[gv] = one.with_attr("global_symbol", func.attrs["global_symbol"])
    return out


def scale(dloss: te.Tensor, dx: te.Tensor) -> te.Tensor:
    """``dloss`` (0-d) times ``dx`` (N, C): the logits' gradient for a loss gradient other
    than 1."""
    return te.compute(dx.shape, lambda i, k: dloss[()] * dx[i, k], name="ce_scale")


def _is_ones(expr, ctx) -> bool:
    """Whether ``expr`` is bound (through variables) to ``R.ones``."""
    while isinstance(expr, relax.Var):
        bound = ctx.lookup_binding(expr)
        if bound is None:
            return False
        expr = bound
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) \
        and expr.op.name == "relax.ones"


def _gradient(orig_var, call, output_grad, ctx):
    """The registered backward of the forward's ``call_tir_with_grad`` (arguments logits and
    targets; outputs the loss and its gradient for a loss gradient of 1): the forward's
    gradient itself where the loss's gradient is ``ones`` (a training step), else scaled by
    it; zeros for the integer targets (no gradient)."""
    _, y = call.args[1].fields
    grads = output_grad
    if isinstance(grads, relax.Var) and isinstance(ctx.lookup_binding(grads), relax.Tuple):
        grads = ctx.lookup_binding(grads)
    dloss = grads.fields[0] if isinstance(grads, relax.Tuple) else \
        ctx.emit(relax.TupleGetItem(output_grad, 0))
    dx = ctx.emit(relax.TupleGetItem(orig_var, 1))
    if not _is_ones(dloss, ctx):
        dx = ctx.emit_te(scale, dloss, dx, primfunc_name_hint="cross_entropy_scale")
    n = int(y.ty.shape.values[0])
    return ctx.emit(relax.Tuple([dx, relax.const(np.zeros((n,), str(y.ty.dtype)))]))


def batch_sums(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` (a training step's module after ``Gradient``) with each sum over the batch of
    the loss's logits gradient (``R.collapse_sum_to(dx, (C,))``: the gradient of the bias of
    the layer that makes the logits) replaced by the loss kernel's own ``dx_sum`` output
    (:func:`cross_entropy`): the same sum in a pairwise tree instead of a chain of N terms, and
    no kernel of its own. The logits gradient is recognised through the variables, tuples and
    tuple items that pass it on from the loss's call; a sum of anything else (a gradient
    scaled by a loss gradient other than 1) is left as it is."""
    kernels = {gv for gv, f in mod.functions.items()
               if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
               and KERNEL_ATTR in f.attrs}
    if not kernels:
        return mod
    call_tir = tvm.ir.Op.get("relax.call_tir")
    collapse = tvm.ir.Op.get("relax.collapse_sum_to")
    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        bound = {b.var: b.value for block in func.body.blocks for b in block.bindings
                 if isinstance(b, relax.VarBinding)}

        def source(expr):
            """(loss call's variable, output index) that ``expr`` passes on, or None."""
            while True:
                if isinstance(expr, relax.Var) and expr in bound:
                    expr = bound[expr]
                elif isinstance(expr, relax.TupleGetItem):
                    tup = expr.tuple_value
                    while isinstance(tup, relax.Var) and isinstance(bound.get(tup), (
                            relax.Tuple, relax.Var)):
                        tup = bound[tup]
                    if isinstance(tup, relax.Tuple):
                        expr = tup.fields[expr.index]
                        continue
                    call = bound.get(tup) if isinstance(tup, relax.Var) else None
                    if (isinstance(call, relax.Call) and call.op.same_as(call_tir)
                            and call.args[0] in kernels):
                        return tup, expr.index
                    return None
                else:
                    return None

        blocks, changed = [], False
        for block in func.body.blocks:
            bindings = []
            for b in block.bindings:
                v = b.value if isinstance(b, relax.VarBinding) else None
                if (isinstance(v, relax.Call) and v.op.same_as(collapse)
                        and len(v.ty.shape.values) == 1):
                    src = source(v.args[0])
                    if src is not None and src[1] == 1:
                        b = relax.VarBinding(b.var, relax.TupleGetItem(src[0], 2))
                        changed = True
                bindings.append(b)
            blocks.append(relax.DataflowBlock(bindings) if isinstance(block, relax.DataflowBlock)
                          else relax.BindingBlock(bindings))
        if changed:
            out[gv] = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body),
                                     func.ret_ty, func.is_pure, func.attrs)
    return out


def register() -> None:
    """Register :func:`_gradient` under :data:`GRADIENT`; safe to call twice."""
    handler = "tvm.relax.te_grad._register." + GRADIENT
    if tvm.get_global_func(handler, allow_missing=True) is None:
        tvm.register_global_func(handler, _gradient)


class CrossEntropyLoss(rloss.Loss):
    """The mean softmax cross-entropy as a ``relax.training`` loss (for ``SetupTrainer``):
    ``(predictions (N, C) float, targets (N,) int64) -> loss ()``, one ``call_tir_with_grad``
    of :func:`cross_entropy`. Its kernel must be in the module the loss is appended to:
    :meth:`add_kernel` puts it there."""

    def __init__(self, predictions: relax.TensorType, targets: relax.TensorType):
        super().__init__("cross_entropy_loss", 1, "mean")
        register()
        self.predictions, self.targets = predictions, targets
        x = te.placeholder([int(d) for d in predictions.shape.values], str(predictions.dtype),
                           "x")
        y = te.placeholder([int(d) for d in targets.shape.values], str(targets.dtype), "y")
        self.kernel = te.create_prim_func([x, y, *cross_entropy(x, y)]).with_attrs(
            {"global_symbol": "cross_entropy", KERNEL_ATTR: True, "op_pattern": OPAQUE})
        self.gv = relax.BlockBuilder().add_func(self.kernel, "cross_entropy")  # typed

    def add_kernel(self, mod: tvm.IRModule) -> tvm.IRModule:
        """``mod`` with the forward kernel under this loss's GlobalVar."""
        out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
        out[self.gv] = self.kernel
        return out

    def __call__(self, predictions=None, targets=None, weights=None) -> relax.Function:
        """The loss function ``cross_entropy_loss(predictions, targets) -> ()``, of the types
        given at construction (``SetupTrainer`` passes the same ones). Raises ValueError for
        class ``weights``, which this loss does not take."""
        if weights is not None:
            raise ValueError("CrossEntropyLoss: class weights are not supported")
        p = relax.Var("predictions", self.predictions)
        t = relax.Var("targets", self.targets)
        bb = relax.BlockBuilder()
        with bb.function(self._loss_name, [p, t]):
            with bb.dataflow():
                dt = str(self.predictions.dtype)
                n, c = (int(d) for d in self.predictions.shape.values)
                out = bb.emit(relax.call_tir_with_grad(
                    self.gv, relax.Tuple([p, t]),
                    [relax.TensorType((), dt), relax.TensorType((n, c), dt),
                     relax.TensorType((c,), dt)],
                    te_grad_name=GRADIENT))
                loss = bb.emit_output(relax.TupleGetItem(out, 0))
            bb.emit_func_output(loss)
        return bb.get()[self._loss_name]
