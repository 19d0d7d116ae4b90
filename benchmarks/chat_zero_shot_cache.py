"""What a chat rendering costs to capture, and what caching its zero-shot head saves.

Every zero-shot prompt through a chat template begins with the same head (the template's
default system turn and the user turn's opening: `ChatTask.head`), which on SmolLM2 and
Qwen2.5 is longer than the query itself. `zero_shot_states` runs the head once and each
query after its KV cache, as ICL runs its demonstrations. This times one episode's whole
capture (train and test queries, zero-shot and ICL; `capture_episode`) three ways, side by
side in one process: the completion prompt, the chat rendering with the head cached, and the
same rendering with every zero-shot prompt run whole (the code before the cache), and checks
that the two chat captures agree.

    python benchmarks/chat_zero_shot_cache.py --model smollm2-135m --task trec \\
        --out benchmarks/results/chat_zero_shot_cache_smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="trec")
    ap.add_argument("--k", type=int, default=30)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--n-test", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/chat_zero_shot_cache"))
    a = ap.parse_args()

    import torch

    from ltv_vllm.extraction.capture import Capturer
    from ltv_vllm.models.hardware import hardware, machine_line
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.pipeline.extract import ExtractOptions, capture_episode, plan_episode
    from ltv_vllm.tasks.chat import ChatTask, chat_task
    from ltv_vllm.tasks.specs import get_task

    class Uncached(ChatTask):
        """The same rendering with no zero-shot head to cache: every prompt run whole."""

        @property
        def zero_shot_prefix(self) -> str:
            return ""

        def zero_shot(self, text: str) -> str:
            return self.head + self.query(text)

    lm = load_model(a.model, dtype=a.dtype)
    task = get_task(a.task)
    chat = chat_task(task, lm.tokenizer)
    uncached = Uncached(**{f: getattr(chat, f) for f in chat.__dataclass_fields__})
    base = plan_episode(task, ExtractOptions(k=a.k, n=a.n, n_test=a.n_test, progress=False))
    forms = {"completion": task, "chat, head cached": chat, "chat, every prompt whole": uncached}
    seconds: dict[str, list[float]] = {f: [] for f in forms}
    caps = {}
    for _ in range(a.repeats):  # interleaved, so a slow spell of the machine hits each form
        for form, t in forms.items():
            ep = type(base)(t, base.seed, base.demos, base.queries, base.test, base.test_seed,
                            base.val)
            cap = Capturer(lm.model, lm.tokenizer, batch_size="auto", progress=False,
                           special_tokens=t.special_tokens)
            t0 = time.perf_counter()
            caps[form] = capture_episode(cap, ep)
            seconds[form].append(time.perf_counter() - t0)
    got, whole = caps["chat, head cached"], caps["chat, every prompt whole"]
    diff = max(float((x - y).abs().max()) for x, y in ((got.h_zs, whole.h_zs),
                                                       (got.h_zs_test, whole.h_zs_test)))
    scale = float(whole.h_zs.abs().max())
    tokens = {form: len(lm.tokenizer(t.zero_shot(base.test[0].text),
                                     add_special_tokens=t.special_tokens)["input_ids"])
              for form, t in forms.items()}
    best = {f: min(s) for f, s in seconds.items()}
    doc = {"command": "python benchmarks/chat_zero_shot_cache.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()),
           "machine": hardware(), "dtype": str(lm.model.dtype).removeprefix("torch."),
           "head_tokens": len(lm.tokenizer(chat.head, add_special_tokens=False)["input_ids"]),
           "zero_shot_tokens": tokens, "seconds": seconds, "best_seconds": best,
           "max_abs_diff_h_zs": diff, "h_zs_scale": scale}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["# Capturing a chat rendering: the zero-shot head cached", "",
             f"`{doc['command']}`", "", f"{machine_line(doc['machine'])}, {doc['dtype']}", "",
             f"One {a.task} episode (k={a.k}, N={a.n}, {a.n_test} test queries), its whole "
             f"capture (`capture_episode`: train and test, zero-shot and ICL), best of "
             f"{a.repeats} interleaved runs. The chat head is {doc['head_tokens']} tokens. "
             f"The cached and whole chat captures agree to {diff:.1e} (states of magnitude "
             f"{scale:.1f}).", "",
             "| rendering | zero-shot prompt tokens | capture s | × completion |",
             "|---|---|---|---|"]
    for form in forms:
        lines.append(f"| {form} | {tokens[form]} | {best[form]:.1f} | "
                     f"{best[form] / best['completion']:.2f} |")
    (a.out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    torch.testing.assert_close(got.h_icl, whole.h_icl)  # the ICL path is the same code


if __name__ == "__main__":
    main()
