"""The extraction pipeline: Episode → captures → a registered method → artifact (+ metrics).

`extract(lm, task, method=..., opts)` is the one call from an episode to an artifact:
`capture_episode` runs the passes every method shares (h_zs, h_icl on the train queries and
the test subset), and the method registry (`ltv_vllm.methods`) fits the artifact and scores
it (`score_methods`), the same code `evaluate` (many tasks × runs), `compile` (a served task),
the benchmarks and a transfer's own-model columns go through. So the vector a server loads
and the one whose numbers the docs report cannot drift apart.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ltv_vllm.core.metrics import off_span_share, span_basis
from ltv_vllm.core.teacher import (
    CONTENT_FREE,
    DEFAULT_GOLD_WEIGHT,
    TeacherOptions,
    fit_targets,
)
from ltv_vllm.core.vector import DEFAULT_SHIFT_STEPS, ModelIdentity, TaskVector
from ltv_vllm.errors import ArgumentError
from ltv_vllm.extraction.capture import (
    Capturer,
    icl_states_per_set,
    label_head,
    mean_over_sets,
    zero_shot_states,
)
from ltv_vllm.extraction.states import PromptStates
from ltv_vllm.extraction.store import CallRecorder
from ltv_vllm.methods import METHODS as REGISTERED
from ltv_vllm.methods import (
    Context,
    MethodOptions,
    check_options_apply,
    get_method,
    score_methods,
)
from ltv_vllm.models.checkpoint import context_length as checkpoint_context
from ltv_vllm.models.checkpoint import (
    read_label_rows,
    read_lm_head,
)
from ltv_vllm.models.loading import (
    LoadedModel,
)
from ltv_vllm.tasks.data import Episode, Example, given_episode, load_dataset, sample_episode
from ltv_vllm.tasks.specs import NO_DATA, Task, is_regression, label_token_ids

ENGINES = ("transformers", "vllm")  # what captures the states (`--engine`)
DEFAULT_K = 30  # the paper's main setting
TRANSFER_K = 10  # the paper's transfer setting: few demos, where a small model's ICL is weak


def check_counts(*, k: int | None = None, n: int | None = None,
                 lam: float | str | None = None,
                 n_test: int | None = None, batch_size: int | str | None = None,
                 rank: int | None = None, runs: int | None = None) -> None:
    """Refuse impossible option values with the option's CLI name, before any heavy work.

    What depends on the task (k against its classes, N against its data) is checked when
    the episode is sampled (`plan_episode`), still before a model loads.
    """
    if batch_size == "auto":  # from the device's free memory (`extraction.batching`)
        batch_size = None
    for name, value in (("--k", k), ("--n", n), ("--n-test", n_test),
                        ("--batch-size", batch_size), ("--rank", rank), ("--runs", runs)):
        if value is not None and (isinstance(value, bool) or int(value) < 1):
            raise ArgumentError(f"{name} must be at least 1, got {value}")
    if lam is not None and lam != "auto" and not (
            isinstance(lam, int | float) and math.isfinite(lam) and lam > 0):
        raise ArgumentError(f"--lam must be a positive number (the ridge penalty λ), got {lam}")


@dataclass(frozen=True)
class ExtractOptions:
    """How one artifact is extracted; checked when built (the CLI builds it first).

    The episode's sizes and the settings every method reads are fields; a method's own
    knobs (`--fv-trials`, `--mlp-depth`, ...) travel in `options`."""

    k: int | None = None  # None: DEFAULT_K, or max(TRANSFER_K, K) for a transfer vector
    n: int = 256
    lam: float | str = 5.0  # or "auto": by closed-form leave-one-out error (`ridge.loo_curve`)
    seed: int = 0
    n_test: int = 500
    batch_size: int | str = 16  # or "auto": planned per pass by the Capturer
    rank: int | None = None  # cut the fit to this rank (ridge.truncate)
    progress: bool = True
    n_val: int = 32  # labelled validation examples for the baselines' layer choice (paper: 32)
    options: MethodOptions = field(default_factory=MethodOptions)
    # multi-prompt fitting: the train target h_icl is the mean over this many demonstration
    # sets of k (`Episode.demo_sets`); the test's ICL reference stays the first set's prompt
    demo_sets: int = 1
    # what the vector imitates (`core.teacher`): the prompt's states (default), calibrated,
    # or blended with the train queries' gold labels
    teacher: TeacherOptions = field(default_factory=TeacherOptions)

    def __post_init__(self) -> None:
        check_counts(k=self.k, n=self.n, lam=self.lam, n_test=self.n_test,
                     batch_size=self.batch_size, rank=self.rank)
        if isinstance(self.demo_sets, bool) or int(self.demo_sets) < 1:
            raise ArgumentError(f"--demo-sets must be at least 1, got {self.demo_sets}")

    def k_for(self, task: Task, *, transfer: bool = False) -> int:
        if self.k is not None:
            return self.k
        return max(TRANSFER_K, task.num_classes) if transfer else DEFAULT_K

    def method_options(self, planned: int | None = None) -> MethodOptions:
        """The registry's options: the method's own knobs and this extraction's settings
        (`planned`: the batch the capture planned, for --batch-size auto)."""
        return self.options.replace(lam=self.lam, seed=self.seed,
                                    batch_size=concrete_batch(self.batch_size, planned),
                                    progress=self.progress, rank=self.rank)


def concrete_batch(batch_size: int | str, planned: int | None = None) -> int:
    """A batch size as a number: "auto" is what the capture planned (16 before it has)."""
    return int(batch_size) if batch_size != "auto" else (planned or 16)


def plan_episode(task: Task, opts: ExtractOptions, *, transfer: bool = False,
                 demos: tuple[Example, ...] | None = None,
                 queries: tuple[Example, ...] | None = None) -> Episode:
    """The episode an extraction runs on (data loaded, k against the classes, N against the
    data): everything that can be refused without a model. `demos` / `queries`: the user's
    own (`data.read_examples`); the rest is sampled (`data.given_episode`)."""
    k = opts.k_for(task, transfer=transfer)
    if opts.demo_sets > 1 and (transfer or demos is not None or queries is not None
                               or is_regression(task)):
        raise ArgumentError("--demo-sets draws its demonstration sets from a classification "
                            "task's data: not with --demos/--queries, a regression task or "
                            "a transfer (--source-model)")
    if demos is None and queries is None:
        return sample_episode(load_dataset(task), k=k, n=opts.n, n_test=opts.n_test,
                              seed=opts.seed, n_val=opts.n_val, demo_sets=opts.demo_sets)
    dataset = None if task.source == NO_DATA else load_dataset(task)
    return given_episode(task, dataset, demos=demos, queries=queries, k=k, n=opts.n,
                         n_test=opts.n_test, seed=opts.seed, n_val=opts.n_val)


@dataclass
class Captures:
    """One model's states for one episode, float32 (rows, d)."""

    h_zs: torch.Tensor       # N train queries, zero-shot
    h_icl: torch.Tensor      # N train queries after the demos (M sets: their mean)
    h_zs_test: torch.Tensor  # test subset, zero-shot
    h_icl_test: torch.Tensor  # test subset after the first set's demos
    capture_seconds: float   # the train passes (what extraction costs)
    test_seconds: float
    # M > 1 demonstration sets, captured set by set (an evaluation's references): (M, rows, d)
    h_icl_sets: torch.Tensor | None = None
    h_icl_test_sets: torch.Tensor | None = None
    first_seconds: float | None = None  # the train passes a single-prompt fit needs

    def first_set(self) -> Captures:
        """The states of the episode's first demonstration set alone: what a single-prompt
        method is fitted to and scored against, and what capturing them took (one set:
        these captures)."""
        if self.h_icl_sets is None:
            return self
        first = self.capture_seconds if self.first_seconds is None else self.first_seconds
        return Captures(self.h_zs, self.h_icl_sets[0], self.h_zs_test, self.h_icl_test,
                        first, self.test_seconds)


