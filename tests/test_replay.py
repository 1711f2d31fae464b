"""Replay of the committed tuning log: it still applies to today's graphs (FLOP coverage) and
the tuned module computes the float64 reference's numbers."""

import os


from thomas_tune import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG = os.path.join(ROOT, "tuning_logs", "local-cpu", "mobilenet_v2-w0.35-r64-c10-b8")


def test_replay_committed_log(capsys):
    """The committed CPU log compiles the inference graph and the training graph of the last two
    layers (the whole graph's takes twice the time: 3.3 min on 2 cores) and their numbers match
    the float64 reference. Its records hold at least half of those graphs' untuned kernel time
    as measured when it was tuned (``default_latency.json`` beside it): a graph change that
    leaves the log's workloads behind shows here."""
    rc = cli.main(["replay", "--log", LOG, "--model", "mobilenet_v2", "--width", "0.35",
                   "--resolution", "64", "--classes", "10", "--batch", "8", "--target", "llvm",
                   "--trainable", "last:2", "--min-flops-coverage", "0",
                   "--min-time-coverage", "0.5"])
    out = capsys.readouterr().out
    print(out)
    assert "tasks have a tuning record" in out and "vs PyTorch float64" in out
    assert rc == 0, out


def test_replay_check_is_pytorchs_and_fails_a_wrong_build(rng):
    """replay's check of a build is against PyTorch float64 (never the project's own gradient
    code) with the step check's formula and bounds: a right build passes; a build whose
    BatchNorm bias gradient is 1% off (``tests/mutants.py``, the last BatchNorm's) fails,
    naming that parameter (the mutant a reference made of the project's own gradient code
    reported right). Both builds at LLVM opt-level 0 (``compile.reference_target``: the same
    loss and gradients to the last bit, in less build time)."""
    import pytest
    pytest.importorskip("torch")
    import mutants as M

    from thomas_tune.training_graph import graph as G
    from thomas_tune.compiler.compile import compile_graph, reference_target
    from thomas_tune.models import build
    from thomas_tune.compiler.replay import REFERENCE, check_numbers
    from thomas_tune.target import parse_target
    model = build("mobilenet_v2", num_classes=5, resolution=32, width=0.35)
    seed = int(rng.integers(1 << 30))
    llvm = reference_target(parse_target("llvm"))
    right = check_numbers(model, llvm, None, 8, "last:2", seed)
    assert right["reference"] == REFERENCE == "PyTorch float64"
    assert right["step"].ok, right["step"].line()
    assert right["logits"] < 1e-5, right
    with M.DATA_MUTANTS["BatchNorm bias"](1.01):
        wrong_build = compile_graph(G.training_module(model, 8, "last:2").mod, llvm)
    wrong = check_numbers(model, llvm, None, 8, "last:2", seed, tuned=wrong_build)
    assert not wrong["step"].ok, wrong["step"].line()
    assert wrong["step"].failing == ["features.18.1.bias"], wrong["step"].line()


def test_replay_claims_no_numeric_check_without_pytorch(monkeypatch):
    """Without PyTorch, replay's numeric check says it has no independent reference and
    returns no numbers (the CLI then fails unless given --no-check)."""
    import builtins

    from thomas_tune.compiler.replay import check_numbers
    real = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch here")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    out = check_numbers(None, None, None, 8, "all", 0)
    assert out["reference"] is None and "PyTorch is not installed" in out["why"]
    assert set(out) == {"reference", "why"}


def test_replay_fails_under_threshold(tmp_path, capsys):
    rc = cli.main(["replay", "--log", LOG, "--min-flops-coverage", "1.0", "--no-check",
                   "--width", "0.35", "--resolution", "64", "--classes", "10", "--batch", "8"])
    assert rc == 1
    assert "below --min-flops-coverage" in capsys.readouterr().err


def test_replay_of_missing_log_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["replay", "--log", str(tmp_path / "none")]) == 2
    assert "has no records" in capsys.readouterr().err


