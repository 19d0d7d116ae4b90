"""`ltv-vllm serve`'s plan: everything checked (model, vectors, architecture, the user's vLLM
flags) and vLLM's server command built before anything is written or started
(`plan_server`); then `ServerPlan.start` writes what the server needs and replaces this
process with it, or `ServerPlan.export` writes it for the user's own `vllm serve`.

Runs in the launcher. The engine recipe is `recipe`, the server's flags `server_args`, the
LoRA plan `lora_plan`, the task store's set-up `store_setup`, the user's vLLM arguments
`flags` (parsed once), and what reaches vLLM's processes one `contract.settings.ServerSettings`
in the environment.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ltv_vllm.core.fileio import check_writable
from ltv_vllm.core.layer_task import LayerTask, load_any
from ltv_vllm.core.vector import TaskVector, VectorError
from ltv_vllm.errors import ArgumentError
from ltv_vllm.models.checkpoint import identity_from_dir
from ltv_vllm.serving.contract.names import MULTI_SERVER_MODULE
from ltv_vllm.serving.contract.plugins import store_plugins
from ltv_vllm.serving.contract.settings import ServerSettings
from ltv_vllm.serving.contract.vllm_support import check_version
from ltv_vllm.serving.contract.wire import chat_env, new_admission
from ltv_vllm.serving.launcher.flags import VllmArgs, chosen
from ltv_vllm.serving.launcher.lora_plan import LoraPlan
from ltv_vllm.serving.launcher.recipe import check_pipeline_parallel, check_shift_steps
from ltv_vllm.serving.launcher.server_args import ServerSpec, required_of, server_args
from ltv_vllm.serving.launcher.store_setup import (
    shared_store,
    shared_url,
    store_entries,
    store_rank,
    upload_limit,
)
from ltv_vllm.serving.store.probes import LORA_PAIRS, served_lora_probes, served_probes

SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"  # one API-server process
# (several, --api-server-count > 1: `contract.names.MULTI_SERVER_MODULE`, `vllm serve`'s code)


def checked_vector(model_dir: str | Path, vector_path: str | Path) -> TaskVector | LayerTask:
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
def _checked_vector(model_dir: str, path: str, stamp: int) -> TaskVector | LayerTask:
    del stamp  # only part of the key
    tv = load_any(path)  # a final-layer vector or a layer task
    tv.check_model(identity_from_dir(model_dir))
    return tv


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
    # the server's own settings: defaults in one place (`contract.settings`)
    max_tasks: int = ServerSettings.max_tasks  # tasks a task-store server can hold at once
    compile_threads: int = ServerSettings.compile_threads  # the engine keeps the other cores
    layer_uploads: bool = False  # the store may hold layer tasks: hooks at start
    max_body_mib: int = ServerSettings.max_body >> 20  # any body but an upload or a compile
    api_keys: str | None = None        # a keys file with roles (`contract.keys`)
    # a task store served with no key at all: refused unless the operator says so
    allow_unauthenticated: bool = False
    key_in_flight: int | None = None   # each key's limits unless it has its own (`tenancy`)
    key_rate: float | None = None
    key_burst: int | None = None
    audit_log: str | None = None       # the task store's operations as JSON lines ("-": stderr)
    task_metrics: bool = ServerSettings.task_metrics  # per-task metrics on /metrics
    # a task's completion requests re-asked with its ICL prompt (`api_server.fidelity`)
    fidelity_sample: float = ServerSettings.fidelity_sample
    selfcheck: bool = True  # probe the engine's row plan at start (`api_server.selfcheck`)

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
        if self.api_keys is not None and (self.vllm.value("--api-key") is not None
                                          or os.environ.get("VLLM_API_KEY")):
            raise ArgumentError("--api-keys with vLLM's --api-key (or VLLM_API_KEY): vLLM "
                                "would refuse every other key; add that key to the file as "
                                "an admin key (ltv-vllm keys add) instead")
        if self.key_limits is not None:
            from ltv_vllm.serving.contract.tenancy import Limits, TenancyError

            try:
                Limits.of(self.key_limits, "--key-in-flight/--key-rate/--key-burst")
            except TenancyError as e:
                raise ArgumentError(str(e).replace("in_flight", "--key-in-flight").replace(
                    "rate", "--key-rate").replace("burst", "--key-burst")) from None
        if self.fidelity_sample:
            self._check_fidelity()
        top = self.vllm.integer("--max-logprobs", default=20)
        if self.selfcheck and 0 <= top < 2:  # -1: the whole vocabulary
            raise ArgumentError(f"--max-logprobs {top}: the start-up self-check reads each "
                                "step's two best log-probabilities; give --max-logprobs 2 or "
                                "more, or --skip-selfcheck")
        if self.layer_uploads and (self.task_store is None or self.lora):
            raise ArgumentError("--layer-uploads lets a task store hold layer tasks, served "
                                "per request: give it with --task-store, without --multi-task "
                                "lora")
        if self.audit_log is not None and self.task_store is None:
            raise ArgumentError("--audit-log records the task store's operations: give it "
                                "with --task-store")
        if self.task_store is not None and self.vllm.api_servers > 1:
            from ltv_vllm.serving.store.shared_store import is_shared, several_api_servers

            if problem := several_api_servers(is_shared(self.task_store), bool(self.lora)):
                raise ArgumentError(problem)
        check_pipeline_parallel(self.vllm.pipeline_parallel)
        if self.multi_task not in (None, *MULTI_TASK_MODES):
            raise ArgumentError(f"--multi-task must be one of {', '.join(MULTI_TASK_MODES)}, "
                                f"got {self.multi_task!r}")
        if self.lora_rank is not None and not self.lora:
            raise ArgumentError("--lora-rank cuts LoRA adapters: give it with --multi-task lora")
        fused = len(self.vectors) == 1 and "=" not in self.vectors[0] and not self.task_store
        check_shift_steps(self.shift_steps, per_request=not self.fold and (fused or not self.lora))

    def _check_fidelity(self) -> None:
        rate = self.fidelity_sample
        if not (isinstance(rate, int | float) and 0 <= rate <= 1):
            raise ArgumentError(f"--fidelity-sample is a share of requests, 0..1; got {rate}")
        if not self.task_metrics:
            raise ArgumentError("--fidelity-sample exports its figures on /metrics: give it "
                                "without --no-task-metrics")
        if self.fold or self.lora:
            raise ArgumentError("--fidelity-sample re-asks a task's requests with and without "
                                "its shift, per request: not with --fold or --multi-task lora")

    @functools.cached_property
    def vllm(self) -> VllmArgs:
        """vLLM's own arguments, parsed once."""
        return VllmArgs(tuple(self.vllm_args))

    @property
    def key_limits(self) -> dict[str, Any] | None:
        """The server's default limits of a key (`contract.tenancy.Limits`), as settings."""
        out = {k: v for k, v in (("in_flight", self.key_in_flight), ("rate", self.key_rate),
                                 ("burst", self.key_burst)) if v is not None}
        return out or None

    @property
    def keyed(self) -> bool:
        """Whether a key of vLLM's own is given (`--api-key`, VLLM_API_KEY)."""
        return self.vllm.value("--api-key") is not None or bool(os.environ.get("VLLM_API_KEY"))

    @property
    def lora(self) -> bool:
        """Named tasks (and a task store's) served as LoRA adapters."""
        return self.multi_task == "lora"


