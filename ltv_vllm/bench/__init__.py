"""Benchmarks: LTV serving against ICL prompts and zero-shot inside vLLM, extraction cost.

`workload` builds the queries, prompts and task vectors every mode shares; `engine` runs one
`vllm.LLM` job in its own process (offline); `online` drives vLLM's OpenAI server; `report`
turns results into JSON, markdown and plots; `serving` and `extraction` are the entry points
behind `ltv-vllm bench ...` and the scripts in `benchmarks/`.
"""

from ltv_vllm.errors import UserError


class BenchError(UserError):
    """A benchmark step failed (one line, plus where its log is)."""
