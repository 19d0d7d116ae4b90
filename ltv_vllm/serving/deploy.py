"""Your own launcher: `vllm serve` (a container image's command, a Kubernetes manifest) with
ltv-vllm's settings, instead of `ltv-vllm serve`.

`ltv-vllm serve ... --export DIR` checks and prepares everything `serve` would (vectors
against the model, probe files, LoRA adapters) and writes, instead of starting a server,

    DIR/vllm.yaml          the vLLM flags ltv-vllm sets, in vLLM's own `--config` format
    DIR/environment.json   the environment the server's processes need

Then `LTV_VLLM_DEPLOY=DIR vllm serve --config DIR/vllm.yaml [your flags]` serves the same:
vLLM loads our general plugin (`vllm_ext.register`) in its API-server process before it
parses its arguments, and `apply` there puts the environment in place (the engine processes,
started later, inherit it), with a fresh admission key per start (`step_policy`). At start the
endpoint plugin checks that vLLM parsed what ltv-vllm needs (`required_problem`): a flag of
yours given on the command line wins over the config file in vLLM, so one that replaced
ltv-vllm's (served names, the gate, the logits processor, the overrides) stops the server
with one line rather than serving unshifted answers under a task's name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from ltv_vllm.errors import UserError

DEPLOY_ENV = "LTV_VLLM_DEPLOY"  # the directory `--export` wrote
CONFIG = "vllm.yaml"
ENVIRONMENT = "environment.json"
_APPLIED = "LTV_VLLM_DEPLOY_APPLIED"  # set once the environment is in place (this process tree)


class DeployError(UserError):
    """An export that cannot be written or read back."""


def flags_to_config(argv: Sequence[str]) -> dict[str, Any]:
    """vLLM flags (`--flag [value ...]`, long names) as its `--config` YAML mapping: no
    value → true, one → the value, several → a list (as vLLM's `load_config_file` reads
    them back); a flag given twice keeps its last value, as vLLM's parser does."""
    out: dict[str, Any] = {}
    key: str | None = None
    for token in argv:
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            out.pop(name, None)  # the last value wins (and keeps its place last)
            out[name] = value if eq else True
            key = None if eq else name
        elif token.startswith("-") and key is None:
            raise DeployError(f"{token}: give vLLM's long flag names with --export (a config "
                              "file holds those only)")
        elif key is None:
            raise DeployError(f"{token!r}: not a --flag's value")
        elif out[key] is True:
            out[key] = token
        else:
            out[key] = [*(out[key] if isinstance(out[key], list) else [out[key]]), token]
    return out


def export(directory: Path, flags: Sequence[str], env: Mapping[str, str],
           admit_every: bool | None) -> list[Path]:
    """Write `vllm.yaml` and `environment.json` into `directory` (created); the paths.
    `admit_every`: the admission the engine enforces (None: none, LoRA mode), its key made
    fresh at each start (never written)."""
    import yaml

    directory.mkdir(parents=True, exist_ok=True)
    config = directory / CONFIG
    config.write_text("# written by `ltv-vllm serve --export`; run it with:\n"
                      f"#   {DEPLOY_ENV}={directory} vllm serve --config {config}\n"
                      + yaml.safe_dump(flags_to_config(flags), sort_keys=False, width=1 << 20))
    environment = directory / ENVIRONMENT
    environment.write_text(json.dumps({"env": dict(env), "admit_every": admit_every},
                                      indent=1) + "\n")
    return [config, environment]


def apply(environ: MutableMapping[str, str] | None = None) -> bool:
    """In a vLLM process started with LTV_VLLM_DEPLOY: the exported environment put in place
    (ltv-vllm's own variables as written; others, such as VLLM_CPU_KVCACHE_SPACE, only where
    the user set none), the plugin allowlist joined with the user's (`plugins.store_plugins`),
    and a fresh admission key unless an ancestor process made one. Whether it applied."""
    from ltv_vllm.serving.plugins import store_plugins
    from ltv_vllm.serving.step_policy import ADMIT_ENV, new_admission

    environ = os.environ if environ is None else environ
    root = environ.get(DEPLOY_ENV)
    if not root or environ.get(_APPLIED) == root:
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
    environ[_APPLIED] = root
    return True


_HELD: list[int] = []  # this process's lock on its copy of a shared store (held for its life)


def _own_copy(environ: MutableMapping[str, str]) -> None:
    """A shared task store's replica: its own copy of the store, made at this start (every
    replica started from one export gets one; the engine reads its tasks from there)."""
    from dataclasses import replace

    from ltv_vllm.serving.settings import ServerSettings
    from ltv_vllm.serving.shared_store import own_copy

    settings = ServerSettings.from_env(environ)
    if not settings.shared_store or settings.task_store:
        return
    root, fd = own_copy(settings.shared_store)
    _HELD.append(fd)
    environ.update(replace(settings, task_store=str(root)).to_env())


def required_problem(args: Any, required: Mapping[str, Any]) -> str | None:
    """What vLLM parsed (`args`) against what ltv-vllm needs of it (`settings.required`),
    as one line, or None: every task among the served names, ltv-vllm's overrides, logits
    processor, gate and LoRA adapters present, processed logprobs."""
    names = set(getattr(args, "served_model_name", None) or [getattr(args, "model", "")])
    if missing := [n for n in required.get("served_model_name", []) if n not in names]:
        return (f"served model names {sorted(names)} lack {missing[0]!r}: a --served-model-name "
                "given on the command line replaced ltv-vllm's (give yours to `ltv-vllm serve "
                "... --export` instead, which keeps both)")
    overrides = getattr(args, "hf_overrides", None) or {}
    for key, value in (required.get("hf_overrides") or {}).items():
        if overrides.get(key) != value:
            return (f"--hf-overrides lacks ltv-vllm's {key!r}: an --hf-overrides given on the "
                    "command line replaced ltv-vllm's")
    for flag, attr in (("--logits-processors", "logits_processors"),
                       ("--middleware", "middleware")):
        have = [str(x) for x in getattr(args, attr, None) or []]
        if missing := [x for x in required.get(attr, []) if x not in have]:
            return (f"{flag} lacks ltv-vllm's {missing[0]}: one given on the command line "
                    "replaced it")
    have = {m.name for m in getattr(args, "lora_modules", None) or []}
    if missing := [n for n in required.get("lora_modules", []) if n not in have]:
        return (f"--lora-modules lacks task {missing[0]!r}: one given on the command line "
                "replaced it")
    if (want := required.get("logprobs_mode")) and getattr(args, "logprobs_mode", None) != want:
        return f"--logprobs-mode must be {want} (classification reads it)"
    return None
