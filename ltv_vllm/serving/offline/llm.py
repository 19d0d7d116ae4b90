"""Offline batch jobs over `vllm.LLM`, no server: an engine with a task vector or with many
(a task per prompt), classification, greedy generation jobs in a fresh process
(`python -m ltv_vllm.serving.offline.llm JOB OUT`).

    from ltv_vllm import make_llm, task_llm, classify_offline
    llm = make_llm("smollm2-135m", "agnews.pt")                # fused vector, checked first
    preds = classify_offline(llm, get_task("agnews"), texts)   # label + restricted probs
    llm = task_llm("smollm2-135m", {"agnews": "agnews.pt", "sst2": "sst2.pt"})
    llm.generate(prompts, [SamplingParams(extra_args={"ltv_task": "sst2"}), ...])
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ltv_vllm.serving.client import Classification, classification
from ltv_vllm.serving.contract.vllm_support import check_version
from ltv_vllm.serving.contract.wire import LAYER_TASKS_ENV
from ltv_vllm.serving.offline.jobs import job_main, run_job
from ltv_vllm.tasks.specs import Task, label_token_ids

# what chooses how vLLM compiles the model: given any, no eager default is added
COMPILATION_ARGS = ("enforce_eager", "compilation_config", "optimization_level")


def make_llm(
    model_spec: str | None,
    vector: str | Path | None = None,
    *,
    dtype: str = "auto",
    fold: bool = False,
    max_model_len: int | None = None,
    enforce_eager: bool | None = None,
    tensor_parallel_size: int = 1,
    engine_args: Mapping[str, Any] | None = None,
) -> Any:
    """A `vllm.LLM` for the model, with the vector fused (or folded) when one is given;
    `engine_args`: any other `vllm.LLM` argument, passed through (`llm_with`)."""
    from ltv_vllm.serving.launcher.recipe import engine_kwargs, fused_env

    model_dir = _model_dir(model_spec)
    ours: dict[str, Any] = (engine_kwargs(model_dir, vector, fold=fold) if vector
                            else {"model": str(model_dir)})
    # a layer task's prefix-cache keys (`engine.prefix_keys`); none: no entry, and none left
    # from an earlier engine of this process
    os.environ.pop(LAYER_TASKS_ENV, None)
    os.environ.update(fused_env(ours.get("hf_overrides", {})))
    given = {"max_model_len": max_model_len, "tensor_parallel_size": tensor_parallel_size,
             **({"enforce_eager": enforce_eager} if enforce_eager is not None else {})}
    return llm_with(model_dir, ours, dtype, {**given, **(engine_args or {})})


def task_llm(
    model_spec: str | None,
    vectors: Mapping[str, str | Path],
    *,
    shift_steps: str | None = None,
    dtype: str = "auto",
    engine_args: Mapping[str, Any] | None = None,
) -> Any:
    """A `vllm.LLM` holding every task vector (name → file), each checked against the model
    first: a prompt picks its task and step policy with
    `SamplingParams(extra_args={"ltv_task": NAME, "ltv_steps": "first"})` (no `ltv_task`: the
    bare model), requests for different tasks batching together as in `ltv-vllm serve`.
    `shift_steps`: the policy of requests naming none (None: each vector's own);
    `engine_args`: any other `vllm.LLM` argument, passed through (`llm_with`).

    The task names are written to this process's environment (`wire.tasks_env`): the
    engine admits requests for them only."""
    from ltv_vllm.serving.launcher.recipe import task_engine

    model_dir = _model_dir(model_spec)
    engine = task_engine(model_dir, dict(vectors), shift_steps=shift_steps)
    os.environ.pop(LAYER_TASKS_ENV, None)  # an earlier engine's, if its tasks were layer tasks
    os.environ.update(engine.env)
    return llm_with(model_dir, engine.kwargs, dtype, engine_args or {})


def _model_dir(model_spec: str | None) -> Path:
    from ltv_vllm.models.cache import DEFAULT_MODEL
    from ltv_vllm.models.loading import local_model_dir

    check_version()
    return Path(local_model_dir(model_spec or DEFAULT_MODEL))


def llm_with(model_dir: Path, ours: Mapping[str, Any], dtype: str,
             engine_args: Mapping[str, Any]) -> Any:
    """`vllm.LLM` with ltv-vllm's arguments (`ours`) and the caller's (`engine_args`), as
    `serve` joins them with a user's flags (`launcher.flags`): `hf_overrides` and
    `logits_processors` merged, a `model` or a `logprobs_mode` other than the processed
    logprobs (what classification reads) refused, `dtype` given once. Eager on the CPU backend
    unless the caller chose how to compile (its compile warm-up costs over a minute per
    engine there); vLLM's own default elsewhere."""
    from vllm import LLM

    from ltv_vllm.errors import ArgumentError
    from ltv_vllm.models.hardware import engine_device, resolve_for_model
    from ltv_vllm.serving.launcher.flags import chosen, merged_overrides

    args = dict(engine_args)
    if "model" in args:
        raise ArgumentError("engine_args names a model: the model is the first argument (its "
                            "task vectors are checked against it)")
    if args.get("logprobs_mode", "processed_logprobs") != "processed_logprobs":
        raise ArgumentError(f"logprobs_mode {args['logprobs_mode']}: ltv-vllm's engines "
                            "return processed_logprobs (what classification reads)")
    kwargs = {**args, **ours,
              "hf_overrides": merged_overrides(ours.get("hf_overrides") or {},
                                               args.get("hf_overrides") or {}),
              "logits_processors": [*(args.get("logits_processors") or []),
                                    *(ours.get("logits_processors") or [])],
              "dtype": resolve_for_model(chosen("dtype", dtype, "auto", args.get("dtype")),
                                         model_dir),
              # logprobs after allowed_token_ids: the label-restricted distribution
              "logprobs_mode": "processed_logprobs"}
    if engine_device() == "cpu" and not any(k in args for k in COMPILATION_ARGS):
        kwargs["enforce_eager"] = True
    return LLM(**kwargs)


def classification_params(label_ids: Sequence[int]) -> Any:
    """One greedy token restricted to the label tokens, with their (renormalised) logprobs."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=len(label_ids),
                          allowed_token_ids=list(label_ids))


def parse_classification(
    output: Any, label_ids: Sequence[int], labels: Sequence[str]
) -> Classification:
    """Label and restricted probabilities from a `RequestOutput` of `classification_params`."""
    top = output.outputs[0].logprobs[0]  # token id → Logprob, restricted to the labels
    return classification({i: x.logprob for i, x in top.items()}, label_ids, labels)


def classify_offline(llm: Any, task: Task, texts: Sequence[str]) -> list[Classification]:
    """One batched `generate` over all texts; each gets its label and restricted probabilities."""
    ids = label_token_ids(task, llm.get_tokenizer())
    outs = llm.generate([task.zero_shot(t) for t in texts], classification_params(ids),
                        use_tqdm=True)
    return [parse_classification(o, ids, task.labels) for o in outs]


# -- greedy generation jobs (regression answers through vLLM) ----------------------------------


def generation_params(max_new_tokens: int) -> Any:
    """Greedy, at most `max_new_tokens`, stopping at EOS as transformers' `generate` does."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_new_tokens, temperature=0.0)


def run_generation_job(job: dict[str, Any]) -> dict[str, Any]:
    """In this process: one engine (`job["vector"]` fused, or none), greedy continuations of
    `job["prompts"]`; their token ids (the caller decodes them with its own tokenizer, so the
    two engines' answers are compared under one set of decoding rules)."""
    import time

    from vllm import LLM

    from ltv_vllm.serving.launcher.recipe import engine_kwargs

    # every generated token shifted, as the transformers generation it is compared with,
    # unless the job names step policies: then every prompt once per policy (the request's
    # `ltv_steps`), in one batch, policy after policy in the output
    kwargs = (engine_kwargs(job["model"], job["vector"], shift_steps="all") if job.get("vector")
              else {"model": job["model"]})
    t0 = time.perf_counter()
    llm = LLM(**kwargs, dtype=job["dtype"], max_model_len=job["max_model_len"],
              enforce_eager=True, enable_prefix_caching=True, seed=0)
    start = time.perf_counter() - t0
    steps = job.get("steps") or [None]
    params = []
    for s in steps:
        p = generation_params(job["max_new_tokens"])
        if s is not None:
            p.extra_args = {"ltv_steps": s}
        params += [p] * len(job["prompts"])
    t0 = time.perf_counter()
    outs = llm.generate(list(job["prompts"]) * len(steps), params, use_tqdm=False)
    return {"token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "startup_seconds": start, "generate_seconds": time.perf_counter() - t0}


def generate_in_subprocess(job: dict[str, Any], work: Path, name: str,
                           kv_cache_gib: int = 2) -> dict[str, Any]:
    """`run_generation_job` in a fresh process (vLLM keeps global state per process; the
    engine runs in it: VLLM_ENABLE_V1_MULTIPROCESSING=0); its log beside the job file."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    return run_job("ltv_vllm.serving.offline.llm", job, work, name, env=env,
                   what=f"vLLM generation job {name}")


if __name__ == "__main__":
    job_main(run_generation_job)
