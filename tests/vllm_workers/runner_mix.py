"""A mixed per-request batch (tasks and step policies) through `vllm.LLM` on whichever
runner the environment asks for, optionally with speculative decoding; writes
{"v2": bool, "rows": [[tokens, logprobs]], "drafts": [proposed, accepted]}.

    python runner_mix.py MODEL_DIR VECTORS_JSON OUT_JSON [SPECULATIVE_CONFIG_JSON]
"""

import json
import sys

# repetitive prompts: the n-gram proposer finds drafts in them (and in the loops a tiny
# random model falls into), so speculative steps have draft rows to verify
PROMPTS = ["Review: the plot is dull\nSentiment: the plot is", "x y z x y z x y",
           "Question: Who wrote Hamlet?\nAnswer Type: Who wrote", "News: peace talks\nType:"] * 2
TASKS = [None, "a", "b", "a", "b", None, "a", "b"]
STEPS = ["all", "first", 2, "all", 0, "all", 3, "first"]
TOKENS = 10

if __name__ == "__main__":
    from vllm import SamplingParams

    from ltv_vllm import task_llm

    model_dir, vectors, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    spec = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    # the exported offline API, every other engine argument passed through
    llm = task_llm(model_dir, vectors, dtype="float32", engine_args=dict(
        enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20, max_num_seqs=4,
        seed=0, speculative_config=spec, disable_log_stats=False))
    params = [SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=3, extra_args={
        **({"ltv_task": t} if t else {}), "ltv_steps": s}) for t, s in zip(TASKS, STEPS,
                                                                         strict=True)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    rows = [[list(o.outputs[0].token_ids),
             [{str(k): v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs]]
            for o in outs]
    counts = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    drafts = [counts.get("vllm:spec_decode_num_draft_tokens", 0),
              counts.get("vllm:spec_decode_num_accepted_tokens", 0)]
    with open(out, "w") as f:
        json.dump({"v2": llm.llm_engine.vllm_config.use_v2_model_runner, "rows": rows,
                   "drafts": drafts}, f)
