"""Layer tasks (`core.layer_task`): the file, its refusals, its positions, combination; the
transformers reference (`extraction.layer_apply`) against hand-made patched forwards; and the
community's control vectors imported (`core.control_files`, `ltv-vllm tasks import`), equal
to repeng's and steering-vectors' own application on the packaged model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import make_llama, make_tokenizer, run_cli
from ltv_vllm.core.layer_task import (
    LayerPolicy,
    LayerTask,
    combine,
    load_any,
    load_layer_task,
)
from ltv_vllm.core.vector import ALL, ModelIdentity, TaskVector, load_task_vector, model_identity
from ltv_vllm.core.vector_files import VectorError
from ltv_vllm.extraction.layer_apply import layer_task_applied
from ltv_vllm.methods.base import decoder_layers, edits

IDENT = ModelIdentity("toy", hidden_size=8, vocab_size=50, lm_head_fingerprint="f" * 16,
                      num_layers=4)


def additive(layers, seed=0, ident=IDENT, policy=None, name="t"):
    g = torch.Generator().manual_seed(seed)
    return LayerTask(layers=tuple(layers), bias=torch.randn(len(layers), ident.hidden_size,
                                                            generator=g),
                     U=None, V=None, model=ident, policy=policy or LayerPolicy(),
                     provenance={"task": {"name": name}})


# -- positions -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, prompt, steps, shown", [
    ("last", False, 1, "last"), ("first", False, 1, "last"), ("generated", False, ALL,
                                                                "generated"),
    ("prompt", True, 1, "prompt"), ("all", True, ALL, "all"), ("3", False, 3, "3"),
    (0, False, 0, "0"), (2, False, 2, "2")])
def test_positions_share_the_step_policies_vocabulary(text, prompt, steps, shown):
    p = LayerPolicy.parse(text)
    assert (p.prompt, p.steps, str(p)) == (prompt, steps, shown)


@pytest.mark.parametrize("bad", ["everything", "", "-1", True, 1.5, None, "prompt+2"])
def test_positions_refuse_what_they_do_not_name(bad):
    with pytest.raises(ValueError, match="last, prompt, generated, all or a count"):
        LayerPolicy.parse(bad)


def test_which_steps_a_policy_shifts():
    assert [LayerPolicy(False, 2).shifts_step(s) for s in (1, 2, 3)] == [True, True, False]
    assert LayerPolicy(True, 0) == LayerPolicy(True, 1)  # the prompt holds step 1's row
    with pytest.raises(ValueError, match="shifts no generated token"):
        LayerPolicy(True, 3)
    assert LayerPolicy(False, ALL).shifts_step(10 ** 6)


# -- the task and its file --------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_layer_task_file_round_trips(tmp_path, suffix):
    g = torch.Generator().manual_seed(1)
    task = LayerTask(layers=(1, 3), bias=torch.randn(2, 8, generator=g),
                     U=torch.randn(2, 8, 3, generator=g), V=torch.randn(2, 8, 3, generator=g),
                     model=IDENT, policy=LayerPolicy.parse("2"), label_token_ids=(4, 5),
                     provenance={"method": "ltv", "task": {"name": "sst2"}})
    back = load_layer_task(task.save(tmp_path / f"t{suffix}"))
    assert (back.layers, back.policy, back.label_token_ids, back.model) == \
        ((1, 3), LayerPolicy(False, 2), (4, 5), IDENT)
    for name in ("U", "V", "bias"):
        assert torch.equal(getattr(back, name), getattr(task, name))
    assert back.provenance.method == "ltv" and back.task_name == "sst2"
    assert isinstance(load_any(tmp_path / f"t{suffix}"), LayerTask)


def test_a_final_layer_reader_refuses_a_layer_file_in_one_line(tmp_path):
    path = additive((2,)).save(tmp_path / "layer.pt")
    with pytest.raises(VectorError, match=r"a layer task \(it shifts decoder blocks \[2\]\)") \
            as e:
        load_task_vector(path)
    assert "\n" not in str(e.value)


def test_a_layer_reader_refuses_a_final_layer_file(tmp_path):
    tv = TaskVector(kind="hidden", U=torch.zeros(8, 1), V=torch.zeros(8, 1), bias=None,
                    model=IDENT, label_token_ids=(1,))
    path = tv.save(tmp_path / "final.pt")
    with pytest.raises(VectorError, match="a final-layer task vector"):
        load_layer_task(path)
    assert isinstance(load_any(path), TaskVector)


def test_a_newer_layer_format_is_refused(tmp_path):
    path = additive((1,)).save(tmp_path / "t.safetensors")
    from safetensors.torch import load_file, safe_open, save_file

    with safe_open(str(path), framework="pt") as f:
        head = json.loads(f.metadata()["ltv_vllm"])
    head["format_version"] = 99
    save_file(load_file(str(path)), str(path), metadata={"ltv_vllm": json.dumps(head)})
    with pytest.raises(VectorError, match="newer ltv-vllm"):
        load_layer_task(path)


@pytest.mark.parametrize("change, message", [
    ({"layers": (2, 1)}, "ascending"),
    ({"layers": (-1,)}, "≥ 0"),
    ({"layers": (4,)}, "past the last block"),
    ({"bias": torch.zeros(1, 7)}, r"bias must have shape \(1, 8\)"),
    ({"bias": torch.full((1, 8), float("nan"))}, "non-finite"),
    ({"bias": None}, "a bias, a map"),
    ({"U": torch.zeros(1, 8, 2)}, "both U and V"),
])
def test_a_malformed_layer_task_is_refused(change, message):
    base = {"layers": (1,), "bias": torch.zeros(1, 8), "U": None, "V": None, "model": IDENT}
    with pytest.raises(VectorError, match=message):
        LayerTask(**{**base, **change})


def test_a_model_too_narrow_or_too_shallow_is_refused_in_one_line():
    task = additive((3,))
    with pytest.raises(VectorError, match="hidden size 8 .*the model has 16"):
        task.check_fits(16, 4, "t")
    with pytest.raises(VectorError, match=r"shifts block 3, the model has 3 blocks \(0 to 2\)"):
        task.check_fits(8, 3, "t")


def test_additive_tasks_combine_by_scaled_sums_over_their_layers():
    a, b = additive((0, 2), seed=1, name="a"), additive((2, 3), seed=2, name="b")
    c = combine([(a, 0.5), (b, -2.0)])
    assert c.layers == (0, 2, 3)
    expect = {0: 0.5 * a.bias[0], 2: 0.5 * a.bias[1] - 2.0 * b.bias[0], 3: -2.0 * b.bias[1]}
    for i, ell in enumerate(c.layers):
        torch.testing.assert_close(c.bias[i], expect[ell])


def test_what_cannot_combine_is_refused_in_one_line():
    mapped = LayerTask(layers=(1,), bias=None, U=torch.zeros(1, 8, 1), V=torch.zeros(1, 8, 1),
                       model=IDENT, provenance={"task": {"name": "m"}})
    with pytest.raises(VectorError, match="'m' is a map"):
        combine([(additive((1,)), 1.0), (mapped, 1.0)])
    with pytest.raises(VectorError, match="shift different positions"):
        combine([(additive((1,)), 1.0), (additive((1,), policy=LayerPolicy.parse("last")), 1.0)])


# -- the transformers reference ---------------------------------------------------------------
@pytest.fixture(scope="module")
def toy():
    tok = make_tokenizer()
    model = make_llama(len(tok), hidden=64, layers=4, seed=3)
    return model, tok


def mapped_task(model, layers, seed=0, policy="all"):
    d = model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    n = len(layers)
    return LayerTask(layers=tuple(layers), bias=torch.randn(n, d, generator=g),
                     U=0.2 * torch.randn(n, d, 2, generator=g),
                     V=0.2 * torch.randn(n, d, 2, generator=g),
                     model=model_identity(model), policy=LayerPolicy.parse(policy))


@torch.no_grad()
def test_the_last_position_shift_equals_the_layer_methods_own_edit(toy):
    """The map at block 1's output, last position only, against `methods.base.at_last`
    (the layer methods' edit, itself checked against full forwards) with the delta computed
    from the clean run's block-1 state by hand."""
    model, tok = toy
    task = mapped_task(model, [1], policy="last")
    ids = torch.tensor([tok.encode("the cat sat on the mat")])
    clean = model(ids, output_hidden_states=True)
    h = clean.hidden_states[2][0, -1]  # block 1's output: hidden_states[ell + 1]
    delta = (h @ task.V[0]) @ task.U[0].T + task.bias[0]
    values = torch.zeros(4, h.shape[0])
    values[1] = delta
    from ltv_vllm.methods.base import at_last

    with at_last(model, values, 1, add=True):
        expect = model(ids).logits
    with layer_task_applied(model, task):
        got = model(ids).logits
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=0)
    assert (got - clean.logits).abs().max() > 1e-2  # it did something


