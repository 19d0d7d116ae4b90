"""The logits processors vLLM loads by name (`--logits-processors`, `contract.names.processor`):
in the API-server process (their `validate_params`) and the engine's workers. The code is
`engine.steps`; this name never moves (configs exported by earlier releases name it)."""

from ltv_vllm.serving.engine.steps import (  # noqa: F401
    LTVLoraRefused,
    LTVStepPolicy,
    LTVStepsRefused,
)
