"""vLLM's OpenAI-server flags for a model and its task vectors: a base every server shares,
then the fused, per-request or LoRA arguments over it. Runs in the launcher process (`serve`'s plan)
and in the online benchmark (`bench.modes`, which starts the same servers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ltv_vllm.core.layer_task import LayerTask
from ltv_vllm.core.vector import VectorError
from ltv_vllm.errors import ArgumentError
from ltv_vllm.serving.contract.names import gate
from ltv_vllm.serving.contract.wire import (
    DEFAULT_KEY,
    STORE_CONFIG_KEY,
    TASKS_CONFIG_KEY,
    layer_tasks,
    layer_tasks_env,
    tasks_env,
)
from ltv_vllm.serving.launcher.flags import (
    UserFlags,
    check_fused_lora,
    check_names,
    merged_overrides,
    vllm_flags,
)
from ltv_vllm.serving.launcher.lora_plan import LoraPlan, plan_lora
from ltv_vllm.serving.launcher.recipe import (
    Check,
    checked_vector,
    fused_env,
    fused_overrides,
    step_processor,
    task_engine,
    wrapper_architecture,
)
from ltv_vllm.serving.launcher.store_setup import store_rank


@dataclass(frozen=True)
class ServerSpec:
    """What a server serves, as `server_args` lays it out.

    One unnamed vector (`vectors[""]`) → fused: the LTV wrapper shifts every request (folded
    into the LM head with `fold`). Named vectors → multi-task, a request choosing its task
    with its `model` field (requests for `served_name` get no shift): by default the engine
    holds every vector and shifts each request's rows with its own (`task_engine`); with
    `lora` each becomes an lm_head LoRA adapter, which any stock vLLM can load;
    `lora_rank_cap` cuts each adapter to rank R (`TaskVector.truncated`; cheaper to serve).
    `store` (task-store entries at `store_root`, name → directory): tasks added while the
    server runs, loaded by the engine from the store on first use (per-request tasks), or,
    with `lora`, LoRA slots for `max_tasks` tasks at the rank a compiled task needs.
    `user`: the user's own vLLM flags that ltv-vllm sets too (`flags`): their served names
    replace `served_name`, their overrides, processors and adapters are merged in.
    """

    model_dir: Path
    vectors: dict[str, Path]
    lora_dir: Path
    served_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    max_model_len: int | None = None
    fold: bool = False
    shift_steps: str | None = None
    lora_rank_cap: int | None = None
    store: dict[str, Path] | None = None
    max_tasks: int = 8
    lora: bool = False
    store_root: Path | None = None
    probes: dict[str, dict[str, str]] | None = None  # the self-check's probe tasks
    # the layer probes among them: served name → (positions, additive) (`probes.ServedProbes`)
    probe_layers: dict[str, tuple[str, bool]] | None = None
    lora_min_rank: int = 1
    user: UserFlags = field(default_factory=UserFlags)
    check: Check = checked_vector  # how each vector is read and checked (`recipe.Check`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))

    @property
    def names(self) -> list[str]:
        """The base model's served names: the user's, else `served_name`."""
        return list(self.user.served_names) or [self.served_name]


def server_args(spec: ServerSpec) -> tuple[list[str], LoraPlan | None, dict[str, str]]:
    """argv for vLLM's OpenAI server (after `-m SERVER_MODULE`), for LoRA multi-task serving
    the plan whose adapters must be written before it starts, and what the server's
    environment needs; every vector is checked against the model first. The argv goes after
    the user's own (vLLM keeps a flag's last value)."""
    check_names([*spec.vectors, *(spec.store or {})], spec.user)
    args = base_args(spec)
    if "" in spec.vectors and spec.store is not None:
        raise VectorError("a task store serves tasks by name (multi-task): give --task-vector "
                          "as NAME=PATH beside --task-store")
    if "" in spec.vectors:
        return fused_args(spec, args)
    if spec.fold:
        raise VectorError("--fold applies to one fused vector, not to multi-task serving")
    if spec.lora_rank_cap is not None and not spec.lora:
        raise VectorError("a LoRA rank applies to LoRA multi-task serving (--multi-task lora)")
    if clash := [n for n in spec.names if n in spec.vectors]:
        raise VectorError(f"task {clash[0]!r} has the served model's name; rename it")
    return shift_args(spec, args) if not spec.lora else lora_args(spec, args)


def base_args(spec: ServerSpec) -> list[str]:
    """What every server gets: the model, where it listens, its dtype and processed
    logprobs."""
    from ltv_vllm.models.hardware import resolve_for_model

    wrapper_architecture(spec.model_dir)
    # vLLM's own "auto" would keep bf16 on any CPU
    dtype = resolve_for_model(spec.dtype, spec.model_dir)
    args = ["--model", str(spec.model_dir), "--host", spec.host, "--port", str(spec.port),
            "--dtype", dtype,
            # logprobs after logits processors such as allowed_token_ids: the label-restricted
            # distribution the paper scores, straight from the server.
            "--logprobs-mode", "processed_logprobs"]
    if spec.max_model_len:
        args += ["--max-model-len", str(spec.max_model_len)]
    return args


def fused_args(spec: ServerSpec, args: list[str]
               ) -> tuple[list[str], None, dict[str, str]]:
    """One fused vector: every request shifted (folded into the LM head with `fold`)."""
    if spec.lora_rank_cap is not None:
        raise VectorError("a LoRA rank applies to multi-task serving (name=path vectors), "
                          "not to one fused vector")
    check_fused_lora(spec.user)
    overrides, tv = fused_overrides(spec.model_dir, spec.vectors[""], spec.fold,
                                    spec.shift_steps, check=spec.check)
    task_env = fused_env(overrides, tv)  # a layer task's prefix-cache keys (read once)
    if spec.probes:  # the fused vector, and the probes by name (`offline.selfcheck`)
        overrides[TASKS_CONFIG_KEY] = json.dumps(spec.probes)
        task_env.update(tasks_env(list(spec.probes)))
        task_env.update(_with_probe_layers(task_env, spec.probe_layers))
    return [*args, "--hf-overrides", json.dumps(merged_overrides(overrides,
                                                                 spec.user.hf_overrides)),
            "--logits-processors", *spec.user.logits_processors,
            step_processor(per_request=not spec.fold),
            "--served-model-name", tv.task_name, *spec.names,
            # the key on every route (vLLM's own included), body limits, and the request
            # shapes the shift cannot follow refused
            "--middleware", gate("FoldedGate" if spec.fold else "Gate")], None, task_env


def shift_args(spec: ServerSpec, args: list[str]
               ) -> tuple[list[str], None, dict[str, str]]:
    """Named tasks with per-request shifts: the engine holds every vector."""
    engine = task_engine(spec.model_dir, spec.vectors, shift_steps=spec.shift_steps,
                         check=spec.check)
    overrides = dict(engine.overrides)
    task_env = engine.env
    if spec.probes:  # beside the tasks, with their own policies (`offline.selfcheck`)
        overrides[TASKS_CONFIG_KEY] = json.dumps(
            {**json.loads(overrides[TASKS_CONFIG_KEY]), **spec.probes})
        task_env = {**task_env, **tasks_env([*spec.vectors, *spec.probes])}
        task_env.update(_with_probe_layers(task_env, spec.probe_layers))
    if spec.store is not None:
        if spec.store_root is None:
            raise VectorError("a task store needs its root (store_root)")
        # the engine loads store tasks from here on first use (`engine.steps.STORE`)
        overrides[STORE_CONFIG_KEY] = str(spec.store_root)
        if spec.shift_steps is not None:  # the store tasks' default too
            overrides[DEFAULT_KEY] = spec.shift_steps
    return [*args, "--hf-overrides", json.dumps(merged_overrides(overrides,
                                                                 spec.user.hf_overrides)),
            "--logits-processors", *spec.user.logits_processors,
            step_processor(per_request=True),
            # every task is a served name of the one model; the gate sets a request's task
            # (`vllm_xargs.ltv_task`) from its `model`
            "--served-model-name", *spec.names, *spec.vectors,
            "--middleware", gate("TaskGate")], None, task_env


def _with_probe_layers(task_env: dict[str, str],
                       probes: dict[str, tuple[str, bool]] | None) -> dict[str, str]:
    """The engine's layer-task listing with the layer probes added (nothing without any)."""
    if not probes:
        return {}
    return layer_tasks_env({**layer_tasks(task_env), **probes})


