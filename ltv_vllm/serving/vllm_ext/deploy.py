"""Runs in every vLLM process at plugin load (`vllm_ext.register`): a server started from an
`--export` directory (`LTV_VLLM_DEPLOY=DIR vllm serve --config DIR/vllm.yaml`) gets
ltv-vllm's environment before vLLM parses its arguments and starts its engine processes
(which inherit it). `launcher.deploy` writes the directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping
from pathlib import Path

from ltv_vllm.serving.contract.deploy import (  # noqa: F401 - DeployError re-exported
    APPLIED_ENV,
    DEPLOY_ENV,
    ENVIRONMENT,
    DeployError,
)


def apply(environ: MutableMapping[str, str] | None = None) -> bool:
    """In a vLLM process started with LTV_VLLM_DEPLOY: the exported environment put in place
    (ltv-vllm's own variables as written; others, such as VLLM_CPU_KVCACHE_SPACE, only where
    the user set none), the plugin allowlist joined with the user's (`plugins.store_plugins`),
    and a fresh admission key unless an ancestor process made one. Whether it applied."""
    from ltv_vllm.serving.contract.plugins import store_plugins
    from ltv_vllm.serving.contract.wire import ADMIT_ENV, new_admission

    environ = os.environ if environ is None else environ
    root = environ.get(DEPLOY_ENV)
    if not root or environ.get(APPLIED_ENV) == root:
        return False
    path = Path(root) / ENVIRONMENT
    try:
        saved = json.loads(path.read_text())
        env, every = dict(saved["env"]), saved["admit_every"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DeployError(f"{DEPLOY_ENV}={root}: cannot read {path} ({e}); write it with "
                          "`ltv-vllm serve ... --export DIR`") from None
    env.pop("VLLM_PLUGINS", None)  # the allowlist is this machine's: made here
    for key, value in env.items():
        if key.startswith("LTV_VLLM_") or key not in environ:
            environ[key] = value
    environ["VLLM_PLUGINS"] = store_plugins(environ)
    if every is not None and ADMIT_ENV not in environ:
        environ.update(new_admission(every=bool(every)))
    _own_copy(environ)
    environ[APPLIED_ENV] = root
    return True


_HELD: list[int] = []  # this process's lock on its copy of a shared store (held for its life)


def _own_copy(environ: MutableMapping[str, str]) -> None:
    """A shared task store's replica: its own copy of the store, made at this start (every
    replica started from one export gets one; the engine reads its tasks from there)."""
    from dataclasses import replace

    from ltv_vllm.serving.contract.settings import ServerSettings
    from ltv_vllm.serving.store.shared_store import own_copy

    settings = ServerSettings.from_env(environ)
    if not settings.shared_store or settings.task_store:
        return
    root, fd = own_copy(settings.shared_store)
    _HELD.append(fd)
    environ.update(replace(settings, task_store=str(root)).to_env())
