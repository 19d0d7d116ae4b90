"""Tasks and their data: what a task is (`specs`: prompt format, label words, regression
tasks, spec files) and its examples (`data`: the packaged datasets, episodes of k demos, N
unlabeled queries and a test subset, deterministic in the seed). The bottom wing: it imports
only `ltv_vllm.errors`."""
