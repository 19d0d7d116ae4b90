"""The names vLLM loads ltv-vllm's code by, and the config keys it carries ours in. Pure.

Runs in every process (the launcher writes these names into vLLM's flags and `--export`'s
`vllm.yaml`; vLLM imports them in its API-server and engine processes). The classes vLLM
loads by name live behind `vllm_ext`, the one small surface it imports: a config exported by
an earlier release names the same dotted paths, so they never move.
"""

from __future__ import annotations

VLLM_EXT = "ltv_vllm.serving.vllm_ext"
MODELS_MODULE = f"{VLLM_EXT}.models"        # ModelRegistry's "module:Class" of each wrapper
PROCESSORS_MODULE = f"{VLLM_EXT}.steps"     # --logits-processors "module:Class"
GATE_MODULE = f"{VLLM_EXT}.middleware"      # --middleware "module.Class"
MULTI_SERVER_MODULE = f"{VLLM_EXT}.launch"  # `python -m`: several API-server processes
COMPILE_WORKER = "ltv_vllm.serving.store.compile"  # `python -m`: one compile job

# the worker method the API server calls (`collective_rpc`) for the shift sizes
SHIFT_SIZES_RPC = "ltv_read_shift_sizes"

CONFIG_KEY = "ltv_task_vector"  # hf_overrides: a fused server's one vector file
FOLD_KEY = "ltv_fold"           # hf_overrides: that vector folded into the LM head

# stock architecture → our wrapper (same constructor, same weights, one method overridden)
WRAPPERS: dict[str, str] = {
    "LlamaForCausalLM": "LTVLlamaForCausalLM",
    "MistralForCausalLM": "LTVMistralForCausalLM",
    "Qwen2ForCausalLM": "LTVQwen2ForCausalLM",
    "Qwen3ForCausalLM": "LTVQwen3ForCausalLM",
}


def gate(cls: str) -> str:
    """The `--middleware` value of one of the gate's classes (`api_server.gate`)."""
    return f"{GATE_MODULE}.{cls}"


def processor(cls: str) -> str:
    """The `--logits-processors` value of one of the engine's processors (`engine.steps`)."""
    return f"{PROCESSORS_MODULE}:{cls}"


def model_class(wrapper: str) -> str:
    """ModelRegistry's lazy "module:Class" of a wrapper (`engine.models`)."""
    return f"{MODELS_MODULE}:{wrapper}"
