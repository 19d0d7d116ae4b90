"""LTV-capable subclasses of vLLM's own model classes.

Each wrapper is the stock class plus one change where the hidden states meet the LM head:
every row that reaches `compute_logits` (sampled tokens, prompt-logprob rows, speculative
rows) is shifted, h ← h + U (Vᵀ h) for a hidden-space vector; a logit-space vector adds
U (Vᵀ h) to the logits instead. The vector file is named by the HF config attribute
`ltv_task_vector` (set through `hf_overrides`, see `ltv_vllm.serve.engine_kwargs`).

Tensor parallelism: hidden states are replicated on every rank, so every rank applies the same
shift before its vocab shard of the LM head — no communication is added. A logit-space delta
is added once, to the gathered logits.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from ..vector import TaskVector, load_task_vector

CONFIG_KEY = "ltv_task_vector"


class LTVMixin:
    """Shared by every wrapper; expects the host class's `compute_logits` and `config`."""

    _ltv: TaskVector | None
    _ltv_cast: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None

    def _ltv_init(self, config: object) -> None:
        path = getattr(config, CONFIG_KEY, None)
        self._ltv = load_task_vector(path) if path else None
        self._ltv_cast = None
        if self._ltv is not None:
            d = int(config.hidden_size)
            if self._ltv.V.shape[0] != d:
                raise ValueError(
                    f"task vector {path} is for hidden size {self._ltv.V.shape[0]}, model has {d}"
                )

    def _ltv_factors(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        # One cast to the engine's device/dtype, on first use (vLLM may build the module on
        # the meta device and move it; the hidden states tell us where we really run).
        cast = self._ltv_cast
        if cast is None or cast[0].device != h.device or cast[0].dtype != h.dtype:
            tv = self._ltv
            assert tv is not None
            bias = tv.bias.to(h.device, h.dtype) if tv.bias is not None else None
            cast = (tv.V.to(h.device, h.dtype), tv.U.to(h.device, h.dtype), bias)
            self._ltv_cast = cast
        return cast

    def _ltv_delta(self, h: torch.Tensor) -> torch.Tensor:
        V, U, bias = self._ltv_factors(h)
        out = (h @ V) @ U.T  # (rows, d_out): rank-r, never a dense d×d
        return out + bias if bias is not None else out

    def _ltv_hidden(self, h: torch.Tensor) -> torch.Tensor:
        if self._ltv is None or self._ltv.kind != "hidden" or h.shape[0] == 0:
            return h
        return h + self._ltv_delta(h)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(self._ltv_hidden(hidden_states))  # type: ignore[misc]
        if logits is not None and self._ltv is not None and self._ltv.kind == "logit":
            delta = self._ltv_delta(hidden_states)
            logits[..., : delta.shape[-1]] += delta.to(logits.dtype)
        return logits



class LTVLocalMixin(LTVMixin):
    """For hosts with vocab-local logits/argmax (vLLM's LocalArgmaxMixin): shift there too."""

    def compute_logits_local(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._ltv is not None and self._ltv.kind == "logit":
            raise NotImplementedError("logit-space vectors need gathered logits")
        return super().compute_logits_local(self._ltv_hidden(hidden_states))  # type: ignore[misc]

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._ltv is not None and self._ltv.kind == "logit":
            raise NotImplementedError("logit-space vectors need gathered logits")
        return super().get_top_tokens(self._ltv_hidden(hidden_states))  # type: ignore[misc]


class LTVLlamaForCausalLM(LTVLocalMixin, LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._ltv_init(vllm_config.model_config.hf_config)


class LTVMistralForCausalLM(LTVLocalMixin, MistralForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._ltv_init(vllm_config.model_config.hf_config)


class LTVQwen2ForCausalLM(LTVMixin, Qwen2ForCausalLM):
    # Stock Qwen2 does not declare its LM head as a LoRA target; multi-task serving carries
    # task vectors as lm_head LoRAs, so declare it (as Llama does).
    embedding_modules: ClassVar[dict[str, str]] = {"lm_head": "output_embeddings"}

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._ltv_init(vllm_config.model_config.hf_config)


class LTVQwen3ForCausalLM(LTVLocalMixin, Qwen3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._ltv_init(vllm_config.model_config.hf_config)
