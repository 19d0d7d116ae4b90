"""A job (`ltv_vllm.serving.offline.jobs`): several vLLM engines one after another in one process,
each torn down before the next.

JOB: a list of {"key", "kind": "generate" | "classify", and that function's arguments};
OUT: {key: result}. Run by `conftest.run_worker`, forked from the job forkserver that has
already imported vLLM (most of what a fresh process per engine costs on a CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def run_all(jobs: list[dict]) -> dict:
    from offline_classify import classify
    from offline_fused import generate, pp_stage_fold

    run = {"generate": generate, "classify": classify, "pp_fold": pp_stage_fold}
    out = {}
    for job in jobs:
        key, kind = job.pop("key"), job.pop("kind")
        out[key] = run[kind](**job)
    return out


if __name__ == "__main__":
    from ltv_vllm.serving.offline.jobs import job_main

    job_main(run_all)
