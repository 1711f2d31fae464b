"""The demo's story: fine-tune a pretrained network on classes it has never seen, with tuned
kernels, and show what tuning bought.

The shipped checkpoint (``models/pretrained/mobilenet_v2-w0.35-r64-mnist0to4.npz``) was trained
by thomas_tune on MNIST digits 0-4 (``bench/four_levels.py``). The demo gives it a fresh
5-class head and fine-tunes it on digits 5-9 (mnist5k, split 80/20 by class, relabelled 0-4).
Before that it tunes the kernels of the training step on the device (``thomas-tune tune`` over
a loopback tracker), starting from the tuning log shipped for PoCL on x86-64
(:func:`shipped_log_path`): a tuning run of this step on one machine is a good start on
another of the same kind, but its times are that machine's, so its best records and their
default schedules are timed again here (``thomas-tune remeasure``) before the demo's own
trials. The untuned build (default schedules) is compiled in a child process meanwhile. From
the same run it reports ms per training step of the tuned build, the untuned build and, where
PyTorch is installed, PyTorch's eager float32 step of the same network, weights, trainable set
and optimizer on the same machine (:func:`pytorch_step`), all timed on the same batches (taking
turns step by step), and the mean training loss over the first and the last steps.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import numpy as np

FINE_TUNE_DIGITS = [5, 6, 7, 8, 9]


def shipped_log_path() -> str:
    """The tuning log shipped for the demo's training step on PoCL on x86-64
    (``tuning_logs/pocl-x86_64/mobilenet_v2-w0.35-r64-c5-b8`` in the source tree; packed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, "tuning_logs", "pocl-x86_64", "mobilenet_v2-w0.35-r64-c5-b8")


def start_from(shipped: str, log_dir: str) -> bool:
    """Copy the tuning log ``shipped`` (a folder, packed or not) to ``log_dir`` (which must not
    hold a log yet) and unpack it there, so that tuning appends to it. Returns False, and
    copies nothing, when ``shipped`` holds no log or ``log_dir`` already does."""
    import shutil

    from .logs import TuningLog, is_packed, unpack
    if not os.path.isdir(shipped) or TuningLog(log_dir).exists():
        return False
    shutil.copytree(shipped, log_dir, dirs_exist_ok=True)
    if is_packed(log_dir):
        unpack(log_dir)
    return True


def build_device_programs(export_dir: str, seed: int = 0, processes: int = 1,
                          evaluate: bool = True) -> None:
    """One training step and (``evaluate``) one evaluation (the training module's prediction,
    which the demo's accuracy uses) of the export in ``export_dir``, on random inputs: builds
    the OpenCL programs of its training module into the driver's kernel cache (and the
    program-binary cache on drivers that keep none: docs/opencl.md), so that the next process
    to run them builds none. The demo runs this in the untuned build's child process while it
    tunes (no evaluation: the untuned build is only timed), and for the tuned build before
    timing it; it never runs their inference module.

    ``processes`` > 1: that many processes first share the compiles (each launches only its
    share of the kernels, one work-group each: ``THOMAS_TUNE_OPENCL_WARM`` in docs/opencl.md),
    at once, then the step runs here on what they built. PoCL compiles each kernel at its first
    launch on one core, so this divides the wait by up to ``processes`` on as many cores. A
    process that fails leaves its kernels to the step here."""
    from .runtime import Session
    if processes > 1:
        helpers = [subprocess.Popen(
            [sys.executable] + (["-P"] if sys.flags.safe_path else []) +
            ["-m", "thomas_tune.demo", "warm", export_dir, str(seed), str(int(evaluate))],
            env={**os.environ, "THOMAS_TUNE_OPENCL_WARM": f"{i}/{processes}"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(processes)]
        for h in helpers:
            h.wait()
    rng = np.random.default_rng(seed)
    with Session(export_dir, seed=seed) as s:
        x = rng.standard_normal(s.model.input_shape(s.batch)).astype("float32")
        y = rng.integers(0, s.model.num_classes, s.batch)
        s.train_step(x, y)
        if evaluate:
            s.evaluate(x, y)
        s.sync()


def pretrained_path() -> str:
    """The shipped checkpoint of MobileNetV2 (w0.35, 64x64) pretrained on digits 0-4."""
    from . import models
    return os.path.join(os.path.dirname(models.__file__), "pretrained",
                        "mobilenet_v2-w0.35-r64-mnist0to4.npz")


def digits(source: str, keep: list[int], resolution: int, limit: int, seed: int = 0):
    """``source`` (a data set with classes named "0".."9") restricted to the digits ``keep``,
    relabelled 0..len(keep)-1, at most ``limit`` images (stratified), split 80/20 by
    :meth:`Dataset.split`. Returns (train, test). Raises ValueError when a digit is missing."""
    from .data import Dataset, load
    full = load(source, resolution)
    names = [str(d) for d in keep]
    missing = [n for n in names if n not in full.classes]
    if missing:
        raise ValueError(f"data set {source!r} has no class {missing}; the demo needs digits")
    ids = np.array([full.classes.index(n) for n in names])
    mask = np.isin(full.y, ids)
    y = np.searchsorted(ids, full.y[mask]) if np.all(np.diff(ids) > 0) else \
        np.array([list(ids).index(v) for v in full.y[mask]])
    rng = np.random.default_rng(seed)
    per = max(1, limit // len(keep))
    idx = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:per]
                          for c in range(len(keep))])
    data = Dataset(full.x[mask][idx], y[idx], names, f"{source} digits {names[0]}-{names[-1]}")
    return data.split(0.2, seed=seed)


