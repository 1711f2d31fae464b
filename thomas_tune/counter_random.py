"""Counter-based random numbers: element ``n`` of stream ``i`` of a seed is a hash of (seed, i, n).

Every element is computed on its own, so a kernel of any schedule, on any device, and numpy on
the host give the same values bit for bit, and nothing but the seed has to cross to a device.
The generator is counter based, as PyTorch's CUDA dropout (Philox; Salmon et al., "Parallel
random numbers: as easy as 1, 2, 3", SC 2011); the hash is MurmurHash3's 32-bit finalizer
``fmix32`` (Appleby, 2011, public domain), a bijection with full avalanche (each input bit
flips each output bit with probability about 1/2), not a cryptographic generator:

    key = fmix32(s0 ^ fmix32((s1 + (i + 1) * 0x9E3779B9) mod 2^32))   seed (s0, s1), stream i
    h   = fmix32((n + key) mod 2^32)                                  n: row-major index

The arithmetic is done in ``uint64`` with explicit ``mod 2^32``: this TVM's LLVM code generator
treats ``uint32`` overflow as impossible (``(x + c) * k`` gives other bits than C's wrapping
arithmetic), while no ``uint64`` value here ever exceeds 2^64. ``*_te`` functions build TIR
expressions, ``*_numpy`` ones compute the same on ``uint64`` arrays.
"""

from __future__ import annotations

import numpy as np
from tvm import tirx

M32 = 0xFFFFFFFF
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35  # fmix32's multipliers (MurmurHash3)
GOLDEN = 0x9E3779B9                 # 2^32 / golden ratio: spreads the stream index over the key


def _u(v: int) -> tirx.PrimExpr:
    return tirx.const(v, "uint64")


def _let(value, body, name: str):
    var = tirx.Var(name, "uint64")
    return tirx.Let(var, value, body(var))


def fmix32_te(h: tirx.PrimExpr, tag: str) -> tirx.PrimExpr:
    """fmix32 of ``h`` (a uint64 expression < 2^32); Let-bound so each step is computed once
    (``tag`` names the bound variables)."""
    return _let(h, lambda a: _let(((a ^ (a >> _u(16))) * _u(_C1)) & _u(M32), lambda b: _let(
        ((b ^ (b >> _u(13))) * _u(_C2)) & _u(M32), lambda c: c ^ (c >> _u(16)), tag + "c"),
        tag + "b"), tag + "a")


def key_te(s0: tirx.PrimExpr, s1: tirx.PrimExpr, stream: int) -> tirx.PrimExpr:
    """The key of stream ``stream`` (an int >= 0) of the seed (``s0``, ``s1``), uint64
    expressions < 2^32."""
    mixed = ((stream + 1) * GOLDEN) & M32
    return fmix32_te(s0 ^ fmix32_te((s1 + _u(mixed)) & _u(M32), "s"), "k")


def hash_te(n: tirx.PrimExpr, key: tirx.PrimExpr) -> tirx.PrimExpr:
    """The hash of element ``n`` (an integer expression, the row-major index) under ``key``
    (:func:`key_te`): a uint64 expression < 2^32."""
    return fmix32_te((tirx.Cast("uint64", n) + key) & _u(M32), "h")


def fmix32_numpy(h: np.ndarray) -> np.ndarray:
    """:func:`fmix32_te` on a ``uint64`` array of values < 2^32."""
    h = h.astype(np.uint64)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(_C1)) & np.uint64(M32)
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(_C2)) & np.uint64(M32)
    return h ^ (h >> np.uint64(16))


def key_numpy(s0: int, s1: int, stream: int) -> np.ndarray:
    """:func:`key_te` for seed (``s0``, ``s1``), ints in [0, 2^32): a uint64 array of one
    value."""
    mixed = np.uint64(((stream + 1) * GOLDEN) & M32)
    inner = fmix32_numpy(np.array([(np.uint64(s1) + mixed) & np.uint64(M32)], np.uint64))
    return fmix32_numpy(np.array([s0], np.uint64) ^ inner)


def hash_numpy(size: int, key: np.ndarray) -> np.ndarray:
    """:func:`hash_te` of elements 0 .. ``size - 1`` under ``key`` (:func:`key_numpy`)."""
    n = np.arange(size, dtype=np.uint64)
    return fmix32_numpy((n + key) & np.uint64(M32))
