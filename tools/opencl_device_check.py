"""OpenCL on a real GPU: kernels and the MobileNetV2 training step, checked and timed.

Two steps, so that the GPU machine needs only TVM's runtime (``TVM_USE_RUNTIME_LIB=1``):

    python tools/opencl_device_check.py prepare DIR   # here: compile for an NVIDIA OpenCL target
    python tools/opencl_device_check.py run DIR       # there: build the sidecar, run, compare
    python tools/opencl_device_check.py run DIR kernels   # the kernels alone

``prepare`` compiles an element-wise, a reduction, a matmul and a conv2d kernel (the last two
from thomas_tune's OpenCL search space: thread bindings, shared memory), and exports MobileNetV2
(width 0.35, 64x64, batch 8, all layers trainable) for OpenCL and for llvm. ``run`` checks every
kernel against numpy in float64, times it with the sidecar's device timer (GFLOP/s), runs the
OpenCL and the llvm training step on the same batch, compares them, and reports ms per step.
"""

import json
import os
import sys
import time

import numpy as np

N = 512  # matmul size
CANDIDATES = 8  # schedules sampled from the search space for matmul and conv2d (a tiny search)
CONV = dict(data=(8, 64, 32, 32), weight=(128, 64, 3, 3))


def prepare(out):
    import tvm
    from tvm import te, topi
    from tvm.s_tir import meta_schedule as ms

    from thomas_tune.schedules import default_gpu_schedules
    from thomas_tune.compiler.export import export
    from thomas_tune.models import build, init_params
    from thomas_tune.schedules import space_generator
    from thomas_tune.target import parse_target

    target = parse_target({"kind": "opencl", "max_threads_per_block": 1024,
                           "max_num_threads": 1024, "max_shared_memory_per_block": 49152,
                           "thread_warp_size": 1})
    os.makedirs(out, exist_ok=True)

    def sampled(mod, seed=1):
        # a random schedule of the search space that passes the postprocessors (VerifyGPUCode
        # rejects work-groups and shared memory over the target's limits), as a tuner's trial
        for attempt in range(200):
            ctx = ms.TuneContext(mod=mod, target=target, space_generator=space_generator(target),
                                 search_strategy="replay-trace", task_name="k",
                                 rand_state=seed + 1000 * attempt, num_threads=1)
            sch = ctx.generate_design_space()[0]
            if all(p.apply(sch) for p in ctx.space_generator.postprocs):
                return sch.mod
        raise RuntimeError("no valid schedule in 200 samples")

    def save(name, mod):
        tvm.compile(mod, target).export_library(os.path.join(out, f"{name}.so"))

    a = te.placeholder((1 << 22,), name="a")
    b = te.placeholder((1 << 22,), name="b")
    c = te.compute(a.shape, lambda i: a[i] * b[i] + te.exp(a[i] * 0.1), name="c")
    save("elementwise", default_gpu_schedules(
        tvm.IRModule({"main": te.create_prim_func([a, b, c])}), target))
    r = te.placeholder((4096, 1024), name="r")
    k = te.reduce_axis((0, 1024), name="k")
    s = te.compute((4096,), lambda i: te.sum(r[i, k] * r[i, k], axis=k), name="s")
    save("reduction", default_gpu_schedules(
        tvm.IRModule({"main": te.create_prim_func([r, s])}), target))
    x = te.placeholder((N, N), name="x")
    y = te.placeholder((N, N), name="y")
    k = te.reduce_axis((0, N), name="k")
    z = te.compute((N, N), lambda i, j: te.sum(x[i, k] * y[k, j], axis=k), name="z")
    for i in range(CANDIDATES):
        save(f"matmul_{i}", sampled(tvm.IRModule({"main": te.create_prim_func([x, y, z])}), i + 1))
    d = te.placeholder(CONV["data"], name="d")
    w = te.placeholder(CONV["weight"], name="w")
    o = topi.nn.conv2d_nchw(d, w, 1, 1, 1)
    for i in range(CANDIDATES):
        save(f"conv2d_{i}", sampled(tvm.IRModule({"main": te.create_prim_func([d, w, o])}), i + 1))

    model = build("mobilenet_v2", num_classes=10, resolution=64, width=0.35)
    params = init_params(model, seed=0)
    for name, tgt in (("mnv2_opencl", target), ("mnv2_llvm", parse_target("llvm"))):
        if os.path.exists(os.path.join(out, name, "manifest.json")):
            continue  # exported already (delete the folder to export again)
        export(os.path.join(out, name), model, params, tgt, batch=8, trainable="all")


