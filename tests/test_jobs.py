"""The job runner (`serving.jobs`): a job runs in a process of its own with the environment it
was given, its output in its log; a job that fails or is killed is one error naming its log,
and leaves no result behind."""

from __future__ import annotations

import os

import pytest

from ltv_vllm.errors import UserError
from ltv_vllm.serving.offline.jobs import job_paths, run_job

pytestmark = pytest.mark.slow(seconds=7)  # the forkserver imports vLLM once


def test_a_job_runs_apart_with_its_environment(tmp_path):
    out = run_job("vllm_workers.toy_job", {"mode": "ok"}, tmp_path, "ok", env={"LTV_TOY": "7"})
    assert out["toy"] == "7" and out["pid"] != os.getpid()
    assert "LTV_TOY" not in os.environ  # the caller's environment is untouched
    _job, result, log = job_paths(tmp_path, "ok")
    assert result.is_file() and "toy job starting" in log.read_text()
    # forked from a forkserver that already imported the engine's modules and ran torch
    # inductor's vector-ISA probe (`serving.preload`): a job does neither again (about 2 s of
    # a tiny engine job's 4)
    assert out["preloaded"] == {"worker": True, "plugin": True, "vec_isa_probed": True}


@pytest.mark.parametrize("mode, words", [("raise", "the toy job was told to fail"),
                                         ("kill", "toy job starting")])
def test_a_failed_or_killed_job_is_one_error_naming_its_log(tmp_path, mode, words):
    _job, result, log = job_paths(tmp_path, mode)
    result.write_text("{}")  # a previous run's result must not pass for this one's
    with pytest.raises(UserError) as e:
        run_job("vllm_workers.toy_job", {"mode": mode}, tmp_path, mode, what="toy job")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("toy job failed (") and str(log) in msg
    assert words in msg
    assert not result.exists()