def test_replay_time_coverage_of_a_gpu_log(capsys):
    """A log tuned by time share is judged by the share of the untuned kernel time (measured on
    the device, default_latency.json) that its compiled records hold; it is computed here from
    the committed H100 log with no device, and a minimum above it fails before compiling. The
    share and the untuned time it reports are the sums made again here from the kernels the
    build has (the tasks of the inference and training graphs with the log's Winograd
    choice), the records it applies and the times in default_latency.json (kept where the
    kernel timed is the one the default rules make today), to the digits printed: a share
    that counts a task without a record, misses a task, counts one twice or forgets its calls
    fails here."""
    import json
    import math

    from thomas_tune.training_graph import graph as G
    from thomas_tune.logs import TuningLog
    from thomas_tune.models import build
    from thomas_tune.compiler.build_plan import BuildPlan
    from thomas_tune.target import parse_target
    from thomas_tune.tasks import extract, key
    from thomas_tune.tuning.defaults import default_schedule_key
    gpu_log = os.path.join(ROOT, "tuning_logs", "h100", "mobilenet_v2-w0.35-r64-c10-b8")
    target_json = os.path.join(ROOT, "targets", "h100_opencl.json")
    args = ["replay", "--log", gpu_log, "--no-check", "--width", "0.35", "--resolution", "64",
            "--classes", "10", "--batch", "8", "--target", target_json,
            "--min-flops-coverage", "0"]
    rc = cli.main(args + ["--min-time-coverage", "0.99"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "below --min-time-coverage 0.99" in captured.err
    head, tail = captured.out.split("% of the untuned kernel time")
    share, untuned_ms = float(head.rsplit(" ", 1)[1]), float(tail.split(" ms")[0])

    # the same sums from the log's files (the CLI's defaults: trainable all, inference batch 1)
    target = parse_target(target_json)
    model = build("mobilenet_v2", width=0.35, resolution=64, num_classes=10)
    graphs = {"infer": G.inference_module(model, 1),
              "train": G.training_module(model, 8, "all").mod}
    plan = BuildPlan.from_log(TuningLog(gpu_log), target, graphs)
    database = plan.database
    with open(os.path.join(gpu_log, "default_latency.json")) as f:
        cached = json.load(f)
    total = tuned = 0.0
    counted = {True: 0, False: 0}
    def applied_in(db, task):
        return bool(db.has_workload(task.mod) and db.get_top_k(db.commit_workload(task.mod), 1))

    assert [key(t) for t in plan.tasks] == [key(t) for t in extract(graphs, target,
                                                                    plan.winograd)]
    for task in plan.tasks:
        k = key(task)
        secs = cached["seconds"].get(k)
        if secs is None or cached["schedules"].get(k) != default_schedule_key(task.mod, target):
            continue  # not timed, failed, or timed on another kernel than today's
        applied = applied_in(database, task)
        total += task.weight * secs
        tuned += task.weight * secs if applied else 0.0
        counted[applied] += 1
    print(f"{share}% of {untuned_ms} ms; here {100 * tuned / total:.3f}% of "
          f"{1e3 * total:.4f} ms over {counted} timed tasks with and without a record")
    assert counted[True] > 0 and counted[False] > 0 and math.isfinite(total)
    assert abs(share - 100 * tuned / total) <= 0.05 + 1e-9, captured.out
    assert abs(untuned_ms - 1e3 * total) <= 0.005 + 1e-9, captured.out

    # the plan made again without a record (as for a wrong one): that kernel alone loses it
    first = next(t for t in plan.tasks if applied_in(database, t))
    fewer = plan.without({key(first): "left out"})
    assert fewer.wrong == {key(first): "left out"} and plan.wrong == {}
    assert not applied_in(fewer.database, first)
    kept = {key(t) for t in fewer.tasks} - {key(first)}
    assert all(applied_in(fewer.database, t) for t in plan.tasks
               if key(t) in kept and applied_in(database, t))


SMALL_MNV2 = ["--width", "0.35", "--resolution", "64", "--classes", "10", "--batch", "8"]


def _time_share(log, capsys, model=SMALL_MNV2) -> float:
    args = ["replay", "--log", str(log), "--no-check", *model, "--target",
            os.path.join(ROOT, "targets", "h100_opencl.json"), "--min-flops-coverage", "0",
            "--min-time-coverage", "1.0"]  # the share is reported, then nothing is compiled
    assert cli.main(args) == 1
    out = capsys.readouterr()
    assert "below --min-time-coverage 1.0" in out.err, out.err
    return float(out.out.split("% of the untuned kernel time")[0].rsplit(" ", 1)[1])


def test_time_share_adds_up_over_the_records_workloads(tmp_path, capsys):
    """The share of the untuned kernel time held by tasks with a record is a sum over those
    tasks: the committed GPU log's records split by workload into two logs give two shares
    that add up to the whole log's, each above 0 and below it. A share that counts tasks
    without a record, counts a task twice or misses the tasks of one half fails this. (The
    MobileNetV2 1.0@224 log: 209 of its model's 276 tasks have records, and it has no
    convolution the Winograd form takes, whose choice would move with the records kept.)"""
    import lzma
    import random
    import shutil
    src = os.path.join(ROOT, "tuning_logs", "h100", "mobilenet_v2-w1-r224-c1000-b32")
    model = ["--model", "mobilenet_v2", "--width", "1.0", "--resolution", "224", "--classes",
             "1000", "--batch", "32"]
    with lzma.open(os.path.join(src, "database_tuning_record.json.xz"), "rt") as f:
        records = [line for line in f if line.strip()]
    workloads = sorted({int(line[1:line.index(",")]) for line in records})
    half = set(random.Random(int.from_bytes(os.urandom(4), "little")).sample(
        workloads, len(workloads) // 2))
    parts = {"all": lambda w: True, "a": lambda w: w in half, "b": lambda w: w not in half}
    shares = {}
    for name, keep in parts.items():
        log = tmp_path / name
        log.mkdir()
        with lzma.open(os.path.join(src, "database_workload.json.xz"), "rt") as f:
            (log / "database_workload.json").write_text(f.read())
        shutil.copy(os.path.join(src, "default_latency.json"), log)
        (log / "database_tuning_record.json").write_text(
            "".join(r for r in records if keep(int(r[1:r.index(",")]))))
        shares[name] = _time_share(log, capsys, model)
    print(shares)
    assert 0 < shares["a"] < shares["all"] and 0 < shares["b"] < shares["all"], shares
    assert abs(shares["a"] + shares["b"] - shares["all"]) <= 0.15, shares  # printed to 0.1


def test_time_coverage_needs_device_times(tmp_path, capsys):
    """A log without the default schedules' times measured on the device
    (``default_latency.json``) cannot say what share of the time its records hold."""
    import shutil
    log = tmp_path / "log"
    shutil.copytree(LOG, log)
    (log / "default_latency.json").unlink()
    rc = cli.main(["replay", "--log", str(log), "--min-flops-coverage", "0", "--no-check",
                   "--min-time-coverage", "0.1", "--width", "0.35", "--resolution", "64",
                   "--classes", "10", "--batch", "8"])
    assert rc == 1
    assert "needs default-schedule times measured on the device" in capsys.readouterr().err


def test_packed_log_reads_as_the_plain_one_and_refuses_writes(tmp_path, monkeypatch, capsys):
    """'log pack' compresses a log in place; the packed log reads the same workloads and
    records (from an unpacked copy in the cache), refuses the lock a tuner or re-measure takes
    with an error naming 'log unpack', and 'log unpack' restores the plain files byte for
    byte."""
    import shutil

    import pytest

    from thomas_tune.logs import (RECORDS, WORKLOADS, TuningLog, is_packed, read_log,
                                        summarize)

    monkeypatch.setenv("THOMAS_TUNE_CACHE", str(tmp_path / "cache"))
    log = tmp_path / "log"
    shutil.copytree(LOG, log)
    plain = {n: (log / n).read_bytes() for n in (WORKLOADS, RECORDS)}
    before = summarize(read_log(str(log)))
    assert cli.main(["log", "pack", str(log)]) == 0
    assert is_packed(str(log)) and not (log / RECORDS).exists()
    assert (log / (RECORDS + ".xz")).stat().st_size * 10 < len(plain[RECORDS])
    assert summarize(read_log(str(log))) == before
    packed = TuningLog(str(log))
    assert packed.packed and packed.database().has_workload is not None
    with pytest.raises(ValueError, match="log unpack"):
        packed.lock()
    # the CLI refuses before it does any work (no tracker at this address is needed)
    assert cli.main(["remeasure", "--model", "mobilenet_v2", "--width", "0.35", "--resolution",
                     "64", "--classes", "10", "--batch", "8", "--log", str(log),
                     "--tracker", "127.0.0.1:9", "--key", "none"]) != 0
    assert "log unpack" in capsys.readouterr().err
    assert cli.main(["log", "unpack", str(log)]) == 0
    assert {n: (log / n).read_bytes() for n in (WORKLOADS, RECORDS)} == plain
    assert not is_packed(str(log)) and not TuningLog(str(log)).packed


def _replay_without_opencl(tmp_path, *extra):
    """`thomas-tune replay` of the committed H100 log in a process that sees no OpenCL device
    (the ICD loader pointed at an empty vendor folder): (exit status, stdout + stderr)."""
    import subprocess
    import sys
    vendors = tmp_path / "no_vendors"
    vendors.mkdir(exist_ok=True)
    gpu_log = os.path.join(ROOT, "tuning_logs", "h100", "mobilenet_v2-w0.35-r64-c10-b8")
    env = dict(os.environ, OCL_ICD_VENDORS=str(vendors), OCL_ICD_FILENAMES="")
    env.pop("THOMAS_TUNE_REQUIRE_OPENCL", None)
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from thomas_tune import cli; "
         "sys.exit(cli.main(sys.argv[1:]))", "replay", "--log", gpu_log, "--width", "0.35",
         "--resolution", "64", "--classes", "10", "--batch", "8", "--target",
         os.path.join(ROOT, "targets", "h100_opencl.json"), "--min-flops-coverage", "0",
         *extra], capture_output=True, text=True, env=env, timeout=600)
    return run.returncode, run.stdout + run.stderr


def test_replay_that_can_check_nothing_fails_unless_told_not_to_check(tmp_path):
    """On a machine with no OpenCL device the GPU log's records cannot be run: the replay
    fails at once, naming why and the way out, and compiles nothing. (With --no-check the same
    log gets past the records: test_replay_time_coverage_of_a_gpu_log.)"""
    rc, out = _replay_without_opencl(tmp_path)
    assert rc == 1, out
    assert "cannot be checked on this machine" in out and "no OpenCL device" in out, out
    assert "--no-check" in out and "nothing compiled" in out, out
    assert "tasks have a tuning record" not in out, out


def test_export_with_no_device_applies_no_unchecked_record(tmp_path, monkeypatch, capsys):
    """Where no device of this machine runs the target, ``export --log`` refuses before it
    compiles anything, naming --no-check; nothing is written."""
    from thomas_tune.compiler import record_check

    def nowhere(target):
        raise record_check.CheckUnavailable("no OpenCL device on this machine")

    monkeypatch.setattr(record_check, "local_device", nowhere)
    out = tmp_path / "e"
    rc = cli.main(["export", "--log", LOG, "--model", "mobilenet_v2", "--width", "0.35",
                   "--resolution", "64", "--classes", "10", "--batch", "8", "--target", "llvm",
                   "--out", str(out), "--any-codegen"])
    err = capsys.readouterr().err
    assert rc == 2 and "--no-check" in err and "cannot be checked" in err, err
    assert not os.path.exists(out / "manifest.json") and not os.path.exists(out / "train.so")
