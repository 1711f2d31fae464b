"""Static instruction mix of a tuning log's best GPU kernels, as recorded and with their
padding kept out of the innermost loop, from clang's NVPTX backend (no GPU needed).

A kernel that is far from the FP32 peak on an NVIDIA GPU often issues too many other
instructions per FMA: an SM issues shared-memory loads at a quarter of its FMA rate (32 banks of
4 bytes per clock against 128 FP32 lanes; NVIDIA's CUDA C++ Programming Guide and H100
whitepaper), and a branch per operand read stops the compiler from sharing loads between
multiply-adds. This script takes the best record of each of the ``--workloads`` workloads of a
log with the longest best time, builds its OpenCL C source with TVM for the log's target, and
compiles that source to PTX with clang (``-target nvptx64-nvidia-nvcl -O3 -march=sm_80``; clang
15 has no sm_90, whose FP32 ISA is the same for these counts). It counts per kernel source:

- ``fma``: ``fma.rn.f32`` (multiply-adds; TVM writes ``a = a + b * c``, contracted);
- ``ld_shared``, ``ld_global``, ``st_shared``: loads and stores by memory space;
- ``branches``: ``bra`` instructions (loop back-edges and bounds tests);

for the record as recorded and, where the record inlines a padding block into a contraction,
with its padding kept out of the innermost loop (``schedules.with_padding_in_fill``: in the
shared-memory copy, or as a kernel of its own). These are counts in the program text, not in
its execution; on the H100 the best AlexNet ``conv2d8`` record gave the same FMA and shared-load
counts from NVIDIA's driver (PTX read from its program binary) as from clang.

    python bench/experiments/ptx_mix.py --log tuning_logs/h100/alexnet-w1-r224-c1000-b32 \\
        --target targets/h100_opencl.json --workloads 12 --out mix.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

COUNTS = {"fma": r"\bfma\.rn\.f32\b", "ld_shared": r"\bld\.shared\.", "ld_global":
          r"\bld\.global\.", "st_shared": r"\bst\.shared\.", "branches": r"\bbra(\.uni)?\b"}


def ptx_counts(source: str, clang: str) -> dict:
    """Counts of :data:`COUNTS` in the PTX that ``clang`` makes of OpenCL C ``source``. Raises
    RuntimeError with clang's message when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.cl"), os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(source)
        r = subprocess.run([clang, "-x", "cl", "-cl-std=CL1.2", "-target", "nvptx64-nvidia-nvcl",
                            "-Xclang", "-finclude-default-header", "-O3", "-march=sm_80", "-S",
                            "-Wno-everything", "-o", out, src], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{clang} failed: {r.stderr.strip()[-500:]}")
        with open(out) as f:
            ptx = f.read()
    return {k: len(re.findall(p, ptx)) for k, p in COUNTS.items()}


def _one(job) -> dict:
    """(worker) The counts of one record as recorded and with its padding kept apart."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.schedule import Schedule

    from thomas_tune.measure.builder import build_candidate
    from thomas_tune.schedules import plain_json, postprocessed, space_generator
    from thomas_tune.schedules import with_padding_in_fill
    from thomas_tune.target import parse_target

    target = parse_target(job["target"])
    wl = ms.database.Workload.from_json(job["workload"])
    names = [n for n in re.findall(r'T\.sblock\("(\w+)"\)', wl.mod.script()) if n != "root"]
    out = {"workload_index": job["workload_index"], "recorded_ms": job["recorded_ms"],
           "name": job.get("name", "+".join(names))}
    rec = ms.database.TuningRecord.from_json(job["body"], wl)
    sch = Schedule(wl.mod)
    rec.trace.apply_to_schedule(sch, remove_postproc=False)
    variants = {"recorded": sch}
    padded = with_padding_in_fill(wl.mod, plain_json(rec.trace.as_json()))
    if padded is not None:
        ctx = ms.TuneContext(mod=wl.mod, target=target, space_generator=space_generator(target),
                             task_name="mix", num_threads=1)
        variants["padding_apart"] = postprocessed(wl.mod, padded, ctx.space_generator.postprocs)
    for name, s in variants.items():
        if s is None:
            out[name] = {"error": "the postprocessors reject the variant"}
            continue
        try:
            src = "\n".join(m.inspect_source() for m in build_candidate(s.mod, target).imports)
            out[name] = {**ptx_counts(src, job["clang"]), "kernels": src.count("// Function:")}
        except Exception as err:  # noqa: BLE001 (one record failing is a result)
            out[name] = {"error": str(err).strip().splitlines()[-1][:300]}
    return out


def from_bench(log: str, bench_json: str, count: int) -> list[dict]:
    """The best record in ``log`` of each of the ``count`` slowest tuned kernels of a
    ``thomas-tune bench`` result (its kernel table, slowest first), named as the table names
    them. Raises ValueError when a kernel's workload has no valid record in ``log``."""
    import math

    from thomas_tune.logs import mean_seconds, read_log
    with open(bench_json) as f:
        kernels = [k for k in json.load(f)["kernels"] if k.get("tuned")]
    kernels.sort(key=lambda k: -k["tuned_ms"] * k.get("calls", 1))
    contents = read_log(log)
    index = {str(w[0]): i for i, (w, _) in enumerate(contents.workloads)}
    best: dict[int, list] = {}  # workload -> its valid record of the least mean time
    for w, body in contents.records:
        if math.isfinite(mean_seconds(body)) and (w not in best or mean_seconds(body)
                                                  < mean_seconds(best[w])):
            best[w] = body
    out = []
    for k in kernels[:count]:
        w = index.get(str(k["workload"]))
        if w not in best:
            raise ValueError(f"kernel {k['name']} (workload {k['workload']}) has no valid "
                             f"record in {log}: give the log the bench used")
        body = best[w]
        out.append({"workload_index": w, "workload": contents.workloads[w][0], "body": body,
                    "recorded_ms": mean_seconds(body) * 1e3, "best": True, "name": k["name"]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", required=True, help="tuning-log folder (packed or not)")
    ap.add_argument("--target", required=True, help="target JSON file (as 'tune --target')")
    ap.add_argument("--workloads", type=int, default=12, help="largest workloads taken")
    ap.add_argument("--bench", default=None, help="a 'thomas-tune bench' result (JSON): take "
                    "the slowest tuned kernels of its kernel table, by name, instead of the "
                    "log's slowest workloads (which may include workloads of older graphs)")
    ap.add_argument("--clang", default=None, help="clang with the NVPTX backend (default: the "
                    "first of clang, clang-18 ... clang-14 on PATH)")
    ap.add_argument("--workers", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--out", required=True, help="JSON file of the rows")
    a = ap.parse_args(argv)
    clang = a.clang or next((c for c in ("clang", *(f"clang-{v}" for v in range(18, 13, -1)))
                             if shutil.which(c)), None)
    if clang is None:
        ap.error("no clang on PATH: install clang (its NVPTX backend) or pass --clang")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from compile_cost import pick

    with open(a.target) as f:
        target_json = json.load(f)
    # (read_log reads a packed log through the project's cached unpacked copy)
    picked = from_bench(a.log, a.bench, a.workloads) if a.bench else pick(a.log, a.workloads,
                                                                          1, 0)
    jobs = [{**p, "target": target_json, "clang": clang} for p in picked]
    print(f"ptx_mix: {len(jobs)} records of {a.log}, clang {clang}", flush=True)
    rows = []
    with ProcessPoolExecutor(a.workers) as pool:
        for row in pool.map(_one, jobs):
            rows.append(row)
            line = f"{row['name'][:40]:40s} best {row['recorded_ms']:7.3f} ms"
            for name in ("recorded", "padding_apart"):
                c = row.get(name)
                if c and "error" not in c:
                    line += (f" | {name}: {c['fma']} FMA, {c['ld_shared']} shared loads,"
                             f" {c['branches']} branches")
                elif c:
                    line += f" | {name}: {c['error']}"
            print(line, flush=True)
    with open(a.out, "w") as f:
        json.dump({"log": a.log, "clang": clang, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
