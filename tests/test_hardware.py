"""`--dtype auto` resolves to what the device computes natively (one rule, `resolve_dtype`)."""

from __future__ import annotations

import json

import pytest
import torch

from ltv_vllm.errors import UserError
from ltv_vllm.models import hardware
from ltv_vllm.models.hardware import checkpoint_dtype, resolve_dtype, resolve_for_model


@pytest.fixture()
def cpu(monkeypatch):
    """Set what the CPU check answers (the real check is cached per process)."""

    def set_native(native: bool) -> None:
        monkeypatch.setattr(hardware, "cpu_native_bf16", lambda: native)

    return set_native


@pytest.mark.parametrize("native,checkpoint,expected", [
    (False, "bfloat16", "float32"),   # AVX2-only: bf16 is emulated, ~5x slower
    (False, None, "float32"),
    (False, "float16", "float32"),
    (True, "bfloat16", "bfloat16"),   # AVX512-BF16 / AMX: native
    (True, None, "bfloat16"),
    (True, "float32", "float32"),     # auto never casts a float32 checkpoint down on a CPU
    (False, "float32", "float32"),
])
def test_auto_on_cpu(cpu, native, checkpoint, expected):
    cpu(native)
    assert resolve_dtype("auto", device="cpu", checkpoint=checkpoint) == expected


@pytest.mark.parametrize("bf16,expected", [(True, "bfloat16"), (False, "float16")])
def test_auto_on_cuda(monkeypatch, cpu, bf16, expected):
    cpu(False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *_a, **_k: bf16)
    for checkpoint in ("bfloat16", "float32", None):
        assert resolve_dtype("auto", device="cuda", checkpoint=checkpoint) == expected
        assert resolve_dtype("auto", device="cuda:1", checkpoint=checkpoint) == expected


@pytest.mark.parametrize("native", [True, False])
def test_explicit_dtype_is_taken_as_given(cpu, native):
    cpu(native)
    for dt in ("bfloat16", "float16", "float32"):
        assert resolve_dtype(dt, device="cpu", checkpoint="bfloat16") == dt
    with pytest.raises(UserError, match="dtype must be one of"):
        resolve_dtype("float8", device="cpu")


def test_checkpoint_dtype_and_model_directories(tmp_path, cpu):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps({"text_config": {"dtype": "float32"}}))
    assert checkpoint_dtype(tmp_path / "a") == "bfloat16"
    assert checkpoint_dtype(tmp_path / "b") == "float32"
    assert checkpoint_dtype(tmp_path / "missing") is None
    cpu(False)
    assert resolve_for_model("auto", tmp_path / "a", "cpu") == "float32"
    cpu(True)
    assert resolve_for_model("auto", tmp_path / "a", "cpu") == "bfloat16"
    assert resolve_for_model("auto", tmp_path / "b", "cpu") == "float32"


def test_real_check_on_this_machine():
    """The uncached answer agrees with the CPU's own flags (Linux x86: /proc/cpuinfo)."""
    import platform
    from pathlib import Path

    native = hardware.cpu_native_bf16()
    assert isinstance(native, bool)
    info = Path("/proc/cpuinfo")
    if platform.machine() == "x86_64" and info.exists():
        flags = set(next((ln for ln in info.read_text().splitlines() if ln.startswith("flags")),
                         "").split())
        assert native == bool({"avx512_bf16", "amx_bf16"} & flags)
    expected = "bfloat16" if native else "float32"
    assert resolve_dtype("auto", device="cpu", checkpoint="bfloat16") == expected
    hw = hardware.hardware()
    assert hw["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert hw["cpu_native_bf16"] == native
    line = hardware.machine_line(hw)
    # "no native bf16" contains "native bf16": the whole parenthesis, as machine_line writes it
    assert f"{hw['cpu_capability']} ({'native' if native else 'no native'} bf16)" in line, line


def test_load_model_uses_the_rule(tmp_path, tokenizer, cpu):
    """A bf16 checkpoint loads in float32 on a CPU without native bf16, in bf16 with it."""
    from conftest import make_llama
    from ltv_vllm.models.loading import load_model

    model = make_llama(len(tokenizer)).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    cpu(False)
    assert load_model(str(tmp_path / "m")).model.dtype == torch.float32
    cpu(True)
    assert load_model(str(tmp_path / "m")).model.dtype == torch.bfloat16
    assert load_model(str(tmp_path / "m"), dtype="float32").model.dtype == torch.float32


def test_device_auto_is_the_gpu_when_there_is_one(monkeypatch):
    """`--device auto` (the default of extract and evaluate): CUDA when torch has it, else
    the CPU; an explicit device is taken as given where this machine has it, refused in
    one line where it does not or where torch does not know it."""
    from ltv_vllm.models.hardware import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(UserError, match="no CUDA device"):
        resolve_device("cuda:1")
    with pytest.raises(UserError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda:1") == "cuda:1"
    assert resolve_device("cpu") == "cpu"


def test_extract_refuses_a_device_this_machine_lacks_before_loading(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cmd in (["extract", "--task", "sst2"], ["evaluate", "--tasks", "sst2"]):
        r = CliRunner().invoke(main, [*cmd, "--model", str(tmp_path / "nope"), "--device",
                                      "cuda"])
        assert r.exit_code == 1 and "no CUDA device" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output
