"""ltv-vllm: Linear Task Vectors extracted with transformers, served inside vLLM."""

__version__ = "0.1.0"
