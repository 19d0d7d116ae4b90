"""Work-arounds for vLLM bugs that would make a server answer silently wrong.

Applied by `register()` (the `vllm.general_plugins` entry point), so they reach every engine
process. Each one says which upstream code it corrects; docs/task-store.md ("Upstream bug")
has a minimal reproduction.

**A row without an adapter gets the last LoRA slot's adapter (CPU backend).** vLLM marks a
request without a LoRA with slot index −1 ("an index of -1 means no lora should be applied",
`PunicaWrapperBase.token_lora_indices`). The GPU kernels skip −1; the CPU backend's torch ops
(`vllm/lora/ops/torch_ops/lora_ops.py: bgmv_shrink / bgmv_expand`, called by
`PunicaWrapperCPU.add_lora_logits`) index `weights[indices]`, and `[-1]` is Python's last
slot. A slot keeps its weights after its adapter is deactivated (`LoRAModelManager.
_deactivate_adapter` only forgets the id), and `OpenAIServingModels.unload_lora_adapter` only
drops the name, so runtime add/delete churn leaves a deleted task's weights in the last slot,
and the bare model answers with that task's shift. We apply the LM-head LoRA to the rows that
have an adapter only; the rows without one are left exactly as the base model computed them.
vLLM 0.33's torch ops mask index −1 themselves (read in its source): there the patch is
redundant and changes nothing.
"""

from __future__ import annotations

from typing import Any

_MARK = "_ltv_vllm_no_adapter_rows"


def patch_cpu_lora_logits() -> bool:
    """Make `PunicaWrapperCPU.add_lora_logits` leave rows with index −1 alone; True when the
    patch is in place (idempotent). Only the CPU wrapper class changes: GPU builds, whose
    kernels already skip −1, never use it."""
    try:
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:  # a vLLM build without the CPU LoRA backend: nothing to fix
        return False
    cls = punica_cpu.PunicaWrapperCPU
    original = cls.add_lora_logits
    if getattr(original, _MARK, False):
        return True

    def add_lora_logits(self: Any, y: Any, x: Any, lora_a_stacked: Any, lora_b_stacked: Any,
                        scale: Any, *, buffer: Any = None, **kwargs: Any) -> None:
        idx = self.sampler_indices  # (rows,): a slot per sampled row, −1 = no adapter
        y2, x2 = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
        if idx.shape[0] != x2.shape[0] or bool((idx >= 0).all()):
            # every row has an adapter (or a layout we do not know): upstream's own code
            return original(self, y, x, lora_a_stacked, lora_b_stacked, scale,
                            buffer=buffer, **kwargs)
        rows = (idx >= 0).nonzero().squeeze(1)
        if rows.numel() == 0:
            return None  # no row has an adapter: the logits stay the base model's
        sub = y2[rows]  # a copy: the adapter rows' logits, updated below, written back
        shrunk = sub.new_zeros((rows.numel(), lora_b_stacked.size(-1)), dtype=_f32())
        punica_cpu.bgmv_shrink(x2[rows], lora_a_stacked, shrunk, idx[rows], scale)
        punica_cpu.bgmv_expand(shrunk, lora_b_stacked, sub, idx[rows], add_inputs=True)
        y2[rows] = sub
        return None

    setattr(add_lora_logits, _MARK, True)
    add_lora_logits.__doc__ = original.__doc__
    cls.add_lora_logits = add_lora_logits
    return True


def _f32() -> Any:
    import torch

    return torch.float32  # as upstream: the shrink buffer is float32 whatever the model dtype