@contextlib.contextmanager
def busy(desc: str, enabled: bool = True):
    """A progress line (tqdm, elapsed seconds) while the body runs a long call that reports no
    progress of its own (an OpenCL program build, a compile). The call must release the GIL
    now and then (TVM's calls do)."""
    if not enabled:
        yield
        return
    from tqdm import tqdm
    done = threading.Event()
    bar = tqdm(desc=desc, bar_format="{desc}: {elapsed}", leave=True)

    def tick():
        while not done.wait(0.5):
            bar.refresh()

    th = threading.Thread(target=tick, daemon=True)
    th.start()
    try:
        yield
    finally:
        done.set()
        th.join()
        bar.refresh()
        bar.close()


def first_batches(train, args) -> list:
    """The batches the demo runs through each build before fine-tuning (its timing):
    ``args.compare_steps`` (at least 1) batches of ``args.batch`` images of ``train`` (a
    :class:`thomas_tune.data.Dataset`), drawn with seed ``args.seed + 1``; a list of
    ``(x, y)``, x float32 ``(batch, 3, H, W)``, y int64 ``(batch,)``."""
    batches = train.batches(args.batch, np.random.default_rng(args.seed + 1))
    return [next(batches) for _ in range(max(1, args.compare_steps))]


def _session_step(session):
    """A step function for :func:`time_side_by_side`: one training step of ``session`` on a
    numpy batch, waited for."""
    def step(x, y):
        session.train_step(x, y)
        session.sync()
    return step


def pytorch_step(session, tensors: dict, optimizer, seed: int):
    """PyTorch's training step of the export that ``session`` runs (its model, trainable set,
    frozen BatchNorms; ``optimizer`` its
    :class:`thomas_tune.training_graph.optimizers.OptimizerConfig`), float32 eager on this machine
    (:func:`thomas_tune.benchmark.torch_baseline.torch_step`: the GPU where PyTorch sees one, else
    the CPU with PyTorch's own threads), from ``tensors``. Returns ``(step(x, y), name)``: a step
    function on numpy batches (waited for) and a name for the report line that says what ran
    (version, device, threads), or ``(None, why)`` where PyTorch is not installed, PyTorch being no
    requirement of the product."""
    from .benchmark.torch_baseline import torch_device, torch_step
    if torch_device() is None:
        return None, "PyTorch not installed here (pip install torch torchvision for its time)"
    m = session.manifest
    side = torch_step(session.model, tensors, m.trainable, optimizer, session.batch,
                      session.batch, seed, frozen_bn=set(m.frozen_bn))
    torch, dev = side["torch"], side["dev"]
    where = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
             else f"CPU, {torch.get_num_threads()} thread(s)")
    name = f"PyTorch {torch.__version__.split('+')[0]} eager ({where})"

    def step(x, y):
        side["step"](torch.from_numpy(x).to(dev), torch.from_numpy(y.astype("int64")).to(dev))
        if dev.type == "cuda":
            torch.cuda.synchronize()
    return step, name


