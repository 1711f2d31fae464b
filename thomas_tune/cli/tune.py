"""The verbs of tuning: ``tasks`` and ``tune`` (``remeasure``: :mod:`thomas_tune.cli.remeasure`)."""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import time

from .options import (add_cache_features_arg, add_loss_scale_args, add_model_args,
                      add_precision_arg, add_profile_arg, add_target_arg, default_log,
                      load_model, model_graphs)
from .stop import STOP, safe_records


def cmd_tasks(args) -> int:
    from ..target import parse_target
    from ..tasks import extract, summary
    model, _, _ = load_model(args)
    tasks = extract(model_graphs(args, model), parse_target(args.target, args.host))
    total = sum(t.total_flops for t in tasks)
    print(summary(tasks[: args.limit] if args.limit else tasks, total))
    if args.limit and len(tasks) > args.limit:
        print(f"(first {args.limit} of {len(tasks)} tasks by FLOPs)")
    return 0


def _bounds(args, log_dir: str) -> dict:
    """The runner's bounds: given, or from ``--device-profile`` (default: the tuning log's
    device_profile.json) (:func:`thomas_tune.limits.runner_bounds`); says which."""
    from ..limits import find_profile, runner_bounds
    from ..rpc.probe import read_profile
    path = args.device_profile or find_profile(log_dir)
    compile_s, trial_s, how = runner_bounds(read_profile(path) if path else None,
                                            args.compile_timeout, args.trial_timeout,
                                            repeat=args.repeat)
    print(f"runner: {how}", flush=True)
    return {"compile_timeout_s": compile_s, "trial_timeout_s": trial_s}


def _tune_options(args):
    """The :class:`thomas_tune.tuning.driver.TuneOptions` of the command line; its checks
    fail here, before the tracker is contacted. Raises ValueError for a bad option (also a
    ``--max-failed-share`` outside 0..1)."""
    from ..tuning.driver import TuneOptions
    options = TuneOptions(
        trials=args.trials, trials_per_iter=args.trials_per_iter, seed=args.seed,
        population=args.population, builder_workers=args.build_workers, stats_path=args.stats,
        max_in_flight=args.in_flight, max_unroll=args.max_unroll, refine_top=args.refine_top,
        genetic_iters=args.genetic_iters, local_share=args.local_share,
        cost_model=args.cost_model if args.cost_model not in (None, "none") else None,
        seed_logs=tuple(args.seed_log or ()), seed_top=args.seed_top)
    if not 0.0 <= args.max_failed_share <= 1.0:
        raise ValueError(f"--max-failed-share {args.max_failed_share} is not a share: give a "
                         "number from 0 to 1")
    return options


def _match_pattern(args):
    """``--match`` compiled (None without it); ValueError naming it when it is not a regular
    expression."""
    try:
        return re.compile(args.match) if args.match else None
    except re.error as err:
        raise ValueError(f"--match {args.match!r} is not a regular expression ({err})") from None


def _matching(args, everything: list, pattern) -> list:
    """The tasks of ``everything`` that ``pattern`` (``--match``) matches by name or workload
    key, or all of them without a pattern; ValueError when none does."""
    if pattern is None:
        return everything
    from ..tasks import matching
    pool = matching(everything, pattern)
    if not pool:
        raise ValueError(f"no task name or workload key matches --match {args.match!r}; "
                         "'thomas-tune tasks' with the same model options lists the names")
    return pool


def _open_log(args, model, options):
    """The tuning log to tune into (``--log``, or the default folder of the device key and
    model), checked writable and of this code generation before minutes of default-schedule
    timing, and the options with the cost model trained beside it where ``--cost-model`` is
    not given (its choice printed). Returns (log, options)."""
    from ..logs import TuningLog
    log = TuningLog(args.log or default_log(args, model, args.key))
    log.require_writable()  # before minutes of default-schedule timing
    log.require_version("tune into it")  # records of another code generation: re-measure
    if args.cost_model is None:  # the one trained on this device's logs, where there is one
        import dataclasses

        from ..tuning.pretrained import beside
        options = dataclasses.replace(options, cost_model=beside(log.path))
    print("cost model: " + (f"trained, from {options.cost_model}" if options.cost_model
                            else "untrained"), flush=True)
    return log, options


