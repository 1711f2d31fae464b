"""Where a training step's kernel time goes, by a tuning log: each kernel's best record.

    python bench/experiments/step_kernel_times.py --model mobilenet_v2 --width 1.0 \
        --resolution 224 \
        --classes 1000 --batch 32 --trainable all \
        --log tuning_logs/h100/mobilenet_v2-w1-r224-c1000-b32 [--top 30]

For each kernel of the step that the export builds (``benchmark.kernels.step_kernels`` of
``library_module.training_library_module``), the mean run time of its best valid record in ``--log``
(ms; the times of the device the log was measured on), times its calls per step; kernels with
no record are counted and left out. Prints the sum, the share of each kernel family (the name
without its numeric suffix), and the ``--top`` kernels with their bytes of arguments per call
and the bandwidth that implies (a lower bound of the traffic, so of the bandwidth).
"""

import argparse
import collections
import json
import math

from thomas_tune.training_graph import graph as G
from thomas_tune.benchmark.kernels import exported_training_module, step_kernels
from thomas_tune.cli.options import add_model_args, load_model, optimizer_config
from thomas_tune.logs import TuningLog


def best_ms(log_path: str) -> dict[str, float]:
    """Workload key -> mean run time of its best valid record, ms."""
    log = TuningLog(log_path)  # a packed log is read from its unpacked copy
    keys = [str(int(json.loads(line)[0])) for line in open(log.workload_path)]
    out: dict[str, float] = {}
    for line in open(log.record_path):
        idx, body = json.loads(line)
        secs = [float(s) for s in body[1]]
        ms = sum(secs) / len(secs) * 1e3 if secs else math.inf
        if ms < 1e9:
            out[keys[idx]] = min(out.get(keys[idx], math.inf), ms)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--log", required=True)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    model, _, _ = load_model(args)
    tg = G.training_module(model, args.batch, args.trainable, optimizer_config(args))
    kernels = step_kernels(exported_training_module(tg))
    best = best_ms(args.log)
    timed = [(k, best[k.key]) for k in kernels if k.key in best]
    total = sum(k.calls * ms for k, ms in timed)
    print(f"{total:.2f} ms per step in the {len(timed)} of {len(kernels)} kernels with a record")
    families = collections.Counter()
    for k, ms in timed:
        families[k.name.rstrip("0123456789_")] += k.calls * ms
    for name, ms in families.most_common():
        print(f"  {name:40s} {ms:8.3f} ms  {100 * ms / total:5.1f}%")
    print()
    for k, ms in sorted(timed, key=lambda t: -t[0].calls * t[1])[:args.top]:
        print(f"  {k.name:40s} {k.calls} x {ms:.4f} ms = {k.calls * ms:7.3f} ms  "
              f"{k.bytes / 1e6:8.1f} MB/call  {k.bytes / 1e6 / ms:8.1f} GB/s")


if __name__ == "__main__":
    main()
