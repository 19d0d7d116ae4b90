"""A memory plan for running a checkpoint on vLLM, from its `config.json` (and the weight
index, when there is one) alone: no weights are read, so a plan for 8×80 GB GPUs can be
printed on a laptop.

What it counts (bytes, on each device):
  weights   the decoder's parameters at the run's dtype, as the capture's pooling runner
            holds them: no LM head (vLLM's pooling adapter builds none). Tensor parallelism
            splits every layer's matrices and the embedding's vocabulary rows; pipeline
            parallelism splits the layers (the first stage holds the embedding, the last the
            final norm; the plan is the first's). KV heads fewer than the TP size are
            replicated, as vLLM does.
  kv        the KV cache the capture needs: the demonstrations' prefix (kept once, shared by
            the prefix cache) plus one batch of queries, at the model's KV width.
  head      the label head the capture scores with (a few LM-head rows, float32), or the
            whole LM head for a transfer source (its logits), held beside the engine.
  act       an estimate of the activations of one engine step (`step_tokens` tokens, vLLM's
            `max_num_batched_tokens`): the gated MLP's two intermediate halves, the q/k/v
            projections and a few hidden-size buffers per token, on this rank's share. vLLM
            profiles the real peak at start-up; the pooling runner computes no logits.
A device fits the plan when weights + kv + act fit `gpu_memory_utilization` of it (vLLM
carves its KV cache out of that budget after weights and the profiled peak; CUDA graphs and
the CUDA context live in the remainder).

The parameter count is computed from the config (Llama / Qwen2 / Mistral-style decoders:
q/k/v/o attention, optional q/k/v biases, a gated MLP, RMS norms) and checked against the
index's `total_size` when the index gives one: a config this module misreads is refused,
not planned.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltv_vllm.errors import UserError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30


class PlanError(UserError):
    """A plan that cannot be made, or cannot fit the devices."""


@dataclass(frozen=True)
class Shape:
    """The config fields a plan needs."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    checkpoint_dtype: str

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Shape:
        need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size")
        missing = [k for k in need if k not in cfg]
        if missing:
            raise PlanError(f"config.json has no {', '.join(missing)}: not a decoder this plan "
                            "knows (Llama, Qwen2, Mistral)")
        heads = int(cfg["num_attention_heads"])
        model_type = str(cfg.get("model_type", ""))
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (its config has no flag for them)
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        )

    def layer_params(self, tp: int = 1) -> int:
        """One decoder layer's parameters on one of `tp` ranks: heads and the MLP's columns
        split, KV heads replicated where fewer than the ranks, the norms whole."""
        d, hd = self.hidden_size, self.head_dim
        q = self.num_attention_heads // tp * hd
        kv = math.ceil(self.num_key_value_heads / tp) * hd
        attn = d * q + 2 * d * kv + q * d + ((q + 2 * kv) if self.attention_bias else 0)
        return attn + 3 * d * math.ceil(self.intermediate_size / tp) + 2 * d

    def params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + head + self.num_hidden_layers * self.layer_params() + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1, pp: int = 1) -> int:
        """K and V of one token on one device: its KV heads (replicated below the TP size),
        its share of the layers."""
        kv_heads = math.ceil(self.num_key_value_heads / tp)
        layers = math.ceil(self.num_hidden_layers / pp)
        return 2 * layers * kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class PlanRequest:
    """What the run will do: the parallel layout, the devices, and the tokens it holds."""

    tp: int = 1
    pp: int = 1
    dtype: str = "bfloat16"
    devices: int = 1
    device_gib: float = 80.0
    gpu_memory_utilization: float = 0.9
    prefix_tokens: int = 2048       # the demonstrations, held once by the prefix cache
    query_tokens: int = 64          # one query, after the prefix
    batch: int = 64                 # queries scheduled together
    n_labels: int = 4
    full_head: bool = False         # a transfer source: the whole LM head, not label rows
    max_model_len: int = 4096
    step_tokens: int = 8192         # tokens one engine step runs (max_num_batched_tokens)


