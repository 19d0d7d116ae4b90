"""Recovery of ICL's accuracy against N, for the paper's LTV and multi-prompt LTV (M
demonstration sets), beside the M-prompt ICL ensemble and the capture time (issue 54).

Same as `ltv-vllm bench scaling`; rerun the same command to resume an interrupted sweep.

    python benchmarks/scaling.py --model smollm2-135m --tasks packaged --ns 64,256,1024 \
        --demo-sets 4 --runs 3 --out benchmarks/results/scaling_smollm2-135m
"""

import sys

from ltv_vllm.cli import main

if __name__ == "__main__":
    main(["bench", "scaling", *sys.argv[1:]])
