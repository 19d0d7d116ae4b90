"""The gate's classes vLLM loads by name (`--middleware`, `contract.names.gate`), in the
API-server process. The code is `api_server.gate` and `api_server.task_gates`; this name
never moves (configs exported by earlier releases name it)."""

from ltv_vllm.serving.api_server.gate import Gate  # noqa: F401
from ltv_vllm.serving.api_server.task_gates import FoldedGate, LoraGate, TaskGate  # noqa: F401
