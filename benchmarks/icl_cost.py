"""ICL serving cost as k grows (prefix cache on and off); LTV's cost does not depend on k.

Same as `ltv-vllm bench icl-cost`; results go to benchmarks/results/icl_cost/.

    python benchmarks/icl_cost.py --model smollm2-135m --tasks sst2,agnews --ks 0,10,30,50
"""

import sys

from ltv_vllm.cli import main

if __name__ == "__main__":
    main(["bench", "icl-cost", *sys.argv[1:]])
