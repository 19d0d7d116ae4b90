"""The engine recipe: what `vllm.LLM` / vLLM's server need to run the stock model class's LTV
wrapper with task vectors, each vector checked against the model first (one line, before
any engine process starts).

Runs in the launcher (`ltv-vllm serve`'s plan) and in offline jobs (`offline.llm`,
`offline.capture`, `offline.selfcheck`), never inside vLLM. `engine_kwargs(model_dir,
vector_path)` fuses one vector: the wrapper is selected with `hf_overrides={"architectures":
[...]}` and finds its vector through the config key `ltv_task_vector`; `task_engine` lays
out a per-request multi-task engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltv_vllm.core.layer_task import LayerTask, load_any
from ltv_vllm.core.vector import TaskVector, VectorError
from ltv_vllm.errors import ArgumentError
from ltv_vllm.models.checkpoint import identity_from_dir
from ltv_vllm.serving.contract.names import CONFIG_KEY, FOLD_KEY, WRAPPERS, processor
from ltv_vllm.serving.contract.wire import DEFAULT_KEY, TASKS_CONFIG_KEY, parse_steps, tasks_env


def checked_vector(model_dir: str | Path, vector_path: str | Path) -> TaskVector | LayerTask:
    """A vector (or a layer task) loaded and checked against the model directory (sizes,
    depth and LM-head fingerprint). The launcher's plan passes its own
    (`serve.checked_vector`, `check`), which reads each file once however many steps ask."""
    tv = load_any(vector_path)
    tv.check_model(identity_from_dir(model_dir))
    return tv


def layer_env(tasks: dict[str, TaskVector | LayerTask],
              defaults: dict[str, str | None]) -> dict[str, str]:
    """The environment an engine with layer tasks needs in the process that starts it
    (`engine.prefix_keys`): each layer task's key, default positions and whether it is
    additive; nothing for an engine without one (an in-process caller clears a previous
    engine's entry: `offline.llm`)."""
    from ltv_vllm.serving.contract.wire import layer_tasks_env

    layers = {key: (defaults.get(key) or str(tv.policy), tv.additive)
              for key, tv in tasks.items() if isinstance(tv, LayerTask)}
    return layer_tasks_env(layers) if layers else {}


Check = Callable[[str | Path, str | Path], TaskVector]  # `checked_vector`'s shape


def base_architecture(model_dir: str | Path) -> str:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if not archs:
        raise VectorError(f"{model_dir}: config.json names no architecture")
    return str(archs[0])



def wrapper_architecture(model_dir: str | Path) -> str:
    """Our LTV subclass of the model directory's stock vLLM architecture."""

    arch = base_architecture(model_dir)
    if arch not in WRAPPERS:
        raise VectorError(f"{model_dir}: architecture {arch} has no LTV wrapper "
                          f"(supported: {', '.join(sorted(WRAPPERS))})")
    return WRAPPERS[arch]


def fused_overrides(
    model_dir: str | Path, vector_path: str | Path, fold: bool, shift_steps: str | None = None,
    check: Check = checked_vector,
) -> tuple[dict[str, Any], TaskVector]:
    vector_path = Path(vector_path).resolve()
    if vector_path.suffix == ".safetensors" and vector_path.parent == Path(model_dir).resolve():
        raise VectorError(
            f"{vector_path.name} is inside the model directory, where vLLM would load it as a "
            "weight shard; keep task vectors elsewhere"
        )
    tv = check(model_dir, vector_path)
    if fold and isinstance(tv, LayerTask):
        raise VectorError(f"{vector_path.name}: a layer task acts inside the decoder, so it "
                          "cannot be folded into the LM head; serve it without --fold")
    if fold:
        tv.require_linear("folded into the LM head")
    if fold and (tv.kind != "hidden" or tv.bias is not None):
        # the wrapper refuses it too, but only inside the engine process, after start-up
        raise VectorError(f"{vector_path.name}: only a hidden-space vector without a bias can be "
                          "folded into the LM head; serve it without --fold")
    overrides: dict[str, Any] = {
        "architectures": [wrapper_architecture(model_dir)],
        CONFIG_KEY: str(vector_path),
    }
    if fold:
        overrides[FOLD_KEY] = True
    if shift_steps is None and not fold:
        shift_steps = vector_steps(tv, vector_path)
    if shift_steps not in (None, "all"):  # the policy of requests that name none (`steps`)
        overrides[DEFAULT_KEY] = shift_steps
    return overrides, tv


def vector_steps(tv: TaskVector | LayerTask, path: Path) -> str:
    """The step policy a vector recommends (`meta.shift_steps`; older vectors: all), a
    layer task's its positions."""
    if isinstance(tv, LayerTask):
        return str(tv.policy)
    steps = tv.provenance.shift_steps or "all"
    try:
        parse_steps(steps)
    except ValueError:
        raise VectorError(f"{path.name}: meta.shift_steps {steps!r} is not a step policy "
                          "(all, first or a count)") from None
    return str(steps)


def engine_kwargs(
    model_dir: str | Path, vector_path: str | Path, *, fold: bool = False,
    shift_steps: str | None = None,
) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` / `EngineArgs` serving `model_dir` with the vector
    fused (or, with `fold`, folded into the LM-head weight at load); `shift_steps`: the step
    policy of requests that name none (None: the vector's `meta.shift_steps`, else all)."""
    check_shift_steps(shift_steps, per_request=not fold)
    overrides, _ = fused_overrides(model_dir, vector_path, fold, shift_steps)
    return {"model": str(model_dir), "hf_overrides": overrides,
            "logits_processors": [step_processor(per_request=not fold)]}


def fused_env(overrides: dict[str, Any], tv: TaskVector | LayerTask | None = None
              ) -> dict[str, str]:
    """`layer_env` of a fused engine's `hf_overrides`; `tv`: its vector already read (else
    its one file is read again: a header and a few tensors)."""
    from ltv_vllm.serving.contract.wire import DEFAULT_KEY as default_key

    path = overrides.get(CONFIG_KEY)
    if tv is None and path:
        tv = load_any(path)
    return layer_env({"": tv} if tv is not None else {}, {"": overrides.get(default_key)})


@dataclass(frozen=True)
class TaskEngine:
    """Multi-task serving with per-request tasks: every vector held by the engine, each
    request shifted by its own task's vector on its own rows (`engine.steps`).

    `kwargs` are for `vllm.LLM` / EngineArgs; `env` must be in the environment of the process
    that admits requests (the `vllm.LLM` caller, the API server) before the engine starts: it
    names the tasks a request may choose (`wire.tasks_env`). A request chooses its
    task with `SamplingParams(extra_args={"ltv_task": NAME})`; through `ltv-vllm serve` the
    OpenAI `model` name does it."""

    vectors: dict[str, TaskVector | LayerTask]  # task name → vector, checked against the model
    overrides: dict[str, Any]      # hf_overrides
    model_dir: Path

    @property
    def env(self) -> dict[str, str]:
        steps = {name: spec.get("steps")
                 for name, spec in json.loads(self.overrides[TASKS_CONFIG_KEY]).items()}
        return {**tasks_env(list(self.vectors)), **layer_env(self.vectors, steps)}

    @property
    def kwargs(self) -> dict[str, Any]:
        return {"model": str(self.model_dir), "hf_overrides": self.overrides,
                "logits_processors": [step_processor(per_request=True)]}


def task_engine(model_dir: str | Path, vectors: dict[str, Path], *,
                shift_steps: str | None = None, check: Check = checked_vector) -> TaskEngine:
    """Check every vector against the model and lay out a per-request multi-task engine;
    `shift_steps`: every task's policy for requests that name none (None: each vector's
    `meta.shift_steps`)."""
    check_shift_steps(shift_steps, per_request=True)
    model_dir = Path(model_dir)
    arch = wrapper_architecture(model_dir)
    tasks, checked = {}, {}
    for name, path in vectors.items():
        if not name:
            raise VectorError("multi-task serving names every vector (NAME=PATH)")
        path = Path(path).resolve()
        checked[name] = tv = check(model_dir, path)
        tasks[name] = {"path": str(path), "steps": shift_steps or vector_steps(tv, path)}
    overrides = {"architectures": [arch], TASKS_CONFIG_KEY: json.dumps(tasks)}
    return TaskEngine(checked, overrides, model_dir)


def check_shift_steps(shift_steps: str | None, *, per_request: bool) -> None:
    """`--shift-steps`: a policy the server can apply (per-request shifts: not folded, not
    LoRA); None (not given) leaves it to the vector files."""
    if shift_steps is None:
        return
    try:
        parse_steps(shift_steps)
    except ValueError:
        raise ArgumentError(f"--shift-steps must be all, first or a count ≥ 0, got "
                            f"{shift_steps!r}") from None
    if shift_steps != "all" and not per_request:
        raise ArgumentError("--shift-steps needs per-request shifts: not --fold, not "
                            "--multi-task lora (a folded head and LoRA adapters shift every "
                            "token)")


def step_processor(per_request: bool, lora: bool = False) -> str:
    """The per-request step policy's logits processor (`engine.steps`), by name: the engine
    process imports it (this one need not import vLLM). `lora`: LoRA multi-task serving,
    whose processor also refuses prompt logprobs (`LTVLoraRefused`)."""
    return processor("LTVStepPolicy" if per_request else "LTVLoraRefused" if lora
                     else "LTVStepsRefused")


def check_pipeline_parallel(pp: int, cuda: bool | None = None) -> None:
    """Refuse pipeline parallelism on vLLM's CPU backend, where 0.32 cannot run it: a later
    stage's buffer for the activations it receives is never allocated (AssertionError in
    `sync_and_gather_intermediate_tensors` on the first step), for a bare model as for ours.
    On GPUs only the last stage holds the LM head; the wrappers fold and shift only there."""
    import torch

    if pp > 1 and not (torch.cuda.is_available() if cuda is None else cuda):
        raise ArgumentError(f"pipeline parallelism ({pp} stages) does not run on vLLM's CPU "
                            "backend (0.32 fails its first step); use --tensor-parallel-size")