def capture_test_zero_shot(cap: Any, task: Task, episode: Episode) -> torch.Tensor:
    """h_zs on the test subset: it does not depend on the demos, so runs share it. (n_test, d)"""
    return zero_shot_states(cap, task, [e.text for e in episode.test],
                            desc=f"{task.name} zero-shot test")


def capture_episode(
    cap: Any, episode: Episode, *, h_zs_test: torch.Tensor | None = None,
    every_set: bool = False,
) -> Captures:
    """Every pass an episode needs; `cap` is a Capturer or a StoredCapturer. `every_set`
    (an evaluation of M > 1 demonstration sets): each set's train and test states kept, the
    test queries run after every set's demos (the ICL ensemble); otherwise the test's ICL
    reference is the first set's prompt."""
    task = episode.task
    queries = [task.query(e.text) for e in episode.queries]
    t0 = time.perf_counter()
    h_zs = zero_shot_states(cap, task, [e.text for e in episode.queries],
                            desc=f"{task.name} zero-shot train")  # (N, d)
    t_zs = time.perf_counter() - t0
    set_seconds: list[float] = []
    per_set = icl_states_per_set(cap, episode, queries, desc=f"{task.name} icl train",
                                 seconds=set_seconds)
    h_icl = mean_over_sets(per_set)  # (N, d): one set, its states
    t1 = time.perf_counter()
    sets = torch.stack(per_set) if every_set and len(per_set) > 1 else None
    if not episode.test:  # a compiled task without labelled examples: nothing to score
        empty = h_zs.new_zeros(0, h_zs.shape[1])
        return Captures(h_zs, h_icl, empty, empty, t1 - t0, 0.0)
    if h_zs_test is None:
        h_zs_test = capture_test_zero_shot(cap, task, episode)
    test_queries = [task.query(e.text) for e in episode.test]
    if sets is None:
        h_icl_test = cap.icl(episode.demo_prefix(), test_queries, desc=f"{task.name} icl test")
        test_sets = None
    else:
        test_sets = torch.stack(icl_states_per_set(cap, episode, test_queries,
                                                   desc=f"{task.name} icl test"))
        h_icl_test = test_sets[0]
    t2 = time.perf_counter()
    return Captures(h_zs, h_icl, h_zs_test, h_icl_test, t1 - t0, t2 - t1, sets, test_sets,
                    t_zs + set_seconds[0] if sets is not None else None)


