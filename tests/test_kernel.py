"""Kernel LTV: the RBF kernel ridge fit against direct dense solves and explicit
leave-one-out refits; its map against a hand-written sum and a hand-patched forward; its
file format; the refusals (fold, LoRA, rank cuts) before any engine starts."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from conftest import make_llama, write_model_and_vectors
from ltv_vllm.cli import main
from ltv_vllm.core.kernel import GAMMA_FACTORS, kernel_fit, rbf_delta
from ltv_vllm.core.ridge import lam_grid
from ltv_vllm.core.vector import TaskVector, VectorError, load_task_vector, model_identity


def _problem(n=10, d=4, d_out=3, seed=3):
    g = torch.Generator().manual_seed(seed)
    h = 2 * torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.tanh(h @ torch.randn(d, d_out, generator=g, dtype=torch.float64))
    return h, y


def test_kernel_fit_is_the_dual_solve_at_the_explicit_leave_one_out_optimum():
    h, y = _problem()
    n = h.shape[0]
    D = torch.cdist(h, h) ** 2
    med = float(D[~torch.eye(n, dtype=torch.bool)].median())
    best, errs = None, {}
    for c in GAMMA_FACTORS:
        K = torch.exp(-(c / med) * D)
        for lam in lam_grid(K):
            sq = 0.0
            for i in range(n):  # refit without sample i, predict it
                keep = [j for j in range(n) if j != i]
                alpha = torch.linalg.solve(K[keep][:, keep] + lam * torch.eye(n - 1,
                                           dtype=K.dtype), y[keep])
                sq += float(((K[i, keep] @ alpha - y[i]) ** 2).sum())
            errs[c / med, lam] = sq / n
    best = min(errs, key=errs.__getitem__)
    kf = kernel_fit(h, y)
    assert kf.gamma == pytest.approx(best[0], rel=1e-9)
    assert kf.lam == pytest.approx(best[1], rel=1e-9)
    K = torch.exp(-kf.gamma * D)
    A = torch.linalg.solve(K + kf.lam * torch.eye(n, dtype=K.dtype), y).T  # (d_out, N)
    torch.testing.assert_close(kf.U.double(), A, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kf.V.double(), h.T, atol=1e-6, rtol=1e-6)
    # the fit reproduces its training targets about as well as LOO says
    fitted = rbf_delta(h.float(), kf.U, kf.V, kf.gamma).double()
    assert float(((fitted - y) ** 2).sum(1).mean()) <= errs[best] + 1e-6


def test_rbf_delta_is_a_hand_written_sum_and_keeps_the_requested_rows():
    g = torch.Generator().manual_seed(1)
    U, V = torch.randn(6, 5, generator=g), torch.randn(4, 5, generator=g)
    h, bias = torch.randn(3, 4, generator=g), torch.randn(6, generator=g)
    got = rbf_delta(h, U, V, 0.2, bias)
    for b in range(3):
        want = bias.clone()
        for j in range(5):
            want += U[:, j] * torch.exp(-0.2 * ((h[b] - V[:, j]) ** 2).sum())
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rbf_delta(h, U, V, 0.2, bias, rows=slice(2, 5)), got[:, 2:5])


@pytest.fixture()
def kernel_tv(tokenizer):
    model = make_llama(len(tokenizer), seed=9)
    d = model.config.hidden_size
    g = torch.Generator().manual_seed(2)
    S = torch.randn(d, 7, generator=g)
    tv = TaskVector("hidden", 3 * torch.randn(d, 7, generator=g), S, None,
                    model_identity(model), (1, 2), {"task": {"name": "k"}}, map="rbf",
                    gamma=1.0 / (2 * d))
    return model, tv


def test_kernel_vector_in_transformers_equals_a_hand_patched_forward(kernel_tv):
    from ltv_vllm.extraction.apply import task_vector_applied

    model, tv = kernel_tv
    ids = torch.tensor([[5, 9, 3, 7, 11]])
    U, S, gamma = tv.U, tv.V, tv.gamma

    def by_hand(_m, args):
        h = args[0]
        shift = torch.zeros_like(h)
        for j in range(S.shape[1]):  # every row, every position: Σ_j U_j exp(−γ‖h − s_j‖²)
            w = torch.exp(-gamma * ((h - S[:, j]) ** 2).sum(-1, keepdim=True))
            shift = shift + w * U[:, j]
        return (h + shift, *args[1:])

    with torch.no_grad():
        handle = model.lm_head.register_forward_pre_hook(by_hand)
        want = model(ids).logits
        handle.remove()
        with task_vector_applied(model, tv):
            got = model(ids).logits
        plain = model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got - plain).abs().max() > 1e-2


def test_kernel_vector_file_round_trip_and_refusals(kernel_tv, tmp_path):
    from ltv_vllm.serving.store.lora import refuse_non_lora

    _model, tv = kernel_tv
    for suffix in (".pt", ".safetensors"):
        back = load_task_vector(tv.save(tmp_path / f"k{suffix}"))
        assert back.map == "rbf" and back.gamma == tv.gamma
        h = torch.randn(2, tv.V.shape[0])
        torch.testing.assert_close(back.delta(h), tv.delta(h))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "k.safetensors"), "pt") as f:
        head = json.loads(f.metadata()["ltv_vllm"])
    assert head["format_version"] == 2 and head["map"] == {"kind": "rbf", "gamma": tv.gamma}
    linear = TaskVector("hidden", tv.U, tv.V, None, tv.model, (1, 2), tv.provenance)
    linear.save(tmp_path / "lin.safetensors")
    with safe_open(str(tmp_path / "lin.safetensors"), "pt") as f:
        head = json.loads(f.metadata()["ltv_vllm"])
    assert head["format_version"] == 1 and "map" not in head  # older readers still load it
    with pytest.raises(VectorError, match="nonlinear .* cut to a lower rank"):
        tv.truncated(2)
    with pytest.raises(VectorError, match="nonlinear .* carried as a LoRA"):
        refuse_non_lora(tv)
    with pytest.raises(VectorError, match="gamma"):
        TaskVector("hidden", tv.U, tv.V, None, tv.model, (1, 2), map="rbf")


def test_serve_refuses_to_fold_or_lora_a_kernel_vector_in_one_line(tmp_path, tokenizer,
                                                                    monkeypatch):
    good, _ = write_model_and_vectors(tmp_path, tokenizer)
    tv = load_task_vector(good)
    TaskVector("hidden", tv.U, tv.V, None, tv.model, tv.label_token_ids, tv.provenance,
               map="rbf", gamma=0.01).save(tmp_path / "kern.pt")
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    model = ["--model", "m"]
    for args, words in (
            (["serve", *model, "--task-vector", "kern.pt", "--fold", "--dry-run"],
             "cannot be folded into the LM head"),
            (["serve", *model, "--task-vector", "a=kern.pt", "--task-vector", f"b={good}",
              "--multi-task", "lora", "--dry-run"], "cannot be carried as a LoRA"),
            (["export-lora", "kern.pt", "-o", "lora", *model], "cannot be carried as a LoRA")):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1, r.output
        errors = [ln for ln in r.output.splitlines() if ln.startswith("Error: ")]
        assert len(errors) == 1 and words in errors[0], r.output
    r = CliRunner().invoke(main, ["serve", *model, "--task-vector", "kern.pt", "--dry-run"])
    assert r.exit_code == 0, r.output  # fused: served
    # multi-task with per-request tasks (the default) serves any map, as fused does
    r = CliRunner().invoke(main, ["serve", *model, "--task-vector", "a=kern.pt",
                                  "--task-vector", f"b={good}", "--dry-run"])
    assert r.exit_code == 0 and "TaskGate" in r.output, r.output
