"""The extraction pass: Episode → captures → ridge fit → TaskVector (+ held-out metrics).

`run_episode` is the one place where an episode is turned into activations, a fit and test
scores; `extract` (the CLI's `extract`) and `evaluate` (many tasks × runs) both call it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import __version__
from .capture import Capturer, full_head, label_head
from .data import Episode
from .errors import ArgumentError
from .loading import (
    QUANTIZATIONS,
    LoadedModel,
    check_quantization,
    load_model,
    local_model_dir,
)
from .metrics import accuracy, d_ntp
from .ridge import Factors, head_gram, mean_shift, ridge_fit, truncate
from .tasks import Task, label_token_ids
from .vector import ModelIdentity, Provenance, TaskVector

METHODS = ("zero-shot", "icl", "ltv", "mean")
TRANSFER_METHOD = "ltv-transfer"
DEFAULT_K = 30  # the paper's main setting
TRANSFER_K = 10  # the paper's transfer setting: few demos, where a small model's ICL is weak


def check_counts(*, k: int | None = None, n: int | None = None,
                 lam: float | str | None = None,
                 n_test: int | None = None, batch_size: int | None = None,
                 rank: int | None = None, runs: int | None = None) -> None:
    """Refuse impossible option values with the option's CLI name, before any heavy work.

    What depends on the task (k against its classes, N against its data) is checked when
    the episode is sampled (`plan_episode`), still before a model loads.
    """
    import math

    for name, value in (("--k", k), ("--n", n), ("--n-test", n_test),
                        ("--batch-size", batch_size), ("--rank", rank), ("--runs", runs)):
        if value is not None and (isinstance(value, bool) or int(value) < 1):
            raise ArgumentError(f"{name} must be at least 1, got {value}")
    if lam is not None and lam != "auto" and not (
            isinstance(lam, int | float) and math.isfinite(lam) and lam > 0):
        raise ArgumentError(f"--lam must be a positive number (the ridge penalty λ), got {lam}")


@dataclass(frozen=True)
class ExtractOptions:
    """How one task vector is extracted; checked when built (the CLI builds it first)."""

    k: int | None = None  # None: DEFAULT_K, or max(TRANSFER_K, K) for a transfer vector
    n: int = 256
    lam: float | str = 5.0  # or "auto": by closed-form leave-one-out error (`ridge.loo_curve`)
    seed: int = 0
    n_test: int = 500
    batch_size: int = 16
    rank: int | None = None  # cut the fit to this rank (ridge.truncate)
    progress: bool = True
    n_val: int = 32  # labelled validation examples for the baselines' layer choice (paper: 32)

    def __post_init__(self) -> None:
        check_counts(k=self.k, n=self.n, lam=self.lam, n_test=self.n_test,
                     batch_size=self.batch_size, rank=self.rank)

    def k_for(self, task: Task, *, transfer: bool = False) -> int:
        if self.k is not None:
            return self.k
        return max(TRANSFER_K, task.num_classes) if transfer else DEFAULT_K


def plan_episode(task: Task, opts: ExtractOptions, *, transfer: bool = False) -> Episode:
    """The episode an extraction runs on (data loaded, k against the classes, N against the
    data): everything that can be refused without a model."""
    from .data import load_dataset, sample_episode

    return sample_episode(load_dataset(task), k=opts.k_for(task, transfer=transfer), n=opts.n,
                          n_test=opts.n_test, seed=opts.seed, n_val=opts.n_val)


@dataclass
class EpisodeResult:
    factors: Factors
    mean: torch.Tensor                      # (d,) constant-mapping baseline
    label_logits: dict[str, torch.Tensor]   # method → (n_test, K) restricted logits
    labels: torch.Tensor                    # (n_test,)
    metrics: dict[str, dict[str, float]]    # method → {"accuracy", "d_ntp"}
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class Captures:
    """One model's states for one episode, float32 (rows, d)."""

    h_zs: torch.Tensor       # N train queries, zero-shot
    h_icl: torch.Tensor      # N train queries after the demos
    h_zs_test: torch.Tensor  # test subset, zero-shot
    h_icl_test: torch.Tensor
    capture_seconds: float   # the train passes (what extraction costs)
    test_seconds: float


