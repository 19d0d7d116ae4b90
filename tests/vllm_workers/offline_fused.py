"""Run in a fresh process: vllm.LLM with a fused task vector; print logprobs as JSON.

argv: model_dir vector_path|fold:vector_path|- prompts_json max_tokens [tensor_parallel_size
      [local|fold]]
`fold` also reports, per rank, whether the head was really folded (`fold_check`).
`local` also runs, on every rank, the vocab-local entry points (`compute_logits_local`,
`get_top_tokens`) against the gathered `compute_logits` (see `local_check`); their results come
back under "local", one entry per rank.
"""

from __future__ import annotations

import json
import sys


def local_check(worker) -> dict:
    """On one rank: the vocab-local logits are this rank's columns of the gathered logits, and
    the local-argmax token is the argmax of the gathered logits (vLLM calls these on opt-in
    paths only, which a CPU engine never takes, so they are called here directly)."""
    import torch

    model = worker.get_model()
    shard = model.lm_head.shard_indices
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, model.lm_head.weight.shape[1], generator=g).to(model.lm_head.weight)
    with torch.inference_mode():
        full = model.compute_logits(h)
        local = model.compute_logits_local(h)
        top = model.get_top_tokens(h)
    n = shard.num_org_elements
    ours = full[:, shard.org_vocab_start_index : shard.org_vocab_end_index]
    return {"start": shard.org_vocab_start_index, "n": n, "pad": shard.num_org_vocab_padding,
            "local_width": local.shape[-1],
            "max_err": float((local[:, :n] - ours).abs().max()),
            "top_ok": bool((top == full.argmax(-1)).all())}


def fold_check(worker) -> dict:
    """On one rank: the wrapper kept no per-token shift, and its LM head is the (untied)
    embedding times I + U Vᵀ, row for row of this rank's shard."""

    from ltv_vllm.core.vector import load_task_vector

    model = worker.get_model()
    path = model.config.ltv_task_vector
    tv = load_task_vector(path)
    head = model.lm_head.weight.detach().float()
    embed = model.model.embed_tokens.weight.detach().float()
    want = embed + (embed @ tv.U) @ tv.V.T
    return {"shift_left": model._ltv is not None,
            "untied": model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr(),
            "max_err": float((head - want).abs().max()),
            "moved": float((head - embed).abs().max())}


def pp_stage_fold(vector: str) -> dict:
    """The fold on a pipeline stage before the last, whose LM head is vLLM's PPMissingLayer:
    it must leave that stage alone (no head to fold, no logits to shift) rather than fail.
    (vLLM's CPU backend cannot run PP > 1, so the stage is built here, not by an engine.)"""
    from torch import nn
    from vllm.model_executor.models.utils import PPMissingLayer

    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.serving.engine.models import LTVMixin

    class Stage(LTVMixin, nn.Module):
        pass

    stage = Stage()
    stage.lm_head = PPMissingLayer()
    stage._ltv = load_task_vector(vector)
    try:
        stage._fold_into_lm_head()
    except Exception as e:  # noqa: BLE001 - reported, the test names it
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None, "shift_left": stage._ltv is not None,
            "head_is_missing_layer": isinstance(stage.lm_head, PPMissingLayer)}


def generate(model_dir: str, vector: str | dict, prompts: list[str], max_tokens: int,
             tp: int = 1, check: str = "", steps: list | None = None,
             shift_steps: str | None = None, xargs: list | None = None,
             more: list[dict] | None = None, lengths: list[int] | None = None) -> dict:
    """One engine: greedy logprobs of `prompts` (+ the `local` or `fold` per-rank checks).
    `vector`: a path, `fold:PATH`, `-` (none) or {task: path} (per-request tasks); `steps`
    or `xargs`: one request per prompt and entry (an `ltv_steps` value, or whole
    `vllm_xargs`), all in one batch; `lengths`: each entry's `max_tokens`, if not all alike.
    `more`: further batches on the same engine, each a dict
    of `max_tokens`, `steps` and `xargs` as above (engines are the expensive part of a test:
    one engine answers every question asked of its configuration); their outputs under
    "more", in order."""

    from vllm import LLM

    from ltv_vllm import task_llm
    from ltv_vllm.serving.launcher.recipe import engine_kwargs

    common = dict(enforce_eager=True, max_model_len=512, gpu_memory_utilization=0.5, seed=0,
                  tensor_parallel_size=tp)
    if isinstance(vector, dict):  # the exported offline API, as a user calls it
        llm = task_llm(model_dir, vector, shift_steps=shift_steps, dtype="float32",
                       engine_args=common)
        kwargs = None
    elif vector == "-":
        kwargs = {"model": model_dir}
    else:
        fold = vector.startswith("fold:")
        kwargs = engine_kwargs(model_dir, vector.removeprefix("fold:"), fold=fold,
                               shift_steps=shift_steps)
    if kwargs is not None:
        llm = LLM(**kwargs, dtype="float32", **common)
    result = _batch(llm, prompts, max_tokens, steps, xargs, lengths)
    extra = [_batch(llm, prompts, b["max_tokens"], b.get("steps"), b.get("xargs"))
             for b in more or []]
    local = llm.collective_rpc(local_check) if check == "local" else None
    folded = llm.collective_rpc(fold_check) if check == "fold" else None
    shutdown(llm)
    return {"outputs": result, "more": extra, "local": local, "fold": folded}


def _batch(llm, prompts: list[str], max_tokens: int, steps: list | None,
           xargs: list | None, lengths: list[int] | None = None) -> list[dict]:
    """One `generate` call: each prompt once with its prompt logprobs, or (`steps`/`xargs`)
    once per entry."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5,
                            prompt_logprobs=1)
    if steps is not None:
        xargs = [None if s is None else {"ltv_steps": s} for s in steps]
    if xargs is not None:  # one request per (prompt, xargs), all in one batch
        prompts = [p for p in prompts for _ in xargs]
        lengths = lengths or [max_tokens] * len(xargs)
        params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=5, extra_args=x,
                                 ignore_eos=True)
                  for _ in range(len(prompts) // len(xargs))
                  for x, m in zip(xargs, lengths, strict=True)]
    result = []
    for o in llm.generate(prompts, params):
        c = o.outputs[0]
        result.append({
            "token_ids": list(c.token_ids),
            "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in c.logprobs],
            "prompt_logprobs": [None if s is None else {str(k): v.logprob for k, v in s.items()}
                                for s in (o.prompt_logprobs or [])],
        })
    return result


def shutdown(llm) -> None:
    """End an engine (and its worker processes) before the next one starts in this process."""
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def main() -> None:
    model_dir, vector, prompts_json, max_tokens = sys.argv[1:5]
    tp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    check = sys.argv[6] if len(sys.argv) > 6 else ""
    print("RESULT " + json.dumps(generate(model_dir, vector, json.loads(prompts_json),
                                          int(max_tokens), tp, check)))


if __name__ == "__main__":
    main()
