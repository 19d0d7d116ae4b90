"""A user's own vLLM deployment survives `ltv-vllm serve`: their served model name, their LoRA
adapter and another installed vLLM plugin, through the real server.

Each server holds a task vector (alpha), a user's LoRA adapter (`ad`, an lm_head adapter made
from another vector, beta: its answers are beta's shift at every step) and the user's served
name (`mine`, the bare model); concurrent mixed requests are checked against transformers with
the right vector (`test_server.check_mixed`: within 1e-4 and told apart from every other
answer). A third-party general plugin, installed for the test on PYTHONPATH, writes a file when
vLLM loads it in the server's processes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_server import check_mixed, make_assets, start_server, stop

from ltv_vllm.serving.lora import export_lora

pytestmark = pytest.mark.slow(seconds=110)  # see conftest's ordering

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
           "OTHER_PLUGIN_MARK": str(mark)}
    user = ["--served-model-name", "mine", "--lora-modules", f"ad={adapter}",
            "--max-lora-rank", "8"]
    if mode == "shift":  # LoRA is the user's own here: all of it theirs to give
        user += ["--enable-lora", "--lora-target-modules", "lm_head"]
    proc, url, log = start_server(model_dir, [f"alpha={alpha[1]}"], tmp_path,
                                  ("--multi-task", mode, *user), env_extra=env)
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
    finally:
        stop(proc, log)
