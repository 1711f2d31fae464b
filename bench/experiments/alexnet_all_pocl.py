"""Why AlexNet@224 `all` from the H100 log fails the step check on `features.0.weight`,
reproduced on PoCL: the first layer's kernels as the log tunes them, and the build's decisions
at the first max pool.

    python3 bench/experiments/alexnet_all_pocl.py EXPORT OUT.json [--log LOG]

EXPORT: an export of AlexNet 1.0@224, 1000 classes, batch 32, every layer, from the H100 log
for the H100 target, built here (``thomas-tune export ... --target targets/h100_opencl.json
--any-codegen --no-check --log tuning_logs/h100/alexnet-w1-r224-c1000-b32``; its kernels run
on PoCL). On this machine's OpenCL device:

1. the log's best record of the first layer's weight gradient (11x11, stride 4, pad 2, 3 input
   channels, 55x55 output) and the task's default schedule, each against PyTorch float64
   (``conv2d_weight``) on the check images with PyTorch float32's output gradient of that
   layer, on the record check's inputs and on standard normal inputs: ``max |got - ref| /
   max |ref|``;
2. per check batch, the log's record of the first convolution (with its bias and ReLU) run on
   the batch: its ReLU decisions and max-pool windows whose argmax is not float64's first
   maximum (the rank of the build's choice in float64's order, the window's exact ties);
3. per check batch, the export's step (PoCL) against float64 with its own decisions, against
   float64 with the first pool's windows decided as the build's first convolution decides
   them, and with the second pool's too (the log's second convolution run on the build's
   first pool output).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def _records(log, target):
    """The best records of the log for the first convolution and its weight gradient (the
    workloads whose parameters include a (64, 3, 11, 11) tensor): {"forward"|"wgrad": record}."""
    from thomas_tune.compiler.compile import tuned_build
    db, _, _ = tuned_build(log, target)
    out = {}
    for r in db.get_all_tuning_records():
        f = r.workload.mod["main"]
        shapes = [tuple(int(s) for s in p.shape) for p in f.params]
        if (192, 64, 5, 5) in shapes and len(shapes) == 4 and shapes[-1] == (32, 192, 27, 27):
            which = "forward3"
        elif (64, 3, 11, 11) not in shapes:
            continue
        else:
            which = "wgrad" if shapes[-1] == (64, 3, 11, 11) else "forward"
        if which not in out:
            out[which] = db.query_tuning_record(r.workload.mod, target, "main")
    return out


def _build(mods, target):
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from thomas_tune.measure.builder import Builder
    b = Builder(max_workers=1, timeout_s=600)
    try:
        built = b.build([ms.builder.BuilderInput(m, target) for m in mods])
    finally:
        b.shutdown()
    return [tvm.runtime.load_module(str(x.artifact_path))["main"] for x in built]


def _run(fn, dev, arrays, out_shape):
    import tvm
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    args.append(tvm.runtime.tensor(np.full(out_shape, np.nan, "float32"), dev))
    fn(*args)
    dev.sync()
    return args[-1].numpy()


def main():
    import torch
    import torch.nn.functional as F
    import tvm

    from thomas_tune import kernel_check as kc
    from thomas_tune.kink_step import torch_forward
    from thomas_tune.kinks import numpy_of
    from thomas_tune.logs import TuningLog
    from thomas_tune.models import load_checkpoint
    from thomas_tune.step_check import CHECK_BATCHES, batch, dropout_masks, gradient_errors
    from thomas_tune.step_run import export_step
    from thomas_tune.trainable import select_trainable

    p = argparse.ArgumentParser()
    p.add_argument("export")
    p.add_argument("out")
    p.add_argument("--log", default="tuning_logs/h100/alexnet-w1-r224-c1000-b32")
    p.add_argument("--target", default="targets/h100_opencl.json")
    a = p.parse_args()
    with open(a.target) as f:
        target = tvm.target.Target(json.load(f))
    dev = tvm.opencl(0)
    recs = _records(TuningLog(a.log), target)
    model, tensors, _ = load_checkpoint(os.path.join(a.export, "params.npz"))
    names_all = select_trainable(model, "all")
    res = {"wgrad": {}, "batches": []}

    # 1. the weight gradient's record and default schedule against float64
    wl = recs["wgrad"].workload.mod
    default, record = _build([kc.default_kernel(wl, target), kc.record_kernel(recs["wgrad"])],
                             target)
    x0, y0 = batch(model, 32, 0)
    loss, g, params, names = torch_forward(model, tensors, names_all, x0, y0, device="cpu",
                                           dtype="float32", masks=dropout_masks(model, 32, 0))
    torch.autograd.grad(loss, params)
    dy_check = (g.kinks[0].dy * g.kinks[0].decision).detach().numpy().astype("float32")
    rng = np.random.default_rng(1)
    cases = {"check images": (x0, dy_check),
             "record check inputs": tuple(kc.random_inputs(
                 [((32, 3, 224, 224), "float32"), ((32, 64, 55, 55), "float32")], 0)),
             "standard normal": (rng.standard_normal((32, 3, 224, 224)).astype("float32"),
                                 rng.standard_normal((32, 64, 55, 55)).astype("float32"))}
    for case, (x, dy) in cases.items():
        ref = torch.nn.grad.conv2d_weight(torch.tensor(x, dtype=torch.float64), (64, 3, 11, 11),
                                          torch.tensor(dy, dtype=torch.float64), stride=4,
                                          padding=2).numpy()
        row = {}
        for label, fn in (("default", default), ("record", record)):
            got = _run(fn, dev, [x, dy], (64, 3, 11, 11))
            row[label] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        res["wgrad"][case] = row
        print(f"weight gradient, {case}: {row}", flush=True)

    # 2. and 3. per check batch
    forward, forward3 = _build([kc.record_kernel(recs["forward"]),
                                kc.record_kernel(recs["forward3"])], target)
    w0 = tensors["features.0.weight"].astype("float32")
    b0 = tensors["features.0.bias"].astype("float32")
    for s in range(CHECK_BATCHES):
        t0 = time.time()
        x, y = batch(model, 32, s)
        masks = dropout_masks(model, 32, s)
        y32 = torch.tensor(_run(forward, dev, [x, w0, b0.reshape(1, 64, 1, 1)],
                                (32, 64, 55, 55)))
        c64 = F.conv2d(torch.tensor(x, dtype=torch.float64), torch.tensor(w0, dtype=torch.float64),
                       torch.tensor(b0, dtype=torch.float64), stride=4, padding=2)
        y64 = c64.clamp_min(0)
        u32 = F.unfold(y32.reshape(-1, 1, 55, 55), 3, stride=2)
        u64 = F.unfold(y64.reshape(-1, 1, 55, 55), 3, stride=2)
        f32, f64 = u32.argmax(1), u64.argmax(1)
        moved = []
        for nc, w in (f32 != f64).nonzero().tolist():
            col = u64[nc, :, w]
            order = sorted(range(9), key=lambda i: (-float(col[i]), i))
            moved.append({"window": [nc // 64, nc % 64, w], "rank": order.index(int(f32[nc, w])),
                          "exact_ties": int((col == col[order[0]]).sum()),
                          "gap": float(col[order[0]] - col[int(f32[nc, w])]),
                          "max": float(col.max())})
        loss_b, grads_b = export_step(a.export, x, y, masks=masks, tensors=tensors)[:2]
        loss, g, params, names = torch_forward(model, tensors, names_all, x, y, device="cpu",
                                               masks=masks)
        own = numpy_of(names, torch.autograd.grad(loss, params, retain_graph=True))
        k = g.kinks[1]
        dec = k.decision.clone()
        for m in moved:
            n, c, w = m["window"]
            oh, ow = divmod(w, 27)
            i, j = divmod(int(f32[n * 64 + c, w]), 3)
            dec[n, c, w] = (2 * oh + i) * 55 + 2 * ow + j
        k.decision = dec
        taken = numpy_of(names, torch.autograd.grad(loss, params, retain_graph=True))
        # the second pool: the log's second convolution on the build's first pool output
        p0 = F.max_pool2d(y32, 3, 2).numpy()
        y3 = torch.tensor(_run(forward3, dev, [p0, tensors["features.3.weight"].astype("float32"),
                                              tensors["features.3.bias"].astype(
                                                  "float32").reshape(1, 192, 1, 1)],
                               (32, 192, 27, 27)))
        k3 = g.kinks[3]
        x3 = k3.x.detach().clamp_min(0)
        v32 = F.unfold(y3.reshape(-1, 1, 27, 27), 3, stride=2)
        v64 = F.unfold(x3.reshape(-1, 1, 27, 27), 3, stride=2)
        moved3 = []
        dec3 = k3.decision.clone()
        for nc, w in (v32.argmax(1) != v64.argmax(1)).nonzero().tolist():
            n, c = divmod(nc, 192)
            oh, ow = divmod(w, 13)
            i, j = divmod(int(v32.argmax(1)[nc, w]), 3)
            dec3[n, c, w] = (2 * oh + i) * 27 + 2 * ow + j
            moved3.append({"window": [n, c, w], "dy": float(k3.dy.reshape(32, 192, -1)[n, c, w]),
                           "from": int(k3.decision[n, c, w]), "to": int(dec3[n, c, w])})
        k3.decision = dec3
        both = numpy_of(names, torch.autograd.grad(loss, params))
        e_own, e_taken = gradient_errors(grads_b, own), gradient_errors(grads_b, taken)
        e_both = gradient_errors(grads_b, both)
        row = {"relu_decisions_moved": int(((y32 > 0) != (y64 > 0)).sum()),
               "pool_windows_moved": moved, "loss": [float(loss_b), float(loss.detach())],
               "errors_own": e_own, "errors_with_pool_flips": e_taken,
               "second_pool_windows_moved": moved3, "errors_with_both_pools": e_both,
               "seconds": time.time() - t0}
        res["batches"].append(row)
        print(f"batch {s}: ReLU decisions moved {row['relu_decisions_moved']}, pool windows "
              f"moved {[(m['rank'], m['exact_ties']) for m in moved]}; features.0.weight "
              f"{e_own['features.0.weight']:.2e} -> {e_taken['features.0.weight']:.2e}, "
              f"features.0.bias {e_own['features.0.bias']:.2e} -> "
              f"{e_taken['features.0.bias']:.2e}; second pool windows moved {moved3}, then "
              f"worst {max(e_both.values()):.2e}", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