def served_template_digest(model_dir: str | Path, vllm: VllmArgs) -> str | None:
    """sha256 of the chat template the server renders with, read as vLLM reads it: the
    `--chat-template` file, or its value as the template itself, else the tokenizer's own
    (None: no template)."""
    from ltv_vllm.tasks.chat import read_template, template_digest

    value = vllm.value("--chat-template")
    if value is None:
        from ltv_vllm.models.loading import load_tokenizer

        template = getattr(load_tokenizer(str(model_dir)), "chat_template", None)
    else:
        template = read_template(value)
    return template_digest(template) if isinstance(template, str) and template else None


def chat_fitted_vectors(vectors: dict[str, TaskVector]) -> dict[str, str]:
    """name → template sha256 of the chat-fitted vectors among `vectors` ("" for a fused
    server's one)."""
    from ltv_vllm.serving.store.taskstore import chat_template_of

    return {name: digest for name, tv in vectors.items()
            if (digest := chat_template_of(tv)) is not None}


def shortfall_notes(vectors: dict[str, TaskVector]) -> list[str]:
    """A warning per vector whose extraction scored it below zero-shot (`metrics.shortfall`):
    served, it would lower accuracy; the operator hears it before the engine starts."""
    from ltv_vllm.core.metrics import shortfall

    return [f"warning: {name or 'the vector'}: {low}" for name, tv in vectors.items()
            if (low := shortfall(tv.provenance.metrics, tv.provenance.method,
                                 tv.provenance.n_test))]


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
            from ltv_vllm.serving.store.taskstore import TaskStore

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
            from ltv_vllm.serving.store.shared_store import SharedStore, sweep_replicas

            SharedStore(settings.shared_store)
            if not replica:
                return
            sweep_replicas(Path(settings.task_store).parent)
        if root := settings.task_store:
            from ltv_vllm.serving.store.taskstore import TaskStore

            store = TaskStore(root)  # created if new
            store.hold()  # before anything is touched: one server per store
            store.sweep()  # what interrupted writes left, removed
            for name, why in self.quarantine.items():
                store.quarantine(name, why)

    def export(self, directory: Path) -> list[Path]:
        """Write what the server needs (`prepare`) and, instead of starting it, its settings
        for the user's own `vllm serve` (`launcher.deploy`); the files written."""
        import json

        from ltv_vllm.serving.contract.wire import ADMIT_ENV
        from ltv_vllm.serving.launcher import deploy

        settings = ServerSettings.from_env(self.env)
        if settings.task_store and not settings.shared_store:
            raise ArgumentError("--export with --task-store DIR: that store is held by the one "
                                "server that serves it; share a store (s3://… or file://…) "
                                "to export, or start that one with ltv-vllm serve")
        self.prepare(replica=False)
        env = {k: v for k, v in self.env.items() if k != ADMIT_ENV}  # a fresh key per start
        if settings.shared_store:  # each start makes its own copy (`vllm_ext.deploy.apply`)
            settings = replace(settings, task_store=None)
        # no secret is written: vLLM's --api-key is given at each start (VLLM_API_KEY), and
        # keys are read from their file or store there (no hashes copied either)
        flags, keyed = deploy.without_api_key(self.flags)
        if keyed:
            settings = replace(settings, required={**(settings.required or {}), "api_key": True})
        env.update(replace(settings, api_keys=None).to_env())
        every = json.loads(self.env[ADMIT_ENV])["every"] if ADMIT_ENV in self.env else None
        return deploy.export(directory, flags, env, every)

    def start(self, announce: Any = None) -> None:
        """Prepare, then `announce()` (what `serve` prints), then replace this process with
        the server. A store another server holds is refused in `prepare`, before anything is
        announced."""
        import sys

        self.prepare()
        if announce is not None:
            announce()
        os.execve(sys.executable, self.argv, {**os.environ, **self.env})


