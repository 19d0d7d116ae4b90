"""A user's own vLLM deployment survives `ltv-vllm serve`: their served model name, their LoRA
adapter and another installed vLLM plugin, through the real server.

Each server holds a task vector (alpha), a user's LoRA adapter (`ad`, an lm_head adapter made
from another vector, beta: its answers are beta's shift at every step) and the user's served
name (`mine`, the bare model); concurrent mixed requests are checked against transformers with
the right vector (`test_server.check_mixed`: within 1e-4 and told apart from every other
answer). A third-party general plugin, installed for the test on PYTHONPATH, writes a file when
vLLM loads it in the server's processes. Every server runs in vLLM's default process layout
(the worker in a process of its own), as a user's does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_server import PROMPTS, check_mixed, make_assets, start_server, stop
from test_task_metrics import assert_quiet, samples, shift_size_sum, value, wait_for

from ltv_vllm.serving.store.lora import export_lora

pytestmark = pytest.mark.slow(seconds=160)  # see conftest's ordering

PLUGIN = '''
import os
from pathlib import Path

def register():
    Path(os.environ["OTHER_PLUGIN_MARK"], str(os.getpid())).write_text("loaded")
'''


def install_other_plugin(site: Path) -> None:
    """A vLLM general plugin of someone else's, as pip would install it."""
    dist = site / "other_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: other-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nother_general = other_plugin:register\n")
    (site / "other_plugin.py").write_text(PLUGIN)


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer):
    return make_assets(tmp_path_factory, tokenizer)


@pytest.mark.parametrize("mode", ["shift", "lora"])
def test_user_name_adapter_and_plugin_survive(assets, tokenizer, tmp_path, monkeypatch,
                                              mode):
    model_dir, model, vecs = assets
    alpha, beta = vecs["alpha"], vecs["beta"]
    adapter = export_lora(beta[0], model_dir, tmp_path / "ad")
    site, mark = tmp_path / "site", tmp_path / "mark"
    install_other_plugin(site)
    mark.mkdir()
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)  # unset: every installed plugin loads
    env = {"PYTHONPATH": os.pathsep.join(
               p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p),
           "OTHER_PLUGIN_MARK": str(mark), "LTV_VLLM_SHIFT_READ": "0.2"}
    user = ["--served-model-name", "mine", "--lora-modules", f"ad={adapter}",
            "--max-lora-rank", "8"]
    if mode == "shift":  # LoRA is the user's own here: all of it theirs to give
        user += ["--enable-lora", "--lora-target-modules", "lm_head"]
    proc, url, log = start_server(model_dir, [f"alpha={alpha[1]}"], tmp_path,
                                  ("--multi-task", mode, *user), env_extra=env,
                                  layout="default")
    try:
        from test_server import HTTP

        names = [m["id"] for m in HTTP.get(f"{url}/v1/models").json()["data"]]
        assert names[0] == "mine" and {"alpha", "ad"} <= set(names), names
        # the bare model under the user's name, the task, the user's adapter: in one batch
        check_mixed(url, {"mine": None, "alpha": alpha[0], "ad": beta[0]}, model, tokenizer,
                    per_request=mode == "shift")
        # a task with the user's adapter: the vector was fitted on the base model
        r = HTTP.post(f"{url}/v1/completions", json={
            "model": "ad", "prompt": "hi", "max_tokens": 1,
            "vllm_xargs": {"ltv_task": "alpha"}})
        assert r.status_code == 400, r.text
        if mode == "shift":  # (LoRA mode refuses ltv_task in every request)
            assert "not another model or a LoRA adapter" in json.dumps(r.json()), r.text
        assert list(mark.iterdir()), "the other plugin was not loaded"
        assert_quiet(log)  # the shift sizes read all along, every read answered
    finally:
        stop(proc, log)


