"""Which teacher a vector should imitate: k-shot, M k-shot sets or a many-shot prompt, each
raw, calibrated (batch / contextual) or blended with gold labels, scored against one k-shot
prompt; every episode's states kept under OUT/states and rescored with --rescore (issue 72).

Same as `ltv-vllm bench teachers`:

    python benchmarks/teachers.py --model qwen2.5-coder-1.5b --tasks packaged --k 30 \
        --many-k 90 --demo-sets 2 --runs 1 --out benchmarks/results/teachers_qwen2.5-coder-1.5b
"""

import sys

from ltv_vllm.cli import main

if __name__ == "__main__":
    main(["bench", "teachers", *sys.argv[1:]])
