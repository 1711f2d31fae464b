"""An export with a memory budget beside the same export without one, in one process.

    python bench/memory_budget.py PLAIN_EXPORT BUDGET_EXPORT [--steps 30] [--check] [--torch]
        [--out bench/results/memory_budget.json]

Both exports (``thomas-tune export``, the second with ``--memory-budget MB``, or at another
``--precision``: the first is "plain", the second "budget" in the output) are timed side by
side (``benchmark.timing.time_interleaved``: interleaved rounds, medians with interquartile
ranges, OpenCL's device timer where there is one); for each: the device's peak in a fresh
process (``benchmark.device_memory``), the compiled step's estimate
(``memory_plan.compiled_step_memory`` with the export's recomputation and precision), the
bytes its kernels
are given per step and its launches (``benchmark.exports.export_counters``). With ``--check``
every export's loss and gradients are checked against PyTorch float64
(``export_check.check_export``). With ``--torch``, PyTorch eager's float32 step of the plain
export's network, parameters, trainable set and optimizer (``benchmark.timing.TorchSide``, its
``cudnn.benchmark`` setting chosen first) is timed in the same rounds ("torch" in the output).
Prints one line per side and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os


def _describe(export_dir: str, side, seed: int) -> dict:
    from thomas_tune.benchmark.exports import export_counters
    from thomas_tune.manifest import Manifest
    from thomas_tune.memory_plan import compiled_step_memory
    from thomas_tune.models import load_checkpoint
    from thomas_tune.training_graph.optimizers import OptimizerConfig
    from thomas_tune.recompute import RecomputePlan
    m = Manifest.read(export_dir)
    model, _, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))
    opt = m.optimizer
    optimizer = OptimizerConfig(**{**opt, "betas": tuple(opt["betas"])})
    budget = m.memory_budget or {}
    from thomas_tune.training_graph.winograd_form import Conv
    wino = {Conv.from_dict(d) for d in (m.winograd or {}).get("training", [])}
    precision = m.precision or "float32"
    estimate = compiled_step_memory(model, m.batch, m.trainable, optimizer,
                                    winograd=wino or None,
                                    budget_plan=RecomputePlan(budget.get("level", "none")),
                                    precision=precision)
    return {"precision": precision, "budget_bytes": budget.get("budget_bytes"),
            "level": budget.get("level", "none"),
            "flops_added": budget.get("flops_added", 0), "estimate_bytes": estimate.peak,
            **export_counters(side, export_dir, seed)}


def _torch_side(export_dir: str, sides: dict, a) -> dict:
    """PyTorch eager's side of ``export_dir``'s step added to ``sides`` as "torch"; its
    ms per step with ``cudnn.benchmark`` off and on (the faster kept)."""
    from thomas_tune.benchmark.timing import TorchSide
    from thomas_tune.manifest import Manifest
    from thomas_tune.models import load_checkpoint
    from thomas_tune.step_check import manifest_frozen_bn
    from thomas_tune.training_graph.optimizers import OptimizerConfig
    m = Manifest.read(export_dir)
    model, tensors, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))
    opt = m.optimizer
    sides["torch"] = TorchSide(model, tensors, list(m.trainable),
                               OptimizerConfig(**{**opt, "betas": tuple(opt["betas"])}),
                               m.batch, m.infer_batch, a.seed, frozen_bn=manifest_frozen_bn(m))
    return sides["torch"].choose_cudnn_benchmark(a.steps, a.warmup)


def _write(path: str, res: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=float)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("exports", nargs=2, help="the export without a budget, then with one")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="check each step against float64")
    p.add_argument("--torch", action="store_true",
                   help="time PyTorch eager's step of the plain export's network beside them")
    p.add_argument("--out", default="bench/results/memory_budget.json")
    a = p.parse_args()
    from thomas_tune.benchmark.timing import ExportSide, as_result, time_interleaved
    names = ["plain", "budget"]
    sides = {n: ExportSide(d, a.seed) for n, d in zip(names, a.exports)}
    by_setting = _torch_side(a.exports[0], sides, a) if a.torch else None
    timed = time_interleaved(sides, a.steps, a.warmup)
    res = {}
    for n, d in zip(names, a.exports):
        res[n] = {"export": d, **as_result(timed[n]), **_describe(d, sides[n], a.seed)}
    if by_setting is not None:
        from thomas_tune.benchmark.timing import torch_result
        res["torch"] = torch_result(sides["torch"], by_setting, timed["torch"])
    _write(a.out, res)  # the figures before the checks, which take minutes at 224 px
    if a.check:
        from thomas_tune.export_check import check_export
        for n in reversed(names):  # the budgeted (or other) build first
            c = check_export(res[n]["export"], seed=a.seed)
            res[n]["check"] = {"ok": c.ok, "line": c.line()}
            _write(a.out, res)
    for n, r in res.items():
        ms = r["train_device_ms"] or r["train_ms"]
        if n == "torch":
            print(f" torch: {ms:.2f} ms/step, PyTorch eager float32, peak "
                  f"{(r['device_peak_bytes'] or 0) / 1e6:.1f} MB (its allocator's)")
            continue
        args = r["launch_arg_bytes_per_step"]
        print(f"{n:>6}: {ms:.2f} ms/step, peak {r['device_peak_bytes'] / 1e6:.1f} MB measured "
              f"({r['estimate_bytes'] / 1e6:.1f} estimated), "
              f"{'-' if args is None else format(args / 1e6, '.1f')} MB/step, "
              f"{r['precision']}, {r['level']} recomputation"
              + (f"; {r['check']['line']}" if a.check else ""))
    ratio = (res["budget"]["train_device_ms"] or res["budget"]["train_ms"]) / (
        res["plain"]["train_device_ms"] or res["plain"]["train_ms"])
    print(f"budgeted step time: {ratio:.2f}x the plain step's")


if __name__ == "__main__":
    main()
