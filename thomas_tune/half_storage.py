"""Half-precision storage, single-precision arithmetic (``--precision mixed16``).

Mixed precision in the sense of PyTorch's automatic mixed precision (AMP), restricted to
*storage*: the activations a step keeps between kernels are held in device memory as float16,
every kernel reads them as float32 and computes in float32. Parameters (the master weights),
their gradients, the optimizer state, the BatchNorm statistics and the loss stay float32, and so
do the gradients of the activations (no loss scaling is needed: nothing of the backward pass is
stored in half, so no gradient can underflow half's range).

Which tensors: the *layer outputs* of the forward pass, each rounded to float16 once where it
is made, and read back as float32 by every kernel that uses it (forward or backward):

* the output of each convolution (before its BatchNorm), of each BatchNorm with its activation,
  of each residual ``add``, of each pooling, of each dropout and of the classifier (the logits);
* only tensors of the forward pass whose first axis is the batch (activations, not the per
  channel statistics).

:func:`round_stored` rewrites a Relax function after its gradient is built (so that no
gradient passes through a cast): ``y = layer(...)`` gains ``y16 = astype(y, float16)`` and
each later use of ``y`` reads ``astype(y16, float32)``, emitted just before that use. Fusion
(:func:`thomas_tune.tasks.fuse`) then puts the first cast into the kernel that makes ``y``,
which stores float16, and each second cast into the kernel that reads it where that kernel is
element-wise; where it is not (a convolution, a reduction), the cast is a kernel of its own
whose float32 copy lives only until its one reader has run. The step computes, in float32,
the same arithmetic on the rounded layer outputs (``tests/test_half_storage.py`` checks each
stored tensor and a small step's gradients against float64).

The kernels' OpenCL C reads and writes the float16 tensors through ``vload_half`` /
``vstore_half`` (:mod:`thomas_tune.half_source`).
"""

from __future__ import annotations

import re

import tvm
from tvm import relax

#: the precisions an export takes: float32 throughout, float16 storage of the layer outputs, or
#: autocast float16's arithmetic on a device with cl_khr_fp16 (:mod:`thomas_tune.half_arith`)
PRECISIONS = ("float32", "mixed16", "autocast16")
#: Relax operators whose result is a stored layer output (module docstring; and ``multiply`` by
#: a function input, a dropout mask). An inference-form BatchNorm's output (an ``add``) is stored
#: before its activation: rounding commutes with ReLU and ReLU6 (0 and 6 are float16 values)
STORED_OPS = frozenset({"relax.nn.conv2d", "relax.add", "relax.nn.max_pool2d",
                        "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d"})
#: activations stored again after their input was: the output of one of these, applied to a
#: stored layer output, is stored as float16 too (its values are float16 values already, as
#: rounding commutes with it), so that the stored tensor a convolution reads is the activation,
#: not a float32 one made from the stored BatchNorm output before it
ACTIVATION_OPS = frozenset({"relax.clip", "relax.nn.relu"})
#: convolutions of the forward pass that read a stored layer output as their data in float16
#: directly (each element converted to float32 as it is loaded, the arithmetic in float32), not
#: a float32 copy made by a kernel of its own before them. Those of the backward (the weight
#: gradients) read the copy, which lives only until they ran: their kernels stay the float32
#: step's, so its tuning records apply to them
HALF_INPUT_OPS = frozenset({"relax.nn.conv2d"})
#: kernels (``call_tir`` of these PrimFunc names, any suffix) whose result is a layer output:
#: a training-form BatchNorm with its activation (:mod:`models.batchnorm`)
STORED_KERNELS = ("bn_act",)


