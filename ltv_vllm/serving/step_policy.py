"""A step policy — which generated tokens a task vector shifts — as requests and `serve`
spell it. Pure (no vLLM import): the CLI checks `--shift-steps` with it before any engine
starts; the engine side is `vllm_ext.steps`."""

from __future__ import annotations

from typing import Any

STEPS_KEY = "ltv_steps"            # a request's `vllm_xargs` key
DEFAULT_KEY = "ltv_shift_steps"    # the server's default, carried in `hf_overrides`
ALL = None                         # the policy "every step"


def parse_steps(value: Any) -> int | None:
    """`all` | `first` | n ≥ 0 → the number of leading generated tokens shifted (None: all)."""
    if value == "all":
        return ALL
    if value == "first":
        return 1
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{STEPS_KEY} must be 'all', 'first' or a count ≥ 0, got {value!r}")
    return value
