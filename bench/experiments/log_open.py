"""What a resumed `tune` and an `export` pay to open a tuning log, side by side in one process.

For the log folder given (packed or not; read from a scratch copy, which gets the kept
schedule hashes):
  json        MetaSchedule's JSONDatabase: open (every record rebuilt), then each workload's
              records replayed for their schedule hashes, as `tune` did before LogDatabase;
  lazy-first  LogDatabase, with no kept hashes: open, replay every record once, keep hashes;
  lazy-kept   LogDatabase at the next start: open, hashes read back, nothing replayed;
and, for an export, the fastest valid record of each workload (build.best_records) through
JSONDatabase and through LogDatabase. Seconds of wall time on this machine's cores; the three
start-ups must find the same schedule hashes and the exports the same records, or it fails.

    python3 bench/experiments/log_open.py tuning_logs/h100/alexnet-w1-r224-c1000-b32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import Schedule

from thomas_tune.compiler.compile import best_records
from thomas_tune.logs import TuningLog, unpack


def _json_hashes(db, mods) -> dict:
    """Hashes as tune found them before LogDatabase: every record of the workload rebuilt by
    JSONDatabase, its trace applied again, the schedule hashed (one thread per core)."""
    from concurrent.futures import ThreadPoolExecutor
    out = {}
    for mod in mods:
        records = db.get_top_k(db.commit_workload(mod), 1 << 30)

        def one(rec, mod=mod):
            sch = Schedule(mod)
            try:
                rec.trace.apply_to_schedule(sch, remove_postproc=False)
            except Exception:
                return None
            return tvm_ffi.structural_hash(sch.mod)

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            out[str(tvm_ffi.structural_hash(mod))] = {
                h for h in pool.map(one, records, chunksize=16) if h is not None}
    return out


def _lazy_hashes(log: TuningLog) -> tuple[dict, int]:
    db = log.database(check=False)
    out = {db.keys[i]: log.measured(db, w.mod) for i, w in enumerate(db.workloads)}
    return out, log.save_hashes()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", help="tuning-log folder (packed or not)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="log-open-")
    try:
        src = TuningLog(args.log)
        path = os.path.join(work, "log")
        shutil.copytree(args.log, path)
        if src.packed:
            unpack(path)
        log = TuningLog(path)
        mods = log.workloads()
        res = {"log": args.log, "cores": os.cpu_count(), "workloads": len(mods)}

        t = time.perf_counter()
        jdb = ms.database.JSONDatabase(log.workload_path, log.record_path, allow_missing=False)
        res["json_open_s"] = time.perf_counter() - t
        res["records"] = len(jdb)
        t = time.perf_counter()
        want = _json_hashes(jdb, mods)
        res["json_replay_s"] = time.perf_counter() - t
        t = time.perf_counter()
        jbest, _ = best_records(jdb, log.path, None)
        res["json_best_s"] = time.perf_counter() - t

        for name in ("lazy_first", "lazy_kept"):
            fresh = TuningLog(path)
            t = time.perf_counter()
            got, replayed = _lazy_hashes(fresh)
            res[f"{name}_s"] = time.perf_counter() - t
            res[f"{name}_replayed"] = replayed
            if got != want:
                print(f"FAIL: {name} found other schedule hashes than JSONDatabase",
                      file=sys.stderr)
                return 1
        t = time.perf_counter()
        lbest, _ = best_records(TuningLog(path).database(check=False), log.path, None)
        res["lazy_best_s"] = time.perf_counter() - t
        if sorted(jbest) != sorted(lbest) or any(
                [float(s) for s in jbest[k].run_secs] != [float(s) for s in lbest[k].run_secs]
                for k in jbest):
            print("FAIL: the fastest records differ", file=sys.stderr)
            return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    json_start = res["json_open_s"] + res["json_replay_s"]
    print(f"{res['records']} records, {res['workloads']} workloads, {res['cores']} cores")
    print(f"  start-up, JSONDatabase + replay : {json_start:7.1f} s "
          f"(open {res['json_open_s']:.1f}, replay {res['json_replay_s']:.1f})")
    print(f"  start-up, LogDatabase, first    : {res['lazy_first_s']:7.1f} s "
          f"({res['lazy_first_replayed']} replayed)  {json_start / res['lazy_first_s']:.1f}x")
    print(f"  start-up, LogDatabase, kept     : {res['lazy_kept_s']:7.1f} s "
          f"({res['lazy_kept_replayed']} replayed)  {json_start / res['lazy_kept_s']:.1f}x")
    print(f"  export's best records           : {res['json_open_s'] + res['json_best_s']:7.1f} s "
          f"-> {res['lazy_best_s']:.1f} s (both opening the log)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
