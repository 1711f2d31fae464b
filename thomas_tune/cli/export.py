"""The verbs that compile: ``export`` (a model with a tuning log) and ``replay`` (a log checked)."""

from __future__ import annotations

import os
import sys

from .options import (add_cache_features_arg, add_loss_scale_args, add_memory_budget_arg,
                      add_model_args,
                      add_precision_arg, add_profile_arg, add_target_arg, budget_bytes,
                      load_model, loss_scale_of, optimizer_config)


def export_model(args, out: str) -> dict:
    """Compile the model of the model options (with ``--log``'s schedules) into ``out``; the
    export's manifest. Raises ValueError for a tuning log with no records."""
    from ..compiler.export import export
    from ..rpc import parse_address
    from ..target import resolve_target
    from ..logs import TuningLog
    model, tensors, classes = load_model(args)
    log = TuningLog(args.log) if args.log else None
    if log is not None and not log.exists():
        raise ValueError(f"tuning log {args.log!r} has no records; tune first, or drop --log "
                         "to export with default schedules")
    if log is not None and not getattr(args, "any_codegen", False):
        log.require_version("export from it (or give --any-codegen to use its times as "
                            "they are)")
    tracker = getattr(args, "tracker", None)  # opencl:remote: the server's or the log's
    target, device = resolve_target(args.target, args.host, tracker and parse_address(tracker),
                                    getattr(args, "key", None), args.log,
                                    wait_s=getattr(args, "wait", 60))
    return export(out, model, tensors, target, batch=args.batch,
                  device_profile=_profile_for_precision(args),
                  infer_batch=args.infer_batch, trainable=args.trainable,
                  optimizer=optimizer_config(args), log=log, classes=classes, device=device,
                  cache_features=getattr(args, "cache_features", False),
                  check_records=not getattr(args, "no_check", False),
                  precision=getattr(args, "precision", "float32"),
                  memory_budget=budget_bytes(getattr(args, "memory_budget", None)),
                  loss_scale=loss_scale_of(args))


def _profile_for_precision(args) -> dict | None:
    """The device profile that says whether the device reports cl_khr_fp16 (``--precision
    autocast16``): ``--device-profile``, or ``--log``'s device_profile.json; None for another
    precision or without one."""
    if getattr(args, "precision", "float32") != "autocast16":
        return None
    from ..limits import find_profile
    from ..rpc.probe import read_profile
    path = getattr(args, "device_profile", None) or find_profile(args.log)
    return read_profile(path) if path else None


def _check_against_profile(args) -> None:
    """The export in ``--out`` checked against ``--device-profile`` (or ``--log``'s
    device_profile.json), which is copied into it for ``train`` and ``infer`` to find."""
    import shutil

    from ..limits import check_before_run, find_profile
    from ..rpc.probe import PROFILE_FILE, read_profile
    path = args.device_profile or find_profile(args.log)
    if path is None:
        return
    read_profile(path)
    target = os.path.join(args.out, PROFILE_FILE)
    if os.path.abspath(path) != os.path.abspath(target):
        shutil.copyfile(path, target)
    check_before_run(args.out, "export", target)
    print(f"checked against the device profile {path}: within its limits")


def cmd_export(args) -> int:
    manifest = export_model(args, args.out)
    _check_against_profile(args)
    print(f"exported {manifest.arch} to {args.out}: {len(manifest.trainable)} trainable, "
          f"{len(manifest.frozen)} frozen parameters; tuning log "
          f"{manifest.tuning_log or 'none'} (sha256 {str(manifest.tuning_log_sha256)[:12]})")
    budget = manifest.memory_budget
    if budget:
        print(f"memory budget {budget['budget_bytes'] / 1e6:.1f} MB: {budget['level']} "
              f"recomputation, estimated peak {budget['estimated_peak_bytes'] / 1e6:.1f} MB")
    checks = manifest.record_check
    if manifest.tuning_log and checks["unchecked"]:
        print(f"its tuning records are UNCHECKED: {checks['unchecked']}")
    if manifest.features:
        shape = "x".join(map(str, manifest.features["shape"]))
        print(f"with the step on cached features (train --cache-features): {shape} float32 "
              "per image")
    return 0


