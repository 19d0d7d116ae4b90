"""A user's task templates (`Task.instruction`, `prompt`, `input`, `system`): prompts equal to
strings written out here, states equal to transformers' forward over them, multi-column data,
one spec file through extract / compile / classify, and one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import CORPUS, make_llama, make_tokenizer
from ltv_vllm.tasks.chat import chat_task
from ltv_vllm.tasks.data import DataError, Episode, Example, load_dataset
from ltv_vllm.tasks.specs import Task, TaskError, get_task, load_task_file

LABELS = ("no", "yes")
NLI = Task("nli", "", "", LABELS, "unused", instruction="Does the hypothesis follow?",
           prompt="{text}\nAnswer:", input="Premise: {premise}\nHypothesis: {hypothesis}")
DEMOS = (Example("Premise: a cat sleeps\nHypothesis: an animal sleeps", 1),
         Example("Premise: it rains\nHypothesis: the sun shines", 0))
TEXT = "Premise: the movie is dull\nHypothesis: the plot is slow"


def test_prompts_are_the_strings_written_out():
    lead = "Does the hypothesis follow?\n"
    q = f"{TEXT}\nAnswer:"
    assert NLI.zero_shot(TEXT) == lead + q
    assert NLI.demos_text(DEMOS) + NLI.query(TEXT) == (
        lead + f"{DEMOS[0].text}\nAnswer: yes\n" + f"{DEMOS[1].text}\nAnswer: no\n" + q)
    # the paper's template is untouched, and a file written before these keys reads the same
    plain = Task("t", "Review", "Sentiment", LABELS, "unused")
    assert plain.zero_shot("x") == "Review: x\nSentiment:" and plain.demos_text(()) == ""
    assert set(plain.to_dict()) == {"name", "in_prefix", "label_prefix", "labels", "source",
                                    "hub"}
    assert Task.from_dict(NLI.to_dict()) == NLI
    own = Task("t", "Review", "Sentiment", LABELS, "unused", prompt="{in_prefix}> {text} =")
    assert own.query("x") == "Review> x ="


@pytest.mark.parametrize("prompt,message", [
    ("{text} {premise}\nA:", "prompt names ['premise']"),
    ("Answer:", "prompt has no {text}"),
    ("{text}\nAnswer: ", "ends in white space"),
    ("{text} {", "literal brace"),
    ("{text} {0}", "is not a field name"),
])
def test_bad_prompts_are_one_line(prompt, message):
    with pytest.raises(TaskError, match=message.replace("[", r"\[").replace("]", r"\]")
                       .replace("{", r"\{").replace("}", r"\}")):
        Task("t", "", "", LABELS, "unused", prompt=prompt)


def write_nli(tmp_path, rows: int = 80, **spec):
    """A CSV with premise and hypothesis columns and its spec (YAML)."""
    import csv

    with open(tmp_path / "nli.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["premise", "hypothesis", "label"])
        for i in range(rows):
            w.writerow([f"the movie {i} is dull", f"the plot {i} is slow", LABELS[i % 2]])
    body = {"name": "nli", "labels": list(LABELS), "data": "nli.csv",
            "instruction": NLI.instruction, "prompt": NLI.prompt, "input": NLI.input, **spec}
    (tmp_path / "nli.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n"
                                               for k, v in body.items()))
    return tmp_path / "nli.yaml"


def test_multi_column_data(tmp_path):
    task = load_task_file(write_nli(tmp_path))
    assert task == Task("nli", "", "", LABELS, str(tmp_path / "nli.csv"), **{
        k: getattr(NLI, k) for k in ("instruction", "prompt", "input")})
    ds = load_dataset(task)
    texts = {e.text for e in (*ds.train, *ds.test)}
    assert "Premise: the movie 3 is dull\nHypothesis: the plot 3 is slow" in texts
    assert len(texts) == 80
    bad = write_nli(tmp_path, input="{premise} {claim}")
    with pytest.raises(DataError, match="no column 'claim', which the task's `input` names"):
        load_dataset(load_task_file(bad))
    packaged = Task("p", "Review", "Sentiment", ("negative", "positive"), "packaged:sst2",
                    input="{text}")
    with pytest.raises(DataError, match="a packaged dataset has one text column"):
        load_dataset(packaged)
    # a spec without data still names a task (compile, classify); extracting from it is a line
    (tmp_path / "bare.json").write_text(json.dumps({"labels": list(LABELS), "prompt": "{text}:"}))
    with pytest.raises(DataError, match="names no data"):
        load_dataset(get_task(str(tmp_path / "bare.json")))


def test_states_are_transformers_on_the_written_prompts():
    """h_zs (the instruction run once, each query after its cache) and h_icl against the
    model's own forward over the whole string written out here."""
    from ltv_vllm.extraction.capture import Capturer
    from ltv_vllm.pipeline.extract import capture_episode

    tok = make_tokenizer()
    model = make_llama(len(tok), seed=5)
    texts = [TEXT, "Premise: rain\nHypothesis: wet streets"]
    ep = Episode(NLI, 0, DEMOS, tuple(Example(x, 0) for x in texts), (Example(TEXT, 1),))
    c = capture_episode(Capturer(model, tok, batch_size=2, progress=False), ep)

    def ref(text: str) -> torch.Tensor:
        with torch.no_grad():
            out = model.model(torch.tensor([tok(text)["input_ids"]]))
        return out.last_hidden_state[0, -1]

    lead = "Does the hypothesis follow?\n"
    demos = "".join(f"{e.text}\nAnswer: {LABELS[e.label]}\n" for e in DEMOS)
    for i, x in enumerate(texts):
        torch.testing.assert_close(c.h_zs[i], ref(f"{lead}{x}\nAnswer:"), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(c.h_icl[i], ref(f"{lead}{demos}{x}\nAnswer:"),
                                   atol=1e-4, rtol=1e-4)


def test_chat_system_turn_and_instruction():
    """Through a chat template: the task's system turn replaces the template's default and
    the instruction opens the first user message, as a chat client would send them."""
    template = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
                "{{ '<s>system\nBe brief.</s>\n' }}{% endif %}"
                "{{ '<s>' + m['role'] + '\n' + m['content'] + '</s>\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")
    tok = make_tokenizer(corpus=CORPUS)
    tok.chat_template = template
    task = Task("nli", "", "", LABELS, "unused", instruction=NLI.instruction,
                prompt=NLI.prompt, system="You judge entailment.")
    for demos in ("turns", "inline"):
        t = chat_task(task, tok, demos)
        sent = [{"role": "system", "content": "You judge entailment."},
                {"role": "user", "content": f"{NLI.instruction}\n{TEXT}\nAnswer:"}]
        want = tok.apply_chat_template(sent, tokenize=False, add_generation_prompt=True)
        assert t.zero_shot(TEXT) == want and "Be brief" not in want
        assert t.demos_text(DEMOS) + t.query(TEXT) == tok.apply_chat_template(
            t.messages(DEMOS, TEXT), tokenize=False, add_generation_prompt=True)
        assert t.messages(DEMOS, TEXT)[1]["content"].startswith(NLI.instruction + "\n")


