"""A job (`ltv_vllm.serving.offline.jobs`) that does what it is told, to test the runner itself.

JOB {"mode": "ok" | "raise" | "kill"}: ok returns its pid and the LTV_TOY variable it was
given, and what it found already done by the forkserver it was forked from (`preloaded`);
raise fails with a message; kill ends its own process with SIGKILL, as the OOM killer
would.
"""

from __future__ import annotations

import os
import signal


def run(job: dict) -> dict:
    print("toy job starting", flush=True)
    if job["mode"] == "raise":
        raise RuntimeError("the toy job was told to fail")
    if job["mode"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return {"pid": os.getpid(), "toy": os.environ.get("LTV_TOY"), "preloaded": preloaded()}


def preloaded() -> dict:
    """What this process holds without having done it itself (read before anything here
    imports or probes): the engine's worker module, and torch inductor's vector-ISA probe."""
    import sys

    isa = sys.modules.get("torch._inductor.cpu_vec_isa")
    return {"worker": "vllm.v1.worker.cpu_worker" in sys.modules,
            "plugin": "ltv_vllm.serving.engine.models" in sys.modules,
            "vec_isa_probed": bool(isa and isa.valid_vec_isa_list.cache_info().currsize)}


if __name__ == "__main__":
    from ltv_vllm.serving.offline.jobs import job_main

    job_main(run)