@dataclass(frozen=True)
class Plan:
    params: int
    param_bytes: int
    weight_bytes_per_device: int
    kv_bytes_per_token: int
    kv_bytes_per_device: int
    head_bytes: int
    activation_bytes_per_device: int
    budget_bytes_per_device: int
    fits: bool
    engine_args: dict[str, Any]

    @property
    def need_per_device(self) -> int:
        return (self.weight_bytes_per_device + self.kv_bytes_per_device
                + self.activation_bytes_per_device)


def read_shape(model_dir: str | Path) -> tuple[Shape, int | None]:
    """The config's shape and the weight index's `total_size` (None without an index)."""
    d = Path(model_dir)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        raise PlanError(f"{d} has no config.json") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"{d / 'config.json'} is not JSON ({e.msg})") from None
    total = None
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        except json.JSONDecodeError as e:
            raise PlanError(f"{index} is not JSON ({e.msg})") from None
    return Shape.from_config(cfg), (int(total) if total is not None else None)


def check_index(shape: Shape, total_size: int | None) -> None:
    """The computed parameter count must be the checkpoint's (within 1 %: an index may hold a
    few buffers besides); otherwise this plan misreads the architecture."""
    if total_size is None:
        return
    want = shape.params() * DTYPE_BYTES.get(shape.checkpoint_dtype, 2)
    if abs(total_size - want) > 0.01 * want:
        raise PlanError(f"the weight index holds {total_size / GIB:.1f} GiB but the config "
                        f"describes {want / GIB:.1f} GiB: an architecture this plan does not "
                        "read (mixture of experts, extra modules?)")


def make_plan(shape: Shape, req: PlanRequest) -> Plan:
    """The per-device bytes of `req` on `shape` (pure arithmetic; see the module docstring)."""
    if req.tp < 1 or req.pp < 1:
        raise PlanError("--tensor-parallel-size and --pipeline-parallel-size must be ≥ 1")
    if req.tp * req.pp > req.devices:
        raise PlanError(f"TP {req.tp} × PP {req.pp} needs {req.tp * req.pp} devices; "
                        f"{req.devices} given")
    if shape.num_attention_heads % req.tp:
        raise PlanError(f"{shape.num_attention_heads} attention heads do not split over "
                        f"TP {req.tp}")
    if req.pp > shape.num_hidden_layers:
        raise PlanError(f"PP {req.pp} exceeds the {shape.num_hidden_layers} layers")
    if req.dtype not in DTYPE_BYTES:
        raise PlanError(f"dtype {req.dtype!r}: one of {', '.join(DTYPE_BYTES)}")
    if req.prefix_tokens + req.query_tokens > req.max_model_len:
        raise PlanError(f"a prompt of {req.prefix_tokens + req.query_tokens} tokens exceeds "
                        f"--max-model-len {req.max_model_len}")
    b = DTYPE_BYTES[req.dtype]
    # the embedding's vocabulary rows split over TP, on the first stage; the pooling runner
    # builds no LM head (vLLM's pooling adapter leaves it out: no logits), so its rows are
    # read on the host instead (`head_bytes`); the last stage adds the final norm
    embed = math.ceil(shape.vocab_size / req.tp) * shape.hidden_size * b
    layers = math.ceil(shape.num_hidden_layers / req.pp)
    per_layer = shape.layer_params(req.tp) * b
    weights = layers * per_layer + embed + shape.hidden_size * b
    kv_tok = shape.kv_bytes_per_token(b, req.tp, req.pp)
    tokens = req.prefix_tokens + req.batch * req.query_tokens
    kv = kv_tok * tokens
    label_head = (shape.vocab_size if req.full_head else req.n_labels) * shape.hidden_size * 4
    qkv = (shape.num_attention_heads // req.tp
           + 2 * math.ceil(shape.num_key_value_heads / req.tp)) * shape.head_dim
    act = req.step_tokens * (2 * math.ceil(shape.intermediate_size / req.tp) + qkv
                             + 4 * shape.hidden_size) * b
    budget = int(req.gpu_memory_utilization * req.device_gib * GIB)
    args = {"runner": "pooling", "dtype": req.dtype,
            "tensor_parallel_size": req.tp, "pipeline_parallel_size": req.pp,
            "max_model_len": req.max_model_len, "enable_prefix_caching": True,
            "max_num_batched_tokens": req.step_tokens,
            "gpu_memory_utilization": req.gpu_memory_utilization,
            "pooler_config": {"pooling_type": "LAST", "use_activation": False}}
    return Plan(params=shape.params(), param_bytes=shape.params() * b,
                weight_bytes_per_device=weights, kv_bytes_per_token=kv_tok,
                kv_bytes_per_device=kv, head_bytes=label_head, activation_bytes_per_device=act,
                budget_bytes_per_device=budget, fits=weights + kv + act <= budget,
                engine_args=args)



