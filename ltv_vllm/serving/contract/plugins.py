"""Which of vLLM's plugins load in a server's processes (`VLLM_PLUGINS`).

vLLM loads general, stat-logger and other plugins unless `VLLM_PLUGINS` lists others, and an
endpoint plugin (ours: the task store's routes and the start-up self-check) only when it is
named: one variable is the allowlist of every group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

STORE_PLUGIN = "ltv_tasks"  # our vllm.endpoint_plugins entry: the /v1/ltv/tasks routes
ENDPOINT_GROUP = "vllm.endpoint_plugins"  # vLLM loads these only when VLLM_PLUGINS names them
# plugins that act only when VLLM_PLUGINS names them: vLLM's Hugging Face hub LoRA resolver
# downloads adapters only if named ("because it allows remote downloads"): never named for
# the user
NAMED_IS_CONSENT = ("lora_hf_hub_resolver",)


def store_plugins(environ: Mapping[str, str] | None = None,
                  installed: Mapping[str, list[str]] | None = None) -> str:
    """vLLM's `VLLM_PLUGINS` for a server with our endpoint plugin (task store, self-check).

    vLLM loads an endpoint plugin only when `VLLM_PLUGINS` names it, and one variable is the
    allowlist of every plugin group: naming ours alone would turn every other installed
    plugin off. So a user's list gets ours added; unset, it becomes every plugin vLLM would
    load unset — each installed in a `vllm.*` group but the endpoint one's — plus ours (other
    endpoint plugins stay off, as unset), but for plugins that read being named as the
    user's consent (`NAMED_IS_CONSENT`: unset, they load and stay off, as unnamed). `installed`:
    group → plugin names (default: this environment's entry points)."""
    environ = os.environ if environ is None else environ
    if installed is None:
        from importlib.metadata import entry_points

        eps = entry_points()
        installed = {g: [ep.name for ep in eps.select(group=g)] for g in eps.groups
                     if g.startswith("vllm.")}
    if environ.get("VLLM_PLUGINS") is not None:
        allow = [p for p in environ["VLLM_PLUGINS"].split(",") if p]
    else:
        allow = [name for group, names in sorted(installed.items())
                 if group != ENDPOINT_GROUP for name in names if name not in NAMED_IS_CONSENT]
    allow += [p for p in ("ltv_vllm", STORE_PLUGIN) if p not in allow]
    return ",".join(dict.fromkeys(allow))
