"""The PyTorch eager baseline: the same training step and inference timed in PyTorch."""

from __future__ import annotations

import time

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


def time_torch(model, tensors, trainable: list[str], optimizer, batch: int, infer_batch: int,
               steps: int, warmup: int = 2, seed: int = 0, use_torchvision: bool = True,
               frozen_bn: set[str] = frozenset()) -> dict:
    """PyTorch eager float32 (TF32 off) on :func:`torch_device`, with ``cudnn.benchmark`` off
    and on (CUDA; the faster is reported, both are kept): torchvision's network where
    torchvision has it (:func:`torchvision_module`; ``use_torchvision``), else the same
    architecture
    (:func:`thomas_tune.reference.torch_module`), batch, trainable set (others frozen) and
    optimizer (momentum SGD, SGD or Adam with the same settings), the BatchNorms of
    ``frozen_bn`` in ``eval()`` while the network trains (as the step being compared runs them:
    ``TrainingGraph.frozen_bn``; frozen parameters need no gradient, so autograd records
    nothing of the frozen part). ms per training step (forward,
    cross-entropy, backward, optimizer step) and per inference pass (``eval()``, no grad):
    medians over ``steps`` runs on fresh random batches, synchronised. On CUDA,
    ``device_peak_bytes`` is ``torch.cuda.max_memory_allocated`` over the training steps (the
    network, its gradients, the optimizer state and the step's activations; None on the CPU).
    Raises RuntimeError when torch is not installed."""
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

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step():
        x = torch.randn(model.input_shape(batch), generator=gen).to(dev)
        y = torch.randint(0, model.num_classes, (batch,), generator=gen).to(dev)
        sync()
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()
        return time.perf_counter() - t0

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    net.train()
    if impl == "torchvision":
        for name, mod in net.named_modules():
            if name in frozen_bn:
                mod.eval()
    else:
        net.frozen_bn = set(frozen_bn)
    by_setting = {}
    # cudnn.benchmark picks convolution algorithms by timing them; which setting is faster
    # depends on the network: both are timed and the faster one is reported
    for bench_algos in ((False, True) if dev.type == "cuda" else (False,)):
        torch.backends.cudnn.benchmark = bench_algos
        for _ in range(warmup):
            step()
        by_setting[bench_algos] = [step() for _ in range(steps)]
    faster = min(by_setting, key=lambda k: np.median(by_setting[k]))
    torch.backends.cudnn.benchmark = faster
    times = by_setting[faster]
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
    net.eval()
    itimes = []
    with torch.no_grad():
        for i in range(warmup + steps):
            x = torch.randn(model.input_shape(infer_batch), generator=gen).to(dev)
            sync()
            t0 = time.perf_counter()
            net(x)
            sync()
            if i >= warmup:
                itimes.append(time.perf_counter() - t0)
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    return {"train_ms": float(np.median(times)) * 1e3, "infer_ms": float(np.median(itimes)) * 1e3,
            "batch": batch, "infer_batch": infer_batch, "launches_per_step": None,
            "device_peak_bytes": peak,
            "device": f"torch {torch.__version__} {dev_name} ({name}), {impl}",
            "implementation": impl,
            "cudnn_benchmark": faster if dev.type == "cuda" else None,
            "train_ms_by_cudnn_benchmark": {str(k): float(np.median(v)) * 1e3
                                            for k, v in by_setting.items()}}
