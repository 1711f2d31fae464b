"""Native half arithmetic (``--precision autocast16``) for devices that report ``cl_khr_fp16``.

The arithmetic of PyTorch's automatic mixed precision with ``dtype=torch.float16`` (autocast
float16, in PyTorch's terms), restricted to where autocast computes in float16:

* each convolution and matrix product of the forward pass takes float16 operands (its input
  activation and its weight, each rounded to float16 once), multiplies and sums in float32
  (``out_dtype`` float32: the product of two float16 values is exact in float32, so this is
  float16 multiplication with float32 accumulation) and rounds its result to float16, the
  dtype autocast gives it;
* the element-wise operators autocast runs in their inputs' dtype (``add``, ``relu``,
  ``clip`` for ReLU6, ``max_pool2d``, ``reshape``, ``permute_dims``) compute in float16 where
  their operands are float16 values of the forward pass; a per-channel float32 operand (a
  bias, a folded BatchNorm's shift) is rounded to float16 first, as autocast casts a
  convolution's bias;
* BatchNorm's statistics, averaging pools (whose sums TVM would accumulate in float16), the
  dropout masks and the loss compute in float32 on the float16 values read back, and their
  outputs are rounded to float16 (:data:`thomas_tune.half_storage.STORED_OPS`);
* master weights, their gradients, the optimizer state and BatchNorm's running statistics
  stay float32. The backward pass computes in float32 from the forward pass's float16 values
  (its weights and activations read back from their float16 copies, so the gradients are those
  of the rounded forward function); its gradients are never float16 (autocast computes them
  in float16 and needs ``GradScaler``'s loss scaling; with float32 gradients nothing can
  underflow, so no loss scaling is needed).

:func:`autocast_function` rewrites a Relax function after its gradient is built, as
:func:`thomas_tune.half_storage.round_stored` does. The OpenCL C of such a module holds
``half`` values, pointers and arithmetic; it is built in the *native* form (no
``vload_half`` / ``vstore_half`` rewrite: :func:`thomas_tune.kernel_signature.native_half`),
which an OpenCL compiler accepts only with ``cl_khr_fp16`` (OpenCL C 3.0 specification,
section 6.1.1.1: without it ``half`` is a storage format only). :func:`fp16_evidence` says
whether the device reports the extension, from a device profile (``thomas-tune rpc probe``),
the driver's extension list read from a device server (``--target opencl:remote``), or the
target's device family (:data:`FP16_DEVICE_FAMILIES`); :func:`require_fp16` refuses the
precision otherwise, naming the extension and the fix (``--precision mixed16``).
"""

from __future__ import annotations

import contextlib

import tvm
from tvm import relax

from .half_storage import _Rounder, map_functions, rewritten
from .limits import profile_reports_fp16

#: the precision name (``export --precision``): autocast float16
AUTOCAST16 = "autocast16"
#: the OpenCL extension whose report the native form needs
EXTENSION = "cl_khr_fp16"
#: OpenCL target ``device`` families whose drivers report ``cl_khr_fp16``: Adreno's (the
#: Adreno 540 of ``targets/adreno540_opencl.json`` reports it and computes float16 at twice
#: its float32 rate). A device profile or a server's extension list overrides this either way
#: (:func:`fp16_evidence`)
FP16_DEVICE_FAMILIES = ("adreno",)
#: Relax operators computed with float16 operands and float32 accumulation
PRODUCTS = frozenset({"relax.nn.conv2d", "relax.matmul"})
#: Relax operators autocast runs in their inputs' dtype: in float16 on float16 operands
IN_INPUT_DTYPE = frozenset({"relax.add", "relax.nn.relu", "relax.clip", "relax.nn.max_pool2d",
                            "relax.reshape", "relax.permute_dims"})
#: the attribute :func:`autocast_function` sets on a function: :func:`native_for` reads it
MARK_ATTR = "thomas_tune.half_arithmetic"


def _extension_list(text) -> list[str]:
    return str(text or "").split()


