"""Replay of the committed tuning log: it still applies to today's graphs (FLOP coverage) and
the tuned module computes the float64 reference's numbers."""

import os

from thomas_tune import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG = os.path.join(ROOT, "tuning_logs", "local-cpu", "mobilenet_v2-w0.35-r64-c10-b8")


def test_replay_committed_log(capsys):
    """The committed CPU log compiles the inference graph and the training graph of the last two
    layers (the whole graph's takes twice the time: 3.3 min on 2 cores) and their numbers match
    the float64 reference."""
    rc = cli.main(["replay", "--log", LOG, "--model", "mobilenet_v2", "--width", "0.35",
                   "--resolution", "64", "--classes", "10", "--batch", "8", "--target", "llvm",
                   "--trainable", "last:2"])
    out = capsys.readouterr().out
    print(out)
    assert "tasks have a tuning record" in out and "vs float64 reference" in out
    assert rc == 0, out


def test_replay_fails_under_threshold(tmp_path, capsys):
    rc = cli.main(["replay", "--log", LOG, "--min-flops-coverage", "1.0", "--no-check",
                   "--width", "0.35", "--resolution", "64", "--classes", "10", "--batch", "8"])
    assert rc == 1
    assert "below --min-flops-coverage" in capsys.readouterr().err


def test_replay_of_missing_log_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["replay", "--log", str(tmp_path / "none")]) == 2
    assert "has no records" in capsys.readouterr().err
