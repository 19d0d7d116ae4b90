"""`ltv-vllm selfcheck`: the per-request shift proves itself on the vLLM, runner and device
it runs on. Runs in an offline job process (`offline.jobs`).

Probe tasks whose effect cannot be mistaken go through a real engine in one `generate`
(one scheduler run), mixed with bare rows: each probe is a logit-space vector whose bias
puts +1000 on a token of its own (the last tokens of the vocabulary), with its own default
policy (`first`, `all`, `2`); requests override policies (`ltv_steps` 0, 1, 3, all), ask
for `n = 2`, have prompts of several lengths (with `--max-num-batched-tokens`, some several
times the budget, so their prefill is chunked) and `max_tokens` from 2 to 6 (so rows finish
at different steps and slots move). Every generated step is then checked from its
distribution: a step a probe shifted has its best logprob ≥ 500 nats above its second (no
model's own logits do that); a row of task T with policy n must be shifted at exactly its
first n steps, to T's token, and a bare row at none. The first wrong row is one line
naming the vLLM version, the runner and the device (`SelfCheckFailed`).

What it checks is the row plan (`engine.steps`), which fused and per-request serving share.
In LoRA mode (`--multi-task lora`) the probes are adapters instead (`probes.LORA_PROBES`:
LoRA has no bias, so each moves one of eight tokens of its own to the top, at every step),
sent with the same mix of bare rows, lengths, budgets and n; each row's best token at each
step must be one of its own adapter's, and a bare row's none of them (`check_lora_rows`):
what vLLM's LoRA batching (and the CPU backend's fix, `engine.fixes`) gives each row.

    python -m ltv_vllm.serving.offline.selfcheck JOB OUT    (a job: `offline.jobs`)
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ltv_vllm.serving.store.probes import (
    LORA_PROBES,
    LORA_TOKENS,
    PROBES,
    layer_probe_tasks,
    lora_probe_vectors,
    probe_tokens,
    probe_vectors,
)
from ltv_vllm.serving.store.selfcheck_rows import (  # noqa: F401 - SelfCheckFailed re-exported
    Probe,
    SelfCheckFailed,
    check_lora_rows,
    check_rows,
    lora_probe_batch,
    lora_requests,
    lora_verdict,
    probe_batch,
    probe_params,
    verdict,
    where,
)


@dataclass(frozen=True)
class SelfCheckOptions:
    """What `ltv-vllm selfcheck` runs the probes on: the engine settings a server would use."""

    model_dir: str
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # a small batch: requests wait, slots are reused and move
    enforce_eager: bool = True
    lora: bool = False  # the probes as LoRA adapters (`serve --multi-task lora`)
    layer: bool = True  # the layer probes too (not in LoRA mode, nor on a float16 engine)


def run_selfcheck(opts: SelfCheckOptions) -> dict[str, Any]:
    """The probes through a fresh engine in this process; the result, or SelfCheckFailed."""
    from transformers import AutoTokenizer
    from vllm import LLM

    from ltv_vllm.models.hardware import resolve_for_model
    from ltv_vllm.serving.contract.vllm_support import check_version
    from ltv_vllm.serving.launcher.lora_plan import plan_lora
    from ltv_vllm.serving.launcher.recipe import task_engine

    check_version()
    tok = AutoTokenizer.from_pretrained(opts.model_dir)
    tokens = probe_tokens(tok, LORA_TOKENS if opts.lora else len(PROBES))
    dtype = resolve_for_model(opts.dtype, opts.model_dir)
    layer = opts.layer and not opts.lora and dtype != "float16"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ltv-selfcheck-") as d:
        vectors = (lora_probe_vectors if opts.lora else probe_vectors)(opts.model_dir, tokens)
        signatures = {}
        if layer:  # LayerTasks beside the final-layer probes, in the one engine
            for name, (task, sig) in layer_probe_tasks(opts.model_dir, dtype).items():
                vectors[name], signatures[name] = task, sig
        paths = {name: tv.save(Path(d) / f"{name}.safetensors")
                 for name, tv in vectors.items()}
        adapters: dict[str, str] = {}
        if opts.lora:  # the adapters a LoRA-mode server would write, by the same plan
            plan = plan_lora(opts.model_dir, paths, lora_dir=Path(d) / "adapters")
            plan.write()
            # every slot holds a probe (no spare): a bare row that read any slot shows
            engine_kw: dict[str, Any] = {"model": opts.model_dir, **plan.engine_kwargs(),
                                         "max_loras": len(LORA_PROBES)}
            adapters = {n: str(a) for n, a in plan.adapters.items()}
        else:
            engine = task_engine(opts.model_dir, paths)
            os.environ.update(engine.env)  # the frontend admits the probe names
            engine_kw = engine.kwargs
        kw: dict[str, Any] = {}
        if opts.max_num_batched_tokens:
            kw.update(max_num_batched_tokens=opts.max_num_batched_tokens,
                      enable_chunked_prefill=True)
        if opts.max_num_seqs:
            kw["max_num_seqs"] = opts.max_num_seqs
        llm = LLM(**engine_kw, dtype=dtype,
                  max_model_len=opts.max_model_len, enforce_eager=opts.enforce_eager,
                  tensor_parallel_size=opts.tensor_parallel_size, seed=0, **kw)
        start = time.perf_counter() - t0
        max_len = int(llm.llm_engine.vllm_config.model_config.max_model_len)
        batch = lora_probe_batch(tok, opts.max_num_batched_tokens, max_len) if opts.lora \
            else probe_batch(tok, opts.max_num_batched_tokens, max_len, layer=layer)
        params = [probe_params(p) for p in batch]
        t1 = time.perf_counter()
        if opts.lora:  # the bare rows first, alone, before any adapter is loaded
            bare = [i for i, p in enumerate(batch) if p.task is None]
            ref = dict(zip(bare, llm.generate([batch[i].prompt for i in bare],
                                              [params[i] for i in bare], use_tqdm=False),
                           strict=True))
        outs = llm.generate([p.prompt for p in batch], params, use_tqdm=False,
                            lora_request=lora_requests(batch, adapters) if opts.lora else None)
        check_s = time.perf_counter() - t1
    ran_on = where(llm.llm_engine.vllm_config)
    found = lora_verdict(batch, outs, ref, tokens, ran_on) if opts.lora else verdict(
        batch, outs, tokens, ran_on, signatures)
    return {**found, "engine_start_seconds": round(start, 2),
            "check_seconds": round(check_s, 3), "options": asdict(opts)}


# the LoRA probes' adapter ids: far above the ids a server gives its own adapters (from 1)
def selfcheck_in_subprocess(opts: SelfCheckOptions, work: Path,
                            module: str = "ltv_vllm.serving.offline.selfcheck") -> dict[str, Any]:
    """`run_selfcheck` in a fresh process (`offline.jobs`); SelfCheckFailed raised here,
    its line whole. `module`: the job's module (a test plants a bug with its own)."""
    from ltv_vllm.models.hardware import engine_device
    from ltv_vllm.serving.contract.vllm_support import cpu_rank_binding
    from ltv_vllm.serving.offline.jobs import run_job

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    if engine_device() == "cpu":  # the CPU backend's own settings
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env.update(cpu_rank_binding(opts.tensor_parallel_size))
    out = run_job(module, asdict(opts), work, "selfcheck", env=env, what="selfcheck")
    if not out.get("ok"):
        raise SelfCheckFailed(out["error"])
    return out


def run_job_dict(job: dict[str, Any]) -> dict[str, Any]:
    """The job's side: a failed check is a result (its line whole), not a crash."""
    try:
        return run_selfcheck(SelfCheckOptions(**job))
    except SelfCheckFailed as e:
        return {"ok": False, "error": str(e)}


if __name__ == "__main__":
    from ltv_vllm.serving.offline.jobs import job_main

    job_main(run_job_dict)
