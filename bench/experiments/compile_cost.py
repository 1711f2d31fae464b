"""What one tuning candidate costs to compile, and what limiting its loop unrolling saves.

On the H100 the trial rate is bound by compilation: each candidate spent 3.7 s of a device
server's time in NVIDIA's OpenCL compiler against 0.03 s of timed runs (the history of
docs/journal/h100.md, 2026-11-24).
MetaSchedule's unroll rule (``ParallelizeVectorizeUnroll``) gives each kernel a maximum of
0, 16, 64, 512 or 1024 unrolled steps, and ``unroll_explicit`` makes TVM write the unrolled
loop bodies out in the OpenCL C source. This script takes records of a tuning log, applies each
as recorded and in variants, and measures per candidate, in this one process and one at a time:

- ``host_s``: TVM's build of the candidate (lowering and OpenCL C code generation), seconds;
- ``source_kb``: the OpenCL C source, kB;
- ``compile_s``: the OpenCL driver's build of the program (``thomas_tune.opencl``; the on-disk
  binary cache is off), seconds;
- ``run_ms``: the kernel's run time on random inputs (``thomas_tune.benchmark``'s timing: best of
  3 repeats of >= 20 ms), ms.

Variants: ``recorded`` (the trace as tuned); ``capN`` (each ``pragma_auto_unroll_max_step``
lowered to at most N); ``pragma`` (the same step limits, with ``pragma_unroll_explicit`` 0: TVM
marks the loops unrolled and leaves the unrolling to the driver's compiler).

Run where the OpenCL device is (the GPU machine: ``bash tools/gpu_tune.sh compile-cost``):

    python bench/experiments/compile_cost.py --log tuning_logs/h100/alexnet-w1-r224-c1000-b32 \\
        --target targets/h100_opencl.json --workloads 8 --records 5 --out cost.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

VARIANTS = ("recorded", "cap64", "pragma")


def vary(trace_json, variant: str):
    """A copy of a record's trace (JSON form) changed for ``variant`` (see the module text)."""
    insts, decisions = json.loads(json.dumps(trace_json))
    for ins in insts:
        if ins[0] != "Annotate" or not ins[2]:
            continue
        key = ins[2][0]
        if variant.startswith("cap") and key == "pragma_auto_unroll_max_step":
            ins[1][1] = min(int(ins[1][1]), int(variant[3:]))
        elif variant == "pragma" and key == "pragma_unroll_explicit":
            ins[1][1] = 0
    return [insts, decisions]


