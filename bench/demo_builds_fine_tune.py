"""Fine-tune the exports of one `thomas-tune demo` run (its tuned and its untuned build) from the
same pretrained weights, seeds and batches, as the demo does, and print the held-out accuracy
and the last 20 steps' mean loss of each: whether the two builds end in the same place. Uses
the demo's defaults (mnist5k, 2,000 images, batch 8, 150 steps, 10 timing steps, seed 0).

    python3 bench/demo_builds_fine_tune.py /tmp/thomas-tune-demo-XXXX untuned tuned
"""
import sys, numpy as np
from thomas_tune.demo import digits, FINE_TUNE_DIGITS, pretrained_path
from thomas_tune.models import load_checkpoint, replace_head
from thomas_tune.runtime import Session
from thomas_tune.train import fine_tune
work = sys.argv[1]  # the demo's --work folder (its last line names it)
model, tensors, classes = load_checkpoint(pretrained_path())
model, tensors = replace_head(model, tensors, len(FINE_TUNE_DIGITS), seed=0)
train, test = digits("mnist5k", FINE_TUNE_DIGITS, model.resolution, 2000, 0)
for name in sys.argv[2:]:
    s = Session(f"{work}/export-{name}", seed=0)
    batches = train.batches(8, np.random.default_rng(1))
    timing = [next(batches) for _ in range(10)]
    for x, y in [timing[0]] + timing:
        s.train_step(x, y)
    s.sync()
    s.load_tensors(tensors)
    r = fine_tune(s, train, test, 150, seed=0, show_progress=False)
    print(name, f"acc {100*r.acc_before:.1f} -> {100*r.acc_after:.1f}", f"loss last20 {np.mean(r.losses[-20:]):.3f}", flush=True)
