"""The bench's report: the result of :func:`thomas_tune.benchmark.run.run_bench` as text tables.

One line per variant (ms per training step and inference pass with their interquartile
ranges, images/s, shares of the measured peaks, launches, device memory, the kernels' sum,
start-up), the speed-ups between checked variants, each build's numbers against PyTorch, the
compilation and start-up details, the slowest kernels and the tuning curve.
"""

from __future__ import annotations

import math

#: the pairs (slower, faster) whose speed-up is printed where both were checked
RATIO_PAIRS = (("default", "tuned"), ("stock", "tuned"), ("stock", "default"),
               ("torch", "tuned"), ("torch", "default"), ("torch.compile", "tuned"),
               ("torch.compile", "default"), ("torch", "torch.compile"))


def _fmt(v, spec=".1f", none="-"):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return format(v, spec)


def _mb(nbytes):
    return None if nbytes is None else nbytes / 1e6


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


def _heading(res: dict) -> list[str]:
    """The model, device, measured peaks (GFLOP/s, GB/s) and the training step's size (kernel
    calls, GFLOP, MB of arguments, estimated peak memory in MB), then a blank line."""
    m, step, peaks = res["model"], res["step"], res["peaks"]
    tuned_memory = (f" ({step['memory_estimate_tuned_bytes'] / 1e6:.1f} MB with the tuned "
                    "build's Winograd transforms)" if "memory_estimate_tuned_bytes" in step
                    else "")
    return [f"{m['arch']} width {m['width']:g}, {m['resolution']}x{m['resolution']}, "
            f"{m['num_classes']} classes; training batch {res['batch']}, trainable "
            f"{res['trainable']} ({res['trainable_params']} tensors), {res['optimizer']}; "
            f"inference batch {res['infer_batch']}",
            f"device: {res['device']}",
            f"peak (measured{', cached' if peaks.get('cached') else ''}): "
            f"{peaks['gflops']:.1f} GFLOP/s, {peaks['gbytes_per_s']:.1f} GB/s "
            f"({peaks['method']})",
            f"training step: {step['calls']} kernel calls, {step['gflop']:.3f} "
            f"GFLOP, {step['argument_gbytes'] * 1e3:.1f} MB of kernel arguments; "
            f"'thomas-tune memory' estimates the compiled step's peak at "
            f"{step.get('memory_estimate_bytes', 0) / 1e6:.1f} MB" + tuned_memory,
            "peak MB: the most bytes the device held (a fresh process, three steps); MB/step: "
            "the bytes of the buffers each step's kernels were given to read and write", ""]


def _variant_table(res: dict) -> list[str]:
    """The table of variants: its header, the variants not timed (wrong numbers, skipped) and
    one row per timed variant (ms, IQR, img/s, % of the peaks, launches, MB, s)."""
    lines = [f"{'variant':<13} {'train ms':>9} {'IQR':>13} {'device ms':>9} {'IQR':>13} "
             f"{'img/s':>8} {'infer ms':>9} {'device ms':>9} {'img/s':>8} "
             f"{'%peak FLOP':>10} {'%peak BW':>9} {'launches':>8} {'peak MB':>8} "
             f"{'MB/step':>8} "
             f"{'kernels ms':>10} "
             f"{'1st start s':>11} {'2nd start s':>11}"]
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
            f"{_fmt(_mb(r.get('launch_arg_bytes_per_step')), '.1f'):>8} "
            f"{_fmt(r.get('kernel_sum_ms'), '.2f'):>10} "
            f"{_fmt(st.get('first', {}).get('total_s'), '.2f'):>11} "
            f"{_fmt(st.get('second', {}).get('total_s'), '.2f'):>11}{mark}")
    return lines


def _speedups(v: dict) -> list[str]:
    """The speed-ups of :data:`RATIO_PAIRS` whose variants were both checked (a time whose
    numbers may be wrong is no speed-up), training and inference, as a blank line and one
    line; [] where there is none."""
    good = {n: r for n, r in v.items() if r.get("checked", True)}
    ratios = []
    for a, b in RATIO_PAIRS:
        if a in good and b in good:
            parts = []
            for what in ("train", "infer"):
                ratio, timer = speedup(v[a], v[b], what)
                parts.append(f"{ratio:.2f}x ({'training' if what == 'train' else 'inference'}"
                             f", {timer})")
            ratios.append(f"{b} vs {a}: " + ", ".join(parts))
    return ["", "speed-up (>1: the first named is faster): " + "; ".join(ratios)] if ratios else []


def _numbers(res: dict) -> list[str]:
    """Per checked variant, its loss and worst gradient error against PyTorch float64 (and
    beside them PyTorch float32's, and torch.compile's against PyTorch eager)."""
    lines = []
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
    return lines


def _compilation_and_startup(v: dict) -> list[str]:
    """The compilation of the compiled PyTorch variants (s, graphs, graph breaks), then the
    start-up of each export (s per phase, OpenCL programs built and loaded from the cache)."""
    lines = []
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
    return lines


def _kernel_table(res: dict, top: int) -> list[str]:
    """The ``top`` slowest kernels of the table's variant (ms per call and per step, GFLOP/s,
    % of the peaks, tuned or not, and the other builds' ms per call); [] without a table."""
    if not res.get("kernels"):
        return []
    v, main = res["variants"], res["kernel_table_variant"]
    others = [n for n in ("tuned", "default", "stock") if n in v and n != main]
    lines = ["", f"slowest kernels of the {main} training step (each timed alone on "
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
    return lines


def _curve(res: dict) -> list[str]:
    """The tuning curve in one line (records, ms per step from default schedules to the
    last record, trials to 95% of the gain); [] without one."""
    c = res.get("tuning_curve")
    if not c:
        return []
    return ["", f"tuning curve: {len(c['trials']) - 1} records of this step's workloads "
            f"({c['skipped_records']} of other workloads skipped); estimated kernel time "
            f"per step {c['ms'][0]:.2f} ms (default schedules) -> {c['ms'][-1]:.2f} ms; "
            f"95% of the gain after {c['trials_to_95pct']} trials"]


def format_report(res: dict, top: int = 12) -> str:
    """The bench result as text tables (what ``thomas-tune bench`` prints); ``top``: rows of
    the kernel table."""
    lines = (_heading(res) + _variant_table(res) + _speedups(res["variants"]) + _numbers(res)
             + _compilation_and_startup(res["variants"]) + _kernel_table(res, top) + _curve(res))
    return "\n".join(lines)
