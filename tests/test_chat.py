"""Chat-rendered tasks (`tasks.chat`): prompts equal to the template's own rendering of the
conversation a chat client sends, states equal to transformers' forward pass over that
rendering tokenized as vLLM's chat route tokenizes it, and one-line refusals."""

from __future__ import annotations

import pytest
import torch

from conftest import CORPUS, make_llama, make_tokenizer
from ltv_vllm.core.vector import Provenance, VectorError
from ltv_vllm.errors import UserError
from ltv_vllm.tasks.chat import chat_task, render, template_digest
from ltv_vllm.tasks.data import Episode, Example
from ltv_vllm.tasks.specs import Task, TaskError, label_token_ids

# ChatML with a default system turn, as SmolLM2's and Qwen2.5's templates write it
CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
          "{{ '<s>system\nBe brief.</s>\n' }}{% endif %}"
          "{{ '<s>' + m['role'] + '\n' + m['content'] + '</s>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")
TASK = Task("toy", "Review", "Sentiment", ("negative", "positive"), "unused")
DEMOS = (Example("a witty movie", 1), Example("the acting is worse", 0), Example("dull", 0))
TEXTS = ["a gorgeous movie", "the plot is dull and the acting is worse", "witty"]


@pytest.fixture(scope="module")
def chat_tokenizer():
    # BOS added by the tokenizer: a chat rendering must not get it (vLLM's chat route does
    # not add it), so the states tell the two conventions apart
    tok = make_tokenizer(bos=True, corpus=CORPUS + ["system\nBe brief.\nuser\nassistant\n"] * 20)
    tok.chat_template = CHATML
    return tok


def by_hand(demos, text, style):
    """The conversation a chat client sends, written out here (not by `ChatTask.messages`)."""
    q = f"Review: {text}\nSentiment:"
    if style == "inline":
        shown = "".join(f"Review: {e.text}\nSentiment: {TASK.labels[e.label]}\n" for e in demos)
        return [{"role": "user", "content": shown + q}]
    out = []
    for e in demos:
        out += [{"role": "user", "content": f"Review: {e.text}\nSentiment:"},
                {"role": "assistant", "content": TASK.labels[e.label]}]
    return out + [{"role": "user", "content": q}]


def chat_toy(chat_tokenizer, tmp_path):
    """A tiny model saved with the chat tokenizer, loaded back, and the toy task rendered
    through its template: (model, loaded model, chat task)."""
    from conftest import write_toy_task
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.tasks.specs import get_task

    model = make_llama(len(chat_tokenizer), seed=3)
    model.save_pretrained(tmp_path / "m")
    chat_tokenizer.save_pretrained(tmp_path / "m")
    lm = load_model(str(tmp_path / "m"), dtype="float32")
    toy = chat_task(get_task(str(write_toy_task(tmp_path, ["dull", "witty", "plot"]))),
                    lm.tokenizer)
    return model, lm, toy


@pytest.mark.parametrize("style", ["turns", "inline"])
def test_prompts_are_the_templates_rendering(chat_tokenizer, style):
    t = chat_task(TASK, chat_tokenizer, style)
    for text in TEXTS:
        zs = chat_tokenizer.apply_chat_template(by_hand((), text, style), tokenize=False,
                                                add_generation_prompt=True)
        icl = chat_tokenizer.apply_chat_template(by_hand(DEMOS, text, style), tokenize=False,
                                                 add_generation_prompt=True)
        assert t.zero_shot(text) == zs
        assert t.demos_text(DEMOS) + t.query(text) == icl
        assert icl.startswith(t.demos_text(DEMOS))  # the shared prefix the cache runs once
    assert zs.endswith("Sentiment:</s>\n<s>assistant\n")
    assert t.record() == {"name": "chat", "demos": style,
                          "template_sha256": template_digest(CHATML)}
    assert t.to_dict() == TASK.to_dict()


def test_label_tokens_have_no_leading_space(chat_tokenizer):
    """The assistant's turn starts on a fresh line: its first token is the label word's."""
    t = chat_task(TASK, chat_tokenizer)
    words = [chat_tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in TASK.labels]
    assert label_token_ids(t, chat_tokenizer) == words
    assert label_token_ids(TASK, chat_tokenizer) != words


