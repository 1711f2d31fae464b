"""``thomas-tune log show|check|merge|digests|carry|...``: look into tuning logs, check one
against a model, merge the logs of several devices or runs, carry one over to a new code
generation that makes the same kernels.

* ``show LOG``: records per workload (failed trials counted apart), the best time of each, the
  targets measured, the failed trials' reasons by count (``trial_errors.jsonl``), and any line
  that does not parse (file and line). Changes nothing.
* ``check LOG --model ...``: the same lines checked and bad ones set aside (``*.rejected``), then
  the model's tasks matched against the log: tuned tasks, share of FLOPs covered, records for
  other targets, workloads that belong to no task of the model. Exit status 1 when a line was
  bad or no task of the model is tuned. With ``--records``, every record a build of the model
  applies is run on this machine's device against its default schedule and wrong ones are set
  aside (:func:`thomas_tune.compiler.build_plan.set_aside_wrong`). The log's code-generation version
  (:mod:`thomas_tune.logs.codegen`) is checked too: records of another version are flagged
  (exit status 1), a log of unknown version is reported as such.
* ``merge SRC... --out DEST``: every distinct record of the sources, once, in ``DEST``.
* ``digests LOG... --out-dir DIR``: the kernel digests of the logs' records under this
  installation's code generation (:mod:`thomas_tune.logs.carry`), one file per log.
* ``carry LOG --from-digests FILE``: the log restamped with this installation's code-generation
  version when every record's kernel (and its workload's default schedule) is byte-identical to
  the one its stamped version made (``FILE``: the digests made under that version's code, with
  ``tools/kernel_digests.py``); refused, writing nothing, otherwise (exit status 1).
* ``train-cost-model LOG... --out DIR``: MetaSchedule's XGBoost cost model trained on the logs'
  records (:mod:`thomas_tune.tuning.pretrained`), saved in ``DIR`` for ``tune --cost-model``.
"""

from __future__ import annotations

import collections
import json
import os
import sys

from ..logs import TuningLog, merge, read_errors, read_log, summarize
from .options import add_model_args, add_target_arg, load_model, model_graphs


def _print_rejected(rejected, out=None) -> None:
    for path, line, why in rejected:  # sys.stdout looked up now: it may have been replaced
        print(f"  {path}:{line}: {why}", file=out or sys.stdout)


def cmd_show(args) -> int:
    """Print the contents of a tuning log (see the module docstring); returns 0."""
    contents = read_log(args.log)
    rows = summarize(contents)
    if args.json:
        version = TuningLog(args.log).version()
        print(json.dumps({"log": args.log, "workloads": rows,
                          "codegen": {"status": version.status, "stamp": version.stamp,
                                      "differs": version.differs},
                          "rejected": [list(r) for r in contents.rejected]}, indent=1))
        return 0
    n = len(contents.records)
    failed = sum(r["failed"] for r in rows)
    print(f"tuning log {args.log}: {len(rows)} workloads, {n} records ({failed} failed trials)")
    print(f"measured with {TuningLog(args.log).version().line()}")
    print(f"{'#':>3}  {'records':>7} {'failed':>6} {'best ms':>10}  {'target':<8} workload")
    for r in rows:
        best = f"{r['best_ms']:.4f}" if r["best_ms"] is not None else "-"
        print(f"{r['workload']:>3}  {r['records']:>7} {r['failed']:>6} {best:>10}  "
              f"{r['target']:<8} {r['label'][:100]}")
    errors = read_errors(TuningLog(args.log))
    if errors:
        why = collections.Counter(e.get("reason", "?")[:160] for e in errors)
        print(f"failed trials with their reasons ({len(errors)} in "
              f"{os.path.join(args.log, 'trial_errors.jsonl')}):")
        for reason, k in why.most_common(8):
            print(f"  {k:>4} x {reason}")
    if contents.rejected:
        print(f"{len(contents.rejected)} line(s) do not parse ('thomas-tune log check' sets "
              "them aside):")
        _print_rejected(contents.rejected)
    return 0


