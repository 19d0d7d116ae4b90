"""A mixed per-request batch (tasks and step policies) through `vllm.LLM` on whichever
runner the environment asks for; writes {"v2": bool, "rows": [[tokens, logprobs]]}.

    python runner_mix.py MODEL_DIR VECTORS_JSON OUT_JSON
"""

import json
import os
import sys

PROMPTS = ["Review: the plot is dull\nSentiment:", "Question: Who wrote Hamlet?\nAnswer Type:",
           "x y z", "News: peace talks\nType:"] * 2
TASKS = [None, "a", "b", "a", "b", None, "a", "b"]
STEPS = ["all", "first", 2, "all", 0, "all", 3, "first"]

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    from ltv_vllm.serving.serve import task_engine

    model_dir, vectors, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    engine = task_engine(model_dir, vectors)
    os.environ.update(engine.env)
    llm = LLM(**engine.kwargs, dtype="float32", enforce_eager=True, max_model_len=256,
              kv_cache_memory_bytes=64 << 20, max_num_seqs=4, seed=0)
    params = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, extra_args={
        **({"ltv_task": t} if t else {}), "ltv_steps": s}) for t, s in zip(TASKS, STEPS,
                                                                         strict=True)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    rows = [[list(o.outputs[0].token_ids),
             [{str(k): v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs]]
            for o in outs]
    with open(out, "w") as f:
        json.dump({"v2": llm.llm_engine.vllm_config.use_v2_model_runner, "rows": rows}, f)
