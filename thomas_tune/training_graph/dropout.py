"""Dropout masks drawn on the device: a counter-based generator in one kernel per mask.

A training step's dropout masks are inputs of ``train_adjoint``. Drawing them on the host and
copying them in costs every step a host draw and a host-to-device copy (AlexNet at batch 32:
two masks, 0.43 M values, 1.7 MB); ``draw_masks`` instead makes them where they are used, from
one 64-bit seed per step (a ``uint32`` tensor of shape (2,)), and only those 8 bytes cross.

The generator is the counter-based one of :mod:`thomas_tune.counter_random` (MurmurHash3's
``fmix32``): element ``n`` of mask ``i`` is a hash of ``(seed, i, n)``, so every element is
computed on its own and any schedule gives the same mask:

    key  = fmix32(seed[0] ^ fmix32((seed[1] + (i + 1) * 0x9E3779B9) mod 2^32))
    h    = fmix32((n + key) mod 2^32)            n: row-major index of the element
    u    = (h >> 8) * 2^-24                      uniform in [0, 1) on a 2^-24 grid
    mask = 1 / (1 - p) if u >= p else 0          inverted dropout, as torch.nn.functional.dropout

:func:`mask_numpy` is the same function in numpy, the reference the tests compare with.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, te, tirx

from .. import counter_random as cr
from ..manifest import DRAW_MASKS

def mask_te(seed: te.Tensor, shape, p: float, index: int) -> te.Tensor:
    """The float32 mask of ``shape`` (drop probability ``p``, 0 <= p < 1) for mask ``index``
    of a step, from ``seed`` (uint32, shape (2,)); see the module docstring."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability {p} is not in [0, 1)")
    # TVM's OpenCL source writes float constants with 7 significant digits (2^-24 as
    # 5.960464e-08f, below 2^-24; 1 / (1 - p) off by an ulp for most p), so neither goes in as
    # a float literal: the scale by its bits, and u >= p decided on the 24-bit integer u * 2^24
    # against the smallest one that keeps (exact; a u on the grid equal to p came out dropped)
    bits = int(np.float32(1.0 / (1.0 - p)).view(np.uint32))
    scale = tirx.reinterpret("float32", tirx.const(bits, "uint32"))
    keep_from = tirx.const(math.ceil(float(np.float32(p)) * 2 ** 24), "uint64")

    def element(*idx):
        flat = idx[0]
        for dim, i in zip(shape[1:], idx[1:]):
            flat = flat * dim + i
        s0, s1 = tirx.Cast("uint64", seed[0]), tirx.Cast("uint64", seed[1])
        h = cr.hash_te(flat, cr.key_te(s0, s1, index))
        return tirx.Select(h >> tirx.const(8, "uint64") >= keep_from, scale,
                           tirx.const(0.0, "float32"))

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


def mask_numpy(seed, shape, p: float, index: int) -> np.ndarray:
    """:func:`mask_te` in numpy (float32 of ``shape``), bit for bit: the tests' reference."""
    s0, s1 = (int(v) for v in np.asarray(seed, dtype=np.uint32))
    h = cr.hash_numpy(int(np.prod(shape)), cr.key_numpy(s0, s1, index))
    u = (h >> np.uint64(8)).astype(np.float32) * np.float32(2.0 ** -24)
    mask = np.where(u >= np.float32(p), np.float32(1.0 / (1.0 - p)), np.float32(0.0))
    return mask.astype(np.float32).reshape(shape)
