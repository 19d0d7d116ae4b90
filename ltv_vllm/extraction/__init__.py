"""What the methods stand on, in transformers: `capture` (final post-norm hidden states of
many prompts, the demos' KV cache shared), `batching` (how many prompts a pass takes under
`--batch-size auto`), `store` (a capture store that resumes chunk by
chunk, for a large transfer source), `apply` (a task vector as a hook on the LM head's input),
`generate` (greedy decoding with a map at every or only the first step) and `transfer` (the
logit-space maths of cross-model transfer)."""