def _choose_tasks(args, everything: list, pool: list, target, runner, log) -> tuple[list, dict]:
    """The tasks to tune among ``pool`` (``--time-share``, ``--untuned``, ``--top``,
    ``--flops-share``) and the default-schedule times they start from (``{workload key:
    seconds per call}``, timed on the device once and cached in the log): with
    ``--time-share`` every kernel of ``everything`` is timed first (its sum printed in ms per
    pass of all graphs), else only the chosen tasks' (and, with ``--untuned``, the
    candidates')."""
    from ..tasks import select
    from ..tuning.defaults import kernel_time_s, measure_defaults, select_by_time
    if args.time_share:
        t0 = time.perf_counter()
        latency = measure_defaults(everything, target, runner, log,
                                   builder_workers=args.build_workers)
        step_ms = kernel_time_s(everything, latency) * 1e3
        failed = sum(1 for v in latency.values() if not math.isfinite(v))
        print(f"default schedules: {len(everything)} kernels sum to {step_ms:.1f} ms per "
              f"pass of all graphs ({failed} failed to run); measured in "
              f"{time.perf_counter() - t0:.0f} s, cached in {log.path}", flush=True)
        pool = select(pool, top=None, flops_share=None, skip_empty=False)
        if args.untuned:
            pool = _untuned(pool, latency, log)
        tasks = select_by_time(pool, latency, args.time_share)
        return (tasks[:args.top] if args.top else tasks), latency
    if args.untuned:  # the candidates' default schedules timed, to compare with records
        pool = _untuned(pool, measure_defaults(pool, target, runner, log,
                                               builder_workers=args.build_workers), log)
    tasks = select(pool, top=args.top, flops_share=args.flops_share)
    # the tuned tasks' default schedules, timed once (cached in the log, as --time-share
    # does for every kernel): the baseline a record must beat to be compiled by export
    return tasks, measure_defaults(tasks, target, runner, log, builder_workers=args.build_workers)


def _native_half_for_tuning(args, target, device) -> None:
    """For ``--precision autocast16``: refused unless the device reports cl_khr_fp16
    (:func:`thomas_tune.half_arith.require_fp16`, from ``--device-profile``, the server's
    extension list or the target), else every kernel of this process and the builders it
    starts is built in the native form (:data:`thomas_tune.kernel_signature.NATIVE_HALF_ENV`)."""
    if getattr(args, "precision", "float32") != "autocast16":
        return
    from ..half_arith import require_fp16
    from ..kernel_signature import NATIVE_HALF_ENV
    from ..limits import find_profile
    from ..rpc.probe import read_profile
    path = getattr(args, "device_profile", None) or find_profile(args.log)
    why = require_fp16("autocast16", target, device, read_profile(path) if path else None)
    print(f"--precision autocast16: the device reports cl_khr_fp16 ({why}); candidates are "
          "built with half arithmetic", flush=True)
    os.environ[NATIVE_HALF_ENV] = "1"


