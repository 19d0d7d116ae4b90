"""Cross-model transfer: the logit-space fit against direct solves and transformers' forward.

Two tiny random models share one tokenizer and differ in hidden size (source 96 / 3 layers,
target 64 / 2 layers). The independent path: states and logits from plain full-prompt
forwards (`output_hidden_states`, `.logits`, no shared cache), W̃ from `torch.linalg.solve`.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from conftest import make_llama, make_tokenizer, write_model_pair
from ltv_vllm.cli import main
from ltv_vllm.core.ridge import ridge_fit
from ltv_vllm.core.vector import load_task_vector
from ltv_vllm.extraction.apply import task_vector_applied
from ltv_vllm.extraction.capture import Capturer
from ltv_vllm.extraction.store import StoredCapturer
from ltv_vllm.extraction.transfer import (
    TransferError,
    check_same_tokenizer,
    fit_transfer,
    full_logits,
    transfer_label_logits,
)
from ltv_vllm.models.loading import load_model
from ltv_vllm.pipeline.extract import ExtractOptions
from ltv_vllm.pipeline.transfer import (
    SourceOptions,
    extract_transfer,
    open_source,
    run_transfer_episode,
)
from ltv_vllm.tasks.data import load_dataset, sample_episode
from ltv_vllm.tasks.specs import get_task, label_token_ids

pytestmark = pytest.mark.slow(seconds=4)  # see conftest's ordering

WORDS = ["the", "plot", "is", "dull", "and", "acting", "worse", "a", "gorgeous", "witty", "movie"]
LAM = 5.0


def direct_solve(h: torch.Tensor, y: torch.Tensor, lam: float) -> torch.Tensor:
    """W = Y Hᵀ (H Hᵀ + λI)⁻¹ with columns as samples, float64. (d_out, d_in)"""
    H, Y = h.double().T, y.double().T
    A = H @ H.T + lam * torch.eye(H.shape[0], dtype=torch.float64)
    return torch.linalg.solve(A, H @ Y.T).T  # A symmetric: (Y Hᵀ A⁻¹)ᵀ = A⁻¹ H Yᵀ


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = write_model_pair(tmp_path_factory.mktemp("pair"), WORDS)
    # a model whose tokenizer adds BOS: same vocabulary, other ids for every prompt
    make_llama(len(make_tokenizer()), hidden=64, layers=2, seed=13).save_pretrained(root / "bos")
    make_tokenizer(bos=True).save_pretrained(root / "bos")
    return root


# -- the maths ----------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "d"), [(40, 16), (12, 16)])  # primal and dual form
def test_same_model_logit_fit_is_head_times_hidden_fit(n, d):
    """Paper: with L = S the logit-space W̃ equals W_lm W* (ridge is linear in its targets)."""
    g = torch.Generator().manual_seed(n)
    W, b = torch.randn(50, d, generator=g), torch.randn(50, generator=g)
    h_zs, h_icl = 3 * torch.randn(n, d, generator=g), 3 * torch.randn(n, d, generator=g)
    hidden = ridge_fit(h_zs, h_icl - h_zs, LAM)
    logit = fit_transfer(h_zs, h_icl @ W.T + b, h_zs @ W.T + b, LAM)  # the bias cancels
    expected = W.double() @ hidden.dense().double()
    assert logit.U.shape == (50, logit.V.shape[1]) and logit.V.shape[0] == d
    torch.testing.assert_close(logit.dense().double(), expected, rtol=1e-4,
                               atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize(("v_source", "v_target"), [(30, 34), (34, 30), (32, 32)])
def test_fit_transfer_equals_direct_solve_on_shared_vocab(v_source, v_target):
    """Padded heads of different length: fit the shared rows, leave the target's extra ones."""
    g = torch.Generator().manual_seed(v_source)
    h = 2 * torch.randn(20, 8, generator=g)
    z_icl, z_zs = torch.randn(20, v_source, generator=g), torch.randn(20, v_target, generator=g)
    f = fit_transfer(h, z_icl, z_zs, LAM)
    shared = min(v_source, v_target)
    expected = direct_solve(h, z_icl[:, :shared] - z_zs[:, :shared], LAM)
    got = f.dense().double()
    assert got.shape == (v_target, 8)
    torch.testing.assert_close(got[:shared], expected, rtol=1e-4, atol=1e-5)
    assert got[shared:].abs().max().item() == 0.0 if v_target > shared else True


