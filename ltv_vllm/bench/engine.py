"""One offline benchmark job: a fresh `vllm.LLM` in its own process, timed passes over it.

    python -m ltv_vllm.bench.engine job.json result.json

A fresh process per engine keeps modes from sharing caches or allocator state and gives each
its own peak RSS (the engine runs in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0). A job is
`{"llm_kwargs", "passes": [{"name", "groups": [[request, ...], ...]}], "repeats",
"gen_tokens", "warmup"}`; groups run one `generate` call each and their times add up. The
prefix cache is reset before every group, so repeats never find their own prompts cached:
ICL with prefix caching pays for its demonstrations once per group, as a fresh server would.
"""

from __future__ import annotations

import resource
import statistics
import threading
import time
from typing import Any, Self

from ltv_vllm.serving.offline.jobs import job_main

KV_GAUGE = "vllm:kv_cache_usage_perc"


def _metric_sum(llm: Any, name: str) -> float:
    return sum(float(getattr(m, "value", 0.0) or 0.0) for m in llm.get_metrics() if m.name == name)


class KVPeak:
    """Highest KV-cache usage (0..1) seen while active; vLLM exports only the current value."""

    def __init__(self, llm: Any, every_s: float = 0.05) -> None:
        self.llm, self.every_s, self.peak = llm, every_s, 0.0
        self._on = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            if self._on.wait(0.2):
                self.peak = max(self.peak, _metric_sum(self.llm, KV_GAUGE))
                time.sleep(self.every_s)

    def __enter__(self) -> Self:
        self._on.set()
        return self

    def __exit__(self, *exc: object) -> None:
        self._on.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


def _inputs(group: list[dict[str, Any]], gen_tokens: int | None) -> tuple[list, list, list | None]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from ltv_vllm.serving.offline.llm import classification_params

    prompts = [r["prompt"] for r in group]
    if gen_tokens:  # free generation: the shift's cost at every decoding step
        params = [SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True,
                                 extra_args=r.get("xargs")) for r in group]
    else:
        params = [classification_params(r["label_ids"]) for r in group]
        for p, r in zip(params, group, strict=True):
            p.extra_args = r.get("xargs")  # a per-request task (`ltv-shift`)
    loras = [LoRARequest(*r["lora"]) if r["lora"] else None for r in group]
    return prompts, params, loras if any(loras) else None


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM

    from ltv_vllm.serving.offline.llm import parse_classification
    t0 = time.perf_counter()
    llm = LLM(**job["llm_kwargs"], logprobs_mode="processed_logprobs", disable_log_stats=False)
    startup = time.perf_counter() - t0
    cache = llm.llm_engine.vllm_config.cache_config
    repeats, gen_tokens = int(job.get("repeats", 1)), int(job.get("gen_tokens", 0))
    kv = KVPeak(llm)

    def timed(group: list[dict[str, Any]], gen: int | None) -> tuple[float, list]:
        prompts, params, loras = _inputs(group, gen)
        llm.reset_prefix_cache()
        with kv:
            t = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            return time.perf_counter() - t, outs

    warm = job["passes"][0]["groups"][0][: int(job.get("warmup", 16))]
    if warm:  # first calls pay for lazy initialisation; keep that out of every timing
        timed(warm, None)
        if gen_tokens:
            timed(warm, gen_tokens)

    passes = {}
    for p in job["passes"]:
        groups = [g for g in p["groups"] if g]
        kv.peak = 0.0
        q0 = _metric_sum(llm, "vllm:prefix_cache_queries")
        h0 = _metric_sum(llm, "vllm:prefix_cache_hits")
        cls_s, preds, prompt_tokens = [], [], []
        for rep in range(repeats):
            total = 0.0
            for g in groups:
                dt, outs = timed(g, None)
                total += dt
                if rep == 0:
                    for r, o in zip(g, outs, strict=True):
                        c = parse_classification(o, r["label_ids"], r["labels"])
                        preds.append({"qid": r["qid"], "task": r["task"], "gold": r["gold"],
                                      "pred": r["labels"].index(c.label),
                                      "probs": [round(c.probs[lab], 7) for lab in r["labels"]]})
                        prompt_tokens.append(len(o.prompt_token_ids))
            cls_s.append(total)
        queries = _metric_sum(llm, "vllm:prefix_cache_queries") - q0
        hits = _metric_sum(llm, "vllm:prefix_cache_hits") - h0
        kv_cls = kv.peak
        gen_s, gen_out = [], 0
        for _rep in range(repeats if gen_tokens else 0):
            total, toks = 0.0, 0
            for g in groups:
                dt, outs = timed(g, gen_tokens)
                total += dt
                toks += sum(len(o.outputs[0].token_ids) for o in outs)
            gen_s.append(total)
            gen_out = toks
        n = sum(len(g) for g in groups)
        passes[p["name"]] = {
            "requests": n,
            "classify_seconds": cls_s,
            "classify_seconds_median": statistics.median(cls_s),
            "requests_per_s": n / statistics.median(cls_s),
            "generate_seconds": gen_s,
            "generate_tokens": gen_out,
            "output_tokens_per_s": gen_out / statistics.median(gen_s) if gen_s else None,
            "accuracy": sum(x["pred"] == x["gold"] for x in preds) / max(1, len(preds)),
            "predictions": preds,
            "prompt_tokens_mean": statistics.fmean(prompt_tokens) if prompt_tokens else 0.0,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "peak_kv_usage": kv_cls,
            "peak_kv_usage_with_generate": kv.peak if gen_s else None,
        }
    kv.close()
    return {
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "startup_seconds": startup,
        "kv_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "passes": passes,
    }


if __name__ == "__main__":
    job_main(run_job)
