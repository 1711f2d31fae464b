"""Kernels that compute wrong numbers are caught: by the tuner before their time enters the
log, and by export and replay before a build applies their record (real kernels on PoCL, a
real tracker and device server on 127.0.0.1)."""

import os
import shutil

import numpy as np
import pytest
import tvm
from tvm import te
from tvm.script import tirx as T

from thomas_tune import kernel_check as kc
from thomas_tune import kernel_reference as kr
from thomas_tune import rpc

from opencl_kernels import NEEDS_OPENCL

pytestmark = NEEDS_OPENCL

N = 64


def _matmul() -> tvm.IRModule:
    a = te.placeholder((N, N), name="A")
    b = te.placeholder((N, N), name="B")
    k = te.reduce_axis((0, N), name="k")
    c = te.compute((N, N), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    return tvm.IRModule({"main": te.create_prim_func([a, b, c])})


# Hand-written schedules of the matmul above: one right, three wrong in the ways a tuner can
# meet. Each is a complete OpenCL kernel with the workload's signature.
@T.prim_func
def _right(A: T.Buffer((64, 64), "float32"), B: T.Buffer((64, 64), "float32"),
           C: T.Buffer((64, 64), "float32")):
    T.func_attr({"global_symbol": "main", "tirx.noalias": True})
    for i in T.thread_binding(64, thread="blockIdx.x"):
        for j in T.thread_binding(64, thread="threadIdx.x"):
            C[i, j] = T.float32(0)
            for k in range(64):
                C[i, j] = C[i, j] + A[i, k] * B[k, j]


@T.prim_func
def _writes_nothing(A: T.Buffer((64, 64), "float32"), B: T.Buffer((64, 64), "float32"),
                    C: T.Buffer((64, 64), "float32")):
    # the store's guard is never true: the build launches no kernel at all
    T.func_attr({"global_symbol": "main", "tirx.noalias": True})
    for i in T.thread_binding(64, thread="blockIdx.x"):
        for j in T.thread_binding(64, thread="threadIdx.x"):
            if i > 64:
                C[i, j] = A[i, j] * B[i, j]


@T.prim_func
def _writes_zeros(A: T.Buffer((64, 64), "float32"), B: T.Buffer((64, 64), "float32"),
                  C: T.Buffer((64, 64), "float32")):
    T.func_attr({"global_symbol": "main", "tirx.noalias": True})
    for i in T.thread_binding(64, thread="blockIdx.x"):
        for j in T.thread_binding(64, thread="threadIdx.x"):
            C[i, j] = T.float32(0)


@T.prim_func
def _racing(A: T.Buffer((64, 64), "float32"), B: T.Buffer((64, 64), "float32"),
            C: T.Buffer((64, 64), "float32")):
    # the reduction bound to threads with no combine: every work-item of a group writes the
    # same row, unsynchronised, its own single term; whichever lands last is kept
    T.func_attr({"global_symbol": "main", "tirx.noalias": True})
    for i in T.thread_binding(64, thread="blockIdx.x"):
        for k in T.thread_binding(64, thread="threadIdx.x"):
            for j in range(64):
                C[i, j] = A[i, k] * B[k, j]


@T.prim_func
def _negated(A: T.Buffer((64, 64), "float32"), B: T.Buffer((64, 64), "float32"),
             C: T.Buffer((64, 64), "float32")):
    # a wrong sign, as in a backward formula with one term negated
    T.func_attr({"global_symbol": "main", "tirx.noalias": True})
    for i in T.thread_binding(64, thread="blockIdx.x"):
        for j in T.thread_binding(64, thread="threadIdx.x"):
            C[i, j] = T.float32(0)
            for k in range(64):
                C[i, j] = C[i, j] - A[i, k] * B[k, j]


@T.prim_func
def _one_percent_high(A: T.Buffer((64, 64), "float32"), B: T.Buffer((64, 64), "float32"),
                      C: T.Buffer((64, 64), "float32")):
    # every result 1% too large
    T.func_attr({"global_symbol": "main", "tirx.noalias": True})
    for i in T.thread_binding(64, thread="blockIdx.x"):
        for j in T.thread_binding(64, thread="threadIdx.x"):
            C[i, j] = T.float32(0)
            for k in range(64):
                C[i, j] = C[i, j] + T.float32(1.01) * A[i, k] * B[k, j]


WRONG = {"writes nothing": _writes_nothing, "writes zeros": _writes_zeros, "races": _racing,
         "wrong sign": _negated, "1% high": _one_percent_high}


# The fewest last blocks of the small MobileNetV2 below whose training step holds a ReLU6
# gradient as an elementwise kernel of its own (in fewer blocks each mask is fused into a
# convolution's data gradient): 285 tasks, against 474 when every layer trains.
TRAINABLE = "last:6,frozen-bn"  # BatchNorm in inference form: ReLU6's gradient is a where
# 8 images of 32x32: the last BatchNorms normalise 8 values per channel, the fewest the step
# check's bounds hold for (thomas_tune.step_check.MIN_BN_VALUES)
BATCH = 8


def _relu6_mask_task(target):
    """The elementwise ReLU6 gradient of a small MobileNetV2's training step with its
    BatchNorms in inference form (``where`` over the mask ``0 < x < 6``), and a wrong schedule
    of it: each work-item keeps its output in a register made float16 by TVM's
    ``unsafe_set_dtype`` (a primitive that may change the numbers, as its name says), so the
    gradient comes out rounded to float16, about 2e-4 of the largest value off where the check
    allows 2e-5 for one term. (The wrong schedules that arose by themselves, a vectorized
    ``where`` whose OpenCL compared -1 with 0, compute right since ``schedules/bool_casts.py``.)"""
    from thomas_tune.training_graph import graph as G
    from thomas_tune.models import build
    from thomas_tune.tasks import extract
    model = build("mobilenet_v2", num_classes=5, resolution=32, width=0.35)
    tasks = extract({"train": G.training_module(model, BATCH, TRAINABLE).mod}, target)
    task = next(t for t in tasks if t.name.startswith("fused_greater") and "where" in t.name)
    sch = tvm.s_tir.Schedule(task.mod)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    for b in blocks[:-1]:
        sch.compute_inline(b)
    out = blocks[-1]
    copy = sch.cache_write(out, 0, "local")
    sch.unsafe_set_dtype(out, 0, "float16")
    bx, tx = sch.split(sch.fuse(*sch.get_loops(copy)), [None, 32])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.compute_at(out, tx)
    return model, task, sch


def test_tolerance_passes_two_float32_summation_orders_and_fails_a_one_percent_error(rng):
    """Sums of n float32 terms taken in two orders (one after another, and numpy's pairwise
    sum) agree within the tolerance for n terms, from 1 to 400,000 terms; a result 1% off
    fails at every length."""
    for n in (1, 1000, 100_000, 400_000):
        terms = rng.standard_normal((4, n)).astype("float32")
        one_by_one = np.add.accumulate(terms, axis=1, dtype=np.float32)[:, -1]
        pairwise = terms.sum(axis=1, dtype=np.float32)
        scale = np.max(np.abs(terms.astype("float64").sum(axis=1)))
        assert np.max(np.abs(one_by_one - pairwise)) / scale <= kc.tolerance(n), n
        assert kc.compare({0: pairwise}, {0: one_by_one}, kc.tolerance(n)) is None
        assert kc.compare({0: pairwise * 1.01}, {0: one_by_one}, kc.tolerance(n)), n


def test_check_spec_names_the_outputs_the_in_place_updates_and_the_sum_length():
    spec = kc.check_spec(_matmul()["main"])
    assert spec.written == (2,) and spec.updated == () and spec.terms == N


def test_compare_catches_nan_zeros_and_far_values_and_passes_rounding(rng):
    ref = {2: rng.standard_normal((8, 8)).astype("float32")}
    assert kc.compare({2: ref[2] * (1 + 1e-6)}, ref, 1e-5) is None
    assert "max rel err 1 " in kc.compare({2: np.full((8, 8), np.nan, "float32")}, ref, 1e-5)
    assert kc.compare({2: np.zeros((8, 8), "float32")}, ref, 1e-5).startswith("wrong result")
    half = ref[2].copy()
    half[0, 0] += 1.0
    assert "at output 2" in kc.compare({2: half}, ref, 1e-5)
    # the tolerance of the longest sums checked (400,000 terms) still fails a wrong sign and a
    # result 1% off
    for wrong in (-1.0, 1.01):
        assert kc.compare({2: ref[2] * wrong}, ref, kc.tolerance(400_000)).startswith("wrong")


def test_the_comparison_on_the_device_gives_the_hosts_verdict(target, rng):
    """:func:`kernel_check.compare_kernel` built for the OpenCL device (two outputs of other
    shapes) and :func:`kernel_check.verdict` give :func:`kernel_check.compare`'s verdict
    and worst error on each case: rounding passes, NaN, zeros, one far value, a wrong sign and
    a 1% error fail, a reference with non-finite elements is compared where it is finite."""
    from tvm import te
    shapes = [(3, 5, 7, 9), (13,)]
    xs = [te.placeholder(sh, "float32", f"x{k}") for k, sh in enumerate(shapes)]
    ys = [te.compute(shapes[0], lambda a, b, c, d: xs[0][a, b, c, d] * 2.0, name="y0"),
          te.compute(shapes[1], lambda a: xs[1][a] * 2.0, name="y1")]
    func = te.create_prim_func(xs + ys)
    spec = kc.check_spec(func)
    assert spec.written == (2, 3)
    lib = tvm.compile(tvm.IRModule({"main": kc.compare_kernel(func, spec, target)}),
                      target=target)
    dev = tvm.opencl(0)
    ref = {2: rng.standard_normal(shapes[0]).astype("float32"),
           3: rng.standard_normal(shapes[1]).astype("float32")}
    ref[3][4] = np.inf  # not compared there
    far = ref[2].copy()
    far.flat[int(rng.integers(far.size))] += 1.0
    nan3 = ref[3].copy()
    nan3[0] = np.nan
    cases = {"rounding": {2: ref[2] * (1 + 1e-6), 3: ref[3] * (1 + 1e-6)},
             "nan": {2: ref[2], 3: nan3}, "zeros": {2: np.zeros_like(ref[2]), 3: ref[3]},
             "far": {2: far, 3: ref[3]}, "sign": {2: -ref[2], 3: ref[3]},
             "1%": {2: ref[2], 3: ref[3] * 1.01}}
    for name, got in cases.items():
        sums = [tvm.runtime.tensor(np.zeros(1, "float32"), dev) for _ in range(4)]
        lib["main"](*[tvm.runtime.tensor(a, dev) for i in (2, 3) for a in (got[i], ref[i])],
                    *sums)
        values = [float(t.numpy()[0]) for t in sums]
        on_device = kc.verdict(dict(zip((2, 3), zip(values[0::2], values[1::2]))), 1e-5)
        on_host = kc.compare(got, ref, 1e-5)
        assert on_device == on_host, (name, on_device, on_host)
        assert (on_host is None) == (name == "rounding"), (name, on_host)


@T.prim_func(s_tir=True)
def _accumulate(X: T.Buffer((4, 16), "float32"), LABEL: T.Buffer((4,), "int64"),
                Y: T.Buffer((4, 16), "float32")):
    # an argument updated in place, and an integer input
    T.func_attr({"global_symbol": "main", "tirx.noalias": True})
    for i, j in T.grid(4, 16):
        with T.sblock("y"):
            vi, vj = T.axis.remap("SS", [i, j])
            Y[vi, vj] = Y[vi, vj] + X[vi, vj] * T.Cast("float32", LABEL[vi])


def _scaled_sqrt() -> tvm.IRModule:
    """Square roots (finite on about a quarter of signed inputs: drawn again positive), with
    an integer and a 0-d input."""
    x = te.placeholder((16, 64), name="X")
    label = te.placeholder((16,), "int64", name="LABEL")
    s = te.placeholder((), name="S")
    y = te.compute((16, 64), lambda i, j: (te.sqrt(x[i, j]) + te.sqrt(x[i, 63 - j])) * s[()]
                   + label[i].astype("float32"), name="Y")
    return tvm.IRModule({"main": te.create_prim_func([x, label, s, y])})


def _shifted_labels() -> tvm.IRModule:
    """An integer output (compared on the host)."""
    label = te.placeholder((3, 50), "int64", name="LABEL")
    out = te.compute((3, 50), lambda i, j: label[i, j] + label[i, 49 - j] * 2, name="OUT")
    return tvm.IRModule({"main": te.create_prim_func([label, out])})


def test_inputs_drawn_on_the_device_are_the_hosts_and_wrong_kernels_still_fail(target, rng):
    """The references of a tuning run, built as the tuner builds them, drawn on the device
    (OpenCL on PoCL, a fresh seed): every input is :func:`kernel_check.random_inputs`'s on the
    host bit for bit (random, never all zeros), outputs are poisoned and in-place arguments
    restored; the reference's outputs, kept on the device, are those of the host-drawn and
    uploaded inputs; a kernel whose inputs are signed where its reference is not finite is
    drawn again positive; and compared there, the right matmul passes while each wrong one
    fails."""
    from thomas_tune.measure.kept import keep_builder, take_builder
    seed = int(rng.integers(1 << 62))
    mods = [_matmul(), _scaled_sqrt(), _shifted_labels()]
    builder = take_builder(1, 120.0)  # as the tuner's references
    try:
        refs, paths = kr.build_references(mods, target, builder, seed)
    finally:
        keep_builder(builder)
    assert all(paths) and len(paths) == 3
    dev = tvm.opencl(0)
    libs = [tvm.runtime.load_module(p) for p in paths]
    for mod, ref, lib in zip(mods, refs, libs):
        func, spec = mod["main"], ref.spec
        shapes = kc.arg_shapes(func)
        for positive in (False, True):
            drawn = kr.DeviceArgs.drawn(lib[kc.FILL], func, spec, dev, seed, positive)
            host = kc.random_inputs(shapes, seed, positive)
            for i, (a, h) in enumerate(zip(drawn.args, host)):
                assert a.numpy().tobytes() == h.tobytes(), (mod, positive, i)
                if h.dtype.kind == "f":  # random, never zeros; integers 0 or 1
                    assert np.count_nonzero(h) > h.size // 2 and len(np.unique(h)) > h.size // 2
                else:
                    assert set(np.unique(h)) <= {0, 1}
            for i in spec.written:
                got = drawn.initial[i].numpy()
                if i in spec.updated:
                    assert np.array_equal(got, host[i])
                elif got.dtype.kind == "f":
                    assert np.isnan(got).all()
                else:
                    assert (got == np.iinfo(got.dtype).max).all()
        other = kc.random_inputs(shapes, seed + 1, positive=True)  # another seed, others
        assert not any(np.array_equal(a, b) for a, b in zip(other, host) if a.dtype.kind == "f")
        args, comparison, expected = kr.device_reference(lib, dev, func, seed, spec)
        uploaded, on_host = kr.reference_outputs(lib["main"], dev, func, seed, spec)
        for a, b in zip(args.args, uploaded.args):
            assert a.numpy().tobytes() == b.numpy().tobytes()
        if mod is mods[2]:  # integer outputs come back to the host and are compared there
            assert comparison is None and expected[1].tobytes() == on_host[1].tobytes()
            assert kc.compare(kr.run_checked(lib["main"], dev, args), expected, spec.tol) is None
            continue
        assert expected is None and comparison is not None
        for k, i in enumerate(spec.written):
            assert np.array_equal(comparison.expected[k].numpy(), on_host[i], equal_nan=True)
        assert kc.verdict(comparison.run(lib["main"], dev), spec.tol) is None
        sqrt_args, sqrt_outputs = args, on_host
    # the square root's inputs were drawn again positive: every output is finite
    assert (sqrt_args.args[0].numpy() >= 0.5).all() and np.isfinite(sqrt_outputs[3]).all()
    # an argument updated in place is restored to its input before each run
    spec = kc.check_spec(_accumulate)
    assert spec.updated == (2,)
    fill = tvm.compile(tvm.IRModule({"main": kc.fill_kernel(_accumulate, spec, target)}),
                       target=target)
    drawn = kr.DeviceArgs.drawn(fill["main"], _accumulate, spec, dev, seed)
    host = kc.random_inputs(kc.arg_shapes(_accumulate), seed)
    assert all(a.numpy().tobytes() == h.tobytes() for a, h in zip(drawn.args, host))
    assert drawn.initial[2].numpy().tobytes() == host[2].tobytes()
    _, matmul, _ = kr.device_reference(libs[0], dev, mods[0]["main"], seed, refs[0].spec)
    right = tvm.compile(tvm.IRModule({"main": _right}), target=target)
    assert kc.verdict(matmul.run(right["main"], dev), refs[0].spec.tol) is None
    for name, wrong in WRONG.items():
        lib = tvm.compile(tvm.IRModule({"main": wrong}), target=target)
        why = kc.verdict(matmul.run(lib["main"], dev), refs[0].spec.tol)
        assert why is not None and why.startswith("wrong result"), name
    for p in paths:
        shutil.rmtree(os.path.dirname(p), ignore_errors=True)


def test_a_kernel_writing_one_value_gets_its_reference_and_check(target, rng):
    """The loss kernel writes a 0-d tensor (the batch's mean loss, beside its rows' lanes): its
    references build as the tuner builds them (the comparison and finite-count kernels of one
    value each), and on PoCL its own default schedule passes the comparison while a loss 1%
    off fails it."""
    from thomas_tune.training_graph.loss import CrossEntropyLoss, cross_entropy
    from thomas_tune.measure.kept import keep_builder, take_builder
    from tvm import relax
    kernel = CrossEntropyLoss(relax.TensorType((4, 10), "float32"),
                              relax.TensorType((4,), "int64")).kernel.with_attr(
        "global_symbol", "main")
    seed = int(rng.integers(1 << 62))
    builder = take_builder(1, 120.0)  # as the tuner's references
    try:
        refs, paths = kr.build_references([tvm.IRModule({"main": kernel})], target, builder,
                                          seed)
    finally:
        keep_builder(builder)
    assert all(paths)
    dev, lib = tvm.opencl(0), tvm.runtime.load_module(paths[0])
    _, comparison, _ = kr.device_reference(lib, dev, kernel, seed, refs[0].spec)
    assert kc.verdict(comparison.run(lib["main"], dev), refs[0].spec.tol) is None
    x = tvm.te.placeholder((4, 10), "float32", "x")
    y = tvm.te.placeholder((4,), "int64", "y")
    ref, m, s = cross_entropy(x, y)  # the loss, and the rows' lanes the backward reads
    wrong = tvm.te.compute((), lambda: ref[()] * tvm.tirx.const(1.01, "float32"), name="w")
    bad = tvm.compile(kc.default_kernel(tvm.IRModule({"main": tvm.te.create_prim_func(
        [x, y, wrong, m, s])}), target), target=target)
    why = kc.verdict(comparison.run(bad["main"], dev), refs[0].spec.tol)
    assert why is not None and why.startswith("wrong result"), why
    shutil.rmtree(os.path.dirname(paths[0]), ignore_errors=True)


def test_tuner_runner_rejects_wrong_candidates_and_times_the_right_one(target):
    from thomas_tune.measure.builder import Builder
    from thomas_tune.tuning import measure_kernels, rpc_runner
    workload = _matmul()
    _, task, rounded = _relu6_mask_task(target)
    mods = [tvm.IRModule({"main": _right})] + [tvm.IRModule({"main": f}) for f in WRONG.values()]
    mods.append(rounded.mod)
    builder = Builder(max_workers=2, timeout_s=120)
    try:
        refs, paths = kr.build_references([workload, task.mod], target, builder)
        with rpc.loopback(key="pocl-check", servers=1, lifetime=300) as addr:
            runner = rpc_runner(addr, "pocl-check", wait_s=30)
            try:
                results = measure_kernels(mods, target, runner, builder,
                                          [refs[0]] * (1 + len(WRONG)) + [refs[1]])
            finally:
                runner.shutdown()
    finally:
        builder.shutdown()
    (secs, why), *wrong = results
    assert why is None and secs and all(s > 0 for s in secs)
    for name, (secs, why) in zip([*WRONG, "float16 register"], wrong):
        assert secs is None, f"{name}: timed {secs}"
        assert why.startswith("wrong result: max rel err"), f"{name}: {why}"


def test_export_leaves_out_and_replay_refuses_a_wrong_record(tmp_path, target, rng):
    """A tuning log whose record for the ReLU6 gradient is wrong (:func:`_relu6_mask_task`): export
    leaves it out and says so in the manifest, and the step's loss and every gradient then
    agree with PyTorch in float64 (:mod:`thomas_tune.step_check`); replay fails on the log
    before it compiles."""
    pytest.importorskip("torch")
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from thomas_tune.compiler.export import export
    from thomas_tune.models import init_params
    from thomas_tune.compiler.replay import replay
    from thomas_tune.export_check import check_export
    from thomas_tune.tasks import key
    from thomas_tune.logs import TuningLog
    model, task, sch = _relu6_mask_task(target)
    os.makedirs(tmp_path / "log")
    log = TuningLog(str(tmp_path / "log"))
    database = log.database(check=False)
    workload = database.commit_workload(task.mod)
    database.commit_tuning_record(ms.database.TuningRecord(
        sch.trace, workload, [1e-7], target, ArgInfo.from_prim_func(task.mod["main"])))
    params = init_params(model, seed=1)
    quiet = dict(batch=BATCH, trainable=TRAINABLE, progress=lambda *_: None)
    checked = export(str(tmp_path / "checked"), model, params, target, log=log, **quiet)
    assert set(checked.record_check["wrong"]) == {key(task)}
    assert checked.record_check["wrong"][key(task)].startswith("wrong result")
    right = check_export(str(tmp_path / "checked"), seed=int(rng.integers(1 << 30)))
    assert right.ok, right.line()
    report = replay(model, target, log, batch=BATCH, trainable=TRAINABLE, say=lambda *_: None)
    assert set(report.records_wrong) == {key(task)} and report.records_checked >= 1
    assert not report.compiled  # a wrong record fails the replay before it compiles


@pytest.mark.quick  # the step check's comparison, in the subset for edits (pytest -m quick)
def test_step_check_names_the_parameters_a_wrong_kernel_breaks(rng):
    """The comparison of a step with its float64 reference on three batches, with gradients
    of scales 1e-6 to 1 (each judged on its own): rounding at PyTorch float32's level passes;
    a gradient that a kernel writing zeros leaves at 0, one with the wrong sign and one 1% too
    large fail by name, the smallest gradient too; an error on one batch only fails (every
    batch counts); a loss off by more than float32 rounding fails; no bound is above CAP,
    whatever the yardstick; a bias whose gradient cancels is judged on its sum of absolute
    terms."""
    from thomas_tune.step_check import CAP, CHECK_BATCHES, compare_step
    scales = {f"p{i}": 10.0 ** -(2 * i) for i in range(4)}  # p3: 1e-6 of p0
    refs = [{k: s * rng.standard_normal((16, 8)) for k, s in scales.items()}
            for _ in range(CHECK_BATCHES)]

    def rounded(rel):
        return [{k: v * (1 + rel * rng.standard_normal(v.shape)) for k, v in r.items()}
                for r in refs]

    losses = [2.5] * CHECK_BATCHES
    torch32 = compare_step(losses, rounded(1e-6), losses, refs)  # the yardstick
    assert torch32.ok and torch32.worst[1] < 1e-5 and not torch32.dead, torch32.line()

    def check(grads, loss=2.5, yard=torch32.errors):
        return compare_step([loss] * CHECK_BATCHES, grads, losses, refs, yard,
                            torch32.loss_err)

    ours = rounded(2e-6)
    assert check(ours).ok, check(ours).line()
    for p in scales:
        for name, wrong in (("zeros", 0.0), ("sign", -1.0), ("1%", 1.01)):
            bad = check([dict(g, **{p: r[p] * wrong}) for g, r in zip(ours, refs)])
            assert not bad.ok and bad.failing == [p], (p, name, bad.line())
            assert bad.errors[p] == pytest.approx(abs(1 - wrong), rel=1e-3), (p, name)
            assert bad.line().startswith("WRONG") and p in bad.line()
    one_batch = [dict(g) for g in ours]
    one_batch[1]["p3"] = one_batch[1]["p3"] * 1.01
    assert check(one_batch).failing == ["p3"], check(one_batch).line()
    assert not check(ours, loss=2.5 * (1 + 1e-4)).ok
    huge = check(ours, yard={k: 0.5 for k in scales})  # PyTorch float32 itself far off
    assert max(huge.bounds.values()) == CAP
    two = check([dict(g, p0=r["p0"] * 1.02) for g, r in zip(ours, refs)], yard={"p0": 0.5})
    assert two.failing == ["p0"], two.line()
    # a bias whose float64 gradient is 1e-15 of its terms: judged on CANCELLED x their sum
    zero = [{"conv.bias": np.full(4, 1e-15)} for _ in range(CHECK_BATCHES)]
    sums = [{"conv.bias": np.full(4, 1.0)} for _ in range(CHECK_BATCHES)]
    noise = [{"conv.bias": np.full(4, 1e-8)} for _ in range(CHECK_BATCHES)]
    assert compare_step(losses, noise, losses, zero, sums=sums).ok
    assert not compare_step(losses, noise, losses, zero).ok  # on its own scale: 1e7


@pytest.mark.quick
def test_a_dead_layer_is_named_and_fails_the_check(rng):
    """A weight whose reference gradient is zero on every check batch (here AlexNet's last
    hidden layer, its input made all zero by a large negative bias before the ReLU) cannot show
    an error: the check fails and names it, and a bias whose gradient is zero is not dead."""
    pytest.importorskip("torch")
    from conftest import SMALL

    from thomas_tune.training_graph import graph as G
    from thomas_tune.models import build, init_params
    from thomas_tune.step_check import reference_steps
    model = build("alexnet", **SMALL["alexnet"])
    tensors = init_params(model, seed=int(rng.integers(1 << 30)))
    names = G.select_trainable(model, "all")
    alive = reference_steps(model, tensors, names, 2, int(rng.integers(1 << 30)))["yardstick"]
    assert not alive.dead, alive.line()
    tensors["classifier.1.bias"] = np.full_like(tensors["classifier.1.bias"], -1e3)
    dead = reference_steps(model, tensors, names, 2, int(rng.integers(1 << 30)))["yardstick"]
    assert "classifier.4.weight" in dead.dead and "classifier.4.bias" not in dead.dead
    assert not dead.ok and "dead layer" in dead.line(), dead.line()


def test_a_batchnorm_over_too_few_values_is_not_checked_to_the_bounds():
    """A small MobileNetV2 at 4 images of 32x32 normalises 4 values per channel in its last
    BatchNorms, under the 8 the bounds were measured for: the check fails it as not
    checkable, naming the layer; at 8 images it does not."""
    pytest.importorskip("torch")
    from thomas_tune.training_graph import graph as G
    from thomas_tune.models import build, init_params
    from thomas_tune.step_check import MIN_BN_VALUES, reference_steps
    model = build("mobilenet_v2", num_classes=5, resolution=32, width=0.35)
    tensors = init_params(model, seed=2)
    names = G.select_trainable(model, "last:1")
    few = reference_steps(model, tensors, names, 4, seed=3, batches=1)["yardstick"]
    assert few.few_bn_values is not None and few.few_bn_values[1] == 4 < MIN_BN_VALUES
    assert not few.ok and "not checkable" in few.line(), few.line()
    enough = reference_steps(model, tensors, names, 8, seed=3, batches=1)["yardstick"]
    assert enough.few_bn_values is None


def test_the_record_check_builds_nothing():
    """record_check checks the records a build plan applies and returns the wrong ones: it
    imports nothing of the build above it (compile, tasks, export, build_plan), anywhere in
    the module, so the plan is made and remade in one place."""
    import ast

    from thomas_tune.compiler import record_check
    with open(record_check.__file__) as f:
        tree = ast.parse(f.read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    imported |= {f"{n.module or ''}.{a.name}".strip(".") for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.level for a in n.names}
    assert not imported & {"compile", "tasks", "export", "build_plan", "replay"}, imported


def test_log_check_sets_a_wrong_record_aside(tmp_path, target):
    """``log check --records`` (:func:`thomas_tune.compiler.build_plan.set_aside_wrong`) moves the
    wrong ReLU6-gradient record to ``database_tuning_record.json.rejected`` with its reason,
    and the plan made from the log afterwards applies no record of that kernel."""
    import json

    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from thomas_tune.training_graph import graph as G
    from thomas_tune.compiler.build_plan import BuildPlan, set_aside_wrong
    from thomas_tune.logs import TuningLog
    model, task, sch = _relu6_mask_task(target)
    os.makedirs(tmp_path / "log")
    log = TuningLog(str(tmp_path / "log"))
    database = log.database(check=False)
    database.commit_tuning_record(ms.database.TuningRecord(
        sch.trace, database.commit_workload(task.mod), [1e-7], target,
        ArgInfo.from_prim_func(task.mod["main"])))
    graphs = {"train": G.training_module(model, BATCH, TRAINABLE).mod}
    said = []
    assert set_aside_wrong(log, target, graphs, say=said.append) == 1
    assert len(said) == 1 and "1 wrong record(s) set aside" in said[0], said
    with open(log.record_path + ".rejected") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 1 and rows[0]["reason"].startswith("wrong result"), rows
    plan = BuildPlan.from_log(TuningLog(str(tmp_path / "log")), target, graphs)
    assert plan.database.query_tuning_record(task.mod, target, "main") is None
