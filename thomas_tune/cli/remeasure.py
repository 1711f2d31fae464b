"""The ``remeasure`` verb: a tuning log's best records (and default schedules) timed again."""

from __future__ import annotations

import os
import time

from .options import add_model_args, add_profile_arg, add_target_arg, load_model, model_graphs
from .tune import _bounds


def cmd_remeasure(args) -> int:
    """Time the best records of the model's tasks in ``--log`` again (and with ``--defaults``
    the default schedules); see :mod:`thomas_tune.tuning.remeasure`. Returns 1 when a re-measure
    failed (the record keeps its old time), else 0."""
    from .. import rpc
    from ..tuning.remeasure import remeasure
    from ..remote import check_device
    from ..target import parse_target
    from ..tasks import extract
    from ..tuning.defaults import kernel_time_s, measure_defaults, read_default_times
    from ..tasks import key as workload_key
    from ..tuning.driver import rpc_runner
    from ..logs import TuningLog
    import tvm_ffi
    model, _, _ = load_model(args)
    target = parse_target(args.target, args.host)
    log = TuningLog(args.log)
    if not log.exists():
        raise ValueError(f"tuning log {args.log!r} has no records; tune first or fix the path")
    log.require_writable()  # its times are rewritten in place
    if args.restamp:
        args.defaults = args.defaults or "logged"  # default times belong to the version too
    else:
        log.require_version("re-measure part of it")
    tracker = rpc.parse_address(args.tracker)
    rpc.wait_for_key(tracker, args.key, timeout=args.wait)
    check_device(tracker, args.key, target, timeout=args.wait)
    free = rpc.wait_for_key(tracker, args.key, timeout=args.wait)
    tasks = extract(model_graphs(args, model), target)
    logged = ({str(tvm_ffi.structural_hash(m)) for m in log.workloads()}
              if args.top or args.defaults == "logged" else None)
    if args.top:  # the logged tasks where the default schedule costs the most per pass
        tasks = [t for t in tasks if workload_key(t) in logged]
        known = read_default_times(log.path, target,
                                   {workload_key(t): t.mod for t in tasks}) or {}
        tasks = sorted(tasks, key=lambda t: -t.weight * known.get(workload_key(t), 0.0)
                       )[:args.top]
    runner = rpc_runner(tracker, args.key, servers=args.servers or free,
                        **_bounds(args, log.path), repeat=args.repeat,
                        min_repeat_ms=args.min_repeat_ms)
    try:
        if args.defaults:
            t0 = time.perf_counter()
            timed = tasks
            if args.defaults == "logged":  # the tasks whose records are timed again
                timed = [t for t in tasks if workload_key(t) in logged]
            cached = read_default_times(log.path, target,
                                        {workload_key(t): t.mod for t in timed})
            latency = measure_defaults(timed, target, runner, log,
                                       builder_workers=args.build_workers, refresh=True)
            was = (f"{1e3 * kernel_time_s(timed, cached):.2f} ms before (cached)" if cached
                   else "none cached before")
            print(f"default schedules: {len(timed)} kernels timed again in "
                  f"{time.perf_counter() - t0:.0f} s; sum per pass of all graphs "
                  f"{1e3 * kernel_time_s(timed, latency):.2f} ms now, {was}", flush=True)
        t0 = time.perf_counter()
        report = remeasure(log, target, runner, {workload_key(t) for t in tasks},
                           top_k=args.top_k, builder_workers=args.build_workers,
                           progress=lambda d, n: print(f"  {d}/{n} records", flush=True),
                           restamp=args.restamp)
    finally:
        runner.shutdown()
    print(f"remeasured {report.measured} records of {len(report.best)} workloads in "
          f"{time.perf_counter() - t0:.0f} s ({report.failed} failed and kept their old time); "
          f"best time moved by more than 1.25x for {report.changed()} workloads")
    for why, n in sorted(report.reasons.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  {n} x {why}")
    if args.restamp:
        from ..logs import STALE
        print(f"restamped: {report.stale} record(s) not measured again moved to "
              f"{os.path.join(log.path, STALE)}; the log is now of {log.version().line()}")
    return 1 if report.failed else 0


def add_remeasure(sub) -> None:
    s = sub.add_parser("remeasure", help="time a log's best records (and the default "
                       "schedules) again on the device; the new times replace the old")
    add_model_args(s)
    add_target_arg(s)
    s.add_argument("--tracker", required=True, help="tracker HOST:PORT")
    s.add_argument("--key", required=True, help="device key of the servers to measure on")
    s.add_argument("--log", required=True, help="tuning-log folder")
    s.add_argument("--top-k", type=int, default=2,
                   help="records per workload timed again, fastest first (default 2)")
    s.add_argument("--top", type=int, help="only the N tasks with records whose default "
                   "schedules take the most time per pass of all graphs (calls x time in "
                   "default_latency.json); the others keep their times")
    s.add_argument("--defaults", nargs="?", const="all", choices=["all", "logged"],
                   help="also time default schedules again (default_latency.json): every "
                   "task's ('--defaults' alone), or only those of the tasks with records in "
                   "the log ('--defaults logged'), which is what export compares the records "
                   "with")
    s.add_argument("--restamp", action="store_true",
                   help="for a log of another or an unknown code-generation version ('log "
                   "check' says which): time the --top-k best records of each workload again, "
                   "move every other record to database_tuning_record.json.stale, time the "
                   "default schedules of the logged tasks again (--defaults logged unless "
                   "given), and stamp the log with this installation's version")
    s.add_argument("--wait", type=float, default=30, help="seconds to wait for a free server")
    s.add_argument("--servers", type=int, help="device servers measuring at once (default: "
                   "all free servers of the key)")
    s.add_argument("--trial-timeout", type=float, default=None, help="as tune's")
    s.add_argument("--compile-timeout", type=float, default=None, help="as tune's")
    add_profile_arg(s, "--log's device_profile.json", "its probed compile time and launch "
                    "overhead set --compile-timeout and --trial-timeout when not given")
    s.add_argument("--repeat", type=int, default=3, help="timed repeats per record (default 3)")
    s.add_argument("--min-repeat-ms", type=float, default=2.0)
    s.add_argument("--build-workers", type=int, help="build processes (default: CPU count)")
    s.set_defaults(fn=cmd_remeasure)