def fp16_evidence(target: tvm.target.Target, limits: dict | None = None,
                  profile: dict | None = None) -> tuple[bool, str]:
    """(whether the device of ``target`` reports ``cl_khr_fp16``, what says so), in order of
    precedence: a device profile ``profile`` (:func:`thomas_tune.rpc.probe.probe`: its
    ``extensions`` list, else its ``fp16`` found by building a kernel), the driver's extension
    list in ``limits`` (:func:`thomas_tune.target.device_limits` of a thomas_tune server),
    the target's ``device`` family (:data:`FP16_DEVICE_FAMILIES`). An ``llvm`` target
    computes float16 as LLVM's ``half`` type on the CPU (each operation rounded to float16)
    and needs no extension; other target kinds are refused."""
    kind = target.kind.name
    if kind == "llvm":
        return True, "an llvm target: LLVM computes float16 on the CPU, no OpenCL extension"
    if kind != "opencl":
        return False, f"a {kind} target: autocast16 is built for OpenCL (and llvm) only"
    if profile is not None:
        props, sources = profile.get("properties", {}), profile.get("sources", {})
        where = f"the device profile of key {profile.get('key')!r}"
        has = profile_reports_fp16(props)
        if has is not None and "extensions" in props:
            return has, f"{where}: its extension list {'has' if has else 'lacks'} {EXTENSION}"
        if has is not None:
            return has, f"{where}: {sources.get('fp16', 'fp16')}"
    info = (limits or {}).get("opencl")
    if isinstance(info, dict) and "extensions" in info:
        has = EXTENSION in _extension_list(info["extensions"])
        return has, (f"the driver's extension list read from the device server "
                     f"{(limits or {}).get('device_name', '')!r} "
                     f"({'has' if has else 'lacks'} {EXTENSION})")
    family = str(target.attrs.get("device", "")) if "device" in target.attrs else ""
    if family in FP16_DEVICE_FAMILIES:
        return True, f"the target's device family {family!r}, whose OpenCL drivers report it"
    return False, (f"the target's device family {family or 'generic'!r} is not known to "
                   f"report it ({', '.join(FP16_DEVICE_FAMILIES)} are) and no device profile "
                   "or server extension list says it does")


def require_fp16(precision: str, target: tvm.target.Target, limits: dict | None = None,
                 profile: dict | None = None) -> str | None:
    """For ``precision`` :data:`AUTOCAST16`: the evidence line of :func:`fp16_evidence` when
    the device reports ``cl_khr_fp16``; raises ValueError naming the extension, the evidence
    and the fix (``--precision mixed16``, or a profile of a device that has it) when it does
    not. None for any other precision."""
    if precision != AUTOCAST16:
        return None
    has, why = fp16_evidence(target, limits, profile)
    if not has:
        raise ValueError(
            f"--precision {AUTOCAST16} computes in float16 on the device, which OpenCL C allows "
            f"only with the {EXTENSION} extension; {why}: use --precision mixed16 (float16 "
            "storage through vload_half / vstore_half, core OpenCL on every device), or give "
            f"--device-profile of a device whose extension list has {EXTENSION} (thomas-tune "
            "rpc probe)")
    return why


def refuse_without_fp16(precision: str, target: tvm.target.Target, limits: dict | None,
                        profile: dict | None, log, check_records: bool, say=print) -> None:
    """An export's check of ``precision`` before any work: for :data:`AUTOCAST16`,
    :func:`require_fp16` (ValueError without ``cl_khr_fp16``), and ValueError for a tuning
    ``log`` whose records would be checked (``check_records``): the check runs them on this
    machine's device, and a device without the extension cannot build them (the fix:
    ``--no-check``). The evidence goes to ``say``. Nothing for another precision."""
    why = require_fp16(precision, target, limits, profile)
    if why is None:
        return
    if log is not None and check_records and target.kind.name == "opencl":
        raise ValueError(f"--precision {AUTOCAST16}: the records of {log.path} would be checked "
                         f"on this machine's OpenCL device, which cannot build half arithmetic "
                         f"without {EXTENSION}; give --no-check to apply them unchecked (the "
                         "manifest's record_check says so), or export with --precision mixed16")
    say(f"--precision {AUTOCAST16}: the device reports {EXTENSION} ({why}); its OpenCL C "
        "keeps half arithmetic, which a device without the extension cannot build")