def shifted_positions(policy: LayerPolicy, prompt_len: int, total: int) -> list[int]:
    """The positions of a sequence of `total` tokens (the prompt then generated ones) the
    policy shifts, written from its definition: every prompt position with `prompt`, and the
    row producing generated token s (position prompt_len − 2 + s) while s is within steps."""
    out = set(range(prompt_len)) if policy.prompt else set()
    for s in range(1, total - prompt_len + 2):
        if policy.shifts_step(s):
            out.add(prompt_len - 2 + s)
    return sorted(p for p in out if p < total)


@torch.no_grad()
@pytest.mark.parametrize("policy", ["all", "prompt", "generated", "last", "2", "0"])
def test_generation_under_each_policy_equals_a_patched_forward_without_a_cache(toy, policy):
    """Greedy generation with the KV cache and our hooks, against recomputing the whole
    sequence at every step (no cache) with the shift put by hand on the positions the
    policy names: same tokens, same logits at every step."""
    model, tok = toy
    task = mapped_task(model, [0, 2], seed=4, policy=policy)
    prompt = torch.tensor([tok.encode("a bird in the hand")])
    steps = 5
    with layer_task_applied(model, task):
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=steps, min_new_tokens=steps, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    seq = prompt
    layers = decoder_layers(model)
    for s in range(steps):
        marked = shifted_positions(task.policy, prompt.shape[1], seq.shape[1])

        def edit(x, ell, marked=marked):
            y = x.clone()
            for p in marked:
                h = x[0, p].float()
                i = task.layers.index(ell)
                y[0, p] = h + (h @ task.V[i]) @ task.U[i].T + task.bias[i]
            return y

        with edits(outputs=[(layers[ell], lambda x, ell=ell: edit(x, ell))
                            for ell in task.layers]):
            logits = model(seq, use_cache=False).logits[0, -1].clone()
        logits[tok.eos_token_id] = float("-inf")  # min_new_tokens' own masking, every step
        torch.testing.assert_close(out.scores[s][0], logits, atol=1e-4, rtol=0)
        seq = torch.cat([seq, logits.argmax().view(1, 1)], dim=1)
    assert torch.equal(out.sequences, seq)


