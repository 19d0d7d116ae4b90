"""Serving benchmark: zero-shot vs ICL (prefix cache on/off) vs LTV (fused, folded, LoRA).

Same as `ltv-vllm bench serving`; see `ltv_vllm/bench/serving.py`. Results go to
benchmarks/results/serving/ (results.json, results.md, plots).

    python benchmarks/serving.py --model smollm2-135m --tasks sst2,subj,trec,agnews
"""

import sys

from ltv_vllm.cli import main

if __name__ == "__main__":
    main(["bench", "serving", *sys.argv[1:]])