def time_side_by_side(steps: dict, batches: list) -> dict[str, float]:
    """ms per training step of each of ``steps`` (name -> ``step(x, y)`` on numpy batches,
    returning when the step is done), median over ``batches`` (:func:`first_batches`), after
    one untimed step each on the first batch (kernels compiled, caches warm). The steps
    alternate batch by batch, their order rotated every batch, so that a change in the
    machine's load or clock during the timing reaches all alike."""
    names = list(steps)
    for name in names:
        steps[name](*batches[0])
    times: dict[str, list[float]] = {name: [] for name in names}
    for i, (x, y) in enumerate(batches):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            steps[name](x, y)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: float(np.median(t)) for name, t in times.items()}


def fine_tune_from(session, tensors: dict, train, test, args, show_progress: bool):
    """The demo's fine-tuning: ``session`` (a :class:`thomas_tune.runtime.Session`) back to
    ``tensors`` (the pretrained weights with the new head) and a fresh optimizer state, then
    ``args.steps`` training steps with seed ``args.seed`` (:func:`thomas_tune.train.
    fine_tune`, whose result it returns: held-out accuracy before and after, losses, ms per
    step)."""
    from .train import fine_tune
    session.load_tensors(tensors)
    return fine_tune(session, train, test, args.steps, seed=args.seed,
                     show_progress=show_progress)