def cmd_check(args) -> int:
    """Check a log's lines (setting bad ones aside) and its coverage of the model's tasks."""
    from ..compiler.replay import coverage
    from ..target import parse_target
    from ..tasks import extract

    read_log(args.log)  # a clear error for a folder that holds no tuning log
    log = TuningLog(args.log)
    report = log.check(report_to=sys.stdout)
    model, _, _ = load_model(args)
    target = parse_target(args.target)
    tasks = extract(model_graphs(args, model), target)
    database = log.database(check=False)
    n, flops = coverage(tasks, database)
    total = sum(t.total_flops for t in tasks) or 1.0
    contents = read_log(args.log)
    task_hashes = set(_task_hashes(tasks))
    foreign = sum(1 for _, h in contents.workloads if h not in task_hashes)
    kinds = collections.Counter(b[2].get("kind") for _, b in contents.records
                                if len(b) > 2 and isinstance(b[2], dict))
    print(f"tuning log {args.log}: {report.workloads} workloads, {report.records} records "
          f"({len(report.rejected)} bad line(s) set aside)")
    print(f"{model.arch} (width {model.width:g}, {model.resolution}x{model.resolution}, "
          f"batch {args.batch}, trainable {args.trainable}) on {target.kind.name}: {n}/"
          f"{len(tasks)} tasks tuned, {100 * flops / total:.1f}% of FLOPs")
    if foreign:
        print(f"{foreign} workload(s) of the log belong to no task of this model (another "
              "model, size, batch or trainable set)")
    other = {k: v for k, v in kinds.items() if k != target.kind.name}
    if other:
        print("records measured for other targets: "
              + ", ".join(f"{v} {k}" for k, v in sorted(other.items())))
    ok = not report.rejected and n > 0
    version = log.version()
    if version.status == "other" and report.records:
        ok = False
        print(f"FAIL: all {report.records} records were measured with {version.line()}; their "
              "times are not trusted: 'thomas-tune remeasure --restamp' with the same model "
              f"options and --log {args.log} measures the best of each workload again and "
              "stamps the log, or 'thomas-tune tune --seed-log' seeds a new log from it")
    elif version.status == "unknown" and report.records:
        print(f"note: the {report.records} records were measured with {version.line()}: their "
              "times are not trusted until measured again ('thomas-tune remeasure --restamp')")
    else:
        print(f"records measured with {version.line()}")
    if args.records:
        from ..compiler.build_plan import set_aside_wrong
        aside = set_aside_wrong(log, target, model_graphs(args, model))
        print(f"records: every record a build of this model applies was run on this machine's "
              f"device against its default schedule; {aside} wrong record(s) set aside "
              f"({log.record_path}.rejected)")
    if args.untuned is not None:
        _print_untuned(tasks, log, database, target, args.untuned)
    if n == 0:
        print(f"FAIL: no task of this model has a record; tune it first ('thomas-tune tune' with "
              f"the same model options and --log {args.log})")
    return 0 if ok else 1


def _print_untuned(tasks, log, database, target, limit: int) -> None:
    """The tasks an export would run on their default schedule (no record faster than it:
    :func:`thomas_tune.tuning.defaults.untuned`, what ``tune --untuned`` chooses among), the
    ``limit`` slowest first by default-schedule time x calls of all graphs (the log's
    ``default_latency.json``); tasks without a cached default time after them, by FLOPs."""
    import math

    from ..tasks import key
    from ..tuning.defaults import kernel_time_s, read_default_times, untuned
    times = read_default_times(log.path, target, {key(t): t.mod for t in tasks}) or {}

    def default_s(t) -> float | None:
        s = times.get(key(t))
        return s if s is not None and math.isfinite(s) else None

    def cost(t) -> float:  # default time x calls, s; -1 for a task without a time
        s = default_s(t)
        return -1.0 if s is None else s * t.weight

    left = untuned(tasks, times, log, database)
    left.sort(key=lambda t: (-cost(t), -t.total_flops))
    timed = sum(1 for t in left if default_s(t) is not None)
    print(f"untuned: {len(left)} of {len(tasks)} tasks have no record faster than their "
          f"default schedule; {kernel_time_s(left, times) * 1e3:.2f} ms of default time per "
          f"pass of all graphs ({timed} of them timed, default_latency.json)")
    if not left:
        return
    print(f"  {'task':<44} {'calls':>5} {'default ms':>11} {'x calls':>9} {'best record ms':>15}")
    for t in left[:limit]:
        s, best = default_s(t), log.best_seconds(database, t.mod)
        d = (f"{s * 1e3:11.4f} {s * t.weight * 1e3:9.4f}" if s is not None
             else f"{'-':>11} {'-':>9}")
        b = f"{best * 1e3:15.4f}" if best is not None else f"{'-':>15}"
        print(f"  {t.name[:44]:<44} {t.weight:>5} {d} {b}")
    if len(left) > limit:
        print(f"  ({len(left) - limit} more)")


