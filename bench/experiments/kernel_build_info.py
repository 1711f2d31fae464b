"""What the OpenCL driver makes of a tuning log's best kernels: for each of the ``--keys``
workloads, its best record and its best record of a tiled space (`schedules/matmul_tiles.py`,
told by the trace's ``ReIndex`` and ``StorageAlign``), each built by TVM for ``--target``, its
program built by this machine's OpenCL device and run once on fresh random inputs (the time is
not taken: `thomas-tune tune` measures). Reported per record:

- the driver's build log (on NVIDIA, with ``-cl-nv-verbose``: ptxas's registers per thread,
  spill stores and loads, and stack frame of each kernel);
- counts in the program binary (on NVIDIA it is PTX, before ptxas): ``fma.rn.f32``,
  ``ld.shared`` (of them ``.v4``), ``ld.local`` and ``st.local`` (private arrays kept in
  memory), ``bar.sync``.

With ``--time``, each record is also built a second time from TVM's source as written
(``vload4``, :mod:`thomas_tune.opencl_source` switched off), and both builds are timed in
this process, alternating (``time_evaluator``: 5 rounds of 20 runs each, median ms), to
measure what the aligned vector reads of shared memory change.

It answers why a kernel is slow where static counts from clang (``bench/experiments/ptx_mix.py``)
cannot: there OpenCL's ``vload4`` stays a call. On the device tool's GPU machine (after `bash
tools/gpu_tune.sh setup`):

    THOMAS_TUNE_OPENCL_PLATFORM=NVIDIA bash tools/gpu_tune.sh py \\
        bench/experiments/kernel_build_info.py \\
        --log tuning_logs/h100/alexnet-w1-r224-c1000-b32 --target targets/h100_opencl.json \\
        --keys 2642313052758211241,6379605961784904180 --out $OUT/build_info.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile

COUNTS = {"fma": r"\bfma\.rn\.f32\b", "ld_shared": r"\bld\.shared\.", "ld_shared_v4":
          r"\bld\.shared\.v4\.", "ld_local": r"\bld\.local\.", "st_local": r"\bst\.local\.",
          "bar_sync": r"\bbar\.sync\b|\bbarrier\.sync\b"}


def tiled(body) -> bool:
    """Whether a record (its JSON body) comes from a tiled space of ``matmul_tiles``."""
    names = {inst[0] for inst in body[0][0]}
    return "ReIndex" in names and "StorageAlign" in names


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--keys", required=True, help="workload keys, comma-separated")
    p.add_argument("--out", required=True)
    p.add_argument("--time", action="store_true",
                   help="also time each record built with and without aligned vector reads")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="kernel-build-info-")
    # read by the OpenCL runtime at its first program build: set before anything loads it
    os.environ.setdefault("THOMAS_TUNE_OPENCL_OPTIONS", "-cl-nv-verbose")
    os.environ["THOMAS_TUNE_OPENCL_BUILD_LOG"] = os.path.join(work, "build.log")

    import numpy as np
    import tvm
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.schedule import Schedule

    from thomas_tune import opencl, opencl_source
    from thomas_tune.measure.builder import build_candidate
    from thomas_tune.target import parse_target
    from thomas_tune.logs import mean_seconds, read_log

    opencl.load()
    target = parse_target(args.target)
    keys = args.keys.split(",")
    contents = read_log(args.log)
    found = {}
    for i, (w, _) in enumerate(contents.workloads):
        wl = ms.database.Workload.from_json(w)
        if str(tvm_ffi.structural_hash(wl.mod)) in keys:
            found[i] = wl
    picks: dict[tuple[int, str], list] = {}
    for i, body in contents.records:
        t = mean_seconds(body)
        if i not in found or not math.isfinite(t):
            continue
        for kind in ("best", "best tiled") if tiled(body) else ("best",):
            if (i, kind) not in picks or t < mean_seconds(picks[i, kind]):
                picks[i, kind] = body
    rng = np.random.default_rng()
    dev = tvm.opencl(0)
    rows = []
    for (i, kind), body in sorted(picks.items()):
        wl = found[i]
        rec = ms.database.TuningRecord.from_json(body, wl)
        sch = Schedule(wl.mod)
        rec.trace.apply_to_schedule(sch, remove_postproc=False)
        cache = os.path.join(work, f"cache-{i}-{kind.replace(' ', '-')}")
        os.environ["THOMAS_TUNE_OPENCL_CACHE"] = cache  # (read per program build)
        log_path = os.environ["THOMAS_TUNE_OPENCL_BUILD_LOG"]
        start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        lib = build_candidate(sch.mod, target)
        func = wl.mod["main"]
        tensors = [tvm.runtime.tensor(rng.standard_normal([int(d) for d in v.shape])
                                      .astype(str(v.dtype)), dev) for v in func.params]
        lib["main"](*tensors)
        dev.sync()
        build_log = ""
        if os.path.exists(log_path):
            with open(log_path) as f:
                f.seek(start)
                build_log = f.read()
        ptx = ""
        for root, _, files in os.walk(cache):
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    ptx += f.read().decode("latin-1")
        row = {"workload": str(tvm_ffi.structural_hash(wl.mod)), "record": kind,
               "recorded_ms": 1e3 * mean_seconds(body),
               "counts": {k: len(re.findall(r, ptx)) for k, r in COUNTS.items()},
               "build_log": [ln for ln in build_log.splitlines()
                             if re.search(r"registers|spill|stack|Compiling", ln)]}
        if args.time:
            opencl_source.ENABLED = False
            try:
                plain = build_candidate(sch.mod, target)
            finally:
                opencl_source.ENABLED = True
            times = {"aligned": [], "as_written": []}
            for _ in range(5):
                for name, m in (("aligned", lib), ("as_written", plain)):
                    ev = m.time_evaluator("main", dev, number=20, repeat=1)
                    times[name].append(1e3 * ev(*tensors).mean)
            row["ms"] = {k: float(np.median(v)) for k, v in times.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"log": args.log, "target": args.target, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