def test_one_spec_file_for_compile(tmp_path):
    """`compile --task SPEC` reads the file `extract` reads: its template goes to the server,
    each JSONL line's text is made from its columns by `input`; the server's parser builds
    the same task from it."""
    from ltv_vllm.cli.serve import compile_request
    from ltv_vllm.serving.store.compile import parse_request

    spec = write_nli(tmp_path)
    rows = [{"premise": "a cat sleeps", "hypothesis": "an animal sleeps", "label": "yes"},
            {"premise": "it rains", "hypothesis": "the sun shines", "label": "no"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({k: r[k] for k in ("premise",
                                                          "hypothesis")}) + "\n" for r in rows))
    body = compile_request("mine", str(spec), str(tmp_path / "d.jsonl"),
                           str(tmp_path / "q.jsonl"), None, 5.0)
    assert body["task"] == {"in_prefix": "", "label_prefix": "", "labels": list(LABELS),
                            "instruction": NLI.instruction, "prompt": NLI.prompt}
    assert [d["text"] for d in body["demos"]] == [e.text for e in DEMOS]
    assert body["queries"] == [e.text for e in DEMOS]
    req = parse_request(json.loads(json.dumps(body)), tokenizer=make_tokenizer(),
                        max_model_len=512)
    assert req.task.query(TEXT) == NLI.query(TEXT) and req.task.lead == NLI.lead
    assert req.episode().demo_prefix() == NLI.demos_text(DEMOS)


