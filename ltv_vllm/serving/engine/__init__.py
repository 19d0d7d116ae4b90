"""Code in vLLM's engine core and worker processes: the LTV model wrappers whose
`compute_logits` adds each row's shift, the V1 row plan and logits processors, the V2 model
state, the shift sizes the API server reads by `collective_rpc`, and fixes for vLLM bugs. It
never imports API-server code."""