def capture_test_zero_shot(cap: Any, task: Task, episode: Episode) -> torch.Tensor:
    """h_zs on the test subset: it does not depend on the demos, so runs share it. (n_test, d)"""
    return cap.hidden([task.query(e.text) for e in episode.test],
                      desc=f"{task.name} zero-shot test")


def capture_episode(
    cap: Any, episode: Episode, *, h_zs_test: torch.Tensor | None = None
) -> Captures:
    """Every pass an episode needs; `cap` is a Capturer or a StoredCapturer."""
    task = episode.task
    prefix = episode.demo_prefix()
    queries = [task.query(e.text) for e in episode.queries]
    t0 = time.perf_counter()
    h_zs = cap.hidden(queries, desc=f"{task.name} zero-shot train")  # (N, d)
    h_icl = cap.icl(prefix, queries, desc=f"{task.name} icl train")   # (N, d)
    t1 = time.perf_counter()
    if not episode.test:  # a compiled task without labelled examples: nothing to score
        empty = h_zs.new_zeros(0, h_zs.shape[1])
        return Captures(h_zs, h_icl, empty, empty, t1 - t0, 0.0)
    if h_zs_test is None:
        h_zs_test = capture_test_zero_shot(cap, task, episode)
    test_queries = [task.query(e.text) for e in episode.test]
    h_icl_test = cap.icl(prefix, test_queries, desc=f"{task.name} icl test")
    t2 = time.perf_counter()
    return Captures(h_zs, h_icl, h_zs_test, h_icl_test, t1 - t0, t2 - t1)


def score_episode(
    c: Captures,
    lam: float,
    w_c: torch.Tensor,
    b_c: torch.Tensor,
    labels: torch.Tensor,
    methods: tuple[str, ...] = METHODS,
    rank: int | None = None,
    head_gram: torch.Tensor | None = None,
) -> EpisodeResult:
    """Fit LTV (and the mean shift) on the train states; score every method on the test ones.

    rank: cut the fit to rank `rank` (`ridge.truncate`, weighted by the LM head's Gram
    `head_gram` = W_lmᵀ W_lm when given); the cut is what gets scored and saved.
    """
    t0 = time.perf_counter()
    y = c.h_icl - c.h_zs  # (N, d) targets
    factors = ridge_fit(c.h_zs, y, lam)
    if rank is not None:
        factors = truncate(factors, rank, head_gram=head_gram)
    mean = mean_shift(y)
    fit_seconds = time.perf_counter() - t0
    hidden = {
        "zero-shot": c.h_zs_test,
        "icl": c.h_icl_test,
        "ltv": c.h_zs_test + factors.apply(c.h_zs_test),
        "mean": c.h_zs_test + mean,
    }
    logits = {m: hidden[m] @ w_c.T + b_c for m in methods}
    metrics = {
        m: {"accuracy": accuracy(z, labels), "d_ntp": d_ntp(logits["icl"], z)}
        for m, z in logits.items()
    } if labels.numel() else {}
    timings = {
        "capture_seconds": c.capture_seconds,
        "fit_seconds": fit_seconds,
        "extraction_seconds": c.capture_seconds + fit_seconds,
        "test_seconds": c.test_seconds,
    }
    return EpisodeResult(factors, mean, logits, labels, metrics, timings)


def episode_labels(episode: Episode) -> torch.Tensor:
    return torch.tensor([e.label for e in episode.test])


def run_episode(
    cap: Capturer,
    episode: Episode,
    lam: float,
    label_ids: list[int],
    *,
    h_zs_test: torch.Tensor | None = None,
    methods: tuple[str, ...] = METHODS,
    rank: int | None = None,
) -> EpisodeResult:
    w_c, b_c = label_head(cap.model, label_ids)  # (K, d), (K,)
    c = capture_episode(cap, episode, h_zs_test=h_zs_test)
    hg = head_gram(full_head(cap.model)[0]) if rank is not None else None
    return score_episode(c, lam, w_c, b_c, episode_labels(episode), methods, rank, hg)