def test_extract_with_chosen_demos_and_queries(tmp_path, tokenizer):
    """`extract --demos D --queries Q`: the episode holds exactly the file's demonstrations
    (in order) and queries, and the vector is the ridge fit on their states, the independent
    solve of transformers' own hidden states over the prompts written out here; with a spec
    that names no data nothing is scored; bad files are one line."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main
    from ltv_vllm.core.vector import load_task_vector

    d = tmp_path / "m"
    model = make_llama(len(tokenizer), seed=5)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    spec = write_nli(tmp_path)
    demos = [{"premise": f"a cat {i}", "hypothesis": f"an animal {i}", "label": LABELS[i % 2]}
             for i in range(4)]
    queries = [{"premise": f"rain {i}", "hypothesis": f"wet {i}"} for i in range(6)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in demos))
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in queries))
    args = ["extract", "--model", str(d), "--quiet", "--lam", "5", "--demos",
            str(tmp_path / "d.jsonl"), "--queries", str(tmp_path / "q.jsonl")]
    r = CliRunner().invoke(main, [*args, "--task", str(spec), "--n-test", "8",
                                  "-o", str(tmp_path / "a.pt")])
    assert r.exit_code == 0, r.output
    tv = load_task_vector(tmp_path / "a.pt")
    assert (tv.provenance.k_used, tv.provenance.n, tv.provenance.n_test) == (4, 6, 8)

    def h(text: str) -> torch.Tensor:
        with torch.no_grad():
            out = model.model(torch.tensor([tokenizer(text)["input_ids"]]))
        return out.last_hidden_state[0, -1].double()

    lead = NLI.instruction + "\n"
    shown = "".join(f"Premise: {x['premise']}\nHypothesis: {x['hypothesis']}\nAnswer: "
                    f"{x['label']}\n" for x in demos)
    qs = [f"Premise: {x['premise']}\nHypothesis: {x['hypothesis']}\nAnswer:" for x in queries]
    H = torch.stack([h(lead + q) for q in qs], 1)                     # (d, N)
    Y = torch.stack([h(lead + shown + q) for q in qs], 1) - H          # (d, N)
    W = Y @ H.T @ torch.linalg.inv(H @ H.T + 5 * torch.eye(H.shape[0], dtype=H.dtype))
    got = (tv.U.double() @ tv.V.double().T)
    torch.testing.assert_close(got, W, atol=2e-4, rtol=2e-3)
    assert tv.meta["teacher"]["gold_weight"] == 0.0  # unlabeled queries: the prompt itself
    # the same queries with their labels: blended in by default, and away from the plain fit
    (tmp_path / "ql.jsonl").write_text("".join(json.dumps({**r, "label": LABELS[i % 2]}) + "\n"
                                               for i, r in enumerate(queries)))
    r = CliRunner().invoke(main, [*args[:-1], str(tmp_path / "ql.jsonl"), "--task", str(spec),
                                  "--n-test", "8", "-o", str(tmp_path / "g.pt")])
    assert r.exit_code == 0, r.output
    gold = load_task_vector(tmp_path / "g.pt")
    assert gold.meta["teacher"]["gold_weight"] == 0.8
    assert (gold.U.double() @ gold.V.double().T - W).abs().max() > 1e-3
    # a spec without data: the vector from the files alone, nothing scored
    (tmp_path / "bare.yaml").write_text(
        "".join(f"{k}: {json.dumps(v)}\n" for k, v in {
            "name": "bare", "labels": list(LABELS), "instruction": NLI.instruction,
            "prompt": NLI.prompt, "input": NLI.input}.items()))
    r = CliRunner().invoke(main, [*args, "--task", str(tmp_path / "bare.yaml"),
                                  "-o", str(tmp_path / "b.pt")])
    assert r.exit_code == 0, r.output
    assert load_task_vector(tmp_path / "b.pt").provenance.n_test == 0
    (tmp_path / "bad.jsonl").write_text(json.dumps({"premise": "x", "label": "no"}) + "\n")
    for extra, message in ((["--demos", str(tmp_path / "bad.jsonl")], "no column 'hypothesis'"),
                           (["--k", "4"], "drop --k"),
                           (["--demos", str(tmp_path / "q.jsonl")], "missing field 'label'")):
        r = CliRunner().invoke(main, [*args, "--task", str(spec), *extra])
        assert r.exit_code == 1 and message in r.output, (extra, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output
