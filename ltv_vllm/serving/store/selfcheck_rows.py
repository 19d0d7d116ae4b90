"""The self-check's probe batch and its verdicts: what an engine that places every row's
shift right answers (`offline.selfcheck` runs it through `vllm.LLM`, `api_server.selfcheck`
through a server's engine at start). Read in the launcher's job and the API-server
process; vLLM is imported only inside the functions that build its requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ltv_vllm.errors import UserError
from ltv_vllm.serving.contract.wire import ADMIT_KEY, STEPS_KEY, TASK_KEY, admission, stamp
from ltv_vllm.serving.store.probes import (
    BIAS,
    LAYER_PROBES,
    LORA_PAIRS,
    LORA_PROBES,
    PROBES,
    Signature,
)


class SelfCheckFailed(UserError):
    """A row did not carry exactly its own probe at exactly its own steps."""


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
        default = {**PROBES, **LAYER_PROBES}[self.task]
        # a layer probe acts at the last block: of the prompt positions only the last
        # prompt token's row shows (it gives the first token)
        return parse_steps(self.steps if self.steps is not None else default)


def probe_batch(tokenizer: Any, budget: int | None, max_len: int,
                layer: bool = False) -> list[Probe]:
    """The mixed batch: every policy, overrides, n = 2, short and long prompts (longer than
    the engine's per-step token budget, when one is given), staggered `max_tokens`; with
    `layer`, the layer probes' rows among them (each position word, overrides, n = 2)."""
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
        *(_layer_rows(short, long) if layer else []),
    ]


def _layer_rows(short: list[str], long: list[str]) -> list[Probe]:
    last, every, two = LAYER_PROBES
    return [
        Probe(short[0], last, None, 1, 3),
        Probe(long[0], every, None, 1, 4),
        Probe(short[1], two, None, 2, 4),
        Probe(short[2], two, 3, 1, 5),
        Probe(long[1], every, "prompt", 1, 3),
        Probe(short[0], last, "generated", 1, 4),
        Probe(short[1], every, 1, 1, 3),
    ]


SHIFTED_GAP = BIAS / 2  # a step's best and second-best logprobs this far apart: shifted


def check_rows(batch: list[Probe], outputs: list[list[list[tuple[int, float, int]]]],
               tokens: dict[str, int],
               signatures: dict[str, Signature] | None = None) -> list[str]:
    """Every wrong row, one line each (empty: all right). `outputs`: per request, per
    choice, per generated step (best token, best minus second-best logprob, second token).
    A step carries a probe iff that gap is over `SHIFTED_GAP` (no model puts 500 nats
    between its two best tokens), or a layer probe iff it shows that probe's signature
    (`probes.Signature`: the distribution its bias forces, whatever the context): what the
    step got is read off the distribution, not guessed from the token, which a model may
    well repeat after the probe wrote it."""
    signatures = signatures or {}

    def carried(t: int, gap: float, second: int) -> str | None:
        if gap > SHIFTED_GAP:
            return next((n for n, tok in tokens.items() if tok == t), "another token")
        return next((n for n, s in signatures.items() if s.shows(t, second, gap)), None)

    wrong = []
    for i, (p, outs) in enumerate(zip(batch, outputs, strict=True)):
        n = p.expected_steps()
        if len(outs) != p.n:
            wrong.append(f"row {i} (task {p.task or 'bare'}): {len(outs)} choices, not {p.n}")
        for c, steps in enumerate(outs):
            seen = [carried(*s) for s in steps]
            want = [p.task if p.task is not None and (n is None or k < n) else None
                    for k in range(len(steps))]
            if len(steps) != p.max_tokens or seen != want:
                wrong.append(f"row {i} (task {p.task or 'bare'}, ltv_steps "
                             f"{p.steps if p.steps is not None else 'default'}, choice {c}): "
                             f"steps {[s or 'bare' for s in seen]}, expected "
                             f"{p.task or 'none'} at steps < {n}")
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


def verdict(batch: list[Probe], outs: list[Any], tokens: list[int], where: str,
            signatures: dict[str, Signature] | None = None) -> dict[str, Any]:
    """The batch's RequestOutputs checked (`check_rows`); SelfCheckFailed on a wrong row.
    `signatures`: the layer probes' (by LAYER_PROBES name), where the batch has their rows."""
    outputs = [[[_top2(lp) for lp in c.logprobs] for c in o.outputs] for o in outs]
    rows = sum(len(o) for o in outputs)
    wrong = check_rows(batch, outputs, dict(zip(PROBES, tokens, strict=True)), signatures)
    if wrong:
        raise SelfCheckFailed(f"selfcheck failed on {where}: {len(wrong)} of {rows} rows "
                              f"wrong; first: {wrong[0]}")
    return {"ok": True, "where": where + (", layer probes" if signatures else ""),
            "rows": rows, "tokens": sum(len(t) for o in outputs for t in o)}


def _top2(logprobs: dict[int, Any]) -> tuple[int, float, int]:
    """A step's best token, its gap to the second, and the second (vLLM returns the top 2,
    and the sampled token where it is not among them): read off the distribution, not the
    sampled token (n > 1 samples at temperature 1)."""
    ranked = sorted(logprobs.items(), key=lambda kv: kv[1].logprob, reverse=True)
    if len(ranked) < 2:
        return ranked[0][0], float("inf"), -1
    return ranked[0][0], float(ranked[0][1].logprob - ranked[1][1].logprob), ranked[1][0]


def _gap(logprobs: dict[int, Any]) -> float:
    """Best minus second-best logprob of one step (vLLM returns the top 2, and the sampled
    token if it is not among them)."""
    top = sorted((x.logprob for x in logprobs.values()), reverse=True)
    return float(top[0] - top[1]) if len(top) > 1 else float("inf")
