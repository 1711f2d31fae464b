"""PyTorch references of the models: the :class:`models.layers.Graph` API implemented with
torch operators, and a ``torch.nn.Module`` with torchvision's parameter names.

Used by the tests (float64 references, ONNX files written by PyTorch's exporter) and by the
experiments (the desktop-trained network). Needs ``torch`` (the ``test`` or ``bench`` extra).
"""

from __future__ import annotations

import contextlib

import numpy as np

from .models import spec


class TorchGraph:
    """The :class:`models.layers.Graph` API implemented with PyTorch, as reference.

    ``params``/``states``: name -> torch tensor (float64 for numeric references, float32 for
    desktop training); new running statistics land in ``new_states``. Dropout multiplies by
    ``masks[name + ".mask"]`` when given, else draws with ``torch.nn.functional.dropout``.
    ``frozen_bn``: in training, BatchNorm in its inference form (running statistics used and
    not updated), as ``BatchNorm2d.eval()`` in a network that is otherwise in ``train()``:
    True for every BatchNorm, or a set of BatchNorm names. ``dropout``: False makes dropout the
    identity in training too (the step checks' setting, masks of ones).
    """

    def __init__(self, params, states, masks, training, frozen_bn=False, dropout=True):
        import torch
        self.torch = torch
        self.F = torch.nn.functional
        self.p, self.s, self.masks, self.training = params, states, masks, training
        self.drop = dropout
        named = isinstance(frozen_bn, (set, frozenset, list, tuple))
        self.bn_training = training and (named or not frozen_bn)
        self.frozen_bn = set(frozen_bn) if named else set()
        self.new_states = {}
        #: layer name -> values per channel each training-form BatchNorm normalised (N*H*W)
        self.bn_values = {}

    @contextlib.contextmanager
    def block(self, name):
        yield

    def conv2d(self, name, x, out_channels, kernel, stride=1, padding=0, groups=1, bias=False):
        b = self.p[f"{name}.bias"] if bias else None
        return self.F.conv2d(x, self.p[f"{name}.weight"], b, stride, padding, 1, groups)

    def batch_norm(self, name, x, eps=1e-5, momentum=0.1, act=None):
        """``F.batch_norm`` (training or inference form), then ``act`` (None, relu, relu6)."""
        if self.bn_training and name not in self.frozen_bn:
            self.bn_values[name] = x.shape[0] * x.shape[2] * x.shape[3]
        rm = self.s[f"{name}.running_mean"].clone()
        rv = self.s[f"{name}.running_var"].clone()
        y = self.F.batch_norm(x, rm, rv, self.p[f"{name}.weight"], self.p[f"{name}.bias"],
                              self.bn_training and name not in self.frozen_bn, momentum, eps)
        if self.training:  # (unchanged where in inference form)
            self.new_states[f"{name}.running_mean"] = rm
            self.new_states[f"{name}.running_var"] = rv
        return self._activate(y, act)

    def _activate(self, x, act):
        """``x`` after ``act``: None (identity), ``"relu"`` or ``"relu6"``."""
        return x if act is None else {"relu": self.relu, "relu6": self.relu6}[act](x)

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

    def residual(self, a, b):
        return a + b

    def linear(self, name, x, out_features):
        return self.F.linear(x, self.p[f"{name}.weight"], self.p[f"{name}.bias"])

    def dropout(self, name, x, p):
        if not self.training or p == 0.0 or not self.drop:
            return x
        if f"{name}.mask" in self.masks:
            return x * self.masks[f"{name}.mask"]
        return self.F.dropout(x, p, training=True)


def torch_module(model, tensors, dtype="float32"):
    """A ``torch.nn.Module`` with the model's parameters and BatchNorm statistics (``dtype``:
    float32, or float64 for references) under their torchvision names (nested sub-modules),
    whose forward is the model's in the module's mode (``train()``: batch statistics, running
    statistics updated as PyTorch does; ``eval()``). Setting the module's ``frozen_bn`` to True
    keeps every BatchNorm in its inference form while the module trains (as calling
    ``eval()`` on each ``BatchNorm2d`` of a torchvision network does); setting its ``dropout``
    to False turns dropout off while it trains (as ``eval()`` on each ``Dropout`` does). Used
    to write ONNX files as users export them and to train on the desktop."""
    import torch

    s = spec(model)
    pnames, snames = [p.name for p in s.params], [q.name for q in s.states]

    class Net(torch.nn.Module):
        def forward(self, x):
            p = {n: self.get_parameter(n) for n in pnames}
            st = {n: self.get_buffer(n) for n in snames}
            g = TorchGraph(p, st, {}, self.training, self.frozen_bn, self.dropout)
            out = model.forward(g, x)
            if self.training:
                with torch.no_grad():
                    for n, v in g.new_states.items():
                        st[n].copy_(v)
            return out

    net = Net()
    net.frozen_bn, net.dropout = False, True
    for n in pnames + snames:
        *path, leaf = n.split(".")
        mod = net
        for part in path:
            if not isinstance(getattr(mod, part, None), torch.nn.Module):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        t = torch.tensor(np.asarray(tensors[n], dtype=dtype))
        if n in pnames:
            mod.register_parameter(leaf, torch.nn.Parameter(t))
        else:
            mod.register_buffer(leaf, t)
    return net.eval()


def torch_pretrain(model, data, steps: int, seed: int, batch: int = 16,
                   lr: float = 0.02) -> dict[str, np.ndarray]:
    """Train ``model`` from its initialisation (``init_params(model, seed)``) in PyTorch
    float32 on ``data`` (a :class:`thomas_tune.data.Dataset`): ``steps`` steps of ``batch``
    images, momentum SGD 0.9, learning rate ``lr`` decayed to 0 on a cosine (so that the
    BatchNorm statistics settle on the final weights, as in a finished training). Returns
    every parameter and BatchNorm statistic under its torchvision name, float32."""
    import torch

    from .models import init_params
    torch.manual_seed(seed)
    net = torch_module(model, init_params(model, seed=seed)).train()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    batches = data.batches(batch, np.random.default_rng(seed))
    for _ in range(steps):
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return {k: v.detach().numpy().copy()
            for k, v in list(net.named_parameters()) + list(net.named_buffers())}