def _build(job):
    """(worker) Apply one variant of a record and build it; returns the job with the library
    path, host build seconds and source size, or the error."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.schedule import Schedule

    from thomas_tune.measure.builder import build_candidate, export_candidate
    from thomas_tune.target import parse_target

    target = parse_target(job["target"])
    wl = ms.database.Workload.from_json(job["workload"])
    try:
        body = [vary(job["body"][0], job["variant"]), *job["body"][1:]]
        sch = Schedule(wl.mod)
        ms.database.TuningRecord.from_json(body, wl).trace.apply_to_schedule(
            sch, remove_postproc=False)
        t0 = time.perf_counter()
        rt = build_candidate(sch.mod, target)
        job["host_s"] = time.perf_counter() - t0
        dev_mods = [m for m in rt.imports]
        job["source_kb"] = sum(len(m.inspect_source()) for m in dev_mods) / 1e3
        job["path"] = export_candidate(rt, target)
        job["args"] = [([int(d) for d in a[2]], str(a[1])) for a in job["body"][3]]
    except Exception as err:  # noqa: BLE001 (one candidate failing is a result)
        job["error"] = str(err).strip().splitlines()[-1][:300] if str(err).strip() else repr(err)
    return job


def _time_one(job, dev, rng) -> None:
    import tvm
    from thomas_tune.benchmark.kernels import random_args
    from thomas_tune.benchmark.peaks import seconds_per_call
    lib = tvm.runtime.load_module(job["path"])
    build = tvm.get_global_func("thomas_tune.opencl.build_programs")
    t0 = time.perf_counter()
    build(lib, dev.index)
    job["compile_s"] = time.perf_counter() - t0
    job["run_ms"] = seconds_per_call(lib, lib.entry_name, dev, random_args(job["args"], dev, rng),
                          20.0) * 1e3


def pick(log: str, workloads: int, records: int, seed: int, spread: int = 0) -> list[dict]:
    """The best record and ``records - 1`` random valid ones of each of the ``workloads``
    workloads of ``log`` with the longest best time (largest kernels first), then ``spread``
    valid records drawn at random from the whole log (as the trials of a run spread)."""
    from thomas_tune.logs import mean_seconds, read_log
    contents = read_log(log)
    by_w: dict[int, list] = {}
    for w, body in contents.records:
        if math.isfinite(mean_seconds(body)):
            by_w.setdefault(w, []).append(body)
    order = sorted(by_w, key=lambda w: -min(mean_seconds(b) for b in by_w[w]))[:workloads]
    rnd = random.Random(seed)
    out = []
    for w in order:
        bodies = sorted(by_w[w], key=mean_seconds)
        chosen = [bodies[0]] + rnd.sample(bodies[1:], min(records - 1, len(bodies) - 1))
        for rank, body in enumerate(chosen):
            out.append({"workload_index": w, "workload": contents.workloads[w][0],
                        "body": body, "recorded_ms": mean_seconds(body) * 1e3,
                        "best": rank == 0})
    taken = {id(p["body"]) for p in out}
    rest = [(w, b) for w in by_w for b in by_w[w] if id(b) not in taken]
    for w, body in rnd.sample(rest, min(spread, len(rest))):
        out.append({"workload_index": w, "workload": contents.workloads[w][0], "body": body,
                    "recorded_ms": mean_seconds(body) * 1e3, "best": False})
    return out


def summarize(rows: list[dict], variants) -> dict:
    """Per variant: medians and means of host_s, compile_s, source_kb; run time against the
    recorded variant of the same record (geometric mean ratio, all and best records only)."""
    base = {(r["workload_index"], r["record"]): r for r in rows
            if r["variant"] == "recorded" and "run_ms" in r}
    def gm(xs):
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None

    out = {}
    for v in variants:
        ok = [r for r in rows if r["variant"] == v and "run_ms" in r]
        ratios = [r["run_ms"] / base[(r["workload_index"], r["record"])]["run_ms"]
                  for r in ok if (r["workload_index"], r["record"]) in base]
        best = [r["run_ms"] / base[(r["workload_index"], r["record"])]["run_ms"]
                for r in ok if r["best"] and (r["workload_index"], r["record"]) in base]
        out[v] = {
            "candidates": len([r for r in rows if r["variant"] == v]),
            "failed": len([r for r in rows if r["variant"] == v and "run_ms" not in r]),
            "host_s_mean": statistics.mean([r["host_s"] for r in ok]) if ok else None,
            "compile_s_mean": statistics.mean([r["compile_s"] for r in ok]) if ok else None,
            "compile_s_median": statistics.median([r["compile_s"] for r in ok]) if ok else None,
            "compile_s_max": max([r["compile_s"] for r in ok]) if ok else None,
            "source_kb_mean": statistics.mean([r["source_kb"] for r in ok]) if ok else None,
            "run_vs_recorded_geomean": gm(ratios),
            "best_run_vs_recorded_geomean": gm(best),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", required=True, help="tuning-log folder (packed or not)")
    ap.add_argument("--target", required=True, help="target JSON file (as 'tune --target')")
    ap.add_argument("--workloads", type=int, default=8, help="largest workloads taken")
    ap.add_argument("--records", type=int, default=5, help="records per workload (best first)")
    ap.add_argument("--spread", type=int, default=0,
                    help="records drawn at random from the whole log besides")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                    help="processes for TVM's builds (the driver compiles one at a time)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON file of the rows and the summary")
    a = ap.parse_args(argv)
    os.environ["THOMAS_TUNE_OPENCL_CACHE"] = "off"
    os.environ.setdefault("CUDA_CACHE_DISABLE", "1")

    import tvm
    from thomas_tune import opencl
    opencl.load()
    with open(a.target) as f:
        target_json = json.load(f)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in variants:
        if v not in ("recorded", "pragma") and not (v.startswith("cap") and v[3:].isdigit()):
            ap.error(f"unknown variant {v!r}: use recorded, pragma or capN (N unrolled steps)")
    picked = pick(a.log, a.workloads, a.records, a.seed, a.spread)
    jobs = []
    for rec, p in enumerate(picked):
        for v in variants:
            jobs.append({**p, "record": rec, "variant": v, "target": target_json})
    dev = tvm.opencl(0)
    rng = np.random.default_rng(a.seed)
    print(f"compile_cost: {len(picked)} records x {len(variants)} variants on "
          f"{opencl.devices().splitlines()[0] if opencl.devices() else 'opencl:0'}", flush=True)
    rows = []
    t0 = time.perf_counter()
    with ProcessPoolExecutor(a.workers) as pool:
        for job in pool.map(_build, jobs):
            if "error" not in job:
                try:
                    _time_one(job, dev, rng)
                except Exception as err:  # noqa: BLE001
                    job["error"] = str(err).strip().splitlines()[-1][:300]
            path = job.pop("path", None)
            if path:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            for k in ("workload", "body", "target", "args"):
                job.pop(k, None)
            rows.append(job)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                              for k, v in job.items()}), flush=True)
    summary = summarize(rows, variants)
    with open(a.out, "w") as f:
        json.dump({"log": a.log, "target": target_json, "device": opencl.devices(),
                   "seconds": time.perf_counter() - t0, "summary": summary, "rows": rows}, f,
                  indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
