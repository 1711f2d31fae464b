"""The ``thomas-tune`` command: tasks, rpc, tune, export, replay, train, infer, bench, demo.

Running an export (``train --export DIR``, ``infer``, ``bench --tracker/--key``) needs no
compiler: with ``TVM_USE_RUNTIME_LIB=1`` in the environment, TVM loads only its runtime
library and the command's imports take about half the time (``TVM_USE_RUNTIME_LIB=1
thomas-tune train --export DIR ...``). The verbs that compile refuse to run so (exit status 2,
saying why).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time

DEFAULT_LOG_ROOT = "tuning_logs"


# ---- shared options ---------------------------------------------------------------------------
def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="mobilenet_v2",
                   help="mobilenet_v2, mobilenet_v1 or alexnet (default: mobilenet_v2)")
    g.add_argument("--width", type=float, default=0.35, help="width multiplier (default 0.35)")
    g.add_argument("--resolution", type=int, default=64, help="input size in pixels (default 64)")
    g.add_argument("--classes", type=int, help="number of classes (default 10; with "
                   "--checkpoint, a different number replaces the classifier head)")
    g.add_argument("--checkpoint", help="a .npz checkpoint: its architecture, shape and weights "
                   "replace --model/--width/--resolution")
    g.add_argument("--batch", type=int, default=8, help="images per training step (default 8)")
    g.add_argument("--infer-batch", type=int, default=1, help="batch of the inference module")
    g.add_argument("--trainable", default="all",
                   help="'all' or 'last:K' (the last K layers train, the rest are frozen); "
                        "',frozen-bn' after either keeps every BatchNorm in inference form")
    g.add_argument("--from-scratch", action="store_true",
                   help="fresh random weights even if --checkpoint is given (all trainable)")
    g.add_argument("--optimizer", default="momentum_sgd", choices=["momentum_sgd", "sgd", "adam"])
    g.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=0.0)


def _target_arg(p, default="llvm"):
    p.add_argument("--target", default=default,
                   help="llvm, opencl, a tag such as qcom/adreno-opencl, or a JSON dict "
                        f"(default {default})")
    if "--host" in p._option_string_actions:  # rpc server: --host is its bind address
        return
    p.add_argument("--host", help="where the compiled code runs: android-aarch64 (a phone), "
                   "linux-aarch64, native, or an llvm triple; a foreign host is linked with "
                   "the cross compiler TVM_NDK_CC names (default: this machine)")


def _remote_args(p) -> None:
    g = p.add_argument_group("device server (run the export there, e.g. on a phone)")
    g.add_argument("--tracker", help="tracker HOST:PORT of the device server")
    g.add_argument("--key", help="device key of the server (e.g. galaxy-s8)")
    g.add_argument("--wait", type=float, default=60,
                   help="seconds to wait for a free server (default 60)")
    g.add_argument("--session-timeout", type=float, default=None,
                   help="seconds each RPC session may last, sent in whole seconds (default "
                        "900); a longer run renews its session between steps, state kept")


def _session(args, checkpoint: str | None = None, seed: int = 0):
    """The export of ``--export`` loaded here, or on a device server of ``--tracker``/``--key``;
    started from ``checkpoint``'s weights (and class names) when given."""
    from .runtime import RemoteDevice, Session
    remote = None
    if args.tracker or args.key:
        if not (args.tracker and args.key):
            raise ValueError("--tracker and --key go together: the tracker's HOST:PORT and "
                             "the device key of the server to run on")
        from .rpc import parse_address
        remote = RemoteDevice(parse_address(args.tracker), args.key, args.session_timeout,
                              wait_s=args.wait)
    session = Session(args.export, remote=remote, seed=seed)
    if checkpoint:
        session.load_checkpoint(checkpoint)
    return session


def _model(args):
    from .models import build, init_params, load_checkpoint, replace_head
    classes = None
    if args.checkpoint:
        model, tensors, classes = load_checkpoint(args.checkpoint)
        if args.classes and args.classes != model.num_classes:
            model, tensors = replace_head(model, tensors, args.classes,
                                          seed=getattr(args, "seed", 0))
            classes = None
    else:
        model = build(args.model, num_classes=args.classes or 10, resolution=args.resolution,
                      width=args.width)
        tensors = init_params(model)
    if args.from_scratch:
        tensors = init_params(model, seed=int(time.time()) % 100000)
        args.trainable = "all"
    return model, tensors, classes


def _optimizer(args):
    from .graph import OptimizerConfig
    return OptimizerConfig(name=args.optimizer, lr=args.lr, momentum=args.momentum,
                           weight_decay=args.weight_decay)


def _graphs(args, model):
    from . import graph as G
    return {"infer": G.inference_module(model, args.infer_batch),
            "train": G.training_module(model, args.batch, args.trainable, _optimizer(args)).mod}


def _model_tag(model, args) -> str:
    return (f"{model.arch}-w{model.width:g}-r{model.resolution}-c{model.num_classes}"
            f"-b{args.batch}")


# ---- verbs ------------------------------------------------------------------------------------
def cmd_tasks(args) -> int:
    from .target import parse_target
    from .tasks import extract, summary
    model, _, _ = _model(args)
    tasks = extract(_graphs(args, model), parse_target(args.target, args.host))
    total = sum(t.total_flops for t in tasks)
    print(summary(tasks[: args.limit] if args.limit else tasks, total))
    if args.limit and len(tasks) > args.limit:
        print(f"(first {args.limit} of {len(tasks)} tasks by FLOPs)")
    return 0


