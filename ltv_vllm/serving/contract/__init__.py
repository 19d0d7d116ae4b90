"""The contract between ltv-vllm's processes. Pure, read in every process, no vLLM import:
the settings the launcher hands vLLM's processes, the wire format of a request's task, step
policy, chat consent and admission stamp, keys and roles, the names vLLM loads ours by, the
plugin allowlist, the supported vLLM range and what an export holds."""
