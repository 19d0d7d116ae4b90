"""`python -m ltv_vllm.cli`: the `ltv-vllm` command."""

from ltv_vllm.cli import main

if __name__ == "__main__":  # (importing it, as the wheel check does, runs nothing)
    main()