def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def describe(plan: Plan, req: PlanRequest, name: str = "model") -> list[str]:
    """The plan as the lines `extract --dry-run` prints."""
    head = "LM head" if req.full_head else "label head"
    rows = (f"{req.n_labels} rows" if not req.full_head else "all rows") + ", float32"
    return [
        f"plan for {name}: {plan.params / 1e9:.2f} B parameters, {gib(plan.param_bytes)} "
        f"at {req.dtype}",
        f"  layout      TP {req.tp} × PP {req.pp} on {req.devices} device(s) of "
        f"{req.device_gib:.1f} GiB (budget {gib(plan.budget_bytes_per_device)} each at "
        f"gpu_memory_utilization {req.gpu_memory_utilization:g})",
        f"  weights     {gib(plan.weight_bytes_per_device)} per device",
        f"  KV cache    {gib(plan.kv_bytes_per_device)} per device: "
        f"{plan.kv_bytes_per_token} B/token × ({req.prefix_tokens} prefix + {req.batch} × "
        f"{req.query_tokens} query tokens)",
        f"  activations {gib(plan.activation_bytes_per_device)} per device (estimate: one step "
        f"of {req.step_tokens} tokens)",
        f"  {head:<11} {gib(plan.head_bytes)} on the host, beside the engine ({rows})",
        f"  fits        {'yes' if plan.fits else 'NO'} ({gib(plan.need_per_device)} of "
        f"{gib(plan.budget_bytes_per_device)})",
        "  vLLM        " + json.dumps(plan.engine_args, sort_keys=True),
    ]


def default_layout(shape: Shape, gpus: int) -> tuple[int, int]:
    """TP × PP over `gpus`: the widest tensor parallelism the heads split over (TP stays
    inside a node and costs no pipeline bubbles), the rest as pipeline stages."""
    tp = max(t for t in range(1, gpus + 1)
             if gpus % t == 0 and shape.num_attention_heads % t == 0)
    return tp, gpus // tp


def plan_table(shapes: dict[str, Shape], gpus: tuple[int, ...], req: PlanRequest) -> str:
    """The docs' table: each model on each GPU count at its `default_layout` (markdown)."""
    from dataclasses import replace

    lines = ["| model | params | GPUs | TP × PP | weights / GPU | KV / GPU | activations / GPU "
             "| needed / budget per GPU | label head (host) | full LM head (host; transfer "
             "source) | fits |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, shape in shapes.items():
        for n in gpus:
            tp, pp = default_layout(shape, n)
            p = make_plan(shape, replace(req, tp=tp, pp=pp, devices=n))
            full = make_plan(shape, replace(req, tp=tp, pp=pp, devices=n, full_head=True))
            lines.append(
                f"| {name} | {p.params / 1e9:.2f} B | {n} | {tp} × {pp} | "
                f"{p.weight_bytes_per_device / GIB:.1f} GiB | "
                f"{p.kv_bytes_per_device / GIB:.2f} GiB | "
                f"{p.activation_bytes_per_device / GIB:.2f} GiB | "
                f"{p.need_per_device / GIB:.1f} / {p.budget_bytes_per_device / GIB:.1f} GiB | "
                f"{p.head_bytes / 2**10:.0f} KiB | "
                f"{full.head_bytes / GIB:.2f} GiB | {'yes' if p.fits else 'no'} |")
    return "\n".join(lines)


def require_fit(plan: Plan) -> None:
    """Refuse, in one line, a plan whose devices cannot hold it."""
    if not plan.fits:
        raise PlanError(f"the plan does not fit: {plan.need_per_device / GIB:.1f} GiB per "
                        f"device, {plan.budget_bytes_per_device / GIB:.1f} GiB usable; raise "
                        "--tensor-parallel-size / --pipeline-parallel-size (see --dry-run)")