@pytest.mark.parametrize("style", ["turns", "inline"])
def test_states_are_transformers_on_the_rendering(chat_tokenizer, style):
    """h_zs and h_icl (shared demo cache) against the model's own forward over the rendered
    conversation, tokenized without the tokenizer's BOS."""
    from ltv_vllm.extraction.capture import Capturer
    from ltv_vllm.pipeline.extract import capture_episode

    model = make_llama(len(chat_tokenizer), seed=3)
    t = chat_task(TASK, chat_tokenizer, style)
    episode = Episode(t, 0, DEMOS, tuple(Example(x, 0) for x in TEXTS),
                      tuple(Example(x, 1) for x in TEXTS[:2]))
    cap = Capturer(model, chat_tokenizer, batch_size=2, progress=False,
                   special_tokens=t.special_tokens)
    c = capture_episode(cap, episode)

    def ref(conversation):
        text = chat_tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=True)
        ids = chat_tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.model(torch.tensor([ids]))
        return out.last_hidden_state[0, -1]

    for i, x in enumerate(TEXTS):
        torch.testing.assert_close(c.h_zs[i], ref(by_hand((), x, style)), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(c.h_icl[i], ref(by_hand(DEMOS, x, style)),
                                   atol=1e-4, rtol=1e-4)
    # the tokenizer's BOS would have given other states: the convention is checked
    with_bos = Capturer(model, chat_tokenizer, batch_size=2, progress=False)
    assert (with_bos.hidden([t.zero_shot(TEXTS[0])])[0] - c.h_zs[0]).abs().max() > 1e-2


def test_templates_it_cannot_use_are_refused(chat_tokenizer):
    tok = make_tokenizer()
    with pytest.raises(TaskError, match="has no chat template"):
        chat_task(TASK, tok)
    tok.chat_template = CHATML.replace("m['content']", "m['content'] | upper")
    with pytest.raises(TaskError, match="does not show the user's message"):
        chat_task(TASK, tok)
    tok.chat_template = CHATML.replace("'<s>' + m['role']", "loop.index | string + m['role']")
    with pytest.raises(TaskError, match="turns one after another"):
        chat_task(TASK, tok)
    with pytest.raises(TaskError, match="must be one of turns, inline"):
        chat_task(TASK, chat_tokenizer, "threaded")


def test_a_chat_task_runs_only_the_state_methods(chat_tokenizer, tmp_path):
    """A method that builds its own completion prompts is refused in one line, before any
    pass; an LTV vector records the rendering it was fitted on."""
    import json

    from ltv_vllm import ExtractOptions, extract

    model, lm, toy = chat_toy(chat_tokenizer, tmp_path)
    opts = ExtractOptions(k=4, n=8, n_test=4, progress=False)
    with pytest.raises(UserError, match="--format chat: fv builds its own completion prompts"):
        extract(lm, toy, "fv", opts)
    r = extract(lm, toy, "ltv", opts)
    assert r.artifact.provenance.prompt_format == toy.record()
    assert r.artifact.provenance.task["name"] == "toy"
    assert "prompt_format" in json.dumps(r.artifact.provenance.to_dict())


def test_extract_through_another_template_and_serve_with_it(chat_tokenizer, tmp_path):
    """`extract --format chat --chat-template FILE` renders through that template, not the
    tokenizer's: the vector records its sha256, a server given the same --chat-template
    takes it without a warning, one with the tokenizer's own warns; the option without
    --format chat, or naming no file, is one line before any model loads."""
    from click.testing import CliRunner

    from conftest import write_toy_task
    from ltv_vllm.cli import main
    from ltv_vllm.core.vector import load_task_vector

    make_llama(len(chat_tokenizer), seed=3).save_pretrained(tmp_path / "m")
    chat_tokenizer.save_pretrained(tmp_path / "m")
    spec = str(write_toy_task(tmp_path, ["dull", "witty", "plot"]))
    plain = CHATML.replace("{% if loop.first and m['role'] != 'system' %}"
                           "{{ '<s>system\nBe brief.</s>\n' }}{% endif %}", "")
    assert plain != CHATML
    (tmp_path / "plain.jinja").write_text(plain)
    args = ["extract", "--model", str(tmp_path / "m"), "--task", spec, "--k", "4", "--n", "8",
            "--n-test", "4", "--dtype", "float32", "--format", "chat"]
    r = CliRunner().invoke(main, [*args, "--chat-template", str(tmp_path / "plain.jinja"),
                                  "-o", str(tmp_path / "v.pt")])
    assert r.exit_code == 0, r.output
    fmt = load_task_vector(tmp_path / "v.pt").provenance.prompt_format
    assert fmt["template_sha256"] == template_digest(plain) != template_digest(CHATML)
    # the rendering is the given template's: its zero-shot prompt has no system turn
    task = chat_task(TASK, chat_tokenizer, template=plain)
    assert task.zero_shot("x") == render(chat_tokenizer, [{"role": "user",
                                                           "content": TASK.query("x")}], plain)
    assert "Be brief" not in task.zero_shot("x")
    for template, warned in ((str(tmp_path / "plain.jinja"), False), (None, True)):
        extra = ["--chat-template", template] if template else []
        r = CliRunner().invoke(main, ["serve", "--model", str(tmp_path / "m"), "--task-vector",
                                      f"t={tmp_path / 'v.pt'}", "--dry-run", *extra])
        assert r.exit_code == 0, r.output
        assert ("fitted through another chat template" in r.output) == warned, r.output
    for bad, match in (([*args[:-2], "--chat-template", plain], "add --format chat"),
                       ([*args, "--chat-template", str(tmp_path / "none.jinja")],
                        "no such file, and not a Jinja template")):
        r = CliRunner().invoke(main, [*bad, "-o", str(tmp_path / "bad.pt")])
        assert r.exit_code != 0 and match in r.output and "Traceback" not in r.output, r.output
        assert not (tmp_path / "bad.pt").exists()


@pytest.mark.parametrize("bad,match", [
    ({"name": "html"}, "'completion' or 'chat'"),
    ({"name": "chat", "demos": "threads", "template_sha256": "0" * 64}, "demos"),
    ({"name": "chat", "demos": "turns", "template_sha256": "xyz"}, "template_sha256"),
    ({"name": "chat", "demos": "turns"}, "template_sha256"),
])
def test_a_bad_stored_prompt_format_is_refused(bad, match):
    with pytest.raises(VectorError, match=match):
        Provenance.from_dict({"prompt_format": bad})
    assert Provenance.from_dict({"prompt_format": {"name": "completion"}}).prompt_format


def test_the_gate_reads_each_vectors_rendering(monkeypatch):
    """`rendering_refusal` over the request shapes, for a fused server's one vector (key "")
    fitted through a template: what `serve` puts in the API server's environment."""
    from ltv_vllm.serving.api_server.gate import Ask
    from ltv_vllm.serving.contract.wire import chat_env

    mine, other = template_digest(CHATML), template_digest("x")
    for k, v in chat_env({"": mine}, mine).items():
        monkeypatch.setenv(k, v)
    chat = {"messages": [{"role": "user", "content": "hi"}]}

    def why(path, payload, key=""):
        r = Ask.of(path, payload, {"headers": []}).rendering(key, "t")
        return r[0] if r else None

    assert why("/v1/chat/completions", chat) is None
    assert why("/invocations", chat) is None  # served as a chat
    assert "send the request to /v1/chat/completions" in why("/v1/completions", {"prompt": "x"})
    assert "is served on /v1/chat/completions" in why("/v1/responses", {"input": "x"})
    assert "own chat_template" in why("/v1/chat/completions", {**chat, "chat_template": "y"})
    assert "generation prompt" in why("/v1/chat/completions",
                                      {**chat, "continue_final_message": True})
    for xargs in ({"ltv_chat": "allow"}, {"ltv_steps": 0}):  # the opt-in, nothing shifted
        assert why("/v1/completions", {"prompt": "x", "vllm_xargs": xargs}) is None
    # a vector fitted on the completion prompt (no entry): chat is the refused shape
    assert why("/v1/completions", {"prompt": "x"}, key="alpha") is None
    assert "completion prompt" in why("/v1/chat/completions", chat, key="alpha")
    # the server renders with another template than the vector's
    for k, v in chat_env({"": mine}, other).items():
        monkeypatch.setenv(k, v)
    assert "this server renders chat with" in why("/v1/chat/completions", chat)


def test_evaluate_over_demo_sets_through_chat(chat_tokenizer, tmp_path):
    """`evaluate --format chat --demo-sets 2`: each set's prompt is the template's rendering
    of that set's turns; every prompt's accuracy from transformers' forward over the
    conversation written out by hand; the multi-prompt rows are there (not refused)."""
    import ltv_vllm.evaluation.evaluate as ev
    from ltv_vllm.extraction.capture import label_head
    from ltv_vllm.tasks.data import load_dataset, sample_episode

    model, lm, toy = chat_toy(chat_tokenizer, tmp_path)
    cfg = ev.EvalConfig(k=4, n=8, n_test=6, runs=1, n_val=0, cost_samples=0, batch_size=2,
                        demo_sets=2)
    doc = ev.evaluate(lm, [toy], [], cfg, progress=False)
    rec = {r["method"]: r for r in doc["records"]}
    assert {"icl-ensemble", "ltv-multi"} <= set(rec)
    ep = sample_episode(load_dataset(toy), k=4, n=8, n_test=6, seed=0, n_val=0, demo_sets=2)
    w, b = label_head(model, label_token_ids(toy, chat_tokenizer))
    labels = torch.tensor([e.label for e in ep.test])

    def ref(conversation):
        text = chat_tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=True)
        ids = chat_tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            return model.model(torch.tensor([ids])).last_hidden_state[0, -1]

    probs = []
    for demos in ep.demo_sets:
        h = torch.stack([ref(by_hand(demos, e.text, "turns")) for e in ep.test]).double()
        probs.append(torch.softmax(h @ w.double().T + b.double(), -1))
    accs = [float((p.argmax(-1) == labels).double().mean()) for p in probs]
    assert rec["icl"]["params"]["set_accuracy"] == accs
    p_ens = sum(probs) / 2
    kl = [float((p * (p.log() - p_ens.log())).sum(-1).mean()) for p in probs]
    assert min(kl) > 1e-4  # the two prompts answer differently
    assert rec["icl-ensemble"]["d_ntp"] == pytest.approx(sum(kl) / 2, rel=1e-4, abs=1e-8)
