"""What ltv-vllm's code in vLLM's processes needs to know, in one frozen object. Pure; read
in every process `ltv-vllm serve` (or an export) starts.

`ltv-vllm serve` decides these settings and starts vLLM's server with them; the gate and the
task-store endpoints read them in the API-server process, the engine's workers the task
store's root (`store.vectors.store_root`). vLLM builds our classes from dotted names in its
own processes, so the environment is the only way in: one variable holding the object as
JSON, written once by the launcher (`launcher.serve`). Every default is written here
once (the CLI's flags show them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

ENV = "LTV_VLLM_SERVER"


@dataclass(frozen=True)
class ServerSettings:
    task_store: str | None = None  # absolute path of the task store; None: no store routes
    # a store many replicas share (`shared_store`): its URL or directory; `task_store` is then
    # this replica's own working copy of it, followed every `store_poll` seconds
    shared_store: str | None = None
    store_poll: float = 2.0
    max_tasks: int = 8             # store entries + compiles under way (`serve --max-tasks`)
    task_rank: int = 256           # the rank store tasks are stored (and served) at
    store_lora: bool = False       # store tasks served as LoRA adapters (else per request)
    store_layers: bool = False     # the store may hold layer tasks: the engine hooks its blocks
    compile_threads: int = 1       # a compile worker's torch threads
    max_body: int = 64 << 20       # bytes of any request body but an upload or a compile
    max_upload: int = 1 << 30      # bytes of a task-vector upload (serve computes the real one)
    selfcheck: bool = False        # the engine holds the probe tasks: check them at start
    selfcheck_lora: dict[str, str] | None = None  # LoRA mode: the probe adapters to check
    # the layer probes the engine holds too: served name → `probes.Signature.record()`
    selfcheck_layer: dict[str, list[float]] | None = None
    required: dict[str, Any] | None = None  # what vLLM must have parsed (`deploy`)
    api_keys: list[dict[str, str]] | None = None  # keys with roles (`keys`): hashes only
    api_keys_file: str | None = None  # ...and their file, read again when it changes
    keys_store: str | None = None  # ...or the shared store whose keys they are (`shared_keys`)
    key_limits: dict[str, Any] | None = None  # a key's limits unless it has its own (`tenancy`)
    audit_log: str | None = None   # store operations as JSON lines: a file ("-": stderr)
    task_metrics: bool = True      # per-task metrics on /metrics (`api_server.metrics`)
    # the share of a task's answered completion requests re-asked with its ICL prompt
    # (`api_server.fidelity`); 0: none
    fidelity_sample: float = 0.0

    def to_env(self) -> dict[str, str]:
        return {ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerSettings:
        """The settings `serve` gave this process (defaults when it was not started by it)."""
        raw = (os.environ if environ is None else environ).get(ENV)
        if not raw:
            return cls()
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})
