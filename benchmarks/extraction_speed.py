"""Extraction time: shared demo KV cache + batching against the reference code's naive path.

Same as `ltv-vllm bench extraction` (see `ltv_vllm/bench/extraction.py`): a grid of k (at the
largest N) and N (at k=30), ours and naive side by side in one process on the same episodes.

    python benchmarks/extraction_speed.py --tasks sst2 --ks 10,30,50 --ns 64,128,256
"""

import sys

from ltv_vllm.cli import main

if __name__ == "__main__":
    main(["bench", "extraction", *sys.argv[1:]])