def cmd_tune(args) -> int:
    from .. import rpc
    from ..tasks import extract, summary
    from ..tuning.driver import rpc_runner, tune
    from ..remote import check_device
    from ..target import cross_compiler, resolve_target, write_device_file
    options = _tune_options(args)
    model, _, _ = load_model(args)
    target, device = resolve_target(args.target, args.host, rpc.parse_address(args.tracker),
                                    args.key, wait_s=args.wait)  # opencl:remote: the server's
    cross_compiler(target)  # a missing or wrong cross compiler fails before any work
    _native_half_for_tuning(args, target, device)
    pattern = _match_pattern(args)
    tracker = rpc.parse_address(args.tracker)
    rpc.wait_for_key(tracker, args.key, timeout=args.wait)
    check_device(tracker, args.key, target, timeout=args.wait)  # loads code linked here
    free = rpc.wait_for_key(tracker, args.key, timeout=args.wait)
    everything = extract(model_graphs(args, model), target)
    pool = _matching(args, everything, pattern)
    log, options = _open_log(args, model, options)
    if device is not None:  # the limits the log's records were measured under
        write_device_file(log.path, device)
    STOP["log"] = log  # what a stop by signal reports
    runner = rpc_runner(tracker, args.key, servers=args.servers or free,
                        **_bounds(args, log.path), repeat=args.repeat,
                        min_repeat_ms=args.min_repeat_ms)
    tasks, latency = _choose_tasks(args, everything, pool, target, runner, log)
    if not tasks and args.untuned:
        print("nothing to tune: every chosen task has a record faster than its default "
              "schedule (--untuned)", flush=True)
        return 0
    if not args.brief:
        print(summary(tasks, sum(t.total_flops for t in everything)), flush=True)
    lanes = args.servers or free  # --servers: lanes asked for; else the servers free now
    print(f"tuning {len(tasks)} tasks, {args.trials} trials, on {lanes} server(s) of key "
          f"{args.key!r}; tuning log {log.path}", flush=True)
    try:
        report = tune(tasks, target, log, runner, options, default_s=latency)
    except BaseException:
        if "signal" not in STOP:  # stopped by SIGINT/SIGTERM: one line, not a traceback
            raise
        sig = STOP["signal"]
        print(f"tuning stopped by {signal.Signals(sig).name}: {safe_records(log)} records "
              f"are safe in {log.record_path} (batches in flight at the signal were measured "
              "and logged); run the same command again to resume", file=sys.stderr, flush=True)
        return 128 + sig
    return _print_tune_report(args, report)


def _print_tune_report(args, report) -> int:
    """Print what a finished tuning run did (trials, seeds, throughput, per task); returns
    the exit status: 3 where more than ``--max-failed-share`` of its trials failed (the
    reason on stderr), else 0."""
    print(f"measured {report.trials} new trials ({report.local} of them one decision from a "
          f"task's best record; {report.skipped} candidates already in the "
          f"log were not re-measured, {report.drawn} drawn at random from the design spaces "
          f"when a search proposed only measured ones; {report.resumed_records} records resumed, "
          f"{report.replayed_records} of them replayed in a start-up of "
          f"{report.startup_s:.1f} s)")
    if report.seeded:
        r = report.seeded
        print(f"seeded from {len(args.seed_log)} log(s): {r['measured']} seed records checked "
              f"and measured on this device ({r['failed']} failed, recorded as failed trials; "
              f"{r['resized']} of them refitted from other shapes; {r['unusable']} did not apply "
              f"here), {r['better']} task(s) got a faster record")
    print(f"throughput: {report.throughput_line()}")
    _print_tasks(report)
    failure = report.failure(args.max_failed_share)
    if failure is not None:
        print(f"error: tuning failed: {failure}. The records were logged as failed trials; "
              "an export keeps the default schedules of tasks with no working record. Fix "
              "the cause (the device server's log says more) and run the same command again",
              file=sys.stderr, flush=True)
        return 3
    return 0


def _print_tasks(report) -> None:
    """Per tuned task: trials, best time, GFLOP/s, failures and the last one's reason."""
    from ..measure.runner import error_line
    for t in report.tasks:
        if t.trials:
            to95 = f"{t.to95}/{t.records}" if t.to95 is not None else "-"
            print(f"  {t.name[:56]:<56} {t.trials:>4} trials  best {t.best_s * 1e3:9.4f} ms  "
                  f"{t.gflops:8.2f} GFLOP/s  ({t.errors} failed; 95% of the best after "
                  f"{to95} records)")
            if t.default_s is not None and t.best_s >= t.default_s:
                print(f"    its default schedule is faster ({t.default_s * 1e3:.4f} ms): an "
                      "export keeps the default")
            if t.errors:
                print(f"    last failure: {error_line(t.last_error, 200)}")
    for name, reason in report.search_failed.items():
        print(f"  {name[:56]}: search ended early: {reason}")


