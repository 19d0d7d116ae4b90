"""Code in vLLM's API-server process: the gate in front of every route, the task registry
that is the process's one source of truth for served tasks, the task store's routes (uploads,
compiles, deletion, following a shared store, the audit log), the start-up self-check, the
per-task metrics and each replica's residency. It never imports engine code."""
