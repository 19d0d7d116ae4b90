"""The final hidden state h of each prompt's last token, captured by vLLM's own engine.

A causal LM loaded with `runner="pooling"` and LAST pooling without activation returns the
last prompt token's final post-norm hidden state (the LM head's input: what every served map
shifts), with vLLM's kernels, tensor and pipeline parallelism and prefix caching; it builds
no LM head, so label logits come from h and the label rows of the head (`models.checkpoint`).
vLLM 0.32 refuses `normalize=`; `use_activation=False` is what keeps h raw.

    llm = capture_llm(model_dir, CaptureEngine(dtype="float32", tensor_parallel_size=2))
    h = final_hidden(llm, prompts)          # [len(prompts), d], float32

The engine keeps global state per process, so a run that also uses transformers or another
engine runs this in a job (`python -m ltv_vllm.serving.capture JOB OUT`, `serving.jobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ltv_vllm.serving.jobs import job_main


@dataclass(frozen=True)
class CaptureEngine:
    """vLLM's parallelism and engine arguments for a capture run (passed through as given)."""

    dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    max_model_len: int | None = None
    enforce_eager: bool | None = None  # vLLM's default unless given
    extra: dict[str, Any] = field(default_factory=dict)

    def llm_kwargs(self) -> dict[str, Any]:
        kw = {k: v for k, v in asdict(self).items() if k != "extra" and v is not None}
        return {**kw, **self.extra}


def capture_llm(model_dir: str, engine: CaptureEngine) -> Any:
    """A pooling-runner `vllm.LLM` whose output per prompt is h of its last token."""
    from vllm import LLM
    from vllm.config import PoolerConfig

    return LLM(model=model_dir, runner="pooling", enable_prefix_caching=True,
               pooler_config=PoolerConfig(pooling_type="LAST", use_activation=False),
               **engine.llm_kwargs())


def final_hidden(llm: Any, prompts: Sequence[str]) -> torch.Tensor:
    """h of each prompt's last token, in prompt order, as float32 [n, d]. Prompts sharing a
    prefix (the demonstrations) find it in the engine's prefix cache."""
    outs = llm.embed(list(prompts), use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs], dtype=torch.float32)


def run_capture_job(job: dict[str, Any]) -> dict[str, Any]:
    """JOB {"model_dir", "prompts", "engine": CaptureEngine fields, "out": .safetensors path}
    → h written to `out` (key "h"); OUT says its shape."""
    from safetensors.torch import save_file

    llm = capture_llm(job["model_dir"], CaptureEngine(**job.get("engine", {})))
    h = final_hidden(llm, job["prompts"])
    save_file({"h": h.contiguous()}, job["out"])
    return {"shape": list(h.shape)}


if __name__ == "__main__":
    job_main(run_capture_job)