def cmd_replay(args) -> int:
    from ..compiler.replay import failed_minimum, replay
    from ..target import parse_target
    from ..logs import TuningLog
    model, _, _ = load_model(args)
    report = replay(model, parse_target(args.target, args.host), TuningLog(args.log),
                    batch=args.batch,
                    infer_batch=args.infer_batch, trainable=args.trainable,
                    check=not args.no_check, min_flops_coverage=args.min_flops_coverage,
                    min_time_coverage=args.min_time_coverage)
    if report.records_unchecked and not report.tasks:  # a check that cannot run is no pass
        print(f"FAIL: the tuning records cannot be checked on this machine: "
              f"{report.records_unchecked}; give --no-check to replay without the checks "
              "(nothing compiled)", file=sys.stderr)
        return 1
    print(f"tuning log {args.log}: records measured with {TuningLog(args.log).version().line()}"
          " (a replay checks that they apply and compute the right numbers; it does not trust "
          "their times beyond choosing among them)")
    time_part = ("" if report.time_coverage is None else
                 f", {100 * report.time_coverage:.1f}% of the untuned kernel time "
                 f"{1e3 * report.time_s:.2f} ms measured on the device")
    print(f"{report.tuned}/{report.tasks} tasks have a tuning record "
          f"({100 * report.task_coverage:.1f}% of tasks, {100 * report.flops_coverage:.1f}% "
          f"of FLOPs{time_part})")
    if report.slower:
        print(f"{report.slower} workload(s) keep their default schedule: their best record is "
              "slower than the default measured on the device (default_latency.json)")
    why = failed_minimum(report, args.min_flops_coverage, args.min_time_coverage)
    ok = why is None
    if not ok:
        print(f"FAIL: {why}", file=sys.stderr)
    if report.records_checked is not None:
        print(f"{report.records_checked} applied tuning record(s) checked against their "
              f"default schedule on this machine's device: {len(report.records_wrong)} wrong")
        if report.records_wrong:
            ok = False
            print(f"FAIL: {len(report.records_wrong)} record(s) compute wrong numbers; "
                  "'thomas-tune log check --records' with the same model options sets them "
                  "aside",
                  file=sys.stderr)
    elif not args.no_check:  # a check that cannot run is no pass
        ok = False
        print(f"FAIL: the tuning records cannot be checked on this machine: "
              f"{report.records_unchecked}; give --no-check to replay without the checks",
              file=sys.stderr)
    if report.checked:
        from ..compiler.replay import LOGITS_TOL
        e = report.errors
        good = e["logits"] <= LOGITS_TOL
        ok &= good
        print(f"max relative error of logits vs {e['reference']}: {e['logits']:.2e} "
              f"({'ok' if good else 'FAIL'}, tolerance {LOGITS_TOL:.0e})")
        step = e["step"]  # loss and gradients: thomas_tune.step_check's formula and bounds
        ok &= step.ok
        print(f"loss and gradients vs {e['reference']} following the build's branches "
              f"({'ok' if step.ok else 'FAIL'}): {step.line()}")
    elif report.errors.get("why"):
        ok = False  # a check that cannot run is no pass
        print(f"FAIL: numbers not checked: {report.errors['why']}; give --no-check to replay "
              "without the checks", file=sys.stderr)
    elif not report.compiled:
        print("nothing compiled: the replay failed before (above)")
    else:
        print("float64 check of the whole graphs not run: it runs llvm targets of this "
              "machine only")
    return 0 if ok else 1


def add_export(sub) -> None:
    s = sub.add_parser("export", help="compile inference and training modules with a log")
    add_model_args(s)
    add_target_arg(s)
    s.add_argument("--log", help="tuning-log folder (none: default schedules)")
    s.add_argument("--out", required=True, help="export folder")
    s.add_argument("--tracker", help="with --target opencl:remote: the tracker HOST:PORT of "
                   "the device server to read the limits from (else --log's device.json)")
    s.add_argument("--key", help="with --target opencl:remote: that server's device key")
    s.add_argument("--any-codegen", action="store_true",
                   help="use a --log of another or an unknown code-generation version ('log "
                   "check' says which) with its times as they are (each applied record is "
                   "still checked); without it such a log is refused")
    add_cache_features_arg(s, "also compile")
    add_precision_arg(s)
    add_loss_scale_args(s)
    add_memory_budget_arg(s, "the step recomputes what it must to fit")
    add_profile_arg(s, "--log's device_profile.json", "the export is checked against its "
                    "limits and keeps it, for train and infer to check against")
    s.add_argument("--no-check", action="store_true",
                   help="apply --log's records without running each on this machine's device "
                   "first (needed where no device here runs the target); the output and the "
                   "manifest's record_check say so")
    s.set_defaults(fn=cmd_export)


def add_replay(sub) -> None:
    s = sub.add_parser("replay", help="compile from a tuning log with no device and check it")
    add_model_args(s)
    add_target_arg(s)
    s.add_argument("--log", required=True)
    s.add_argument("--min-flops-coverage", type=float, default=0.5,
                   help="fail when tuned tasks hold less than this share of FLOPs (0.5)")
    s.add_argument("--min-time-coverage", type=float, default=0.0,
                   help="fail when tuned tasks hold less than this share of the untuned "
                        "kernel time measured on the device (default_latency.json in the log "
                        "folder; for logs of tune --time-share; default 0: not checked)")
    s.add_argument("--no-check", action="store_true",
                   help="skip the numeric checks: each applied record against its default "
                        "schedule on this machine's device, and the float64 check of the "
                        "graphs (llvm targets)")
    s.set_defaults(fn=cmd_replay)
