"""Per workload of tuning logs, the trials (its records in log order) to 95% of its final best
speed, as ``tune --stats`` counts them per task (:func:`thomas_tune.tuning.report.trials_to_95`);
prints per log the workloads, their records and the median and 90th percentile of that count.
Example (docs/journal/cost-model.md):

    python bench/experiments/log_convergence.py tuning_logs/h100/alexnet-w1-r224-c1000-b32 \\
        tuning_logs/h100/mobilenet_v2-w1-r224-c1000-b32
"""

from __future__ import annotations

import sys

import numpy as np


def main(argv=None) -> int:
    from thomas_tune.logs import TuningLog
    from thomas_tune.tuning.report import trials_to_95
    for path in (argv if argv is not None else sys.argv[1:]):
        db = TuningLog(path).database(check=False)
        counts, records = [], []
        for wl in db.workloads:
            times = db.times_in_order(wl.mod)
            n, _ = trials_to_95(times)
            if n is not None and len(times) >= 32:
                counts.append(n)
                records.append(len(times))
        c = np.array(counts)
        print(f"{path}: {len(c)} workloads with 32 records or more ({sum(records)} records); "
              f"trials to 95% of the final best: median {np.median(c):.0f}, 90th percentile "
              f"{np.percentile(c, 90):.0f}; share of the workload's records: median "
              f"{np.median(c / np.array(records)):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
