"""thomas_tune: autotuned kernels for on-device training of CNNs.

Importing the package loads the OpenCL runtime sidecar when it can be built here (see
:mod:`thomas_tune.opencl`), so that ``tvm.opencl(0)`` and exported OpenCL modules work.

TVM's FFI layer (``tvm_ffi``) and ``tvm.relax`` import PyTorch at their own import whenever it
is installed, though loading and running exported kernels never needs it: that import is most
of a second start's time (2.6 s -> 0.8 s to import :mod:`thomas_tune.runtime` on a 2-core
x86-64 host with the CPU build of torch 2.13). So TVM is imported here with PyTorch hidden,
unless PyTorch is already imported or ``THOMAS_TUNE_TVM_WITH_TORCH=1``; ``import torch`` later
works as usual (the bench and the tests compare with it), only tvm_ffi's automatic conversion
of torch tensors is off, which thomas_tune does not use. The processes this one starts get the
same for TVM's pool workers (builders, runners, device servers): :mod:`thomas_tune.startup`.

Running an export needs no compiler: with ``TVM_USE_RUNTIME_LIB=1`` in the environment before
TVM is imported, TVM loads only ``libtvm_runtime.so`` and skips ``tvm.relax``, which halves
the import (a deployed second start; ``thomas-tune train --export DIR`` / ``infer``). Then
:mod:`thomas_tune.runtime`, :mod:`thomas_tune.models` (checkpoints, ``spec``) and the OpenCL
sidecar work; the compiler's modules (``export``, ``graph``, ``tune``...) do not import, graph
building (``models.trace``) and ``remote.check_device`` raise RuntimeError saying to run
without the variable, and the CLI's compiling verbs exit with status 2 saying so.
:func:`compiler_available` says which kind of process this is.
"""

from .startup.sitecustomize import hook_children, import_tvm_without_torch

hook_children()  # this process's children: TVM's pool workers import TVM without torch too
import_tvm_without_torch()

from .models.layers import compiler_available  # noqa: E402,F401
from . import opencl as _opencl  # noqa: E402

if compiler_available():
    # OpenCL sources are checked for kernel arguments TVM's own OpenCL runtime cannot pass,
    # and compiled with aligned vector reads of shared memory
    from . import kernel_signature as _kernel_signature  # noqa: E402

    _kernel_signature.register()

try:
    _opencl.load()
    if compiler_available():
        # BatchNorm's statistics are one reduction with their own combiner, which TVM's
        # schedule primitives (cross-thread reduction, rfactor) must know in every compiling
        # process; the sidecar registers it (C++ callbacks)
        from .models import batchnorm as _batchnorm  # noqa: E402

        _batchnorm.register_reducer()
except _opencl.OpenCLUnavailable:  # reported when OpenCL is actually used
    pass
