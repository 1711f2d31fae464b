"""How well the pretrained cost model ranks records it was not trained on.

Features of the committed H100 logs' records are extracted once (``--per-workload`` records at
most per workload of each log, drawn at random; cached in ``--cache``), then:

* ``by-workload``: the workloads of all logs split into ``--folds`` folds by workload key (a
  workload of two logs falls in one fold); each fold ranked by a model trained on the others;
* ``mnv2->mnv1``: trained on the MobileNetV2 1.0@224 log, ranking the MobileNetV1 log;
* ``others->mnv1``: trained on every log but MobileNetV1's, ranking it;
* ``--fewer N``: the same with at most N of the cached records per workload, to see what more
  training data buys;
* ``online``: per MobileNetV1 workload, its first ``k`` records (log order) stand for a session's
  measurements: a model trained on those alone (MetaSchedule from scratch) and the
  ``others->mnv1`` model boosted further on them (:func:`thomas_tune.tuning.pretrained.fit` with
  ``prior``), both ranking the workload's remaining records.

Ranking quality: Spearman's rank correlation of predicted score against measured throughput
within each workload (at least 8 records), averaged over workloads; ``untrained``: uniform random
scores, as MetaSchedule's model gives before its first 100 samples. Prints JSON. Example
(docs/journal/cost-model.md):

    python bench/experiments/cost_model_ranking.py --per-workload 64 --cache /tmp/cm_features.pkl
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time

import numpy as np

LOGS = {"alexnet": "tuning_logs/h100/alexnet-w1-r224-c1000-b32",
        "mnv1": "tuning_logs/h100/mobilenet_v1-w1-r224-c1000-b32",
        "mnv2_small": "tuning_logs/h100/mobilenet_v2-w0.35-r64-c10-b8",
        "mnv2": "tuning_logs/h100/mobilenet_v2-w1-r224-c1000-b32"}


def _merge(parts):
    from thomas_tune.tuning.pretrained import RecordFeatures
    out = RecordFeatures()
    for p in parts:
        out.features += p.features
        out.seconds += p.seconds
        out.workloads += p.workloads
        out.logs += p.logs
        out.best.update(p.best)
    return out


def main(argv=None) -> int:
    from thomas_tune.tuning import pretrained as pt
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-workload", type=int, default=64)
    ap.add_argument("--cache", default="/tmp/cm_features.pkl")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--online", default="8,16")
    ap.add_argument("--fewer", type=int, help="keep at most this many of the cached records "
                    "per workload (drawn at random): the figures with less training data")
    args = ap.parse_args(argv)
    parts, timing = {}, {}
    if os.path.exists(args.cache):
        with open(args.cache, "rb") as f:
            parts, timing = pickle.load(f)
    for name, path in LOGS.items():
        if name not in parts:
            t0 = time.perf_counter()
            parts[name] = pt.record_features([path], args.per_workload, 0, args.threads)
            timing[name] = time.perf_counter() - t0
            print(f"{name}: {len(parts[name].seconds)} records in {timing[name]:.0f} s",
                  file=sys.stderr, flush=True)
            with open(args.cache, "wb") as f:
                pickle.dump((parts, timing), f)
    if args.fewer:
        rng = np.random.default_rng(1)
        for name, p in parts.items():
            by = {}
            for i, w in enumerate(p.workloads):
                by.setdefault(w, []).append(i)
            keep = {int(i) for idx in by.values()
                    for i in (rng.choice(idx, args.fewer, replace=False)
                              if len(idx) > args.fewer else idx)}
            parts[name] = p.subset(lambda i, keep=keep: i in keep)
    out = {"per_workload": args.fewer or args.per_workload,
           "features": {n: {"records": len(p.seconds), "seconds": round(timing.get(n, 0), 1)}
                        for n, p in parts.items()}}
    everything = _merge(parts.values())

    def score(booster, data):
        r = pt.rank_correlation(booster, data)
        return {"mean": round(r["mean"], 3), "workloads": r["workloads"], "records": r["records"]}

    # by workload: folds of workload keys
    keys = sorted(set(everything.workloads))
    rng = np.random.default_rng(0)
    fold = dict(zip(keys, rng.permutation(len(keys)) % args.folds))
    rhos, rand, train_s = [], [], []
    for k in range(args.folds):
        train = everything.subset(lambda i: fold[everything.workloads[i]] != k)
        test = everything.subset(lambda i: fold[everything.workloads[i]] == k)
        t0 = time.perf_counter()
        b = pt.train(train, threads=args.threads)
        train_s.append(time.perf_counter() - t0)
        r = pt.rank_correlation(b, test)
        rhos += list(r["per_workload"].values())
        rand += list(pt.rank_correlation(None, test)["per_workload"].values())
    out["by-workload"] = {"trained": round(float(np.mean(rhos)), 3),
                          "untrained": round(float(np.mean(rand)), 3), "workloads": len(rhos),
                          "train_s_per_fold": round(float(np.mean(train_s)), 1)}
    for name, sources in (("mnv2->mnv1", ["mnv2"]), ("others->mnv1",
                                                     ["alexnet", "mnv2", "mnv2_small"])):
        train = _merge(parts[s] for s in sources)
        t0 = time.perf_counter()
        b = pt.train(train, threads=args.threads)
        shared = len(set(train.workloads) & set(parts["mnv1"].workloads))
        out[name] = {"trained": score(b, parts["mnv1"]),
                     "untrained": score(None, parts["mnv1"]),
                     "train_records": len(train.seconds),
                     "train_s": round(time.perf_counter() - t0, 1),
                     "mnv1_workloads_in_training": shared,
                     "mnv1_workloads": len(set(parts["mnv1"].workloads))}
        if name == "others->mnv1":
            prior = b
    # online: a session's first k records of each MobileNetV1 workload, then the rest ranked
    mnv1 = parts["mnv1"]
    online = {}
    for k in [int(x) for x in args.online.split(",")]:
        res = {"prior": [], "prior+session": [], "session only": [], "untrained": []}
        for w in sorted(set(mnv1.workloads)):
            idx = [i for i in range(len(mnv1.seconds)) if mnv1.workloads[i] == w]
            if len(idx) < k + 8:
                continue
            first, rest = idx[:k], idx[k:]
            best = min(mnv1.seconds[i] for i in first)
            xs = [mnv1.features[i] for i in first]
            ys = np.array([best / mnv1.seconds[i] for i in first], dtype="float32")
            test = mnv1.subset(lambda i: i in set(rest))
            res["prior"].append(pt.rank_correlation(prior, test)["mean"])
            res["prior+session"].append(pt.rank_correlation(
                pt.fit(xs, ys, threads=args.threads, prior=prior), test)["mean"])
            res["session only"].append(pt.rank_correlation(
                pt.fit(xs, ys, threads=args.threads), test)["mean"])
            res["untrained"].append(pt.rank_correlation(None, test)["mean"])
        online[str(k)] = {n: round(float(np.nanmean(v)), 3) if v else None
                          for n, v in res.items()}
        online[str(k)]["workloads"] = len(res["prior"])
    out["online"] = online
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