def plan_server(opts: ServeOptions) -> ServerPlan:
    """Everything checked (model, vectors, architecture) and the vLLM command built; no file
    is written and no engine started (`ServerPlan.start` does both)."""
    import sys

    from ltv_vllm.models.cache import DEFAULT_MODEL
    from ltv_vllm.models.hardware import engine_device
    from ltv_vllm.models.loading import local_model_dir

    # a vLLM the plugin was not checked against, or drafts on a runner that refuses our
    # logits processor beside them: one line, before any model is resolved
    check_version()
    opts.vllm.check_speculative()
    opts.vllm.user  # noqa: B018 - the user's flags read (and refused) before the model
    # a store open to anyone is refused before the model is resolved (or fetched)
    keys = _plan_keys(opts, shared_url(opts.task_store))
    spec = opts.model_spec or DEFAULT_MODEL
    model_dir = local_model_dir(spec)  # a hub id: fetched, or found in the cache offline
    parsed = parse_vector_specs(list(opts.vectors))
    store = _plan_store(opts, model_dir, parsed)
    given = {n: checked_vector(model_dir, p) for n, p in parsed.items()}  # read once
    # layer hooks: a layer task given, or one the store holds or may hold
    layered = any(isinstance(t, LayerTask) for t in given.values()) or store.layers
    probes, lora_probes, notes = _plan_probes(opts, model_dir, layered)
    args, lora, task_env = server_args(_server_spec(opts, model_dir, parsed, store, probes,
                                                    lora_probes))
    extra = list(opts.vllm_args)
    defaults = []
    if engine_device() == "cpu" and not opts.vllm.chose_compilation:
        # vLLM's compile warm-up costs the CPU backend over a minute per start (and per
        # fused/folded variant: their compile caches differ); eager starts in about 46 s
        # (docs/benchmarks.md, "Serve start-up"), and every serving benchmark ran eager.
        # Any compilation flag of the user's wins.
        defaults.append("--enforce-eager")
    elif layered and not opts.vllm.chose_compilation:
        # layer tasks on a GPU: full CUDA graphs would replay steps without their op; piecewise
        # ones split at it (the plugin names it among vLLM's default splitting ops,
        # `engine.layer_shift`; read in vLLM's source, not run on a GPU)
        defaults += ["--compilation-config", json.dumps({"cudagraph_mode": "PIECEWISE"})]
    env = dict(task_env)
    notes += shortfall_notes(given)
    env.update(_plan_chat(opts, model_dir, given, store.entries, notes))
    settings = _plan_settings(opts, model_dir, store, lora, probes, lora_probes, keys)
    if (probes or lora_probes is not None or store.entries is not None or opts.task_metrics
            or opts.fidelity_sample):
        # the endpoint plugin: the self-check at start, the task store's routes, the
        # per-task metrics (counted where it hands requests to the engine)
        env["VLLM_PLUGINS"] = store_plugins()
    # (the CPU backend lets this variable override --kv-cache-memory-bytes: set our default
    # only where the user gave neither)
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ and not opts.vllm.sized_kv_cache:
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"  # GiB; read by the CPU backend only
    if lora is None:
        # the engine shifts only requests its gate admitted (`contract.wire.stamp`): a fused
        # vector shifts every request, so every request needs the stamp; per-request tasks,
        # those that name a task. (LoRA adapters are chosen by `model` alone: the gate's)
        env.update(new_admission(every="" in parsed))
    # what vLLM must have parsed at start (checked by the endpoint plugin: another launcher's
    # command line may have replaced a flag, `contract.deploy.required_problem`)
    settings = replace(settings, required=required_of(args), task_metrics=opts.task_metrics,
                       fidelity_sample=float(opts.fidelity_sample))
    env.update(settings.to_env())
    # ours after the user's: vLLM keeps a flag's last value, and ours hold theirs merged in
    module = MULTI_SERVER_MODULE if opts.vllm.api_servers > 1 else SERVER_MODULE
    return ServerPlan([sys.executable, "-m", module, *defaults, *extra, *args], env,
                      lora, store.quarantine, probes or lora_probes, notes,
                      [*defaults, *extra, *args])


