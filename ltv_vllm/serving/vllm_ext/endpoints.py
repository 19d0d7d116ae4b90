"""The endpoint plugin vLLM loads by its entry point (`vllm.endpoint_plugins`: `ltv_tasks`),
in the API-server process. The code is `api_server.endpoints`; this name never moves."""

from ltv_vllm.serving.api_server.endpoints import TaskEndpoints  # noqa: F401
