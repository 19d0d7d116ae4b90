"""The model classes vLLM's ModelRegistry loads by name (`contract.names.model_class`), in
the engine's worker processes. The code is `engine.models`; this name never moves (configs
exported by earlier releases name it)."""

from ltv_vllm.serving.engine.models import (  # noqa: F401
    LTVLlamaForCausalLM,
    LTVMistralForCausalLM,
    LTVQwen2ForCausalLM,
    LTVQwen3ForCausalLM,
)
