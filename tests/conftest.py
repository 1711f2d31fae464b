"""Shared fixtures: small models, float64 compiles, a torch mirror of models.layers.Graph."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest


class TorchGraph:
    """The :class:`models.layers.Graph` API implemented with PyTorch (float64), as reference.

    ``params``/``states``: name -> torch tensor; new running statistics land in ``new_states``.
    """

    def __init__(self, params, states, masks, training):
        import torch
        self.torch = torch
        self.F = torch.nn.functional
        self.p, self.s, self.masks, self.training = params, states, masks, training
        self.new_states = {}

    @contextlib.contextmanager
    def block(self, name):
        yield

    def conv2d(self, name, x, out_channels, kernel, stride=1, padding=0, groups=1, bias=False):
        b = self.p[f"{name}.bias"] if bias else None
        return self.F.conv2d(x, self.p[f"{name}.weight"], b, stride, padding, 1, groups)

    def batch_norm(self, name, x, eps=1e-5, momentum=0.1):
        rm = self.s[f"{name}.running_mean"].clone()
        rv = self.s[f"{name}.running_var"].clone()
        y = self.F.batch_norm(x, rm, rv, self.p[f"{name}.weight"], self.p[f"{name}.bias"],
                              self.training, momentum, eps)
        if self.training:
            self.new_states[f"{name}.running_mean"] = rm
            self.new_states[f"{name}.running_var"] = rv
        return y

    def relu(self, x):
        return self.F.relu(x)

    def relu6(self, x):
        return self.F.relu6(x)

    def max_pool2d(self, x, kernel, stride, padding=0):
        return self.F.max_pool2d(x, kernel, stride, padding)

    def adaptive_avg_pool2d(self, x, output_size):
        return self.F.adaptive_avg_pool2d(x, output_size)

    def flatten(self, x):
        return self.torch.flatten(x, 1)

    def add(self, a, b):
        return a + b

    def linear(self, name, x, out_features):
        return self.F.linear(x, self.p[f"{name}.weight"], self.p[f"{name}.bias"])

    def dropout(self, name, x, p):
        if not self.training or p == 0.0:
            return x
        return x * self.masks[f"{name}.mask"]


def random_tensors(model, rng):
    """Parameters from the model's initialisers plus non-trivial BN statistics and biases."""
    from thomas_tune.models import init_params
    t = init_params(model, seed=int(rng.integers(1 << 30)))
    for k in t:
        if k.endswith("running_mean") or k.endswith(".bias"):
            t[k] = rng.normal(0, 0.1, t[k].shape).astype("float32")
        elif k.endswith("running_var"):
            t[k] = rng.uniform(0.5, 1.5, t[k].shape).astype("float32")
        elif k.endswith(".weight") and t[k].ndim == 1:
            t[k] = rng.uniform(0.5, 1.5, t[k].shape).astype("float32")
    return t


@pytest.fixture
def rng():
    """A fresh generator per test, seeded from the OS: inputs differ from run to run."""
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


SMALL = {
    "mobilenet_v2": dict(num_classes=5, resolution=64, width=0.35),
    "mobilenet_v1": dict(num_classes=5, resolution=64, width=0.25),
    "alexnet": dict(num_classes=5, resolution=67, width=0.1),
}


def torch_module(model, tensors):
    """A ``torch.nn.Module`` with the model's parameters and BatchNorm statistics under their
    torchvision names (nested sub-modules), whose eval-mode forward is the model's; used to
    write ONNX files as users export them from PyTorch."""
    import torch
    from thomas_tune.models import spec

    s = spec(model)
    pnames, snames = [p.name for p in s.params], [q.name for q in s.states]

    class Net(torch.nn.Module):
        def forward(self, x):
            p = {n: self.get_parameter(n) for n in pnames}
            st = {n: self.get_buffer(n) for n in snames}
            return model.forward(TorchGraph(p, st, {}, False), x)

    net = Net()
    for n in pnames + snames:
        *path, leaf = n.split(".")
        mod = net
        for part in path:
            if not isinstance(getattr(mod, part, None), torch.nn.Module):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        t = torch.tensor(np.asarray(tensors[n], dtype="float32"))
        if n in pnames:
            mod.register_parameter(leaf, torch.nn.Parameter(t))
        else:
            mod.register_buffer(leaf, t)
    return net.eval()
