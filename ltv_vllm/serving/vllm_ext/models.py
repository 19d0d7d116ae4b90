"""LTV-capable subclasses of vLLM's own model classes.

Each wrapper is the stock class plus one change where the hidden states meet the LM head:
every row that reaches `compute_logits` (sampled tokens, prompt-logprob rows, speculative
rows) is shifted, h ← h + U (Vᵀ h) for a hidden-space vector; a logit-space vector adds
U (Vᵀ h) to the logits instead. The vector file is named by the HF config attribute
`ltv_task_vector` (set through `hf_overrides`, see `ltv_vllm.serving.serve.engine_kwargs`).

Tensor parallelism: hidden states are replicated on every rank, so every rank applies the same
shift before its vocab shard of the LM head — no communication is added. A logit-space delta
is added once, to the gathered logits; on vLLM's vocab-local path (`compute_logits_local`)
each rank adds the rows of U for its own vocab shard.

Pipeline parallelism: only the last stage holds the LM head (earlier ones hold vLLM's
`PPMissingLayer` and never compute logits), so only it shifts or folds.
"""

from __future__ import annotations

import copy
from typing import ClassVar

import torch
from torch import nn
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.utils import PPMissingLayer

from ltv_vllm.core.vector import TaskVector, VectorError, load_task_vector
from ltv_vllm.serving.vllm_ext.steps import take_step_mask

CONFIG_KEY = "ltv_task_vector"
FOLD_KEY = "ltv_fold"


class LTVMixin:
    """Shared by every wrapper; expects the host class's `compute_logits` and `config`."""

    _ltv: TaskVector | None
    _ltv_cast: TaskVector | None  # _ltv on the engine's device, float32

    def _ltv_init(self, config: object) -> None:
        path = getattr(config, CONFIG_KEY, None)
        self._ltv = load_task_vector(path) if path else None
        self._ltv_cast = None
        self._ltv_fold = bool(getattr(config, FOLD_KEY, False)) and self._ltv is not None
        if self._ltv_fold and (self._ltv.kind != "hidden" or self._ltv.bias is not None
                               or self._ltv.map != "linear"):
            raise VectorError("only a linear hidden-space vector without a bias can be folded")
        if self._ltv is not None:
            d = int(config.hidden_size)
            if self._ltv.V.shape[0] != d:
                raise VectorError(
                    f"task vector {path} is for hidden size {self._ltv.V.shape[0]}, model has {d}"
                )
            vocab = int(config.vocab_size)
            if self._ltv.kind == "logit" and self._ltv.U.shape[0] != vocab:
                # compute_logits adds U's rows to the first columns: a mismatch would shift
                # the wrong tokens rather than fail
                raise VectorError(
                    f"logit vector {path} is for vocabulary {self._ltv.U.shape[0]}, model has "
                    f"{vocab}"
                )

    def _ltv_delta(self, h: torch.Tensor, part: slice | None = None) -> torch.Tensor:
        """U (Vᵀ h) (+ bias) in float32, only the outputs in `part` (a vocab shard for a
        logit vector).

        Always float32, whatever the engine's dtype: in bf16 an RBF map's distances
        ‖h‖² + ‖v‖² − 2h·v cancel catastrophically (at ‖h‖² ≈ 128 a bf16 step is 1, the
        size of the distances themselves), and a linear shift loses what rounding each
        product loses. The shift is ~1 % of the LM head's work (r ≪ vocab), so the cost is
        small; only its sum with h is rounded back to the engine's dtype."""
        # One cast to the engine's device, on first use (vLLM may build the module on the
        # meta device and move it; the hidden states tell us where we really run).
        cast = self._ltv_cast
        if cast is None or cast.U.device != h.device:
            assert self._ltv is not None
            cast = self._ltv_cast = self._ltv.to(h.device, torch.float32)
        return cast.delta(h.float(), part)  # (n, d_out): rank-r, never a dense d×d

    def _ltv_hidden(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self._ltv is None or self._ltv.kind != "hidden" or h.shape[0] == 0:
            return h
        delta = self._ltv_delta(h)
        if mask is not None:  # the rows whose request's step policy shifts this step
            delta = delta * mask
        return (h.float() + delta).to(h.dtype)

    def load_weights(self, weights):
        loaded = super().load_weights(weights)  # type: ignore[misc]
        if self._ltv_fold:
            self._fold_into_lm_head()
        return loaded

    def _fold_into_lm_head(self) -> None:
        """W_lm ← W_lm (I + U Vᵀ): the shift costs nothing per token afterwards.

        A head tied to the input embedding is untied first (folding must not touch the
        embeddings). Under tensor parallelism each rank folds its own vocab rows.
        """
        tv = self._ltv
        assert tv is not None
        head = self.lm_head  # type: ignore[attr-defined]
        if isinstance(head, PPMissingLayer):  # a stage before the last: no head, no logits
            self._ltv = None
            return
        embed = getattr(getattr(self, "model", None), "embed_tokens", None)
        if head is embed or head.weight is getattr(embed, "weight", None):
            head = copy.copy(head)
            head._parameters = dict(head._parameters)  # a shallow copy shares this dict
            head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
            self.lm_head = head  # type: ignore[attr-defined]
        w = head.weight.data
        f32 = tv.to(w.device, torch.float32)
        w32 = w.float()
        w.copy_((w32 + (w32 @ f32.U) @ f32.V.T).to(w.dtype))
        self._ltv = None  # nothing left to do at run time

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        # this step's per-request step policy (`steps`), taken on the main call only
        mask = (take_step_mask(hidden_states.shape[0], hidden_states.device)
                if self._ltv is not None else None)
        logits = super().compute_logits(  # type: ignore[misc]
            self._ltv_hidden(hidden_states, mask))
        if logits is not None and self._ltv is not None and self._ltv.kind == "logit":
            delta = self._ltv_delta(hidden_states)
            if mask is not None:
                delta = delta * mask
            logits[..., : delta.shape[-1]] += delta.to(logits.dtype)
        return logits



class LTVLocalMixin(LTVMixin):
    """For hosts with vocab-local logits/argmax (vLLM's LocalArgmaxMixin): shift there too.

    vLLM 0.32 calls these only on opt-in paths: `compute_logits_local` with
    --enable-batch-sharded-sampling (TP > 1, model runner V2), `get_top_tokens` for a draft
    model with speculative `use_local_argmax_reduction`. A hidden vector shifts h as usual.
    A logit vector is handled rather than opted out of: vLLM detects support with `hasattr`,
    which an inherited method cannot decline cleanly, and a missing `get_top_tokens` is an error.
    """

    def compute_logits_local(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits_local(self._ltv_hidden(hidden_states))  # type: ignore[misc]
        if self._ltv is not None and self._ltv.kind == "logit" and hidden_states.shape[0]:
            # This rank's logits are the columns [org_vocab_start, org_vocab_end) of the real
            # vocabulary, then padding: add the matching rows of U, nothing to the padding.
            shard = self.lm_head.shard_indices  # type: ignore[attr-defined]
            part = slice(shard.org_vocab_start_index, shard.org_vocab_end_index)
            logits[..., : shard.num_org_elements] += self._ltv_delta(hidden_states, part).to(
                logits.dtype)
        return logits

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._ltv is not None and self._ltv.kind == "logit":
            # The stock reduction projects through the LM head itself, past any hook of ours.
            # Argmax of the full (all-gathered on every rank) shifted logits is the same token;
            # it only gives up the communication saving, on a rare draft-model path.
            return self.compute_logits(hidden_states).argmax(dim=-1)
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
