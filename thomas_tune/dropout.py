"""Dropout masks drawn on the device: a counter-based generator in one kernel per mask.

A training step's dropout masks are inputs of ``train_adjoint``. Drawing them on the host and
copying them in costs every step a host draw and a host-to-device copy (AlexNet at batch 32:
two masks, 0.43 M values, 1.7 MB); ``draw_masks`` instead makes them where they are used, from
one 64-bit seed per step (a ``uint32`` tensor of shape (2,)), and only those 8 bytes cross.

The generator is counter based, as PyTorch's CUDA dropout (Philox; Salmon et al., "Parallel
random numbers: as easy as 1, 2, 3", SC 2011): element ``n`` of mask ``i`` is a hash of
``(seed, i, n)``, so every element is computed on its own and any schedule gives the same
mask. The hash is MurmurHash3's 32-bit finalizer ``fmix32`` (Appleby, 2011, public domain):

    key  = fmix32(seed[0] ^ fmix32((seed[1] + (i + 1) * 0x9E3779B9) mod 2^32))
    h    = fmix32((n + key) mod 2^32)            n: row-major index of the element
    u    = (h >> 8) * 2^-24                      uniform in [0, 1) on a 2^-24 grid
    mask = 1 / (1 - p) if u >= p else 0          inverted dropout, as torch.nn.functional.dropout

``fmix32`` is a bijection with full avalanche (each input bit flips each output bit with
probability about 1/2), which is what dropout needs; it is not a cryptographic generator.
The arithmetic is done in ``uint64`` with explicit ``mod 2^32``: this TVM's LLVM code
generator treats ``uint32`` overflow as impossible (``(x + c) * k`` gives other bits than
C's wrapping arithmetic), while no ``uint64`` value here ever exceeds 2^64.
:func:`mask_numpy` is the same function in numpy, the reference the tests compare with.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx

from .manifest import DRAW_MASKS

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35  # fmix32's multipliers (MurmurHash3)
_GOLDEN = 0x9E3779B9                # 2^32 / golden ratio: spreads the mask index over the key


def _u(v: int) -> tirx.PrimExpr:
    return tirx.const(v, "uint64")


def _let(value, body, name: str):
    var = tirx.Var(name, "uint64")
    return tirx.Let(var, value, body(var))


def _fmix32(h, tag: str):
    """fmix32 of ``h`` (a uint64 expression < 2^32); Let-bound so each step is computed once."""
    return _let(h, lambda a: _let(((a ^ (a >> _u(16))) * _u(_C1)) & _u(_M32), lambda b: _let(
        ((b ^ (b >> _u(13))) * _u(_C2)) & _u(_M32), lambda c: c ^ (c >> _u(16)), tag + "c"),
        tag + "b"), tag + "a")


def mask_te(seed: te.Tensor, shape, p: float, index: int) -> te.Tensor:
    """The float32 mask of ``shape`` (drop probability ``p``, 0 <= p < 1) for mask ``index``
    of a step, from ``seed`` (uint32, shape (2,)); see the module docstring."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability {p} is not in [0, 1)")
    stream = ((index + 1) * _GOLDEN) & _M32
    scale, keep_from = tirx.const(1.0 / (1.0 - p), "float32"), tirx.const(p, "float32")

    def element(*idx):
        flat = idx[0]
        for dim, i in zip(shape[1:], idx[1:]):
            flat = flat * dim + i
        s0, s1 = tirx.Cast("uint64", seed[0]), tirx.Cast("uint64", seed[1])
        key = _fmix32(s0 ^ _fmix32((s1 + _u(stream)) & _u(_M32), "s"), "k")
        h = _fmix32((tirx.Cast("uint64", flat) + key) & _u(_M32), "h")
        u = tirx.Cast("float32", h >> _u(8)) * tirx.const(2.0 ** -24, "float32")
        return tirx.Select(u >= keep_from, scale, tirx.const(0.0, "float32"))

    return te.compute(tuple(shape), element, name=f"dropout_mask{index}")


def draw_masks_function(mod: tvm.IRModule, masks: list[tuple[tuple[int, ...], float]]
                        ) -> tvm.IRModule:
    """``mod`` plus ``draw_masks(seed) -> (mask_0, ..., mask_k)``: seed uint32 of shape (2,),
    each mask float32 of its shape, in ``masks``' order (the order of ``train_adjoint``'s
    mask arguments). ``masks``: (shape, p) pairs, at least one."""
    if not masks:
        raise ValueError("draw_masks_function: the graph has no dropout mask")
    bb = relax.BlockBuilder(mod)
    seed = relax.Var("seed", relax.TensorType((2,), "uint32"))
    with bb.function(DRAW_MASKS, [seed]):
        with bb.dataflow():
            outs = [bb.emit(bb.call_te(mask_te, seed, tuple(shape), p, i,
                                       primfunc_name_hint=f"dropout_mask{i}"))
                    for i, (shape, p) in enumerate(masks)]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _fmix32_np(h: np.ndarray) -> np.ndarray:
    h = h.astype(np.uint64)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(_C1)) & np.uint64(_M32)
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(_C2)) & np.uint64(_M32)
    return h ^ (h >> np.uint64(16))


def mask_numpy(seed, shape, p: float, index: int) -> np.ndarray:
    """:func:`mask_te` in numpy (float32 of ``shape``), bit for bit: the tests' reference."""
    s0, s1 = (np.uint64(int(v)) for v in np.asarray(seed, dtype=np.uint32))
    stream = np.uint64(((index + 1) * _GOLDEN) & _M32)
    key = _fmix32_np(np.array([s0]) ^ _fmix32_np(np.array([(s1 + stream) & np.uint64(_M32)])))
    n = np.arange(int(np.prod(shape)), dtype=np.uint64)
    h = _fmix32_np((n + key) & np.uint64(_M32))
    u = (h >> np.uint64(8)).astype(np.float32) * np.float32(2.0 ** -24)
    mask = np.where(u >= np.float32(p), np.float32(1.0 / (1.0 - p)), np.float32(0.0))
    return mask.astype(np.float32).reshape(shape)
