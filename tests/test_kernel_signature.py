"""Kernels that TVM's own OpenCL runtime (``tvm_rpc`` on a phone) can launch: a build whose
kernel takes an argument that runtime cannot pass fails at build time, naming the kernel and the
argument; the candidate check's own kernels take 32-bit scalars only."""

from __future__ import annotations

import pytest
import tvm
from tvm import te, tirx

from thomas_tune import kernel_check as kc
from thomas_tune.kernel_signature import UnlaunchableKernel, check_source, signatures, unlaunchable
from thomas_tune.target import parse_target


def _opencl_source(func: tirx.PrimFunc) -> str:
    exe = tvm.compile(tvm.IRModule({"main": func}), target=parse_target("opencl"))
    return exe.mod.imports[0].inspect_source()


def _seeded(n: int = 256) -> tirx.PrimFunc:
    """Two tensors drawn from the halves of a 64-bit seed, as the candidate check's fill
    kernel once did: common-subexpression elimination computes each half once, on the host,
    and passes it to both kernels as a ``ulong``."""
    seed = tirx.Var("seed", "int64")
    s64 = tirx.Cast("uint64", seed)
    lo, hi = s64 & tirx.const(0xFFFFFFFF, "uint64"), s64 >> tirx.const(32, "uint64")

    def draw(name):
        return te.compute((n,), lambda i: tirx.Cast(
            "float32", (lo ^ (hi + tirx.Cast("uint64", i))) & tirx.const(255, "uint64")),
            name=name)

    outs = [draw("a"), draw("b")]
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": te.create_prim_func([seed, *outs])}))
    for out in ("a", "b"):
        bx, tx = sch.split(sch.get_loops(sch.get_sblock(out))[0], [None, 64])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    return sch.mod["main"]


def test_a_kernel_with_a_ulong_argument_is_a_build_error():
    with pytest.raises(Exception) as err:  # raised in the code generator's callback: the
        _opencl_source(_seeded())           # error crosses TVM's FFI as a RuntimeError
    msg = str(err.value)
    assert "OpenCL kernel main_kernel" in msg and "is a ulong" in msg, msg
    assert "TVM's OpenCL runtime" in msg and "32-bit parameters" in msg, msg


def test_the_candidate_checks_own_kernels_take_32_bit_scalars():
    """The fill, finite-count and comparison kernels of a workload with an input, an output
    and an argument updated in place: only buffers, ``uint`` keys and the ``int`` flag."""
    a = te.placeholder((8, 33), "float32", "a")
    acc = te.placeholder((33,), "float32", "acc")
    k = te.reduce_axis((0, 8), "k")
    total = te.compute((33,), lambda j: te.sum(a[k, j], axis=k), name="total")
    out = te.compute((33,), lambda j: acc[j] + total[j], name="out")
    func = te.create_prim_func([a, acc, out])
    spec = kc.check_spec(func)
    target = parse_target("opencl")
    kinds = set()
    for make in (kc.fill_kernel, kc.finite_kernel, kc.compare_kernel):
        src = _opencl_source(make(func, spec, target))
        assert unlaunchable(src) == []
        kinds |= {ty for args in signatures(src).values() for ty, _ in args}
    assert {"uint", "int", "__global float*"} <= kinds, kinds
    assert "ulong" not in kinds and "long" not in kinds, kinds


def test_signatures_read_pointers_images_and_scalars():
    src = ("__kernel void k0(__global float* restrict x, __read_only image2d_t img, uint n, "
           "int flag);\n__kernel void k1(__global const half* restrict y, ulong s, half h,"
           " long m, double d) {\n}")
    assert signatures(src) == {
        "k0": [("__global float*", "x"), ("image2d_t", "img"), ("uint", "n"), ("int", "flag")],
        "k1": [("__global half*", "y"), ("ulong", "s"), ("half", "h"), ("long", "m"),
               ("double", "d")]}
    assert unlaunchable(src) == [("k1", "s", "ulong"), ("k1", "h", "half")]
    with pytest.raises(UnlaunchableKernel,
                       match=r"kernel k1: argument s is a ulong,.*\(1 more such argument\)"):
        check_source(src)
    assert check_source(src.split("__kernel void k1")[0]) == src.split("__kernel void k1")[0]