def lora_args(spec: ServerSpec, args: list[str]
              ) -> tuple[list[str], LoraPlan, dict[str, str]]:
    """Named tasks as lm_head LoRA adapters (`lora_plan`)."""
    for name, path in spec.vectors.items():
        if isinstance(spec.check(spec.model_dir, path), LayerTask):
            raise VectorError(f"task {name!r} is a layer task: it acts inside the decoder, "
                              "where no lm_head adapter reaches; serve it without "
                              "--multi-task lora")
    # a task-store server holds its command-line tasks and up to max_tasks store tasks at
    # once (more when the store already holds more): a LoRA slot for each
    room = {"min_rank": spec.lora_min_rank} if spec.store is None else {
        "capacity": len(spec.vectors) + max(spec.max_tasks, len(spec.store)),
        "min_rank": max(store_rank(spec.model_dir), spec.lora_min_rank)}
    plan = plan_lora(spec.model_dir, spec.vectors, lora_dir=spec.lora_dir,
                     rank_cap=spec.lora_rank_cap, store=spec.store, check=spec.check,
                     **room)
    return [*args, "--served-model-name", *spec.names,
            "--logits-processors", *spec.user.logits_processors,
            step_processor(per_request=False, lora=True),
            *plan.server_args(spec.user)], plan, {}


def required_of(args: list[str]) -> dict[str, Any]:
    """What of ltv-vllm's flags (`args`) vLLM must still hold when it starts: every served
    name, override, logits processor, middleware and task adapter, processed logprobs
    (checked by the endpoint plugin: `contract.deploy.required_problem`)."""
    parsed = vllm_flags(args)
    if parsed is None:
        raise ArgumentError("vLLM's parser refuses ltv-vllm's own flags: " + " ".join(args))
    return {"served_model_name": list(parsed.served_model_name or []),
            "hf_overrides": dict(parsed.hf_overrides or {}),
            "logits_processors": [str(p) for p in parsed.logits_processors or []],
            "middleware": list(parsed.middleware or []),
            "lora_modules": [m.name for m in parsed.lora_modules or []],
            "logprobs_mode": parsed.logprobs_mode}
