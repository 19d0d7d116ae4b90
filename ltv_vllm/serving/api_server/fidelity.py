"""Live fidelity: how close a task's answers stay to the ICL prompt its vector replaces, on
the traffic it serves. Runs in vLLM's API-server process.

A vector is fitted so that the model's next-token distribution under the shift matches the
one under its ICL prompt (the paper's d_NTP, measured once at extraction on held-out queries
like the ones it was fitted on). Live traffic can drift away from those queries. With
`serve --fidelity-sample RATE` the gate offers each answered completion request of a task
(`Gate.probe`); a RATE share of them is re-asked here, after the client's answer is sent,
twice, one token each: the vector on the client's prompt, and the bare model on the ICL
prompt the vector replaces — the task's first demonstration set (`meta.demonstrations`)
before the client's query, as extraction builds it (`Task.demos_text`). Both re-asks carry
a readout of the task's label tokens (`READOUT_KEY`): the engine's wrapper sets every other
token's logit to −inf after the shift (`engine.steps.restrict`), so the log-probabilities
vLLM returns are the label-restricted distribution d_NTP is defined on, exactly, whatever
vLLM's `--max-logprobs` N is; with more labels than N, each side is read in chunks of N
sharing one anchor label (more re-asks, the prompt's KV shared through the prefix cache).
They give KL(P_icl ‖ P_tv) and whether their argmax agree (`core.metrics.live_sample`),
exported per task (`metrics.fidelity`) beside the extraction's d_NTP. `incomplete` is what
cannot be read by construction: a server whose N is below 2 for a task with more labels,
a vector without label tokens whose top-N lists share fewer than two tokens; the first per
task is logged with its reason and kept in `LiveFidelity.incomplete`.

Never in the client's way: a re-ask starts once the client's response is complete, at most
one is in flight (an offer meanwhile is dropped and counted), and under vLLM's
`--scheduling-policy priority` it runs behind every client request. It is counted in flight
under its task's engine key, as a client's request is, so a DELETE waits for it; a task
unserved before its re-ask starts is not re-asked. Chat-fitted vectors and vectors without
demonstrations (files from before they were recorded, hand-made ones) are counted, not
sampled.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ltv_vllm.core.metrics import live_sample
from ltv_vllm.serving.api_server import metrics
from ltv_vllm.serving.contract.names import CONFIG_KEY
from ltv_vllm.serving.contract.wire import (
    ADMIT_KEY,
    READOUT_KEY,
    STEPS_KEY,
    TASK_KEY,
    TASKS_CONFIG_KEY,
    admission,
    stamp,
)
from ltv_vllm.serving.store.vectors import FUSED, StoreVectors, store_root

logger = logging.getLogger(__name__)
STATE = "ltv_fidelity"  # the attribute of the app's state that holds the `LiveFidelity`
PROBE_ID = metrics.PROBE_ID  # its requests' ids start so (not traffic: `metrics.instrument`)
LOW_PRIORITY = 1 << 20  # vLLM serves lower values first (priority scheduling only)
KEEP = 256  # teachers kept (a store's churn: least recently used dropped)


@dataclass(frozen=True)
class Probe:
    """What the gate hands over of an answered request a vector shifted: its task's engine
    key ("" for a fused vector), the name its metrics carry, the prompt, and the
    `vllm_xargs` it was admitted with (its stamp included)."""

    key: str
    name: str
    prompt: str
    xargs: dict[str, Any]


@dataclass(frozen=True)
class Teacher:
    """A task's ICL prompt around a zero-shot prompt, and what its vector recorded."""

    lead: str                 # what every zero-shot prompt of the task starts with
    prefix: str               # what its ICL prompt has before the query (lead + demos)
    labels: tuple[int, ...]   # the label tokens (empty: a task without them)
    d_ntp: float | None       # the extraction's d_NTP on held-out queries
    off_span: float | None = None  # ...and its mean off-span share there (`core.metrics`)

    def prompt(self, zero_shot: str) -> str:
        """The ICL prompt of a request's prompt: its query after the demonstrations."""
        query = zero_shot[len(self.lead):] if zero_shot.startswith(self.lead) else zero_shot
        return self.prefix + query


def teacher_of(tv: Any) -> Teacher | None:
    """The teacher a vector recorded: None for one without demonstrations, or fitted through
    a chat template (its ICL prompt is a conversation, not a text before the query)."""
    from ltv_vllm.core.metrics import untrusted_number
    from ltv_vllm.tasks.data import Example
    from ltv_vllm.tasks.specs import task_from_dict

    prov = tv.provenance
    fmt = (prov.prompt_format or {}).get("name", "completion")
    if not prov.demonstrations or not prov.task or fmt != "completion":
        return None
    task = task_from_dict(prov.task)
    demos = [Example(e["text"], e["label"]) for e in prov.demonstrations[0]]
    scores = (prov.metrics or {}).get(prov.method or "ltv")
    d = untrusted_number(scores.get("d_ntp")) if isinstance(scores, dict) else None
    off = untrusted_number(scores.get("off_span")) if isinstance(scores, dict) else None
    return Teacher(task.zero_shot_prefix, task.demos_text(demos), tuple(tv.label_token_ids), d,
                   off)


