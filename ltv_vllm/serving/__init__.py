"""Serving, the wing that runs with vLLM, laid out by the process each part runs in
(docs/architecture.md, "Serving"): `contract` (pure, every process: settings, the request's
wire format, keys, the names vLLM loads ours by), `store` (task files: the task store, a
shared store, adapters, compile), `launcher` (`ltv-vllm serve`), `api_server` (vLLM's
API-server process: the gate, the task registry and routes, metrics), `engine` (vLLM's engine
core and workers: the model wrappers and the row plan), `offline` (job processes of ours:
`vllm.LLM`, captures, the self-check), `vllm_ext` (the one surface vLLM loads by name) and
`client` (the HTTP client, in the user's process)."""
