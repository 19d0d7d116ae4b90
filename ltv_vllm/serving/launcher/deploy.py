"""Runs in the launcher (`ltv-vllm serve --export`). Your own launcher: `vllm serve` (a
container image's command, a Kubernetes manifest) with ltv-vllm's settings, instead of
`ltv-vllm serve`.

`ltv-vllm serve ... --export DIR` checks and prepares everything `serve` would (vectors
against the model, probe files, LoRA adapters) and writes, instead of starting a server,

    DIR/vllm.yaml          the vLLM flags ltv-vllm sets, in vLLM's own `--config` format
    DIR/environment.json   the environment the server's processes need

Then `LTV_VLLM_DEPLOY=DIR vllm serve --config DIR/vllm.yaml [your flags]` serves the same:
vLLM loads our general plugin (`vllm_ext.register`) in its API-server process before it
parses its arguments, and `apply` there puts the environment in place (the engine processes,
started later, inherit it), with a fresh admission key per start (`contract.wire`). At start the
endpoint plugin checks that vLLM parsed what ltv-vllm needs (`required_problem`): a flag of
yours given on the command line wins over the config file in vLLM, so one that replaced
ltv-vllm's (served names, the gate, the logits processor, the overrides) stops the server
with one line rather than serving unshifted answers under a task's name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ltv_vllm.serving.contract.deploy import CONFIG, DEPLOY_ENV, ENVIRONMENT, DeployError  # noqa: F401


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


def without_api_key(flags: Sequence[str]) -> tuple[list[str], bool]:
    """`flags` without vLLM's `--api-key` and its values (an export holds no secret: the
    key is given at each start, as VLLM_API_KEY), and whether one was there."""
    out: list[str] = []
    dropping = keyed = False
    for token in flags:
        if token == "--api-key" or token.startswith("--api-key="):
            dropping = token == "--api-key"
            keyed = True
            continue
        if dropping and not token.startswith("--"):
            continue
        dropping = False
        out.append(token)
    return out, keyed


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
