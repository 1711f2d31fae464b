"""A cost model that starts trained, local search near the best records, and the trials to 95%,
on PoCL over a loopback tracker and device server: the cost model trained on a tuning log's
records is saved, loaded and updated online; the local search proposes schedules one decision
away from a task's best records and they are measured; ``--stats`` counts the trials per task
to 95% of its final best."""

import json
import math
import os
import shutil

import numpy as np
import pytest
import tvm
from tvm.s_tir import meta_schedule as ms

from thomas_tune import rpc

from opencl_kernels import NEEDS_OPENCL

pytestmark = NEEDS_OPENCL


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One small task of MobileNetV2 tuned on PoCL for 16 trials (evolutionary search only),
    its log and its ``--stats`` report."""
    from thomas_tune.training_graph import graph as G
    from thomas_tune import opencl
    from thomas_tune.logs import TuningLog
    from thomas_tune.models import build
    from thomas_tune.tasks import extract, key
    from thomas_tune.tuning import rpc_runner, tune
    target = opencl.target_for(0)
    model = build("mobilenet_v2", num_classes=5, resolution=32, width=0.35)
    tasks = sorted((t for t in extract({"infer": G.inference_module(model, 1)}, target)
                    if t.flops > 0 and not t.name.startswith("bn_fold")), key=lambda t: t.flops)
    task = tasks[2]  # a convolution with tiles to choose, quick to build and run
    root = tmp_path_factory.mktemp("tuned")
    log, stats = TuningLog(str(root / "log")), str(root / "stats.json")
    with rpc.loopback(key="pocl", servers=1, lifetime=600) as addr:
        # a default-schedule time (1 s, slower than any record) that the report carries
        report = tune([task], target, log, rpc_runner(addr, "pocl"), trials=16,
                      trials_per_iter=4, population=16, show_progress=False, max_in_flight=1,
                      builder_workers=1,
                      refine_top=0, local_share=0.0, stats_path=stats,
                      default_s={key(task): 1.0})
    assert report.trials == 16 and report.local == 0
    with open(stats) as f:
        return {"task": task, "target": target, "log": log, "stats": json.load(f)}


def _candidates(log, target):
    """The log's valid records rebuilt as measure candidates of one tune context, and their
    mean times (s)."""
    from thomas_tune.logs import mean_seconds
    (wl,) = [ms.database.Workload.from_json(w) for w in _lines(log.workload_path)]
    ctx = ms.TuneContext(mod=wl.mod, target=target, num_threads=1)
    cands, secs = [], []
    for _, body in _lines(log.record_path):
        if math.isfinite(mean_seconds(body)):
            sch = tvm.s_tir.Schedule(wl.mod)
            tvm.s_tir.schedule.Trace.apply_json_to_schedule(body[0], sch)
            cands.append(ms.MeasureCandidate(sch, []))
            secs.append(mean_seconds(body))
    return ctx, cands, np.array(secs)


def _fit(pred, secs) -> float:
    """How well scores ``pred`` fit MetaSchedule's labels of times ``secs`` (the best time over
    each one): their correlation. (Its objective weighs each candidate by its label, so the
    order among candidates 100x slower than the best is left loose: a rank correlation over
    all of them would judge what it does not fit.)"""
    return float(np.corrcoef(pred, secs.min() / secs)[0, 1])


def test_a_trained_cost_model_is_saved_loaded_and_updated_online(tuned, tmp_path, rng):
    """``log train-cost-model``'s model, loaded, predicts as the booster trained on the same
    records before saving does (how well such a model ranks records is measured on the committed
    logs, docs/journal/cost-model.md: on the dozen records of one small session here its fit
    to its own training times went as low as 0.34 in rank correlation); a session's model made
    from it
    predicts with it before any measurement (no random warm-up); an update with fresh
    measurements that rank the candidates the other way round moves its predictions towards
    them, and leaves the saved booster unchanged."""
    from thomas_tune.measure.phases import Phases
    from thomas_tune.tuning import cost_model
    from thomas_tune.tuning import pretrained as pt

    out = str(tmp_path / "cost_model")
    info = pt.train_cost_model([tuned["log"].path], out, max_per_workload=None,
                               report_to=None)
    ctx, cands, secs = _candidates(tuned["log"], tuned["target"])
    # (at least half the 16 trials measured: a loaded machine times some out)
    assert info["records"] == len(secs) >= 8 and info["skipped"] == 0
    assert os.path.getsize(os.path.join(out, pt.BOOSTER)) < 1e6
    booster, meta = pt.load(out)
    assert meta["records"] == len(secs) and meta["feature_extractor"] == "PerStoreFeature"
    feats = [f.numpy() for f in ms.feature_extractor.PerStoreFeature().extract_from(ctx, cands)]
    loaded = pt.predict(booster, feats)
    assert np.ptp(loaded) > 0  # not a constant model
    data = pt.record_features([tuned["log"].path])
    assert np.allclose(pt.predict(pt.train(data), feats), loaded)  # saved as trained

    model = cost_model(Phases(), threads=1, pretrained=booster)
    before = np.asarray(model.predict(ctx, cands))
    assert np.allclose(before, loaded)  # the trained booster from the first candidate on
    # fresh times that reverse the model's ranking: the best predicted measures slowest
    times = np.empty(len(cands))
    times[np.argsort(-before)] = np.sort(rng.uniform(1e-5, 1e-3, len(cands)))[::-1]
    assert _fit(before, times) < 0
    model.update(ctx, cands, [ms.runner.RunnerResult([float(t)], None) for t in times])
    after = np.asarray(model.predict(ctx, cands))
    assert not np.allclose(after, before)
    assert _fit(after, times) > max(0.5, _fit(before, times) + 0.5)
    assert np.allclose(pt.predict(booster, feats), loaded)  # the prior is kept as it was
    assert pt.beside(os.path.join(str(tmp_path), "some-model")) == out


def _one_decision_apart(trace, centre) -> bool:
    from thomas_tune.tuning.local_search import differing_decisions
    try:
        return len(differing_decisions(trace, centre)) == 1
    except ValueError:  # a trace of another design space (sketch) of the task: not its centre
        return False


def test_local_search_measures_schedules_one_decision_from_the_best(tuned, tmp_path):
    """A session with all of each batch given to the local search (``local_share=1``)
    measures only schedules that differ from one of the task's two best records before their
    batch in exactly one decision, and times them on the device."""
    from thomas_tune.logs import TuningLog, mean_seconds
    from thomas_tune.tuning import rpc_runner, tune
    path = str(tmp_path / "log")
    shutil.copytree(tuned["log"].path, path)
    log = TuningLog(path)
    n0 = len(_lines(log.record_path))
    with rpc.loopback(key="pocl", servers=1, lifetime=600) as addr:
        report = tune([tuned["task"]], tuned["target"], log, rpc_runner(addr, "pocl"),
                      trials=8, trials_per_iter=4, population=16, show_progress=False,
                      max_in_flight=1, refine_top=0, local_share=1.0, seed=7, builder_workers=1)
    # (a search that finds only measured schedules draws a batch at random, which can pass
    # the budget by a few trials; those are handed to the local search too)
    assert report.trials >= 8 and report.local == report.trials
    records = [body for _, body in _lines(log.record_path)]
    assert len(records) == n0 + report.trials
    valid = [r for r in records if math.isfinite(mean_seconds(r))]
    for j in range(n0, len(records)):
        # its centre was one of the two best records when its batch was made: before it in
        # the log (batches can be shorter than 4 where the search skipped measured ones)
        centres = {json.dumps(b[0]): b for k in range(n0, j + 1)
                   for b in sorted((r for r in valid if records.index(r) < k),
                                   key=mean_seconds)[:2]}
        assert any(_one_decision_apart(records[j][0], b[0]) for b in centres.values()), j
    assert any(math.isfinite(mean_seconds(r)) for r in records[n0:])  # measured


def test_trials_to_95_percent_of_the_final_time(tuned, tmp_path, rng):
    """The trials to 95% of a task's final best (and of its gain over the default schedule)
    on a small log of known times, read in log order through the tuning log's database; and
    the figure ``--stats`` wrote for the tuned task, against its log read line by line."""
    from thomas_tune.logs import FAILED_RUN_S, TuningLog, mean_seconds
    from thomas_tune.tuning.report import TaskProgress, convergence, trials_to_95

    scale = float(rng.uniform(1e-6, 1e-3))  # the count does not depend on the unit
    cases = [([5, 4, math.inf, 2, 1.9, 3, 1.0], 10, (7, 7)),
             ([2, 1.04, 1.0], 3, (2, 2)), ([1.0, 1.02, 2], 0.5, (1, None)),
             ([math.inf, math.inf], 1, (None, None))]
    (wl,) = _lines(tuned["log"].workload_path)
    (body, *_) = [b for _, b in _lines(tuned["log"].record_path)]
    for times, default, want in cases:
        folder = tmp_path / f"known{len(times)}-{default}"
        folder.mkdir()
        log = TuningLog(str(folder))
        with open(log.workload_path, "w") as f:
            f.write(json.dumps(wl) + "\n")
        with open(log.record_path, "w") as f:
            for t in times:
                secs = [FAILED_RUN_S] if math.isinf(t) else [t * scale]
                f.write(json.dumps([0, [body[0], secs, *body[2:]]]) + "\n")
        task = TaskProgress("known", 1.0)
        convergence([task], log.database(), [tuned["task"].mod], [default * scale * 1e3])
        assert (task.to95, task.to95_gain) == want and task.records == len(times)
        assert trials_to_95([t * scale for t in times], default * scale) == want

    times = [mean_seconds(b) for _, b in _lines(tuned["log"].record_path)]
    best, first = min(times), None
    for n in range(1, len(times) + 1):
        if min(times[:n]) * 0.95 <= best:
            first = n
            break
    (stats,) = tuned["stats"]["tasks"]
    assert stats["records"] == 16 and stats["trials_to_95pct"] == first
    assert stats["default_ms"] == 1000.0 and stats["best_ms"] < stats["default_ms"]


def test_cost_model_and_local_search_options_name_what_is_wrong(tmp_path, capsys):
    """'tune --cost-model' with a folder that holds no trained model, '--local-share' outside
    0..1, and 'log train-cost-model' of a folder that holds no tuning log fail before any work,
    naming the option and the fix; nothing is made."""
    from thomas_tune import cli
    log, out = tmp_path / "log", tmp_path / "model"
    base = ["tune", "--model", "alexnet", "--width", "0.1", "--resolution", "63", "--classes",
            "5", "--tracker", "127.0.0.1:9", "--key", "k", "--log", str(log)]
    cases = [([*base, "--cost-model", str(tmp_path)], "holds no trained cost model",
              "thomas-tune log train-cost-model"),
             ([*base, "--local-share", "1.5"], "--local-share 1.5 is not a share"),
             (["log", "train-cost-model", str(tmp_path), "--out", str(out)],
              "is not a tuning-log folder")]
    for argv, *needles in cases:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert all(n in err for n in needles) and "Traceback" not in err, err
    assert not log.exists() and not out.exists()