def cmd_rpc(args) -> int:
    from . import rpc
    if args.rpc_verb == "tracker":
        tracker = rpc.start_tracker(args.host, args.port)
        print(f"tracker listening on {args.host}:{tracker.port}", flush=True)
        procs = [tracker]
    else:
        addr = rpc.parse_address(args.tracker)
        if args.target != "llvm":
            import thomas_tune  # noqa: F401  (loads runtime extensions before serving)
        # restarted whenever its process dies (a kernel that kills the device process)
        rpc.serve(addr, args.key, host=args.host, port=args.port, duration=args.duration,
                  log=sys.stdout)
        return 0
    deadline = time.monotonic() + args.duration if args.duration else None
    try:
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            p.terminate()
    return 0


def _default_log(args, model, key):
    return os.path.join(DEFAULT_LOG_ROOT, key, _model_tag(model, args))


def cmd_tune(args) -> int:
    from . import rpc
    from .target import parse_target
    from .tasks import extract, select, summary
    import math

    from .measure.runner import error_line
    from .tuning.driver import TuneOptions, rpc_runner, tune
    from .tuning_log import TuningLog
    from .runtime import check_device
    from .target import cross_compiler, resolve_target, write_device_file
    options = TuneOptions(  # its checks fail here, before the tracker is contacted
        trials=args.trials, trials_per_iter=args.trials_per_iter, seed=args.seed,
        population=args.population, builder_workers=args.build_workers, stats_path=args.stats,
        max_in_flight=args.in_flight, max_unroll=args.max_unroll, refine_top=args.refine_top,
        genetic_iters=args.genetic_iters)
    model, _, _ = _model(args)
    target, device = resolve_target(args.target, args.host, rpc.parse_address(args.tracker),
                                    args.key, wait_s=args.wait)  # opencl:remote: the server's
    cross_compiler(target)  # a missing or wrong cross compiler fails before any work
    try:
        pattern = re.compile(args.match) if args.match else None
    except re.error as err:
        raise ValueError(f"--match {args.match!r} is not a regular expression ({err})") from None
    tracker = rpc.parse_address(args.tracker)
    rpc.wait_for_key(tracker, args.key, timeout=args.wait)
    check_device(tracker, args.key, target, timeout=args.wait)  # loads code linked here
    free = rpc.wait_for_key(tracker, args.key, timeout=args.wait)
    everything = extract(_graphs(args, model), target)
    pool = everything
    if pattern is not None:
        from .tasks import matching
        pool = matching(everything, pattern)
        if not pool:
            raise ValueError(f"no task name or workload key matches --match {args.match!r}; "
                             "'thomas-tune tasks' with the same model options lists the names")
    log = TuningLog(args.log or _default_log(args, model, args.key))
    log.require_writable()  # before minutes of default-schedule timing
    if device is not None:  # the limits the log's records were measured under
        write_device_file(log.path, device)
    _STOP["log"] = log  # what a stop by signal reports
    runner = rpc_runner(tracker, args.key, servers=args.servers or free,
                        trial_timeout_s=args.trial_timeout,
                        compile_timeout_s=args.compile_timeout, repeat=args.repeat,
                        min_repeat_ms=args.min_repeat_ms)
    latency = None
    if args.time_share:
        from .tuning.defaults import kernel_time_s, measure_defaults, select_by_time
        t0 = time.perf_counter()
        latency = measure_defaults(everything, target, runner, log,
                                   builder_workers=args.build_workers)
        step_ms = kernel_time_s(everything, latency) * 1e3
        failed = sum(1 for v in latency.values() if not math.isfinite(v))
        print(f"default schedules: {len(everything)} kernels sum to {step_ms:.1f} ms per "
              f"pass of all graphs ({failed} failed to run); measured in "
              f"{time.perf_counter() - t0:.0f} s, cached in {log.path}", flush=True)
        tasks = select_by_time(select(pool, top=None, flops_share=None, skip_empty=False),
                               latency, args.time_share)
        if args.top:
            tasks = tasks[:args.top]
    else:
        from .tuning.defaults import measure_defaults
        tasks = select(pool, top=args.top, flops_share=args.flops_share)
        # the tuned tasks' default schedules, timed once (cached in the log, as --time-share
        # does for every kernel): the baseline a record must beat to be compiled by export
        latency = measure_defaults(tasks, target, runner, log, builder_workers=args.build_workers)
    print(summary(tasks, sum(t.total_flops for t in everything)), flush=True)
    lanes = args.servers or free  # --servers: lanes asked for; else the servers free now
    print(f"tuning {len(tasks)} tasks, {args.trials} trials, on {lanes} server(s) of key "
          f"{args.key!r}; tuning log {log.path}", flush=True)
    try:
        report = tune(tasks, target, log, runner, options, default_s=latency)
    except BaseException:
        if "signal" not in _STOP:  # stopped by SIGINT/SIGTERM: one line, not a traceback
            raise
        sig = _STOP["signal"]
        print(f"tuning stopped by {signal.Signals(sig).name}: {_safe_records(log)} records "
              f"are safe in {log.record_path} (batches in flight at the signal were measured "
              "and logged); run the same command again to resume", file=sys.stderr, flush=True)
        return 128 + sig
    print(f"measured {report.trials} new trials ({report.skipped} candidates already in the "
          f"log were not re-measured, {report.drawn} drawn at random from the design spaces "
          f"when a search proposed only measured ones; {report.resumed_records} records resumed, "
          f"{report.replayed_records} of them replayed in a start-up of "
          f"{report.startup_s:.1f} s)")
    print(f"throughput: {report.throughput_line()}")
    for t in report.tasks:
        if t.trials:
            print(f"  {t.name[:56]:<56} {t.trials:>4} trials  best {t.best_s * 1e3:9.4f} ms  "
                  f"{t.gflops:8.2f} GFLOP/s  ({t.errors} failed)")
            if t.errors:
                print(f"    last failure: {error_line(t.last_error, 200)}")
    for name, reason in report.search_failed.items():
        print(f"  {name[:56]}: search ended early: {reason}")
    return 0


