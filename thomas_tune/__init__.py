"""thomas_tune: autotuned kernels for on-device training of CNNs.

Importing the package loads the OpenCL runtime sidecar when it can be built here (see
:mod:`thomas_tune.opencl`), so that ``tvm.opencl(0)`` and exported OpenCL modules work.
"""

from . import opencl as _opencl

try:
    _opencl.load()
except _opencl.OpenCLUnavailable:  # reported when OpenCL is actually used
    pass