def extract(
    lm: LoadedModel,
    task: Task,
    opts: ExtractOptions | None = None,
    *,
    episode: Episode | None = None,
) -> tuple[TaskVector, EpisodeResult]:
    """Fit an LTV for `task` on `lm` and measure it on the held-out test subset.

    `episode`: one already sampled (`plan_episode(task, opts)`), e.g. by a caller that
    checked it before loading the model. `opts.rank` cuts the fit before it is scored and saved.
    """
    opts = opts or ExtractOptions()
    label_ids = label_token_ids(task, lm.tokenizer)
    episode = episode or plan_episode(task, opts)
    cap = Capturer(lm.model, lm.tokenizer, batch_size=opts.batch_size, progress=opts.progress)
    res = run_episode(cap, episode, opts.lam, label_ids, rank=opts.rank)
    tv = TaskVector(
        kind="hidden",
        U=res.factors.U,
        V=res.factors.V,
        bias=None,
        model=lm.identity,
        label_token_ids=tuple(label_ids),
        provenance=_provenance(lm, episode, res, opts, method="ltv"),
        gram=res.factors.gram,
    )
    return tv, res


@dataclass(frozen=True)
class MethodResult:
    """`extract_method`'s outcome: the artifact (a TaskVector for mean / ltv-auto / kernel),
    its test metrics, extraction seconds and the parameters it chose (λ, γ, layers)."""

    artifact: Any
    metrics: dict[str, dict[str, float]]
    seconds: float
    params: dict[str, Any]
    k: int
    n_test: int


VECTOR_METHODS = ("mean", "ltv-auto", "kernel")  # methods whose artifact is a TaskVector


def extract_method(lm: LoadedModel, task: Task, method: str,
                   opts: ExtractOptions | None = None) -> MethodResult:
    """Extract `method`'s artifact (any registered method but plain LTV, which is `extract`)
    on `task`'s episode, scored on its test queries; the artifact carries the metrics."""
    from dataclasses import replace

    from .methods import Context, MethodOptions, score_methods

    opts = opts or ExtractOptions()
    label_ids = label_token_ids(task, lm.tokenizer)
    episode = plan_episode(task, opts)
    cap = Capturer(lm.model, lm.tokenizer, batch_size=opts.batch_size, progress=opts.progress)
    c = capture_episode(cap, episode)
    ctx = Context(cap, episode, label_ids,
                  MethodOptions(lam=opts.lam, seed=opts.seed, batch_size=opts.batch_size,
                                progress=opts.progress),
                  identity=lm.identity, h_zs=c.h_zs, h_icl=c.h_icl,
                  capture_seconds=c.capture_seconds)
    sc = score_methods(ctx, [method], c.h_zs_test, c.h_icl_test, episode_labels(episode))
    secs = sc.extraction_seconds[method]
    art = sc.artifacts[method]
    art = replace(art, provenance=replace(art.provenance, metrics=sc.metrics,
                                          timings={"extraction_seconds": secs}))
    return MethodResult(art, sc.metrics, secs, dict(sc.params.get(method, {})),
                        k=len(episode.demos), n_test=len(episode.test))


def _provenance(lm: LoadedModel, episode: Episode, res: Any, opts: ExtractOptions, *,
                method: str, source: SourceModel | None = None) -> Provenance:
    """What a task-vector file records about its extraction (res: Episode/TransferResult)."""
    from .hardware import hardware

    return Provenance(
        method=method,
        task=episode.task.to_dict(),
        k=opts.k_for(episode.task, transfer=source is not None),
        k_used=len(episode.demos),
        n=opts.n,
        lam=res.factors.lam if res.factors.lam is not None else opts.lam,
        seed=opts.seed,
        n_test=len(episode.test),
        episode=episode.fingerprint(),
        ridge_form=res.factors.form,
        metrics_rank=int(res.factors.U.shape[1]),  # the rank the metrics were measured at
        dtype=str(lm.model.dtype).removeprefix("torch."),
        hardware=hardware(),
        package_version=__version__,
        metrics=res.metrics,
        timings=res.timings,
        source_model=source.identity.to_dict() if source else None,
        source_load={k: v for k, v in source.load.items() if v is not None} if source else None,
        extra={"lam_loo": res.factors.loo.to_dict()} if res.factors.loo is not None else {},
    )


# -- cross-model transfer -----------------------------------------------------------------


