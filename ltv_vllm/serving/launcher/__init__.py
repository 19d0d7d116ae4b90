"""The launcher process (`ltv-vllm serve`): the user's vLLM arguments parsed once, the engine
recipe, the server's flags, the LoRA plan, the task store's set-up, the plan that checks
everything before anything is written, and the export for the user's own `vllm serve`.
Offline jobs reuse the recipe and the flags' joining rules."""