def episode_prompts(episode: Episode) -> list[str]:
    """Every prompt `capture_episode` asks for (train and test, zero-shot and ICL), once each,
    learnt by running it against a recorder: what an engine that captures ahead of the
    pipeline (`--engine vllm`) is sent."""
    rec = CallRecorder()
    # every set's test prompts too: what an evaluation of M > 1 sets asks for (an extraction
    # reads the first set's of them; the others share their set's cached demonstrations)
    capture_episode(rec, episode, every_set=True)
    return list(dict.fromkeys(context + p for _, context, prompts in rec.calls
                              for p in prompts))


def episode_labels(episode: Episode) -> torch.Tensor:
    return torch.tensor([e.label for e in episode.test])


@dataclass(frozen=True)
class Extraction:
    """`extract`'s outcome: the artifact (a TaskVector for the hidden-space maps, an
    `Artifact` for the layer methods), the held-out metrics of zero-shot, ICL, the method and
    the baselines it is shown beside, and what the extraction cost and chose."""

    method: str
    artifact: Any
    metrics: dict[str, dict[str, float]]   # method → {"accuracy", "d_ntp"}; {} without test
    timings: dict[str, float]              # capture / fit / extraction / test seconds
    params: dict[str, Any]                 # what the method chose (λ, γ, a layer)
    episode: Episode
    label_logits: dict[str, torch.Tensor]  # method → (n_test, K) restricted logits


@dataclass
class CapturedModel:
    """A model seen only through the states another engine captured (`--engine vllm`): its
    tokenizer, identity and checkpoint directory (the LM-head rows are read from its shards),
    the captured table, and what the vector file records about that engine. Nothing of the
    model is loaded into transformers."""

    spec: str
    path: str
    tokenizer: Any
    identity: ModelIdentity
    states: PromptStates
    dtype: str                 # the precision the engine ran in
    engine: dict[str, Any]     # `CaptureEngine.record()`: name, version, dtype, parallelism
    # the engine's own seconds: its start, and the capture of every prompt at once (train
    # and test: one batch, so they are not told apart)
    capture_seconds: float = 0.0
    startup_seconds: float = 0.0

    def seconds_for(self, prompts: int) -> float:
        """The capture time of `prompts` of the engine's batch, apportioned by prompt count
        (one batch has no per-prompt time)."""
        return self.capture_seconds * prompts / max(1, len(self.states.row))