@torch.no_grad()
def test_scale_multiplies_the_whole_shift(toy):
    model, tok = toy
    task = mapped_task(model, [1], seed=5, policy="all")
    ids = torch.tensor([tok.encode("one two three")])
    with layer_task_applied(model, task, scale=-0.5):
        got = model(ids).logits
    with layer_task_applied(model, task.scaled(-0.5)):
        expect = model(ids).logits
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=0)


def test_a_task_for_another_model_is_refused_before_any_hook(toy):
    model, _ = toy
    task = additive((1,))  # width 8, the toy has 64
    before = [len(m._forward_hooks) for m in decoder_layers(model)]
    with pytest.raises(VectorError, match="hidden size 8"), layer_task_applied(model, task):
        pass
    assert [len(m._forward_hooks) for m in decoder_layers(model)] == before


# -- the community's vectors, on the packaged model -------------------------------------------
@pytest.fixture(scope="module")
def smollm(packaged_smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(packaged_smollm2, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(packaged_smollm2)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return packaged_smollm2, model, tok


PAIRS = [(f"I feel wonderful and happy today, number {i}",
          f"I feel terrible and sad today, number {i}") for i in range(6)]


@torch.no_grad()
def greedy(model, tok, text, steps=8):
    ids = tok([text], return_tensors="pt")
    return model.generate(**ids, max_new_tokens=steps, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, pad_token_id=tok.pad_token_id)


def assert_same_generation(ours, theirs):
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.scores, theirs.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def repeng():
    # repeng 0.4.0 names np.float_ (removed in numpy 2) in a type annotation only; the alias
    # restored, its own code runs unchanged on our stack (scripts/setup.sh installs it)
    if not hasattr(np, "float_"):
        np.float_ = np.float64
    import repeng as lib

    return lib


def test_a_repeng_gguf_imports_to_what_repeng_itself_applies(smollm, tmp_path):
    path, model, tok = smollm
    lib = repeng()
    cv = lib.ControlVector.train(model, tok, [lib.DatasetEntry(positive=p, negative=n)
                                              for p, n in PAIRS], batch_size=6)
    cv.export_gguf(str(tmp_path / "happy.gguf"))
    run_cli("tasks", "import", "happy.gguf", "--model", str(path), "--scale", "1.5",
            "-o", "happy.layer.safetensors", cwd=tmp_path)
    task = load_layer_task(tmp_path / "happy.layer.safetensors")
    assert task.layers == tuple(sorted(cv.directions)) and str(task.policy) == "all"
    bare = greedy(model, tok, "Today the weather is")
    with layer_task_applied(model, task):
        ours = greedy(model, tok, "Today the weather is")
    control = lib.ControlModel(model, list(cv.directions))
    try:
        control.set_control(cv, 1.5)
        theirs = greedy(control, tok, "Today the weather is")
    finally:
        control.unwrap()
    assert_same_generation(ours, theirs)
    assert (ours.scores[0] - bare.scores[0]).abs().max() > 0.1  # the vector does something


def test_a_steering_vector_imports_to_what_the_library_itself_applies(smollm, tmp_path):
    from steering_vectors import train_steering_vector

    path, model, tok = smollm
    sv = train_steering_vector(model, tok, PAIRS, layers=[4, 11, 20], show_progress=False)
    torch.save(sv, tmp_path / "sv.pt")  # the object itself, as its users save it
    run_cli("tasks", "import", "sv.pt", "--model", str(path), "--scale", "4",
            "-o", "sv.layer.pt", cwd=tmp_path)
    task = load_layer_task(tmp_path / "sv.layer.pt")
    assert task.layers == (4, 11, 20)
    with layer_task_applied(model, task):
        ours = greedy(model, tok, "My favourite food is")
    with sv.apply(model, multiplier=4.0, min_token_index=0):
        theirs = greedy(model, tok, "My favourite food is")
    assert_same_generation(ours, theirs)


def write_gguf(path, directions, hint="llama", arch="controlvector"):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_string(f"{arch}.model_hint", hint)
    w.add_uint32(f"{arch}.layer_count", len(directions))
    for layer, vec in directions.items():
        w.add_tensor(f"direction.{layer}", np.asarray(vec, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("directions, hint, arch, message", [
    ({3: np.zeros(1536)}, "llama", "controlvector", "width 1536, .* hidden size 576"),
    ({30: np.zeros(576)}, "llama", "controlvector", r"block 30, .* 30 blocks \(0 to 29\)"),
    ({3: np.zeros(576)}, "qwen2", "controlvector", "made on a 'qwen2' model, the model is"),
    ({3: np.zeros(576)}, "llama", "llama", "not a control vector"),
])
def test_a_control_vector_that_does_not_fit_is_refused_and_nothing_written(
        smollm, tmp_path, directions, hint, arch, message):
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    path = smollm[0]
    write_gguf(tmp_path / "v.gguf", directions, hint, arch)
    r = CliRunner().invoke(main, ["tasks", "import", str(tmp_path / "v.gguf"), "--model",
                                  str(path), "-o", str(tmp_path / "out.safetensors")])
    assert r.exit_code != 0
    assert len(r.output.strip().splitlines()) == 1, r.output
    import re

    assert re.search(message, r.output), r.output
    assert not (tmp_path / "out.safetensors").exists()


# -- a request's layer shift, as the engine admits it and keys its cache -----------------------
LAYERS = {"ctl": ("all", True), "add": ("all", True), "late": ("generated", True),
          "map": ("last", False)}


def test_a_request_asks_for_its_task_its_scale_and_its_mix():
    from ltv_vllm.serving.contract.wire import layer_parts

    assert layer_parts({"ltv_task": "ctl"}, LAYERS) == (("ctl", 1.0),)
    assert layer_parts({"ltv_task": "map", "ltv_scale": -2}, LAYERS) == (("map", -2.0),)
    assert layer_parts({"ltv_task": "ctl", "ltv_mix": {"add": 0.5}}, LAYERS) == \
        (("ctl", 1.0), ("add", 0.5)) == \
        layer_parts({"ltv_task": "ctl", "ltv_mix": "add=0.5"}, LAYERS)  # as HTTP sends it
    assert layer_parts({"ltv_task": "head"}, LAYERS) is None  # a final-layer task


@pytest.mark.parametrize("args, message", [
    ({"ltv_task": "head", "ltv_scale": 2}, "apply to a layer task"),
    ({"ltv_scale": 2}, "the bare model is not one"),
    ({"ltv_task": "ctl", "ltv_scale": True}, "ltv_scale must be a finite number"),
    ({"ltv_task": "ctl", "ltv_scale": 101}, "from -100 to 100"),
    ({"ltv_task": "ctl", "ltv_mix": {"map": 1}}, "'map' is a map"),
    ({"ltv_task": "map", "ltv_mix": {"ctl": 1}}, "'map' is a map"),
    ({"ltv_task": "ctl", "ltv_mix": {"late": 1}}, "shift different positions"),
    ({"ltv_task": "ctl", "ltv_mix": {"ctl": 1}}, "own task again"),
    ({"ltv_task": "ctl", "ltv_mix": {"x@y": 1}}, "not a layer task"),
    ({"ltv_task": "ctl", "ltv_mix": []}, "must name 1 to 16"),
    ({"ltv_task": "ctl", "ltv_mix": "add"}, "NAME=SCALE"),
    ({"ltv_task": "ctl", "ltv_mix": "add=x"}, "ltv_mix.add must be"),
    ({"ltv_task": "ctl", "ltv_mix": "add=1,add=2"}, "NAME=SCALE"),
    ({"ltv_task": "ctl", "ltv_mix": {"add": float("nan")}}, "ltv_mix.add must be"),
])
def test_what_a_request_cannot_ask_of_layer_tasks_is_refused_in_one_line(args, message):
    from ltv_vllm.serving.contract.wire import layer_parts

    with pytest.raises(ValueError, match=message) as e:
        layer_parts(args, LAYERS)
    assert "\n" not in str(e.value)
    from ltv_vllm.serving.contract.wire import layer_parts as parts

    # with positions named for all, tasks of different defaults combine
    assert parts({"ltv_task": "ctl", "ltv_mix": {"late": 1}, "ltv_steps": "all"}, LAYERS)


@pytest.mark.parametrize("args, prompt_len, keyed_from", [
    ({}, 70, None),                                            # bare
    ({"ltv_task": "head"}, 70, None),                          # a final-layer task
    ({"ltv_task": "ctl"}, 70, 0),                              # the whole prompt
    ({"ltv_task": "map"}, 70, 69),                             # from the last prompt token
    ({"ltv_task": "late"}, 70, 69),
    ({"ltv_task": "ctl", "ltv_steps": 0}, 70, None),           # nothing shifted
    ({"ltv_task": "ctl", "ltv_steps": "generated"}, 70, 69),
    # a task-store layer task: its kind and positions come with it, under the stamp
    ({"ltv_task": "s@0123", "ltv_layer": "add", "ltv_steps": "all"}, 70, 0),
    ({"ltv_task": "s@0123", "ltv_layer": "map", "ltv_steps": "last"}, 70, 69),
    ({"ltv_task": "s@0123", "ltv_layer": "map", "ltv_steps": 0}, 70, None),
    ({"ltv_task": "s@0123", "ltv_steps": "all"}, 70, None),    # a final-layer store task
])
def test_a_block_is_keyed_from_the_first_position_its_request_shifts(args, prompt_len,
                                                                    keyed_from):
    from ltv_vllm.serving.engine.prefix_keys import block_key

    for end in range(1, 140):
        key = block_key(args, prompt_len, end, LAYERS)
        assert (key is not None) == (keyed_from is not None and end > keyed_from), end


def test_blocks_of_other_tasks_scales_or_positions_have_other_keys():
    from ltv_vllm.serving.engine.prefix_keys import block_key

    asks = [{"ltv_task": "ctl"}, {"ltv_task": "add"}, {"ltv_task": "ctl", "ltv_scale": 2},
            {"ltv_task": "ctl", "ltv_steps": "prompt"},
            {"ltv_task": "ctl", "ltv_mix": {"add": 1}}]
    keys = [block_key(a, 70, 64, LAYERS) for a in asks]
    assert len(set(keys)) == len(asks)
    assert block_key({"ltv_task": "ctl", "ltv_scale": 1.0}, 70, 64, LAYERS) == keys[0]
    # two store layer tasks, or one at two scales: apart from each other and the others
    store = [{"ltv_task": t, "ltv_layer": "add", "ltv_steps": "all", **more}
             for t, more in (("s@01", {}), ("s@02", {}), ("s@01", {"ltv_scale": 2}))]
    keys += [block_key(a, 70, 64, LAYERS) for a in store]
    assert len(set(keys)) == len(asks) + len(store)