def _task_hashes(tasks):
    import tvm_ffi
    return [int(tvm_ffi.structural_hash(t.mod)) for t in tasks]


def cmd_merge(args) -> int:
    """Merge tuning logs into ``--out``; returns 1 when a source had lines that do not parse."""
    report = merge(args.logs, args.out)
    print(f"merged {len(args.logs)} log(s) into {args.out}: {report.workloads} workloads, "
          f"{report.records} distinct records ({report.duplicates} duplicate(s) kept once)")
    print(f"merged log measured with {report.version}")
    if report.rejected:
        print(f"{len(report.rejected)} line(s) of the sources do not parse and were left out "
              "(the sources are unchanged):")
        _print_rejected(report.rejected)
        return 1
    return 0


def cmd_pack(args) -> int:
    """xz-compress tuning logs in place (read-only from then on; for commits)."""
    from ..logs import pack
    for path in args.logs:
        before, after = pack(path)
        print(f"packed {path}: {before / 1e6:.2f} MB -> {after / 1e6:.2f} MB")
    return 0


def cmd_unpack(args) -> int:
    """Undo 'log pack' in place, so that the logs can be tuned into again."""
    from ..logs import unpack
    for path in args.logs:
        print(f"unpacked {path}: {unpack(path) / 1e6:.2f} MB")
    return 0


def cmd_digests(args) -> int:
    """Write the kernel digests of each log's records into ``--out-dir``."""
    from ..logs.carry import compute_digests, digests_name, write_digests
    os.makedirs(args.out_dir, exist_ok=True)
    for path in args.logs:
        read_log(path)  # a clear error for a folder that holds no tuning log, before any work
        digests = compute_digests(path)
        out = os.path.join(args.out_dir, digests_name(path))
        write_digests(digests, out)
        print(f"{path}: {len(digests.records)} records, {len(digests.defaults)} default "
              f"schedules digested under code generation {digests.codegen['id']} in "
              f"{digests.seconds:.0f} s -> {out}")
    return 0


def cmd_carry(args) -> int:
    """Restamp a log when its kernels are the same under this code generation; 1 if refused."""
    from ..logs.carry import CarryRefused, carry, read_digests
    read_log(args.log)
    try:
        old = read_digests(args.from_digests)
        new = read_digests(args.digests) if args.digests else None
        report = carry(args.log, old, new)
    except CarryRefused as err:
        print(f"refused: {err}")
        return 1
    print(f"carried {args.log} from code generation {report.old} to {report.new}: "
          f"{report.records - report.changed} records' kernels ({report.errors} failing to "
          f"build under both) and {report.defaults} default schedules identical")
    if report.set_aside:
        from ..logs import STALE
        print(f"set aside: {report.set_aside} failed trials whose kernels changed, moved to "
              f"{os.path.join(args.log, STALE)} (a search may measure them again)")
    return 0


