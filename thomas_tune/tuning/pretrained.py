"""A cost model that starts trained: MetaSchedule's XGBoost model fitted to tuning logs' records,
saved, loaded by a tuning session and updated online.

The model is MetaSchedule's (``XGBModel``: ``PerStoreFeature`` features, one row per buffer store
of a schedule, summed over a candidate's rows; labels are each workload's best time over the
record's time, "pack-sum" squared error; Chen et al. 2018, "Learning to Optimize Tensor
Programs", and Zheng et al. 2020, "Ansor"). A record's features come from its schedule, rebuilt
from its workload and trace. :func:`train` fits a booster to them; :func:`save` writes the
booster alone (no feature data: a few MB at most) with what it was trained on; a session
(:func:`session_model`) predicts with it from its first batch, and each update MetaSchedule makes
(on the session's own measurements, when they have grown by a fifth) adds trees fitted to the
session's data on top of the saved booster, as continued boosting, instead of training from
scratch. The session's labels are normalized by its own best times, so records of another
device never mix with this device's times.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm.s_tir import meta_schedule as ms

#: the folder a trained cost model is saved in, beside the tuning logs it was trained on
#: (``tuning_logs/<device>/cost_model``)
COST_MODEL_DIR = "cost_model"
BOOSTER = "booster.ubj"
META = "cost_model.json"
#: MetaSchedule's XGBModel settings (``XGBConfig``'s defaults) and its early stopping: 50
#: boosting rounds without a better training p-rmse
EARLY_STOPPING_ROUNDS = 50


@dataclass
class RecordFeatures:
    """Features of tuning records: per record its ``PerStoreFeature`` rows (float32, shape
    ``(stores, 164)``), its mean run time ``seconds`` (s), its workload's key (structural
    hash, decimal) and the log folder it came from; ``best`` maps each (log folder, workload
    key) to the best time (s) of all the workload's records in that log (not only those
    kept)."""

    features: list = field(default_factory=list)
    seconds: list = field(default_factory=list)
    workloads: list = field(default_factory=list)
    logs: list = field(default_factory=list)
    best: dict = field(default_factory=dict)
    skipped: int = 0  # records whose trace no longer applies to its workload

    def labels(self) -> np.ndarray:
        """MetaSchedule's training labels: the workload's best time over the record's time
        (0..1, float32)."""
        return np.array([self.best[(g, w)] / s
                         for g, w, s in zip(self.logs, self.workloads, self.seconds)],
                        dtype="float32")

    def subset(self, keep) -> RecordFeatures:
        """The records at the indices for which ``keep(i)`` is true."""
        idx = [i for i in range(len(self.seconds)) if keep(i)]
        return RecordFeatures([self.features[i] for i in idx], [self.seconds[i] for i in idx],
                              [self.workloads[i] for i in idx], [self.logs[i] for i in idx],
                              dict(self.best), self.skipped)


def record_features(logs: list[str], max_per_workload: int | None = None, seed: int = 0,
                    threads: int = 1, progress=None) -> RecordFeatures:
    """The features of the valid records (a run time, not a failed trial) of the tuning-log
    folders ``logs``: each record's schedule rebuilt from its workload and trace
    (``Trace.apply_json_to_schedule``, as MetaSchedule's JSON database does) and passed to
    MetaSchedule's ``PerStoreFeature`` under the record's own target. ``max_per_workload``: at
    most that many records per workload of each log, drawn at random with ``seed`` (None: all;
    rebuilding and extracting take about 40 ms per record on one core). ``threads``: the
    feature extractor's threads. ``progress(done, total)`` is called per workload. Raises
    ValueError (from :func:`thomas_tune.logs.read_log`) for a folder that holds no tuning log.
    """
    from ..logs import mean_seconds, read_log
    rng = np.random.default_rng(seed)
    extractor = ms.feature_extractor.PerStoreFeature()
    out = RecordFeatures()
    for path in logs:
        contents = read_log(path)
        by_wl: dict[int, list] = {}
        for pos, body in contents.records:
            secs = mean_seconds(body)
            if math.isfinite(secs) and secs > 0:
                by_wl.setdefault(pos, []).append((body, secs))
        for n, (pos, rows) in enumerate(sorted(by_wl.items())):
            obj, key = contents.workloads[pos]
            out.best[(path, str(key))] = min(s for _, s in rows)
            if max_per_workload is not None and len(rows) > max_per_workload:
                rows = [rows[i] for i in sorted(rng.choice(len(rows), max_per_workload,
                                                           replace=False))]
            workload = ms.database.Workload.from_json(obj)
            target = tvm.target.Target(rows[0][0][2])
            ctx = ms.TuneContext(mod=workload.mod, target=target, num_threads=threads)
            cands, kept = [], []
            for body, secs in rows:
                sch = tvm.s_tir.Schedule(workload.mod)
                try:
                    tvm.s_tir.schedule.Trace.apply_json_to_schedule(body[0], sch)
                except Exception:  # a trace of another TVM or rule set: left out, counted
                    out.skipped += 1
                    continue
                cands.append(ms.MeasureCandidate(sch, []))
                kept.append(secs)
            if cands:
                for f, secs in zip(extractor.extract_from(ctx, cands), kept):
                    out.features.append(f.numpy().astype("float32"))
                    out.seconds.append(secs)
                    out.workloads.append(str(key))
                    out.logs.append(path)
            if progress is not None:
                progress(n + 1, len(by_wl))
    return out


class _PackSum:
    """MetaSchedule's pack-sum form of a batch (``cost_model.xgb_model.PackSum``): candidates'
    feature rows stacked, each row carrying its candidate's label, weight = label."""

    def __init__(self, xs: list, ys: np.ndarray | None):
        import xgboost as xgb
        from tvm.s_tir.meta_schedule.cost_model.xgb_model import PackSum
        self.inner = PackSum(xs=xs, ys=ys)
        self.dmatrix: xgb.DMatrix = self.inner.dmatrix

    def objective(self, predt, _dtrain):
        return self.inner.obj_square_error(predt)

    def metric(self, predt, _dtrain):
        return self.inner.rmse(predt)


def fit(xs: list, ys: np.ndarray, threads: int = 1, prior=None, seed: int = 43,
        max_rounds: int = 10000):
    """An XGBoost booster fitted to candidates' feature rows ``xs`` (each float32 ``(rows,
    164)``) and labels ``ys`` (0..1) with MetaSchedule's objective and settings (``XGBConfig``'s
    defaults, early stopping after :data:`EARLY_STOPPING_ROUNDS` rounds without a lower
    training p-rmse, at most ``max_rounds`` rounds), on ``threads`` threads. With ``prior``
    (a booster), boosting continues from it (its trees kept, new trees fitted to what it leaves
    unexplained); ``prior`` itself is not changed. Raises ValueError for no data."""
    import xgboost as xgb
    from tvm.s_tir.meta_schedule.cost_model.xgb_model import XGBConfig
    if not xs:
        raise ValueError("no candidate to fit the cost model to")
    data = _PackSum(xs, np.asarray(ys, dtype="float32"))
    params = XGBConfig(nthread=max(1, threads), seed=seed).to_dict()
    params["disable_default_eval_metric"] = 1
    stop = xgb.callback.EarlyStopping(rounds=EARLY_STOPPING_ROUNDS, metric_name="p-rmse",
                                      data_name="tr", save_best=True)
    return xgb.train(params, data.dmatrix, num_boost_round=max_rounds, obj=data.objective,
                     custom_metric=data.metric, evals=[(data.dmatrix, "tr")],
                     verbose_eval=False, callbacks=[stop],
                     xgb_model=prior.copy() if prior is not None else None)


def predict(booster, xs: list) -> np.ndarray:
    """The booster's score per candidate (higher: predicted faster), float64, one per item of
    ``xs`` (feature rows of one candidate each)."""
    data = _PackSum(xs, None)
    return data.inner.predict_with_score(booster.predict(data.dmatrix)).astype("float64")


def train(data: RecordFeatures, threads: int = 1, max_rounds: int = 10000):
    """A booster fitted to ``data`` (:func:`record_features`) with :func:`fit`."""
    return fit(data.features, data.labels(), threads=threads, max_rounds=max_rounds)


def save(booster, path: str, info: dict) -> int:
    """Write ``booster`` to the folder ``path`` (created) as ``booster.ubj`` (XGBoost's binary
    format) and ``info`` (what it was trained on) with the versions of TVM and XGBoost as
    ``cost_model.json``. Returns the bytes written."""
    import xgboost as xgb
    os.makedirs(path, exist_ok=True)
    booster.save_model(os.path.join(path, BOOSTER))
    meta = {"feature_extractor": "PerStoreFeature", "tvm": tvm.__version__,
            "xgboost": xgb.__version__, **info}
    with open(os.path.join(path, META), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    return sum(os.path.getsize(os.path.join(path, n)) for n in (BOOSTER, META))


def load(path: str):
    """``(booster, info)`` of the cost model saved in the folder ``path`` (:func:`save`).
    Raises ValueError naming the folder and the command that makes one when it holds none."""
    import xgboost as xgb
    file = os.path.join(path, BOOSTER)
    if not os.path.isfile(file):
        raise ValueError(f"--cost-model {path!r} holds no trained cost model ({BOOSTER}); make "
                         "one with 'thomas-tune log train-cost-model LOG... --out DIR'")
    booster = xgb.Booster()
    booster.load_model(file)
    info = {}
    if os.path.isfile(os.path.join(path, META)):
        with open(os.path.join(path, META)) as f:
            info = json.load(f)
    return booster, info


def beside(log_path: str) -> str | None:
    """The cost model saved beside the tuning log ``log_path``
    (``<its parent folder>/cost_model``, as ``tuning_logs/<device>/cost_model`` lies beside
    ``tuning_logs/<device>/<model>``), or None when there is none."""
    path = os.path.join(os.path.dirname(os.path.abspath(log_path)), COST_MODEL_DIR)
    return path if os.path.isfile(os.path.join(path, BOOSTER)) else None


def start_trained(model, booster, threads: int = 1) -> None:
    """Make the MetaSchedule ``XGBModel`` ``model`` start from ``booster``: it predicts with it
    from the first candidate (no random warm-up), and each retraining MetaSchedule's update
    makes continues boosting from ``booster`` on the session's data (:func:`fit` with
    ``prior``) instead of training a new booster from scratch."""
    inst = model._inst

    def train_on_session(xs, ys) -> None:
        inst.booster = fit(xs, ys, threads=threads, prior=booster)

    inst.booster = booster
    inst.num_warmup_samples = 0
    inst._train = train_on_session


def rank_correlation(booster, data: RecordFeatures, min_records: int = 8) -> dict:
    """How well ``booster`` ranks ``data``'s records within each workload: Spearman's rank
    correlation of its scores against the measured throughput (1 / time), per workload with at
    least ``min_records`` records, and their mean. ``booster`` None scores at random
    (uniform, as an untrained MetaSchedule model does). Returns ``{"mean": float,
    "workloads": n, "records": n, "per_workload": {(log, key): rho}}``
    (the workloads of each log apart: times of two logs are not compared)."""
    from scipy.stats import spearmanr
    rng = np.random.default_rng(0)
    by_wl: dict[tuple, list[int]] = {}
    for i, w in enumerate(zip(data.logs, data.workloads)):
        by_wl.setdefault(w, []).append(i)
    per, n = {}, 0
    for w, idx in by_wl.items():
        if len(idx) < min_records:
            continue
        thr = [1.0 / data.seconds[i] for i in idx]
        if len(set(thr)) < 2:
            continue
        xs = [data.features[i] for i in idx]
        score = predict(booster, xs) if booster is not None else rng.random(len(idx))
        rho = spearmanr(score, thr).statistic
        per[w] = float(rho) if math.isfinite(rho) else 0.0
        n += len(idx)
    mean = float(np.mean(list(per.values()))) if per else math.nan
    return {"mean": mean, "workloads": len(per), "records": n, "per_workload": per}


def train_cost_model(logs: list[str], out: str, max_per_workload: int | None = 64,
                     seed: int = 0, threads: int = 1, report_to=sys.stderr) -> dict:
    """Train the cost model on the records of the tuning-log folders ``logs``
    (:func:`record_features`, :func:`train`) and save it in ``out`` (:func:`save`). Returns
    what was saved in ``cost_model.json``: records and workloads per log, seconds spent
    extracting features and training, bytes written."""
    t0 = time.perf_counter()

    def progress(done, total):
        if report_to is not None and (done == total or done % 20 == 0):
            print(f"  {done}/{total} workloads", file=report_to, flush=True)

    data = RecordFeatures()
    per_log = {}
    for path in logs:
        if report_to is not None:
            print(f"features of {path}", file=report_to, flush=True)
        part = record_features([path], max_per_workload, seed, threads, progress)
        per_log[os.path.normpath(path)] = {"records": len(part.seconds),
                                           "workloads": len(set(part.workloads))}
        data.features += part.features
        data.seconds += part.seconds
        data.workloads += part.workloads
        data.logs += part.logs
        data.best.update(part.best)
        data.skipped += part.skipped
    t1 = time.perf_counter()
    booster = train(data, threads=threads)
    t2 = time.perf_counter()
    info = {"logs": per_log, "records": len(data.seconds), "skipped": data.skipped,
            "max_per_workload": max_per_workload, "seed": seed,
            "boosting_rounds": booster.num_boosted_rounds(),
            "features_s": round(t1 - t0, 1), "train_s": round(t2 - t1, 1)}
    info["bytes"] = save(booster, out, info)
    return info
