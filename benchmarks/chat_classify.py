"""Classification through a chat template: what the template does to the prompt a vector was
fitted on, measured.

A vector is fitted on the task's completion prompt (`Question: ...\\nAnswer Type:`), at the
state of its last token. A chat-completions request wraps the same text in the model's chat
template: a system turn, the user turn, and with a generation prompt an assistant header, so
the label is predicted from another state (after `<|im_start|>assistant\\n`), one the vector
never saw. With `continue_final_message` and the task prompt as the final (assistant)
message, the rendered prompt ends exactly as the fitted prompt does, behind the template's
preamble. This scores, on the same test queries, one multi-task engine (`serve.task_engine`,
the vectors of `--vectors DIR`), label-restricted as `classify` does:

  completion            the fitted prompt (what `ltv-vllm classify` sends)
  chat                  the task prompt as the user message, generation prompt on
  chat, continued       the task prompt as the final assistant message, continued

each zero-shot and with the task's LTV, and how many predictions equal the completion
prompt's.

    python benchmarks/chat_classify.py --model smollm2-135m --tasks trec,sst2 \\
        --vectors benchmarks/results/serving_multitask/work/vectors \\
        --out benchmarks/results/chat_classify_smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

FORMS = ("completion", "chat", "chat, continued")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="trec,sst2")
    ap.add_argument("--vectors", type=Path, required=True,
                    help="directory with TASK-*.safetensors (e.g. bench serving's work/vectors)")
    ap.add_argument("--n-test", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/chat_classify"))
    a = ap.parse_args()

    from vllm import LLM

    from ltv_vllm.models.hardware import hardware, machine_line, resolve_for_model
    from ltv_vllm.models.resolve import resolve_model
    from ltv_vllm.serving.launcher.recipe import task_engine
    from ltv_vllm.serving.offline.llm import classification_params, parse_classification
    from ltv_vllm.tasks.data import load_dataset, sample_test
    from ltv_vllm.tasks.specs import get_task, label_token_ids

    model_dir = resolve_model(a.model)
    dtype = resolve_for_model(a.dtype, model_dir)
    names = a.tasks.split(",")
    vectors = {t: next(a.vectors.glob(f"{t}-k*.safetensors")) for t in names}
    engine = task_engine(model_dir, vectors)
    os.environ.update(engine.env)
    llm = LLM(**engine.kwargs, dtype=dtype, enforce_eager=True, max_model_len=2048,
              logprobs_mode="processed_logprobs", seed=0)
    tok = llm.get_tokenizer()
    res = {"model": a.model, "dtype": dtype, "machine": hardware(), "n_test": a.n_test,
           "tasks": {}}
    example = {}
    for name in names:
        task = get_task(name)
        test = sample_test(load_dataset(task), a.n_test, seed=a.seed)
        ids = label_token_ids(task, tok)
        prompts = [task.query(e.text) for e in test]
        gold = [e.label for e in test]
        per: dict = {}
        for form in FORMS:
            for method in ("zero-shot", "ltv"):
                params = classification_params(ids)
                if method == "ltv":
                    params.extra_args = {"ltv_task": name}
                if form == "completion":
                    outs = llm.generate(prompts, params, use_tqdm=False)
                else:
                    cont = form == "chat, continued"
                    convs = [[{"role": "assistant" if cont else "user", "content": p}]
                             for p in prompts]
                    outs = llm.chat(convs, params, use_tqdm=False, add_generation_prompt=not cont,
                                    continue_final_message=cont)
                    example[form] = tok.decode(outs[0].prompt_token_ids)
                preds = [task.labels.index(parse_classification(o, ids, task.labels).label)
                         for o in outs]
                per[f"{form} / {method}"] = preds
        base = {m: per[f"completion / {m}"] for m in ("zero-shot", "ltv")}
        res["tasks"][name] = {
            key: {"accuracy": sum(p == g for p, g in zip(preds, gold, strict=True)) / len(gold),
                  "same_as_completion": sum(p == b for p, b in zip(
                      preds, base[key.split(" / ")[1]], strict=True)) / len(gold)}
            for key, preds in per.items()}
    res["example_prompts"] = {"completion": prompts[0], **example}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=1, ensure_ascii=False))
    cmd = (f"python benchmarks/chat_classify.py --model {a.model} --tasks {a.tasks} --vectors "
           f"{a.vectors} --n-test {a.n_test} --out {a.out}")
    md = ["# Classification through a chat template\n", f"```\n{cmd}\n```\n",
          f"{machine_line(res['machine'])}; {dtype}; vLLM offline, one multi-task engine; "
          f"{a.n_test} test queries per task; label-restricted argmax.\n",
          "| task | prompt | zero-shot | LTV | LTV predictions equal to the completion "
          "prompt's |", "|---|---|---|---|---|"]
    for name, per in res["tasks"].items():
        for form in FORMS:
            z, v = per[f"{form} / zero-shot"], per[f"{form} / ltv"]
            md.append(f"| {name} | {form} | {100 * z['accuracy']:.1f}% | "
                      f"{100 * v['accuracy']:.1f}% | {100 * v['same_as_completion']:.0f}% |")
    md += ["", "Prompts as rendered (the last task's first query):", ""]
    for form, text in res["example_prompts"].items():
        md.append(f"- {form}: `{text!r}`")
    (a.out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
