"""export-lora: the PEFT adapter reproduces the task vector exactly (checked with PEFT itself)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_llama
from ltv_vllm.core.vector import TaskVector, VectorError, model_identity
from ltv_vllm.extraction.apply import task_vector_applied
from ltv_vllm.serving.store.lora import export_lora, lora_rank
from ltv_vllm.tasks.specs import BUILTIN_TASKS

PROMPT = "Review: the plot is dull\nSentiment:"


@pytest.mark.parametrize("kind", ["hidden", "logit"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("rank", [5, 8])
def test_peft_adapter_equals_hook(tmp_path, tokenizer, tie, rank, kind):
    from peft import PeftModel

    model = make_llama(len(tokenizer), seed=4, tie=tie)
    model.save_pretrained(tmp_path / "m")
    g = torch.Generator().manual_seed(rank)
    # hidden: U (d, r) shifts h; logit: U (vocab, r) is added to the logits (lora_B = U)
    U = (0.5 * torch.randn(64, rank, generator=g) if kind == "hidden"
         else 2.0 * torch.randn(len(tokenizer), rank, generator=g))
    tv = TaskVector(kind, U, torch.linalg.qr(torch.randn(64, rank, generator=g))[0], None,
                    model_identity(model, "tiny"), (1, 2),
                    {"task": BUILTIN_TASKS["sst2"].to_dict()})
    out = export_lora(tv, tmp_path / "m", tmp_path / "adapter")
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        with task_vector_applied(model, tv):
            ref = model(**ids).logits
        plain = model(**ids).logits
        peft_model = PeftModel.from_pretrained(make_llama(len(tokenizer), seed=4, tie=tie), out)
        got = peft_model(**ids).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert (ref - plain).abs().max() > 1e-2
    assert peft_model.peft_config["default"].r == lora_rank(rank)


def test_lora_refuses_wrong_model_and_bias(tmp_path, tokenizer):
    model = make_llama(len(tokenizer), seed=4)
    model.save_pretrained(tmp_path / "m")
    other = make_llama(len(tokenizer), seed=8)
    tv = TaskVector("hidden", torch.zeros(64, 2), torch.zeros(64, 2), None,
                    model_identity(other, "other"), (1, 2), {})
    with pytest.raises(VectorError, match="was extracted from other"):
        export_lora(tv, tmp_path / "m", tmp_path / "a")
    tvb = TaskVector("hidden", torch.zeros(64, 2), torch.zeros(64, 2), torch.ones(64),
                     model_identity(model, "m"), (1, 2), {})
    with pytest.raises(VectorError, match="bias"):
        export_lora(tvb, tmp_path / "m", tmp_path / "a")
    assert lora_rank(1) == 1 and lora_rank(9) == 16 and lora_rank(256) == 256
    with pytest.raises(VectorError):
        lora_rank(600)


def test_cli_export_lora(tmp_path, tokenizer):
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    model = make_llama(len(tokenizer), seed=4)
    model.save_pretrained(tmp_path / "m")
    tv = TaskVector("hidden", torch.ones(64, 3), torch.ones(64, 3), None,
                    model_identity(model, str(tmp_path / "m")), (1, 2), {})
    tv.save(tmp_path / "v.pt")
    r = CliRunner().invoke(main, ["export-lora", str(tmp_path / "v.pt"), "-o", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert {p.name for p in (tmp_path / "a").iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", "ltv_vllm.json"}


@pytest.mark.parametrize("kind", ["hidden", "logit"])
def test_cli_export_lora_rank(tmp_path, tokenizer, kind):
    """`export-lora --rank 3` of a rank-12 vector serves the rank-3 map closest to W in what
    it does to the logits, computed here independently; checked through PEFT itself."""
    from click.testing import CliRunner
    from peft import PeftModel

    from ltv_vllm.cli import main

    model = make_llama(len(tokenizer), seed=4)
    model.save_pretrained(tmp_path / "m")
    g = torch.Generator().manual_seed(2)
    d_out = 64 if kind == "hidden" else len(tokenizer)
    # raw factors, not SVD-ordered: the cut must find the top directions itself
    tv = TaskVector(kind, 0.3 * torch.randn(d_out, 12, generator=g),
                    0.3 * torch.randn(64, 12, generator=g),
                    None, model_identity(model, str(tmp_path / "m")), (1, 2),
                    {"task": BUILTIN_TASKS["sst2"].to_dict(), "metrics_rank": 12})
    tv.save(tmp_path / "v.pt")
    r = CliRunner().invoke(main, ["export-lora", str(tmp_path / "v.pt"), "-o", str(tmp_path / "a"),
                                  "--rank", "3"])
    assert r.exit_code == 0, r.output
    assert "rank 3, cut from 12" in r.output
    # no training states recorded (no gram): min ‖M (W − W_r)‖_F with M the LM head for a
    # hidden vector (its logits are what the adapter changes), I for a logit vector; by the
    # reduced-rank formula W_r = R⁻¹ P_r P_rᵀ R W (M = Q R, P_r: top singular vectors of R W)
    W = (tv.U @ tv.V.T).double()
    R = (torch.linalg.qr(model.lm_head.weight.detach().double())[1] if kind == "hidden"
         else torch.eye(d_out, dtype=torch.float64))
    P = torch.linalg.svd(R @ W)[0]
    Wr = torch.linalg.solve(R, P[:, :3] @ P[:, :3].T @ R @ W)
    P2, s2, Qt2 = torch.linalg.svd(Wr)
    best = TaskVector(kind, (P2[:, :3] * s2[:3]).float(), Qt2[:3].T.float(), None, tv.model,
                      (1, 2), {})
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        with task_vector_applied(model, best):
            ref = model(**ids).logits
        with task_vector_applied(model, tv):
            full = model(**ids).logits
        peft_model = PeftModel.from_pretrained(make_llama(len(tokenizer), seed=4), tmp_path / "a")
        got = peft_model(**ids).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert (full - ref).abs().max() > 1e-3  # the cut is real
    assert peft_model.peft_config["default"].r == lora_rank(3) == 8
    assert tv.truncated(3).meta == tv.meta and tv.truncated(12) is tv


def test_lowrank_fro_norm_equals_the_product_norm():
    from ltv_vllm.serving.store.lora import lowrank_fro_norm

    g = torch.Generator().manual_seed(3)
    B, A = torch.randn(50, 4, generator=g), torch.randn(4, 30, generator=g)
    direct = torch.linalg.matrix_norm((B.double() @ A.double()), "fro").item()
    assert lowrank_fro_norm(B, A) == pytest.approx(direct, rel=1e-12)


def test_gain_bound_refuses_corrupt_vectors(tmp_path, tokenizer):
    """A served vector may not move the logits 1e3x more than the LM head itself does."""
    from ltv_vllm.serving.store.lora import MAX_GAIN, lora_factors

    model = make_llama(len(tokenizer), seed=4)
    model.save_pretrained(tmp_path / "m")
    head = model.lm_head.weight.detach()
    g = torch.Generator().manual_seed(1)
    U, V = torch.randn(64, 3, generator=g), torch.randn(64, 3, generator=g)
    ident = model_identity(model, "m")
    task = {"task": BUILTIN_TASKS["sst2"].to_dict()}
    # factors ~1: served, and the adapter is written
    out = export_lora(TaskVector("hidden", U, V, None, ident, (1, 2), task), tmp_path / "m",
                      tmp_path / "ok")
    assert (out / "adapter_model.safetensors").is_file()
    # ×1e30: finite in float32, but the logit map is ~1e30 larger than the head's own
    big = TaskVector("hidden", U * 1e30, V, None, ident, (1, 2), task)
    ratio = (torch.linalg.matrix_norm(head.double() @ (U.double() * 1e30) @ V.double().T)
             / torch.linalg.matrix_norm(head.double())).item()
    assert ratio > MAX_GAIN
    with pytest.raises(VectorError) as e:
        export_lora(big, tmp_path / "m", tmp_path / "bad")
    assert str(e.value) == (f"task vector 'sst2' would move the logits {ratio:.1e}x more than "
                            "the LM head itself (limit 1e+03x): refused as corrupt")
    assert not (tmp_path / "bad" / "adapter_model.safetensors").exists()
    # W_lm U beyond float32 (a head of 10s times U of 3e38): overflow, said as such
    huge = TaskVector("hidden", torch.full((64, 3), 3e38), V, None, ident, (1, 2), task)
    with pytest.raises(VectorError) as e:
        lora_factors(huge, torch.full_like(head, 10.0))
    assert str(e.value) == "task vector 'sst2' overflows float32 on this LM head"
