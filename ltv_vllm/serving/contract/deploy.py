"""What an `--export` directory holds and what vLLM must have parsed for ltv-vllm to serve.
Pure: read by the launcher (`launcher.deploy`, which writes the export), by every vLLM
process at plugin load (`vllm_ext.deploy`, which puts the environment in place), and by the
API server at start (`required_problem`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ltv_vllm.errors import UserError

DEPLOY_ENV = "LTV_VLLM_DEPLOY"  # the directory `--export` wrote
CONFIG = "vllm.yaml"
ENVIRONMENT = "environment.json"
APPLIED_ENV = "LTV_VLLM_DEPLOY_APPLIED"  # set once the environment is in place (this process tree)


class DeployError(UserError):
    """An export that cannot be written or read back."""


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
    if required.get("api_key") and not (getattr(args, "api_key", None)
                                        or os.environ.get("VLLM_API_KEY")):
        return ("this export was made with --api-key, which it does not hold: give the key "
                "at start (VLLM_API_KEY=KEY in the environment, or --api-key KEY)")
    if (want := required.get("logprobs_mode")) and getattr(args, "logprobs_mode", None) != want:
        return f"--logprobs-mode must be {want} (classification reads it)"
    return None
