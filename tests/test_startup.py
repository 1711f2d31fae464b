"""TVM's pool workers started by a thomas_tune process import TVM without PyTorch
(:mod:`thomas_tune.startup`); other child processes are as before, and a start-up hook
further on the path still runs."""

import os
import subprocess
import sys

import pytest
from tvm.support.popen_pool import PopenWorker

import thomas_tune  # noqa: F401  (puts the start-up hook on the children's path)

pytest.importorskip("torch")


# evaluated in the worker (a function of this file would not unpickle there)
LOADED = "[m in __import__('sys').modules for m in ('tvm', 'torch')]"


def test_tvm_pool_workers_do_not_import_torch():
    worker = PopenWorker()
    try:
        worker.send(eval, (LOADED,))
        assert worker.recv() == [True, False]  # TVM is imported there, without torch
        worker.send(eval, ("__import__('torch').__name__",))
        assert worker.recv() == "torch"  # which imports later
    finally:
        worker.kill()


def test_other_children_import_torch_and_run_a_further_hook(tmp_path, monkeypatch):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['FURTHER_HOOK'] = 'ran'\n")
    monkeypatch.setenv("PYTHONPATH", os.environ["PYTHONPATH"] + os.pathsep + str(other))
    code = "import os, torch; print(torch.__name__, os.environ.get('FURTHER_HOOK'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch", "ran"]
