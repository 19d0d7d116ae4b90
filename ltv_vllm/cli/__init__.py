"""`ltv-vllm` command line: thin click commands, each a call into the library, one module per
command group — `base` (the root group, one-line errors, shared option types and groups),
`models` (models, tasks, data), `extract` (extract, inspect, export-lora, evaluate, report),
`serve` (selfcheck, serve, classify, compile, tasks remote), `keys` (a server's API keys)
and `bench` (the benchmarks; `bench_value`: its held-out value protocol).
Importing this package registers every command on `main`."""

from ltv_vllm.cli import (  # noqa: F401 - they register commands
    bench,
    bench_value,
    extract,
    keys,
    models,
    serve,
)
from ltv_vllm.cli.base import main
from ltv_vllm.cli.serve import compile_request

__all__ = ["compile_request", "main"]