def readout_chunks(labels: tuple[int, ...], top: int) -> list[tuple[int, ...]] | None:
    """The readouts that return every label's log-probability when a request returns at
    most `top` of them: one of all labels; more, each of at most `top` with the first label
    in every one (their anchor); None where no chunk can hold the anchor and another label
    (`top` < 2: that server cannot be read)."""
    if len(labels) <= top:
        return [labels]
    if top < 2:
        return None
    anchor, rest = labels[0], labels[1:]
    return [(anchor, *rest[i:i + top - 1]) for i in range(0, len(rest), top - 1)]


def bare_xargs() -> dict[str, Any]:
    """The `vllm_xargs` of a bare-model request: none, or on a server whose every request
    needs the gate's stamp (a fused vector), no step shifted, stamped."""
    adm = admission()
    if adm is None or not adm.every:
        return {}
    return {STEPS_KEY: 0, ADMIT_KEY: stamp(adm, FUSED, 0)}


class LiveFidelity:
    """This API-server process's sampler (module docstring); made by the task endpoints'
    `init_state`, kept on the app's state (`STATE`), offered requests by the gate."""

    def __init__(self, engine: Any, registry: Any, rate: float,
                 rng: random.Random | None = None) -> None:
        self.engine, self.registry, self.rate = engine, registry, rate
        self.rng = rng or random.Random()
        self.busy: asyncio.Task | None = None
        self.teachers: OrderedDict[str, Teacher | None] = OrderedDict()
        self.warned: set[str] = set()  # tasks whose failed re-ask was logged
        self.incomplete: dict[str, str] = {}  # task → why its re-asks cannot be measured
        self.ids = itertools.count()
        cfg = engine.model_config
        n = int(cfg.max_logprobs)
        self.top = n if n >= 0 else int(cfg.get_vocab_size())  # vLLM's -1: no cap
        sched = getattr(engine.vllm_config, "scheduler_config", None)
        self.priority = LOW_PRIORITY if getattr(sched, "policy", "fcfs") == "priority" else 0
        self.store = StoreVectors(store_root(cfg.hf_config))

    async def warm(self) -> None:
        """One bare request with log-probabilities before the server answers anything: vLLM
        compiles its logprob-rank kernel on the first such request (seconds on a CPU, with
        every request of that step waiting), which would otherwise be the first re-ask's.
        (The start-up self-check asks for logprobs too; with --skip-selfcheck only this.)"""
        try:
            await self._ask("warm", bare_xargs())
        except Exception as e:  # noqa: BLE001 - a re-ask that fails later is counted
            logger.warning("ltv-vllm: the fidelity sampler's warm-up request failed: %s",
                           str(e).splitlines()[0][:200] if str(e) else type(e).__name__)

    def offer(self, probe: Probe) -> None:
        """An answered request: re-asked with probability `rate` unless one is in flight."""
        if self.rng.random() >= self.rate:
            return
        if self.busy is not None and not self.busy.done():
            metrics.fidelity(probe.name, "dropped")
            return
        if "@" in probe.key:  # a store task's: counted in flight as a client's request is
            if probe.key not in self.registry.keys.values():
                return  # unserved since (a DELETE): its pin may be going
            self.registry.enter(probe.key)  # so a DELETE waits for it
        self.busy = asyncio.ensure_future(self._probe(probe))

    async def _probe(self, probe: Probe) -> None:
        try:
            teacher = await self._teacher(probe.key)
            if teacher is None:
                metrics.fidelity(probe.name, "unsupported")
                return
            metrics.fidelity_baseline(probe.name, teacher.d_ntp, teacher.off_span)
            if teacher.labels:
                chunks = readout_chunks(teacher.labels, self.top)
                if chunks is None:
                    self._incomplete(probe.name, f"the task has {len(teacher.labels)} labels "
                                     f"and the server returns {self.top} log-probabilities "
                                     "per token (--max-logprobs below 2)")
                    return
                tv, icl = await asyncio.gather(
                    self._read(probe.prompt, probe.xargs, chunks),
                    self._read(teacher.prompt(probe.prompt), bare_xargs(), chunks))
            else:  # a vector without label tokens: the top-N maps (`live_sample`)
                tv, icl = await asyncio.gather(
                    self._ask(probe.prompt, probe.xargs),
                    self._ask(teacher.prompt(probe.prompt), bare_xargs()))
            s = live_sample(icl, tv, teacher.labels)
            if s.kl is None:
                self._incomplete(probe.name, "fewer than two tokens are in both top-"
                                 f"{self.top} lists (a vector without label tokens)")
                return
            metrics.fidelity(probe.name, "measured", s.kl, s.agree)
        except Exception as e:  # noqa: BLE001 - a re-ask never answers a client: counted
            metrics.fidelity(probe.name, "failed")
            if probe.name not in self.warned:  # once per task: a rate must not flood the log
                self.warned.add(probe.name)
                logger.warning("ltv-vllm: a fidelity re-ask of task %r failed (counted in "
                               "ltv_vllm:task_fidelity_samples_total, said here once): %s",
                               probe.name, str(e).splitlines()[0][:200] if str(e)
                               else type(e).__name__)
        finally:
            if "@" in probe.key:
                self.registry.leave(probe.key)

    def _incomplete(self, name: str, why: str) -> None:
        """Count a re-ask that cannot be measured by construction; the first per task says
        why in the log and on `incomplete[name]` (what the task's listing shows)."""
        metrics.fidelity(name, "incomplete")
        if name not in self.incomplete:
            self.incomplete[name] = why
            logger.warning("ltv-vllm: live fidelity cannot measure task %r: %s (counted as "
                           "incomplete in ltv_vllm:task_fidelity_samples_total)", name, why)

    async def _read(self, prompt: str, xargs: dict[str, Any],
                    chunks: list[tuple[int, ...]]) -> dict[int, float]:
        """The label tokens' logits (up to one constant) of `prompt`'s first next token,
        read through the engine's readout (`READOUT_KEY`: every other token's logit −inf,
        so the log-probabilities it returns are the restricted distribution itself, exact
        whatever N is). Several chunks (more labels than N): each holds the first label
        (the anchor), and each label's logit is taken relative to the anchor's."""
        outs = await asyncio.gather(*(
            self._ask(prompt, {**xargs, READOUT_KEY: list(c)}, top=len(c)) for c in chunks))
        z: dict[int, float] = {}
        for c, lp in zip(chunks, outs, strict=True):
            if any(t not in lp for t in c):
                raise RuntimeError("the engine's readout returned other tokens than asked")
            z.update((t, lp[t] - lp[c[0]]) for t in c)
        return z

    async def _teacher(self, key: str) -> Teacher | None:
        if key in self.teachers:
            self.teachers.move_to_end(key)
            return self.teachers[key]
        tv = await asyncio.to_thread(self._vector, key)
        t = self.teachers[key] = teacher_of(tv)
        while len(self.teachers) > KEEP:
            self.teachers.popitem(last=False)
        return t

    def _vector(self, key: str) -> Any:
        """A task's vector as the engine holds it: the fused one, a command-line task's, or
        a store key's (from its pin, checked against its digest)."""
        # (a layer task records no demonstrations: `teacher_of` gives it no teacher)
        from ltv_vllm.core.layer_task import load_any

        hf = self.engine.model_config.hf_config
        if "@" in key:
            return self.store.get(key)
        if key == FUSED:
            return load_any(getattr(hf, CONFIG_KEY))
        return load_any(json.loads(getattr(hf, TASKS_CONFIG_KEY))[key]["path"])

    async def _ask(self, prompt: str, xargs: dict[str, Any],
                   top: int | None = None) -> dict[int, float]:
        """The first next-token distribution of `prompt` (top N, or `top`: token →
        log-probability), tokenized as vLLM's completion route tokenizes a prompt."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import SamplingParams

        engine = self.engine
        (engine_input,) = await engine.renderer.render_cmpl_async(
            [parse_model_prompt(engine.model_config, prompt)])
        params = SamplingParams(max_tokens=1, temperature=0.0,
                                logprobs=self.top if top is None else top,
                                extra_args=dict(xargs) or None)
        last = None
        async for out in engine.generate(engine_input, params, f"{PROBE_ID}{next(self.ids)}",
                                         priority=self.priority):
            last = out
        if last is None or not last.outputs or not last.outputs[0].logprobs:
            raise RuntimeError("the engine returned no log-probabilities")
        return {int(t): float(lp.logprob) for t, lp in last.outputs[0].logprobs[0].items()}


def probe_of(scope: dict[str, Any], key: str | None, name: str, payload: dict[str, Any]
             ) -> Probe | None:
    """What the gate offers of a request it admitted (None: nothing to offer): a completion
    request with one text prompt, one choice, shifted at its first token, on a server that
    samples."""
    state = getattr(scope.get("app"), "state", None)
    if key is None or getattr(state, STATE, None) is None:
        return None
    prompt, xargs = payload.get("prompt"), payload.get("vllm_xargs") or {}
    if not isinstance(prompt, str) or payload.get("n") not in (None, 1) or payload.get("echo"):
        return None
    if not isinstance(xargs, dict) or xargs.get(STEPS_KEY) == 0 \
            or xargs.get(TASK_KEY, FUSED) != key:
        return None
    return Probe(key, name, prompt, dict(xargs))


def fidelity_of(scope: dict[str, Any]) -> LiveFidelity | None:
    return getattr(getattr(scope.get("app"), "state", None), STATE, None)
