"""Activation gradients stored as float16, with dynamic loss scaling (``export --precision
mixed16 --loss-scale dynamic``).

Plain mixed16 (:mod:`thomas_tune.half_storage`) stores the forward's layer outputs as float16
and keeps the backward in float32. Here the backward's activation gradients are stored as
float16 too, the way the forward's layer outputs are: each rounded to float16 once where it is
made, read back as float32 by every kernel that uses it (its own cast before each use, fused
into the reader where the reader is element-wise), arithmetic in float32. Which tensors: every
value of the backward (after the first ``*_adjoint`` binding of the step's adjoint) that a call
makes, float32, of two axes or more, whose first axis is the batch: the gradients of the layer
outputs (convolutions' data gradients, the BatchNorms' input gradients, the residual sums of
gradients, the dropout's and pooling's) and the loss's own logits gradient. The backward's
convolutions and depthwise gradient kernels read their stored operands in float16 directly
(:meth:`_GradRounder.reads`: otherwise fusion puts a non-fusing reader's float32 cast into the
kernel that makes the gradient, which then stores float32). Not stored in half: the parameter
gradients (a value named ``<parameter>_adjoint``, or of a parameter's shape),
views (``reshape``), the master weights, the optimizer state, the BatchNorm statistics and the
loss.

Float16 holds magnitudes from 2^-24 to 65,504 only, and activation gradients are small (the
loss's gradient is a mean over the batch): most would flush to zero. The loss's gradient is
therefore multiplied by a loss scale ``S`` (:func:`scale_loss_gradient`: the step's last input
``loss_scale``, 0-d float32), every gradient of the backward is ``S`` times the true one, and
the optimizer unscales the parameter gradients and skips a step whose gradients are not finite
(:mod:`thomas_tune.training_graph.loss_scaled`); the host chooses ``S`` as PyTorch's GradScaler
does (:mod:`thomas_tune.loss_scale`).

The step then holds float16 tensors on both sides of the turn from forward to backward, so the
storages the backward frees are the size of those it takes (:mod:`thomas_tune.storage_merge`):
what plain mixed16 could not reach (docs/journal/memory.md).
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax

from .half_storage import _Rounder, rewritten, round_stored
from .manifest import ADJOINT, FEATURES, HEAD_ADJOINT, OPTIMIZER, PREDICT

#: the step's input that scales the loss's gradient
LOSS_SCALE_INPUT = "loss_scale"
#: convolutions of the backward that read their stored operands (the forward's layer output, the
#: activation gradient) in float16 directly, the arithmetic in float32 (:meth:`_GradRounder.reads`)
HALF_INPUT_OPS = frozenset({"relax.nn.conv2d", "relax.nn.conv2d_transpose"})
#: views: their values are those of their input, stored already
VIEW_OPS = frozenset({"relax.reshape"})


def _loss_call(func: relax.Function) -> relax.Var:
    """The variable of the loss kernel's call in ``func`` (``call_tir`` of a PrimFunc named
    ``cross_entropy``, :mod:`thomas_tune.training_graph.loss`). Raises ValueError without one."""
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if (isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op)
                    and v.op.name == "relax.call_tir" and isinstance(v.args[0], tvm.ir.GlobalVar)
                    and v.args[0].name_hint.startswith("cross_entropy")):
                return b.var
    raise ValueError("loss scaling: the step has no cross-entropy loss kernel to scale")


def scale_loss_gradient(func: relax.Function) -> relax.Function:
    """The step's adjoint ``func`` taking one more input, ``loss_scale`` (0-d float32, last),
    by which the loss kernel's gradients (its outputs 1, the logits' gradient, and 2, its sum
    over the batch: the classifier bias's gradient) are multiplied where the backward reads
    them: every gradient of the step is then ``loss_scale`` times the float32 step's. Raises
    ValueError when ``func`` reads neither gradient of a loss kernel."""
    loss = _loss_call(func)
    scale = relax.Var(LOSS_SCALE_INPUT, relax.TensorType((), "float32"))
    bb = relax.BlockBuilder()
    blocks, scaled = [], 0
    for block in func.body.blocks:
        dataflow = isinstance(block, relax.DataflowBlock)
        out = []
        for b in block.bindings:
            v = b.value
            if (isinstance(v, relax.TupleGetItem) and v.tuple_value.same_as(loss)
                    and v.index in (1, 2)):
                raw = (relax.DataflowVar if dataflow else relax.Var)(
                    f"{b.var.name}_unscaled", b.var.ty)
                out.append(relax.VarBinding(raw, v))
                b = relax.VarBinding(b.var, bb.normalize(relax.op.multiply(raw, scale)))
                scaled += 1
            out.append(b)
        blocks.append(relax.DataflowBlock(out) if dataflow else relax.BindingBlock(out))
    if not scaled:
        raise ValueError("loss scaling: the step reads no gradient of its loss kernel")
    return relax.Function([*func.params, scale], relax.SeqExpr(blocks, func.body.body),
                          func.ret_ty, func.is_pure, func.attrs)


class _GradRounder(_Rounder):
    """:class:`thomas_tune.half_storage._Rounder` that stores the backward's activation
    gradients as float16 too (module docstring)."""

    def __init__(self, batch: int, params):
        super().__init__(batch, params)
        self.depthwise: dict = {}  # forward depthwise conv2d calls by weight and data var
        self.alias: dict = {}  # var -> the var it is bound to (note_convs)
        # (the gradient pass names them after the parameter, dots as underscores)
        self.param_grads = {f"{p.name}_adjoint".replace(".", "_") for p in params}
        self.param_shapes = {tuple(int(d) for d in p.ty.shape.values) for p in params
                             if isinstance(p.ty, relax.TensorType) and p.ty.shape is not None}

    def note_convs(self, func: relax.Function) -> None:
        """Record ``func``'s depthwise convolutions (by weight and by data variable), whose
        backward kernels :meth:`reads` builds again for float16 operands, and its aliases: a
        variable bound to another, or to a field of a tuple of variables (the gradient pass
        passes a kernel's result on so: ``t = (dx, ...)``, ``x_adjoint = t[0]``)."""
        from .training_graph.gradients import is_depthwise
        tuples = {}
        for block in func.body.blocks:
            for b in block.bindings:
                v = b.value
                if isinstance(v, relax.Call) and getattr(v.op, "name", "") == "relax.nn.conv2d" \
                        and is_depthwise(v):
                    self.depthwise[v.args[1]] = v
                    self.depthwise[v.args[0]] = v
                elif isinstance(v, relax.Tuple):
                    tuples[b.var] = v
                elif isinstance(v, relax.Var):
                    self.alias[b.var] = v
                elif isinstance(v, relax.TupleGetItem) and v.tuple_value in tuples:
                    field = tuples[v.tuple_value].fields[v.index]
                    if isinstance(field, relax.Var):
                        self.alias[b.var] = field

    def _source(self, var):
        """The variable ``var`` aliases (:meth:`note_convs`), or ``var``."""
        while isinstance(var, relax.Var) and var in self.alias:
            var = self.alias[var]
        return var

    def reads(self, expr, dataflow: bool, out: list) -> relax.Expr:
        """As :meth:`thomas_tune.half_storage._Rounder.reads`; in the backward, a depthwise
        convolution's gradient kernel (:meth:`_half_depthwise`) and a convolution
        (:meth:`_half_conv`) read their stored operands in float16 directly, not float32 copies:
        a float32 copy read by a kernel that fuses nothing is made in the kernel that makes the
        gradient, which then stores float32 (FuseOps fuses the rounding and the read-back cast
        into it)."""
        op = getattr(expr.op, "name", "") if isinstance(expr, relax.Call) else ""
        call = None
        if not self.in_forward and op == "relax.call_tir":
            call = self._half_depthwise(expr, dataflow, out)
        elif not self.in_forward and op in HALF_INPUT_OPS:
            call = self._half_conv(expr, dataflow, out)
        return call if call is not None else super().reads(expr, dataflow, out)

    def _halves(self, args, dataflow: bool, out: list):
        """Per argument, its float16 twin where it is stored, else it read as
        :meth:`thomas_tune.half_storage._Rounder.reads` reads it; None where none is stored."""
        halves = [self.half_of(self._source(a)) for a in args]
        if all(h is None for h in halves):
            return None
        return [h if h is not None else super(_GradRounder, self).reads(a, dataflow, out)
                for h, a in zip(halves, args)]

    def _half_conv(self, expr, dataflow: bool, out: list):
        """A backward convolution (``conv2d``: a weight gradient; ``conv2d_transpose``: a data
        gradient) reading its stored operands in float16, its result float32."""
        ins = self._halves(expr.args[:2], dataflow, out)
        if ins is None:
            return None
        a = expr.attrs
        if expr.op.name == "relax.nn.conv2d":
            call = relax.op.nn.conv2d(*ins, a.strides, a.padding, a.dilation, a.groups,
                                      a.data_layout, a.kernel_layout, a.out_layout, "float32")
        else:
            call = relax.op.nn.conv2d_transpose(
                *ins, a.strides, a.padding, a.output_padding, a.dilation, a.groups,
                a.data_layout, a.kernel_layout, a.out_layout, "float32")
        return self.bb.normalize(call)

    def _half_depthwise(self, expr, dataflow: bool, out: list):
        """A depthwise convolution's gradient kernel (``call_tir`` of ``depthwise_data_grad``
        or ``depthwise_weight_grad``, :mod:`thomas_tune.training_graph.gradients`) built again
        from its TE compute with its stored operands read in float16 (each element converted to
        float32 as it is loaded, :func:`_as_float32`), the strides, padding and dilation those
        of its forward convolution (:meth:`note_convs`); None for another call, or where no
        operand is stored."""
        from .training_graph import gradients as GR
        name = expr.args[0].name_hint
        kind = next((k for k in ("depthwise_data_grad", "depthwise_weight_grad")
                     if name.startswith(k)), None)
        args = list(expr.args[1].fields)
        key = self._source(args[1] if kind == "depthwise_data_grad" else args[0])
        conv = self.depthwise.get(key) if kind else None
        ins = self._halves(args, dataflow, out) if conv is not None else None
        if ins is None:
            return None
        at = conv.attrs
        strides, dilation = [int(v) for v in at.strides], [int(v) for v in at.dilation]
        padding = [int(v) for v in at.padding]
        if kind == "depthwise_data_grad":
            hw = [int(v) for v in conv.args[0].ty.shape.values][2:]
            te_func = _as_float32(GR.depthwise_data_grad_te)
            extra = (hw, strides, padding, dilation)
        else:
            kernel = [int(v) for v in conv.args[1].ty.shape.values][2:]
            te_func = _as_float32(GR.depthwise_weight_grad_te)
            extra = (kernel, strides, padding, dilation)
        return self.bb.normalize(self.bb.call_te(te_func, *ins, *extra,
                                                 primfunc_name_hint=f"{kind}_half"))

    def stores(self, b, forward: bool) -> bool:
        if super().stores(b, forward):
            return True
        return not forward and self.is_activation_gradient(b)

    def is_activation_gradient(self, b) -> bool:
        """Whether backward binding ``b`` makes an activation gradient (module docstring)."""
        v, ty = b.value, b.var.ty
        if not isinstance(v, relax.Call) or not isinstance(ty, relax.TensorType):
            return False
        if isinstance(v.op, tvm.ir.Op) and v.op.name in VIEW_OPS:
            return False
        if ty.dtype != "float32" or ty.ndim < 2 or ty.shape is None:
            return False
        shape = ty.shape.values
        if not all(isinstance(d, tvm.tirx.IntImm) for d in shape) or int(shape[0]) != self.batch:
            return False
        return (b.var.name not in self.param_grads
                and tuple(int(d) for d in shape) not in self.param_shapes)


def _as_float32(te_func):
    """``te_func`` (a TE compute of float32 tensors) taking its first two tensors of any float
    dtype, each read as float32 (a cast stage, inlined by the build)."""
    from tvm import te

    def wrapped(a, b, *rest):
        def f32(t):
            if t.dtype == "float32":
                return t
            return te.compute(t.shape, lambda *i: t(*i).astype("float32"), name=f"{t.name}_f32")
        return te_func(f32(a), f32(b), *rest)
    return wrapped


def round_gradients(func: relax.Function, batch: int) -> tuple[relax.Function, dict]:
    """The step's adjoint ``func`` (its loss gradient scaled, :func:`scale_loss_gradient`) with
    its forward's layer outputs and its backward's activation gradients stored as float16 and
    read back as float32 (module docstring); ``batch``: the step's batch size. Returns the
    function and the kernels it calls that are new (GlobalVar -> PrimFunc: the depthwise
    gradients reading float16)."""
    r = _GradRounder(batch, func.params)
    r.note_convs(func)
    out = rewritten(func, r) or func
    kernels = {gv: f for gv, f in r.bb.get().functions.items()
               if isinstance(f, tvm.tirx.PrimFunc)}
    return out, kernels


def rewrite_function(func: relax.Function, batch: int) -> relax.Function:
    """``func`` as :func:`apply_loss_scaling` rewrites it: a step's adjoint (it has a loss
    kernel) loss-scaled with its activation gradients stored as float16, a ``predict`` as
    plain mixed16's (the function rewrite :func:`thomas_tune.memory.training_memory` takes)."""
    try:
        _loss_call(func)
    except ValueError:
        return round_stored(func, batch)
    return round_gradients(scale_loss_gradient(func), batch)[0]


def _scaled_optimizer(tg, mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with ``OPTIMIZER`` replaced by the loss-scaled form of ``tg``'s optimizer
    (:func:`thomas_tune.training_graph.loss_scaled.loss_scaled_function`) and its kernels."""
    from .training_graph.graph import _add_functions
    from .training_graph.loss_scaled import loss_scaled_function
    plain = mod[OPTIMIZER]
    opt = tg.optimizer.build()
    params = [relax.Var(f"p{i}", t) for i, t in enumerate(plain.params[0].ty.fields)]
    opt.init(params)
    func = loss_scaled_function(opt, OPTIMIZER)
    own = tvm.IRModule({OPTIMIZER: func, **{gv: f for gv, f in opt.kernels.items()}})
    _add_functions(mod, own, OPTIMIZER, OPTIMIZER)
    return mod


def apply_loss_scaling(tg, batch: int):
    """The training graph ``tg`` (:class:`thomas_tune.training_graph.graph.TrainingGraph`, not
    changed) with half gradients and dynamic loss scaling: its adjoint's loss gradient scaled
    by the input ``loss_scale`` and its layer outputs and activation gradients stored as
    float16 (:func:`round_gradients`), its ``predict`` at ``batch`` images as plain mixed16's,
    its optimizer unscaling and skipping non-finite steps (returns ``skipped``). Raises
    ValueError for a graph with the cached-features split (built in float32 only)."""
    if tg.features is not None:
        raise ValueError("--loss-scale is built without --cache-features only: drop one of "
                         "the two")
    mod = tvm.IRModule(dict(tg.mod.functions), attrs=tg.mod.attrs)
    adj, kernels = round_gradients(scale_loss_gradient(mod[ADJOINT]), batch)
    mod[ADJOINT] = adj.with_attr("global_symbol", ADJOINT)
    for gv, f in kernels.items():
        mod[gv] = f
    mod[PREDICT] = round_stored(mod[PREDICT], batch)
    mod = _scaled_optimizer(tg, mod)
    entries = [f for f in (ADJOINT, OPTIMIZER, PREDICT, FEATURES, HEAD_ADJOINT)
               if f in [gv.name_hint for gv in mod.get_global_vars()]]
    mod = relax.transform.DeadCodeElimination(entries)(mod)
    return dataclasses.replace(tg, mod=mod)