def _tune(args, tune_fn, common: list[str], log_dir: str, shipped: str | None,
          started: bool) -> int:
    """The demo's tuning (step 2 of :func:`run`): a loopback tracker and one device server;
    when ``started`` (the log ``shipped`` was copied to ``log_dir``), its costliest tasks timed
    again (``remeasure``), then the demo's own trials. Returns ``tune``'s exit status."""
    from . import rpc
    t0 = time.perf_counter()
    with rpc.loopback(key=args.key, servers=1, lifetime=3600) as (host, port):
        print(f"[demo] tracker on {host}:{port}, one device server with key {args.key!r}",
              flush=True)
        server = ["--tracker", f"{host}:{port}", "--key", args.key, "--log", log_dir]
        if started:
            from .logs import TuningLog
            version = TuningLog(log_dir).version()
            if version.status == "current":
                which = ["--top", str(args.remeasure_top)]
                print(f"[demo] starting from the shipped tuning log {shipped}: the best records "
                      f"of its {args.remeasure_top} costliest tasks and their default "
                      "schedules timed again on this device", flush=True)
            else:  # times of another code generation: every task's best record again
                which = ["--restamp"]
                print(f"[demo] starting from the shipped tuning log {shipped}, measured with "
                      f"{version.line()}: the best record of each task and their default "
                      "schedules timed again on this device, the others set aside", flush=True)
            if tune_fn(["remeasure", *common, *server, "--top-k", "1", "--defaults", "logged",
                        *which]):
                print("[demo] a record could not be timed again (above): it keeps its shipped "
                      "time, or is set aside where the log was restamped", flush=True)
        per_task = max(1, -(-args.trials // max(1, args.top)))  # one batch per task
        rc = tune_fn(["tune", *common, *server, "--trials", str(args.trials), "--top",
                      str(args.top), "--trials-per-iter", str(per_task), "--population", "32",
                      "--max-unroll", str(args.max_unroll), "--refine-top", "0", "--brief"])
        if rc:
            return rc
    print(f"[demo] tuning done in {time.perf_counter() - t0:.0f} s; servers stopped",
          flush=True)
    return 0


def run(args, tune_fn) -> int:
    """The demo (see the module docstring). ``args``: the demo's options; ``tune_fn(argv)``
    runs ``thomas-tune`` with ``argv`` and returns its exit status (the CLI's ``main``).
    Raises FileNotFoundError without the pretrained checkpoint, RuntimeError when the untuned
    build fails."""
    from .training_graph.graph import OptimizerConfig
    from .target import parse_target

    t_start = time.perf_counter()
    work = args.work
    log_dir = args.log or os.path.join(work, "tuning_log")
    ckpt, model, tensors, train, test = _pretrained(args)
    target = parse_target(args.target)
    opt = OptimizerConfig(lr=args.lr)
    dirs = {name: os.path.join(work, f"export-{name}") for name in ("tuned", "untuned")}
    rc = _make_builds(args, tune_fn, ckpt, model, tensors, train, target, opt, dirs, log_dir)
    if rc:
        return rc
    tuned, ms = _steps_side_by_side(args, dirs, train, tensors, opt)
    _fine_tune(args, tuned, tensors, train, test, ms)
    print(f"[demo] finished in {time.perf_counter() - t_start:.0f} s; files in {work}")
    return 0


def _pretrained(args):
    """The pretrained model (``--checkpoint``, or the shipped one) with a new head for
    :data:`FINE_TUNE_DIGITS`, and the fine-tuning data (training and held-out images).
    Returns (checkpoint path, model, tensors, train, test); raises FileNotFoundError without
    the checkpoint."""
    from .models import load_checkpoint, replace_head
    ckpt = args.checkpoint or pretrained_path()
    if not os.path.exists(ckpt):
        raise FileNotFoundError(f"pretrained checkpoint {ckpt} is missing (install the project "
                                "from its source tree: pip install -e .)")
    model, tensors, classes = load_checkpoint(ckpt)
    print(f"[demo] pretrained {model.arch} (width {model.width:g}, {model.resolution}x"
          f"{model.resolution}) on digits {', '.join(classes or [])}; fine-tuning on the unseen "
          f"digits {FINE_TUNE_DIGITS[0]}-{FINE_TUNE_DIGITS[-1]} with a new "
          f"{len(FINE_TUNE_DIGITS)}-class head", flush=True)
    model, tensors = replace_head(model, tensors, len(FINE_TUNE_DIGITS), seed=args.seed)
    train, test = digits(args.data, FINE_TUNE_DIGITS, model.resolution, args.limit, args.seed)
    print(f"[demo] data: {len(train.y)} training / {len(test.y)} held-out images of "
          f"{train.source}", flush=True)
    return ckpt, model, tensors, train, test


def _make_builds(args, tune_fn, ckpt: str, model, tensors: dict, train, target, opt,
                 dirs: dict, log_dir: str) -> int:
    """Steps 1-3 of the demo: the untuned build (default schedules) compiled by a child
    process (which also builds its device programs, into the caches this process then loads
    them from) while this one tunes the training step's kernels into ``log_dir``, starting
    from the shipped tuning log, and compiles the tuned build. Returns the tuning's exit
    status (0: both builds are in ``dirs``); raises RuntimeError when the child fails."""
    from .compiler.export import export
    from .logs import TuningLog
    from .models import save_checkpoint
    init = os.path.join(args.work, "init.npz")
    save_checkpoint(init, model, tensors, train.classes)
    child_log = os.path.join(args.work, "untuned-build.log")
    with open(child_log, "w") as out:
        child = subprocess.Popen(
            [sys.executable] + (["-P"] if sys.flags.safe_path else []) +
            ["-m", "thomas_tune.demo", init, dirs["untuned"], str(args.batch), args.trainable,
             str(args.lr), args.target], stdout=out, stderr=subprocess.STDOUT)
    # the shipped log's best records and their default schedules are timed again here, then
    # the demo's own trials run on the largest kernels
    common = ["--checkpoint", ckpt, "--batch", str(args.batch), "--trainable", args.trainable,
              "--target", args.target]
    # the shipped log holds OpenCL schedules: on another target it has nothing to offer
    shipped = (shipped_log_path() if target.kind.name == "opencl" and not args.no_shipped_log
               else None)
    started = shipped is not None and start_from(shipped, log_dir)
    try:
        rc = _tune(args, tune_fn, common, log_dir, shipped, started)
        if rc:
            return rc
        # the tuned build, here, while the child may still be building the untuned one
        with busy("[demo] compiling the tuned build"):
            export(dirs["tuned"], model, tensors, target, batch=args.batch,
                   trainable=args.trainable, optimizer=opt, log=TuningLog(log_dir),
                   classes=train.classes, progress=lambda m: None)
        with busy("[demo] waiting for the untuned build"):
            child.wait()
    finally:
        if child.poll() is None:  # this process failed or returned early: no orphan build
            child.kill()
            child.wait()
    if child.returncode != 0:
        with open(child_log) as f:
            raise RuntimeError(f"compiling the untuned build failed ({child_log}):\n"
                               f"{f.read()[-3000:]}")
    return 0


def _steps_side_by_side(args, dirs: dict, train, tensors: dict, opt):
    """Step 4 of the demo: the same first batches through both builds (and PyTorch's step,
    where torch is installed), side by side: they alternate step by step (the order swapped
    every batch), so that a change in the machine's load or clock during the timing reaches
    all alike. Returns the tuned build's session and the ms per step (each one's median)."""
    from .runtime import Session
    check_builds(dirs, args.seed)
    timing = first_batches(train, args)
    with busy("[demo] building the tuned device programs"):
        build_device_programs(dirs["tuned"], args.seed, processes=os.cpu_count() or 1)
    sessions = {name: Session(dirs[name], seed=args.seed) for name in ("untuned", "tuned")}
    steps = {name: _session_step(s) for name, s in sessions.items()}
    torch_step, torch_name = pytorch_step(sessions["tuned"], tensors, opt, args.seed)
    if torch_step is not None:
        steps[torch_name] = torch_step
    ms = time_side_by_side(steps, timing)
    del sessions["untuned"], steps  # frees the untuned build's device memory
    print(f"[demo] ms per training step over the same {len(timing)} batches (median): tuned "
          f"{ms['tuned']:.1f}, untuned {ms['untuned']:.1f} ({ms['untuned'] / ms['tuned']:.2f}x), "
          + (f"{torch_name} {ms[torch_name]:.1f}" if torch_step is not None else torch_name),
          flush=True)
    return sessions["tuned"], ms


def _fine_tune(args, s, tensors: dict, train, test, ms: dict) -> None:
    """Step 5 of the demo: fine-tune from the pretrained weights with the tuned build's
    session ``s``; print the held-out accuracy before and after, the mean training loss of
    the first and last steps and ms per step; save the checkpoint with ``--save``."""
    print(f"[demo] fine-tuning {args.steps} steps of batch {args.batch} (trainable "
          f"{args.trainable}) with the tuned build", flush=True)
    evaluate = s.evaluate

    def evaluate_with_progress(x, y):
        with busy(f"[demo] held-out accuracy on {len(y)} images"):
            return evaluate(x, y)

    s.evaluate = evaluate_with_progress
    r = fine_tune_from(s, tensors, train, test, args, show_progress=True)
    k = max(1, min(args.loss_window, len(r.losses) // 2))
    first, last = float(np.mean(r.losses[:k])), float(np.mean(r.losses[-k:]))
    print(f"[demo] held-out accuracy on digits {FINE_TUNE_DIGITS[0]}-{FINE_TUNE_DIGITS[-1]}: "
          f"{100 * r.acc_before:.1f}% before -> {100 * r.acc_after:.1f}% after")
    print(f"[demo] mean training loss: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    print(f"[demo] tuned {r.ms_per_step:.1f} ms per step while fine-tuning (median of "
          f"{r.steps}); untuned {ms['untuned']:.1f} ms on the same device in this run")
    if args.save:
        s.save(args.save)
        print(f"[demo] saved the fine-tuned checkpoint to {args.save}")


def export_untuned(init: str, out: str, batch: int, trainable: str, lr: float,
                   target: str) -> None:
    """The demo's child process: the checkpoint ``init`` exported to ``out`` with default
    schedules (no tuning log) for ``target`` (a :func:`thomas_tune.target.parse_target`
    string), then its device programs built (:func:`build_device_programs`)."""
    from .compiler.export import export
    from .training_graph.graph import OptimizerConfig
    from .models import load_checkpoint
    from .target import parse_target
    model, tensors, classes = load_checkpoint(init)
    export(out, model, tensors, parse_target(target), batch=batch, trainable=trainable,
           optimizer=OptimizerConfig(lr=lr), classes=classes)
    build_device_programs(out, evaluate=False)


def check_builds(dirs: dict, seed: int) -> None:
    """Both builds' training steps checked against PyTorch float64 before they are timed
    (:func:`thomas_tune.benchmark.checks.check_variants`: one line each). Raises RuntimeError
    for a wrong build; without PyTorch says that the numbers are not checked."""
    from .benchmark.checks import check_variants
    checks = check_variants({"default": dirs["untuned"], "tuned": dirs["tuned"]}, seed,
                            say=lambda m: print(m.replace("[bench]", "[demo]"), flush=True))
    wrong = [v for v in ("default", "tuned") if v in checks and not checks[v].ok]
    if wrong:
        raise RuntimeError(f"the {' and '.join(wrong)} build computes wrong numbers (above): "
                           "not timed")


if __name__ == "__main__":
    # python -m thomas_tune.demo INIT OUT BATCH TRAINABLE LR TARGET: see export_untuned;
    # python -m thomas_tune.demo warm EXPORT SEED EVALUATE(0/1): a warm-up share of
    # build_device_programs
    a = sys.argv[1:]
    if a[0] == "warm":
        build_device_programs(a[1], int(a[2]), evaluate=bool(int(a[3])))
    else:
        export_untuned(a[0], a[1], int(a[2]), a[3], float(a[4]), a[5])
