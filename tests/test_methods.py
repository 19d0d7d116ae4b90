"""The task-vector methods (ltv_vllm.methods) on a tiny random Llama, each against an
independent computation: hand-made patched forwards, transformers' own modules, a direct
dense solve, the naive full-prompt sweep."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_llama, write_toy_task
from ltv_vllm.core.ridge import ridge_fit
from ltv_vllm.core.vector import VectorError, load_task_vector, model_identity
from ltv_vllm.extraction.capture import Capturer
from ltv_vllm.methods import METHODS, Artifact, Context, MethodOptions, load_artifact
from ltv_vllm.methods.base import at_last, decoder_layers, last_token_states, prefix_of
from ltv_vllm.methods.fv import indirect_effects, mean_head_activations, shuffled_prompts
from ltv_vllm.methods.mlp import fit_mlp, mlp_delta
from ltv_vllm.methods.sv import separator_positions
from ltv_vllm.tasks.data import load_dataset, sample_episode
from ltv_vllm.tasks.specs import get_task, label_token_ids

pytestmark = pytest.mark.slow(seconds=11)  # see conftest's ordering

WORDS = ["the", "plot", "is", "dull", "and", "acting", "worse", "a", "gorgeous", "movie"]


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_llama(len(tokenizer), seed=7, layers=3)


@pytest.fixture(scope="module")
def ctx(model, tokenizer, tmp_path_factory):
    task = get_task(str(write_toy_task(tmp_path_factory.mktemp("toy"), WORDS)))
    ep = sample_episode(load_dataset(task), k=6, n=24, n_test=12, seed=2, n_val=8)
    cap = Capturer(model, tokenizer, progress=False, batch_size=5)
    return Context(cap, ep, label_token_ids(task, tokenizer),
                   MethodOptions(progress=False, fv_prompts=4, fv_trials=3, batch_size=5))


@pytest.fixture(scope="module")
def artifacts(ctx):
    return {name: m.extract(ctx) for name, m in METHODS.items()}


def query_ids(ctx, i=0):
    return torch.tensor([ctx.cap.encode(ctx.episode.task.query(ctx.episode.test[i].text))])


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits[0, -1]


@pytest.mark.parametrize("name", list(METHODS))
def test_hook_changes_logits_and_removes_itself(model, ctx, artifacts, name):
    ids = query_ids(ctx)
    before = logits(model, ids)
    with METHODS[name].applied(model, artifacts[name]):
        during = logits(model, ids)
    assert (during - before).abs().max() > 1e-3  # the method acts
    assert torch.equal(logits(model, ids), before)  # and leaves nothing behind
    with pytest.raises(RuntimeError), METHODS[name].applied(model, artifacts[name]):
        raise RuntimeError("inside")
    assert torch.equal(logits(model, ids), before)  # removed on an error too


@pytest.mark.parametrize("name", ["ltv", "mean", "mlp"])
def test_hidden_space_shift_equals_hooked_forward(model, ctx, artifacts, name):
    """`shift` (scoring on captured states) is what the LM-head hook does in a forward."""
    ids = query_ids(ctx)
    h = ctx.cap.hidden([ctx.episode.task.query(ctx.episode.test[0].text)])
    with METHODS[name].applied(model, artifacts[name]):
        hooked = logits(model, ids)
    torch.testing.assert_close(hooked, model.lm_head(METHODS[name].shift(artifacts[name], h))[0],
                               atol=1e-4, rtol=1e-4)


def test_ltv_is_the_direct_ridge_solve(ctx, artifacts):
    h_zs, h_icl = ctx.states()
    H, Y = h_zs.double().T, (h_icl - h_zs).double().T
    W = Y @ H.T @ torch.linalg.inv(H @ H.T + 5.0 * torch.eye(H.shape[0], dtype=H.dtype))
    tv = artifacts["ltv"]
    torch.testing.assert_close((tv.U @ tv.V.T).double(), W, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(artifacts["mean"].bias, (h_icl - h_zs).mean(0))


def test_ltv_auto_takes_the_lam_whose_explicit_leave_one_out_error_is_least(ctx, artifacts):
    """ltv-auto's λ is the grid point with the least error over N explicit refits (each a
    direct solve without one train pair, predicting it); its map is the direct solve there."""
    from ltv_vllm.core.ridge import lam_grid

    h_zs, h_icl = ctx.states()
    h, y = h_zs.double(), (h_icl - h_zs).double()
    n, d = h.shape

    def refits(lam):
        err = 0.0
        for i in range(n):
            keep = [j for j in range(n) if j != i]
            H, Y = h[keep].T, y[keep].T
            W = Y @ H.T @ torch.linalg.inv(H @ H.T + lam * torch.eye(d, dtype=H.dtype))
            err += float(((W @ h[i] - y[i]) ** 2).sum())
        return err / n

    errs = {lam: refits(lam) for lam in lam_grid(h @ h.T)}
    best = min(errs, key=errs.__getitem__)
    tv = artifacts["ltv-auto"]
    assert tv.provenance.lam == pytest.approx(best, rel=1e-12)
    assert METHODS["ltv-auto"].params(tv) == {"lam": tv.provenance.lam}
    loo = tv.provenance.extra["lam_loo"]
    assert loo["errors"] == pytest.approx([errs[lam] for lam in loo["lams"]], rel=1e-6)
    H, Y = h.T, y.T
    W = Y @ H.T @ torch.linalg.inv(H @ H.T + best * torch.eye(d, dtype=H.dtype))
    torch.testing.assert_close((tv.U @ tv.V.T).double(), W, atol=1e-4, rtol=1e-3)


def test_tv_replacement_at_last_layer_is_the_final_norm_of_theta(model, ctx, artifacts):
    """Replacing the last layer's output leaves only the final norm and the LM head."""
    theta = artifacts["tv"].tensors["theta"]
    last = len(decoder_layers(model)) - 1
    art = Artifact("tv", {"theta": theta}, {"layer": last}, model_identity(model), (1, 2))
    with METHODS["tv"].applied(model, art):
        got = logits(model, query_ids(ctx))
    expected = model.lm_head(model.model.norm(theta[last]))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_tv_replacement_equals_a_hand_written_hook(model, ctx, artifacts):
    theta = artifacts["tv"].tensors["theta"]

    def write(_m, _a, out):  # the state written in by hand, independently of the method's hook
        out = out.clone()
        out[:, -1] = theta[1]
        return out

    art = Artifact("tv", {"theta": theta}, {"layer": 1}, model_identity(model), (1, 2))
    ids = query_ids(ctx, 3)
    handle = model.model.layers[1].register_forward_hook(write)
    try:
        expected = logits(model, ids)
    finally:
        handle.remove()
    with METHODS["tv"].applied(model, art):
        torch.testing.assert_close(logits(model, ids), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pack", [True, False])
def test_last_token_sweep_equals_full_forwards(model, ctx, artifacts, pack, monkeypatch):
    """One row per candidate layer against the cached earlier tokens == a full forward each,
    with the rows packed along one sequence (the default) and as a padded batch."""
    monkeypatch.setattr(ctx.cap, "pack", pack)
    assert ctx.cap.packed == pack
    theta = artifacts["tv"].tensors["theta"]
    ids = query_ids(ctx, 1)[0].tolist()
    layers = torch.arange(len(decoder_layers(model)))
    pre = prefix_of(ctx.cap, ids[:-1])  # the earlier tokens, unedited
    with at_last(model, theta, layers):
        fast = last_token_states(ctx.cap, ids, len(layers), pre)
    for ell in layers.tolist():
        with at_last(model, theta, ell):
            full = ctx.cap.hidden([ctx.cap.tokenizer.decode(ids)])
        torch.testing.assert_close(fast[ell], full[0], atol=1e-5, rtol=1e-5)


def block_states(model, tokenizer, texts, layer):
    """Block `layer`'s output at each text's last token, from transformers' own
    `hidden_states` (index layer + 1), one unpadded forward per text; the last block's entry
    there is after the final norm, so that one is read by a plain hook instead."""
    rows, last = [], []
    block = decoder_layers(model)[layer]
    handle = block.register_forward_hook(lambda _m, _a, out: last.append(out[0, -1]))
    try:
        for t in texts:
            ids = torch.tensor([tokenizer(t)["input_ids"]])
            with torch.no_grad():
                hs = model(ids, output_hidden_states=True).hidden_states
            rows.append(hs[layer + 1][0, -1] if layer + 2 < len(hs) else last[-1])
    finally:
        handle.remove()
    return torch.stack(rows)


@pytest.mark.parametrize("pack", [True, False])
def test_tapped_blocks_are_transformers_own_hidden_states(model, ctx, tokenizer, pack,
                                                         monkeypatch):
    """`Capturer.tapping`: zero-shot (padded batches) and ICL rows (after the demos' cache,
    packed or padded) carry each tapped block's state at the last token, then the final state
    the capture returns untapped."""
    monkeypatch.setattr(ctx.cap, "pack", pack)
    ep, task = ctx.episode, ctx.episode.task
    texts = [e.text for e in ep.queries[:7]]
    prefix = ep.demo_prefix()
    plain_zs = ctx.cap.hidden([task.zero_shot(t) for t in texts])
    plain_icl = ctx.cap.icl(prefix, [task.query(t) for t in texts])
    # not the last block: transformers' hidden_states holds it after the final norm
    with ctx.cap.tapping([1, 0]):
        zs = ctx.cap.hidden([task.zero_shot(t) for t in texts])
        icl = ctx.cap.icl(prefix, [task.query(t) for t in texts])
    d = model.config.hidden_size
    assert zs.shape == icl.shape == (7, 3 * d)
    for j, ell in enumerate([1, 0]):
        torch.testing.assert_close(zs[:, j * d:(j + 1) * d], block_states(
            model, tokenizer, [task.zero_shot(t) for t in texts], ell), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(icl[:, j * d:(j + 1) * d], block_states(
            model, tokenizer, [prefix + task.query(t) for t in texts], ell),
            atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(zs[:, 2 * d:], plain_zs, atol=1e-6, rtol=0)
    torch.testing.assert_close(icl[:, 2 * d:], plain_icl, atol=1e-6, rtol=0)


def test_ltv_layer_is_the_direct_ridge_solve_at_its_block(model, ctx, tokenizer, artifacts):
    """ltv-layer's map at its chosen block, against the dense ridge solve on that block's
    states taken from transformers' hidden states: zero-shot prompts and the full ICL
    prompts (demos written out, no cache)."""
    art = artifacts["ltv-layer"]
    (ell,) = art.layers
    ep, task = ctx.episode, ctx.episode.task
    h_zs = block_states(model, tokenizer, [task.zero_shot(e.text) for e in ep.queries], ell)
    h_icl = block_states(model, tokenizer,
                         [ep.demo_prefix() + task.query(e.text) for e in ep.queries], ell)
    H, Y = h_zs.double().T, (h_icl - h_zs).double().T
    W = Y @ H.T @ torch.linalg.inv(H @ H.T + 5.0 * torch.eye(H.shape[0], dtype=H.dtype))
    torch.testing.assert_close((art.U[0] @ art.V[0].T).double(), W, atol=1e-4, rtol=1e-3)
    assert str(art.policy) == "last" and art.bias is None
    assert METHODS["ltv-layer"].params(art)["layer"] == ell


def test_ltv_layer_choice_scores_each_block_as_its_own_full_forward(model, ctx):
    """The validation sweep's rows (one candidate block each, packed after the prompt's
    cache) equal a full forward of the prompt under that block's task, for every block."""
    from ltv_vllm.core.ridge import ridge_fit
    from ltv_vllm.methods.ltv_layer import _at_rows, layer_states, task_for

    n = len(decoder_layers(model))
    h_zs, h_icl, _ = layer_states(ctx, list(range(n)))
    fits = {ell: ridge_fit(h_zs[ell], h_icl[ell] - h_zs[ell], 5.0) for ell in range(n)}
    ids = query_ids(ctx, 2)[0].tolist()
    pre = prefix_of(ctx.cap, ids[:-1])  # the earlier tokens, unedited
    with _at_rows(ctx, fits, torch.arange(n)):
        fast = last_token_states(ctx.cap, ids, n, pre)
    for ell in range(n):
        with METHODS["ltv-layer"].applied(model, task_for(ctx, ell, fits[ell], {})):
            full = ctx.cap.hidden([ctx.cap.tokenizer.decode(ids)])
        torch.testing.assert_close(fast[ell], full[0], atol=1e-5, rtol=1e-5)
    assert (fast[0] - fast[n - 1]).abs().max() > 1e-4  # the blocks' maps differ


@pytest.mark.parametrize("pack", [True, False])
def test_fast_indirect_effect_equals_naive_patched_forwards(ctx, pack, monkeypatch):
    monkeypatch.setattr(ctx.cap, "pack", pack)
    mean_act = mean_head_activations(ctx)
    trials = shuffled_prompts(ctx)[:2]
    fast = indirect_effects(ctx, mean_act, trials, fast=True)
    naive = indirect_effects(ctx, mean_act, trials, fast=False)
    assert fast.shape == (3, 4) and fast.abs().max() > 1e-6
    torch.testing.assert_close(fast, naive, atol=1e-5, rtol=1e-4)
    part = indirect_effects(ctx, mean_act, trials, fast=False, layers=[0, 2])  # the benchmark's
    torch.testing.assert_close(part[[0, 2]], naive[[0, 2]])
    assert torch.equal(part[1], torch.zeros(4))


def test_shuffled_prompts_keep_the_demos_and_permute_their_labels(ctx):
    ep = ctx.episode
    task = ep.task
    shuffled = 0
    for prompt, label in shuffled_prompts(ctx):
        lines = prompt.split("\n")
        texts = [ln.removeprefix(task.in_prefix + ": ") for ln in lines[0:-2:2]]
        words = [ln.removeprefix(task.label_prefix + ": ") for ln in lines[1:-2:2]]
        assert texts == [e.text for e in ep.demos] and lines[-1] == task.label_prefix + ":"
        assert sorted(words) == sorted(task.labels[e.label] for e in ep.demos)
        shuffled += words != [task.labels[e.label] for e in ep.demos]
        query = lines[-2].removeprefix(task.in_prefix + ": ")
        assert [e.label for e in ep.queries if e.text == query] == [label]
    assert shuffled >= 1


def test_function_vector_is_the_sum_of_head_projections(model, ctx, artifacts):
    art = artifacts["fv"]
    mean_act = mean_head_activations(ctx)
    hd = mean_act.shape[2]
    expected = torch.zeros(model.config.hidden_size)
    for ell, j in art.params["heads"]:
        x = torch.zeros(mean_act.shape[1] * hd)
        x[j * hd:(j + 1) * hd] = mean_act[ell, j]
        expected += model.model.layers[ell].self_attn.o_proj(x).detach()  # head alone
    torch.testing.assert_close(art.tensors["fv"], expected, atol=1e-5, rtol=1e-4)
    top = art.tensors["indirect_effect"].flatten().topk(len(art.params["heads"])).indices
    assert sorted(top.tolist()) == sorted(ell * 4 + j for ell, j in art.params["heads"])


def test_sv_separators_are_the_label_prefix_colons(ctx):
    ep = ctx.episode
    ids, pos = separator_positions(ctx.cap, ep.task, ep.demos, ep.queries[0].text)
    assert len(pos) == len(ep.demos) + 1 and pos[-1] == len(ids) - 1
    for p in pos:
        upto = ctx.cap.tokenizer.decode(ids[: p + 1])
        assert upto.endswith(ep.task.label_prefix + ":")


@pytest.mark.parametrize("mode", ["replace", "add"])
def test_sv_equals_a_hand_made_forward(model, ctx, artifacts, mode):
    sv = artifacts["sv"].tensors["sv"]
    depth = 2

    def pre(ell):
        def hook(_m, args):
            x = args[0].clone()
            x[:, -1] = x[:, -1] + sv[ell] if mode == "add" else sv[ell]
            return (x,)
        return hook

    ids = query_ids(ctx, 2)
    handles = [model.model.layers[ell].self_attn.o_proj.register_forward_pre_hook(pre(ell))
               for ell in range(depth)]
    try:
        expected = logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    art = Artifact("sv", {"sv": sv}, {"depth": depth, "mode": mode}, model_identity(model), (1,))
    with METHODS["sv"].applied(model, art):
        torch.testing.assert_close(logits(model, ids), expected, atol=1e-5, rtol=1e-5)


def test_i2cl_with_lambda_zero_beta_one_is_zero_shot_exactly(model, ctx, artifacts):
    a = artifacts["i2cl"]
    off = Artifact("i2cl", a.tensors, {"lam": 0.0, "beta": 1.0}, a.model, a.label_token_ids)
    ids = query_ids(ctx)
    zero_shot = logits(model, ids)
    with METHODS["i2cl"].applied(model, off):
        assert torch.equal(logits(model, ids), zero_shot)


def test_i2cl_context_vectors_are_module_outputs_of_demos_alone(model, ctx, artifacts):
    """Layer 0's attention and MLP outputs at each demo's last token, from its own modules."""
    ep = ctx.episode
    layer = model.model.layers[0]
    attn, ffn = [], []
    for e in ep.demos:
        ids = torch.tensor([ctx.cap.encode(ep.task.demo(e.text, e.label))])
        with torch.no_grad():
            x = model.model.embed_tokens(ids)
            cos_sin = model.model.rotary_emb(x, torch.arange(ids.shape[1])[None])
            a, _ = layer.self_attn(layer.input_layernorm(x), position_embeddings=cos_sin,
                                   attention_mask=None)  # causal by default
            m = layer.mlp(layer.post_attention_layernorm(x + a))
        attn.append(a[0, -1])
        ffn.append(m[0, -1])
    got = artifacts["i2cl"].tensors
    torch.testing.assert_close(got["c_attn"][0], torch.stack(attn).mean(0), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["c_mlp"][0], torch.stack(ffn).mean(0), atol=1e-5, rtol=1e-4)


def hand_i2cl(model, c_attn, c_mlp, coef):
    """Forward hooks written out by hand: layer ℓ's attention / MLP output o → β o + λ c."""
    hs = []
    for ell, layer in enumerate(model.model.layers):
        for mod, c, m in ((layer.self_attn, c_attn[ell], 0), (layer.mlp, c_mlp[ell], 1)):
            lam, beta = float(coef[ell, m, 0]), float(coef[ell, m, 1])

            def hook(_m, _a, out, lam=lam, beta=beta, c=c):
                if isinstance(out, tuple):
                    return (beta * out[0] + lam * c, *out[1:])
                return beta * out + lam * c
            hs.append(mod.register_forward_hook(hook))
    return hs


def demos_loss_by_hand(model, ctx, art, coef):
    """Mean cross-entropy of each demo's label token, the demo asked as a zero-shot query."""
    ep = ctx.episode
    hs = hand_i2cl(model, art.tensors["c_attn"], art.tensors["c_mlp"], coef)
    try:
        losses = []
        for e in ep.demos:
            z = logits(model, torch.tensor([ctx.cap.encode(ep.task.query(e.text))])).double()
            losses.append(-torch.log_softmax(z, -1)[ctx.label_ids[e.label]])
    finally:
        for h in hs:
            h.remove()
    return float(torch.stack(losses).mean())


def test_i2cl_calibrated_hook_equals_a_hand_made_forward(model, ctx, artifacts):
    art = artifacts["i2cl-cal"]
    coef = art.tensors["coef"]
    assert coef.shape == (3, 2, 2) and not torch.allclose(coef, coef[0, 0])  # per-layer values
    ids = query_ids(ctx, 1)
    hs = hand_i2cl(model, art.tensors["c_attn"], art.tensors["c_mlp"], coef)
    try:
        expected = logits(model, ids)
    finally:
        for h in hs:
            h.remove()
    with METHODS["i2cl-cal"].applied(model, art):
        torch.testing.assert_close(logits(model, ids), expected, atol=1e-5, rtol=1e-5)


def test_i2cl_calibration_lowers_the_demos_loss_and_leaves_the_model_alone(model, ctx, artifacts):
    from ltv_vllm.methods.i2cl import calibrate, demos_loss, initial_coef, injected

    art = artifacts["i2cl-cal"]
    before = demos_loss_by_hand(model, ctx, art, initial_coef(3, 0.1, 1.0))
    # the training loss: all demos in one left-padded batch, equal to one run per demo
    ep = ctx.episode
    prompts = [ctx.cap.encode(ep.task.query(e.text)) for e in ep.demos]
    assert len({len(p) for p in prompts}) > 1  # padding is exercised
    with torch.no_grad(), injected(model, art.tensors["c_attn"], art.tensors["c_mlp"],
                                   initial_coef(3, 0.1, 1.0)):
        batched = demos_loss(model, prompts, [ctx.label_ids[e.label] for e in ep.demos])
    assert float(batched) == pytest.approx(before, rel=1e-4)
    after = demos_loss_by_hand(model, ctx, art, art.tensors["coef"])
    assert after < before - 0.05, (before, after)
    assert art.params["loss_last_epoch"] < art.params["loss_first_epoch"]
    # the same fit again: the model's weights neither move nor collect a gradient
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    coef, losses = calibrate(model, art.tensors["c_attn"], art.tensors["c_mlp"], prompts,
                             [ctx.label_ids[e.label] for e in ep.demos],
                             epochs=3, seed=ctx.opts.seed)
    assert len(losses) == 3 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_mlp_fits_a_planted_nonlinear_target_better_than_ridge():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(256, 16, generator=g)
    y = torch.relu(h @ torch.randn(16, 16, generator=g)) @ torch.randn(16, 16, generator=g) / 4
    ws = fit_mlp(h, y, epochs=200, lr=3e-3, batch=16)
    f = ridge_fit(h, y, 1e-3)
    mse_mlp = float(((mlp_delta(ws, h) - y) ** 2).mean())
    mse_lin = float(((f.apply(h) - y) ** 2).mean())
    assert mse_mlp < 0.5 * mse_lin, (mse_mlp, mse_lin)
    deep = fit_mlp(h, y, depth=4, epochs=200, lr=3e-3, batch=16)
    assert len(deep) == 4 and float(((mlp_delta(deep, h) - y) ** 2).mean()) < mse_lin


@pytest.mark.parametrize("name", ["tv", "fv", "sv", "i2cl", "i2cl-cal", "mlp"])
def test_artifact_round_trip_and_checks(model, ctx, artifacts, name, tmp_path, tokenizer):
    art = artifacts[name]
    path = art.save(tmp_path / f"{name}.safetensors")
    back = load_artifact(path)
    assert back.method == name and back.params == art.params
    assert back.label_token_ids == art.label_token_ids and back.model == art.model
    for k, v in art.tensors.items():
        assert torch.equal(back.tensors[k], v)
    ids = query_ids(ctx)
    with METHODS[name].applied(model, art):
        a = logits(model, ids)
    with METHODS[name].applied(model, back):
        assert torch.equal(logits(model, ids), a)
    other = make_llama(len(tokenizer), seed=8, layers=3)
    with pytest.raises(VectorError, match="was extracted from"), METHODS[name].applied(other, back):
        pass
    (tmp_path / "bad.safetensors").write_bytes(path.read_bytes()[:100])
    with pytest.raises(VectorError, match="truncated or corrupt"):
        load_artifact(tmp_path / "bad.safetensors")

    with pytest.raises(VectorError, match="not a task vector"):
        load_task_vector(path)  # serve refuses a baseline's artifact in one line


def test_cli_evaluate_every_method_end_to_end(tmp_path, tokenizer):
    """`evaluate` with the full method list on a tiny model: every method scored, the
    correlation and cost tables written, and LTV / zero-shot / ICL equal to what `extract`
    measures on the same episode."""
    import json

    from click.testing import CliRunner

    from ltv_vllm.cli import main
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.pipeline.extract import ExtractOptions, extract

    make_llama(len(tokenizer), seed=9, layers=3).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    spec = write_toy_task(tmp_path, WORDS)
    methods = "zero-shot,icl,ltv,mean,tv,fv,sv,i2cl,i2cl-cal,mlp"
    r = CliRunner().invoke(main, [
        "evaluate", "--model", str(tmp_path / "m"), "--tasks", str(spec), "--methods", methods,
        "--runs", "2", "--k", "6", "--n", "24", "--n-test", "12", "--n-val", "8",
        "--fv-trials", "2", "--fv-prompts", "3", "--cost-samples", "3", "--dtype", "float32",
        "--i2cl-epochs", "20", "--out", str(tmp_path / "ev"), "--quiet"])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert doc["config"]["methods"] == methods.split(",")
    assert doc["config"]["options"]["i2cl_epochs"] == 20
    assert {(x["method"], x["run"]) for x in doc["records"]} == {
        (m, run) for m in methods.split(",") for run in (0, 1)}
    assert all(0 <= x["accuracy"] <= 1 and x["d_ntp"] >= 0 for x in doc["records"])
    layers = {x["method"]: x["params"] for x in doc["records"] if "params" in x and x["run"] == 0}
    assert 0 <= layers["tv"]["layer"] < 3 and 1 <= layers["sv"]["depth"] <= 3
    assert len(layers["fv"]["heads"]) == 10
    cal = layers["i2cl-cal"]
    assert cal["epochs"] == 20 and cal["mean_beta"] != 1.0  # calibrated, for 20 epochs
    assert doc["correlation"]["pooled"]["points"] == 2 * 9
    icl = {x["run"]: x["accuracy"] for x in doc["records"] if x["method"] == "icl"}
    pts = [(x["d_ntp"], abs(x["accuracy"] - icl[x["run"]])) for x in doc["records"]
           if x["method"] != "icl"]
    gap = doc["correlation"]["icl_gap"]
    assert gap["points"] == 18
    assert gap["pearson"] == pytest.approx(float(np.corrcoef(np.array(pts).T)[0, 1]), abs=1e-9)
    assert set(doc["inference_cost"]["toy"]) == set(methods.split(","))
    md = (tmp_path / "ev" / "results.md").read_text()
    assert "| Function Vector |" in md and "**Cost**" in md and "d_NTP vs accuracy" in md
    assert "gap to ICL's accuracy" in md and "| I2CL (calibrated) |" in md

    lm = load_model(str(tmp_path / "m"), dtype="float32")
    for run in (0, 1):
        res = extract(lm, get_task(str(spec)), "ltv", ExtractOptions(
            k=6, n=24, n_test=12, seed=run, progress=False))
        got = {x["method"]: x for x in doc["records"] if x["run"] == run}
        for m in ("zero-shot", "icl", "ltv", "mean"):
            assert got[m]["accuracy"] == pytest.approx(res.metrics[m]["accuracy"])
            assert got[m]["d_ntp"] == pytest.approx(res.metrics[m]["d_ntp"], rel=1e-4, abs=1e-6)


def test_every_method_has_its_own_colour_in_the_figures():
    from ltv_vllm.evaluation.evaluate import SOURCE, TRANSFER_METHOD, method_colors
    from ltv_vllm.evaluation.regress import FIRST

    names = [*METHODS, "zero-shot", "icl", FIRST, TRANSFER_METHOD,
             *(SOURCE + m for m in ("zero-shot", "icl", "ltv", "mean"))]
    colours = [method_colors().get(m) for m in names]
    assert None not in colours and len(set(colours)) == len(names)


def test_evaluate_refuses_baselines_with_a_source_model_and_unknown_methods():
    from ltv_vllm.errors import ArgumentError
    from ltv_vllm.evaluation.evaluate import resolve_methods

    with pytest.raises(ArgumentError, match="without --source-model"):
        resolve_methods(["ltv", "tv"], transfer=True)
    with pytest.raises(ArgumentError, match="unknown nope"):
        resolve_methods(["nope"], transfer=False)
    assert resolve_methods(["fv"], transfer=False) == ["icl", "fv"]


def test_cli_extract_method_writes_a_checked_artifact(tmp_path, tokenizer):
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    make_llama(len(tokenizer), seed=9, layers=3).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    spec = write_toy_task(tmp_path, WORDS)
    args = ["extract", "--model", str(tmp_path / "m"), "--task", str(spec), "--k", "6",
            "--n", "24", "--n-test", "12", "--dtype", "float32", "--quiet"]
    r = CliRunner().invoke(main, [*args, "--method", "sv", "-o", str(tmp_path / "sv.safetensors")])
    assert r.exit_code == 0, r.output
    art = load_artifact(tmp_path / "sv.safetensors")
    assert art.method == "sv" and 1 <= art.params["depth"] <= 3
    assert set(art.provenance.metrics) == {"zero-shot", "icl", "sv"}
    r = CliRunner().invoke(main, [*args, "--method", "tv", "-o", str(tmp_path / "tv.pt")])
    assert r.exit_code == 1 and "--output" in r.output and not (tmp_path / "tv.pt").exists()
    r = CliRunner().invoke(main, [*args, "--method", "fv", "--rank", "2"])
    assert r.exit_code == 1 and "--rank is an option of ltv, ltv-auto, not of fv" in r.output
    # a vector method writes a task-vector file (.pt allowed) with the map it fitted
    r = CliRunner().invoke(main, [*args, "--method", "kernel", "-o", str(tmp_path / "k.pt")])
    assert r.exit_code == 0, r.output
    kv = load_task_vector(tmp_path / "k.pt")
    assert kv.map == "rbf" and kv.gamma > 0 and kv.V.shape == (64, 24)  # N support states
    assert set(kv.provenance.metrics) == {"zero-shot", "icl", "kernel"}
    assert "gamma" in r.output and "wrote" in r.output


def toy_model_and_task(tmp_path, tokenizer):
    """A tiny Llama saved under tmp_path/m and loaded in float32, and the toy task."""
    from ltv_vllm.models.loading import load_model

    make_llama(len(tokenizer), seed=9, layers=2).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    task = get_task(str(write_toy_task(tmp_path, WORDS)))
    return load_model(str(tmp_path / "m"), dtype="float32"), task


def test_evaluate_keeps_each_test_query_and_compares_with_icl(tmp_path, tokenizer):
    """Every record holds its method's correctness on each test query, and their mean is the
    record's accuracy (scored apart, by `score_methods`); the comparison against ICL is the
    mean over queries of each query's correctness averaged over the runs minus ICL's,
    computed here by hand, inside its interval; the average over one task is that task's;
    the report shows the table."""
    import ltv_vllm.evaluation.evaluate as ev

    lm, task = toy_model_and_task(tmp_path, tokenizer)
    cfg = ev.EvalConfig(k=6, n=24, n_test=12, runs=2, n_val=4, cost_samples=0)
    ms = ["zero-shot", "icl", "ltv", "mean"]
    doc = ev.evaluate(lm, [task], ms, cfg, progress=False)
    for r in doc["records"]:
        assert len(r["correct"]) == 12 and set(r["correct"]) <= {0, 1}
        assert sum(r["correct"]) / 12 == pytest.approx(r["accuracy"])

    def per_query(m):
        rs = [r["correct"] for r in doc["records"] if r["method"] == m]
        assert len(rs) == 2
        return [(a + b) / 2 for a, b in zip(*rs, strict=True)]

    got = doc["intervals"]["methods"]
    assert doc["intervals"]["vs"] == "icl" and sorted(got) == ["ltv", "mean", "zero-shot"]
    icl = per_query("icl")
    for m in ("zero-shot", "ltv", "mean"):
        diff = sum(a - b for a, b in zip(per_query(m), icl, strict=True)) / 12
        rec = got[m]["toy"]
        assert rec["diff"] == pytest.approx(diff) and rec["lo"] <= diff <= rec["hi"]
        assert got[m]["average"]["diff"] == pytest.approx(diff)
        assert rec["verdict"] == ("above" if rec["lo"] > 0 else "below" if rec["hi"] < 0
                                  else "tie")
    assert "**Against ICL on the same test queries**" in ev.markdown_table(doc)


def test_evaluate_resumes_from_its_checkpoint(tmp_path, tokenizer, monkeypatch):
    """An interrupted evaluation rerun skips the episodes its checkpoint holds and ends with
    the same document; a checkpoint of another configuration is refused."""
    import json

    import ltv_vllm.evaluation.episodes as episodes
    import ltv_vllm.evaluation.evaluate as ev
    from ltv_vllm.errors import ArgumentError

    lm, task = toy_model_and_task(tmp_path, tokenizer)
    cfg = ev.EvalConfig(k=6, n=24, n_test=12, runs=2, n_val=4, cost_samples=0)
    ms = ["zero-shot", "icl", "ltv", "i2cl"]
    ck = tmp_path / "partial.json"
    full = ev.evaluate(lm, [task], ms, cfg, progress=False, checkpoint=ck)
    state = json.loads(ck.read_text())
    assert state["done"] == [["toy", 0], ["toy", 1]]
    state["done"] = [["toy", 0]]  # as if stopped after the first run
    state["records"] = [r for r in state["records"] if r["run"] == 0]
    ck.write_text(json.dumps(state))
    calls = []
    real = episodes.score_methods
    monkeypatch.setattr(episodes, "score_methods",
                        lambda ctx, *a, **kw: calls.append(ctx.episode.seed)
                        or real(ctx, *a, **kw))
    again = ev.evaluate(lm, [task], ms, cfg, progress=False, checkpoint=ck)
    assert calls == [1]  # only the missing run
    def scores(doc):  # everything but the timings, which differ between passes
        return [{k: v for k, v in r.items() if k not in ("extraction_seconds", "episode")}
                for r in doc["records"]]

    assert scores(again) == scores(full)
    assert again["summary"]["average"] == full["summary"]["average"]
    with pytest.raises(ArgumentError, match="another configuration"):
        ev.evaluate(lm, [task], ms, ev.EvalConfig(k=6, n=24, n_test=12, runs=3, n_val=4,
                                                  cost_samples=0), progress=False, checkpoint=ck)
    assert not ev.episode_checkpoint(ck).exists()  # removed once its episode is done


def test_evaluate_resumes_inside_an_episode(tmp_path, tokenizer, monkeypatch):
    """Stopped in the middle of an episode (after its capture and its first method), a rerun
    captures nothing again, extracts only the methods not yet scored, and ends with the same
    records as an uninterrupted evaluation."""
    import ltv_vllm.evaluation.episodes as episodes
    import ltv_vllm.evaluation.evaluate as ev
    import ltv_vllm.methods.score as score

    lm, task = toy_model_and_task(tmp_path, tokenizer)
    cfg = ev.EvalConfig(k=6, n=24, n_test=12, runs=1, n_val=4, cost_samples=0)
    ms = ["zero-shot", "icl", "ltv", "mlp", "i2cl"]
    full = ev.evaluate(lm, [task], ms, cfg, progress=False)

    ck = tmp_path / "partial.json"
    real_get = score.get_method
    extracted: list[str] = []

    class Stop(Exception):
        pass

    def stopping(name):  # the session ends as the third method starts
        if name == "i2cl" and not extracted.count("again"):
            raise Stop
        extracted.append(name)
        return real_get(name)

    monkeypatch.setattr(score, "get_method", stopping)
    with pytest.raises(Stop):
        ev.evaluate(lm, [task], ms, cfg, progress=False, checkpoint=ck)
    assert not ck.exists() and ev.episode_checkpoint(ck).is_file()
    assert extracted == ["ltv", "mlp"]

    captured = []
    real_capture = episodes.capture_episode
    monkeypatch.setattr(episodes, "capture_episode", lambda *a, **kw: captured.append(1)
                        or real_capture(*a, **kw))
    extracted[:] = ["again"]
    again = ev.evaluate(lm, [task], ms, cfg, progress=False, checkpoint=ck)
    assert captured == [] and extracted == ["again", "i2cl"]

    def same(doc):  # as uninterrupted; the reloaded states are contiguous copies, whose
        # products may round differently in the last bit, hence d_NTP to 1e-6
        assert len(doc["records"]) == len(full["records"])
        for r, f in zip(doc["records"], full["records"], strict=True):
            timing = ("extraction_seconds", "d_ntp", "episode")
            assert {k: v for k, v in r.items() if k not in timing} == \
                {k: v for k, v in f.items() if k not in timing}
            assert r["d_ntp"] == pytest.approx(f["d_ntp"], rel=1e-6, abs=1e-9)

    same(again)
    assert not ev.episode_checkpoint(ck).exists()

    ck.unlink()
    ev.episode_checkpoint(ck).write_bytes(b"not safetensors")  # a damaged file: start over
    captured.clear()
    same(ev.evaluate(lm, [task], ms, cfg, progress=False, checkpoint=ck))
    assert captured == [1]


def test_extend_takes_an_earlier_evaluation_from_before_a_new_option():
    """A method option added since an evaluation ran is compared at its default (what that
    evaluation ran with); a changed option is still refused."""
    from ltv_vllm.errors import ArgumentError
    from ltv_vllm.evaluation.evaluate import EvalConfig, check_extension

    config = EvalConfig().to_dict()
    older = {**config, "options": {k: v for k, v in config["options"].items()
                                   if not k.startswith("i2cl_")}}
    check_extension({"config": older, "records": []}, config)
    changed = EvalConfig(options=MethodOptions(i2cl_epochs=5)).to_dict()
    with pytest.raises(ArgumentError, match="differs in options"):
        check_extension({"config": older, "records": []}, changed)


def test_cli_evaluate_extend_equals_one_evaluation_of_everything(tmp_path, tokenizer,
                                                                  monkeypatch):
    """`evaluate --extend` grows a finished evaluation by a task and a run: only the new
    episodes run, and the document equals one evaluation of every task and run (timings
    aside); a changed configuration, a missing results.json and regression are refused."""
    import json

    from click.testing import CliRunner

    import ltv_vllm.evaluation.episodes as episodes
    from ltv_vllm.cli import main

    make_llama(len(tokenizer), seed=9, layers=2).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    one = write_toy_task(tmp_path, WORDS)
    spec = json.loads(one.read_text())
    two = tmp_path / "toy2.json"  # a second task on the same data, another prompt
    two.write_text(json.dumps({**spec, "name": "toy2", "in_prefix": "Text"}))
    base = ["evaluate", "--model", str(tmp_path / "m"), "--methods", "zero-shot,icl,ltv,tv",
            "--k", "6", "--n", "24", "--n-test", "12", "--n-val", "4", "--cost-samples", "2",
            "--dtype", "float32", "--quiet"]
    both = ["--tasks", f"{one},{two}", "--runs", "2"]

    def run(*args: str) -> tuple[int, str]:
        r = CliRunner().invoke(main, [*base, *args])
        return r.exit_code, r.output

    assert run(*both, "--out", str(tmp_path / "all"))[0] == 0
    assert run("--tasks", str(one), "--runs", "1", "--out", str(tmp_path / "ext"))[0] == 0
    seen = []
    real = episodes.score_methods
    monkeypatch.setattr(episodes, "score_methods", lambda ctx, *a, **kw: seen.append(
        (ctx.episode.task.name, ctx.episode.seed)) or real(ctx, *a, **kw))
    code, out = run(*both, "--out", str(tmp_path / "ext"), "--extend")
    assert code == 0, out
    assert seen == [("toy", 1), ("toy2", 0), ("toy2", 1)]  # toy's run 0 is kept

    full, ext = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("all", "ext"))

    def scores(doc):
        return sorted((r["task"], r["run"], r["method"], r["accuracy"],
                       round(r["d_ntp"], 9), json.dumps(r.get("params"), sort_keys=True))
                      for r in doc["records"])

    assert scores(ext) == scores(full)
    assert ext["summary"]["average"] == full["summary"]["average"]
    assert ext["correlation"]["pooled"] == pytest.approx(full["correlation"]["pooled"])
    assert set(ext["inference_cost"]) == {"toy", "toy2"}
    assert ext["extends"]["tasks"] == ["toy"] and ext["extends"]["runs"] == 1
    assert "extending an earlier evaluation (tasks toy; 1 runs)" in (
        tmp_path / "ext" / "results.md").read_text()

    seen.clear()  # refusals, one line each, before any episode runs
    code, out = run(*both, "--n", "20", "--out", str(tmp_path / "ext"), "--extend")
    assert code == 1 and "differs in n;" in out and seen == []
    code, out = run(*both, "--out", str(tmp_path / "none"), "--extend")
    assert code == 1 and "does not exist" in out
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.json").write_text("{not json")
    code, out = run(*both, "--out", str(tmp_path / "bad"), "--extend")
    assert code == 1 and "unreadable" in out
    code, out = run("--tasks", "linear", "--out", str(tmp_path / "ext"), "--extend")
    assert code == 1 and "--extend grows a classification evaluation" in out and seen == []


@pytest.mark.parametrize("name", ["tv", "fv", "ltv-layer"])
def test_a_method_served_as_a_layer_task_does_what_its_own_hook_does(model, ctx, artifacts,
                                                                      name, tokenizer,
                                                                      tmp_path):
    """`Method.layer_task`: the form a server applies (`core.layer_task`), under the layer
    tasks' own hook, gives the method's logits on the test queries (so `evaluate`'s number is
    the served one); `tasks import` writes the same task from the artifact's file."""
    from ltv_vllm.extraction.layer_apply import layer_task_applied

    art = artifacts[name]
    task = METHODS[name].layer_task(art)
    for i in range(4):
        ids = query_ids(ctx, i)
        with METHODS[name].applied(model, art):
            want = logits(model, ids)
        with layer_task_applied(model, task):
            got = logits(model, ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if name == "ltv-layer":
        return  # already a layer task's file
    from conftest import run_cli
    from ltv_vllm.core.layer_task import load_layer_task

    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    art.save(tmp_path / f"{name}.safetensors")
    run_cli("tasks", "import", f"{name}.safetensors", "--model", str(tmp_path / "m"),
            "-o", "t.safetensors", cwd=tmp_path)
    got = load_layer_task(tmp_path / "t.safetensors")
    assert got.layers == task.layers and str(got.policy) == "last"
    torch.testing.assert_close(got.bias, task.bias)


@pytest.mark.parametrize("name", ["sv", "i2cl", "i2cl-cal", "mlp"])
def test_a_method_without_a_layer_task_form_is_refused_in_one_line(artifacts, name):
    from ltv_vllm.methods.base import MethodError

    with pytest.raises(MethodError, match="no layer-task form") as e:
        METHODS[name].layer_task(artifacts[name])
    assert "\n" not in str(e.value)
