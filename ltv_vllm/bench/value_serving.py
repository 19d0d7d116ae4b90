"""What each row of the value protocol costs to serve (`ltv-vllm bench value --serving`): one
vLLM engine per way of answering, each in a fresh process (`bench.engine`), the same test
queries, the same engine settings, zero-shot first and again last (the noise floor of every
ratio). Runs in the benchmark's driver process; the engines in their own.

Ways of answering, each as a user would serve it:

  * zero-shot: the bare model on the zero-shot prompts;
  * the k-shot and the many-shot prompt with vLLM's prefix cache (the demonstrations are
    computed once per group and shared);
  * the default task vector, fused into the engine (`serving.launcher.recipe.engine_kwargs`,
    the first generated token shifted: what `extract` records), the vector `extract` writes
    for the same episode;
  * the LoRA rival: its PEFT adapter (the one chosen on dev) through vLLM's LoRA
    (`enable_lora`, a `LoRARequest` per request).

Each engine classifies every query (one label-restricted token) and generates `gen_tokens`
free tokens per query; throughput is the fastest of `repeats` passes (`report.derive_rates`),
the ratio is to the faster zero-shot run. The engine's own label predictions come back too:
its accuracy on these queries, beside the transformers row it serves, shows the served
artifact is the evaluated one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ZERO_SHOT = "zero-shot"
ZERO_SHOT_AGAIN = "zero-shot (again)"
PROMPT_K = "prompt, one k-shot (prefix cache)"
PROMPT_MANY = "prompt, many-shot (prefix cache)"
VECTOR = "default vector (fused, first token)"
LORA = "LoRA adapter (vLLM LoRA)"


@dataclass(frozen=True)
class ServingOptions:
    queries: int = 200      # test queries served per way (the first of the test split)
    gen_tokens: int = 16
    repeats: int = 3
    kv_cache_gib: int = 4


def _request(qid: int, prompt: str, gold: int, task: Any, label_ids: Sequence[int],
             lora: tuple[str, int, str] | None = None) -> dict[str, Any]:
    return {"qid": qid, "prompt": prompt, "task": task.name, "gold": gold,
            "label_ids": list(label_ids), "labels": list(task.labels), "model": "base",
            "lora": list(lora) if lora else None, "xargs": None}


def _offline_only(host: str, port: int) -> list[str]:  # noqa: ARG001 - Engine's signature
    raise NotImplementedError("the value protocol's serving costs are measured offline")


def serving_costs(model_dir: Path, task: Any, ep: Any, many: Sequence[Any],
                  label_ids: Sequence[int], vector: Path, adapter: Path | None, dtype: str,
                  opts: ServingOptions, work: Path,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every way's throughput and served accuracy on the first `opts.queries` test queries."""
    from ltv_vllm.bench.modes import Engine
    from ltv_vllm.bench.report import derive_rates
    from ltv_vllm.bench.serving import run_engine_job
    from ltv_vllm.bench.workload import EngineSettings
    from ltv_vllm.models.loading import load_tokenizer
    from ltv_vllm.serving.launcher.recipe import engine_kwargs

    test = ep.test[: opts.queries]
    k_prefix, many_prefix = ep.demo_prefix(), task.demos_text(many)
    prompts = {ZERO_SHOT: [task.zero_shot(e.text) for e in test],
               PROMPT_K: [k_prefix + task.query(e.text) for e in test],
               PROMPT_MANY: [many_prefix + task.query(e.text) for e in test]}
    tok = load_tokenizer(str(model_dir))
    longest = max(len(tok(p, add_special_tokens=task.special_tokens)["input_ids"])
                  for p in prompts[PROMPT_MANY])
    # one setting for every engine: room for the many-shot prompt and its generation
    settings = EngineSettings(dtype=dtype, max_model_len=longest + opts.gen_tokens + 8,
                              kv_cache_gib=opts.kv_cache_gib)
    common = {"model": str(model_dir), **settings.llm_kwargs(), "enable_prefix_caching": True}

    def reqs(way: str, lora: tuple[str, int, str] | None = None) -> list[dict[str, Any]]:
        src = prompts.get(way, prompts[ZERO_SHOT])
        return [_request(i, p, e.label, task, label_ids, lora)
                for i, (p, e) in enumerate(zip(src, test, strict=True))]

    ways: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = [
        (ZERO_SHOT, common, reqs(ZERO_SHOT)),
        (PROMPT_K, common, reqs(PROMPT_K)),
        (PROMPT_MANY, common, reqs(PROMPT_MANY)),
        (VECTOR, {**common, **engine_kwargs(model_dir, vector, shift_steps="first")},
         reqs(VECTOR))]
    if adapter is not None:
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        ways.append((LORA, {**common, "enable_lora": True, "max_loras": 1,
                            "max_lora_rank": int(cfg["r"])},
                     reqs(LORA, ("value-lora", 1, str(adapter)))))
    ways.append((ZERO_SHOT_AGAIN, common, reqs(ZERO_SHOT)))
    out: dict[str, Any] = {}
    for way, kwargs, group in ways:
        log(f"serving cost: {way}")
        engine = Engine(way, kwargs, _offline_only, [group])
        res = run_engine_job(engine, [{"name": "main", "groups": [group]}],
                             repeats=opts.repeats, gen_tokens=opts.gen_tokens, warmup=8,
                             settings=settings, log_dir=work, log=log)
        p = derive_rates(res["passes"]["main"])
        out[way] = {"requests": p["requests"], "requests_per_s": p["requests_per_s"],
                    "output_tokens_per_s": p["output_tokens_per_s"],
                    "accuracy": p["accuracy"], "prompt_tokens_mean": p["prompt_tokens_mean"],
                    "startup_seconds": res["startup_seconds"],
                    "peak_rss_bytes": res["peak_rss_bytes"],
                    "predictions": [x["pred"] for x in sorted(p["predictions"],
                                                              key=lambda x: x["qid"])]}
    zs = max(out[ZERO_SHOT]["requests_per_s"], out[ZERO_SHOT_AGAIN]["requests_per_s"])
    zs_gen = max(out[ZERO_SHOT]["output_tokens_per_s"], out[ZERO_SHOT_AGAIN]["output_tokens_per_s"])
    for r in out.values():
        r["classify_ratio"] = r["requests_per_s"] / zs
        r["generate_ratio"] = r["output_tokens_per_s"] / zs_gen
    return {"task": task.name, "seed": ep.seed, "queries": len(test),
            "gen_tokens": opts.gen_tokens, "repeats": opts.repeats,
            "max_model_len": settings.max_model_len, "dtype": dtype, "ways": out}
