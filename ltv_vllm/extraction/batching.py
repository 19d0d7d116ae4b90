"""`--batch-size auto`: how many prompts one forward pass of the capture takes, from the
device's free memory and the prompts' token counts. Pure arithmetic over the model's shape;
`free_memory` is the one place that asks the device.

What a batch holds at its peak, per decoder layer kept or passed through (bytes):

- padded rows after a shared demo prefix (`Capturer.forward_last`): each row's keys and
  values for the prefix *and* its suffix — the prefix's cache is expanded per row, and the
  forward concatenates the suffix onto it, so every row holds its own copy —
  2 · L · (p + s) · kv_heads · head_dim · b, kept for every layer until the pass ends;
  plus, in the layer being computed, the attention scores (float32: heads · s · (p + s) · 4)
  and the MLP's activations (3 · s · intermediate · b) and a few hidden-state copies
  (4 · s · hidden · b);
- one packed row (`Capturer.forward_packed`: the prefix once, then B queries of T tokens in
  all): the keys and values of p + T positions, the scores of T × (p + T) and its additive
  mask (float32), and the activations of T tokens.

The batch is the largest that fits in `FRACTION` of the free memory (the rest: the
allocator's fragmentation, the hidden states gathered so far, what other processes take
meanwhile), at most `CAP` on a GPU (measured on an H200 at the Llama-3.1-8B and Qwen2.5-32B
shapes, benchmarks/results/extraction_*_cuda: the whole extraction was fastest at 128; 256
was no faster, before and after the capture's length buckets) and `CPU_CAP` on a CPU,
which is compute-bound: there a packed row of many queries spends its time on the masked
attention between them (quadratic in the packed tokens), and SmolLM2-135M's TREC extraction
(`extract --task trec --batch-size 16` / `128`, float32, AMD EPYC AVX2, 2 cores) captured in
27.8 s at 16 against 36.1 s at 128.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FRACTION = 0.5
CAP = 128
CPU_CAP = 16


@dataclass(frozen=True)
class Shape:
    """What the planner needs of a model: its decoder's sizes and the compute dtype's bytes."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    dtype_bytes: int

    @classmethod
    def of(cls, config: Any, dtype_bytes: int) -> Shape:
        cfg = getattr(config, "text_config", None) or config
        heads = int(cfg.num_attention_heads)
        hidden = int(cfg.hidden_size)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        return cls(layers=int(cfg.num_hidden_layers), heads=heads,
                   kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
                   head_dim=head_dim, hidden=hidden,
                   intermediate=int(getattr(cfg, "intermediate_size", None) or 4 * hidden),
                   dtype_bytes=dtype_bytes)

    def kv_bytes(self, tokens: int) -> int:
        """Keys and values of `tokens` positions over every layer."""
        return 2 * self.layers * tokens * self.kv_heads * self.head_dim * self.dtype_bytes

    def layer_bytes(self, tokens: int, context: int) -> int:
        """The transient peak of one layer over `tokens` new positions that attend to
        `context` positions: float32 scores, MLP activations, hidden-state copies."""
        b = self.dtype_bytes
        return (self.heads * tokens * context * 4 + 3 * tokens * self.intermediate * b
                + 4 * tokens * self.hidden * b)


def padded_bytes(shape: Shape, batch: int, prefix: int, suffix: int) -> int:
    """Peak bytes of `batch` left-padded rows of `suffix` tokens after a `prefix`-token
    cache (prefix 0: whole prompts)."""
    return batch * (shape.kv_bytes(prefix + suffix) + shape.layer_bytes(suffix, prefix + suffix))


def packed_bytes(shape: Shape, prefix: int, tokens: int) -> int:
    """Peak bytes of one packed row: the prefix once, then `tokens` query tokens in all
    (their block mask, float32, beside the scores)."""
    return (shape.kv_bytes(prefix + tokens) + shape.layer_bytes(tokens, prefix + tokens)
            + tokens * (prefix + tokens) * 4)


def plan_batch(shape: Shape, free: int, prefix: int, suffixes: list[int], *,
               packed: bool = False, fraction: float = FRACTION, cap: int = CAP) -> int:
    """The largest batch (≤ cap, ≥ 1) of these prompts whose peak fits in `fraction` of
    `free` bytes. Padded: every row as long as the longest suffix; packed: the longest
    suffixes first (the worst batch of that size)."""
    budget = fraction * free
    if not suffixes:
        return 1
    longest = sorted(suffixes, reverse=True)
    best = 1
    for size in range(2, min(cap, len(suffixes)) + 1):
        need = (packed_bytes(shape, prefix, sum(longest[:size])) if packed
                else padded_bytes(shape, size, prefix, longest[0]))
        if need > budget:
            break
        best = size
    return best


def free_memory(device: Any) -> int:
    """Bytes the device can still give: CUDA's free memory, or the host's available
    memory (/proc/meminfo's MemAvailable) for the CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30  # no /proc: assume a modest 4 GiB
