"""Capture on vLLM (eager, compiled) against transformers: same as `ltv-vllm bench capture`
(see `ltv_vllm/bench/capture_engines.py`).

    python benchmarks/capture_engines.py --models smollm2-135m,qwen2.5-coder-1.5b --k 30 --n 256
"""

import sys

from ltv_vllm.cli import main

if __name__ == "__main__":
    main(["bench", "capture", *sys.argv[1:]])