def check_precision(precision: str) -> str:
    """``precision`` when it is one of :data:`PRECISIONS`; ValueError naming them otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)} "
                         "(mixed16: activations stored as float16, arithmetic in float32; "
                         "autocast16: convolutions and matrix products on float16 operands, "
                         "for devices with cl_khr_fp16)")
    return precision


def _is_layer_output(value: relax.Expr, ty, batch: int, params, stored=()) -> bool:
    """Whether a binding's ``value`` (of type ``ty``) is a layer output of the forward pass
    (``params``: the function's parameters; ``stored``: the values stored so far, whose
    activation (:data:`ACTIVATION_OPS`) is stored too)."""
    if not isinstance(value, relax.Call) or not isinstance(ty, relax.TensorType):
        return False
    if ty.dtype != "float32" or ty.ndim < 2 or ty.shape is None:
        return False
    first = ty.shape.values[0]
    if not isinstance(first, tvm.tirx.IntImm) or int(first) != batch:
        return False
    name = value.op.name if isinstance(value.op, tvm.ir.Op) else ""
    if name == "relax.multiply":  # a dropout: by a mask, an input of the function
        return any(isinstance(a, relax.Var) and any(a.same_as(p) for p in params)
                   for a in value.args)
    if name in STORED_OPS:
        return True
    if name in ACTIVATION_OPS:
        return isinstance(value.args[0], relax.Var) and any(
            value.args[0].same_as(s) for s in stored)
    if name in ("relax.call_tir", "relax.call_tir_with_grad"):
        callee = value.args[0]
        return isinstance(callee, tvm.ir.GlobalVar) and any(
            re.fullmatch(rf"{k}\d*", callee.name_hint) for k in STORED_KERNELS)
    return False


@relax.expr_functor.mutator
class _Replace(relax.PyExprMutator):
    """Replaces variables by others (``table``: old -> new)."""

    def __init__(self, table: dict):
        super().__init__()
        self.table = table

    def visit_var_(self, op):
        return self.table.get(op, op)

    def visit_dataflow_var_(self, op):
        return self.table.get(op, op)


def _free_vars(expr) -> list:
    out = []

    def visit(e):
        if isinstance(e, relax.Var) and not any(e.same_as(v) for v in out):
            out.append(e)
    relax.analysis.post_order_visit(expr, visit)
    return out


class _Rounder:
    """The state of :func:`round_stored` over one function: the float16 twin of each stored
    value, and a counter for new names."""

    #: convolutions read their stored data in float16 (:data:`HALF_INPUT_OPS`) and
    #: activations of stored values are stored (:data:`ACTIVATION_OPS`)
    direct_half_reads = True
    #: whether :meth:`block` is rewriting the forward pass (:meth:`reads` of a convolution)
    in_forward = False

    def __init__(self, batch: int, params):
        self.batch = batch
        self.params = list(params)
        self.half: dict = {}  # stored var -> its float16 var
        self.count = 0
        self.bb = relax.BlockBuilder()

    def cast(self, x: relax.Expr, dtype: str) -> relax.Expr:
        return self.bb.normalize(relax.op.astype(x, dtype))

    def _var(self, like: relax.Var, dtype: str, dataflow: bool) -> relax.Var:
        self.count += 1
        ty = relax.TensorType(like.ty.shape, dtype)
        name = f"{like.name}_{'f16' if dtype == 'float16' else 'f32'}{self.count}"
        return relax.DataflowVar(name, ty) if dataflow else relax.Var(name, ty)

    def reads(self, expr, dataflow: bool, out: list) -> relax.Expr:
        """``expr`` reading the float32 casts of the stored values it uses, whose bindings are
        appended to ``out``; in the forward pass, a convolution of :data:`HALF_INPUT_OPS`
        whose data is a stored value reads its float16 twin directly, its result float32."""
        conv = self._half_input(expr, dataflow, out) if self.in_forward else None
        if conv is not None:
            return conv
        table = {}
        for v in _free_vars(expr):
            h = self.half_of(v)
            if h is not None:
                c = self._var(v, "float32", dataflow)
                out.append(relax.VarBinding(c, self.cast(h, "float32")))
                table[v] = c
        return _Replace(table).visit_expr(expr) if table else expr

    def _half_input(self, expr, dataflow: bool, out: list) -> relax.Expr | None:
        """``expr`` as a convolution reading its stored data in float16 (:meth:`reads`), or
        None where it is not such a convolution."""
        if not (self.direct_half_reads and isinstance(expr, relax.Call)
                and isinstance(expr.op, tvm.ir.Op) and expr.op.name in HALF_INPUT_OPS
                and isinstance(expr.args[0], relax.Var)):
            return None
        h = self.half_of(expr.args[0])
        if h is None:
            return None
        a = expr.attrs
        weight = self.reads(expr.args[1], dataflow, out)
        return self.bb.normalize(relax.op.nn.conv2d(
            h, weight, a.strides, a.padding, a.dilation, a.groups, a.data_layout,
            a.kernel_layout, a.out_layout, "float32"))

    def half_form(self, b, dataflow: bool, out: list) -> bool:
        """A forward binding ``b`` computed in float16 instead, its bindings appended to
        ``out``: True when done. Here never: storage only, arithmetic stays float32
        (:class:`thomas_tune.half_arith._Autocast` computes some ops in float16)."""
        return False

    def half_of(self, var) -> relax.Var | None:
        """The float16 twin of the stored value ``var`` (the same variable), or None."""
        return next((h for s, h in self.half.items() if s.same_as(var)), None)

    def stores(self, b, forward: bool) -> bool:
        """Whether binding ``b`` (``forward``: of the forward pass) is stored as float16: a
        layer output of the forward (:func:`_is_layer_output`)."""
        return forward and _is_layer_output(b.value, b.var.ty, self.batch, self.params,
                                             self.half if self.direct_half_reads else ())

    def before_result(self, func: relax.Function) -> None:
        """Called once the blocks of ``func`` are rewritten, before its result is read back."""

    def block(self, block, forward: bool):
        """``block`` rewritten (module docstring); ``forward``: still in the forward pass."""
        dataflow = isinstance(block, relax.DataflowBlock)
        out = []
        for b in block.bindings:
            if "_adjoint" in b.var.name:
                forward = False
            if forward and self.half_form(b, dataflow, out):
                continue
            self.in_forward = forward
            value = self.reads(b.value, dataflow, out)
            out.append(relax.VarBinding(b.var, value) if value is not b.value else b)
            if self.stores(b, forward):
                h = self._var(b.var, "float16", dataflow)
                out.append(relax.VarBinding(h, self.cast(b.var, "float16")))
                self.half[b.var] = h
        return (relax.DataflowBlock(out) if dataflow else relax.BindingBlock(out)), forward


def rewritten(func: relax.Function, r: _Rounder) -> relax.Function | None:
    """``func`` rewritten block by block by ``r`` (a :class:`_Rounder` made for it), its result
    read back as float32; None when ``r`` stored nothing in half."""
    blocks, forward = [], True
    for block in func.body.blocks:
        new, forward = r.block(block, forward)
        blocks.append(new)
    if not r.half:
        return None
    r.before_result(func)
    tail: list = []
    body = r.reads(func.body.body, False, tail)
    if tail:
        blocks.append(relax.BindingBlock(tail))
    out = relax.Function(func.params, relax.SeqExpr(blocks, body), func.ret_ty, func.is_pure,
                         func.attrs)
    return r.bb.normalize(out)


def round_stored(func: relax.Function, batch: int) -> relax.Function:
    """``func`` (a step's adjoint or a ``predict`` function, its gradient already built) with
    its layer outputs stored as float16 and read back as float32 (module docstring); ``batch``
    is its batch size (the first axis of the tensors that are activations). A function with no
    layer output is returned as it is."""
    return rewritten(func, _Rounder(batch, func.params)) or func


class _Keeping(_Rounder):
    """:class:`_Rounder` whose float16 twins are variables of the function, not of its
    dataflow blocks, so that its result can return them (:func:`returning_stored`)."""

    def _var(self, like: relax.Var, dtype: str, dataflow: bool) -> relax.Var:
        return super()._var(like, dtype, dataflow and dtype != "float16")


def returning_stored(func: relax.Function, batch: int) -> relax.Function:
    """``func`` rewritten as :func:`round_stored` rewrites it (the same bindings), returning
    the pair (``func``'s result, a tuple of the float16 tensors it stores, in the order they
    are made): the check-only form of a mixed16 step, whose stored values the step check's
    reference adopts where they are a float16 neighbour of its own
    (:mod:`thomas_tune.half_reference`). Raises ValueError when ``func`` stores nothing."""
    r = _Keeping(batch, func.params)
    blocks, forward = [], True
    for block in func.body.blocks:
        new, forward = r.block(block, forward)
        blocks.append(new)
    if not r.half:
        raise ValueError("returning_stored: the function stores no layer output in float16")
    tail: list = []
    body = r.reads(func.body.body, False, tail)
    if tail:
        blocks.append(relax.BindingBlock(tail))
    halves = list(r.half.values())
    body = relax.Tuple([body, relax.Tuple(halves)])
    ret = relax.TupleType([func.ret_ty, relax.TupleType([h.ty for h in halves])])
    out = relax.Function(func.params, relax.SeqExpr(blocks, body), ret, func.is_pure,
                         func.attrs)
    return r.bb.normalize(out)


def map_functions(mod: tvm.IRModule, batches: dict[str, int], rewrite) -> tvm.IRModule:
    """A copy of ``mod`` with ``rewrite(func, batch)`` applied to each function named in
    ``batches`` (function name -> its batch size); other functions as they are."""
    out = mod.clone() if hasattr(mod, "clone") else tvm.IRModule(mod.functions, attrs=mod.attrs)
    for name, batch in batches.items():
        gv = out.get_global_var(name)
        out[gv] = rewrite(out[gv], batch)
    return out


def round_module(mod: tvm.IRModule, batches: dict[str, int]) -> tvm.IRModule:
    """``mod`` with :func:`round_stored` applied to each function named in ``batches``
    (function name -> its batch size); other functions as they are."""
    return map_functions(mod, batches, round_stored)


def apply_precision(precision: str, train_mod: tvm.IRModule, infer_mod: tvm.IRModule,
                    batch: int, infer_batch: int, rewrite=None
                    ) -> tuple[tvm.IRModule, tvm.IRModule]:
    """The training module (its ``train_adjoint`` and ``predict`` at ``batch`` images) and the
    inference module (``predict`` at ``infer_batch``) of a graph built at ``precision``
    (:data:`PRECISIONS`): as they are for float32, else each of those functions rewritten by
    ``rewrite(func, batch)``: for mixed16 by default :func:`round_stored` (layer outputs
    stored as float16); autocast16's rewrite is
    :func:`thomas_tune.half_arith.autocast_function`, which
    :func:`thomas_tune.half_arith.apply_precision` passes. Raises ValueError for another
    precision, and for autocast16 without its rewrite."""
    return (training_precision(precision, train_mod, batch, rewrite),
            inference_precision(precision, infer_mod, infer_batch, rewrite))


def _rewrite(precision: str, rewrite):
    """``rewrite``, or :func:`round_stored` for mixed16 when it is None; ValueError for
    another precision without its rewrite."""
    if rewrite is not None:
        return rewrite
    if precision != "mixed16":
        raise ValueError(f"precision {precision!r} is built by thomas_tune.half_arith."
                         "apply_precision")
    return round_stored


def training_precision(precision: str, train_mod: tvm.IRModule, batch: int, rewrite=None
                       ) -> tvm.IRModule:
    """The training module of :func:`apply_precision` alone (its ``train_adjoint`` and
    ``predict`` at ``batch`` images rewritten for ``precision``; as it is for float32): what
    an export compiles into ``train.so``, and what :mod:`thomas_tune.memory_plan` plans the
    step's memory of. Raises ValueError as :func:`apply_precision`."""
    from .manifest import ADJOINT, PREDICT
    if check_precision(precision) == "float32":
        return train_mod
    return map_functions(train_mod, {ADJOINT: batch, PREDICT: batch},
                         _rewrite(precision, rewrite))


def inference_precision(precision: str, infer_mod: tvm.IRModule, infer_batch: int,
                        rewrite=None) -> tvm.IRModule:
    """The inference module of :func:`apply_precision` alone (its ``predict`` at
    ``infer_batch`` images rewritten for ``precision``; as it is for float32): what an export
    compiles into ``inference.so``. Raises ValueError as :func:`apply_precision`."""
    from .manifest import PREDICT
    if check_precision(precision) == "float32":
        return infer_mod
    return map_functions(infer_mod, {PREDICT: infer_batch}, _rewrite(precision, rewrite))
