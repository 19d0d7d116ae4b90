"""Where each tensor would live on a GPU, tracked on the CPU (`Placement`).

Every test runs on the CPU, where the model's device and the host are the same place, so a
tensor kept on the host and later combined with the model's activations — FV's head patch
did this, and failed on CUDA ("Expected all tensors to be on the same device") — passes
here. `Placement` is a torch function mode that tags each tensor "device" (the model's) or
"host", as CUDA would place it: the model's parameters and buffers are on the device; a
factory without `device=` (or with `device="cpu"`), `.cpu()`, `.numpy()` inputs and
tokenizer outputs are on the host; `.to(x.device)`, `*_like`, `new_*` follow their argument;
any other op's result is on the device when one of its inputs is. The model's `.device` reads
as `cpu:0` under the mode (a real torch device every op accepts), so code that asks a tensor
or the model for its device and places tensors there is followed exactly.

An op that takes a device tensor and a host tensor of one or more dimensions raises
`PlacementError` — CUDA's rule, with its two exceptions: a 0-dim host tensor is a scalar,
index tensors of `x[idx]` / `x[idx] = v` may stay on the host (`copy_` and `.to` move
between the two by design, and autograd carries a gradient back across a `.to`).
`.numpy()` of a device tensor is refused too (CUDA refuses it).

`.to` also copies as CUDA does: a host tensor sent to the device is a new tensor (so a
parameter moved once never sees its optimizer's updates, as on a GPU), a device tensor sent
there again is itself, and one brought to the host is a copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily
from torch.utils.weak import WeakIdKeyDictionary

DEVICE = torch.device("cpu", 0)  # the model's device, as the code under the mode sees it
HOST = torch.device("cpu")


class PlacementError(AssertionError):
    """A device tensor and a host tensor met in one op (CUDA would refuse it)."""


_T = torch.Tensor
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor,
             torch.as_tensor, torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye,
             torch.linspace, torch.logspace, torch.empty_strided, torch.scalar_tensor,
             torch.from_numpy, torch.tril_indices, torch.triu_indices, torch.normal}
LIKE = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
        torch.randn_like, torch.randint_like}
NEW = {_T.new_zeros, _T.new_ones, _T.new_empty, _T.new_full, _T.new_tensor}
DEVICE_GET = _T.device.__get__
GRAD_GET = _T.grad.__get__


def _is_device(where: Any) -> bool:
    d = torch.device(where)
    return d.type != "cpu" or d.index is not None


def _to_target(args: tuple, kwargs: dict) -> Any:
    """Where `Tensor.to(...)` sends its tensor: a device, a tensor, or None (dtype only)."""
    for a in args[1:]:
        if isinstance(a, (str, torch.device, torch.Tensor)):
            return a
    return kwargs.get("device")


def _on_host(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`Tensor.to`'s arguments with its device target replaced by the host's."""
    if kwargs.get("device") is not None:
        return args, {**kwargs, "device": HOST}
    return tuple(HOST if isinstance(a, (str, torch.device)) else a for a in args), kwargs


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class Placement(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self._on_device = WeakIdKeyDictionary()
        self.checked = 0  # ops that met at least one device tensor (the check ran)
        self.models = 0   # models put on the device

    def put(self, model: nn.Module) -> nn.Module:
        """`model` is on the device: its parameters and buffers."""
        for t in [*model.parameters(), *model.buffers()]:
            self._on_device[t] = True
        self.models += 1
        return model

    def __enter__(self):
        # `nn.Parameter(t)` is made without a torch function: it takes t's place by hand
        made, mode = nn.Parameter.__new__, self

        def new(cls, data=None, requires_grad=True):
            p = made(cls, data, requires_grad)
            if data is not None and mode.on_device(data):
                mode._on_device[p] = True
            return p

        self._made = made
        nn.Parameter.__new__ = staticmethod(new)
        return super().__enter__()

    def __exit__(self, *exc):
        nn.Parameter.__new__ = staticmethod(self._made)
        return super().__exit__(*exc)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The mode off for the block: transformers builds a model under its own device
        mode (meta-device init), which must see no other mode, or its rotary buffers come
        out unfilled."""
        with _pop_mode_temporarily() as top:
            if top is not self:
                raise RuntimeError("Placement.paused: another torch function mode is on top")
            yield

    def on_device(self, t: torch.Tensor) -> bool:
        return self._on_device.get(t, False)

    def _mark(self, out: Any, on: bool) -> None:
        for t in _tensors(out):
            if on:
                self._on_device[t] = True
            else:
                self._on_device.pop(t, None)

    def _where(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether func's result is on the device; raises where CUDA would refuse the op."""
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        if func is _T.cpu or func is _T.numpy or func is _T.__array__:
            if func is not _T.cpu and self.on_device(args[0]):
                raise PlacementError(f"{name} of a tensor on the model's device")
            return False
        if func is _T.cuda:
            return True
        if func is _T.to:
            target = _to_target(args, kwargs)
            if isinstance(target, torch.Tensor):
                return self.on_device(target)
            return self.on_device(args[0]) if target is None else _is_device(target)
        if func is _T.copy_:
            return self.on_device(args[0])
        if func in FACTORIES:
            return "device" in kwargs and kwargs["device"] is not None \
                and _is_device(kwargs["device"])
        if func in LIKE or func in NEW:
            if kwargs.get("device") is not None:
                return _is_device(kwargs["device"])
            return self.on_device(args[0])
        if func is _T.__getitem__:
            return self.on_device(args[0])
        if func is _T.__setitem__:
            self._check(name, [args[0], *_tensors(args[2:])])
            return self.on_device(args[0])
        return self._check(name, list(_tensors((args, kwargs))))

    def _check(self, name: str, tensors: list[torch.Tensor]) -> bool:
        dev = [t for t in tensors if self.on_device(t)]
        if not dev:
            return False
        self.checked += 1
        host = [t for t in tensors if not self.on_device(t) and t.dim() > 0]
        if host:
            raise PlacementError(
                f"{name}: a tensor on the model's device {tuple(dev[0].shape)} meets a host "
                f"tensor {tuple(host[0].shape)} (CUDA refuses it)")
        return True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == DEVICE_GET:
            return DEVICE if self.on_device(args[0]) else HOST
        if func == GRAD_GET:
            out = func(*args, **kwargs)
            if out is not None:
                self._mark(out, self.on_device(args[0]))
            return out
        if func is torch.autograd.grad:  # each gradient lives where its input does
            out = func(*args, **kwargs)
            inputs = kwargs.get("inputs", args[1] if len(args) > 1 else ())
            for g, x in zip(out, [inputs] if isinstance(inputs, torch.Tensor) else inputs,
                            strict=True):
                self._mark(g, self.on_device(x))
            return out
        on = self._where(func, args, kwargs)
        if func is _T.to and on and self.on_device(args[0]) \
                and not isinstance(_to_target(args, kwargs), torch.Tensor):
            # already on the device: CUDA returns the tensor itself, as the host's own device
            # does here (`cpu:0` would copy it, and a moved copy never sees in-place updates)
            args, kwargs = _on_host(args, kwargs)
        out = func(*args, **kwargs)
        if func is _T.__setitem__ or func is _T.copy_:
            return out
        if args and out is args[0] and on != self.on_device(out):
            # `.cpu()` / `.to(...)` of a tensor already on the host returns it; from the
            # device CUDA copies, so it gets a copy of its own to carry its own place
            out = out.clone()
        self._mark(out, on)
        return out
