"""The PyTorch eager baseline: the same training step and inference timed in PyTorch."""

from __future__ import annotations

import contextlib
import functools

import numpy as np


def torch_device() -> str | None:
    """``cuda`` when PyTorch sees a CUDA device, ``cpu`` when PyTorch is installed without one,
    None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return "cuda" if torch.cuda.is_available() else "cpu"


def torchvision_module(model, tensors):
    """torchvision's own network of ``model`` (MobileNetV2 and AlexNet) with its weights, in
    ``eval()`` mode, or None where torchvision is not installed or has no such network (the
    model's parameter names are torchvision's: the state dict loads as it is)."""
    try:
        import torch
        import torchvision
    except ImportError:
        return None
    if model.arch == "mobilenet_v2":
        net = torchvision.models.mobilenet_v2(num_classes=model.num_classes,
                                              width_mult=model.width)
    elif model.arch == "alexnet" and model.width == 1.0:
        net = torchvision.models.alexnet(num_classes=model.num_classes)
    else:
        return None
    state = {k: torch.tensor(np.asarray(v, "float32")) for k, v in tensors.items()}
    missing, unexpected = net.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("num_batches_tracked") for k in missing):
        return None
    return net.eval()


def torch_step(model, tensors, trainable: list[str], optimizer, batch: int, infer_batch: int,
               seed: int = 0, use_torchvision: bool = True,
               frozen_bn: set[str] = frozenset(), compiled: bool = False) -> dict:
    """PyTorch's side of a bench, set up: float32 (TF32 off) on :func:`torch_device`,
    torchvision's network where torchvision has it (:func:`torchvision_module`;
    ``use_torchvision``), else the same architecture (:func:`thomas_tune.reference.
    torch_module`), the same trainable set (the others frozen: no gradient, so autograd records
    nothing of the frozen part) and optimizer (momentum SGD, SGD or Adam with the same
    settings), the BatchNorms of ``frozen_bn`` in ``eval()`` while the network trains (as the
    step being compared runs them: ``TrainingGraph.frozen_bn``). ``compiled``: the forward
    with its cross-entropy (and so, through AOTAutograd, its backward), the inference forward
    and the optimizer step each wrapped in ``torch.compile`` (default mode, inductor); each
    compiles at its first call (:func:`thomas_tune.benchmark.compiled.compiled_side` makes
    those calls before timing). Returns a dict: ``torch``,
    ``dev``, ``net``, ``impl`` (which network), ``step(x, y)`` (forward, cross-entropy,
    backward, optimizer step), ``infer(x)`` (a forward without grad: in inference form after
    ``net.eval()``), ``training_mode()`` (back to the training step's modes: the network in
    ``train()``, the BatchNorms of ``frozen_bn`` in ``eval()``), ``new_batch()`` /
    ``new_images()`` (fresh random float32 images and integer labels of ``seed``'s
    generator, on the device), ``loss_and_grads(x, y)`` (the step without its optimizer
    update: the loss, float, and the gradients of the trainable parameters, name -> float64
    numpy array), ``no_dropout()`` (a context in which dropout is off while the network
    trains, as the step checks run it). Raises RuntimeError when torch is not installed."""
    dev_name = torch_device()
    if dev_name is None:
        raise RuntimeError("torch is not installed")
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(seed)
    dev = torch.device(dev_name)
    net, impl = _torch_network(model, tensors, dev, use_torchvision)
    train = set(trainable)
    opt = _torch_optimizer(torch, net, train, optimizer)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    training_mode = functools.partial(_training_mode, net, impl, frozen_bn)

    def loss_of(x, y):
        return torch.nn.functional.cross_entropy(net(x), y)

    forward, opt_step = net, opt.step
    if compiled:
        loss_of, forward, opt_step = (torch.compile(loss_of), torch.compile(net),
                                      torch.compile(opt.step))

    def step(x, y):
        loss = loss_of(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt_step()

    def infer(x):
        with torch.no_grad():
            forward(x)

    def loss_and_grads(x, y):
        loss = loss_of(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        return float(loss.detach()), {n: p.grad.detach().cpu().numpy().astype("float64")
                                      for n, p in net.named_parameters() if n in train}

    no_dropout = functools.partial(_no_dropout, torch, net, impl, model)

    def new_images(n=infer_batch):
        return torch.randn(model.input_shape(n), generator=gen).to(dev)

    def new_batch():
        return (new_images(batch),
                torch.randint(0, model.num_classes, (batch,), generator=gen).to(dev))

    training_mode()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return {"torch": torch, "dev": dev, "net": net, "impl": impl, "step": step,
            "infer": infer, "new_batch": new_batch, "new_images": new_images,
            "training_mode": training_mode, "loss_and_grads": loss_and_grads,
            "no_dropout": no_dropout, "compiled": compiled}


def _torch_network(model, tensors: dict, dev, use_torchvision: bool):
    """``model`` with ``tensors`` as a PyTorch network on ``dev``: torchvision's where it has
    it (and ``use_torchvision``), else :func:`thomas_tune.reference.torch_module`. Returns the
    network and which it is ("torchvision" or "thomas_tune.reference")."""
    from ..reference import torch_module
    net = torchvision_module(model, tensors) if use_torchvision else None
    impl = "torchvision" if net is not None else "thomas_tune.reference"
    return (net if net is not None else torch_module(model, tensors)).to(dev), impl


def _torch_optimizer(torch, net, train: set[str], optimizer):
    """PyTorch's optimizer of ``optimizer`` (a
    :class:`thomas_tune.training_graph.graph.OptimizerConfig`: Adam, else SGD with its momentum for
    ``momentum_sgd``, 0 for plain SGD; the same learning rate, betas, eps and weight decay) over the
    parameters of ``net`` named in ``train``; the others are frozen (``requires_grad`` off, so
    autograd records nothing of them)."""
    params = []
    for name, p in net.named_parameters():
        p.requires_grad_(name in train)
        if name in train:
            params.append(p)
    if optimizer.name == "adam":
        return torch.optim.Adam(params, lr=optimizer.lr, betas=tuple(optimizer.betas),
                                eps=optimizer.eps, weight_decay=optimizer.weight_decay)
    return torch.optim.SGD(params, lr=optimizer.lr, weight_decay=optimizer.weight_decay,
                           momentum=optimizer.momentum if optimizer.name == "momentum_sgd"
                           else 0.0)


def _training_mode(net, impl: str, frozen_bn) -> None:
    """Put ``net`` in the training step's modes: ``train()``, with the BatchNorms named in
    ``frozen_bn`` in ``eval()`` (torchvision's modules; the reference network takes the set)."""
    net.train()
    if impl == "torchvision":
        for name, mod in net.named_modules():
            if name in frozen_bn:
                mod.eval()
    else:
        net.frozen_bn = set(frozen_bn)


@contextlib.contextmanager
def _no_dropout(torch, net, impl: str, model):
    """A context in which ``net``'s dropout is off while it trains: torchvision's Dropout
    modules with p > 0 in ``eval()``, or the reference network's ``dropout`` flag (where
    ``model`` has dropout masks). Only what draws masks is switched: a switch makes a
    compiled step compile again."""
    from ..models import spec

    def set_dropout(m, on: bool):
        if impl == "torchvision":
            m.train(on)
        else:
            m.dropout = on

    if impl == "torchvision":
        drops = [m for m in net.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    else:
        drops = [net] if spec(model).masks else []
    for m in drops:
        set_dropout(m, False)
    try:
        yield
    finally:
        for m in drops:
            set_dropout(m, True)


def torch_description(side) -> dict:
    """What a :class:`~thomas_tune.benchmark.timing.TorchSide` ran: ``device`` (torch version,
    device and its name, network, torch.compile where compiled), ``implementation``,
    ``cudnn_benchmark`` (None on the CPU)."""
    torch, dev = side.torch, side.dev
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    how = ", torch.compile (inductor)" if getattr(side, "compiled", False) else ""
    return {"device": f"torch {torch.__version__} {dev.type} ({name}), {side.impl}{how}",
            "implementation": side.impl,
            "cudnn_benchmark": getattr(side, "cudnn_benchmark", None)}
