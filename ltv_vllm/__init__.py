"""ltv-vllm: Linear Task Vectors extracted with transformers, served inside vLLM.

The package is built in wings, each importing only the ones below it (a test checks it):

    tasks      task specs and their data                       (ltv_vllm.tasks)
    core       ridge, kernel, metrics, the task-vector format  (ltv_vllm.core)
    models     cache, packaged, derived, loading, hardware     (ltv_vllm.models)
    extraction capture, store, apply, generate, transfer maths (ltv_vllm.extraction)
    methods    the method registry: LTV and the baselines      (ltv_vllm.methods)
    pipeline   extract(lm, task, method, opts)                 (ltv_vllm.pipeline)
    serving    vLLM: serve, the plugin, task store, client     (ltv_vllm.serving)
    evaluation evaluate, regression                            (ltv_vllm.evaluation)
    jobs       a command as one call: extract_file(ExtractJob) (ltv_vllm.jobs)
    bench      benchmarks                                      (ltv_vllm.bench)
    cli        the `ltv-vllm` command                          (ltv_vllm.cli)

The public API below is imported on first use (PEP 562), so that `ltv-vllm --help` does not
pay for torch; `from ltv_vllm import extract, TaskVector` works as usual.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.3.0"

# name → module that defines it
_API = {
    "extract": "ltv_vllm.pipeline.extract",
    "extract_transfer": "ltv_vllm.pipeline.transfer",
    "ExtractJob": "ltv_vllm.jobs.extract",
    "extract_file": "ltv_vllm.jobs.extract",
    "LayerTask": "ltv_vllm.core.layer_task",
    "load_layer_task": "ltv_vllm.core.layer_task",
    "layer_task_applied": "ltv_vllm.extraction.layer_apply",
    "ExtractOptions": "ltv_vllm.pipeline.extract",
    "Extraction": "ltv_vllm.pipeline.extract",
    "plan_episode": "ltv_vllm.pipeline.extract",
    "TaskVector": "ltv_vllm.core.vector",
    "load_task_vector": "ltv_vllm.core.vector",
    "task_vector_applied": "ltv_vllm.extraction.apply",
    "load_model": "ltv_vllm.models.loading",
    "get_task": "ltv_vllm.tasks.specs",
    "Task": "ltv_vllm.tasks.specs",
    "METHODS": "ltv_vllm.methods",
    "Method": "ltv_vllm.methods",
    "MethodOptions": "ltv_vllm.methods",
    "Option": "ltv_vllm.methods",
    "register": "ltv_vllm.methods",
    "evaluate": "ltv_vllm.evaluation.evaluate",
    "EvalConfig": "ltv_vllm.evaluation.evaluate",
    "UserError": "ltv_vllm.errors",
    "make_llm": "ltv_vllm.serving.offline.llm",
    "task_llm": "ltv_vllm.serving.offline.llm",
    "classify_offline": "ltv_vllm.serving.offline.llm",
}

__all__ = ["__version__", *sorted(_API)]


def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ltv_vllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
