"""Python's start-up hook in the processes that thomas_tune's processes start.

Importing :mod:`thomas_tune` puts this folder first on ``PYTHONPATH`` for the process's
children, so that Python's ``site`` imports this module in each of them before its main module
(``site`` imports the first ``sitecustomize`` on the path). In TVM's pool workers
(``python -m tvm.exec.popen_worker``: the builders' and runners' workers, the device servers)
it imports TVM with PyTorch hidden, as :mod:`thomas_tune` does: tvm_ffi imports torch at its
own import whenever torch is installed, and no worker uses it (``import torch`` later works).
That import is most of a worker's start (docs/opencl.md gives the figures). Every other
process is left as it was. A ``sitecustomize`` further on the path (a distribution's, a virtual
environment's) is imported first, as Python would have imported it.
``THOMAS_TUNE_TVM_WITH_TORCH=1`` lets TVM import torch, in workers too.
"""

import os
import sys

#: the module a TVM pool worker runs (``tvm.support.popen_pool.PopenWorker``)
TVM_WORKER = "tvm.exec.popen_worker"
#: this folder, which :func:`hook_children` puts first on the children's ``PYTHONPATH``
HERE = os.path.dirname(os.path.abspath(__file__))


class HideTorch:
    """A meta-path finder under which ``import torch`` raises ImportError."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is hidden in this process: thomas_tune imports TVM "
                              "without it (THOMAS_TUNE_TVM_WITH_TORCH=1 keeps it)")
        return None


def _is_tvm_worker(argv) -> bool:
    return any(a == TVM_WORKER and argv[i - 1] == "-m" for i, a in enumerate(argv) if i)


def _import_next_sitecustomize() -> None:
    """Import the ``sitecustomize`` that this one hides on the path, if there is one."""
    import importlib.machinery
    import importlib.util
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _torch_kept() -> bool:
    return os.environ.get("THOMAS_TUNE_TVM_WITH_TORCH") == "1"


def hook_children() -> None:
    """Put this folder first on ``PYTHONPATH`` in this process's environment, once, so that the
    processes it starts run this hook (unless ``THOMAS_TUNE_TVM_WITH_TORCH=1``)."""
    if _torch_kept():
        return
    path = os.environ.get("PYTHONPATH", "")
    if path.split(os.pathsep)[0] != HERE:
        os.environ["PYTHONPATH"] = HERE + (os.pathsep + path if path else "")


def import_tvm_without_torch() -> None:
    """Import TVM (``tvm_ffi``, then ``tvm``) with ``import torch`` failing, unless torch is
    already imported or ``THOMAS_TUNE_TVM_WITH_TORCH=1``; afterwards torch imports as usual."""
    if "torch" in sys.modules or _torch_kept():
        return
    hide = HideTorch()
    sys.meta_path.insert(0, hide)
    try:
        import tvm_ffi  # noqa: F401
        # with TVM's compiler, tvm imports tvm.relax (tvm.relax.base_py_module imports torch
        # too); under TVM_USE_RUNTIME_LIB=1 only the runtime's modules
        import tvm  # noqa: F401
    finally:
        sys.meta_path.remove(hide)


if __name__ == "sitecustomize":
    _import_next_sitecustomize()
    if _is_tvm_worker(getattr(sys, "orig_argv", sys.argv)):
        import_tvm_without_torch()  # the worker's first statement imports TVM anyway
