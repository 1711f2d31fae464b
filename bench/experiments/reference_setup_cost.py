"""One candidate-check reference set-up per task, inputs drawn on the host against on the device.

Over a loopback tracker and one device server of this machine's OpenCL device (the runner's own
lane functions, one RPC session), per task of the training step (the largest first): the
reference library loaded (uploaded, the driver's build of its programs), then, side by side and
``--repeat`` times, the set-up with the inputs drawn on the host and uploaded, the reference's
outputs copied back (``kernel_reference.reference_outputs``, as the runner did) and with the inputs
drawn on the device and the outputs kept there (``kernel_reference.device_reference``). The first
repeat includes the device's first launch of each kernel. Prints one JSON line per task (MB of
the task's arguments, seconds) and the totals; both set-ups give the same reference outputs.

    python3 bench/experiments/reference_setup_cost.py [--model mobilenet_v2] [--width 0.35]
        [--resolution 64] [--classes 10] [--batch 8] [--top 6] [--repeat 2] [--target JSON]
"""

from __future__ import annotations

import json
import math
import os
import sys
import time


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from check_cost import largest_tasks, task_args

    p = task_args(__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()

    import numpy as np
    import tvm

    from thomas_tune import kernel_check as kc
    from thomas_tune import kernel_reference as kr
    from thomas_tune import rpc
    from thomas_tune.measure import lane as R
    from thomas_tune.measure.builder import Builder
    target, tasks = largest_tasks(args)
    builder = Builder(max_workers=2, timeout_s=300)
    try:
        refs, _ = kr.build_references([t.mod for t in tasks], target, builder)
    finally:
        builder.shutdown()
    total = {"load_s": 0.0, "host_s": [0.0] * args.repeat, "device_s": [0.0] * args.repeat}
    clock = time.perf_counter
    with rpc.loopback(key="setup-cost", servers=1, lifetime=1800) as addr:
        R.lane_open(addr[0], addr[1], "setup-cost", 1800, 1)
        dev = R._LANE["session"].device("opencl", 0)
        for task, ref in zip(tasks, refs):
            func, spec = tvm.ir.load_json(ref.workload_json), ref.spec
            t0 = clock()
            lib = R.lane_load(ref.artifact, f"ref-{ref.key}.so", dev)
            row = {"task": task.name[:40], "load_s": round(clock() - t0, 3),
                   "MB": round(sum(math.prod(s) * np.dtype(d).itemsize
                                   for s, d in kc.arg_shapes(func)) / 1e6, 1)}
            total["load_s"] += row["load_s"]
            for r in range(args.repeat):
                t0 = clock()
                up, expected = kr.reference_outputs(lib["main"], dev, func, ref.seed, spec)
                kr.DeviceComparison(kr.library_function(lib, kc.COMPARE), up, dev)
                dev.sync()
                t1 = clock()
                _, comparison, _ = kr.device_reference(lib, dev, func, ref.seed, spec)
                dev.sync()
                t2 = clock()
                total["host_s"][r] += t1 - t0
                total["device_s"][r] += t2 - t1
                row[f"host_s{r}"], row[f"device_s{r}"] = round(t1 - t0, 3), round(t2 - t1, 3)
            row["same_outputs"] = comparison is not None and all(
                np.array_equal(comparison.expected[k].numpy(), expected[i], equal_nan=True)
                for k, i in enumerate(spec.written))
            print(json.dumps(row), flush=True)
        R.lane_close()
    print(json.dumps({k: [round(x, 2) for x in v] if isinstance(v, list) else round(v, 2)
                      for k, v in total.items()}))


if __name__ == "__main__":
    main()
