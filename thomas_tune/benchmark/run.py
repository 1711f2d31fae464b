"""The whole bench: every variant timed on one device, and its report."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from .checks import bench_reference, check_variants
from .compiled import compiled_side, graphs_now
from .curve import tuning_curve
from .exports import export_counters, startup
from .kernels import exported_training_module, mark_tuned, step_kernels, time_kernels
from .peaks import device_description, measure_peaks
from .timing import ExportSide, TorchSide, as_result, time_interleaved, torch_result
from .torch_baseline import torch_device


@dataclass
class BenchConfig:
    """What to run: steps (timed runs per measurement), warm-up runs, kernels (rows of the
    kernel table; 0 skips per-kernel timing), kernel_min_ms (length of one timed repeat of a
    kernel), startup (first/second start), torch (PyTorch eager), torch_compile (PyTorch with
    ``torch.compile``: compiled before timing, checked as the builds are), refresh_peaks, seed,
    check (each build's loss and gradients against PyTorch before it is timed; a wrong build is
    not timed)."""

    steps: int = 20
    warmup: int = 2
    kernels: int = 12
    kernel_min_ms: float = 1.0
    startup: bool = True
    torch: bool = True
    torch_compile: bool = False
    refresh_peaks: bool = False
    seed: int = 0
    progress: bool = True
    check: bool = True


def run_bench(model, tensors, target, exports: dict, cfg: BenchConfig, log_path: str | None,
              trainable: str, optimizer, say=print) -> dict:
    """Measure every variant of ``exports`` (variant -> export folder), PyTorch eager, peaks,
    kernels, start-up and the tuning curve (see the module docstring). Returns the result
    dict that :func:`thomas_tune.benchmark.report.format_report` prints and the ``--json``
    file holds. Raises ValueError for an OpenCL target without an OpenCL device here."""
    from ..manifest import Manifest
    from ..training_graph.graph import training_module
    from ..runtime import device_for
    first = Manifest.read(next(iter(exports.values())))
    batch, infer_batch = first.batch, first.infer_batch
    kind = target.kind.name
    dev = device_for(kind)
    if kind == "opencl" and not dev.exist:
        raise ValueError("no OpenCL device here; see 'python -c \"import thomas_tune.opencl as o; "
                         "print(o.devices())\"'")
    tg = training_module(model, batch, trainable, optimizer)
    train_mod = exported_training_module(tg)
    from ..memory_plan import compiled_step_memory
    from ..recompute import RecomputePlan
    # the export's own recomputation (export --memory-budget), the same for every variant
    level = (first.memory_budget or {}).get("level", "none")
    estimate = compiled_step_memory(model, batch, trainable, optimizer,
                                    budget_plan=RecomputePlan(level))
    res = {"model": {"arch": model.arch, **model.config()}, "batch": batch,
           "infer_batch": infer_batch, "trainable": trainable,
           "trainable_params": len(tg.trainable), "optimizer": tg.optimizer.name,
           "target": str(target.kind.name), "device": device_description(kind, dev),
           "tuning_log": log_path, "config": cfg.__dict__, "variants": {}}
    say(f"[bench] peak of {res['device']} ...")
    res["peaks"] = peaks = measure_peaks(target, dev, refresh=cfg.refresh_peaks)
    kernels = step_kernels(train_mod)
    res["step"], step_flops, step_bytes = _step_size(kernels, estimate.peak)
    own, separate = _own_kernels(res, exports, kernels, train_mod, model, batch, trainable,
                                 optimizer, level)
    if log_path:  # one read of the log marks the tuned build's kernels and the common rows
        tuned_ks = own.get("tuned", kernels)
        mark_tuned([*kernels, *tuned_ks] if separate else kernels, log_path, target)
        res["step"]["tuned_kernels"] = sum(k.tuned for k in tuned_ks)
    t0 = time.perf_counter()
    ref = bench_reference(exports, cfg.seed) if cfg.check else None
    if ref is not None:
        say(f"[bench] PyTorch's float64 and float32 reference steps in "
            f"{time.perf_counter() - t0:.1f} s")
    checks = check_variants(exports, cfg.seed, say, ref, progress=say) if cfg.check else {}
    res["checks"] = {k: c.as_dict() for k, c in checks.items()}
    res["skipped"] = {}
    sides, torch_by_setting = _sides(exports, checks, cfg, model, tensors, tg, batch,
                                     infer_batch, say)
    compiled = _add_torch_compile(sides, res, model, tensors, tg, batch, infer_batch, cfg, ref,
                                  say) if cfg.torch_compile else None
    graphs_before = graphs_now() if compiled else 0
    say(f"[bench] timing {', '.join(sides)} side by side: {cfg.steps} interleaved rounds of "
        "training steps, then of inference passes ...")
    timed = time_interleaved(sides, cfg.steps, cfg.warmup) if sides else {}
    for variant, side in sides.items():
        if variant == "torch":
            r = torch_result(side, torch_by_setting, timed[variant])
            r["checked"] = True  # the reference itself
        elif variant == "torch.compile":
            r = {**torch_result(side, {}, timed[variant]), **compiled,
                 "recompiled_while_timed": graphs_now() - graphs_before,
                 "checked": variant in res["checks"]}
        else:
            r = _export_result(variant, side, timed[variant], exports[variant], checks, cfg,
                               kind, dev, kernels, own[variant], variant in separate, say)
        res["variants"][variant] = r
    sides.clear()
    _rates(res["variants"], step_flops, step_bytes, peaks)
    if cfg.kernels:
        main = "tuned" if "tuned" in exports else next(iter(exports))
        res["kernels"] = _kernel_rows(kernels, peaks, main)
        res["kernel_table_variant"] = main
        if log_path and "default" in exports:
            res["tuning_curve"] = tuning_curve(log_path, kernels)
    return res


def _step_size(kernels: list, memory_bytes: int) -> tuple[dict, float, float]:
    """The training step's size for the result (its kernels and calls, GFLOP, GB of kernel
    arguments, each call's, and ``memory_bytes``, the estimated peak memory in bytes), and its
    FLOPs and bytes of kernel arguments."""
    step_flops = sum(k.flops * k.calls for k in kernels)
    step_bytes = sum(k.bytes * k.calls for k in kernels)
    return ({"kernels": len(kernels), "calls": sum(k.calls for k in kernels),
             "gflop": step_flops / 1e9, "argument_gbytes": step_bytes / 1e9,
             "memory_estimate_bytes": memory_bytes}, step_flops, step_bytes)


def _own_kernels(res: dict, exports: dict, kernels: list, train_mod, model, batch: int,
                 trainable: str, optimizer, level: str = "none") -> tuple[dict, set]:
    """Each variant's kernels: the step's, except that the tuned build may compute some
    convolutions in the Winograd form (its manifest lists them), which has its own kernels;
    then the number of those convolutions and the tuned step's memory estimate (bytes, its
    Winograd transforms counted) go to ``res["step"]``. Returns the kernels by variant and the
    variants whose kernels are their own."""
    from ..manifest import Manifest
    from ..memory_plan import compiled_step_memory
    from ..recompute import RecomputePlan
    own = {variant: list(kernels) for variant in exports}
    separate = set()
    if "tuned" in exports:
        from ..training_graph.winograd_form import Conv
        built = Manifest.read(exports["tuned"]).winograd or {}
        chosen = {Conv.from_dict(d) for d in built.get("training", [])}
        if chosen:
            own["tuned"] = step_kernels(train_mod, chosen)
            separate.add("tuned")
            res["step"]["winograd_convolutions"] = len(chosen)
            res["step"]["memory_estimate_tuned_bytes"] = compiled_step_memory(
                model, batch, trainable, optimizer, winograd=chosen,
                budget_plan=RecomputePlan(level)).peak
    return own, separate


def _sides(exports: dict, checks: dict, cfg: BenchConfig, model, tensors, tg, batch: int,
           infer_batch: int, say) -> tuple[dict, dict | None]:
    """The sides to time: one per export whose numbers are not wrong (:class:`ExportSide`),
    and PyTorch eager (:class:`TorchSide`, with ``cfg.torch`` where torch is installed), its
    cudnn.benchmark setting chosen. Returns the sides by name and PyTorch's times per setting
    (None without PyTorch)."""
    sides = {}
    for variant, folder in exports.items():
        if variant in checks and not checks[variant].ok:
            say(f"[bench] {variant}: not timed, its numbers are wrong")
            continue
        sides[variant] = ExportSide(folder, cfg.seed)
    torch_by_setting = None
    if cfg.torch:
        td = torch_device()
        if td is None:
            say("[bench] PyTorch is not installed: no PyTorch column")
        else:
            sides["torch"] = TorchSide(model, tensors, tg.trainable, tg.optimizer, batch,
                                       infer_batch, cfg.seed, frozen_bn=tg.frozen_bn)
            if td == "cuda":
                say("[bench] PyTorch eager on cuda: cudnn.benchmark off and on ...")
            torch_by_setting = sides["torch"].choose_cudnn_benchmark(cfg.steps, cfg.warmup)
    return sides, torch_by_setting


def _export_result(variant: str, side, timed, folder: str, checks: dict, cfg: BenchConfig,
                   kind: str, dev, kernels: list, ks: list, separate: bool, say) -> dict:
    """The result of one export's side: its times ``timed`` (of the interleaved rounds) and
    counters, ``checked`` where its numbers were (a time whose numbers were not checked gets
    no ratio); with ``cfg.kernels`` its kernels ``ks`` timed alone (their sum per step in ms
    and the failed ones counted; where they are the variant's own, ``separate``, their times
    merged into the rows of ``kernels`` by workload, new workloads appended); with
    ``cfg.startup`` on OpenCL its first and second start."""
    r = {**as_result(timed), **export_counters(side, folder, cfg.seed)}
    r["checked"] = variant in checks
    if cfg.kernels:
        time_kernels(os.path.join(folder, "train.so"), ks, dev, variant,
                     cfg.kernel_min_ms, cfg.seed, cfg.progress)
        r["kernel_sum_ms"] = sum(k.ms[variant] * k.calls for k in ks
                                 if math.isfinite(k.ms[variant]))
        r["kernels_failed"] = sum(1 for k in ks if not math.isfinite(k.ms[variant]))
        if separate:  # one row per workload: times of shared kernels merged
            by_key = {k.key: k for k in kernels}
            for k in ks:
                if k.key in by_key:
                    by_key[k.key].ms[variant] = k.ms[variant]
                else:
                    kernels.append(k)
    if cfg.startup and kind == "opencl":
        say(f"[bench] start-up of the {variant} export: first start (empty program "
            "cache), then second start ...")
        r["startup"] = startup(folder, cfg.seed)
    return r


def _rates(variants: dict, step_flops: float, step_bytes: float, peaks: dict) -> None:
    """Add to each variant's result its images/s (training, inference), GFLOP/s and shares
    of the measured peaks (``peaks``: GFLOP/s, GB/s), from the step's FLOPs and bytes of
    kernel arguments."""
    for r in variants.values():
        r["train_images_per_s"] = 1e3 * r["batch"] / r["train_ms"]
        r["infer_images_per_s"] = 1e3 * r["infer_batch"] / r["infer_ms"]
        r["train_gflops"] = step_flops / r["train_ms"] / 1e6
        r["share_of_peak_flops"] = r["train_gflops"] / peaks["gflops"]
        r["share_of_peak_bandwidth"] = step_bytes / r["train_ms"] / 1e6 / peaks["gbytes_per_s"]


def _kernel_rows(kernels: list, peaks: dict, main: str) -> list[dict]:
    """The kernel table: per kernel its calls, MFLOP, MB of arguments, whether tuned, and per
    variant ms per call, GFLOP/s and shares of the peaks; slowest per step of ``main`` first."""
    rows = []
    for k in kernels:
        row = {"name": k.name, "calls": k.calls, "mflop": k.flops / 1e6,
               "mbytes": k.bytes / 1e6, "tuned": k.tuned, "workload": k.key}
        for variant, ms in k.ms.items():
            row[f"{variant}_ms"] = ms
            if math.isfinite(ms) and ms > 0:
                row[f"{variant}_gflops"] = k.flops / ms / 1e6
                row[f"{variant}_share_of_peak_flops"] = k.flops / ms / 1e6 / peaks["gflops"]
                row[f"{variant}_share_of_peak_bandwidth"] = (
                    k.bytes / ms / 1e6 / peaks["gbytes_per_s"])
        rows.append(row)
    rows.sort(key=lambda r: -(r.get(f"{main}_ms", 0) * r["calls"]
                              if math.isfinite(r.get(f"{main}_ms", math.nan)) else 0))
    return rows


def _add_torch_compile(sides, res, model, tensors, tg, batch, infer_batch, cfg, ref,
                       say) -> dict | None:
    """Add the ``torch.compile`` side to ``sides`` (:func:`compiled_side`) once it is compiled
    and its numbers are right (with ``cfg.check``); its check goes to ``res["checks"]``, the
    cause of a failure to ``res["skipped"]``. Returns the compile figures of the result
    (``compile_s``, ``graphs``, ``graph_breaks``), None where the side is not timed."""
    eager = sides.get("torch")
    if eager is not None and eager.dev.type == "cuda":  # its peak, before another side allocates
        eager.peak_bytes = eager.torch.cuda.max_memory_allocated()
    say("[bench] torch.compile: compiling the training step and the inference forward "
        "(untimed) ...")
    side, info = compiled_side(model, tensors, tg.trainable, tg.optimizer, batch, infer_batch,
                               cfg.seed, tg.frozen_bn, ref)
    if side is None:
        say(f"[bench] torch.compile: not timed, it cannot compile here: {info['error']}")
        res["skipped"]["torch.compile"] = info["error"]
        return None
    say(f"[bench] torch.compile: compiled in {info['compile_s']:.1f} s ({info['graphs']} "
        f"graphs, {info['graph_breaks']} graph breaks)")
    check, against = info["check"], info["against_eager"]
    if check is not None:
        res["checks"]["torch.compile"] = {**check.as_dict(), "against_eager": against.as_dict()}
        name, err = against.worst
        say(f"[bench] numbers of torch.compile against PyTorch float64: {check.line()}; "
            f"against PyTorch eager float32: loss {against.loss_err:.1e}, worst gradient "
            f"{name} {err:.1e}")
        if not check.ok:
            say("[bench] torch.compile: not timed, its numbers are wrong")
            return None
    sides["torch.compile"] = side
    return {k: info[k] for k in ("compile_s", "graphs", "graph_breaks")}