def test_full_logits_in_vocab_blocks():
    g = torch.Generator().manual_seed(0)
    h, W, b = (torch.randn(5, 16, generator=g), torch.randn(23, 16, generator=g),
               torch.randn(23, generator=g))
    torch.testing.assert_close(full_logits(h, W.bfloat16(), b, rows=7),
                               h @ W.bfloat16().float().T + b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full_logits(h, W, None, rows=100), h @ W.T)


def test_transfer_label_logits_uses_only_label_rows():
    g = torch.Generator().manual_seed(1)
    h, W = torch.randn(6, 8, generator=g), torch.randn(30, 8, generator=g)
    f = fit_transfer(torch.randn(10, 8, generator=g), torch.randn(10, 30, generator=g),
                     torch.randn(10, 30, generator=g), LAM)
    ids = [4, 17, 2]
    full = h @ W.T + f.apply(h)
    got = transfer_label_logits(h, W[ids], torch.zeros(3), f, ids)
    torch.testing.assert_close(got, full[:, ids], rtol=1e-5, atol=1e-5)


# -- end to end with two tiny models ------------------------------------------------------
def _last_state_and_logits(model, tok, prompts):
    hs, zs = [], []
    with torch.no_grad():
        for p in prompts:
            out = model(torch.tensor([tok(p)["input_ids"]]), output_hidden_states=True)
            hs.append(out.hidden_states[-1][0, -1])  # transformers applies the final norm here
            zs.append(out.logits[0, -1])
    return torch.stack(hs), torch.stack(zs)


def test_transfer_vector_matches_independent_computation(pair, tmp_path):
    out = tmp_path / "toy.transfer.safetensors"
    r = CliRunner().invoke(main, [
        "extract", "--model", str(pair / "target"), "--source-model", str(pair / "source"),
        "--task", str(pair / "toy.json"), "--n", "24", "--n-test", "20", "--dtype", "float32",
        "--source-dtype", "float32", "--work-dir", str(tmp_path / "work"), "--chunk-size", "8",
        "-o", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    tv = load_task_vector(out)
    assert tv.kind == "logit" and tv.meta["k_used"] == 10  # the paper's transfer setting
    assert tv.U.shape == (400, tv.rank) and tv.V.shape == (64, tv.rank)
    assert tv.meta["source_model"]["hidden_size"] == 96

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pair / "target")
    src = AutoModelForCausalLM.from_pretrained(pair / "source", dtype=torch.float32).eval()
    tgt = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).eval()
    task = get_task(str(pair / "toy.json"))
    ep = sample_episode(load_dataset(task), k=10, n=24, n_test=20, seed=0)
    queries = [task.query(e.text) for e in ep.queries]
    h_zs, z_zs = _last_state_and_logits(tgt, tok, queries)
    _, z_icl = _last_state_and_logits(src, tok, [ep.demo_prefix() + q for q in queries])
    W_direct = direct_solve(h_zs, z_icl - z_zs, LAM)  # (vocab, d_S)
    got = (tv.U @ tv.V.T).double()
    scale = W_direct.abs().max().item()
    torch.testing.assert_close(got, W_direct, rtol=1e-3, atol=1e-3 * scale)

    # Applied with the transformers reference hook: z = z_zs + W̃ h_zs on the target.
    tests = [task.query(e.text) for e in ep.test]
    h_t, z_t = _last_state_and_logits(tgt, tok, tests)
    with task_vector_applied(tgt, tv), torch.no_grad():
        hooked = torch.stack([tgt(torch.tensor([tok(p)["input_ids"]])).logits[0, -1]
                              for p in tests])
    torch.testing.assert_close(hooked.double(), (z_t.double() + h_t.double() @ W_direct.T),
                               rtol=1e-3, atol=1e-3 * hooked.abs().max().item())
    ids = list(tv.label_token_ids)
    labels = torch.tensor([e.label for e in ep.test])
    acc = (hooked[:, ids].argmax(-1) == labels).double().mean().item()
    assert tv.meta["metrics"]["ltv-transfer"]["accuracy"] == pytest.approx(acc)
    assert "wrote" in r.output and "source captures in" in r.output


