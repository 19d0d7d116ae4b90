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
from .capture import Capturer, label_head
from .data import Episode
from .metrics import accuracy, d_ntp
from .ridge import Factors, mean_shift, ridge_fit
from .tasks import Task, label_token_ids
from .vector import ModelIdentity, TaskVector, model_identity

METHODS = ("zero-shot", "icl", "ltv", "mean")


@dataclass
class LoadedModel:
    """A transformers causal LM ready for capture, with what a TaskVector records about it."""

    model: Any
    tokenizer: Any
    spec: str
    identity: ModelIdentity


def load_model(spec: str | None, *, dtype: str = "auto", device: str = "cpu") -> LoadedModel:
    """Resolve a model spec (alias | local dir | hub id) and load it with transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .models import DEFAULT_MODEL, resolve_model

    spec = spec or DEFAULT_MODEL
    path = resolve_model(spec)
    torch_dtype: Any = dtype if dtype == "auto" else getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()
    return LoadedModel(model=model, tokenizer=tok, spec=spec, identity=model_identity(model, spec))


@dataclass
class EpisodeResult:
    factors: Factors
    mean: torch.Tensor                      # (d,) constant-mapping baseline
    label_logits: dict[str, torch.Tensor]   # method → (n_test, K) restricted logits
    labels: torch.Tensor                    # (n_test,)
    metrics: dict[str, dict[str, float]]    # method → {"accuracy", "d_ntp"}
    timings: dict[str, float] = field(default_factory=dict)


def capture_test_zero_shot(cap: Capturer, task: Task, episode: Episode) -> torch.Tensor:
    """h_zs on the test subset: it does not depend on the demos, so runs share it. (n_test, d)"""
    return cap.hidden([task.query(e.text) for e in episode.test], desc=f"{task.name} zero-shot test")


def run_episode(
    cap: Capturer,
    episode: Episode,
    lam: float,
    label_ids: list[int],
    *,
    h_zs_test: torch.Tensor | None = None,
    methods: tuple[str, ...] = METHODS,
) -> EpisodeResult:
    task = episode.task
    w_c, b_c = label_head(cap.model, label_ids)  # (K, d), (K,)
    prefix = episode.demo_prefix()
    queries = [task.query(e.text) for e in episode.queries]

    t0 = time.perf_counter()
    h_zs = cap.hidden(queries, desc=f"{task.name} zero-shot train")  # (N, d)
    h_icl = cap.icl(prefix, queries, desc=f"{task.name} icl train")   # (N, d)
    t1 = time.perf_counter()
    y = h_icl - h_zs                                                    # (N, d) targets
    factors = ridge_fit(h_zs, y, lam)
    mean = mean_shift(y)
    t2 = time.perf_counter()

    if h_zs_test is None:
        h_zs_test = capture_test_zero_shot(cap, task, episode)
    test_queries = [task.query(e.text) for e in episode.test]
    h_icl_test = cap.icl(prefix, test_queries, desc=f"{task.name} icl test")
    t3 = time.perf_counter()

    hidden = {
        "zero-shot": h_zs_test,
        "icl": h_icl_test,
        "ltv": h_zs_test + factors.apply(h_zs_test),
        "mean": h_zs_test + mean,
    }
    logits = {m: hidden[m] @ w_c.T + b_c for m in methods}
    labels = torch.tensor([e.label for e in episode.test])
    metrics = {
        m: {"accuracy": accuracy(z, labels), "d_ntp": d_ntp(logits["icl"], z)}
        for m, z in logits.items()
    }
    timings = {
        "capture_seconds": t1 - t0,
        "fit_seconds": t2 - t1,
        "extraction_seconds": t2 - t0,
        "test_seconds": t3 - t2,
    }
    return EpisodeResult(factors, mean, logits, labels, metrics, timings)


def extract(
    lm: LoadedModel,
    task: Task,
    *,
    k: int = 30,
    n: int = 256,
    lam: float = 5.0,
    seed: int = 0,
    n_test: int = 500,
    batch_size: int = 16,
    progress: bool = True,
) -> tuple[TaskVector, EpisodeResult]:
    """Fit an LTV for `task` on `lm` and measure it on the held-out test subset."""
    from .data import load_dataset, sample_episode

    label_ids = label_token_ids(task, lm.tokenizer)
    dataset = load_dataset(task)
    episode = sample_episode(dataset, k=k, n=n, n_test=n_test, seed=seed)
    cap = Capturer(lm.model, lm.tokenizer, batch_size=batch_size, progress=progress)
    res = run_episode(cap, episode, lam, label_ids)
    tv = TaskVector(
        kind="hidden",
        U=res.factors.U,
        V=res.factors.V,
        bias=None,
        model=lm.identity,
        label_token_ids=tuple(label_ids),
        meta={
            "method": "ltv",
            "task": task.to_dict(),
            "k": k,
            "k_used": len(episode.demos),
            "n": n,
            "lam": lam,
            "seed": seed,
            "n_test": len(episode.test),
            "episode": episode.fingerprint(),
            "ridge_form": res.factors.form,
            "dtype": str(lm.model.dtype).removeprefix("torch."),
            "package_version": __version__,
            "metrics": res.metrics,
            "timings": res.timings,
        },
    )
    return tv, res
