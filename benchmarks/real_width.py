"""The vLLM capture at Qwen2.5-72B's real width (one layer): same as `ltv-vllm bench
real-width` (see `ltv_vllm/bench/real_width.py`).

    python benchmarks/real_width.py --config qwen2.5-72b --layers 1 --tps 1,2
"""

import sys

from ltv_vllm.cli import main

if __name__ == "__main__":
    main(["bench", "real-width", *sys.argv[1:]])