def check_engine(method: str, engine: str) -> None:
    """`--engine vllm` captures the final hidden state only: a method that hooks inner layers
    (TV, FV, SV, I2CL) is refused in one line, before anything loads."""
    if engine not in ENGINES:
        raise ArgumentError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if method not in REGISTERED:  # zero-shot, ICL, the multi-prompt references: final states
        return
    m = get_method(method)
    if engine != "transformers" and not (m.hidden_space and m.uses_states):
        raise ArgumentError(f"--method {method} hooks the model's inner layers; --engine "
                            f"{engine} captures only the final hidden state (methods: "
                            f"{', '.join(states_methods())}); use --engine transformers")


def check_format(methods: list[str], task: Task, lm: Any, episode: Episode) -> None:
    """A chat rendering (`tasks.chat`): only the methods fitted on the final states at the
    query's last token (the others build their own completion prompts), captured by
    transformers, with the template's pieces checked against its rendering of this episode's
    first conversation. One line each, before any pass."""
    if task.prompt_format != "chat":
        return
    check_chat_methods(methods)
    if isinstance(lm, CapturedModel):
        raise ArgumentError("--format chat captures with transformers (--engine transformers)")
    text = (episode.test or episode.queries)[0].text
    task.check(lm.tokenizer, episode.demos, text)


def check_chat_methods(methods: list[str]) -> None:
    """Through a chat rendering only the methods fitted on the final states run (the others
    build their own completion prompts): one line naming the others."""
    other = [n for n in methods if n not in states_methods() and n not in ("zero-shot", "icl")]
    if other:
        raise ArgumentError(f"--format chat: {', '.join(other)} builds its own completion "
                            f"prompts; chat-rendered methods: {', '.join(states_methods())}")


def states_methods() -> list[str]:
    """The methods fitted on the final hidden states alone (what `--engine vllm` runs)."""
    return [n for n, m in REGISTERED.items() if m.hidden_space and m.uses_states]


def capturer_for(lm: LoadedModel | CapturedModel, batch_size: int | str,
                 progress: bool, special_tokens: bool = True) -> Any:
    """What `capture_episode` reads states from: a Capturer over the loaded model, or the
    table a CapturedModel's engine filled. `special_tokens`: the tasks' `special_tokens`."""
    if isinstance(lm, CapturedModel):
        return lm.states
    return Capturer(lm.model, lm.tokenizer, batch_size=batch_size, progress=progress,
                    special_tokens=special_tokens)


def model_dtype(lm: LoadedModel | CapturedModel) -> str:
    return lm.dtype if isinstance(lm, CapturedModel) else \
        str(lm.model.dtype).removeprefix("torch.")


