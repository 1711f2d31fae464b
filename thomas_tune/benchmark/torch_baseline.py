"""The PyTorch eager baseline: the same training step and inference timed in PyTorch."""

from __future__ import annotations


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
               frozen_bn: set[str] = frozenset()) -> dict:
    """PyTorch's side of a bench, set up: float32 (TF32 off) on :func:`torch_device`,
    torchvision's network where torchvision has it (:func:`torchvision_module`;
    ``use_torchvision``), else the same architecture (:func:`thomas_tune.reference.
    torch_module`), the same trainable set (the others frozen: no gradient, so autograd records
    nothing of the frozen part) and optimizer (momentum SGD, SGD or Adam with the same
    settings), the BatchNorms of ``frozen_bn`` in ``eval()`` while the network trains (as the
    step being compared runs them: ``TrainingGraph.frozen_bn``). Returns a dict: ``torch``,
    ``dev``, ``net``, ``impl`` (which network), ``step(x, y)`` (forward, cross-entropy,
    backward, optimizer step), ``infer(x)`` (a forward without grad: in inference form after
    ``net.eval()``), ``training_mode()`` (back to the training step's modes: the network in
    ``train()``, the BatchNorms of ``frozen_bn`` in ``eval()``), ``new_batch()`` /
    ``new_images()`` (fresh random float32 images and integer labels of ``seed``'s
    generator, on the device). Raises RuntimeError when torch is not installed."""
    dev_name = torch_device()
    if dev_name is None:
        raise RuntimeError("torch is not installed")
    import torch
    from ..reference import torch_module
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(seed)
    dev = torch.device(dev_name)
    net = torchvision_module(model, tensors) if use_torchvision else None
    impl = "torchvision" if net is not None else "thomas_tune.reference"
    net = (net if net is not None else torch_module(model, tensors)).to(dev)
    train = set(trainable)
    params = []
    for name, p in net.named_parameters():
        p.requires_grad_(name in train)
        if name in train:
            params.append(p)
    if optimizer.name == "adam":
        opt = torch.optim.Adam(params, lr=optimizer.lr, betas=tuple(optimizer.betas),
                               eps=optimizer.eps, weight_decay=optimizer.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=optimizer.lr, weight_decay=optimizer.weight_decay,
                              momentum=optimizer.momentum if optimizer.name == "momentum_sgd"
                              else 0.0)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def training_mode():
        net.train()
        if impl == "torchvision":
            for name, mod in net.named_modules():
                if name in frozen_bn:
                    mod.eval()
        else:
            net.frozen_bn = set(frozen_bn)

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def infer(x):
        with torch.no_grad():
            net(x)

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
            "training_mode": training_mode}


def torch_description(side) -> dict:
    """What a :class:`~thomas_tune.benchmark.timing.TorchSide` ran: ``device`` (torch version,
    device and its name, network), ``implementation``, ``cudnn_benchmark`` (None on the
    CPU)."""
    torch, dev = side.torch, side.dev
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    return {"device": f"torch {torch.__version__} {dev.type} ({name}), {side.impl}",
            "implementation": side.impl,
            "cudnn_benchmark": getattr(side, "cudnn_benchmark", None)}