def test_same_model_transfer_reproduces_ltv(pair):
    """Source = target: the transferred vector scores exactly like the model's own LTV."""
    lm = load_model(str(pair / "target"), dtype="float32")
    source = open_source(SourceOptions(str(pair / "target"), dtype="float32", work_dir=None,
                                       progress=False))
    task = get_task(str(pair / "toy.json"))
    ep = sample_episode(load_dataset(task), k=10, n=24, n_test=20, seed=1)
    ids = label_token_ids(task, lm.tokenizer)
    cap = Capturer(lm.model, lm.tokenizer, batch_size=4, progress=False)
    res, ct, _ = run_transfer_episode(cap, source, ep, LAM, ids)
    w_c = lm.model.lm_head.weight[ids].detach()
    z_tr = transfer_label_logits(ct.h_zs_test, w_c, torch.zeros(len(ids)), res.factors, ids)
    z_ltv = res.target.logits["ltv"]
    torch.testing.assert_close(z_tr, z_ltv, rtol=1e-4, atol=1e-4 * z_ltv.abs().max().item())
    assert res.metrics["ltv-transfer"]["accuracy"] == res.metrics["ltv"]["accuracy"]
    assert res.metrics["source-icl"]["accuracy"] == res.metrics["icl"]["accuracy"]


def test_interrupted_source_pass_resumes(pair, tmp_path):
    lm = load_model(str(pair / "source"), dtype="float32")
    prompts = [f"Review: {w} movie\nSentiment:" for w in WORDS]  # 11 prompts, chunks of 3
    calls: list[int] = []

    class Flaky(Capturer):
        def hidden(self, ps, desc="forward"):
            calls.append(len(ps))
            if len(calls) == 3:
                raise KeyboardInterrupt  # the process dies in the third chunk
            return super().hidden(ps, desc)

    def make():
        return Flaky(lm.model, lm.tokenizer, batch_size=2, progress=False)

    store = StoredCapturer(tmp_path, {"model": "x"}, make, chunk_size=3, progress=False)
    with pytest.raises(KeyboardInterrupt):
        store.hidden(prompts)
    files = sorted(p.name for p in store.dir.iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) == 2
    assert all(f.endswith((".safetensors", ".json")) for f in files)  # no temp file left

    again = StoredCapturer(tmp_path, {"model": "x"}, make, chunk_size=3, progress=False)
    h = again.hidden(prompts)
    assert (again.reused, again.computed) == (2, 2) and calls == [3, 3, 3, 3, 2]
    ref = Capturer(lm.model, lm.tokenizer, batch_size=11, progress=False).hidden(prompts)
    torch.testing.assert_close(h, ref, rtol=1e-5, atol=1e-5)
    # another key (other weights, dtype, quantisation) never sees these chunks
    other = StoredCapturer(tmp_path, {"model": "y"}, make, chunk_size=3, progress=False)
    assert other.dir != again.dir


def test_finished_source_pass_is_not_loaded_again(pair, tmp_path):
    lm = load_model(str(pair / "target"), dtype="float32")
    task = get_task(str(pair / "toy.json"))
    vectors = []
    for _ in range(2):
        source = open_source(SourceOptions(str(pair / "source"), dtype="float32",
                                           work_dir=str(tmp_path), chunk_size=16, progress=False))
        tv, _ = extract_transfer(lm, source, task, ExtractOptions(n=24, n_test=20, progress=False))
        vectors.append((tv, source.cap.loaded, source.cap.computed))
    (first, loaded1, computed1), (second, loaded2, computed2) = vectors
    assert loaded1 and computed1 > 0
    assert not loaded2 and computed2 == 0  # LM head read from the checkpoint instead
    torch.testing.assert_close(first.U, second.U)
    torch.testing.assert_close(first.V, second.V)


