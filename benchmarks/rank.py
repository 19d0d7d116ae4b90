"""LTV quality against rank: accuracy and d_NTP of each fit cut to its best rank-R part.

Same as `ltv-vllm bench rank`; results go to benchmarks/results/rank/.

    python benchmarks/rank.py --model smollm2-135m --tasks sst2,subj,trec,agnews
"""

import sys

from ltv_vllm.cli import main

if __name__ == "__main__":
    main(["bench", "rank", *sys.argv[1:]])
