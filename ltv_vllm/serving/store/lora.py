"""A task vector as a PEFT LoRA adapter on lm_head, so vLLM's multi-LoRA machinery carries it.
Pure file work, in whichever process writes an adapter (the launcher, the API server's
store, a compile worker).

Hidden kind: logits = W_lm (h + U Vᵀ h) = W_lm h + (W_lm U)(Vᵀ h), i.e. a rank-r LoRA on the
LM head with lora_A = Vᵀ (r, d), lora_B = W_lm U (vocab, r) and alpha = r (scale 1).
Logit kind: logits = W_lm h + U Vᵀ h, so lora_B = U directly.
vLLM only accepts some ranks; the factors are padded with zero columns up to the next one,
which changes nothing numerically.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ltv_vllm.core.fileio import atomic_write
from ltv_vllm.core.vector import TaskVector, VectorError
from ltv_vllm.models.checkpoint import identity_from_dir, read_lm_head

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# How much more a served vector may move the logits than the LM head itself (Frobenius norms
# of the two logit maps): a real task vector is within a few times; 1e3 times is a broken file
MAX_GAIN = 1e3


def lora_rank(r: int) -> int:
    for allowed in VLLM_LORA_RANKS:
        if r <= allowed:
            return allowed
    raise VectorError(f"rank {r} exceeds vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


def refuse_non_lora(tv: TaskVector) -> None:
    """A constant bias (the mean-shift baseline) or a nonlinear map (kernel LTV) is not a
    low-rank linear map: no LoRA carries it."""
    tv.require_linear("carried as a LoRA (multi-task serving, a task store)")
    if tv.bias is not None:
        raise VectorError(f"task vector {tv.task_name!r} has a constant bias, which is not a "
                          "LoRA; serve it alone (fused)")


def lowrank_fro_norm(B: torch.Tensor, A: torch.Tensor) -> float:
    """‖B A‖_F for B (m, r), A (r, n) without forming the m × n product:
    ‖BA‖_F² = trace((BᵀB)(AAᵀ)), two r × r Gram matrices, in float64."""
    b, a = B.double(), A.double()
    return float(torch.trace((b.T @ b) @ (a @ a.T)).clamp_min(0).sqrt())


def check_servable(tv: TaskVector, A: torch.Tensor, B: torch.Tensor,
                   lm_head: torch.Tensor) -> None:
    """Refuse LoRA factors (A (r, d), B (vocab, r)) that would wreck every logit: values
    float32 cannot hold, or a logit map B A far larger than the LM head's own."""
    if not (bool(torch.isfinite(A).all()) and bool(torch.isfinite(B).all())):
        raise VectorError(f"task vector {tv.task_name!r} overflows float32 on this LM head")
    gain, head = lowrank_fro_norm(B, A), float(torch.linalg.vector_norm(lm_head))
    if gain > MAX_GAIN * head:
        ratio = gain / head if head > 0 else math.inf
        raise VectorError(f"task vector {tv.task_name!r} would move the logits {ratio:.1e}x "
                          f"more than the LM head itself (limit {MAX_GAIN:.0e}x): refused as "
                          "corrupt")


def lora_factors(tv: TaskVector, lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A (R, d), lora_B (vocab, R)) with R the allowed rank ≥ tv.rank; float32.
    Refuses a vector whose factors are not servable (`check_servable`)."""
    refuse_non_lora(tv)
    w = lm_head.float()
    B = w @ tv.U if tv.kind == "hidden" else tv.U  # (vocab, r)
    A = tv.V.T  # (r, d)
    check_servable(tv, A, B, w)
    pad = lora_rank(tv.rank) - tv.rank
    if pad:
        A = torch.cat([A, A.new_zeros(pad, A.shape[1])])
        B = torch.cat([B, B.new_zeros(B.shape[0], pad)], dim=1)
    return A.contiguous(), B.contiguous()


def export_lora(tv: TaskVector, model_dir: str | Path, out_dir: str | Path,
                rank: int | None = None, base_model: str | None = None) -> Path:
    """Write a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).

    rank: cut the vector to rank `rank` first (`TaskVector.truncated`, weighted by this LM
    head): vLLM's CPU LoRA kernel gathers a vocab × rank matrix per sampled row.
    base_model: the adapter's `base_model_name_or_path` (default: the vector's model name);
    vLLM's filesystem LoRA resolver requires the engine's `--model` there.
    """
    from safetensors.torch import save_file

    tv.check_model(identity_from_dir(model_dir))
    head = read_lm_head(model_dir)
    full_rank = tv.rank
    if rank is not None:
        tv = tv.truncated(rank, lm_head=head)
    A, B = lora_factors(tv, head)
    r_lora = A.shape[0]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or tv.model.name,
        "r": r_lora,
        "lora_alpha": r_lora,  # scale alpha / r = 1: the adapter adds exactly W_lm U Vᵀ h
        "lora_dropout": 0.0,
        "target_modules": ["lm_head"],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    # Provenance beside the adapter, not in it: PEFT warns about unknown config keys.
    provenance = {"task": tv.provenance.task, "kind": tv.kind, "rank": tv.rank,
                  "full_rank": full_rank, "model": tv.model.to_dict()}
    tensors = {
        "base_model.model.lm_head.lora_A.weight": A,
        "base_model.model.lm_head.lora_B.weight": B,
    }
    atomic_write(out / "adapter_model.safetensors", lambda tmp: save_file(tensors, tmp))
    atomic_write(out / "adapter_config.json",
                 lambda tmp: Path(tmp).write_text(json.dumps(config, indent=1)))
    atomic_write(out / "ltv_vllm.json",
                 lambda tmp: Path(tmp).write_text(json.dumps(provenance, indent=1)))
    return out
