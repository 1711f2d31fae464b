"""The whole bench: every variant timed on one device, and its report."""

from __future__ import annotations

import math
import os
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
    dict that :func:`format_report` prints and the ``--json`` file holds."""

    from ..export import read_manifest
    from ..graph import training_module
    from ..runtime import device_for
    first = read_manifest(next(iter(exports.values())))
    batch, infer_batch = first["batch"], first["infer_batch"]
    kind = target.kind.name
    dev = device_for(kind)
    if kind == "opencl" and not dev.exist:
        raise ValueError("no OpenCL device here; see 'python -c \"import thomas_tune.opencl as o; "
                         "print(o.devices())\"'")
    tg = training_module(model, batch, trainable, optimizer)
    train_mod = exported_training_module(model, tg)
    from ..memory import training_memory
    estimate = training_memory(model, batch, trainable, optimizer)
    res = {"model": {"arch": model.arch, **model.config()}, "batch": batch,
           "infer_batch": infer_batch, "trainable": trainable,
           "trainable_params": len(tg.trainable), "optimizer": tg.optimizer.name,
           "target": str(target.kind.name), "device": device_description(kind, dev),
           "tuning_log": log_path, "config": cfg.__dict__, "variants": {}}
    say(f"[bench] peak of {res['device']} ...")
    res["peaks"] = peaks = measure_peaks(target, dev, refresh=cfg.refresh_peaks)
    kernels = step_kernels(train_mod)
    step_flops = sum(k.flops * k.calls for k in kernels)
    step_bytes = sum(k.bytes * k.calls for k in kernels)
    res["step"] = {"kernels": len(kernels), "calls": sum(k.calls for k in kernels),
                   "gflop": step_flops / 1e9, "argument_gbytes": step_bytes / 1e9,
                   "memory_estimate_bytes": estimate.peak}
    # the tuned build may compute some convolutions in the Winograd form (its manifest lists
    # them): its own kernels
    own = {variant: list(kernels) for variant in exports}
    separate = set()
    if "tuned" in exports:
        from ..winograd_form import Conv
        built = read_manifest(exports["tuned"]).get("winograd") or {}
        chosen = {Conv.from_dict(d) for d in built.get("training", [])}
        if chosen:
            own["tuned"] = step_kernels(train_mod, chosen)
            separate.add("tuned")
            res["step"]["winograd_convolutions"] = len(chosen)
            # the tuned build's step with its Winograd transforms counted
            res["step"]["memory_estimate_tuned_bytes"] = training_memory(
                model, batch, trainable, optimizer, winograd=chosen).peak
    if log_path:  # one read of the log marks the tuned build's kernels and the common rows
        tuned_ks = own.get("tuned", kernels)
        mark_tuned([*kernels, *tuned_ks] if separate else kernels, log_path, target)
        res["step"]["tuned_kernels"] = sum(k.tuned for k in tuned_ks)
    ref = bench_reference(exports, cfg.seed) if cfg.check else None
    checks = check_variants(exports, cfg.seed, say, ref) if cfg.check else {}
    res["checks"] = {k: c.as_dict() for k, c in checks.items()}
    res["skipped"] = {}
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
            res["variants"][variant] = r
            continue
        if variant == "torch.compile":
            r = {**torch_result(side, {}, timed[variant]), **compiled,
                 "recompiled_while_timed": graphs_now() - graphs_before,
                 "checked": variant in res["checks"]}
            res["variants"][variant] = r
            continue
        folder = exports[variant]
        r = {**as_result(timed[variant]), **export_counters(side, folder, cfg.seed)}
        r["checked"] = variant in checks  # a time whose numbers were not checked: no ratio
        res["variants"][variant] = r
        if cfg.kernels:
            ks = own[variant]
            time_kernels(os.path.join(folder, "train.so"), ks, dev, variant,
                         cfg.kernel_min_ms, cfg.seed, cfg.progress)
            r["kernel_sum_ms"] = sum(k.ms[variant] * k.calls for k in ks
                                     if math.isfinite(k.ms[variant]))
            r["kernels_failed"] = sum(1 for k in ks if not math.isfinite(k.ms[variant]))
            if variant in separate:  # one row per workload: times of shared kernels merged
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
    sides.clear()
    for variant, r in res["variants"].items():
        r["train_images_per_s"] = 1e3 * r["batch"] / r["train_ms"]
        r["infer_images_per_s"] = 1e3 * r["infer_batch"] / r["infer_ms"]
        r["train_gflops"] = step_flops / r["train_ms"] / 1e6
        r["share_of_peak_flops"] = r["train_gflops"] / peaks["gflops"]
        r["share_of_peak_bandwidth"] = step_bytes / r["train_ms"] / 1e6 / peaks["gbytes_per_s"]
    if cfg.kernels:
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
        main = "tuned" if "tuned" in exports else next(iter(exports))
        rows.sort(key=lambda r: -(r.get(f"{main}_ms", 0) * r["calls"]
                                  if math.isfinite(r.get(f"{main}_ms", math.nan)) else 0))
        res["kernels"] = rows
        res["kernel_table_variant"] = main
        if log_path and "default" in exports:
            res["tuning_curve"] = tuning_curve(log_path, kernels)
    return res


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


def _fmt(v, spec=".1f", none="-"):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return format(v, spec)


def _iqr(sp) -> str:
    if not sp or sp.get("q1") is None:
        return "-"
    return f"{sp['q1']:.2f}-{sp['q3']:.2f}"


def speedup(slow: dict, fast: dict, what: str = "train") -> tuple[float, str]:
    """How many times faster the variant ``fast`` is than ``slow`` (bench variant dicts) at
    ``what`` ("train" or "infer"): the ratio of their device-timer medians when both have a
    device timer (OpenCL events, CUDA events), else of their host-clock medians; returns
    (ratio, "device timer" or "host clock")."""
    key = f"{what}_device_ms"
    if slow.get(key) and fast.get(key):
        return slow[key] / fast[key], "device timer"
    return slow[f"{what}_ms"] / fast[f"{what}_ms"], "host clock"


def format_report(res: dict, top: int = 12) -> str:
    """The bench result as text tables (what ``thomas-tune bench`` prints)."""
    m = res["model"]
    lines = [f"{m['arch']} width {m['width']:g}, {m['resolution']}x{m['resolution']}, "
             f"{m['num_classes']} classes; training batch {res['batch']}, trainable "
             f"{res['trainable']} ({res['trainable_params']} tensors), {res['optimizer']}; "
             f"inference batch {res['infer_batch']}",
             f"device: {res['device']}",
             f"peak (measured{', cached' if res['peaks'].get('cached') else ''}): "
             f"{res['peaks']['gflops']:.1f} GFLOP/s, {res['peaks']['gbytes_per_s']:.1f} GB/s "
             f"({res['peaks']['method']})",
             f"training step: {res['step']['calls']} kernel calls, {res['step']['gflop']:.3f} "
             f"GFLOP, {res['step']['argument_gbytes'] * 1e3:.1f} MB of kernel arguments; "
             f"'thomas-tune memory' estimates a peak of "
             f"{res['step'].get('memory_estimate_bytes', 0) / 1e6:.1f} MB"
             + (f" ({res['step']['memory_estimate_tuned_bytes'] / 1e6:.1f} MB with the tuned "
                "build's Winograd transforms)" if "memory_estimate_tuned_bytes" in res["step"]
                else ""), ""]
    hdr = (f"{'variant':<13} {'train ms':>9} {'IQR':>13} {'device ms':>9} {'IQR':>13} "
           f"{'img/s':>8} {'infer ms':>9} {'device ms':>9} {'img/s':>8} "
           f"{'%peak FLOP':>10} {'%peak BW':>9} {'launches':>8} {'peak MB':>8} "
           f"{'kernels ms':>10} "
           f"{'1st start s':>11} {'2nd start s':>11}")
    lines.append(hdr)
    for name, c in res.get("checks", {}).items():
        if not c["ok"] and name != "torch_float32":  # wrong, dead or not checkable
            lines.append(f"{name:<13} not timed: {c['line']}")
    for name, why in res.get("skipped", {}).items():
        lines.append(f"{name:<13} not timed: {why}")
    for name, r in res["variants"].items():
        st = r.get("startup") or {}
        mark = "" if r.get("checked", True) else " (unchecked: its numbers were not compared)"
        lines.append(
            f"{name:<13} {r['train_ms']:>9.2f} {_iqr(r.get('train_ms_spread')):>13} "
            f"{_fmt(r.get('train_device_ms'), '.2f'):>9} "
            f"{_iqr(r.get('train_device_ms_spread')):>13} {r['train_images_per_s']:>8.1f} "
            f"{r['infer_ms']:>9.3f} {_fmt(r.get('infer_device_ms'), '.3f'):>9} "
            f"{r['infer_images_per_s']:>8.1f} "
            f"{100 * r['share_of_peak_flops']:>9.2f}% {100 * r['share_of_peak_bandwidth']:>8.2f}% "
            f"{_fmt(r.get('launches_per_step'), '.0f'):>8} "
            f"{_fmt(r.get('device_peak_bytes') and r['device_peak_bytes'] / 1e6, '.1f'):>8} "
            f"{_fmt(r.get('kernel_sum_ms'), '.2f'):>10} "
            f"{_fmt(st.get('first', {}).get('total_s'), '.2f'):>11} "
            f"{_fmt(st.get('second', {}).get('total_s'), '.2f'):>11}{mark}")
    # ratios of checked builds only: a time whose numbers may be wrong is no speed-up
    v = res["variants"]
    good = {n: r for n, r in v.items() if r.get("checked", True)}
    ratios = []
    for a, b in (("default", "tuned"), ("stock", "tuned"), ("stock", "default"),
                 ("torch", "tuned"), ("torch", "default"), ("torch.compile", "tuned"),
                 ("torch.compile", "default"), ("torch", "torch.compile")):
        if a in good and b in good:
            parts = []
            for what in ("train", "infer"):
                ratio, timer = speedup(v[a], v[b], what)
                parts.append(f"{ratio:.2f}x ({'training' if what == 'train' else 'inference'}"
                             f", {timer})")
            ratios.append(f"{b} vs {a}: " + ", ".join(parts))
    if ratios:
        lines += ["", "speed-up (>1: the first named is faster): " + "; ".join(ratios)]
    for name, c in res.get("checks", {}).items():
        if c["ok"]:
            yard = c.get("torch_float32_errors") or {}
            beside = (f" (PyTorch float32 {yard[c['worst'][0]]:.1e})"
                      if c["worst"][0] in yard else "")
            eager = c.get("against_eager")
            if eager:
                beside += (f"; against PyTorch eager float32: worst gradient "
                           f"{eager['worst'][0]} {eager['worst'][1]:.1e}")
            lines.append(f"numbers of {name}: loss {c['loss']:.6f} (PyTorch float64 "
                         f"{c['loss_ref']:.6f}), worst gradient {c['worst'][0]} "
                         f"{c['worst'][1]:.1e}{beside}")
    for name, r in v.items():
        if r.get("compile_s") is not None:
            lines.append(f"compilation of {name} (untimed): {r['compile_s']:.1f} s, "
                         f"{r['graphs']} graphs, {r['graph_breaks']} graph breaks"
                         + (f"; compiled again {r['recompiled_while_timed']} times while timed"
                            if r.get("recompiled_while_timed") else ""))
    for name, r in v.items():
        st = r.get("startup")
        if st:
            f, s = st["first"], st["second"]
            lines.append(f"start-up of {name}: first {f['total_s']:.2f} s (import "
                         f"{f['import_s']:.2f}, load {f['load_s']:.2f}, first step "
                         f"{f['first_step_s']:.2f}; {f['opencl'].get('source_builds')} program "
                         f"builds from source), second {s['total_s']:.2f} s (first step "
                         f"{s['first_step_s']:.2f}; {s['opencl'].get('source_builds')} builds, "
                         f"{s['opencl'].get('binary_loads')} from the program cache)")
    if res.get("kernels"):
        main = res["kernel_table_variant"]
        others = [n for n in ("tuned", "default", "stock") if n in v and n != main]
        lines += ["", f"slowest kernels of the {main} training step (each timed alone on "
                  "random inputs; ms per call x calls = ms per step):"]
        h = (f"{'kernel':<44} {'calls':>5} {'ms/call':>9} {'ms/step':>8} {'GFLOP/s':>8} "
             f"{'%peak':>6} {'%BW':>6} {'tuned':>5}")
        h += "".join(f" {o + ' ms':>11}" for o in others)
        lines.append(h)
        for r in res["kernels"][:top]:
            ms = r.get(f"{main}_ms", math.nan)
            lines.append(
                f"{r['name'][:44]:<44} {r['calls']:>5} {_fmt(ms, '.4f'):>9} "
                f"{_fmt(ms * r['calls'], '.3f'):>8} {_fmt(r.get(f'{main}_gflops'), '.1f'):>8} "
                f"{_fmt(100 * r.get(f'{main}_share_of_peak_flops', math.nan), '.1f'):>6} "
                f"{_fmt(100 * r.get(f'{main}_share_of_peak_bandwidth', math.nan), '.1f'):>6} "
                f"{'yes' if r['tuned'] else 'no':>5}"
                + "".join(f" {_fmt(r.get(f'{o}_ms'), '.4f'):>11}" for o in others))
    c = res.get("tuning_curve")
    if c:
        lines += ["", f"tuning curve: {len(c['trials']) - 1} records of this step's workloads "
                  f"({c['skipped_records']} of other workloads skipped); estimated kernel time "
                  f"per step {c['ms'][0]:.2f} ms (default schedules) -> {c['ms'][-1]:.2f} ms; "
                  f"95% of the gain after {c['trials_to_95pct']} trials"]
    return "\n".join(lines)
