"""The one surface vLLM loads by name: the plugin's entry points and the classes vLLM's flags
name (`contract.names`). Each module here is a re-export of code that lives in the folder of
the process it runs in (`engine`, `api_server`); configs exported by earlier releases name
these paths, so they never move.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in every process it
starts (API server, engine core, workers), which is the only way an out-of-tree class
reaches a worker. It registers lazy "module:Class" strings, so importing this package never
imports vLLM's model code, and it is safe to call any number of times. It also applies
`engine.fixes`: work-arounds for vLLM bugs that would make a server answer silently wrong.
"""

from __future__ import annotations

from ltv_vllm.serving.contract.names import WRAPPERS  # noqa: F401 - re-exported


def register() -> None:
    import logging

    from vllm import ModelRegistry

    from ltv_vllm.serving.contract.names import model_class
    from ltv_vllm.serving.contract.vllm_support import version_problem
    from ltv_vllm.serving.engine.fixes import patch_cpu_lora_logits

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

    # `vllm serve` started with LTV_VLLM_DEPLOY (`launcher.deploy`): ltv-vllm's environment
    # in place before vLLM parses its arguments and starts its engine processes
    from ltv_vllm.serving.vllm_ext.deploy import apply

    apply()

    # before any engine builds its LoRA layers: a request without a task vector must never
    # get a LoRA slot's shift (engine.fixes)
    patch_cpu_lora_logits()
    # before the scheduler hashes a block: a layer task's shifted KV is never shared
    # (engine.prefix_keys)
    from ltv_vllm.serving.engine.prefix_keys import patch_block_hash_keys

    patch_block_hash_keys()
    # before any config resolves its splitting ops: piecewise graphs run the layer op
    from ltv_vllm.serving.engine.layer_shift import patch_splitting_ops

    patch_splitting_ops()

    supported = set(ModelRegistry.get_supported_archs())
    for wrapper in WRAPPERS.values():
        if wrapper not in supported:
            ModelRegistry.register_model(wrapper, model_class(wrapper))