def run(out, only=None):
    import tvm
    from tvm.runtime.vm import VirtualMachine  # runtime-only: no relax compiler needed

    from thomas_tune import opencl

    opencl.load()
    print("OpenCL devices:", opencl.devices())
    dev = tvm.opencl(0)
    rng = np.random.default_rng(int(time.time()))
    report = {"device": dev.device_name}

    def kernel(name, inputs, ref, flops, out_shape, candidates=None):
        # candidates: sampled schedules of one workload; each is checked and timed, the fastest
        # is reported, and launches the device refuses (e.g. too many registers for the
        # work-group) are counted as failed trials, as the tuner does.
        best, failed = None, []
        for cand in ([name] if candidates is None else
                     [f"{name}_{i}" for i in range(candidates)]):
            lib = tvm.runtime.load_module(os.path.join(out, f"{cand}.so"))
            args = [tvm.runtime.tensor(v.astype("float32"), dev) for v in inputs]
            res = tvm.runtime.empty(out_shape, "float32", dev)
            print(f"  {cand}: launching", flush=True)
            try:
                lib["main"](*args, res)
                dev.sync()
            except Exception as e:  # noqa: BLE001 - reported below
                msg = " | ".join(x for x in str(e).replace("\x00", "").splitlines()
                                if x.strip() and not x.startswith("  File"))
                failed.append(f"{cand}: {msg[-600:]}")
                continue
            err = float(np.abs(res.numpy() - ref).max() / max(np.abs(ref).max(), 1e-12))
            assert err < 1e-4, (cand, err)
            t = lib.time_evaluator("main", dev, number=1, repeat=1)(*args, res).mean
            print(f"  {cand}: {t * 1e3:.3f} ms (one run)", flush=True)
            if t < 0.05:  # repeat only the plausible ones: a random schedule can be very slow
                t = lib.time_evaluator("main", dev, number=10, repeat=3)(*args, res).mean
            row = {"schedule": cand, "rel_err_vs_float64": err, "ms": t * 1e3,
                   "GFLOP/s": flops / t / 1e9}
            if best is None or row["ms"] < best["ms"]:
                best = row
        report[name] = dict(best or {}, failed_launches=failed)
        print(name, report[name], flush=True)

    a, b = rng.standard_normal(1 << 22), rng.standard_normal(1 << 22)
    kernel("elementwise", [a, b], a * b + np.exp(a * 0.1), 4 * (1 << 22), (1 << 22,))
    r = rng.standard_normal((4096, 1024))
    kernel("reduction", [r], (r * r).sum(1), 2 * r.size, (4096,))
    x, y = rng.standard_normal((N, N)), rng.standard_normal((N, N))
    kernel("matmul", [x, y], x @ y, 2 * N ** 3, (N, N), CANDIDATES)
    d, w = rng.standard_normal(CONV["data"]), rng.standard_normal(CONV["weight"])
    ref = np.zeros((8, 128, 32, 32))
    dp = np.pad(d, ((0, 0), (0, 0), (1, 1), (1, 1)))
    for i in range(3):
        for j in range(3):
            ref += np.einsum("nchw,oc->nohw", dp[:, :, i:i + 32, j:j + 32], w[:, :, i, j])
    kernel("conv2d", [d, w], ref, 2 * ref.size * 64 * 9, ref.shape, CANDIDATES)

    if only == "kernels":
        print(json.dumps(report, indent=1))
        return
    x = rng.standard_normal((8, 3, 64, 64)).astype("float32")
    y = rng.integers(0, 10, 8).astype("int64")
    losses, grads, times, step_ms, curves = {}, {}, {}, {}, {}
    for name, device in (("mnv2_opencl", dev), ("mnv2_llvm", tvm.cpu())):
        folder = os.path.join(out, name)
        m = json.load(open(os.path.join(folder, "manifest.json")))
        p = np.load(os.path.join(folder, "params.npz"))
        vm = VirtualMachine(tvm.runtime.load_module(os.path.join(folder, "train.so")),
                                  device)
        t = lambda v: tvm.runtime.tensor(np.asarray(v), device)  # noqa: E731
        masks = [t(np.ones(s["shape"], "float32")) for s in m["masks"].values()]
        args = [t(x), *masks, *[t(p[n]) for n in m["frozen"] + m["trainable"] + m["states"]],
                t(y)]
        ret, g = vm["train_adjoint"](*args)
        losses[name] = float(ret[0].numpy())
        grads[name] = [v.numpy() for v in g]
        f = vm.time_evaluator("train_adjoint", device, number=3, repeat=3)
        times[name] = f(*args).mean * 1e3
        # whole training steps (forward, backward, BN state, momentum SGD update), wall clock
        nf, nt = len(m["frozen"]), len(m["trainable"])
        first = 1 + len(masks)
        params = args[first + nf:first + nf + nt]
        opt = np.load(os.path.join(folder, "optim_state.npz"))
        state = [t(opt[f"s{i}"]) for i in range(len(opt.files))]
        curve, wall = [], []
        for _ in range(12):
            t0 = time.perf_counter()
            ret, g = vm["train_adjoint"](*args)
            params, state = vm["optimizer"](list(params), g, state)
            params = list(params)
            args[first + nf:first + nf + nt] = params
            args[first + nf + nt:-1] = list(ret)[1:]
            curve.append(float(ret[0].numpy()))
            wall.append((time.perf_counter() - t0) * 1e3)
        step_ms[name] = float(np.median(wall[2:]))
        curves[name] = curve
    biggest = max(np.abs(v).max() for v in grads["mnv2_llvm"])
    worst = max(np.abs(a - b).max() for a, b in zip(grads["mnv2_opencl"], grads["mnv2_llvm"]))
    report["mobilenet_v2_training"] = {
        "loss_opencl": losses["mnv2_opencl"], "loss_llvm": losses["mnv2_llvm"],
        "grad_max_abs_diff_over_max_grad": float(worst / biggest),
        "ms_per_forward_backward_opencl": times["mnv2_opencl"],
        "ms_per_forward_backward_llvm_cpu": times["mnv2_llvm"],
        "ms_per_training_step_opencl": step_ms["mnv2_opencl"],
        "ms_per_training_step_llvm_cpu": step_ms["mnv2_llvm"],
        "loss_over_12_steps_on_one_batch_opencl": curves["mnv2_opencl"],
        "loss_over_12_steps_on_one_batch_llvm": curves["mnv2_llvm"]}
    print(json.dumps(report, indent=1))
    if os.environ.get("OUT"):
        json.dump(report, open(os.path.join(os.environ["OUT"], "opencl_report.json"), "w"),
                  indent=1)


if __name__ == "__main__":
    {"prepare": prepare, "run": run}[sys.argv[1]](*sys.argv[2:])
