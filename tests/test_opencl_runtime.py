"""The OpenCL runtime sidecar on PoCL: kernels with thread bindings against numpy in float64,
the device timer, exported MobileNetV1 and AlexNet steps against their llvm builds, build
options and the build log, compiles at raised niceness, the rewrite of vector reads of local
memory, dropout masks drawn on the device, and the error messages."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import te

from thomas_tune.schedules import default_gpu_schedules

from opencl_kernels import (NEEDS_OPENCL, prim_module, run_kernel)

pytestmark = NEEDS_OPENCL


@pytest.mark.quick  # the subset for edits (pytest -m quick): a small kernel on PoCL
def test_elementwise(target, rng):
    a = te.placeholder((3000,), name="a")
    b = te.placeholder((3000,), name="b")
    c = te.compute((3000,), lambda i: a[i] * b[i] + te.exp(a[i] * 0.1), name="c")
    x, y = rng.standard_normal(3000), rng.standard_normal(3000)
    got = run_kernel(default_gpu_schedules(prim_module(a, b, c), target), target, [x, y], (3000,))
    np.testing.assert_allclose(got, x * y + np.exp(x * 0.1), rtol=1e-5, atol=1e-5)


def test_time_evaluator_uses_the_device_timer(target, rng, capfd):
    # TVM's timer.cc looks up "runtime.timer.<device>"; without it time_evaluator falls back to a
    # host wall clock with a warning.
    import tvm_ffi
    timer = tvm_ffi.get_global_func("runtime.timer.opencl")(tvm.opencl(0))
    assert type(timer).__name__ == "OpenCLKernelTimer"
    a = te.placeholder((1 << 16,), name="a")
    c = te.compute(a.shape, lambda i: a[i] * 2.0, name="c")
    lib = tvm.compile(default_gpu_schedules(prim_module(a, c), target), target)
    dev = tvm.opencl(0)
    x = tvm.runtime.tensor(rng.standard_normal(1 << 16).astype("float32"), dev)
    y = tvm.runtime.empty((1 << 16,), "float32", dev)
    ms_ = lib.mod.time_evaluator("main", dev, number=3, repeat=2)(x, y).mean * 1e3
    assert 0 < ms_ < 1e3
    assert "No timer implementation" not in capfd.readouterr().err


@pytest.mark.quick
def test_reduction(target, rng):
    a = te.placeholder((37, 513), name="a")
    k = te.reduce_axis((0, 513), name="k")
    s = te.compute((37,), lambda i: te.sum(a[i, k] * a[i, k], axis=k), name="s")
    x = rng.standard_normal((37, 513))
    got = run_kernel(default_gpu_schedules(prim_module(a, s), target), target, [x], (37,))
    np.testing.assert_allclose(got, (x * x).sum(1), rtol=1e-4)


def _opencl_and_llvm(tmp_path, target, model, params, batch, trainable):
    """``model`` with ``params`` exported for ``target`` (OpenCL) and for llvm with default
    schedules (LLVM ``opt-level`` 0: the reference's speed does not matter); returns the two
    sessions (OpenCL first)."""
    from conftest import REFERENCE

    from build_cache import export  # the session's build of these inputs
    from thomas_tune.runtime import Session
    quiet = dict(batch=batch, trainable=trainable, progress=lambda *_: None)
    export(str(tmp_path / "cl"), model, params, target, **quiet)
    export(str(tmp_path / "cpu"), model, params, REFERENCE, **quiet)
    return Session(str(tmp_path / "cl")), Session(str(tmp_path / "cpu"))


def test_exported_mobilenet_matches_llvm(tmp_path, target, rng):
    from thomas_tune.models import build, init_params
    model = build("mobilenet_v1", num_classes=10, resolution=64, width=0.25)
    params = init_params(model, seed=int(rng.integers(1000)))
    cl, cpu = _opencl_and_llvm(tmp_path, target, model, params, 8, "last:4")
    assert str(cl.device) == "opencl:0"
    x = rng.standard_normal((8, 3, 64, 64)).astype("float32")
    y = rng.integers(0, 10, 8)
    np.testing.assert_allclose(cl.predict(x[:1]), cpu.predict(x[:1]), rtol=1e-4, atol=1e-5)
    assert abs(cl.train_step(x, y) - cpu.train_step(x, y)) < 1e-4
    a, b = cl.tensors(), cpu.tensors()
    # The parameter updates of one step agree as vectors: relative L2 distance over all trainable
    # parameters. Both sides are float32, and training-mode BatchNorm over 2x2x8 = 32 values per
    # channel amplifies rounding (`thomas-tune replay` measures ~1e-2 between llvm float32 and
    # float64 on this model), so single elements may differ by several percent; a wrong kernel
    # moves the whole update by O(1).
    names = cl.manifest.trainable
    da = np.concatenate([(a[n] - params[n]).ravel() for n in names]).astype("float64")
    db = np.concatenate([(b[n] - params[n]).ravel() for n in names]).astype("float64")
    assert np.linalg.norm(db) > 0
    rel = np.linalg.norm(da - db) / np.linalg.norm(db)
    print("relative L2 distance of the updates", rel)
    assert rel < 5e-2, rel


def test_alexnet_training_step_on_opencl_matches_llvm(tmp_path, target, rng):
    """AlexNet's kernels that the generic GPU rules refuse or break (max-pooling's backward with
    its argmax reduction, adaptive pooling with index-dependent windows) get a valid default
    schedule: a full training step on PoCL gives the llvm build's loss, also after two
    warm-up processes shared its compiles."""
    from thomas_tune.models import build, init_params
    model = build("alexnet", num_classes=5, resolution=67, width=0.1)
    params = init_params(model, seed=int(rng.integers(1000)))
    cl, cpu = _opencl_and_llvm(tmp_path, target, model, params, 4, "all")
    # warm-up shares (THOMAS_TUNE_OPENCL_WARM) split the step's kernel launches between
    # processes: two shares launch disjoint parts that add up to a whole step's launches
    code = ("import json; from thomas_tune import demo, opencl; "
            f"demo.build_device_programs({str(tmp_path / 'cl')!r}); "
            "print(json.dumps(opencl.stats()))")
    shares = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "THOMAS_TUNE_OPENCL_WARM": f"{i}/2"})
              for i in range(2)]
    launches = []
    for p in shares:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        launches.append(json.loads(out.splitlines()[-1])["launches"])
    from thomas_tune import demo, opencl
    before = opencl.stats()["launches"]
    demo.build_device_programs(str(tmp_path / "cl"))
    launches.append(opencl.stats()["launches"] - before)
    assert min(launches[:2]) > 0 and launches[0] + launches[1] == launches[2], launches
    x = rng.standard_normal((4, 3, 67, 67)).astype("float32")
    y = rng.integers(0, 5, 4)
    np.testing.assert_allclose(cl.predict(x[:1]), cpu.predict(x[:1]), rtol=1e-4, atol=1e-5)
    assert abs(cl.train_step(x, y) - cpu.train_step(x, y)) < 1e-4


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_no_platform_error_names_the_filter():
    p = _python("import thomas_tune, tvm\n"
                "tvm.runtime.tensor(__import__('numpy').zeros(3, 'float32'), tvm.opencl(0))",
                THOMAS_TUNE_OPENCL_PLATFORM="no-such-platform")
    assert p.returncode != 0
    assert "no device found on platforms matching 'no-such-platform'" in p.stderr


_SCALE_KERNEL = """
import numpy as np, thomas_tune, tvm
from tvm import te
a = te.placeholder((256,), name="a")
b = te.compute((256,), lambda i: a[i] * 3.0 + 1.0, name="b")
s = tvm.s_tir.Schedule(te.create_prim_func([a, b]))
i, = s.get_loops(s.get_sblock("b"))
o, t = s.split(i, [None, 64])
s.bind(o, "blockIdx.x"); s.bind(t, "threadIdx.x")
lib = tvm.compile(s.mod, target=tvm.target.Target({"kind": "opencl"}, host={"kind": "llvm"}))
x = np.random.default_rng().standard_normal(256).astype("float32")
y = tvm.runtime.tensor(np.empty(256, "float32"), tvm.opencl(0))
lib["main"](tvm.runtime.tensor(x, tvm.opencl(0)), y)
# -cl-mad-enable may fuse x * 3 + 1 into one rounding: near x = -1/3 that differs from
# numpy's two roundings by up to half an ulp of x * 3 (about 6e-8) absolute
assert np.allclose(y.numpy(), x * 3 + 1, rtol=1e-6, atol=1e-6)
"""


def test_build_options_reach_the_compiler(tmp_path):
    """``THOMAS_TUNE_OPENCL_OPTIONS`` goes to clBuildProgram: a macro it defines is seen by the
    compiler (the driver rejects the program that ``#error``s on it), and with
    ``THOMAS_TUNE_OPENCL_BUILD_LOG`` each program built from source is logged with its options."""
    log = tmp_path / "build.log"
    env = dict(THOMAS_TUNE_OPENCL_CACHE="off", THOMAS_TUNE_OPENCL_BUILD_LOG=str(log))
    ok = _python(_SCALE_KERNEL, THOMAS_TUNE_OPENCL_OPTIONS="-cl-mad-enable", **env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert '== program of main_kernel (options "-cl-mad-enable")' in log.read_text()
    # the same kernel with "#error" under a macro only the options define: the build must fail
    code = _SCALE_KERNEL.replace("lib = tvm.compile", "tvm.register_global_func("
                                 "'tvm_callback_opencl_postproc', lambda c, t: "
                                 "'#ifdef TT_FAIL\\n#error TT_FAIL set\\n#endif\\n' + c, "
                                 "override=True)\nlib = tvm.compile")
    assert _python(code, **env).returncode == 0
    bad = _python(code, THOMAS_TUNE_OPENCL_OPTIONS="-DTT_FAIL", **env)
    assert bad.returncode != 0 and "TT_FAIL set" in bad.stderr, bad.stderr[-2000:]


def _adds(x, n):
    return lambda i: x[i] + float(n)


def test_contraction_kernels_are_built_in_programs_of_their_own(tmp_path, monkeypatch, target):
    """The sidecar deals a module's kernels into programs by a hash of their names, the
    contraction kernels (convolutions, matrix products) into groups of their own: a tuned and
    an untuned build, which differ mostly in those, then build the same programs for the other
    kernels (docs/opencl.md). Forty elementwise kernels and one named ``conv2d``: each program
    built holds contraction kernels only or none; by name alone, ``add3`` would share
    ``conv2d``'s program."""
    import tvm_ffi
    log = tmp_path / "build.log"
    monkeypatch.setenv("THOMAS_TUNE_OPENCL_BUILD_LOG", str(log))
    a = te.placeholder((16, 16), name="a")
    k = te.reduce_axis((0, 16), name="k")
    funcs = {"conv2d": te.create_prim_func(
        [a, te.compute((16, 16), lambda i, j: te.sum(a[i, k] * a[k, j], axis=k), name="c")])}
    for n in range(40):
        x = te.placeholder((64,), name="x")
        funcs[f"add{n}"] = te.create_prim_func([x, te.compute((64,), _adds(x, n), name="y")])
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    lib = tvm.compile(default_gpu_schedules(mod, target), target)
    assert tvm_ffi.get_global_func("thomas_tune.opencl.build_programs")(lib.mod, 0) == 1
    programs = [line.split("== program of ", 1)[1].split(" (options")[0].split(", ")
                for line in log.read_text().splitlines() if line.startswith("== program of ")]
    assert sorted(k for p in programs for k in p) == sorted(f"{n}_kernel" for n in funcs)
    assert ["conv2d_kernel"] in programs, programs
    assert 10 < len(programs) <= 25, programs  # 1 + at most 24 groups of the elementwise ones


@pytest.mark.quick
def test_kernel_build_failure_shows_the_build_log():
    import tvm_ffi
    blob = bytearray()

    def s(b):
        blob.extend(len(b).to_bytes(8, "little") + b)
    s(b"cl")
    blob.extend((0).to_bytes(8, "little"))  # no functions
    s(b"__kernel void broken(__global float* a) { a[0] = undefined_name; }")
    mod = tvm_ffi.get_global_func("ffi.Module.load_from_bytes.opencl")(bytes(blob))
    assert mod.kind == "opencl"
    assert "undefined_name" in mod.inspect_source()


def test_out_of_memory_names_the_device():
    with pytest.raises(Exception, match="allocating .* bytes on "):
        tvm.runtime.empty((1 << 40,), "float32", tvm.opencl(0))  # 4 TiB


def test_low_priority_build_compiles_at_raised_niceness(target):
    """Device servers compile candidates' OpenCL programs on a thread of niceness +COMPILE_NICE
    (so that they leave the CPU to another server's timed run); build errors reach the caller,
    and the host module's import is found and built."""
    import threading

    import tvm_ffi

    from thomas_tune.measure.priority import (COMPILE_NICE, on_low_priority_thread,
                                              register_low_priority_build)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    niceness = on_low_priority_thread(
        lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    assert niceness == min(base + COMPILE_NICE, 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # caller's kept
    with pytest.raises(ZeroDivisionError):
        on_low_priority_thread(lambda: 1 / 0)

    register_low_priority_build()
    build = tvm_ffi.get_global_func("thomas_tune.opencl.build_programs_low_priority")
    a = te.placeholder((4096,), name="a")
    c = te.compute(a.shape, lambda i: a[i] * 3.0, name="c")
    lib = tvm.compile(default_gpu_schedules(prim_module(a, c), target), target)
    assert build(lib.mod, 0) == 1  # the llvm host module and its OpenCL import
    blob = bytearray()

    def s(b):
        blob.extend(len(b).to_bytes(8, "little") + b)
    s(b"cl")
    blob.extend((0).to_bytes(8, "little"))
    s(b"__kernel void broken(__global float* a) { a[0] = undefined_name; }")
    broken = tvm_ffi.get_global_func("ffi.Module.load_from_bytes.opencl")(bytes(blob))
    with pytest.raises(Exception, match="undefined_name"):
        build(broken, 0)


def test_vector_reads_of_shared_memory_are_aligned_where_their_index_proves_it(target, rng):
    """thomas_tune.opencl_source rewrites a ``vload4``/``vstore4`` of a ``__local`` array into
    a float4 dereference only where the index is a proven multiple of 4 (constants, sums,
    products, shifts, integers defined once); a loop counter, an odd offset, a name assigned
    twice or a division keep ``vload4``. A kernel with both kinds runs on PoCL and matches
    numpy."""
    from thomas_tune.opencl_source import align_local_vectors, int_definitions, multiple_of

    assert multiple_of("((i * 36) + (convert_int(get_local_id(1)) * 4))") == 4
    assert multiple_of("(((x >> 2) * 144) + ((x & 3) * 4)) + 2304") == 4
    assert multiple_of("(i << 3) - 8") == 8 and multiple_of("0") == 64
    assert multiple_of("(i * 4) + 2") == 2 and multiple_of("(i * 8) / 2") == 1
    assert multiple_of("(int)i * 4") == 1 and multiple_of("a ? 4 : 8") == 1  # not parsed
    kernel = ("int a = i * 8;\nint b = j;\nb = b + 1;\nfor (int k = 0; k < 4; ++k) {\n"
              "  int c = k * 4;\n}\nint d = (a + 4);\nint d = 8;\n")
    assert int_definitions(kernel) == {"a": "i * 8", "c": "k * 4"}
    assert multiple_of("a + c", int_definitions(kernel)) == 4
    assert multiple_of("k * 4 + b", int_definitions(kernel)) == 1

    src = """__kernel void main_kernel(__global float* restrict x, __global float* restrict y) {
  __local float s[64];
  float r[4];
  int t = convert_int(get_local_id(0));
  int base = t * 4;
  vstore4(vload4(0, x + (t * 4)), 0, s + base);
  barrier(CLK_LOCAL_MEM_FENCE);
  vstore4(vload4(0, s + ((t * 4 + 4) & 63)), 0, r + 0);
  float4 v = vload4(0, s + (t * 4));
  float4 w = vload4(0, s + ((t * 4) + 2) % 60);
  vstore4(((v * 2.0f) + w) + vload4(0, r + 0), 0, y + (t * 4));
}
"""
    new, counts = align_local_vectors(src)
    assert counts == {"aligned": 2, "kept": 2}
    assert "__local float s[64] __attribute__((aligned(16)));" in new
    assert "((*(__local float4*)(s + (base))) = (vload4(0, x + (t * 4))));" in new
    assert "float4 v = (*(__local float4*)(s + ((t * 4))));" in new
    assert "vload4(0, s + ((t * 4 + 4) & 63))" in new and "vload4(0, x + (t * 4))" in new

    import pyopencl as cl

    ctx = cl.Context([next(d for p in cl.get_platforms() for d in p.get_devices())])
    queue = cl.CommandQueue(ctx)
    xn = rng.standard_normal(64).astype("float32")
    outs = []
    for text in (src, new):
        prog = cl.Program(ctx, text).build()
        xb = cl.Buffer(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=xn)
        yb = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, 64 * 4)
        prog.main_kernel(queue, (16,), (16,), xb, yb)
        y = np.empty(64, "float32")
        cl.enqueue_copy(queue, y, yb)
        outs.append(y.astype("float64"))
    x64, t = xn.astype("float64"), np.arange(16)
    ref = np.empty(64)
    for i in t:
        v, w = x64[4 * i:4 * i + 4], x64[(4 * i + 2) % 60:(4 * i + 2) % 60 + 4]
        r = x64[(4 * i + 4) & 63:((4 * i + 4) & 63) + 4]
        ref[4 * i:4 * i + 4] = 2 * v + w + r
    # the same loads in the same order: equal to the bit; against float64 within float32
    # rounding of the sum's terms (a sum near zero has no relative accuracy)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[1], ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_dropout_masks_drawn_on_the_device_match_numpy(target, rng):
    # draw_masks (thomas_tune.training_graph.dropout) as the export compiles it (default GPU
    # schedules) on PoCL: bit for bit the numpy reference; the drop rate is p, fresh seeds give
    # fresh masks, two masks of one step are independent streams, and the values are those of
    # torch.nn.functional.dropout (0 and 1 / (1 - p)).
    from tvm import relax

    from thomas_tune.compiler.compile import compile_graph
    from thomas_tune.training_graph.dropout import draw_masks_function, mask_numpy
    masks = [((400, 500), 0.5), ((200_000,), 0.2), ((7, 3, 5), 0.9)]
    exe = compile_graph(draw_masks_function(tvm.IRModule(), masks), target, None)
    vm = relax.VirtualMachine(exe, tvm.opencl(0))
    draws = []
    for _ in range(2):
        seed = rng.integers(0, 2 ** 32, size=2, dtype=np.uint32)
        out = [m.numpy() for m in vm["draw_masks"](tvm.runtime.tensor(seed, tvm.opencl(0)))]
        for i, ((shape, p), got) in enumerate(zip(masks, out)):
            np.testing.assert_array_equal(got, mask_numpy(seed, shape, p, i))
            assert set(np.unique(got)) <= {np.float32(0), np.float32(1 / (1 - p))}
        draws.append(out)
    for i, (shape, p) in enumerate(masks[:2]):
        n = int(np.prod(shape))
        for got in (draws[0][i], draws[1][i]):
            assert abs((got == 0).mean() - p) < 5 * np.sqrt(p * (1 - p) / n)
        both = ((draws[0][i] == 0) & (draws[1][i] == 0)).mean()  # independent: p^2
        assert abs(both - p * p) < 5 * np.sqrt(p * p * (1 - p * p) / n)
    first, second = draws[0][0].ravel()[:200_000] == 0, draws[0][1] == 0
    both = (first & second).mean()  # two streams of one seed: 0.5 * 0.2
    assert abs(both - 0.1) < 5 * np.sqrt(0.1 * 0.9 / 200_000)


def test_a_dropout_draw_equal_to_p_is_kept_on_the_device(target, rng):
    # u >= p keeps an element: with p equal to an element's own draw (a multiple of 2^-24),
    # the device keeps it, as the numpy reference and PyTorch's rule do. The draw is found for a
    # fresh seed and mask, so every run puts some element exactly on the boundary.
    from tvm import relax

    from thomas_tune import counter_random as cr
    from thomas_tune.compiler.compile import compile_graph
    from thomas_tune.training_graph.dropout import draw_masks_function, mask_numpy
    seed = rng.integers(0, 2 ** 32, size=2, dtype=np.uint32)
    shape = (64,)
    h = cr.hash_numpy(64, cr.key_numpy(int(seed[0]), int(seed[1]), 0))
    j = int(rng.integers(64))
    p = float(int(h.ravel()[j]) >> 8) * 2.0 ** -24
    exe = compile_graph(draw_masks_function(tvm.IRModule(), [(shape, p)]), target, None)
    got = relax.VirtualMachine(exe, tvm.opencl(0))["draw_masks"](
        tvm.runtime.tensor(seed, tvm.opencl(0)))[0].numpy()
    want = mask_numpy(seed, shape, p, 0)
    assert want[j] == np.float32(1 / (1 - p))
    np.testing.assert_array_equal(got, want)


def test_the_runtime_counts_device_memory_and_launch_bytes(target, rng):
    """The sidecar counts the bytes allocated on the device (current and peak, a fresh peak
    from reset_peak) and, per launch, the bytes of the buffers a kernel is given."""
    from thomas_tune import opencl
    dev = tvm.opencl(0)
    n = int(rng.integers(1000, 5000))
    base = opencl.stats()["device_bytes"]
    opencl.reset_peak()
    a = tvm.runtime.tensor(rng.standard_normal(n).astype("float32"), dev)
    b = tvm.runtime.tensor(rng.standard_normal(2 * n).astype("float32"), dev)
    s = opencl.stats()
    assert s["device_bytes"] - base == 12 * n and s["device_peak_bytes"] == s["device_bytes"]
    del b
    s = opencl.stats()
    assert s["device_bytes"] - base == 4 * n and s["device_peak_bytes"] - base == 12 * n
    opencl.reset_peak()
    assert opencl.stats()["device_peak_bytes"] == opencl.stats()["device_bytes"]
    x = te.placeholder((n,), name="x")
    y = te.compute((n,), lambda i: x[i] * 2.0, name="y")
    lib = tvm.compile(default_gpu_schedules(prim_module(x, y), target), target)
    out = tvm.runtime.empty((n,), "float32", dev)
    before = opencl.stats()
    lib["main"](a, out)
    dev.sync()
    after = opencl.stats()
    assert after["launches"] - before["launches"] == 1
    assert after["launch_arg_bytes"] - before["launch_arg_bytes"] == 8 * n
    np.testing.assert_allclose(out.numpy(), a.numpy() * 2.0)


def _opencl_module_parts(monkeypatch, chunk: int, mod, target) -> tuple[dict, dict]:
    """``mod`` compiled for ``target`` with TVM's OpenCL code generator run ``chunk`` kernels
    at a time: (kernel name -> its definition, prototypes and blank lines left out; kernel
    name -> its argument types and launch tags), as the OpenCL module is made from them."""
    from thomas_tune import opencl
    from thomas_tune.compiler.compile import compile_graph
    from thomas_tune.limits import _FUNCTION
    monkeypatch.setattr(opencl, "CODEGEN_CHUNK", chunk)
    made: list = []
    opencl._pieces.out = made
    try:
        compile_graph(mod, target)
    finally:
        opencl._pieces.out = None
    assert len(made) == 1, len(made)
    source, fmap = made[0]
    parts = _FUNCTION.split(source)
    kept = {name: "\n".join(line for line in body.splitlines()
                            if line.strip() and not opencl._PROTOTYPE.match(line))
            for name, body in zip(parts[1::2], parts[2::2])}
    types = {str(k): (str(v.name), [str(t) for t in v.arg_types],
                      [str(t) for t in v.launch_param_tags], [int(t) for t in v.arg_extra_tags])
             for k, v in fmap.items()}
    return kept, types


def test_code_generation_in_pieces_writes_every_kernel_as_in_one(monkeypatch, target):
    """TVM's OpenCL code generator run a few kernels at a time (``opencl._chunked_build``,
    whose time grows linearly, not with the square of the kernel count) gives every kernel of
    a training step the definition, argument types and launch tags one call gives it."""
    from thomas_tune.models import build
    from thomas_tune.training_graph import graph as G
    model = build("alexnet", num_classes=5, resolution=67, width=0.1)
    mod = G.training_module(model, 4, "last:3", None).mod
    whole, whole_types = _opencl_module_parts(monkeypatch, 10 ** 6, mod, target)
    pieces, piece_types = _opencl_module_parts(monkeypatch, 3, mod, target)
    assert len(whole) > 3 * 3 and whole.keys() == whole_types.keys()
    assert pieces == whole
    assert piece_types == whole_types
