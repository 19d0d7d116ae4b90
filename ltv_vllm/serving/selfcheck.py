"""`ltv-vllm selfcheck`: the per-request shift proves itself on the vLLM, runner and device
it runs on.

Probe tasks whose effect cannot be mistaken go through a real engine in one `generate`
(one scheduler run), mixed with bare rows: each probe is a logit-space vector whose bias
puts +1000 on a token of its own (the last tokens of the vocabulary), with its own default
policy (`first`, `all`, `2`); requests override policies (`ltv_steps` 0, 1, 3, all), ask
for `n = 2`, have prompts of several lengths (with `--max-num-batched-tokens`, some several
times the budget, so their prefill is chunked) and `max_tokens` from 2 to 6 (so rows finish
at different steps and slots move). Every generated step is then checked from its
distribution: a step a probe shifted has its best logprob ≥ 500 nats above its second (no
model's own logits do that); a row of task T with policy n must be shifted at exactly its
first n steps, to T's token, and a bare row at none. The first wrong row is one line
naming the vLLM version, the runner and the device (`SelfCheckFailed`).

What it checks is the row plan (`vllm_ext.steps`), which fused and per-request serving share.
In LoRA mode (`--multi-task lora`) the probes are adapters instead (`probes.LORA_PROBES`:
LoRA has no bias, so each moves one of eight tokens of its own to the top, at every step),
sent with the same mix of bare rows, lengths, budgets and n; each row's best token at each
step must be one of its own adapter's, and a bare row's none of them (`check_lora_rows`):
what vLLM's LoRA batching (and the CPU backend's fix, `vllm_ext.fixes`) gives each row.

    python -m ltv_vllm.serving.selfcheck JOB OUT    (a job: `serving.jobs`)
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ltv_vllm.errors import UserError
from ltv_vllm.serving.probes import (
    BIAS,
    LORA_PAIRS,
    LORA_PROBES,
    LORA_TOKENS,
    PROBES,
    lora_probe_vectors,
    probe_tokens,
    probe_vectors,
)
from ltv_vllm.serving.step_policy import ADMIT_KEY, STEPS_KEY, TASK_KEY, admission, stamp


class SelfCheckFailed(UserError):
    """A row did not carry exactly its own probe at exactly its own steps."""


@dataclass(frozen=True)
class SelfCheckOptions:
    """What `ltv-vllm selfcheck` runs the probes on: the engine settings a server would use."""

    model_dir: str
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # a small batch: requests wait, slots are reused and move
    enforce_eager: bool = True
    lora: bool = False  # the probes as LoRA adapters (`serve --multi-task lora`)


@dataclass(frozen=True)
class Probe:
    """One request of the probe batch."""

    prompt: str
    task: str | None           # a probe's name, or None (the bare model)
    steps: str | int | None    # `ltv_steps` (None: the task's default)
    n: int
    max_tokens: int

    def expected_steps(self) -> int | None:
        """Leading generated tokens the probe must carry (None: every one)."""
        from ltv_vllm.core.vector import parse_steps

        if self.task is None:
            return 0
        return parse_steps(self.steps if self.steps is not None else PROBES[self.task])


def probe_batch(tokenizer: Any, budget: int | None, max_len: int) -> list[Probe]:
    """The mixed batch: every policy, overrides, n = 2, short and long prompts (longer than
    the engine's per-step token budget, when one is given), staggered `max_tokens`."""
    def prompt(tokens: int) -> str:
        words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
        text, i = "Question:", 0
        while len(tokenizer(text)["input_ids"]) < tokens:
            text += " " + words[i % len(words)]
            i += 1
        return text

    short = [prompt(6), prompt(11), prompt(17)]
    long_len = min(max(3 * (budget or 16), 40), max_len - 8)
    long = [prompt(long_len), prompt(max(long_len // 2, 24))]
    first, every, two = PROBES
    return [
        Probe(short[0], None, None, 1, 3),
        Probe(short[1], first, None, 1, 4),
        Probe(short[2], every, None, 1, 5),
        Probe(short[0], two, None, 1, 6),
        Probe(long[0], first, None, 1, 3),
        Probe(short[1], first, 3, 1, 5),
        Probe(short[2], every, 0, 1, 3),
        Probe(long[1], two, None, 2, 4),
        Probe(long[0], None, None, 1, 2),
        Probe(short[0], every, 1, 1, 4),
        Probe(long[1], two, "all", 1, 2),
        Probe(short[2], None, None, 2, 5),
        Probe(short[1], two, "first", 1, 6),
    ]


SHIFTED_GAP = BIAS / 2  # a step's best and second-best logprobs this far apart: shifted


def check_rows(batch: list[Probe], outputs: list[list[list[tuple[int, float]]]],
               tokens: dict[str, int]) -> list[str]:
    """Every wrong row, one line each (empty: all right). `outputs`: per request, per
    choice, per generated step (token, best minus second-best logprob). A step carries a
    probe iff that gap is over `SHIFTED_GAP` (no model puts 500 nats between its two best
    tokens): what the step got is read off the distribution, not guessed from the token,
    which a model may well repeat after the probe wrote it."""
    wrong = []
    for i, (p, outs) in enumerate(zip(batch, outputs, strict=True)):
        n = p.expected_steps()
        if len(outs) != p.n:
            wrong.append(f"row {i} (task {p.task or 'bare'}): {len(outs)} choices, not {p.n}")
        for c, steps in enumerate(outs):
            bad = []
            for k, (t, gap) in enumerate(steps):
                want = p.task is not None and (n is None or k < n)
                got = gap > SHIFTED_GAP
                if got != want or (want and t != tokens[p.task]):
                    bad.append(k)
            if len(steps) != p.max_tokens or bad:
                seen = ["probe" if gap > SHIFTED_GAP else "bare" for _, gap in steps]
                wrong.append(f"row {i} (task {p.task or 'bare'}, ltv_steps "
                             f"{p.steps if p.steps is not None else 'default'}, choice {c}): "
                             f"steps {seen}, expected the probe at steps < {n}")
    return wrong


def lora_probe_batch(tokenizer: Any, budget: int | None, max_len: int) -> list[Probe]:
    """`probe_batch` with each probe's rows given a LoRA probe (every step: adapters have no
    step policy), and bare rows greedy: each is compared with the same request run before
    any adapter was loaded (`check_lora_rows`)."""
    lora = dict(zip(PROBES, LORA_PROBES, strict=True))
    return [replace(p, task=lora[p.task], steps=None) if p.task else replace(p, n=1)
            for p in probe_batch(tokenizer, budget, max_len)]


NEAR_TIE = 1.0  # nats: a bare step whose best two tokens are closer may flip between batches


def check_lora_rows(batch: list[Probe], tops: list[list[list[tuple[int, float]]]],
                    own: dict[str, set[int]],
                    bare: dict[int, list[tuple[int, float]]]) -> list[str]:
    """Every wrong row of a LoRA probe batch, one line each. `tops`: per request, per
    choice, each step's (best token, best minus second-best logprob); `bare`: per bare
    request, the same from its run before any adapter was loaded. A probe's row must have
    one of its own tokens at every step; a bare row must be its reference, step for step
    (up to a near tie, after which the two may part: both are the bare model's). Judged
    against the bare model itself, not against the probe tokens, which a model may well
    favour unshifted (a tiny test model's vocabulary is hundreds of tokens)."""
    wrong = []
    for i, (p, outs) in enumerate(zip(batch, tops, strict=True)):
        want = p.task or "bare"
        if len(outs) != p.n:
            wrong.append(f"row {i} (adapter {want}): {len(outs)} choices, not {p.n}")
        for c, steps in enumerate(outs):
            seen = [next((n for n, ts in own.items() if t in ts), "bare") for t, _ in steps]
            if p.task is None:
                seen = ["bare"] * len(steps)
                for k, ((t, _), (t_ref, gap)) in enumerate(zip(steps, bare[i], strict=False)):
                    if t != t_ref:
                        if gap > NEAR_TIE:
                            seen[k] = next((n for n, ts in own.items() if t in ts), "other")
                        break
            if len(steps) != p.max_tokens or any(x != want for x in seen):
                wrong.append(f"row {i} (adapter {want}, choice {c}): steps {seen}")
    return wrong


def run_selfcheck(opts: SelfCheckOptions) -> dict[str, Any]:
    """The probes through a fresh engine in this process; the result, or SelfCheckFailed."""
    from transformers import AutoTokenizer
    from vllm import LLM

    from ltv_vllm.models.hardware import resolve_for_model
    from ltv_vllm.serving.serve import plan_lora, task_engine
    from ltv_vllm.serving.vllm_support import check_version

    check_version()
    tok = AutoTokenizer.from_pretrained(opts.model_dir)
    tokens = probe_tokens(tok, LORA_TOKENS if opts.lora else len(PROBES))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ltv-selfcheck-") as d:
        vectors = (lora_probe_vectors if opts.lora else probe_vectors)(opts.model_dir, tokens)
        paths = {name: tv.save(Path(d) / f"{name}.safetensors")
                 for name, tv in vectors.items()}
        adapters: dict[str, str] = {}
        if opts.lora:  # the adapters a LoRA-mode server would write, by the same plan
            plan = plan_lora(opts.model_dir, paths, lora_dir=Path(d) / "adapters")
            plan.write()
            # every slot holds a probe (no spare): a bare row that read any slot shows
            engine_kw: dict[str, Any] = {"model": opts.model_dir, **plan.engine_kwargs(),
                                         "max_loras": len(LORA_PROBES)}
            adapters = {n: str(a) for n, a in plan.adapters.items()}
        else:
            engine = task_engine(opts.model_dir, paths)
            os.environ.update(engine.env)  # the frontend admits the probe names
            engine_kw = engine.kwargs
        kw: dict[str, Any] = {}
        if opts.max_num_batched_tokens:
            kw.update(max_num_batched_tokens=opts.max_num_batched_tokens,
                      enable_chunked_prefill=True)
        if opts.max_num_seqs:
            kw["max_num_seqs"] = opts.max_num_seqs
        llm = LLM(**engine_kw, dtype=resolve_for_model(opts.dtype, opts.model_dir),
                  max_model_len=opts.max_model_len, enforce_eager=opts.enforce_eager,
                  tensor_parallel_size=opts.tensor_parallel_size, seed=0, **kw)
        start = time.perf_counter() - t0
        max_len = int(llm.llm_engine.vllm_config.model_config.max_model_len)
        batch = (lora_probe_batch if opts.lora else probe_batch)(
            tok, opts.max_num_batched_tokens, max_len)
        params = [probe_params(p) for p in batch]
        t1 = time.perf_counter()
        if opts.lora:  # the bare rows first, alone, before any adapter is loaded
            bare = [i for i, p in enumerate(batch) if p.task is None]
            ref = dict(zip(bare, llm.generate([batch[i].prompt for i in bare],
                                              [params[i] for i in bare], use_tqdm=False),
                           strict=True))
        outs = llm.generate([p.prompt for p in batch], params, use_tqdm=False,
                            lora_request=lora_requests(batch, adapters) if opts.lora else None)
        check_s = time.perf_counter() - t1
    ran_on = where(llm.llm_engine.vllm_config)
    found = lora_verdict(batch, outs, ref, tokens, ran_on) if opts.lora else verdict(
        batch, outs, tokens, ran_on)
    return {**found, "engine_start_seconds": round(start, 2),
            "check_seconds": round(check_s, 3), "options": asdict(opts)}


# the LoRA probes' adapter ids: far above the ids a server gives its own adapters (from 1)
LORA_ID_BASE = 1 << 30


def lora_requests(batch: list[Probe], adapters: dict[str, str]) -> list[Any]:
    """Each probe row's LoRARequest (None: a bare row)."""
    from vllm.lora.request import LoRARequest

    ids = {name: LORA_ID_BASE + i for i, name in enumerate(LORA_PROBES)}
    return [None if p.task is None else LoRARequest(p.task, ids[p.task], adapters[p.task])
            for p in batch]


def lora_verdict(batch: list[Probe], outs: list[Any], bare: dict[int, Any],
                 tokens: list[int], where: str) -> dict[str, Any]:
    """The LoRA batch's RequestOutputs checked against the bare rows' own run (`bare`:
    request index → RequestOutput; `check_lora_rows`); SelfCheckFailed on a wrong row."""
    per = 2 * LORA_PAIRS
    own = {name: set(tokens[per * i: per * (i + 1)]) for i, name in enumerate(LORA_PROBES)}

    def steps(c: Any) -> list[tuple[int, float]]:
        return [(max(lp, key=lambda t: lp[t].logprob), _gap(lp)) for lp in c.logprobs]

    tops = [[steps(c) for c in o.outputs] for o in outs]
    rows = sum(len(o) for o in tops)
    wrong = check_lora_rows(batch, tops, own, {i: steps(o.outputs[0]) for i, o in bare.items()})
    if wrong:
        raise SelfCheckFailed(f"selfcheck (LoRA) failed on {where}: {len(wrong)} of {rows} "
                              f"rows wrong; first: {wrong[0]}")
    return {"ok": True, "where": where + ", LoRA", "rows": rows,
            "tokens": sum(len(t) for o in tops for t in o)}


def where(vllm_config: Any) -> str:
    """What the probes ran on, for the verdict's line: vLLM's version, the model runner the
    engine was built with — read from vLLM's own config (`use_v2_model_runner`: the setting,
    and what overrides it), not from what ltv-vllm asked for — and the device."""
    import vllm

    from ltv_vllm.models.hardware import engine_device

    runner = "V2" if vllm_config.use_v2_model_runner else "V1"
    return f"vLLM {vllm.__version__}, {runner} runner, {engine_device()}"


def probe_params(p: Probe) -> Any:
    """A probe's SamplingParams: greedy, or with n > 1 (which vLLM refuses at temperature 0)
    sampled at temperature 1; every token generated; the two best logprobs of each step.
    (Not top-k 1: a server's processed logprobs would then show every other token at −inf,
    which reads as a shifted step.)"""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    xargs: dict[str, Any] = {}
    if p.task is not None and p.task not in LORA_PROBES:  # (an adapter is the LoRARequest)
        xargs[TASK_KEY] = p.task
    if p.steps is not None:
        xargs[STEPS_KEY] = p.steps
    if (adm := admission()) is not None:  # in a server: stamped as its gate would
        xargs[ADMIT_KEY] = stamp(adm, xargs.get(TASK_KEY, ""), xargs.get(STEPS_KEY))
    sampling = {"temperature": 0.0 if p.n == 1 else 1.0}
    # FINAL_ONLY: one output per request with all n choices (a streaming kind would hand
    # the choices over one child at a time)
    return SamplingParams(max_tokens=p.max_tokens, n=p.n, ignore_eos=True, logprobs=2,
                          extra_args=xargs or None, output_kind=RequestOutputKind.FINAL_ONLY,
                          **sampling)


def verdict(batch: list[Probe], outs: list[Any], tokens: list[int],
            where: str) -> dict[str, Any]:
    """The batch's RequestOutputs checked (`check_rows`); SelfCheckFailed on a wrong row."""
    outputs = [[[(t, _gap(lp)) for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
                for c in o.outputs] for o in outs]
    rows = sum(len(o) for o in outputs)
    wrong = check_rows(batch, outputs, dict(zip(PROBES, tokens, strict=True)))
    if wrong:
        raise SelfCheckFailed(f"selfcheck failed on {where}: {len(wrong)} of {rows} rows "
                              f"wrong; first: {wrong[0]}")
    return {"ok": True, "where": where, "rows": rows,
            "tokens": sum(len(t) for o in outputs for t in o)}


async def engine_selfcheck(engine_client: Any, model_dir: str | Path,
                           probe_names: dict[str, str],
                           lora: dict[str, str] | None = None) -> dict[str, Any]:
    """The probe batch through a running engine (the server's, at start: `vllm_ext.endpoints`),
    all requests in flight together. `probe_names`: PROBES' names → the names the engine
    holds them under; `lora`: instead, LORA_PROBES' names → their adapter directories (sent
    as LoRA requests, removed from the engine after). Chunked prefill is forced only where
    the engine's step budget is small (≤ 256 tokens); `ltv-vllm selfcheck
    --max-num-batched-tokens` forces it anywhere."""
    import asyncio
    import uuid

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tokens = probe_tokens(tok, LORA_TOKENS if lora else len(PROBES))
    budget = int(engine_client.vllm_config.scheduler_config.max_num_batched_tokens)
    max_len = int(engine_client.model_config.max_model_len)
    batch = (lora_probe_batch if lora else probe_batch)(
        tok, budget if budget <= 256 else None, max_len)
    loras = lora_requests(batch, lora) if lora else [None] * len(batch)
    tag = uuid.uuid4().hex[:8]

    async def one(i: int, p: Probe, phase: str = "") -> Any:
        served = p if lora else replace(p, task=probe_names[p.task] if p.task else None)
        final = None
        async for out in engine_client.generate(
                {"prompt_token_ids": tok(p.prompt)["input_ids"]}, probe_params(served),
                f"ltv-selfcheck-{tag}{phase}-{i}", lora_request=loras[i]):
            final = out
        return final

    t0 = time.perf_counter()
    if not lora:
        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
        return {**verdict(batch, outs, tokens, where(engine_client.vllm_config)),
                "check_seconds": round(time.perf_counter() - t0, 3)}
    # the bare rows first, alone, before any probe adapter is loaded: their reference
    bare = [i for i, p in enumerate(batch) if p.task is None]
    ref = dict(zip(bare, await asyncio.gather(*(one(i, batch[i], "-ref") for i in bare)),
                   strict=True))
    try:
        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    finally:
        for r in {r.lora_int_id for r in loras if r is not None}:
            await engine_client.remove_lora(r)  # their slots are the server's again
    return {**lora_verdict(batch, outs, ref, tokens, where(engine_client.vllm_config)),
            "check_seconds": round(time.perf_counter() - t0, 3)}


def _gap(logprobs: dict[int, Any]) -> float:
    """Best minus second-best logprob of one step (vLLM returns the top 2, and the sampled
    token if it is not among them)."""
    top = sorted((x.logprob for x in logprobs.values()), reverse=True)
    return float(top[0] - top[1]) if len(top) > 1 else float("inf")


def selfcheck_in_subprocess(opts: SelfCheckOptions, work: Path,
                            module: str = "ltv_vllm.serving.selfcheck") -> dict[str, Any]:
    """`run_selfcheck` in a fresh process (`serving.jobs`); SelfCheckFailed raised here,
    its line whole. `module`: the job's module (a test plants a bug with its own)."""
    from ltv_vllm.models.hardware import engine_device
    from ltv_vllm.serving.jobs import run_job
    from ltv_vllm.serving.vllm_support import cpu_rank_binding

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    if engine_device() == "cpu":  # the CPU backend's own settings
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env.update(cpu_rank_binding(opts.tensor_parallel_size))
    out = run_job(module, asdict(opts), work, "selfcheck", env=env, what="selfcheck")
    if not out.get("ok"):
        raise SelfCheckFailed(out["error"])
    return out


def run_job_dict(job: dict[str, Any]) -> dict[str, Any]:
    """The job's side: a failed check is a result (its line whole), not a crash."""
    try:
        return run_selfcheck(SelfCheckOptions(**job))
    except SelfCheckFailed as e:
        return {"ok": False, "error": str(e)}


if __name__ == "__main__":
    from ltv_vllm.serving.jobs import job_main

    job_main(run_job_dict)
