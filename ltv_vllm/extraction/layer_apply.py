"""Reference application of a layer task in transformers: the ground truth a server's layer
shift is tested against, and how `evaluate` scores a layer task.

`layer_task_applied(model, task)` hooks the output of each decoder block the task names for
the duration of a `with` block: at the positions of the task's policy (`core.layer_task`),
h_ℓ ← h_ℓ + scale · (U_ℓ (V_ℓᵀ h_ℓ) + b_ℓ), in float32, the sum rounded back to the model's
dtype. The hooks always remove themselves; the model is never modified.

Which rows a forward pass holds is read from its shape, as generation feeds them: a pass of
more than one token is a prompt (left-padded: its last position is every row's last prompt
token, so its row produces generated token 1); a one-token pass after a prompt in the same
block is a decode step (the fed-back token i produces token i + 1). A one-token pass before
any prompt is a one-token prompt. One sequence batch at a time per block: a second prompt
pass starts the count again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from ltv_vllm.core.layer_task import LayerPolicy, LayerTask
from ltv_vllm.core.vector import VectorError, model_identity
from ltv_vllm.extraction.capture import base_model


class _Steps:
    """The token-producing step of the rows in the current forward pass (module docstring)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.step = 0  # 1: a prompt pass (its last row); i + 1: decode of generated token i

    def advance(self, tokens: int) -> None:
        if tokens > 1 or not self.prompt_seen:
            self.prompt_seen, self.step = True, 1
        else:
            self.step += 1


@contextmanager
def layer_task_applied(model: nn.Module, task: LayerTask, *, scale: float = 1.0,
                       policy: LayerPolicy | None = None,
                       check: bool = True) -> Iterator[nn.Module]:
    """`task` applied to `model`'s decoder blocks for the block (module docstring); `policy`
    overrides the task's own, `scale` multiplies its shift. `check`: refuse a model the task
    was not made for (its width, depth and LM head), in one line."""
    layers = getattr(base_model(model), "layers", None)  # type: ignore[arg-type]
    if not isinstance(layers, nn.ModuleList):
        raise VectorError(f"{type(model).__name__}: no decoder layer list to shift (layer "
                          "tasks support Llama-style models)")
    if check:
        task.check_model(model_identity(model))
    task.check_fits(task.model.hidden_size, len(layers), f"layer task {task.task_name!r}")
    policy = policy or task.policy
    param = next(model.parameters())
    cast = task.to(param.device, torch.float32)
    steps = _Steps()
    first = task.layers[0]

    def shift(ell: int, x: torch.Tensor) -> torch.Tensor:
        if ell == first:
            steps.advance(x.shape[1])
        prompt_pass = steps.step == 1
        if prompt_pass and policy.prompt:
            rows = slice(None)  # every prompt position
        elif policy.shifts_step(steps.step):
            rows = slice(-1, None)  # the pass's last position: its token-producing row
        else:
            return x
        out = x.clone()
        h = x[:, rows].float()
        delta = cast.delta(ell, h.reshape(-1, h.shape[-1]), scale).view_as(h)
        out[:, rows] = (h + delta).to(x.dtype)
        return out

    with ExitStack() as stack:
        for ell in task.layers:
            handle = layers[ell].register_forward_hook(
                lambda _m, _a, out, ell=ell: (shift(ell, out[0]), *out[1:])
                if isinstance(out, tuple) else shift(ell, out))
            stack.callback(handle.remove)
        yield model