@dataclass(frozen=True)
class _StorePlan:
    """The task store a server plan serves: a shared store's URL (None: the server's own, or
    none), the root this replica serves from, its entries (None: no store) and the entries
    it cannot serve (name → why)."""

    shared: str | None = None
    root: Path | None = None
    entries: dict[str, Path] | None = None
    quarantine: dict[str, str] = field(default_factory=dict)
    layers: bool = False  # it holds, or may be given, layer tasks (`serve --layer-uploads`)


def _plan_store(opts: ServeOptions, model_dir: Path, parsed: dict[str, Path]) -> _StorePlan:
    from ltv_vllm.serving.store.shared_store import replica_root

    if opts.task_store is None:
        return _StorePlan()
    # a replica serves at most --max-tasks of a shared store's tasks (the oldest: the index's
    # order), however many its index holds: its LoRA slots are sized by the flag alone
    shared, _ = shared_store(opts.task_store)
    if shared is not None:
        # a shared store: this replica serves a copy of its own, made at start
        return _StorePlan(shared, replica_root(shared), {}, {}, opts.layer_uploads)
    entries, quarantine, held = store_entries(opts.task_store, model_dir, parsed, opts.lora)
    return _StorePlan(None, Path(opts.task_store).absolute(), entries, quarantine,
                      opts.layer_uploads or held)