class _Autocast(_Rounder):
    """:func:`autocast_function`'s state: :class:`_Rounder`'s float16 twins (``half``: value
    -> its float16 var, read back as float32 before each float32 use), made here also for the
    operands of the products (weights, the input images)."""

    #: the products read float16 operands of their own (:meth:`_half_of`)
    direct_half_reads = False

    def _half_of(self, x: relax.Expr, dataflow: bool, out: list):
        """``x``'s float16 form: its twin, or ``x`` rounded now (a binding appended to
        ``out``; a variable's twin is kept, so later float32 uses read the rounded value)."""
        if isinstance(x, relax.Var):
            h = self.half_of(x)
            if h is not None:
                return h
            h = self._var(x, "float16", dataflow)
            out.append(relax.VarBinding(h, self.cast(x, "float16")))
            self.half[x] = h
            return h
        return self.cast(x, "float16")

    def _is_half(self, x) -> bool:
        return isinstance(x, relax.Var) and any(s.same_as(x) for s in self.half)

    def _per_channel(self, x) -> bool:
        """A float32 tensor whose first axis is not the batch (a bias, a folded shift)."""
        ty = getattr(x, "ty", None)
        if not isinstance(ty, relax.TensorType) or ty.dtype != "float32" or ty.shape is None:
            return False
        first = ty.shape.values[0] if ty.ndim >= 1 else None
        return not (isinstance(first, tvm.tirx.IntImm) and int(first) == self.batch)

    def half_form(self, b, dataflow: bool, out: list) -> bool:
        """Append ``b`` in its float16 form (module docstring) to ``out`` and record its twin;
        False (nothing appended) where ``b`` is not computed in float16."""
        v, ty = b.value, b.var.ty
        if not isinstance(v, relax.Call) or not isinstance(v.op, tvm.ir.Op):
            return False
        if not isinstance(ty, relax.TensorType) or ty.dtype != "float32":
            return False
        name = v.op.name
        tensors = [a for a in v.args if isinstance(getattr(a, "ty", None), relax.TensorType)]
        if any(a.ty.dtype != "float32" for a in tensors):
            return False
        if name in PRODUCTS:
            a16, w16 = (self._half_of(a, dataflow, out) for a in v.args[:2])
            if name == "relax.matmul":
                acc = relax.op.matmul(a16, w16, out_dtype="float32")
            else:
                at = v.attrs
                acc = relax.op.nn.conv2d(a16, w16, strides=at.strides, padding=at.padding,
                                         dilation=at.dilation, groups=at.groups,
                                         data_layout=at.data_layout,
                                         kernel_layout=at.kernel_layout,
                                         out_layout=at.out_layout, out_dtype="float32")
            wide = self._var(b.var, "float32", dataflow)
            out.append(relax.VarBinding(wide, self.bb.normalize(acc)))
            h = self._var(b.var, "float16", dataflow)
            out.append(relax.VarBinding(h, self.cast(wide, "float16")))
            self.half[b.var] = h
            return True
        if name not in IN_INPUT_DTYPE or not any(self._is_half(a) for a in tensors):
            return False
        if not all(self._is_half(a) or self._per_channel(a) for a in tensors):
            return False
        args = [self._half_of(a, dataflow, out) if any(a.same_as(t) for t in tensors) else a
                for a in v.args]
        h = self._var(b.var, "float16", dataflow)
        call = relax.Call(v.op, args, v.attrs, v.ty_args)
        out.append(relax.VarBinding(h, self.bb.normalize(call)))
        self.half[b.var] = h
        return True

    def before_result(self, func: relax.Function) -> None:
        """A parameter returned as it is stays the float32 master value."""
        self.half = {s: h for s, h in self.half.items()
                     if not any(s.same_as(p) for p in func.params)}


def autocast_function(func: relax.Function, batch: int) -> relax.Function:
    """``func`` (a step's adjoint or a ``predict`` function, its gradient already built; its
    images ``batch`` per call) with autocast float16's arithmetic (module docstring), marked
    with :data:`MARK_ATTR`. The function's results (loss, gradients, logits) are float32.
    A function with no product is returned as it is."""
    out = rewritten(func, _Autocast(batch, func.params))
    return func if out is None else out.with_attr(MARK_ATTR, True)


def autocast_module(mod: tvm.IRModule, batches: dict[str, int]) -> tvm.IRModule:
    """``mod`` with :func:`autocast_function` applied to each function named in ``batches``
    (name -> its batch size); each rewritten function is marked (:data:`MARK_ATTR`) to be
    built in the native form."""
    return map_functions(mod, batches, lambda func, batch: autocast_function(func, batch))


def rewrite_for(precision: str):
    """The function rewrite :func:`thomas_tune.half_storage.apply_precision` takes for
    ``precision``: :func:`autocast_function` for :data:`AUTOCAST16`, else None (its own).
    Raises ValueError for an unknown precision."""
    from .half_storage import check_precision
    if check_precision(precision) != AUTOCAST16:
        return None
    return lambda func, batch: autocast_function(func, batch)


def apply_precision(precision: str, train_mod: tvm.IRModule, infer_mod: tvm.IRModule,
                    batch: int, infer_batch: int) -> tuple[tvm.IRModule, tvm.IRModule]:
    """The training module (its ``train_adjoint`` and ``predict`` at ``batch`` images) and the
    inference module (``predict`` at ``infer_batch``) of a graph built at ``precision``
    (:func:`thomas_tune.half_storage.apply_precision` with :func:`rewrite_for`'s rewrite).
    Raises ValueError for an unknown precision."""
    from . import half_storage
    return half_storage.apply_precision(precision, train_mod, infer_mod, batch, infer_batch,
                                        rewrite=rewrite_for(precision))


def is_autocast(mod: tvm.IRModule) -> bool:
    """Whether a function of ``mod`` was made by :func:`autocast_function` (its mark is kept
    where the function is copied into another module, as the training library's is)."""
    return any(isinstance(f, relax.Function) and f.attrs is not None and MARK_ATTR in f.attrs
               for f in mod.functions.values())


def native_for(mod: tvm.IRModule):
    """The context to compile ``mod`` in: :func:`thomas_tune.kernel_signature.native_half`
    for an autocast16 module (its OpenCL C keeps its ``half`` arithmetic and the
    ``cl_khr_fp16`` pragma), none for any other."""
    from .kernel_signature import native_half
    return native_half() if is_autocast(mod) else contextlib.nullcontext()
