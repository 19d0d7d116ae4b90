"""Run in a fresh process: vllm.LLM with a fused task vector; print logprobs as JSON.

argv: model_dir vector_path|fold:vector_path|- prompts_json max_tokens [tensor_parallel_size]
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    model_dir, vector, prompts_json, max_tokens = sys.argv[1:5]
    tp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    from vllm import LLM, SamplingParams

    from ltv_vllm.serve import engine_kwargs

    if vector == "-":
        kwargs = {"model": model_dir}
    else:
        fold = vector.startswith("fold:")
        kwargs = engine_kwargs(model_dir, vector.removeprefix("fold:"), fold=fold)
    llm = LLM(**kwargs, dtype="float32", enforce_eager=True, max_model_len=512,
              gpu_memory_utilization=0.5, seed=0, tensor_parallel_size=tp)
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), logprobs=5,
                            prompt_logprobs=1)
    outs = llm.generate(json.loads(prompts_json), params)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append({
            "token_ids": list(c.token_ids),
            "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in c.logprobs],
            "prompt_logprobs": [None if s is None else {str(k): v.logprob for k, v in s.items()}
                                for s in o.prompt_logprobs],
        })
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