def _plan_keys(opts: ServeOptions, shared: str | None
               ) -> tuple[list[dict[str, Any]] | None, str | None, str | None]:
    """The keys a server accepts beside vLLM's own `--api-key`: (their entries, hashes only;
    the keys file; the shared store they live in). A shared store that holds keys is served
    with them (every replica follows one source); a task store with no key at all is refused
    unless the operator says --allow-unauthenticated."""
    from ltv_vllm.serving.contract.keys import read_keys

    if shared is not None:
        from ltv_vllm.serving.store.shared_keys import StoreKeys

        source = StoreKeys(shared)
        if source.exists():
            if opts.api_keys is not None or opts.keyed:
                raise ArgumentError(f"task store {shared} holds the API keys every "
                                    "replica follows: drop --api-keys and --api-key here "
                                    "(change them with `ltv-vllm keys ... --store`)")
            return source.read(), None, shared
    if opts.api_keys is not None:
        return read_keys(opts.api_keys), str(Path(opts.api_keys).absolute()), None
    if opts.task_store is not None and not opts.keyed and not opts.allow_unauthenticated:
        raise ArgumentError("a task store served without an API key lets anyone who reaches "
                            "the port add, replace and delete its tasks: give --api-keys FILE "
                            "(ltv-vllm keys add), keys in the shared store (ltv-vllm keys add "
                            "--store), or --api-key; or say --allow-unauthenticated")
    return None, None, None


def _plan_probes(opts: ServeOptions, model_dir: Path,
                 layered: bool = False) -> tuple[Any, Any, list[str]]:
    """The start-up self-check's probes (tasks, or LoRA adapters; with `layered`, where the
    server serves layer tasks, the layer probes too) and a note where some cannot run."""
    from ltv_vllm.models.hardware import resolve_for_model
    from ltv_vllm.serving.store.lora import lora_rank as padded_rank

    # the probe tasks, held by the engine beside the real ones: where the row plan decides
    # what a row gets (a folded head and LoRA adapters do not use it)
    layer_dtype = None
    notes: list[str] = []
    if layered and opts.selfcheck and not opts.fold and not opts.lora:
        layer_dtype = resolve_for_model(chosen("--dtype", opts.dtype, ServeOptions.dtype,
                                               opts.vllm.user.dtype), model_dir)
        if layer_dtype == "float16":  # its range cannot hold a layer probe's bias
            notes.append("warning: the start-up self-check checks the layer tasks' rows with "
                         "bfloat16 or float32 engines only; this float16 one runs the "
                         "final-layer probes alone")
            layer_dtype = None
    probes = (served_probes(model_dir, layer_dtype)
              if opts.selfcheck and not opts.fold and not opts.lora else None)
    # in LoRA mode the probes are adapters (rank 4), sent by the endpoint plugin at start;
    # not where --lora-rank 1 keeps every adapter at rank 1 (the check would raise vLLM's
    # LoRA rank, and its cost, to 8 for every request)
    lora_probes = (served_lora_probes(model_dir) if opts.selfcheck and opts.lora and (
        opts.lora_rank is None or padded_rank(opts.lora_rank) >= LORA_PAIRS) else None)
    notes += ([] if lora_probes is not None or not (opts.selfcheck and opts.lora) else [
        f"warning: no start-up self-check at --lora-rank {opts.lora_rank} (its probe "
        f"adapters need rank {LORA_PAIRS}); `ltv-vllm selfcheck --multi-task lora` runs it"])
    return probes, lora_probes, notes


