import json
import sys

from thomas_tune.models import build, init_params
from thomas_tune.training_graph.graph import training_module
from thomas_tune.benchmark import time_torch
out = {}
for arch, tr in (("mobilenet_v2", "all"), ("mobilenet_v2", "last:2"), ("alexnet", "all"),
                 ("alexnet", "last:3")):
    m = build(arch, num_classes=1000, resolution=224, width=1.0)
    t = init_params(m, seed=0)
    tg = training_module(m, 32, tr)
    for tv in (True, False):
        r = time_torch(m, t, tg.trainable, tg.optimizer, 32, 1, 10, 2, 0, use_torchvision=tv)
        out[f"{arch} {tr} {r['implementation']}"] = r
        print(arch, tr, r["implementation"], round(r["train_ms"], 2),
              r["train_ms_by_cudnn_benchmark"], round(r["infer_ms"], 3), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