def label_rows(lm: LoadedModel | CapturedModel,
               label_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """W_C, b_C for `score_methods` when there is no model to ask (None: the model's own)."""
    return read_label_rows(lm.path, label_ids) if isinstance(lm, CapturedModel) else None


def method_context(lm: LoadedModel | CapturedModel, cap: Any, episode: Episode,
                   label_ids: list[int], opts: MethodOptions,
                   c: Captures | None = None) -> Context:
    """The registry's view of one episode on `lm` (the captured train states, if any). A
    CapturedModel has no model to run: its context holds the states, its dtype and engine,
    and (only for a fit cut to a rank, which needs it) the whole LM head from the shards."""
    extra: dict[str, Any] = {}
    if isinstance(lm, CapturedModel):
        cap = None
        extra = {"dtype": lm.dtype, "engine": lm.engine,
                 "head": read_lm_head(lm.path) if opts.rank is not None else None}
    return Context(cap, episode, label_ids, opts, identity=lm.identity,
                   h_zs=c.h_zs if c else None, h_icl=c.h_icl if c else None,
                   capture_seconds=c.capture_seconds if c else 0.0, **extra)


def extract(
    lm: LoadedModel | CapturedModel,
    task: Task,
    method: str = "ltv",
    opts: ExtractOptions | None = None,
    *,
    episode: Episode | None = None,
) -> Extraction:
    """Extract `method`'s artifact for `task` on `lm` and score it on the held-out test subset
    (beside zero-shot, ICL and the method's `compare_with` baselines). `lm` is a loaded
    transformers model, or a CapturedModel whose states vLLM captured (`episode_prompts`).

    `episode`: one already sampled (`plan_episode(task, opts)`), e.g. by a caller that checked
    it before loading the model. The artifact's provenance carries the metrics and timings.
    """
    opts = opts or ExtractOptions()
    m = get_method(method)
    check_options_apply([method], opts.method_options())  # `opts.rank` included
    label_ids = label_token_ids(task, lm.tokenizer)
    episode = episode or plan_episode(task, opts)
    names = [method, *(b for b in m.compare_with if b != method)]
    check_format(names, task, lm, episode)
    check_teacher(opts.teacher, method, task, lm, episode)
    prompt_tokens = check_context(lm.tokenizer, episode, task.special_tokens,
                                  context_length(lm))
    cap = capturer_for(lm, opts.batch_size, opts.progress, task.special_tokens)
    c = capture_episode(cap, episode)
    if not opts.teacher.is_default:
        c = teach(cap, episode, c, label_rows(lm, label_ids) or label_head(lm.model, label_ids),
                  opts.teacher)
    if isinstance(lm, CapturedModel):
        check_engine(method, lm.engine.get("name", "vllm"))
        # the engine captured train and test in one batch: the train prompts' share
        c.capture_seconds = lm.seconds_for((1 + len(episode.demo_sets)) * len(episode.queries))
        c.test_seconds = lm.seconds_for(2 * len(episode.test))
    ctx = method_context(lm, cap, episode, label_ids,
                         opts.method_options(getattr(cap, "batch_size", None)), c)
    sc = score_methods(ctx, names, c.h_zs_test, c.h_icl_test, episode_labels(episode),
                       head=label_rows(lm, label_ids))
    total = sc.extraction_seconds[method]
    capture = c.capture_seconds if m.uses_states else 0.0
    timings = {"capture_seconds": capture, "fit_seconds": total - capture,
               "extraction_seconds": total, "test_seconds": c.test_seconds}
    if isinstance(lm, CapturedModel):
        timings["engine_start_seconds"] = lm.startup_seconds
    else:  # the batch the capture ran at (with --batch-size auto: the last one planned)
        timings["batch_size"] = cap.batch_size
    art = sc.artifacts[method]
    vector = isinstance(art, TaskVector)
    if vector and art.map == "linear" and method in sc.metrics and len(c.h_zs_test):
        # the live drift signal's reference (`serve --fidelity-sample`): on the held-out
        # queries, the share of h the map cannot see
        share = off_span_share(c.h_zs_test.double(), span_basis(art.V.double()))
        sc.metrics[method] = {**sc.metrics[method], "off_span": float(share.mean()),
                              "off_span_sd": float(share.std()) if len(share) > 1 else 0.0}
    prov = replace(art.provenance, k=opts.k_for(task), n=opts.n, metrics=sc.metrics,
                   timings=timings, metrics_rank=art.rank if vector else None,
                   shift_steps=DEFAULT_SHIFT_STEPS if vector else None,
                   prompt_format=task.record() if task.prompt_format == "chat" else None,
                   demonstrations=demonstrations(episode.demo_sets) if vector else None,
                   teacher={**opts.teacher.record(), "prompt_tokens": prompt_tokens})
    return Extraction(method, replace(art, provenance=prov), sc.metrics, timings,
                      dict(sc.params.get(method, {})), episode, sc.logits)


def context_length(lm: LoadedModel | CapturedModel) -> int | None:
    """The model's context in tokens, from its config (None where it states none)."""
    if isinstance(lm, CapturedModel):
        return checkpoint_context(lm.path)
    return getattr(lm.model.config, "max_position_embeddings", None)


def check_context(tokenizer: Any, episode: Episode, special_tokens: bool,
                  limit: int | None) -> int:
    """The longest demonstration prefix's token count; refused in one line, before any pass,
    where it and the longest query do not fit the model's context (a many-shot teacher's
    k is bounded by it)."""
    task = episode.task

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=special_tokens)["input_ids"])

    prefix = max(count(p) for p in episode.demo_prefixes())
    texts = [e.text for e in (*episode.queries, *episode.test)]
    longest = max(texts, key=len) if texts else ""
    total = count(episode.demo_prefix() + task.query(longest))
    if limit is not None and max(prefix, total) > limit:
        raise ArgumentError(f"{task.name}: the ICL prompt of k={len(episode.demos)} "
                            f"demonstrations takes {max(prefix, total)} tokens, over the "
                            f"model's context of {limit}; use a smaller --k")
    return prefix


