"""Configs an earlier release's `ltv-vllm serve --export` wrote keep starting: every dotted
name they hand vLLM (the gate's `--middleware`, the `--logits-processors`, the model
architecture ModelRegistry loads, the plugin entry points) still loads the class this
release serves with, and today's export of the same inputs is the same config and reads as
the same settings (`fixtures/export-0.1.0`, written at release 0.1.0). `test_user_deployment`
starts plain `vllm serve` from today's export."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from conftest import write_model_and_vectors
from ltv_vllm.cli import main
from ltv_vllm.serving.contract.settings import ENV, ServerSettings

FIXTURES = Path(__file__).parent / "fixtures" / "export-0.1.0"
KINDS = {"fused": ["--task-vector", "{good}"],
         "folded": ["--task-vector", "{good}", "--fold"],
         "shift": ["--task-vector", "a={good}", "--task-vector", "b={good}"],
         "lora": ["--task-vector", "a={good}", "--task-vector", "b={good}",
                  "--multi-task", "lora"]}


def load(dotted: str, sep: str) -> object:
    module, _, name = dotted.rpartition(sep)
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_earlier_release_config_names_todays_classes(kind):
    from ltv_vllm.serving.api_server import gate, task_gates
    from ltv_vllm.serving.contract.names import WRAPPERS, model_class
    from ltv_vllm.serving.engine import models, steps

    config = yaml.safe_load((FIXTURES / kind / "vllm.yaml").read_text())
    middleware = load(config["middleware"], ".")
    name = config["middleware"].rpartition(".")[2]
    assert middleware is (getattr(gate, name, None) or getattr(task_gates, name))
    assert issubclass(middleware, gate.Gate)
    processor = load(config["logits-processors"], ":")
    assert processor is getattr(steps, config["logits-processors"].rpartition(":")[2])
    for arch in json.loads(config["hf-overrides"])["architectures"]:
        assert arch in WRAPPERS.values()
        assert load(model_class(arch), ":") is getattr(models, arch)


def test_the_plugin_entry_points_load_todays_code():
    from importlib.metadata import entry_points

    from ltv_vllm.serving.api_server.endpoints import TaskEndpoints
    from ltv_vllm.serving.vllm_ext import register

    general = {e.name: e for e in entry_points(group="vllm.general_plugins")}
    endpoint = {e.name: e for e in entry_points(group="vllm.endpoint_plugins")}
    assert general["ltv_vllm"].value == "ltv_vllm.serving.vllm_ext:register"
    assert general["ltv_vllm"].load() is register
    assert endpoint["ltv_tasks"].value == "ltv_vllm.serving.vllm_ext.endpoints:TaskEndpoints"
    assert endpoint["ltv_tasks"].load() is TaskEndpoints


def normalized(text: str, root: Path) -> str:
    text = text.replace(str(root), "<ROOT>")
    return re.sub(r"(selfcheck|adapters)/[0-9a-f]{12}", r"\1/<hash>", text)


def test_todays_export_is_the_earlier_releases(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    good, _ = write_model_and_vectors(tmp_path, tokenizer)
    for kind, args in KINDS.items():
        out = tmp_path / "out" / kind
        # eager and float32 as the release's export chose them on a CPU, given here so a GPU
        # machine writes the same
        r = CliRunner().invoke(main, ["serve", "--model", str(tmp_path / "m"),
                                      *(a.format(good=good) for a in args),
                                      "--dtype", "float32", "--export", str(out),
                                      "--enforce-eager"])
        assert r.exit_code == 0, r.output
        assert (normalized((out / "vllm.yaml").read_text(), tmp_path)
                == (FIXTURES / kind / "vllm.yaml").read_text()), kind
        # the environment: every variable 0.1.0 wrote, the same; its settings read today
        # as today's settings of the same server (a field added since at its default)
        old = json.loads((FIXTURES / kind / "environment.json").read_text())
        new = json.loads(normalized((out / "environment.json").read_text(), tmp_path))
        new["env"].pop("VLLM_PLUGINS", None)
        assert new["admit_every"] == old["admit_every"], kind
        assert {k: v for k, v in new["env"].items() if k != ENV} == {
            k: v for k, v in old["env"].items() if k != ENV}, kind
        assert ServerSettings.from_env(old["env"]) == ServerSettings.from_env(new["env"]), kind