# -- refusals -----------------------------------------------------------------------------
def test_different_tokenizers_refused_before_any_pass(pair, tmp_path):
    out = tmp_path / "x.pt"
    r = CliRunner().invoke(main, [
        "extract", "--model", str(pair / "bos"), "--source-model", str(pair / "source"),
        "--task", str(pair / "toy.json"), "--n", "24", "--n-test", "20",
        "--work-dir", str(tmp_path / "work"), "-o", str(out), "--quiet"])
    assert r.exit_code == 1
    msg = r.output.strip().splitlines()[-1]
    assert msg.startswith("Error:") and "tokenize" in msg and "differently" in msg
    assert not out.exists()
    assert not list((tmp_path / "work").rglob("*.safetensors"))  # no source pass ran


def test_different_vocabularies_refused():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["another corpus entirely"] * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    other = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")
    with pytest.raises(TransferError, match="do not share a tokenizer"):
        check_same_tokenizer(make_tokenizer(), other, ["Review: x"])
    check_same_tokenizer(make_tokenizer(), make_tokenizer(), ["Review: x\nSentiment:"])


def test_ltv_transfer_needs_a_source(pair):
    r = CliRunner().invoke(main, ["evaluate", "--model", str(pair / "target"), "--tasks",
                                  str(pair / "toy.json"), "--methods", "ltv,ltv-transfer"])
    assert r.exit_code == 1 and "needs --source-model" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_evaluate_transfer_table(pair, tmp_path):
    out = tmp_path / "eval"
    r = CliRunner().invoke(main, [
        "evaluate", "--model", str(pair / "target"), "--source-model", str(pair / "source"),
        "--tasks", str(pair / "toy.json"), "--runs", "2", "--n", "24", "--n-test", "20",
        "--dtype", "float32", "--source-dtype", "float32", "--work-dir", str(tmp_path / "w"),
        "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["methods"] == ["zero-shot", "icl", "ltv", "source-zero-shot",
                                        "source-icl", "source-ltv", "ltv-transfer"]
    assert doc["config"]["k_per_task"] == {"toy": 10}
    md = (out / "results.md").read_text()
    assert "Transferred LTV (source → target)" in md and "Δ transferred − target LTV" in md
    # run 0 is the episode `extract --seed 0` fits: same vector, same score
    lm = load_model(str(pair / "target"), dtype="float32")
    source = open_source(SourceOptions(str(pair / "source"), dtype="float32",
                                       work_dir=str(tmp_path / "w"), progress=False))
    _, res = extract_transfer(lm, source, get_task(str(pair / "toy.json")),
                              ExtractOptions(n=24, n_test=20, progress=False))
    rec = next(x for x in doc["records"] if x["run"] == 0 and x["method"] == "ltv-transfer")
    assert rec["accuracy"] == pytest.approx(res.metrics["ltv-transfer"]["accuracy"])
    assert rec["d_ntp"] == pytest.approx(res.metrics["ltv-transfer"]["d_ntp"], rel=1e-4)
    assert source.cap.computed == 0  # evaluate's source captures were reused


def test_source_loading_options(pair, tmp_path):
    """device_map (accelerate) gives the same captures; bitsandbytes without CUDA is refused
    up front, before the target's passes."""
    prompts = [f"Review: {w} movie\nSentiment:" for w in WORDS[:5]]
    plain = open_source(SourceOptions(str(pair / "source"), dtype="float32",
                                      work_dir=str(tmp_path / "a"), progress=False))
    mapped = open_source(SourceOptions(str(pair / "source"), dtype="float32", device_map="cpu",
                         work_dir=str(tmp_path / "b"), progress=False))
    torch.testing.assert_close(mapped.cap.hidden(prompts), plain.cap.hidden(prompts),
                               rtol=1e-5, atol=1e-5)
    if not torch.cuda.is_available():
        r = CliRunner().invoke(main, [
            "extract", "--model", str(pair / "target"), "--source-model", str(pair / "source"),
            "--task", str(pair / "toy.json"), "--source-quantization", "4bit",
            "--work-dir", str(tmp_path / "c"), "-o", str(tmp_path / "q.pt"), "--quiet"])
        assert r.exit_code == 1 and "needs a CUDA GPU" in r.output.strip().splitlines()[-1]
        assert not (tmp_path / "q.pt").exists()
