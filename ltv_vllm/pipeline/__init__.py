"""The one extraction pipeline: `extract(lm, task, method=..., opts)` samples an episode,
captures the states every method shares, and has the method registry (`ltv_vllm.methods`)
fit and score the artifact (`pipeline.extract`); `extract_transfer` is the cross-model
variant (`pipeline.transfer`). `extract`,
`compile`, `evaluate`, the benchmarks and a transfer's own columns all go through it."""