def cmd_remeasure(args) -> int:
    """Time the best records of the model's tasks in ``--log`` again (and with ``--defaults``
    the default schedules); see :mod:`thomas_tune.remeasure`. Returns 1 when a re-measure
    failed (the record keeps its old time), else 0."""
    from . import rpc
    from .remeasure import remeasure
    from .runtime import check_device
    from .target import parse_target
    from .tasks import extract
    from .tuning.defaults import kernel_time_s, measure_defaults, read_default_times
    from .tasks import key as workload_key
    from .tuning.driver import rpc_runner
    from .tuning_log import TuningLog
    model, _, _ = _model(args)
    target = parse_target(args.target, args.host)
    log = TuningLog(args.log)
    if not log.exists():
        raise ValueError(f"tuning log {args.log!r} has no records; tune first or fix the path")
    log.require_writable()  # its times are rewritten in place
    tracker = rpc.parse_address(args.tracker)
    rpc.wait_for_key(tracker, args.key, timeout=args.wait)
    check_device(tracker, args.key, target, timeout=args.wait)
    free = rpc.wait_for_key(tracker, args.key, timeout=args.wait)
    tasks = extract(_graphs(args, model), target)
    runner = rpc_runner(tracker, args.key, servers=args.servers or free,
                        trial_timeout_s=args.trial_timeout,
                        compile_timeout_s=args.compile_timeout, repeat=args.repeat,
                        min_repeat_ms=args.min_repeat_ms)
    try:
        if args.defaults:
            t0 = time.perf_counter()
            cached = read_default_times(log.path, target,
                                        {workload_key(t): t.mod for t in tasks})
            latency = measure_defaults(tasks, target, runner, log,
                                       builder_workers=args.build_workers, refresh=True)
            was = (f"{1e3 * kernel_time_s(tasks, cached):.2f} ms before (cached)" if cached
                   else "none cached before")
            print(f"default schedules: {len(tasks)} kernels timed again in "
                  f"{time.perf_counter() - t0:.0f} s; sum per pass of all graphs "
                  f"{1e3 * kernel_time_s(tasks, latency):.2f} ms now, {was}", flush=True)
        t0 = time.perf_counter()
        report = remeasure(log, target, runner, {workload_key(t) for t in tasks},
                           top_k=args.top_k, builder_workers=args.build_workers,
                           progress=lambda d, n: print(f"  {d}/{n} records", flush=True))
    finally:
        runner.shutdown()
    print(f"remeasured {report.measured} records of {len(report.best)} workloads in "
          f"{time.perf_counter() - t0:.0f} s ({report.failed} failed and kept their old time); "
          f"best time moved by more than 1.25x for {report.changed()} workloads")
    for why, n in sorted(report.reasons.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  {n} x {why}")
    return 1 if report.failed else 0


def _export_model(args, out: str) -> dict:
    """Compile the model of the model options (with ``--log``'s schedules) into ``out``; the
    export's manifest. Raises ValueError for a tuning log with no records."""
    from .export import export
    from .rpc import parse_address
    from .target import resolve_target
    from .tuning_log import TuningLog
    model, tensors, classes = _model(args)
    log = TuningLog(args.log) if args.log else None
    if log is not None and not log.exists():
        raise ValueError(f"tuning log {args.log!r} has no records; tune first, or drop --log "
                         "to export with default schedules")
    tracker = getattr(args, "tracker", None)  # opencl:remote: the server's or the log's
    target, device = resolve_target(args.target, args.host, tracker and parse_address(tracker),
                                    getattr(args, "key", None), args.log,
                                    wait_s=getattr(args, "wait", 60))
    return export(out, model, tensors, target, batch=args.batch,
                  infer_batch=args.infer_batch, trainable=args.trainable,
                  optimizer=_optimizer(args), log=log, classes=classes, device=device)


def cmd_export(args) -> int:
    manifest = _export_model(args, args.out)
    print(f"exported {manifest['arch']} to {args.out}: {len(manifest['trainable'])} trainable, "
          f"{len(manifest['frozen'])} frozen parameters; tuning log "
          f"{manifest['tuning_log'] or 'none'} (sha256 {str(manifest['tuning_log_sha256'])[:12]})")
    return 0


def cmd_replay(args) -> int:
    from .replay import failed_minimum, replay
    from .target import parse_target
    from .tuning_log import TuningLog
    model, _, _ = _model(args)
    report = replay(model, parse_target(args.target, args.host), TuningLog(args.log),
                    batch=args.batch,
                    infer_batch=args.infer_batch, trainable=args.trainable,
                    check=not args.no_check, min_flops_coverage=args.min_flops_coverage,
                    min_time_coverage=args.min_time_coverage)
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
            print(f"FAIL: {len(report.records_wrong)} record(s) compute wrong numbers; 'thomas-tune "
                  "log check --records' with the same model options sets them aside",
                  file=sys.stderr)
    elif not args.no_check:
        print(f"tuning records not checked: {report.records_unchecked}")
    if report.checked:
        e = report.errors
        # tuned gradients may be no worse than 10x the default schedules' float32 error
        tol = {"logits": 1e-4, "loss": 1e-4,
               "gradients": max(args.grad_tolerance, 10 * e["gradients_default_schedules"])}
        for k in ("logits", "loss", "gradients"):
            good = e[k] <= tol[k]
            ok &= good
            print(f"max relative error of {k} vs float64 reference: {e[k]:.2e} "
                  f"({'ok' if good else 'FAIL'}, tolerance {tol[k]:.1e})")
        print(f"(float32 with default schedules: gradients {e['gradients_default_schedules']:.2e})")
    else:
        print("float64 check of the whole graphs not run: it runs llvm targets of this "
              "machine only")
    return 0 if ok else 1


def _data(args, model):
    from .data import load
    return load(args.data, model.resolution, limit=args.limit, seed=args.seed)


def _export_for_train(args) -> str:
    """``train`` without ``--export``: compile the model for its trainable set first."""
    out = args.out or tempfile.mkdtemp(prefix="thomas-tune-train-")
    manifest = _export_model(args, out)
    mode = "from scratch" if args.from_scratch else f"trainable {args.trainable}"
    print(f"compiled {manifest['arch']} ({mode}) into {out}", flush=True)
    return out


def _warn_identity_batchnorms(session, args) -> None:
    """Say so when the weights hold uncalibrated BatchNorms of a fused ONNX import and the
    step trains BatchNorm in its training form (or may: an export does not record it)."""
    from .graph import parse_trainable
    from .models.onnx_import import identity_batchnorms
    fused = identity_batchnorms(session.model, session.tensors())
    if not fused or (not args.export_given and parse_trainable(args.trainable)[1] == "frozen"):
        return
    print(f"warning: {len(fused)} BatchNorm layers are the identity of a fused ONNX import: "
          "in training form they discard each channel's learned scale and shift; import with "
          "--calibrate DATA, or train with --trainable all,frozen-bn"
          + (" (ignore this if the export was made so)" if args.export_given else ""),
          file=sys.stderr)


def cmd_train(args) -> int:
    from .train import fine_tune
    checkpoint = args.checkpoint if args.export else None  # else compiled in below
    args.export_given = bool(args.export)
    if not args.export:
        args.export = _export_for_train(args)
    session = _session(args, checkpoint, seed=args.seed)
    data = _data(args, session.model)
    n = session.model.num_classes
    if len(data.classes) > n:
        print(f"error: data set has {len(data.classes)} classes, the model "
              f"{n}; export a model with --classes "
              f"{len(data.classes)}", file=sys.stderr)
        return 2
    # the labels are the data's class indices: its names go with the weights it trains
    session.classes = [str(c) for c in data.classes] + [str(i) for i in
                                                        range(len(data.classes), n)]
    _warn_identity_batchnorms(session, args)
    train, test = data.split(args.test_fraction, seed=args.seed)
    print(f"data {data.source}: {len(train.y)} training / {len(test.y)} held-out images, "
          f"{len(data.classes)} classes; {len(session.manifest['trainable'])} trainable "
          f"parameters", flush=True)
    r = fine_tune(session, train, test, args.steps, seed=args.seed,
                  show_progress=not args.quiet)
    print(f"accuracy before {100 * r.acc_before:.1f}%  after {100 * r.acc_after:.1f}%  "
          f"({r.steps} steps, loss {r.losses[0]:.3f} -> {r.losses[-1]:.3f}, "
          f"{r.ms_per_step:.1f} ms per training step)")
    if session.renewals:  # sessions of --session-timeout s, renewed with the state kept
        print(f"{len(session.renewals)} session renewal(s) on the device server")
    if args.save:
        session.save(args.save)
        print(f"saved checkpoint {args.save}")
    if args.out and not args.export_given:  # the export this run compiled: keep it trained
        session.save(os.path.join(args.export, "params.npz"))
        print(f"{args.export} holds the fine-tuned weights and class names: 'thomas-tune infer "
              f"--export {args.export} IMAGE' classifies with them")
    return 0


def cmd_infer(args) -> int:
    import numpy as np
    from .data import IMAGE_EXTENSIONS, to_model_input
    session = _session(args, args.checkpoint)
    if args.data:
        data = _data(args, session.model)
        acc = session.evaluate(data.x, data.y)
        print(f"accuracy on {data.source}: {100 * acc:.1f}% of {len(data.y)} images")
        return 0
    from PIL import Image
    paths = [p for p in args.images if p.lower().endswith(IMAGE_EXTENSIONS)]
    if not paths:
        print("error: give image files or --data", file=sys.stderr)
        return 2
    images = []
    for p in paths:
        try:
            with Image.open(p) as im:
                images.append(np.asarray(im.convert("RGB"), dtype="float32"))
        except OSError as err:  # missing, unreadable, or not an image (UnidentifiedImageError)
            raise ValueError(f"image {p!r} cannot be read ({err}); give image files "
                             "(PNG, JPEG, ...) or --data") from err
    logits = session.predict(to_model_input(images, session.model.resolution))
    names = session.classes or [str(i) for i in range(session.model.num_classes)]
    for p, row in zip(paths, logits):
        e = np.exp(row - row.max())
        k = int(np.argmax(row))
        print(f"{p}: {names[k]} ({100 * e[k] / e.sum():.1f}%)")
    return 0


def _bench_remote(args) -> int:
    """``bench --export E --tracker HOST:PORT --key KEY``: time E's training steps and
    inference on that device server (wall time here, RPC round trips included)."""
    import numpy as np
    from .runtime import time_steps
    if not args.export:
        raise ValueError("bench on a device server needs --export (an export for that "
                         "device, e.g. made with --host android-aarch64)")
    session = _session(args, args.checkpoint, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal(session.model.input_shape(session.batch)).astype("float32")
    y = rng.integers(0, session.model.num_classes, session.batch)
    session.train_step(x, y)  # warm-up
    ms = time_steps(session, x, y, args.steps)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        session.predict(x[: session.infer_batch])
    infer_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    print(json.dumps({"export": args.export, "device_key": args.key, "batch": session.batch,
                      "ms_per_training_step": round(ms, 3),
                      "ms_per_inference": round(infer_ms, 3)}))
    return 0


def cmd_bench(args) -> int:
    """Side by side on this machine's device: the model compiled with --log (tuned) and with
    default schedules, and PyTorch eager; see :mod:`thomas_tune.bench`. With --tracker/--key:
    one export timed on that device server (``_bench_remote``)."""
    if args.tracker or args.key:
        return _bench_remote(args)
    from . import bench
    from .target import parse_target
    work = args.work or tempfile.mkdtemp(prefix="thomas-tune-bench-")
    if args.export:  # one existing export: its model, shapes, target and trainable set
        from .export import read_manifest
        from .graph import OptimizerConfig
        from .models import load_checkpoint
        m = read_manifest(args.export)
        model, tensors, _ = load_checkpoint(os.path.join(args.export, "params.npz"))
        target = parse_target(m["target"])
        trainable = m["trainable"]
        opt = m["optimizer"]
        optimizer = OptimizerConfig(**{**opt, "betas": tuple(opt["betas"])})
        log = args.log or (m["tuning_log"] if m["tuning_log"] and
                           os.path.isdir(m["tuning_log"]) else None)
        exports = {"tuned" if m["tuning_log"] else "default": args.export}
    else:
        model, tensors, _ = _model(args)
        target = parse_target(args.target)
        trainable, optimizer, log = args.trainable, _optimizer(args), args.log
        exports = bench.prepare_exports(model, tensors, target, log, work, args.batch,
                                        args.infer_batch, trainable, optimizer,
                                        stock=args.stock_defaults)
    cfg = bench.BenchConfig(steps=args.steps, warmup=args.warmup, kernels=args.kernels,
                            kernel_min_ms=args.kernel_min_ms, startup=not args.no_startup,
                            torch=not args.no_torch, refresh_peaks=args.refresh_peaks,
                            seed=args.seed, progress=not args.quiet)
    res = bench.run_bench(model, tensors, target, exports, cfg, log, trainable, optimizer)
    res["exports"] = exports
    out_json = args.json or os.path.join(work, "bench.json")
    curve = res.get("tuning_curve")
    if curve:
        png = args.plot or os.path.splitext(out_json)[0] + "-tuning-curve.png"
        m = res["model"]
        res["tuning_curve_png"] = bench.plot_curve(
            curve, png, f"{m['arch']} w{m['width']:g} r{m['resolution']} c{m['num_classes']} "
                        f"b{res['batch']} {res['trainable']}\n{res['device']}")
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1, default=float)
    print(bench.format_report(res, top=args.kernels or 12))
    print(f"\nwritten: {out_json}" + (f", {res['tuning_curve_png']}"
                                      if res.get("tuning_curve_png") else ""))
    return 0


def cmd_import_onnx(args) -> int:
    from .models import save_checkpoint
    from .models.onnx_import import import_onnx
    model, tensors, report = import_onnx(args.onnx, args.model, width=args.width,
                                         resolution=args.resolution, num_classes=args.classes,
                                         seed=args.seed)
    cal = None
    if args.calibrate and report.fused_batchnorms:
        from .data import load
        from .models.onnx_import import calibrate_batchnorms
        import numpy as np
        x = load(args.calibrate, model.resolution, limit=args.calibrate_images, seed=args.seed).x
        images = x[np.random.default_rng(args.seed).permutation(len(x))[:args.calibrate_images]]
        tensors, cal = calibrate_batchnorms(model, tensors, images, report.fused_batchnorms)
    save_checkpoint(args.out, model, tensors)
    print(f"imported {report.layers} layers of {args.onnx} into {model.arch} "
          f"(width {model.width:g}, {model.resolution}x{model.resolution}, "
          f"{model.num_classes} classes) -> {args.out}")
    n_fused = len(report.fused_batchnorms)
    if cal is not None:
        print(f"  {n_fused} BatchNorm layers were fused into their convolutions in the file: "
              f"calibrated on {cal.images} images of {args.calibrate} (scale, shift and "
              "running statistics from the per-channel mean and variance of each layer's "
              "input; inference output unchanged, max relative change "
              f"{cal.logits_change:.1e}): training-form BatchNorm starts from the imported "
              "network")
    elif n_fused:
        print(f"  {n_fused} BatchNorm layers were fused into their convolutions in the file: "
              "imported as identity BatchNorms (same inference output). Training them in "
              "training form discards each channel's learned scale and shift: import with "
              "--calibrate DATA (images like those the network was trained on), or train "
              "with --trainable all,frozen-bn (or last:K,frozen-bn)")
    elif args.calibrate:
        print("  no BatchNorm was fused in the file (statistics imported): nothing to "
              "calibrate")
    if report.replaced_head:
        print(f"  classifier head {report.replaced_head} replaced: {report.onnx_classes} -> "
              f"{model.num_classes} classes, freshly initialised")
    return 0


def cmd_memory(args) -> int:
    from .memory import training_memory
    model, _, _ = _model(args)
    modes = args.modes.split(",") if args.modes else [args.trainable]
    rows = []
    for mode in modes:
        m = training_memory(model, args.batch, mode, _optimizer(args)).as_dict()
        rows.append({"trainable": mode, **m})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    keys = ["parameters", "gradients", "optimizer_state", "activations_kept", "peak"]
    print(f"{model.arch} w{model.width:g} r{model.resolution} batch {args.batch}, MiB:")
    print(f"{'trainable':>10}" + "".join(f"{k:>18}" for k in keys))
    for r in rows:
        print(f"{r['trainable']:>10}" + "".join(f"{r[k] / 2**20:>18.2f}" for k in keys))
    return 0


def cmd_demo(args) -> int:
    """The product's story on loopback: tune the training step of the shipped pretrained
    network (digits 0-4), fine-tune it on the unseen digits 5-9, report tuned against untuned
    ms per step from the same run (see :mod:`thomas_tune.demo`)."""
    from . import demo, opencl
    if args.target.startswith("opencl") and not opencl.available():
        try:
            opencl.load()
            why = "no OpenCL device is visible"
        except opencl.OpenCLUnavailable as err:
            why = str(err)
        print(f"error: the demo runs on OpenCL but {why}. Install PoCL (apt-get install "
              "pocl-opencl-icd ocl-icd-opencl-dev opencl-headers g++) or run "
              "'thomas-tune demo --target llvm --key local-cpu'", file=sys.stderr)
        return 2
    args.work = args.work or tempfile.mkdtemp(prefix="thomas-tune-demo-")
    return demo.run(args, main)


# ---- parser -----------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="thomas-tune", description=__doc__)
    sub = p.add_subparsers(dest="verb", required=True)

    s = sub.add_parser("tasks", help="list the tasks of the inference and training graphs")
    _model_args(s)
    _target_arg(s)
    s.add_argument("--limit", type=int, default=0, help="show only the largest N tasks")
    s.set_defaults(fn=cmd_tasks)

    s = sub.add_parser("rpc", help="start a TVM RPC tracker or device server")
    rsub = s.add_subparsers(dest="rpc_verb", required=True)
    t = rsub.add_parser("tracker")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=9190)
    t.add_argument("--duration", type=float, default=0, help="stop after N seconds (0: never)")
    t = rsub.add_parser("server")
    t.add_argument("--tracker", default="127.0.0.1:9190", help="tracker HOST:PORT")
    t.add_argument("--key", required=True, help="device key to register under")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=9090)
    t.add_argument("--duration", type=float, default=0, help="stop after N seconds (0: never)")
    _target_arg(t)
    s.set_defaults(fn=cmd_rpc)

    s = sub.add_parser("tune", help="tune the tasks on device servers of a tracker")
    _model_args(s)
    _target_arg(s)
    s.add_argument("--tracker", required=True, help="tracker HOST:PORT")
    s.add_argument("--key", required=True, help="device key of the servers to measure on")
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
    s.add_argument("--log", help="tuning-log folder (default tuning_logs/<key>/<model tag>)")
    s.add_argument("--wait", type=float, default=30, help="seconds to wait for a free server")
    s.add_argument("--population", type=int, default=128,
                   help="evolutionary-search population per round (default 128)")
    s.add_argument("--genetic-iters", type=int, default=2,
                   help="rounds of mutation per search round (default 2); the search's host "
                        "time per round grows with population x rounds")
    s.add_argument("--servers", type=int, help="device servers measuring at once (default: "
                   "all free servers of the key)")
    s.add_argument("--trial-timeout", type=float, default=20.0,
                   help="seconds the timed runs of a trial may take before it is cut and "
                        "recorded as an error (default 20)")
    s.add_argument("--compile-timeout", type=float, default=30.0,
                   help="seconds the device's build of a candidate's OpenCL programs may take "
                        "before the trial is cut and recorded as an error (default 30)")
    s.add_argument("--repeat", type=int, default=3, help="timed repeats per trial (default 3)")
    s.add_argument("--min-repeat-ms", type=float, default=2.0,
                   help="length of one repeat; runs per repeat are sized from a warm-up run "
                        "(default 2 ms)")
    s.add_argument("--build-workers", type=int, help="build processes (default: CPU count)")
    s.add_argument("--in-flight", type=int, default=3,
                   help="batches measured while the next is searched and built (default 3; "
                        "1: search, build and measure take turns)")
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
    s.add_argument("--stats", help="write trials/s and the time split as JSON here (every "
                   "30 s while tuning, and at the end, also after SIGINT or SIGTERM; its 'ended' "
                   "says how the run ended)")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_tune)

    s = sub.add_parser("remeasure", help="time a log's best records (and the default "
                       "schedules) again on the device; the new times replace the old")
    _model_args(s)
    _target_arg(s)
    s.add_argument("--tracker", required=True, help="tracker HOST:PORT")
    s.add_argument("--key", required=True, help="device key of the servers to measure on")
    s.add_argument("--log", required=True, help="tuning-log folder")
    s.add_argument("--top-k", type=int, default=2,
                   help="records per workload timed again, fastest first (default 2)")
    s.add_argument("--defaults", action="store_true",
                   help="also time every task's default schedule again (default_latency.json)")
    s.add_argument("--wait", type=float, default=30, help="seconds to wait for a free server")
    s.add_argument("--servers", type=int, help="device servers measuring at once (default: "
                   "all free servers of the key)")
    s.add_argument("--trial-timeout", type=float, default=20.0)
    s.add_argument("--compile-timeout", type=float, default=30.0)
    s.add_argument("--repeat", type=int, default=3, help="timed repeats per record (default 3)")
    s.add_argument("--min-repeat-ms", type=float, default=2.0)
    s.add_argument("--build-workers", type=int, help="build processes (default: CPU count)")
    s.set_defaults(fn=cmd_remeasure)

    s = sub.add_parser("export", help="compile inference and training modules with a log")
    _model_args(s)
    _target_arg(s)
    s.add_argument("--log", help="tuning-log folder (none: default schedules)")
    s.add_argument("--out", required=True, help="export folder")
    s.add_argument("--tracker", help="with --target opencl:remote: the tracker HOST:PORT of "
                   "the device server to read the limits from (else --log's device.json)")
    s.add_argument("--key", help="with --target opencl:remote: that server's device key")
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("replay", help="compile from a tuning log with no device and check it")
    _model_args(s)
    _target_arg(s)
    s.add_argument("--log", required=True)
    s.add_argument("--min-flops-coverage", type=float, default=0.5,
                   help="fail when tuned tasks hold less than this share of FLOPs (0.5)")
    s.add_argument("--min-time-coverage", type=float, default=0.0,
                   help="fail when tuned tasks hold less than this share of the untuned "
                        "kernel time measured on the device (default_latency.json in the log "
                        "folder; for logs of tune --time-share; default 0: not checked)")
    s.add_argument("--grad-tolerance", type=float, default=1e-3,
                   help="max relative gradient error vs float64, or 10x that of the default "
                        "schedules in float32 if larger (default 1e-3)")
    s.add_argument("--no-check", action="store_true",
                   help="skip the numeric checks: each applied record against its default "
                        "schedule on this machine's device, and the float64 check of the "
                        "graphs (llvm targets)")
    s.set_defaults(fn=cmd_replay)

    for name, fn, hlp in (("train", cmd_train, "fine-tune on data: an export, or a model "
                                                "compiled for --trainable / --from-scratch"),
                          ("infer", cmd_infer, "classify images with an exported module")):
        s = sub.add_parser(name, help=hlp)
        if name == "train":
            s.add_argument("--export", help="export folder (default: compile the model given "
                           "by the model options into --out first)")
            _model_args(s)
            _target_arg(s)
            s.add_argument("--log", help="tuning log for that compile (default: none)")
            s.add_argument("--out", help="folder for that compile (default: a temp folder); "
                           "after training it holds the fine-tuned weights and class names")
        else:
            s.add_argument("--export", required=True, help="export folder")
            s.add_argument("--checkpoint", help="weights (and class names) to classify with, "
                           "e.g. train --save's: same model as the export, no recompile")
        _remote_args(s)
        s.add_argument("--data", default=None if name == "infer" else "mnist5k",
                       help="image folder (one sub-folder per class) or a shipped data set: "
                            "mnist5k, digits")
        s.add_argument("--limit", type=int, help="use at most N images (stratified)")
        s.add_argument("--seed", type=int, default=0)
        if name == "train":
            s.add_argument("--steps", type=int, default=200)
            s.add_argument("--test-fraction", type=float, default=0.2)
            s.add_argument("--save", help="write the fine-tuned checkpoint here")
            s.add_argument("--quiet", action="store_true", help="no progress bar")
        else:
            s.add_argument("images", nargs="*", help="image files")
        s.set_defaults(fn=fn)

    s = sub.add_parser("import-onnx", help="pretrained weights from an ONNX file -> checkpoint")
    s.add_argument("onnx", help="ONNX file with the torchvision layer layout")
    s.add_argument("--model", required=True, help="mobilenet_v2, mobilenet_v1 or alexnet")
    s.add_argument("--width", type=float, default=1.0, help="width multiplier (default 1.0)")
    s.add_argument("--resolution", type=int, help="input size (default: the ONNX input's)")
    s.add_argument("--classes", type=int,
                   help="classes (default: the file's; another number replaces the head)")
    s.add_argument("--seed", type=int, default=0, help="seed of a replaced head")
    s.add_argument("--out", required=True, help="checkpoint .npz to write")
    s.add_argument("--calibrate", metavar="DATA", help="image folder or shipped data set: "
                   "recover the scale, shift and statistics of BatchNorms fused in the file "
                   "from these images (like those the network was trained on)")
    s.add_argument("--calibrate-images", type=int, default=512,
                   help="images of --calibrate to use (default 512)")
    s.set_defaults(fn=cmd_import_onnx)

    s = sub.add_parser("memory", help="bytes a training step needs, by trainable set")
    _model_args(s)
    s.add_argument("--modes", help="comma-separated trainable sets, e.g. all,last:4,last:1")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_memory)

    s = sub.add_parser("bench", help="side by side on one device: tuned vs default schedules "
                       "vs PyTorch eager; kernels, peaks, start-up, tuning curve")
    _model_args(s)
    _target_arg(s)
    _remote_args(s)
    s.add_argument("--log", help="tuning log of the tuned variant (none: default schedules and "
                   "PyTorch only)")
    s.add_argument("--export", help="bench this export instead of compiling the model options")
    s.add_argument("--work", help="folder for the exports and the JSON (default: a temp folder; "
                   "exports already there with the same settings are reused)")
    s.add_argument("--steps", type=int, default=20, help="timed training steps and inference "
                   "passes per variant (median; default 20)")
    s.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    s.add_argument("--kernels", type=int, default=12, help="rows of the kernel table; 0 skips "
                   "timing each kernel (default 12)")
    s.add_argument("--kernel-min-ms", type=float, default=1.0,
                   help="length of one timed repeat of a kernel (default 1 ms)")
    s.add_argument("--no-startup", action="store_true",
                   help="skip the first/second start measurement (OpenCL)")
    s.add_argument("--no-torch", action="store_true", help="skip PyTorch eager")
    s.add_argument("--stock-defaults", action="store_true",
                   help="also a variant whose kernels get TVM's own default GPU schedules "
                   "(dlight's rules) instead of thomas_tune's: what tuning gains over TVM "
                   "untuned")
    s.add_argument("--refresh-peaks", action="store_true",
                   help="measure the device's peak FLOP/s and bandwidth again")
    s.add_argument("--json", help="result file (default WORK/bench.json)")
    s.add_argument("--plot", help="tuning-curve PNG (default next to the JSON; needs "
                   "matplotlib)")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("demo", help="tune a pretrained MobileNetV2 (digits 0-4) on loopback and "
                       "fine-tune it on the unseen digits 5-9; tuned vs untuned ms per step")
    s.add_argument("--checkpoint", help="pretrained checkpoint (default: the shipped "
                   "models/pretrained/mobilenet_v2-w0.35-r64-mnist0to4.npz)")
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--trainable", default="all")
    s.add_argument("--lr", type=float, default=0.01)
    s.add_argument("--target", default="opencl",
                   help="opencl (this machine's OpenCL device, PoCL on a CPU) or llvm")
    s.add_argument("--key", default="local-opencl")
    s.add_argument("--trials", type=int, default=16,
                   help="tuning trials (default 16: two per task of --top)")
    s.add_argument("--top", type=int, default=8, help="tune the N largest tasks (default 8)")
    s.add_argument("--steps", type=int, default=150, help="fine-tuning steps (default 150)")
    s.add_argument("--compare-steps", type=int, default=10,
                   help="batches timed through both the tuned and the untuned build, the two "
                   "alternating step by step (default 10)")
    s.add_argument("--loss-window", type=int, default=20,
                   help="steps averaged for the first/last mean training loss (default 20)")
    s.add_argument("--data", default="mnist5k", help="a data set of digits (default mnist5k)")
    s.add_argument("--limit", type=int, default=2000, help="images of digits 5-9 used "
                   "(80%% to train, 20%% held out; default 2000)")
    s.add_argument("--save", help="write the fine-tuned checkpoint here")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--log", help="tuning-log folder (default: inside --work)")
    s.add_argument("--work", help="folder for the log and the exports (default: a temp folder)")
    s.set_defaults(fn=cmd_demo)

    from .log_cli import add_parser as add_log_parser
    add_log_parser(sub, _model_args, _target_arg)
    return p


