"""What every benchmark mode shares: the queries, their zero-shot and ICL prompts, the vectors.

The test queries of each task are its episode's balanced test subset (the same ones
`ltv-vllm evaluate` scores), interleaved round-robin across tasks so any prefix of the list
is a balanced mix. Task vectors are extracted once with transformers (or loaded from
`vector_dir` when a file for the task is there) before anything is timed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ltv_vllm.tasks.specs import Task


@dataclass(frozen=True)
class EngineSettings:
    """Identical for every mode; only prefix caching differs (ICL without it)."""

    dtype: str = "auto"  # resolved per machine (`hardware.resolve_dtype`) before any engine
    max_model_len: int = 4096
    kv_cache_gib: int = 4          # VLLM_CPU_KVCACHE_SPACE (CPU backend)
    enforce_eager: bool = True
    max_num_seqs: int | None = None
    seed: int = 0

    def llm_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"dtype": self.dtype, "max_model_len": self.max_model_len,
                              "enforce_eager": self.enforce_eager, "seed": self.seed}
        if self.max_num_seqs:
            kw["max_num_seqs"] = self.max_num_seqs
        return kw

    def server_flags(self) -> list[str]:
        flags = ["--seed", str(self.seed)]
        if self.enforce_eager:
            flags.append("--enforce-eager")
        if self.max_num_seqs:
            flags += ["--max-num-seqs", str(self.max_num_seqs)]
        return flags

    def env(self) -> dict[str, str]:
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}


@dataclass(frozen=True)
class Query:
    qid: int        # position in the workload's interleaved list
    task: str
    gold: int       # index into the task's labels
    zs: str         # the zero-shot prompt
    icl: str        # k demonstrations + the zero-shot prompt


@dataclass
class Workload:
    model_dir: Path
    tasks: dict[str, Task]
    label_ids: dict[str, list[int]]
    queries: list[Query]
    vectors: dict[str, Path] = field(default_factory=dict)
    kernel_vectors: dict[str, Path] = field(default_factory=dict)  # `kernel-fused` only
    # accuracy (and d_NTP) of each method measured by transformers at extraction, same queries
    transformers_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    k: int = 30

    def describe(self) -> dict[str, Any]:
        return {
            "model_dir": str(self.model_dir),
            "tasks": list(self.tasks),
            "queries": len(self.queries),
            "queries_per_task": {t: sum(q.task == t for q in self.queries) for t in self.tasks},
            "k": self.k,
            "label_ids": self.label_ids,
            "vectors": {t: str(p) for t, p in self.vectors.items()},
            "kernel_vectors": {t: str(p) for t, p in self.kernel_vectors.items()},
            "transformers_metrics": self.transformers_metrics,
        }


def interleave(per_task: dict[str, list[Query]]) -> list[Query]:
    from dataclasses import replace

    out: list[Query] = []
    longest = max((len(v) for v in per_task.values()), default=0)
    for i in range(longest):
        out += [qs[i] for qs in per_task.values() if i < len(qs)]
    return [replace(q, qid=i) for i, q in enumerate(out)]


def icl_queries(task: Task, *, k: int, n_test: int, seed: int, n: int = 256) -> list[Query]:
    """The task's balanced test subset as zero-shot and k-shot prompts (episode `seed`)."""
    from ltv_vllm.tasks.data import load_dataset, sample_episode

    ep = sample_episode(load_dataset(task), k=k, n=n, n_test=n_test, seed=seed)
    prefix = ep.demo_prefix()
    return [Query(-1, task.name, e.label, task.query(e.text), prefix + task.query(e.text))
            for e in ep.test]


def build_workload(
    model_spec: str,
    task_names: list[str],
    *,
    n_per_task: int,
    k: int = 30,
    n: int = 256,
    lam: float = 5.0,
    seed: int = 0,
    vector_dir: Path,
    extract_dtype: str = "auto",
    with_vectors: bool = True,
    with_kernel: bool = False,
) -> Workload:
    from transformers import AutoTokenizer

    from ltv_vllm.models.cache import DEFAULT_MODEL
    from ltv_vllm.models.loading import local_model_dir
    from ltv_vllm.serving.launcher.serve import checked_vector
    from ltv_vllm.tasks.specs import get_task, label_token_ids

    model_dir = Path(local_model_dir(model_spec or DEFAULT_MODEL))
    tok = AutoTokenizer.from_pretrained(model_dir)
    tasks = {name: get_task(name) for name in task_names}
    per_task = {name: icl_queries(t, k=k, n_test=n_per_task, seed=seed, n=n)
                for name, t in tasks.items()}
    wl = Workload(model_dir, tasks, {name: label_token_ids(t, tok) for name, t in tasks.items()},
                  interleave(per_task), k=k)
    if not with_vectors:
        return wl
    vector_dir.mkdir(parents=True, exist_ok=True)
    lm = None
    for name, task in tasks.items():
        path = vector_dir / f"{name}-k{k}-n{n}-lam{lam:g}-seed{seed}.safetensors"
        if path.exists():
            tv = checked_vector(model_dir, path)
        else:
            from ltv_vllm.models.loading import load_model
            from ltv_vllm.pipeline.extract import ExtractOptions, extract

            lm = lm or load_model(str(model_dir), dtype=extract_dtype)
            tv = extract(lm, task, "ltv", ExtractOptions(k=k, n=n, lam=lam, seed=seed,
                                                         n_test=n_per_task)).artifact
            tv.save(path)
        wl.vectors[name] = path
        wl.transformers_metrics[name] = {
            "k": tv.provenance.k, "seed": tv.provenance.seed, "n_test": tv.provenance.n_test,
            **{m: v.get("accuracy") for m, v in (tv.provenance.metrics or {}).items()},
        }
    for name, task in tasks.items() if with_kernel else ():
        path = vector_dir / f"{name}-kernel-k{k}-n{n}-seed{seed}.safetensors"
        if path.exists():
            tv = checked_vector(model_dir, path)
        else:
            from ltv_vllm.models.loading import load_model
            from ltv_vllm.pipeline.extract import ExtractOptions, extract

            lm = lm or load_model(str(model_dir), dtype=extract_dtype)
            tv = extract(lm, task, "kernel", ExtractOptions(
                k=k, n=n, seed=seed, n_test=n_per_task)).artifact
            tv.save(path)
        wl.kernel_vectors[name] = path
        wl.transformers_metrics[name]["kernel"] = (
            (tv.provenance.metrics or {}).get("kernel", {}).get("accuracy"))
    del lm
    return wl


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """K and V of one token across all layers: what a longer prompt costs in KV cache."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    width = {"float32": 4}.get(dtype, 2)
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * width


def machine() -> dict[str, Any]:
    """The hardware record (`hardware.hardware`) plus the vLLM version."""
    from ltv_vllm.models.hardware import hardware

    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:  # pragma: no cover - the benchmarks need vLLM anyway
        vllm_version = None
    return {**hardware(), "vllm": vllm_version}
