"""Cross-model transfer: a large source model's ICL carried to a small target in logit space.

`extract_transfer(target, source, task, opts)` fits the target's logit-space vector to the
source's ICL distributions on the same episode (`run_transfer_episode`); the source is
loaded only where its stored captures miss a prompt (`open_source`, `prefetch_source`). The
passes and the maths are the extraction pipeline's (`pipeline.extract`) and
`extraction.transfer`'s; this module holds what only a transfer needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ltv_vllm import __version__
from ltv_vllm.core.metrics import accuracy, d_ntp
from ltv_vllm.core.ridge import Factors, truncate
from ltv_vllm.core.vector import DEFAULT_SHIFT_STEPS, ModelIdentity, Provenance, TaskVector
from ltv_vllm.errors import ArgumentError
from ltv_vllm.extraction.capture import Capturer, full_head
from ltv_vllm.extraction.store import CallRecorder, StoredCapturer
from ltv_vllm.extraction.transfer import (
    TransferError,
    check_same_tokenizer,
    fit_transfer,
    full_logits,
    transfer_label_logits,
)
from ltv_vllm.methods import Context, MethodOptions, MethodScores, score_methods
from ltv_vllm.models.cache import cache_dir
from ltv_vllm.models.checkpoint import identity_from_dir, read_lm_head, read_lm_head_bias
from ltv_vllm.models.hardware import DTYPE_CHOICES, hardware, resolve_for_model
from ltv_vllm.models.loading import (
    QUANTIZATIONS,
    LoadedModel,
    check_quantization,
    load_model,
    local_model_dir,
)
from ltv_vllm.pipeline.extract import (
    ENGINES,
    Captures,
    ExtractOptions,
    capture_episode,
    demonstrations,
    episode_labels,
    plan_episode,
)
from ltv_vllm.tasks.data import Episode
from ltv_vllm.tasks.specs import Task, label_token_ids

METHODS = ("zero-shot", "icl", "ltv", "mean")  # what a transfer evaluation shows per model
OWN_METHODS = ("ltv", "mean")  # each model's own task vectors in a transfer
TRANSFER_METHOD = "ltv-transfer"


def _transfer_provenance(lm: LoadedModel, episode: Episode, res: TransferResult,
                         opts: ExtractOptions, source: SourceModel) -> Provenance:
    """What a transferred vector's file records about its extraction."""

    return Provenance(
        method=TRANSFER_METHOD,
        task=episode.task.to_dict(),
        k=opts.k_for(episode.task, transfer=True),
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
        source_model=source.identity.to_dict(),
        source_load={k: v for k, v in source.load.items() if v is not None},
        shift_steps=DEFAULT_SHIFT_STEPS,
        demonstrations=demonstrations([episode.demos]),
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
    engine: str = "transformers"  # or "vllm": the chunks filled ahead by `prefetch_source`

    def __post_init__(self) -> None:
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
        if self.engine not in ENGINES:
            raise ArgumentError(f"--source-engine must be one of {', '.join(ENGINES)}, "
                                f"got {self.engine!r}")
        if self.engine == "vllm" and (self.device_map or self.quantization):
            raise ArgumentError("--source-engine vllm places the source itself: no "
                                "--source-device-map or --source-quantization")


def open_source(opts: SourceOptions) -> SourceModel:
    """Prepare the source side of a transfer: tokenizer, identity, a resumable capture store.

    Nothing heavy: the model loads only when a capture chunk is missing.
    """

    from transformers import AutoTokenizer

    path = local_model_dir(opts.spec)
    ident = identity_from_dir(path, name=opts.spec)
    spread = (opts.device_map or opts.quantization or opts.engine == "vllm") \
        and torch.cuda.is_available()
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
    if opts.engine != "transformers":  # another engine's kernels: chunks never mixed
        key["engine"] = opts.engine
        load["engine"] = opts.engine
    root = Path(opts.work_dir) if opts.work_dir else cache_dir() / "captures"
    store = StoredCapturer(root, key, make, chunk_size=opts.chunk_size, progress=opts.progress)
    return SourceModel(spec=opts.spec, path=path, tokenizer=AutoTokenizer.from_pretrained(path),
                       identity=ident, cap=store, load=load)


def prefetch_source(source: SourceModel, episodes: list[Episode],
                    capture: Callable[[list[str]], torch.Tensor]) -> int:
    """Fill the source's capture store ahead of the passes: every chunk the episodes' passes
    will ask for and the store lacks, captured by `capture` (an engine that takes every
    prompt at once: `--source-engine vllm`) in one call. The passes then find every chunk
    and never load the source into transformers. Returns the prompts captured."""
    rec = CallRecorder()
    for ep in episodes:
        capture_episode(rec, ep)
    chunks = source.cap.missing(rec.calls)
    prompts = [p for _, ps in chunks for p in ps]
    if prompts:
        source.cap.fill(chunks, capture(prompts))
    return len(prompts)


def check_pair(target: LoadedModel, source: SourceModel, episode: Episode) -> list[int]:
    """Same tokenizer on this episode's prompts and label words; returns the label ids."""

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
    target: MethodScores                  # the target's own zero-shot / ICL / LTV / mean
    source: MethodScores                  # the source's own (fitted on its stored states)
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

    labels = episode_labels(episode)
    ct = capture_episode(target_cap, episode, h_zs_test=h_zs_test_target)
    cs = capture_episode(source.cap, episode, h_zs_test=h_zs_test_source)
    w_t, b_t = full_head(target_cap.model)
    w_s, b_s = source.head()
    # each model's own LTV and mean shift, through the registry like any extraction
    own = MethodOptions(lam=lam, progress=False)
    ctx_t = Context(target_cap, episode, label_ids, own, h_zs=ct.h_zs, h_icl=ct.h_icl,
                    capture_seconds=ct.capture_seconds)
    ctx_s = Context(None, episode, label_ids, own, identity=source.identity, h_zs=cs.h_zs,
                    h_icl=cs.h_icl, capture_seconds=cs.capture_seconds, head=w_s,
                    dtype=str(source.load["dtype"]))
    res_t = score_methods(ctx_t, OWN_METHODS, ct.h_zs_test, ct.h_icl_test, labels,
                          head=_label_rows(w_t, b_t, label_ids))
    res_s = score_methods(ctx_s, OWN_METHODS, cs.h_zs_test, cs.h_icl_test, labels,
                          head=_label_rows(w_s, b_s, label_ids))

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
                               "d_ntp": d_ntp(res_s.logits["icl"], z_tr)}
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
        provenance=_transfer_provenance(target, episode, res, opts, source),
        gram=res.factors.gram,
    )
    return tv, res
