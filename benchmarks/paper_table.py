"""The paper's protocol through the Ray executor on a Ray cluster started here: `--nodes`
worker nodes of `--cpus-per-node` CPUs on the loopback address (`ray.cluster_utils.Cluster`),
then one `ltv-vllm evaluate --executor ray` against it, its output in `--out`.

    python benchmarks/paper_table.py --model smollm2-135m --nodes 2 \
        --out benchmarks/results/paper_table_smollm2-135m

The evaluation is the paper's protocol on the seven packaged tasks (5 runs, k = 30, N = 256,
500 test queries; zero-shot, ICL, FV, TV, SV, I2CL, LTV; `--methods` and `--runs` change
it). Interrupted, the same command again resumes from OUT/partial.json (the driver's
checkpoint) and runs only the missing episodes; OUT/results.md is `evaluate`'s own report,
with the driver's machine; every record names the Ray node that ran its episode.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

PACKAGED = "sst2,trec,subj,mr,sst5,agnews,hate_speech18"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default=PACKAGED)
    ap.add_argument("--methods", default="zero-shot,icl,fv,tv,sv,i2cl,ltv")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--cpus-per-node", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": a.cpus_per_node})
    for _ in range(a.nodes - 1):
        c.add_node(num_cpus=a.cpus_per_node)
    c.wait_for_nodes()
    try:
        r = subprocess.run([sys.executable, "-m", "ltv_vllm.cli", "evaluate",
                            "--model", a.model, "--tasks", a.tasks, "--methods", a.methods,
                            "--runs", str(a.runs), "--cost-samples", "0", "--out", str(a.out),
                            "--executor", "ray", "--ray-address", c.address,
                            "--episode-cpus", str(a.cpus_per_node)])
    finally:
        ray.shutdown()
        c.shutdown()
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
