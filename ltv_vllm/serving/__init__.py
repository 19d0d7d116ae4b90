"""Serving, the only wing that imports vLLM: `serve` (the `ltv-vllm serve` launcher and
engine arguments), `vllm_ext` (the plugin: LTV model wrappers, the task endpoints, the gate
middleware, fixes for vLLM bugs), `lora` (a task vector as a PEFT adapter; no vLLM in it),
`taskstore` (the runtime task store), `compile` (a served task extracted from
demonstrations), `client` (the HTTP client), `offline` (one `vllm.LLM` job in a process),
`capture` (h of a prompt's last token from vLLM's pooling runner) and `jobs` (the process a
job runs in)."""