@dataclass
class SourceModel:
    """The large model of a transfer, loaded only if some of its captures are missing.

    Everything about it that is needed before a heavy pass (tokenizer, identity, LM head) is
    read from its directory without building the model.
    """

    spec: str
    path: str
    tokenizer: Any
    identity: ModelIdentity
    cap: Any  # StoredCapturer
    load: dict[str, Any]
    _head: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """W_lm (V, d_L) and its bias: from the loaded model, else from the checkpoint."""
        if self.cap.loaded:
            return full_head(self.cap.capturer.model)
        if self._head is None:
            from .checkpoint import read_lm_head, read_lm_head_bias

            self._head = (read_lm_head(self.path), read_lm_head_bias(self.path))
        return self._head


@dataclass(frozen=True)
class SourceOptions:
    """The large model of a cross-model transfer and how it is loaded and captured."""

    spec: str
    dtype: str = "auto"
    device: str = "cpu"
    device_map: str | None = None  # e.g. "auto": spread over every GPU (accelerate)
    quantization: str | None = None  # "8bit" | "4bit" (bitsandbytes, CUDA only)
    work_dir: str | None = None  # where captures are saved [default: the cache's captures/]
    chunk_size: int = 64
    batch_size: int = 16
    progress: bool = True

    def __post_init__(self) -> None:
        from .hardware import DTYPE_CHOICES

        if self.chunk_size < 1:
            raise ArgumentError(f"--chunk-size must be at least 1, got {self.chunk_size}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ArgumentError(f"--source-quantization must be one of none, "
                                f"{', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization:
            check_quantization(self.quantization)  # no GPU / bitsandbytes: refused up front
        if self.dtype not in DTYPE_CHOICES:
            raise ArgumentError(f"--source-dtype must be one of {', '.join(DTYPE_CHOICES)}, "
                                f"got {self.dtype!r}")


def open_source(opts: SourceOptions) -> SourceModel:
    """Prepare the source side of a transfer: tokenizer, identity, a resumable capture store.

    Nothing heavy: the model loads only when a capture chunk is missing.
    """
    from pathlib import Path

    from transformers import AutoTokenizer

    from .checkpoint import identity_from_dir
    from .hardware import resolve_for_model
    from .models import cache_dir
    from .store import StoredCapturer

    path = local_model_dir(opts.spec)
    ident = identity_from_dir(path, name=opts.spec)
    spread = (opts.device_map or opts.quantization) and torch.cuda.is_available()
    # resolved here: the capture store's key must hold the precision the states came from
    dtype = resolve_for_model(opts.dtype, path, "cuda" if spread else opts.device)
    load = {"dtype": dtype, "device": opts.device, "device_map": opts.device_map,
            "quantization": opts.quantization}

    def make() -> Capturer:
        lm = load_model(path, **load)
        return Capturer(lm.model, lm.tokenizer, batch_size=opts.batch_size,
                        progress=opts.progress)

    # Not the spec: the same weights reached by another path or alias reuse the captures.
    key = {"model": {k_: v for k_, v in ident.to_dict().items() if k_ != "name"}, "dtype": dtype,
           "quantization": opts.quantization, "capture": "post-norm last token, v1"}
    root = Path(opts.work_dir) if opts.work_dir else cache_dir() / "captures"
    store = StoredCapturer(root, key, make, chunk_size=opts.chunk_size, progress=opts.progress)
    return SourceModel(spec=opts.spec, path=path, tokenizer=AutoTokenizer.from_pretrained(path),
                       identity=ident, cap=store, load=load)


def check_pair(target: LoadedModel, source: SourceModel, episode: Episode) -> list[int]:
    """Same tokenizer on this episode's prompts and label words; returns the label ids."""
    from .transfer import TransferError, check_same_tokenizer

    task = episode.task
    prefix = episode.demo_prefix()
    prompts = [prefix + task.query(e.text) for e in episode.queries[:4]]
    prompts += [task.query(e.text) for e in (*episode.queries[:16], *episode.test[:16])]
    check_same_tokenizer(target.tokenizer, source.tokenizer, prompts,
                         names=(f"target {target.spec}", f"source {source.spec}"))
    ids_t = label_token_ids(task, target.tokenizer)
    ids_s = label_token_ids(task, source.tokenizer)
    if ids_t != ids_s:
        raise TransferError(f"label words of {task.name!r} map to {ids_t} in the target's "
                            f"tokenizer but {ids_s} in the source's")
    return ids_t


@dataclass
class TransferResult:
    factors: Factors                      # W̃ = U Vᵀ, U (V_S, r), V (d_S, r)
    target: EpisodeResult                 # the target's own zero-shot / ICL / LTV / mean
    source: EpisodeResult                 # the source's own
    metrics: dict[str, dict[str, float]]  # target methods, "source-*" and "ltv-transfer"
    timings: dict[str, float]


def _label_rows(w: torch.Tensor, b: torch.Tensor | None, label_ids: list[int]):
    idx = torch.tensor(label_ids, dtype=torch.long, device=w.device)
    w_c = w.index_select(0, idx).float().cpu()
    b_c = b.index_select(0, idx).float().cpu() if b is not None else torch.zeros(len(label_ids))
    return w_c, b_c


def run_transfer_episode(
    target_cap: Capturer,
    source: SourceModel,
    episode: Episode,
    lam: float,
    label_ids: list[int],
    *,
    h_zs_test_target: torch.Tensor | None = None,
    h_zs_test_source: torch.Tensor | None = None,
    rank: int | None = None,
) -> tuple[TransferResult, Captures, Captures]:
    """Both models' passes, each model's own LTV, and the logit-space fit source → target."""
    from .transfer import fit_transfer, full_logits, transfer_label_logits

    labels = episode_labels(episode)
    ct = capture_episode(target_cap, episode, h_zs_test=h_zs_test_target)
    cs = capture_episode(source.cap, episode, h_zs_test=h_zs_test_source)
    w_t, b_t = full_head(target_cap.model)
    w_s, b_s = source.head()
    res_t = score_episode(ct, lam, *_label_rows(w_t, b_t, label_ids), labels)
    res_s = score_episode(cs, lam, *_label_rows(w_s, b_s, label_ids), labels)

    t0 = time.perf_counter()
    z_icl_s = full_logits(cs.h_icl, w_s, b_s)  # (N, V_L): the regression's reference
    z_zs_t = full_logits(ct.h_zs, w_t, b_t)    # (N, V_S)
    factors = fit_transfer(ct.h_zs, z_icl_s, z_zs_t, lam)
    if rank is not None:
        factors = truncate(factors, rank)
    del z_icl_s, z_zs_t
    fit_seconds = time.perf_counter() - t0

    w_c, b_c = _label_rows(w_t, b_t, label_ids)
    z_tr = transfer_label_logits(ct.h_zs_test, w_c, b_c, factors, label_ids)
    metrics = dict(res_t.metrics)
    metrics.update({f"source-{m}": v for m, v in res_s.metrics.items()})
    # The transferred vector imitates the source's ICL: that is its d_NTP reference.
    metrics["ltv-transfer"] = {"accuracy": accuracy(z_tr, labels),
                               "d_ntp": d_ntp(res_s.label_logits["icl"], z_tr)}
    timings = {
        "source_capture_seconds": cs.capture_seconds,
        "target_capture_seconds": ct.capture_seconds,
        "fit_seconds": fit_seconds,
        "extraction_seconds": cs.capture_seconds + ct.capture_seconds + fit_seconds,
        "test_seconds": cs.test_seconds + ct.test_seconds,
    }
    return TransferResult(factors, res_t, res_s, metrics, timings), ct, cs


def extract_transfer(
    target: LoadedModel,
    source: SourceModel,
    task: Task,
    opts: ExtractOptions | None = None,
    *,
    episode: Episode | None = None,
) -> tuple[TaskVector, TransferResult]:
    """A logit-space task vector for `target`, fitted to `source`'s ICL (paper appendix)."""
    opts = opts or ExtractOptions()
    episode = episode or plan_episode(task, opts, transfer=True)
    label_ids = check_pair(target, source, episode)  # before any heavy pass
    cap = Capturer(target.model, target.tokenizer, batch_size=opts.batch_size,
                   progress=opts.progress)
    res, _, _ = run_transfer_episode(cap, source, episode, opts.lam, label_ids, rank=opts.rank)
    tv = TaskVector(
        kind="logit",
        U=res.factors.U,
        V=res.factors.V,
        bias=None,
        model=target.identity,
        label_token_ids=tuple(label_ids),
        provenance=_provenance(target, episode, res, opts, method=TRANSFER_METHOD,
                               source=source),
        gram=res.factors.gram,
    )
    return tv, res