_STOP: dict = {}  # the signal that stopped this process, if any; the tuning log it reports


#: after SIGINT/SIGTERM, the clean stop's time before the process exits anyway (while tuning, the
#: clean stop waits for the batches in flight: on the H100, up to 3 batches of 64 trials)
STOP_GRACE_S = 60.0


def _terminate(signum, frame):
    # SIGTERM ends the run as SIGINT does: TVM's C++ loops, which run Python's signal handlers
    # from inside long calls, unwind on KeyboardInterrupt (the tuner's own loop stops from its
    # task scheduler instead: thomas_tune.tuning); main() then exits with 128 + signal.
    # Should the clean stop not finish (a build or session stuck in native code), the process
    # exits after STOP_GRACE_S all the same: tuning records are on disk as they arrive.
    if "signal" not in _STOP:
        _STOP["signal"] = signum
        timer = threading.Timer(STOP_GRACE_S, _force_exit, args=(signum,))
        timer.daemon = True
        timer.start()
    raise KeyboardInterrupt


def _force_exit(signum: int) -> None:
    name = signal.Signals(signum).name
    log = _STOP.get("log")
    if log is not None:
        print(f"tuning stopped by {name}: {_safe_records(log)} records are safe in "
              f"{log.record_path} (trials in flight are lost); run the same command again to "
              "resume", file=sys.stderr, flush=True)
    else:
        print(f"stopped by {name} (the clean stop took over {STOP_GRACE_S:g} s)",
              file=sys.stderr, flush=True)
    os._exit(128 + signum)


