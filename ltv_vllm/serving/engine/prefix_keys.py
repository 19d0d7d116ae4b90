"""Layer tasks in vLLM's prefix cache. Runs in vLLM's engine-core process (the scheduler's
KV-cache manager), installed by `register()` like `engine.fixes`.

A shift at the LM head never touches the KV cache, so final-layer tasks share every cached
block with bare requests. A layer task does: from the first position it shifts, every later
token's keys and values at the blocks above it differ from the bare model's. vLLM keys a
cached block by its tokens, its parent block and "extra keys" (a LoRA adapter's name, a
`cache_salt`, multimodal hashes: `kv_cache_utils.generate_block_hash_extra_keys`). We add
one more where a layer task has shifted — ("ltv_layer", positions, its (task, scale) parts:
the request's own task and any `ltv_mix`) — on each block that reaches the request's first
shifted position: position 0 with the whole prompt shifted, else its last prompt token. The
blocks before it hold exactly the bare model's KV and keep their plain key, so bare requests,
and the unshifted head of a layer task's prompt, still hit the cache; two tasks, two
policies or two scales over one prefix never share a shifted block.
A task key is fixed for an engine's life (a name from its command line) or names its content
("NAME@DIGEST"), so a key never stands for two vectors.

The engine learns which task keys are layer tasks, and their default positions, from
`wire.LAYER_TASKS_ENV`, written by the recipe's caller before the engine starts (as the task
names are: `wire.tasks_env`); the worker refuses to start with layer tasks the variable
does not list, so a cache that would not key them never serves them. A task-store layer
task's request carries its kind and positions itself (`wire.request_layers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ltv_vllm.core.layer_task import LayerPolicy
from ltv_vllm.serving.contract.wire import (
    LAYER_KEY,
    STEPS_KEY,
    layer_parts,
    layer_tasks,
    request_layers,
)

_MARK = "_ltv_vllm_layer_keys"


def first_shifted(policy: LayerPolicy, prompt_len: int) -> int | None:
    """The first position a policy shifts (None: none): 0 with the prompt, else the last
    prompt token's, when any step is shifted."""
    if policy.prompt:
        return 0
    if policy.steps is None or policy.steps > 0:
        return max(prompt_len - 1, 0)
    return None


def block_key(args: Mapping[str, Any], prompt_len: int, end: int,
              tasks: Mapping[str, tuple[str, bool]]) -> tuple[Any, ...] | None:
    """The extra key of a block ending before token `end` of a request with `vllm_xargs`
    `args` (None: the bare model's block). Pure: what the patch below adds."""
    try:
        # a store layer task's kind and positions come with it (unchecked here: a stamp
        # the request check refused keys a block apart, never shares one)
        layers = request_layers(args, None, tasks)
        parts = layer_parts(args, layers)
    except ValueError:  # refused at admission; keyed apart anyway, never shared
        return ("ltv_layer", repr(sorted(args.items(), key=str))[:256])
    if parts is None:
        return None
    text = args[STEPS_KEY] if STEPS_KEY in args else layers[parts[0][0]][0]
    try:
        policy = LayerPolicy.parse(text)
    except ValueError:
        return ("ltv_layer", repr(text)[:64], parts)
    first = first_shifted(policy, prompt_len)
    if first is None or end <= first:
        return None
    return ("ltv_layer", str(policy), parts)


def patch_block_hash_keys() -> bool:
    """Add `block_key` to vLLM's block-hash extra keys (idempotent); False when this vLLM
    has no such function (the worker then refuses layer tasks with prefix caching on)."""
    try:
        from vllm.v1.core import block_pool, kv_cache_utils
    except ImportError:
        return False
    original = getattr(kv_cache_utils, "generate_block_hash_extra_keys", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    def keyed(request: Any, start_token_idx: int, end_token_idx: int,
              start_mm_idx: int) -> tuple[Any, int]:
        keys, next_mm = original(request, start_token_idx, end_token_idx, start_mm_idx)
        params = getattr(request, "sampling_params", None)
        args = (params.extra_args or {}) if params is not None else {}
        tasks = layer_tasks()
        if not tasks and LAYER_KEY not in args:
            return keys, next_mm
        extra = block_key(args, int(request.num_prompt_tokens), end_token_idx, tasks)
        if extra is None:
            return keys, next_mm
        return (*(keys or ()), extra), next_mm

    setattr(keyed, _MARK, True)
    kv_cache_utils.generate_block_hash_extra_keys = keyed
    if getattr(block_pool, "generate_block_hash_extra_keys", None) is original:
        block_pool.generate_block_hash_extra_keys = keyed
    return True


def patched() -> bool:
    """Whether this process's vLLM keys blocks with `block_key`."""
    try:
        from vllm.v1.core import kv_cache_utils
    except ImportError:
        return False
    return bool(getattr(getattr(kv_cache_utils, "generate_block_hash_extra_keys", None),
                        _MARK, False))
