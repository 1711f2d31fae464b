"""BatchNorm's batch statistics alone against float64: mean and variance per channel.

    python bench/experiments/bn_statistics.py [--repo PATH] [--llvm]

Builds the statistics kernels of ``models/batchnorm.py`` (of this tree, or of the checkout at
``--repo``: the four-kernel form's ``bn_stats``, the seven-kernel form's ``bn_combine`` or the
eight-kernel form's ``bn_mean``) with the product's default schedules for OpenCL device 0
(``--llvm``: for this CPU, its long sums split as ``thomas_tune.compiler.compile`` splits them),
runs them on 32 x 8 x 28 x 28 float32 values per draw (channel means 0, 1, 10 and 100 standard
deviations from 0, sample means spread by 0.3 of one; five draws each) and prints the largest
error of the mean (in standard deviations) and of the biased variance (relative), against
numpy's float64 statistics of the same values.
"""

import argparse
import importlib.util
import os

import numpy as np
import tvm
from tvm import te

from thomas_tune import opencl
from thomas_tune.schedules import default_gpu_schedules, split_long_sums


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=os.path.abspath(os.path.join(__file__, "../../..")))
    ap.add_argument("--llvm", action="store_true")
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location(
        "batchnorm", os.path.join(a.repo, "models", "batchnorm.py"))
    B = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(B)
    n, c, h, w = 32, 8, 28, 28
    x = te.placeholder((n, c, h, w), "float32", "x")
    if hasattr(B, "register_reducer"):  # the four-kernel form: one reduction
        B.register_reducer()
        outs = list(B.bn_stats(x))  # m2, mean, count: the last two read as mu, s0 below
    elif hasattr(B, "bn_combine"):
        p = B.bn_psum(x)
        s = B.bn_stats(x, p)
        outs = list(B.bn_combine(p, s[0], s[1], h * w))
    else:
        p = B.bn_psum(x)
        mu = B.bn_mean(p, n * h * w)
        s = B.bn_stats(x, mu)
        outs = [mu, *B.bn_sums(s[0], s[1])]
    mod = tvm.IRModule({"main": te.create_prim_func([x, *outs])})
    if a.llvm:
        target, dev = "llvm", tvm.cpu()
        mod = split_long_sums(mod)
    else:
        target, dev = opencl.target_for(0), tvm.opencl(0)
        mod = default_gpu_schedules(mod, target)
    lib = tvm.compile(mod, target=target)
    rng = np.random.default_rng(0)
    m = n * h * w
    for offset in (0.0, 1.0, 10.0, 100.0):
        err_mean = err_var = 0.0
        for _ in range(5):
            xs = (rng.standard_normal((n, c, h, w)) * rng.uniform(0.5, 2, (1, c, 1, 1))
                  + offset * rng.standard_normal((1, c, 1, 1))
                  + 0.3 * rng.standard_normal((n, c, 1, 1))).astype("float32")
            args = [tvm.runtime.tensor(xs, dev)] + [
                tvm.runtime.tensor(np.zeros(c, "float32"), dev) for _ in range(3)]
            lib["main"](*args)
            mu, s0, s1 = (v.numpy().astype("float64") for v in args[1:])
            if hasattr(B, "register_reducer"):
                mu, s0, s1 = s0, 0.0, mu
            m1 = s0 / m
            x64 = xs.astype("float64")
            mean, var = x64.mean(axis=(0, 2, 3)), x64.var(axis=(0, 2, 3))
            err_mean = max(err_mean, float(np.max(np.abs(mu + m1 - mean) / np.sqrt(var))))
            err_var = max(err_var, float(np.max(np.abs(s1 / m - m1 ** 2 - var) / var)))
        print(f"channel means {offset:5.1f} sd from 0: mean {err_mean:.1e} sd, "
              f"variance {err_var:.1e} relative")


if __name__ == "__main__":
    main()
