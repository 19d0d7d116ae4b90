"""The serving modes compared, as vLLM engines: which engine arguments, which requests.

Every mode runs the same queries with the same `EngineSettings`; prefix caching is on
everywhere (vLLM's default) except in `icl-no-cache`. A fused or folded vector serves one
task, so those modes run one engine per task (times are summed); the LoRA mode serves every
task from one engine with the tasks mixed in one batch; `ltv-lora-rR` does the same with
every adapter cut to rank R (`TaskVector.truncated`; vLLM's CPU LoRA kernel gathers a
vocab × rank matrix per sampled row, so its cost grows with the rank). `kernel-fused` serves
the kernel LTV (`extract --method kernel`) fused, the only way a nonlinear map is served.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltv_vllm.bench.workload import EngineSettings, Query, Workload

MODES = ("zero-shot", "icl-prefix-cache", "icl-no-cache", "ltv-fused", "ltv-folded", "ltv-lora",
         "kernel-fused")
DEFAULT_MODES = MODES[:-1]  # the kernel map is compared on request (`--modes ...,kernel-fused`)
BASE_NAME = "base"  # served model name of the bare model
_LORA_MODE = re.compile(r"ltv-lora(?:-r([1-9][0-9]*))?")


def lora_mode_rank(mode: str) -> tuple[bool, int | None]:
    """(is a LoRA mode, its rank cap): `ltv-lora` → (True, None), `ltv-lora-r32` → (True, 32)."""
    m = _LORA_MODE.fullmatch(mode)
    return (m is not None, int(m.group(1)) if m and m.group(1) else None)


def known_mode(mode: str) -> bool:
    return mode in MODES or lora_mode_rank(mode)[0]


@dataclass
class Engine:
    """One engine configuration and the requests it gets, grouped per task."""

    label: str
    llm_kwargs: dict[str, Any]                 # for vllm.LLM (offline)
    server_args: Callable[[str, int], list[str]]  # (host, port) → argv after `-m SERVER_MODULE`
    groups: list[list[dict[str, Any]]]


def request(wl: Workload, q: Query, *, icl: bool, model: str,
            lora: tuple[str, int, str] | None = None) -> dict[str, Any]:
    return {"qid": q.qid, "prompt": q.icl if icl else q.zs, "task": q.task, "gold": q.gold,
            "label_ids": wl.label_ids[q.task], "labels": list(wl.tasks[q.task].labels),
            "model": model,
            "lora": list(lora) if lora else None}


def per_task(queries: list[Query]) -> dict[str, list[Query]]:
    out: dict[str, list[Query]] = {}
    for q in queries:
        out.setdefault(q.task, []).append(q)
    return out


def engines(mode: str, wl: Workload, settings: EngineSettings, queries: list[Query],
            lora_dir: Path) -> list[Engine]:
    """The engine(s) a mode needs for `queries` (a subset of the workload's)."""
    from ltv_vllm.serving.serve import engine_kwargs, plan_lora, server_args

    model = str(wl.model_dir)
    caching = mode != "icl-no-cache"
    common = {**settings.llm_kwargs(), "enable_prefix_caching": caching}
    flags = [*settings.server_flags(),
             "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]

    def plain(host: str, port: int) -> list[str]:
        return ["--model", model, "--served-model-name", BASE_NAME, "--host", host,
                "--port", str(port), "--dtype", settings.dtype,
                "--max-model-len", str(settings.max_model_len),
                "--logprobs-mode", "processed_logprobs", *flags]

    groups = per_task(queries)
    if mode in ("zero-shot", "icl-prefix-cache", "icl-no-cache"):
        icl = mode != "zero-shot"
        return [Engine(mode, {"model": model, **common}, plain,
                       [[request(wl, q, icl=icl, model=BASE_NAME) for q in qs]
                        for qs in groups.values()])]

    if mode in ("ltv-fused", "ltv-folded", "kernel-fused"):
        fold = mode == "ltv-folded"
        out = []
        for task, qs in groups.items():
            vec = (wl.kernel_vectors if mode == "kernel-fused" else wl.vectors)[task]

            def fused(host: str, port: int, vec: Path = vec) -> list[str]:
                args, _ = server_args(model, {"": vec}, lora_dir=lora_dir, served_name=BASE_NAME,
                                      host=host, port=port, dtype=settings.dtype,
                                      max_model_len=settings.max_model_len, fold=fold)
                return [*args, *flags]

            # every generated token shifted in every mode (the folded head can do no other):
            # the modes' costs and answers stay comparable
            out.append(Engine(f"{mode}[{task}]", {**engine_kwargs(model, vec, fold=fold,
                                                                  shift_steps="all"), **common},
                              fused, [[request(wl, q, icl=False, model=task) for q in qs]]))
        return out

    is_lora, cap = lora_mode_rank(mode)
    if is_lora:
        names = list(groups)
        # the plan `ltv-vllm serve` uses: same adapters, slots, target modules
        plan = plan_lora(model, {t: wl.vectors[t] for t in names}, lora_dir=lora_dir,
                         rank_cap=cap)
        plan.write()
        loras = {t: (t, i + 1, str(plan.adapters[t])) for i, t in enumerate(names)}
        kwargs = {"model": model, **common, **plan.engine_kwargs()}

        def multi(host: str, port: int) -> list[str]:
            args, _ = server_args(model, {t: wl.vectors[t] for t in names}, lora_dir=lora_dir,
                                  served_name=BASE_NAME, host=host, port=port,
                                  dtype=settings.dtype, max_model_len=settings.max_model_len,
                                  lora_rank_cap=cap)
            return [*args, *flags]

        mixed = [request(wl, q, icl=False, model=q.task, lora=loras[q.task]) for q in queries]
        return [Engine(mode, kwargs, multi, [mixed])]

    raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)}, ltv-lora-rR)")
