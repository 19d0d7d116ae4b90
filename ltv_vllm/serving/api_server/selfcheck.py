"""The start-up self-check of a server's own engine, before the server answers anything
(`serve --selfcheck`, the default). Runs in vLLM's API-server process; the probe batch and
its verdicts are `store.selfcheck_rows`'.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ltv_vllm.serving.store.probes import (
    LORA_TOKENS,
    PROBES,
    probe_tokens,
)
from ltv_vllm.serving.store.selfcheck_rows import (
    Probe,
    lora_probe_batch,
    lora_requests,
    lora_verdict,
    probe_batch,
    probe_params,
    verdict,
    where,
)


async def engine_selfcheck(engine_client: Any, model_dir: str | Path,
                           probe_names: dict[str, str],
                           lora: dict[str, str] | None = None,
                           layer: dict[str, Any] | None = None) -> dict[str, Any]:
    """The probe batch through a running engine (the server's, at start: `api_server.endpoints`),
    all requests in flight together. `probe_names`: PROBES' names → the names the engine
    holds them under; `lora`: instead, LORA_PROBES' names → their adapter directories (sent
    as LoRA requests, removed from the engine after); `layer`: the layer probes' signatures
    (LAYER_PROBES' names → `probes.Signature`), whose rows join the batch. Chunked prefill
    is forced only where the engine's step budget is small (≤ 256 tokens); `ltv-vllm
    selfcheck --max-num-batched-tokens` forces it anywhere."""
    import asyncio
    import uuid

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tokens = probe_tokens(tok, LORA_TOKENS if lora else len(PROBES))
    budget = int(engine_client.vllm_config.scheduler_config.max_num_batched_tokens)
    max_len = int(engine_client.model_config.max_model_len)
    budget_or_none = budget if budget <= 256 else None
    batch = lora_probe_batch(tok, budget_or_none, max_len) if lora else \
        probe_batch(tok, budget_or_none, max_len, layer=bool(layer))
    loras = lora_requests(batch, lora) if lora else [None] * len(batch)
    tag = uuid.uuid4().hex[:8]

    async def one(i: int, p: Probe, phase: str = "") -> Any:
        served = p if lora else replace(p, task=probe_names[p.task] if p.task else None)
        final = None
        async for out in engine_client.generate(
                {"prompt_token_ids": tok(p.prompt)["input_ids"]}, probe_params(served),
                f"ltv-selfcheck-{tag}{phase}-{i}", lora_request=loras[i]):
            final = out
        return final

    t0 = time.perf_counter()
    if not lora:
        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
        return {**verdict(batch, outs, tokens, where(engine_client.vllm_config), layer),
                "check_seconds": round(time.perf_counter() - t0, 3)}
    # the bare rows first, alone, before any probe adapter is loaded: their reference
    bare = [i for i, p in enumerate(batch) if p.task is None]
    ref = dict(zip(bare, await asyncio.gather(*(one(i, batch[i], "-ref") for i in bare)),
                   strict=True))
    try:
        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    finally:
        for r in {r.lora_int_id for r in loras if r is not None}:
            await engine_client.remove_lora(r)  # their slots are the server's again
    return {**lora_verdict(batch, outs, ref, tokens, where(engine_client.vllm_config)),
            "check_seconds": round(time.perf_counter() - t0, 3)}