def check_teacher(teacher: TeacherOptions, method: str, task: Task, lm: Any,
                  episode: Episode) -> None:
    """A teacher other than the prompt's own states needs a method fitted on them, a
    classification task, the content-free prompts' states (transformers) for contextual
    calibration, and labelled queries for a gold blend: one line each, before any pass."""
    if teacher.is_default:
        return
    if method not in states_methods():
        raise ArgumentError(f"--teacher {teacher.calibration} / --gold-weight shape the "
                            f"states a map is fitted to: methods {', '.join(states_methods())}")
    if is_regression(task):
        raise ArgumentError(f"{task.name} is a regression task: a teacher reshapes label "
                            "distributions")
    if teacher.calibration == "contextual" and isinstance(lm, CapturedModel):
        raise ArgumentError("--teacher contextual captures its content-free prompts with "
                            "transformers (--engine transformers)")
    if teacher.gold_weight and not labelled(task, episode):
        raise ArgumentError("--gold-weight blends the queries' gold labels: every query needs "
                            "a label of the task")


def labelled(task: Task, episode: Episode) -> bool:
    """Every train query carries a label of the (classification) task."""
    return bool(episode.queries) and all(
        isinstance(e.label, int) and not isinstance(e.label, bool)
        and 0 <= e.label < task.num_classes for e in episode.queries)


def default_teacher(teacher: TeacherOptions, method: str, task: Task, episode: Episode, *,
                    transfer: bool = False) -> TeacherOptions:
    """The teacher `extract` fits when no --gold-weight is given: `teacher` blended with the
    queries' gold labels at DEFAULT_GOLD_WEIGHT where that applies (a method fitted on the
    states, a classification task, every query labelled, no transfer), else `teacher` as is
    (the paper's fit: unlabeled queries, your own `--queries` without labels)."""
    if (transfer or method not in states_methods() or is_regression(task)
            or not labelled(task, episode)):
        return teacher
    return replace(teacher, gold_weight=DEFAULT_GOLD_WEIGHT)


def teach(cap: Any, episode: Episode, c: Captures, head: tuple[torch.Tensor, torch.Tensor],
          teacher: TeacherOptions) -> Captures:
    """The captures with the teacher's states in place of the prompt's: the train target
    (gold labels blended where asked) and the test reference (calibrated, never blended:
    a test query has no label at serving time)."""
    w_c, b_c = head
    task = episode.task
    cf = None
    if teacher.calibration == "contextual":
        cf = mean_over_sets(icl_states_per_set(
            cap, episode, [task.query(t) for t in CONTENT_FREE], desc="content-free"))
    gold = torch.tensor([int(e.label) for e in episode.queries]) if teacher.gold_weight else None
    h_icl, test = fit_targets(teacher, c.h_icl, c.h_icl_test, w_c, b_c, h_content_free=cf,
                              gold=gold)
    return replace(c, h_icl=h_icl, h_icl_test=test)


def demonstrations(sets: Sequence[Sequence[Any]]) -> list[list[dict[str, Any]]]:
    """An episode's demonstration sets as a vector file records them (`Provenance`)."""
    return [[{"text": e.text, "label": e.label if isinstance(e.label, float) else int(e.label)}
             for e in demos] for demos in sets]