def test_plain_vllm_serve(assets, tokenizer, tmp_path, monkeypatch):
    """`ltv-vllm serve --export DIR`, then the user's own `vllm serve --config DIR/vllm.yaml`
    (on this CPU build vLLM's console script cannot run: `python -m
    vllm.entrypoints.openai.api_server`, what it runs) with LTV_VLLM_DEPLOY=DIR: the same
    answers as `ltv-vllm serve` (every task and the bare model against transformers), the
    same start-up self-check and the same gate, the per-task counters equal to what was sent
    and the shift's size equal to transformers' (its reads answered: no traceback in the
    log); a command-line flag that replaces one of ltv-vllm's stops it at start in one line."""
    import re
    import sys

    from click.testing import CliRunner
    from test_server import HTTP

    from ltv_vllm.cli import main

    model_dir, model, vecs = assets
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    dep = tmp_path / "deploy"
    r = CliRunner().invoke(main, [
        "serve", "--model", str(model_dir), "--task-vector", f"alpha={vecs['alpha'][1]}",
        "--task-vector", f"gamma={vecs['gamma'][1]}", "--dtype", "float32",
        "--max-model-len", "256", "--export", str(dep), "--enforce-eager"])
    assert r.exit_code == 0, r.output
    assert f"LTV_VLLM_DEPLOY={dep} vllm serve --config {dep / 'vllm.yaml'}" in r.output

    def vllm_serve(*flags: str):
        return lambda port: [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                             "--config", str(dep / "vllm.yaml"), "--port", str(port),
                             "--kv-cache-memory-bytes", str(64 << 20), *flags]

    env = {"LTV_VLLM_DEPLOY": str(dep)}
    proc, url, log = start_server(model_dir, [], tmp_path, layout="default",
                                  env_extra={**env, "LTV_VLLM_SHIFT_READ": "0.2"},
                                  launcher=vllm_serve())
    try:
        text = Path(log.name).read_text()
        assert re.search(r"selfcheck passed on vLLM", text), text[-2000:]
        check_mixed(url, {str(model_dir): None, "alpha": vecs["alpha"][0],
                          "gamma": vecs["gamma"][0]}, model, tokenizer, per_request=True)
        r = HTTP.post(f"{url}/v1/completions", json={
            "model": "alpha", "prompt": "hi", "max_tokens": 2, "use_beam_search": True})
        assert r.status_code == 400 and "beam search" in r.text, r.text
        # the gate's admission: a task named without the gate's stamp on another route
        r = HTTP.post(f"{url}/inference/v1/generate", json={
            "model": "alpha", "token_ids": [1, 2], "sampling_params": {"max_tokens": 1}})
        assert r.status_code >= 400, r.text
        # per task: check_mixed's three rounds of one request per prompt (3, 4, 5 tokens,
        # every step shifted: these vectors record no policy); the refusals above: none
        sent = 3 * len(PROMPTS)
        tokens = (3 + 4 + 5) * len(PROMPTS)
        size = "ltv_vllm:task_shift_relative_size"
        got = wait_for(url, f"{size}_count", "alpha", tokens, headers={})
        for task in ("alpha", "gamma"):
            assert value(got, "ltv_vllm:task_requests_total", task=task) == sent, task
            assert value(got, "ltv_vllm:task_generation_tokens_total", task=task) == tokens
        assert value(got, f"{size}_count", task="gamma") == 0  # logit-space: no h to shift
        # one token per prompt more: the sum's step is transformers' ‖U Vᵀ h‖ / ‖h‖
        before = value(got, f"{size}_sum", task="alpha")
        for p in PROMPTS:
            assert HTTP.post(f"{url}/v1/completions", timeout=60, json={
                "model": "alpha", "prompt": p, "max_tokens": 1}).status_code == 200
        got = wait_for(url, f"{size}_count", "alpha", tokens + len(PROMPTS), headers={})
        want = shift_size_sum(model, tokenizer, vecs["alpha"][0], PROMPTS)
        assert value(got, f"{size}_sum", task="alpha") - before == pytest.approx(want, rel=1e-4)
        assert value(samples(url, {}), "ltv_vllm:task_requests_total", task="alpha") == (
            sent + len(PROMPTS))
        assert_quiet(log)  # in steady state: every read of the shift sizes answered
    finally:
        stop(proc, log)
    # the user's own --served-model-name on the command line wins over the config file in
    # vLLM, and the tasks would be gone: the server refuses to start, saying why
    with pytest.raises(RuntimeError, match=r"served model names \['mine'\] lack"):
        start_server(model_dir, [], tmp_path, env_extra=env, attempts=1, layout="default",
                     launcher=vllm_serve("--served-model-name", "mine"))
