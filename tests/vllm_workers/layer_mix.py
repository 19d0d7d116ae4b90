"""Layer tasks through `vllm.LLM` on whichever runner the environment asks for: a mixed batch
(layer tasks at different blocks and positions, a final-layer task, the bare model), long
prompts prefilled in chunks, then the prefix cache across requests one after another; writes
{"v2": bool, "rows": [[tokens, logprobs]], "cache": [[tokens, logprobs, cached tokens]]}.

    python layer_mix.py MODEL_DIR VECTORS_JSON OUT_JSON
"""

import json
import sys

LONG = " ".join(f"w{i % 7} x{i % 5}" for i in range(40))  # >100 tokens: several chunks
# (prompt, task, ltv_steps or None for the task's own positions[, more vllm_xargs])
MIX = [
    ("Review: the plot is dull\nSentiment:", "ctl", None),         # all positions
    ("x y z x y z x y", "map", None),                              # the last prompt token
    ("Question: Who wrote Hamlet?\nAnswer:", "map", "generated"),  # every token-producing row
    (LONG + " end", "ctl", "prompt"),                              # the prompt only, chunked
    ("News: peace talks\nType:", "head", None),                    # a final-layer task
    (LONG + " tail", None, None),                                  # bare, chunked
    ("Review: a gorgeous movie\nSentiment:", "both", 2),           # blocks 0 and 1, 2 steps
    ("x y z x y z x y", "ctl", 0),                                 # nothing shifted
    ("Question: What is 2+2?\nAnswer:", "map", None, {"ltv_scale": -0.7}),  # scaled
    ("News: stocks fall\nType:", "ctl", "generated",                 # two tasks added
     {"ltv_scale": 0.5, "ltv_mix": {"add": -1.5}}),
]
# one after another, the prefix cache warm from the requests before: the same long prompt
# (its own: none of the mixed batch's prefixes)
CACHED = " ".join(f"q{i % 3} r{i % 4}" for i in range(40))
CACHE = [(None, None), ("ctl", None), ("both", "all"), ("map", None), ("ctl", None),
         (None, None), ("ctl", 0)]
TOKENS = 6


def params(task, steps, more=None):
    from vllm import SamplingParams

    extra = {**({"ltv_task": task} if task else {}),
             **({"ltv_steps": steps} if steps is not None else {}), **(more or {})}
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=3, extra_args=extra)


def rows(outs, cached=False):
    return [[list(o.outputs[0].token_ids),
             [{str(k): v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs],
             *([o.num_cached_tokens] if cached else [])] for o in outs]


if __name__ == "__main__":
    from ltv_vllm import task_llm

    model_dir, vectors, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    llm = task_llm(model_dir, vectors, dtype="float32", engine_args=dict(
        enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20, max_num_seqs=4,
        seed=0, block_size=32, enable_prefix_caching=True, enable_chunked_prefill=True,
        max_num_batched_tokens=48))
    mix = llm.generate([m[0] for m in MIX], [params(*m[1:]) for m in MIX], use_tqdm=False)
    cache = []
    for task, steps in CACHE:  # each request alone: the cache holds what the ones before left
        cache += rows(llm.generate([CACHED], [params(task, steps)], use_tqdm=False),
                      cached=True)
    with open(out, "w") as f:
        json.dump({"v2": llm.llm_engine.vllm_config.use_v2_model_runner, "rows": rows(mix),
                   "cache": cache}, f)