def add_tasks(sub) -> None:
    s = sub.add_parser("tasks", help="list the tasks of the inference and training graphs")
    add_model_args(s)
    add_target_arg(s)
    s.add_argument("--limit", type=int, default=0, help="show only the largest N tasks")
    add_cache_features_arg(s, "also list the tasks of")
    add_precision_arg(s)
    add_loss_scale_args(s)
    s.set_defaults(fn=cmd_tasks)


def _untuned(pool, latency, log):
    """``pool`` less the tasks whose best record in ``log`` beats its default schedule
    (:func:`thomas_tune.tuning.defaults.untuned`), with a line saying how many are left."""
    from ..tuning.defaults import untuned
    left = untuned(pool, latency, log)
    print(f"--untuned: {len(left)} of {len(pool)} tasks have no record faster than their "
          "default schedule", flush=True)
    return left


def _add_task_choice(s) -> None:
    """``tune``'s budget and its choice of tasks: trials, their rounds, --top, --match,
    --flops-share, --time-share, --untuned."""
    s.add_argument("--trials", type=int, default=64, help="measurements in all (default 64)")
    s.add_argument("--trials-per-iter", type=int, default=8,
                   help="candidates measured per task per round (default 8)")
    s.add_argument("--top", type=int, help="tune only the N tasks with the most FLOPs")
    s.add_argument("--match", help="choose among the tasks whose name matches this regular "
                   "expression (Python re.search), or whose workload key it matches whole (the "
                   "'workload' of a bench's kernel table in JSON), only; the other options "
                   "select among them")
    s.add_argument("--flops-share", type=float,
                   help="tune the fewest largest tasks covering this share of FLOPs")
    s.add_argument("--time-share", type=float,
                   help="first time every kernel with its default schedule on the device, then "
                        "tune the fewest slowest tasks covering this share of that time")
    s.add_argument("--untuned", action="store_true",
                   help="choose among the tasks that have no record in the log faster than "
                        "their default schedule (timed on the device first, cached in the "
                        "log) only: after a change of the graph or of the code generation, the "
                        "kernels an export would still run on default schedules; with "
                        "--time-share, the share is of those tasks' default time")


def _add_search_size(s) -> None:
    """The evolutionary search's population and rounds of mutation per search round."""
    s.add_argument("--population", type=int, default=128,
                   help="evolutionary-search population per round (default 128)")
    s.add_argument("--genetic-iters", type=int, default=2,
                   help="rounds of mutation per search round (default 2); the search's host "
                        "time per round grows with population x rounds")


def _add_measurement(s) -> None:
    """How candidates are measured on the device servers: servers at once, the trial's
    limits (s), the device profile, repeats, build processes, batches in flight."""
    s.add_argument("--servers", type=int, help="device servers measuring at once (default: "
                   "all free servers of the key)")
    s.add_argument("--trial-timeout", type=float, default=None,
                   help="seconds the timed runs of a trial may take before it is cut and "
                        "recorded as an error (default 20, more for a device profile with "
                        "slow launches)")
    s.add_argument("--compile-timeout", type=float, default=None,
                   help="seconds the device's build of a candidate's OpenCL programs may take "
                        "before the trial is cut and recorded as an error (default 30, or 20x "
                        "the device profile's probed compile time where that is more)")
    add_profile_arg(s, "--log's device_profile.json", "its probed compile time and launch "
                    "overhead set --compile-timeout and --trial-timeout when not given")
    s.add_argument("--repeat", type=int, default=3, help="timed repeats per trial (default 3)")
    s.add_argument("--min-repeat-ms", type=float, default=2.0,
                   help="length of one repeat; runs per repeat are sized from a warm-up run "
                        "(default 2 ms)")
    s.add_argument("--build-workers", type=int, help="build processes (default: CPU count)")
    s.add_argument("--in-flight", type=int, default=3,
                   help="batches measured while the next is searched and built (default 3; "
                        "1: search, build and measure take turns)")