def cmd_train_cost_model(args) -> int:
    """Train the cost model on the logs' records and save it in ``--out``
    (:func:`thomas_tune.tuning.pretrained.train_cost_model`)."""
    from ..tuning.pretrained import train_cost_model
    for path in args.logs:
        read_log(path)  # a clear error for a folder that holds no tuning log, before any work
    info = train_cost_model(args.logs, args.out, max_per_workload=args.per_workload or None,
                            seed=args.seed, threads=args.threads)
    print(f"cost model trained on {info['records']} records of {len(args.logs)} log(s) "
          f"({info['skipped']} whose trace no longer applies left out): features "
          f"{info['features_s']:.0f} s, training {info['train_s']:.0f} s "
          f"({info['boosting_rounds']} boosting rounds); {info['bytes'] / 1e6:.2f} MB in "
          f"{args.out}")
    return 0


def add_parser(sub) -> None:
    """Add the ``log`` verb and its sub-verbs to ``sub``."""
    s = sub.add_parser("log", help="show a tuning log, check it against a model, merge, pack "
                       "and unpack logs")
    lsub = s.add_subparsers(dest="log_verb", required=True)
    t = lsub.add_parser("show", help="records, failures and best time per workload")
    t.add_argument("log", help="tuning-log folder")
    t.add_argument("--json", action="store_true")
    t.set_defaults(fn=cmd_show)
    t = lsub.add_parser("check", help="set bad lines aside; coverage of a model's tasks")
    t.add_argument("log", help="tuning-log folder")
    add_model_args(t)
    add_target_arg(t)
    t.add_argument("--records", action="store_true",
                   help="also run each record a build of the model applies on this machine's "
                        "device against its default schedule, and set wrong ones aside until "
                        "every applied record is right (unpacked logs only)")
    t.add_argument("--untuned", type=int, nargs="?", const=20, metavar="N",
                   help="also list the N (default 20) slowest tasks with no record faster than "
                        "their default schedule, by default-schedule time x calls (the log's "
                        "default_latency.json): what 'tune --untuned' chooses among")
    t.set_defaults(fn=cmd_check)
    t = lsub.add_parser("merge", help="merge logs of several devices or runs")
    t.add_argument("logs", nargs="+", help="tuning-log folders to merge")
    t.add_argument("--out", required=True, help="folder of the merged log (may exist)")
    t.set_defaults(fn=cmd_merge)
    t = lsub.add_parser("pack", help="xz-compress logs in place (read-only; as committed)")
    t.add_argument("logs", nargs="+", help="tuning-log folders")
    t.set_defaults(fn=cmd_pack)
    t = lsub.add_parser("unpack", help="undo 'log pack', to tune into a log again")
    t.add_argument("logs", nargs="+", help="tuning-log folders")
    t.set_defaults(fn=cmd_unpack)
    t = lsub.add_parser("digests", help="the kernel digests of logs' records under this "
                        "installation's code generation (for 'log carry')")
    t.add_argument("logs", nargs="+", help="tuning-log folders")
    t.add_argument("--out-dir", required=True, help="folder of the digests files")
    t.set_defaults(fn=cmd_digests)
    t = lsub.add_parser("carry", help="restamp a log with this code generation when its "
                        "kernels are byte-identical under it")
    t.add_argument("log", help="tuning-log folder (stamped with the old version)")
    t.add_argument("--from-digests", required=True, metavar="FILE",
                   help="the log's kernel digests made under its stamped version's code "
                        "(tools/kernel_digests.py in a checkout of that version)")
    t.add_argument("--digests", metavar="FILE",
                   help="the digests under this installation ('log digests'); made here when "
                        "left out")
    t.set_defaults(fn=cmd_carry)
    t = lsub.add_parser("train-cost-model", help="train the XGBoost cost model on logs' "
                        "records; 'tune' starts from it (--cost-model)")
    t.add_argument("logs", nargs="+", help="tuning-log folders")
    t.add_argument("--out", required=True, help="folder to save it in (e.g. "
                   "tuning_logs/<device>/cost_model, which 'tune' picks up for logs beside it)")
    t.add_argument("--per-workload", type=int, default=64,
                   help="records per workload of each log, drawn at random (default 64; 0: "
                        "all; features take about 40 ms per record on one core)")
    t.add_argument("--threads", type=int, default=1, help="threads (default 1)")
    t.add_argument("--seed", type=int, default=0, help="seed of the records drawn")
    t.set_defaults(fn=cmd_train_cost_model)
