"""A job (`ltv_vllm.serving.jobs`) that does what it is told, to test the runner itself.

JOB {"mode": "ok" | "raise" | "kill"}: ok returns its pid and the LTV_TOY variable it was
given; raise fails with a message; kill ends its own process with SIGKILL, as the OOM killer
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
    return {"pid": os.getpid(), "toy": os.environ.get("LTV_TOY")}


if __name__ == "__main__":
    from ltv_vllm.serving.jobs import job_main

    job_main(run)