def _add_refinement(s) -> None:
    """The unroll limit and the refinement stages around the search: --refine-top, the seed
    logs and their records per workload."""
    s.add_argument("--max-unroll", type=int,
                   help="largest unroll limit the search chooses on GPUs (of 0, 16, 64, 512, "
                        "1024; default: all): smaller candidates build and compile faster; "
                        "the best records then get the larger limits (--refine-top)")
    s.add_argument("--refine-top", type=int, default=2,
                   help="best records per task measured again before the search with "
                        "their padding moved out of the inner loop into the shared-memory "
                        "fill (convolutions), best records of each other workload of the "
                        "same contraction (a twin with or without a fused ReLU) measured on "
                        "it, and, with "
                        "--max-unroll, after it with each larger unroll limit (default 2; "
                        "0: none)")
    s.add_argument("--seed-log", action="append", metavar="DIR",
                   help="a tuning log (of another device, model or code generation; packed or "
                   "not; repeatable) to seed the search from: before it, the --seed-top best "
                   "records of each of its workloads that a task matches (the same kernel, or "
                   "a twin of the same contraction; for a task that matches none, the best "
                   "records of the nearest kernels of the same computation at other shapes, "
                   "tile sizes refitted) are checked and measured on this device and enter "
                   "--log as its own trials; the seed logs are only read")
    s.add_argument("--seed-top", type=int, default=4,
                   help="records per matching workload of each --seed-log measured, and per "
                   "task seeded from other shapes (default 4)")


def _add_run_control(s) -> None:
    """The run's statistics file, cost model, local-search share, bound on failed trials,
    seed and printout."""
    s.add_argument("--stats", help="write trials/s and the time split as JSON here (every "
                   "30 s while tuning, and at the end, also after SIGINT or SIGTERM; its 'ended' "
                   "says how the run ended), and per task the trials, in the log's order, to "
                   "95%% of its final best speed ('trials_to_95pct') and of its final gain over "
                   "the default schedule ('trials_to_95pct_gain')")
    s.add_argument("--cost-model", help="folder of a trained cost model ('thomas-tune log "
                   "train-cost-model') the session's model starts from and keeps training "
                   "(default: the one beside the tuning log, <log>/../cost_model, where there "
                   "is one; 'none': an untrained model)")
    s.add_argument("--local-share", type=float, default=0.25,
                   help="share of each batch given to schedules one decision away from the "
                        "task's best records (coordinate descent; default 0.25; 0: "
                        "evolutionary search only)")
    s.add_argument("--max-failed-share", type=float, default=0.5, metavar="SHARE",
                   help="exit with status 3 when more than this share (0..1) of the run's "
                        "trials failed, naming the first errors (default 0.5)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--brief", action="store_true",
                   help="leave out the table of the chosen tasks before tuning (the line "
                        "that says how many are tuned stays)")


def add_tune(sub) -> None:
    s = sub.add_parser("tune", help="tune the tasks on device servers of a tracker")
    add_model_args(s)
    add_target_arg(s)
    s.add_argument("--tracker", required=True, help="tracker HOST:PORT")
    s.add_argument("--key", required=True, help="device key of the servers to measure on")
    _add_task_choice(s)
    s.add_argument("--log", help="tuning-log folder (default tuning_logs/<key>/<model tag>)")
    s.add_argument("--wait", type=float, default=30, help="seconds to wait for a free server")
    _add_search_size(s)
    _add_measurement(s)
    _add_refinement(s)
    _add_run_control(s)
    add_cache_features_arg(s, "also tune the tasks of")
    add_precision_arg(s)
    add_loss_scale_args(s)
    s.set_defaults(fn=cmd_tune)
