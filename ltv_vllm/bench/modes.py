"""The serving modes compared, as vLLM engines: which engine arguments, which requests.

Every mode runs the same queries with the same `EngineSettings`; prefix caching is on
everywhere (vLLM's default) except in `icl-no-cache`. A fused or folded vector serves one
task, so those modes run one engine per task (times are summed); the LoRA mode serves every
task from one engine with the tasks mixed in one batch; `ltv-lora-rR` does the same with
every adapter cut to rank R (`TaskVector.truncated`; vLLM's CPU LoRA kernel gathers a
vocab × rank matrix per sampled row, so its cost grows with the rank). `kernel-fused` serves
the kernel LTV (`extract --method kernel`) fused, the only way a nonlinear map is served.
`ltv-shift` serves every task from one engine too, with each request's task chosen per
request inside the engine (`serve.task_engine`, what `ltv-vllm serve` does with named vectors
by default). Every LTV mode shifts every generated token, as the folded head and LoRA can only
do, so their costs compare; `ltv-fused-first` shifts the first generated token only (the step
policy `first`, what classification vectors record), the cost of free text served cleanly.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ltv_vllm.bench.workload import EngineSettings, Query, Workload

MODES = ("zero-shot", "icl-prefix-cache", "icl-no-cache", "ltv-fused", "ltv-folded",
         "ltv-shift", "ltv-lora", "ltv-fused-first", "kernel-fused")
# the kernel map and the first-step policy are compared on request (`--modes ...`)
DEFAULT_MODES = MODES[:-2]
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
    env: dict[str, str] = field(default_factory=dict)  # for the engine's (or server's) process


def request(wl: Workload, q: Query, *, icl: bool, model: str,
            lora: tuple[str, int, str] | None = None,
            xargs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"qid": q.qid, "prompt": q.icl if icl else q.zs, "task": q.task, "gold": q.gold,
            "label_ids": wl.label_ids[q.task], "labels": list(wl.tasks[q.task].labels),
            "model": model,
            "lora": list(lora) if lora else None,
            "xargs": xargs}  # the request's `vllm_xargs` (offline: SamplingParams.extra_args)


def per_task(queries: list[Query]) -> dict[str, list[Query]]:
    out: dict[str, list[Query]] = {}
    for q in queries:
        out.setdefault(q.task, []).append(q)
    return out


def engines(mode: str, wl: Workload, settings: EngineSettings, queries: list[Query],
            lora_dir: Path) -> list[Engine]:
    """The engine(s) a mode needs for `queries` (a subset of the workload's)."""
    from ltv_vllm.serving.launcher.lora_plan import plan_lora
    from ltv_vllm.serving.launcher.recipe import engine_kwargs, task_engine
    from ltv_vllm.serving.launcher.server_args import ServerSpec, server_args

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

    if mode in ("ltv-fused", "ltv-folded", "kernel-fused", "ltv-fused-first"):
        fold = mode == "ltv-folded"
        # every generated token shifted (the folded head can do no other), so the modes'
        # costs and answers compare; the first-step mode shifts the first only
        steps = "first" if mode == "ltv-fused-first" else "all"
        out = []
        for task, qs in groups.items():
            vec = (wl.kernel_vectors if mode == "kernel-fused" else wl.vectors)[task]

            def fused(host: str, port: int, vec: Path = vec) -> list[str]:
                args, _, _ = server_args(ServerSpec(
                    model, {"": vec}, lora_dir=lora_dir, served_name=BASE_NAME, host=host,
                    port=port, dtype=settings.dtype, max_model_len=settings.max_model_len,
                    fold=fold, shift_steps=None if fold else steps))
                return [*args, *flags]

            kwargs = engine_kwargs(model, vec, fold=fold, shift_steps=None if fold else steps)
            out.append(Engine(f"{mode}[{task}]", {**kwargs, **common}, fused,
                              [[request(wl, q, icl=False, model=task) for q in qs]]))
        return out

    if mode == "ltv-shift":
        vectors = {t: wl.vectors[t] for t in groups}
        engine = task_engine(model, vectors, shift_steps="all")

        def shift(host: str, port: int) -> list[str]:
            args, _, _ = server_args(ServerSpec(
                model, vectors, lora_dir=lora_dir, served_name=BASE_NAME, host=host,
                port=port, dtype=settings.dtype, max_model_len=settings.max_model_len,
                shift_steps="all"))
            return [*args, *flags]

        mixed = [request(wl, q, icl=False, model=q.task, xargs={"ltv_task": q.task})
                 for q in queries]
        return [Engine(mode, {**engine.kwargs, **common}, shift, [mixed], engine.env)]

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
            args, _, _ = server_args(ServerSpec(
                model, {t: wl.vectors[t] for t in names}, lora_dir=lora_dir,
                served_name=BASE_NAME, host=host, port=port, dtype=settings.dtype,
                max_model_len=settings.max_model_len, lora_rank_cap=cap, lora=True))
            return [*args, *flags]

        mixed = [request(wl, q, icl=False, model=q.task, lora=loras[q.task]) for q in queries]
        return [Engine(mode, kwargs, multi, [mixed])]

    raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)}, ltv-lora-rR)")