def _server_spec(opts: ServeOptions, model_dir: Path, parsed: dict[str, Path],
                 store: _StorePlan, probes: Any, lora_probes: Any) -> ServerSpec:
    """The server `server_args` lays out: the options, the user's flags winning where they
    gave one (`flags.chosen`)."""
    import hashlib

    from ltv_vllm.models.cache import DEFAULT_MODEL, cache_dir
    from ltv_vllm.serving.store.lora import lora_rank as padded_rank

    user = opts.vllm.user
    # the adapters' directory: named by the vectors' files and the rank cut
    digest = hashlib.sha256((f"r{opts.lora_rank}:" + "".join(
        f"{n}={p.resolve()}:{p.stat().st_mtime_ns}"
        for n, p in sorted({**parsed, **(store.entries or {})}.items())
        if p.exists())).encode()).hexdigest()[:12]
    return ServerSpec(
        model_dir, parsed, lora_dir=cache_dir() / "adapters" / digest,
        served_name=opts.model_spec or DEFAULT_MODEL,
        host=chosen("--host", opts.host, ServeOptions.host, user.host),
        port=chosen("--port", opts.port, ServeOptions.port, user.port),
        dtype=chosen("--dtype", opts.dtype, ServeOptions.dtype, user.dtype),
        max_model_len=chosen("--max-model-len", opts.max_model_len, None, user.max_model_len),
        user=user, fold=opts.fold, shift_steps=opts.shift_steps, lora_rank_cap=opts.lora_rank,
        store=store.entries, max_tasks=opts.max_tasks, lora=opts.lora, store_root=store.root,
        probes=probes.config if probes is not None else None,
        probe_layers=probes.layer_tasks() if probes is not None else None,
        lora_min_rank=padded_rank(LORA_PAIRS) if lora_probes is not None else 1,
        check=checked_vector)  # each file read once in the plan


def _plan_chat(opts: ServeOptions, model_dir: Path, given: dict[str, TaskVector],
               store: dict[str, Path] | None, notes: list[str]) -> dict[str, str]:
    """What the gate needs of chat-fitted vectors (`contract.wire.chat_env`); a note (in
    `notes`) for each fitted through another template than the server renders with."""
    from ltv_vllm.serving.store.taskstore import VECTOR

    fitted = chat_fitted_vectors(given)  # the gate shifts their chat requests (`tasks.chat`)
    if not fitted and opts.task_store is None:
        return {}
    # a task store's chat-fitted entries: the gate learns them from the store; warned here
    kept = chat_fitted_vectors({n: load_any(p / VECTOR)
                                for n, p in (store or {}).items()})
    served = served_template_digest(model_dir, opts.vllm)
    notes += [f"warning: {name or 'the vector'} was fitted through another chat template "
              f"(sha256 {digest[:12]}) than this server renders with "
              f"({(served or 'none')[:12]}): its chat requests will be refused unless "
              "they opt in (ltv_chat: allow)"
              for name, digest in {**fitted, **kept}.items() if digest != served]
    return chat_env(fitted, served)


def _plan_settings(opts: ServeOptions, model_dir: Path, store: _StorePlan,
                   lora: LoraPlan | None, probes: Any, lora_probes: Any,
                   keyring: tuple[Any, str | None, str | None]) -> ServerSettings:
    """The server's settings (`contract.settings`), but what vLLM must have parsed;
    `keyring`: `_plan_keys`'."""
    settings = ServerSettings(max_body=opts.max_body_mib << 20, key_limits=opts.key_limits)
    keys, keys_file, keys_store = keyring
    settings = replace(settings, api_keys=keys, api_keys_file=keys_file, keys_store=keys_store)
    if opts.audit_log not in (None, "-"):
        audit = check_writable(opts.audit_log, option="--audit-log")
        settings = replace(settings, audit_log=str(audit.absolute()))
    elif opts.audit_log == "-":
        settings = replace(settings, audit_log="-")
    if probes:  # the engine holds the probes; the endpoint plugin checks them at start
        settings = replace(settings, selfcheck=True, selfcheck_layer=probes.layer)
    if lora_probes is not None:
        settings = replace(settings, selfcheck_lora=lora_probes.adapters)
    if store.entries is not None:
        settings = replace(settings, task_store=str(store.root), shared_store=store.shared,
                           store_poll=opts.store_poll, max_tasks=opts.max_tasks,
                           task_rank=lora.max_rank if lora else store_rank(model_dir),
                           store_lora=lora is not None,
                           store_layers=store.layers,
                           compile_threads=opts.compile_threads,
                           max_upload=upload_limit(model_dir))
    return settings
