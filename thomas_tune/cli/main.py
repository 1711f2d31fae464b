"""The command line's entry: the parser of every verb, :func:`main`, and the ``demo`` verb
(which runs the others through :func:`main`)."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile

from . import bench, device, export, log, model, remeasure, run, tune
from .stop import STOP, terminate

#: the command's description in ``thomas-tune --help``
DESCRIPTION = """The ``thomas-tune`` command: tasks, rpc, tune, export, replay, train, infer, bench,
demo, log.

Running an export (``train --export DIR``, ``infer``, ``bench --tracker/--key``) needs no
compiler: with ``TVM_USE_RUNTIME_LIB=1`` in the environment, TVM loads only its runtime
library and the command's imports take about half the time (``TVM_USE_RUNTIME_LIB=1
thomas-tune train --export DIR ...``). The verbs that compile refuse to run so (exit status 2,
saying why).
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="thomas-tune", description=DESCRIPTION)
    sub = p.add_subparsers(dest="verb", required=True)
    tune.add_tasks(sub)
    device.add_rpc(sub)
    tune.add_tune(sub)
    remeasure.add_remeasure(sub)
    export.add_export(sub)
    export.add_replay(sub)
    run.add_train_infer(sub)
    model.add_import_onnx(sub)
    model.add_memory(sub)
    bench.add_bench(sub)
    add_demo(sub)
    log.add_parser(sub)
    return p


RUNTIME_ONLY_ENV = "TVM_USE_RUNTIME_LIB"


def _runs_without_compiler(args) -> bool:
    """True for the verbs that only run an export: ``infer``, ``train --export``, ``bench
    --tracker/--key`` (a process with TVM's runtime library alone runs them)."""
    return (args.fn is run.cmd_infer or (args.fn is run.cmd_train and bool(args.export))
            or (args.fn is bench.cmd_bench and bool(args.tracker or args.key)))


def main(argv=None) -> int:
    """Entry point; returns the exit status (2 for bad input, with the reason on stderr; also
    for a verb that compiles in a process without TVM's compiler, ``TVM_USE_RUNTIME_LIB=1``)."""
    signal.signal(signal.SIGTERM, terminate)  # so that loopback servers are stopped
    signal.signal(signal.SIGINT, terminate)
    args = parser().parse_args(argv)
    from .. import compiler_available
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
        sig = STOP.get("signal", signal.SIGINT)
        print(f"stopped by {signal.Signals(sig).name}", file=sys.stderr)
        return 128 + sig


def cmd_demo(args) -> int:
    """The product's story on loopback: tune the training step of the shipped pretrained
    network (digits 0-4), fine-tune it on the unseen digits 5-9, report tuned, untuned and
    PyTorch ms per step from the same run (see :mod:`thomas_tune.demo`)."""
    from .. import demo, opencl
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


def add_demo(sub) -> None:
    s = sub.add_parser("demo", help="tune a pretrained MobileNetV2 (digits 0-4) on loopback and "
                       "fine-tune it on the unseen digits 5-9; tuned, untuned and PyTorch ms "
                       "per step")
    s.add_argument("--checkpoint", help="pretrained checkpoint (default: the shipped "
                   "models/pretrained/mobilenet_v2-w0.35-r64-mnist0to4.npz)")
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--trainable", default="all")
    s.add_argument("--lr", type=float, default=0.005,
                   help="learning rate of momentum SGD (default 0.005; with --steps, chosen so "
                   "that rounding does not decide the accuracy: docs/benchmarks.md)")
    s.add_argument("--target", default="opencl",
                   help="opencl (this machine's OpenCL device, PoCL on a CPU) or llvm")
    s.add_argument("--key", default="local-opencl")
    s.add_argument("--trials", type=int, default=12,
                   help="tuning trials (default 12: three per task of --top, each task's in one "
                   "batch, so that the search runs once per task)")
    s.add_argument("--top", type=int, default=4, help="tune the N largest tasks (default 4)")
    s.add_argument("--max-unroll", type=int, default=16,
                   help="largest unroll limit the demo's own trials choose (default 16, as in "
                   "the shipped log: kernels unrolled further have OpenCL C sources of up to a "
                   "megabyte, which make the tuned build slower to compile and to check)")
    s.add_argument("--steps", type=int, default=300, help="fine-tuning steps (default 300)")
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
    s.add_argument("--remeasure-top", type=int, default=6, help="tasks of the shipped log "
                   "whose best record and default schedule are timed again on this device: "
                   "those whose default schedule costs the most per step (default 6)")
    s.add_argument("--no-shipped-log", action="store_true", help="tune from the default "
                   "schedules only, not from the tuning log shipped for PoCL on x86-64")
    s.add_argument("--work", help="folder for the log and the exports (default: a temp folder)")
    s.set_defaults(fn=cmd_demo)