def _safe_records(log) -> int:
    """Complete records (lines that parse) in a tuning log's record file."""
    n = 0
    if os.path.exists(log.record_path):
        with open(log.record_path) as f:
            for line in f:
                try:
                    json.loads(line)
                    n += line.endswith("\n")
                except ValueError:
                    pass
    return n


RUNTIME_ONLY_ENV = "TVM_USE_RUNTIME_LIB"


def _runs_without_compiler(args) -> bool:
    """True for the verbs that only run an export: ``infer``, ``train --export``, ``bench
    --tracker/--key`` (a process with TVM's runtime library alone runs them)."""
    return (args.fn is cmd_infer or (args.fn is cmd_train and bool(args.export))
            or (args.fn is cmd_bench and bool(args.tracker or args.key)))


def main(argv=None) -> int:
    """Entry point; returns the exit status (2 for bad input, with the reason on stderr; also
    for a verb that compiles in a process without TVM's compiler, ``TVM_USE_RUNTIME_LIB=1``)."""
    signal.signal(signal.SIGTERM, _terminate)  # so that loopback servers are stopped
    signal.signal(signal.SIGINT, _terminate)
    args = parser().parse_args(argv)
    from . import compiler_available
    if not compiler_available() and not _runs_without_compiler(args):
        print(f"error: this command compiles, and this process loaded TVM without its "
              f"compiler ({RUNTIME_ONLY_ENV}=1): run it without {RUNTIME_ONLY_ENV} (only "
              "infer, train --export and bench --tracker/--key run with the runtime alone)",
              file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except (ValueError, TimeoutError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sig = _STOP.get("signal", signal.SIGINT)
        print(f"stopped by {signal.Signals(sig).name}", file=sys.stderr)
        return 128 + sig


if __name__ == "__main__":
    sys.exit(main())
