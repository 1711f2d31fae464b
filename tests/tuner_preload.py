"""What the fault test's fork server imports once for the tuners it forks: the CLI (thomas_tune
first: it imports TVM without PyTorch, as the command does) and MetaSchedule's tensor
intrinsics through thomas_tune's faster import (a plain ``import tvm.s_tir.tensor_intrin``
takes about 10x longer)."""

import thomas_tune.cli  # noqa: F401
from thomas_tune.schedules.intrinsics import load_tensor_intrinsics

load_tensor_intrinsics()
