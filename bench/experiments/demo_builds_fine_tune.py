"""Fine-tune the exports of one `thomas-tune demo` run (its tuned and its untuned build) from the
same pretrained weights, seeds and batches, as the demo does (the demo's own steps and its
default options, from the CLI's parser), and print the held-out accuracy and the last 20
steps' mean loss of each: whether the two builds end in the same place.

    python3 bench/experiments/demo_builds_fine_tune.py /tmp/thomas-tune-demo-XXXX untuned tuned
"""
import sys

import numpy as np

from thomas_tune.cli import parser
from thomas_tune.demo import FINE_TUNE_DIGITS, digits, fine_tune_from, first_batches
from thomas_tune.demo import pretrained_path
from thomas_tune.models import load_checkpoint, replace_head
from thomas_tune.runtime import Session

work = sys.argv[1]  # the demo's --work folder (its last line names it)
args = parser().parse_args(["demo"])  # the demo's defaults
model, tensors, classes = load_checkpoint(pretrained_path())
model, tensors = replace_head(model, tensors, len(FINE_TUNE_DIGITS), seed=args.seed)
train, test = digits(args.data, FINE_TUNE_DIGITS, model.resolution, args.limit, args.seed)
for name in sys.argv[2:]:
    s = Session(f"{work}/export-{name}", seed=args.seed)
    timing = first_batches(train, args)
    for x, y in [timing[0]] + timing:  # as the demo: a first step, then the timed steps
        s.train_step(x, y)
    s.sync()
    r = fine_tune_from(s, tensors, train, test, args, show_progress=False)
    print(name, f"acc {100 * r.acc_before:.1f} -> {100 * r.acc_after:.1f}",
          f"loss last20 {np.mean(r.losses[-20:]):.3f}", flush=True)
