"""vLLM integration, quarantined: the plugin entry point and LTV-capable model classes.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in every process that
builds a model (engine core, workers), which is the only way an out-of-tree class reaches a
worker. It registers lazy "module:Class" strings, so importing this package never imports
vLLM's model code, and it is safe to call any number of times. It also applies `fixes`:
work-arounds for vLLM bugs that would make a server answer silently wrong.
"""

from __future__ import annotations

# stock architecture → our wrapper (same constructor, same weights, one method overridden)
WRAPPERS: dict[str, str] = {
    "LlamaForCausalLM": "LTVLlamaForCausalLM",
    "MistralForCausalLM": "LTVMistralForCausalLM",
    "Qwen2ForCausalLM": "LTVQwen2ForCausalLM",
    "Qwen3ForCausalLM": "LTVQwen3ForCausalLM",
}


def register() -> None:
    import logging

    from vllm import ModelRegistry

    from ltv_vllm.serving.vllm_ext.fixes import patch_cpu_lora_logits
    from ltv_vllm.serving.vllm_support import version_problem

    # a level of ltv-vllm's own (unless the user set one): vLLM's SageMaker routes import a
    # package that sets the root logger to ERROR, which would silence every warning of the
    # gate and the task endpoints (a store outage, a task skipped)
    if logging.getLogger("ltv_vllm").level == logging.NOTSET:
        logging.getLogger("ltv_vllm").setLevel(logging.WARNING)

    if (problem := version_problem()) is not None:
        # vLLM logs and swallows a plugin's exception: say it in one line and register
        # nothing, so an engine asked for an LTV architecture fails to start
        logging.getLogger("ltv_vllm").error("ltv-vllm: %s", problem)
        return

    # `vllm serve` started with LTV_VLLM_DEPLOY (`serving.deploy`): ltv-vllm's environment
    # in place before vLLM parses its arguments and starts its engine processes
    from ltv_vllm.serving.deploy import apply

    apply()

    # before any engine builds its LoRA layers: a request without a task vector must never
    # get a LoRA slot's shift (fixes.py)
    patch_cpu_lora_logits()

    supported = set(ModelRegistry.get_supported_archs())
    for wrapper in WRAPPERS.values():
        if wrapper not in supported:
            ModelRegistry.register_model(wrapper, f"ltv_vllm.serving.vllm_ext.models:{wrapper}")
