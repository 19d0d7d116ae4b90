"""The one interface every task-vector method implements, and the hook plumbing they share.

A method turns an `Episode` (the same demos, train queries, label tokens and prompt format
for every method) into an artifact, and applies that artifact to a transformers model as a
context-managed hook that always removes itself:

    art = method.extract(ctx)                  # ctx: Context (model, episode, options)
    with method.applied(ctx.cap.model, art):   # the model now behaves "as if" demos were there
        ...

Two kinds of method:
  * hidden-space (ltv, mean, mlp): a map of the final post-norm state h_zs, applied before the
    LM head exactly like LTV (every decoding step); `shift(art, h)` is its closed form, so an
    evaluation scores it on captured states without another forward pass;
  * layer methods (tv, fv, sv, i2cl): edits inside the decoder (a layer's output, an attention
    head's input, a module's output); scored by running the test prompts under the hook.

The layer methods' edits of the *last* position (tv, fv, sv) leave every earlier position's
keys and values untouched (attention is causal), so a candidate (a layer, a head) is tried
by running only the last token against the clean run's KV cache (`last_token_states`) —
one token per candidate instead of a whole prompt; tests check it equals the full forward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ltv_vllm import __version__
from ltv_vllm.core.vector import ModelIdentity, Provenance, model_identity
from ltv_vllm.errors import ArgumentError, UserError
from ltv_vllm.extraction.capture import (
    Capturer,
    Prefix,
    base_model,
    full_head,
    icl_states,
    label_head,
    lm_head,
    zero_shot_states,
)
from ltv_vllm.models.hardware import hardware
from ltv_vllm.tasks.data import Episode, Example


class MethodError(UserError):
    """A method that cannot run on this model or episode (architecture, too few examples)."""


@dataclass(frozen=True)
class Option:
    """One knob a method declares in its own module; the CLI derives `--NAME` from it
    (`ltv_vllm.cli`), an evaluation records it, `MethodOptions` checks and carries it."""

    name: str                  # python name ("fv_trials"); the flag is --fv-trials
    default: Any
    help: str
    type: type = int           # int | float (None defaults take this type when given)
    minimum: float | None = None   # refused below (inclusive bound)
    positive: bool = False     # refused at or below 0
    even: bool = False         # refused when odd (the MLP's depth)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> None:
        if value is None:
            if self.default is not None:
                raise ArgumentError(f"{self.flag} needs a value")
            return
        if isinstance(value, float) and not math.isfinite(value):
            raise ArgumentError(f"{self.flag} must be a finite number, got {value}")
        if self.minimum is not None and value < self.minimum:
            raise ArgumentError(f"{self.flag} must be at least {self.minimum:g}, got {value}")
        if self.positive and not value > 0:
            raise ArgumentError(f"{self.flag} must be positive, got {value}")
        if self.even and value % 2:
            raise ArgumentError(f"{self.flag} must be an even number, got {value}")


# Options every method reads (the extraction's own settings, passed on by its caller).
COMMON: tuple[Option, ...] = (
    Option("lam", 5.0, "LTV's ridge penalty λ, or \"auto\" (leave-one-out)", float),
    Option("layer", None, "Fix TV/FV/ltv-layer's layer or SV's depth instead of choosing it on the "
           "validation examples.", int, minimum=0),
    Option("seed", 0, "Seed of the methods' own randomness."),
    Option("batch_size", 16, "Prompts per forward pass.", minimum=1),
    Option("progress", True, "Progress bars.", bool),
)
# name → Option for every option a registered method declares (`declare`, called by
# `registry.register`), so options are checked and defaulted without importing the methods
DECLARED: dict[str, Option] = {o.name: o for o in COMMON}


def declare(options: Sequence[Option], owner: str) -> None:
    """Make `owner`'s options known; a name two methods share must mean the same knob."""
    for o in options:
        known = DECLARED.get(o.name)
        if known is not None and known != o:
            raise MethodError(f"method {owner!r} declares option {o.name!r} unlike the "
                              "method that declared it first")
        DECLARED[o.name] = o


class MethodOptions:
    """Every method's knobs in one frozen object: the common ones (`COMMON`) and those the
    registered methods declare; unset knobs read as their declared defaults. Checked when
    built, so a bad value is refused with its flag's name before any model loads."""

    __slots__ = ("_values",)

    def __init__(self, **values: Any) -> None:
        unknown = sorted(set(values) - set(DECLARED))
        if unknown:
            raise ArgumentError(f"unknown method option(s) {', '.join(unknown)}; known: "
                                f"{', '.join(sorted(DECLARED))}")
        for name, v in values.items():
            if name != "lam":  # λ is checked with its CLI spelling (`check_counts`)
                DECLARED[name].check(v)
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        if name in DECLARED:
            return DECLARED[name].default
        raise AttributeError(f"no method option {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("MethodOptions is frozen; use .replace(...)")

    def replace(self, **changes: Any) -> MethodOptions:
        return MethodOptions(**{**self._values, **changes})

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled (a cluster's worker gets the options): rebuilt, and checked, from its values
        # (the default reduction would set a slot, which a frozen object refuses)
        return (_rebuilt_options, (dict(self._values),))

    def to_dict(self) -> dict[str, Any]:
        """Every declared knob with its value (defaults filled in), in declaration order."""
        return {name: getattr(self, name) for name in DECLARED}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MethodOptions) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.to_dict().items()))

    def __repr__(self) -> str:
        return f"MethodOptions({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


def _rebuilt_options(values: dict[str, Any]) -> MethodOptions:
    return MethodOptions(**values)


@dataclass
class Context:
    """What an extraction sees: the model (through its Capturer), the episode, the options,
    and the train states h_zs / h_icl when some method already captured them (shared).

    `cap` may be None where only states are known (a transfer's source model, read from its
    capture store): hidden-space methods fit on the states alone; `head` (the LM head's
    weight, V × d) and `dtype` then stand in for what the model would tell."""

    cap: Capturer | None
    episode: Episode
    label_ids: list[int]
    opts: MethodOptions
    identity: ModelIdentity | None = None  # default: read from the model (name "model")
    h_zs: torch.Tensor | None = None   # (N, d) train queries, zero-shot
    h_icl: torch.Tensor | None = None  # (N, d) train queries after the demos
    capture_seconds: float = 0.0       # what capturing h_zs / h_icl cost
    timings: dict[str, float] = field(default_factory=dict)
    head: torch.Tensor | None = None   # W_lm (V, d) when there is no model
    dtype: str | None = None           # the states' precision when there is no model
    engine: dict[str, Any] | None = None  # what captured the states (default: transformers)

    def __post_init__(self) -> None:
        if self.identity is None:
            self.identity = model_identity(self.model)

    @property
    def model(self) -> nn.Module:
        if self.cap is None:
            raise MethodError("this method runs the model, and only its states are at hand")
        return self.cap.model

    def lm_head_weight(self) -> torch.Tensor:
        """W_lm (V, d) on the CPU, float32: the model's, else `head`."""
        w = self.head if self.head is not None else full_head(self.model)[0]
        return w.float().cpu()

    def provenance(self, method: str, **extra: Any) -> Provenance:
        """What an artifact records about how it was made (as a task-vector file does)."""
        ep = self.episode
        dtype = self.dtype or str(self.model.dtype)
        engine = self.engine
        if engine is None and self.cap is not None:  # captured here, by transformers
            import transformers

            engine = {"name": "transformers", "version": transformers.__version__,
                      "device": str(self.cap.device)}
        if ep.extra_demos:  # multi-prompt fitting: how many sets the target averaged
            extra = {"demo_sets": len(ep.demo_sets), **extra}
        return Provenance(method=method, task=ep.task.to_dict(), k_used=len(ep.demos),
                          n=len(ep.queries), lam=None,
                          seed=ep.seed, n_test=len(ep.test), episode=ep.fingerprint(),
                          dtype=dtype.removeprefix("torch."), engine=engine,
                          hardware=hardware(), package_version=__version__, extra=extra)

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """h_zs and h_icl on the N train queries, captured once per episode."""
        if self.h_zs is None or self.h_icl is None:
            task = self.episode.task
            queries = [task.query(e.text) for e in self.episode.queries]
            t0 = time.perf_counter()
            cap = self.cap
            if cap is None:
                raise MethodError("no model to capture the train states with")
            self.h_zs = zero_shot_states(cap, task, [e.text for e in self.episode.queries],
                                         desc=f"{task.name} zero-shot train")
            self.h_icl = icl_states(cap, self.episode, queries,
                                    desc=f"{task.name} icl train")
            self.capture_seconds = time.perf_counter() - t0
        return self.h_zs, self.h_icl


class Method:
    """Base class: `name`, `hidden_space`, `needs_val`; extract / applied (/ shift)."""

    name: str = ""
    label: str = ""
    hidden_space = False  # True: `shift` gives the final state, no forward pass needed
    uses_states = False   # fitted on the train states h_zs / h_icl (their capture is its cost)
    needs_val = False     # chooses a layer on the episode's labelled validation examples
    options: tuple[Option, ...] = ()  # its own knobs (flags, defaults, checks)
    color = "black"                   # its colour in every plot
    # what its artifact can do beyond `applied` in transformers: "fused" / "folded" / "lora"
    # (served by vLLM that way), "regression" (scored on generated numbers), "generation"
    supports: frozenset[str] = frozenset()
    compare_with: tuple[str, ...] = ()  # baselines `extract` scores beside it (cheap ones)

    def extract(self, ctx: Context) -> Any:
        raise NotImplementedError

    def applied(self, model: nn.Module, art: Any) -> Any:
        """A context manager under which `model` runs with the artifact applied."""
        raise NotImplementedError

    def shift(self, art: Any, h: torch.Tensor) -> torch.Tensor:
        """Hidden-space methods: the final state the LM head sees, from h_zs. (n, d)"""
        raise NotImplementedError(f"{self.name} is not a hidden-space method")

    def params(self, art: Any) -> dict[str, Any] | None:
        """What the method chose for this episode (a layer, λ), for the evaluation records."""
        params = getattr(art, "params", None)
        return dict(params) if params is not None else None

    def layer_task(self, art: Any) -> Any:  # noqa: ARG002 - one signature
        """The artifact as a layer task a server applies (`core.layer_task`), doing exactly
        what `applied` does, so `evaluate`'s number is the served one; a method whose edit is
        not a shift of decoder blocks' outputs has none."""
        raise MethodError(f"{self.name}: no layer-task form (its edit is not a shift of "
                          "decoder blocks' outputs); tv, fv and ltv-layer serve as layer "
                          "tasks")


# -- the decoder's parts ----------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks (Llama, Qwen2, Mistral, ...: `model.model.layers`)."""
    layers = getattr(base_model(model), "layers", None)  # type: ignore[arg-type]
    if not isinstance(layers, nn.ModuleList):
        raise MethodError(f"{type(model).__name__}: no decoder layer list to hook "
                          "(the layer methods support Llama-style models)")
    return layers


def attention(layer: nn.Module) -> nn.Module:
    attn = getattr(layer, "self_attn", None)
    if attn is None or not isinstance(getattr(attn, "o_proj", None), nn.Linear):
        raise MethodError(f"{type(layer).__name__}: no self_attn.o_proj to hook "
                          "(the layer methods support Llama-style models)")
    return attn


def mlp(layer: nn.Module) -> nn.Module:
    m = getattr(layer, "mlp", None)
    if m is None:
        raise MethodError(f"{type(layer).__name__}: no mlp module to hook")
    return m


def head_dim(model: nn.Module) -> tuple[int, int]:
    """(number of attention heads, per-head width) of the o_proj input."""
    cfg = model.config
    n = int(cfg.num_attention_heads)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // n
    return n, int(hd)


# -- hooks ------------------------------------------------------------------------------------

Edit = Callable[[torch.Tensor], torch.Tensor]  # (B, T, D) → (B, T, D), never in place

# While `last_token_states` runs its candidates packed along one sequence after the cached
# prefix, the tensors an edit gets are (1, R, D), candidate r at position r; edits are written
# for the batch layout (row r, last position), so they are shown the transpose (R, 1, D).
_ROWS_ON_SEQUENCE: ContextVar[bool] = ContextVar("rows_on_sequence", default=False)


def _in_layout(fn: Edit) -> Edit:
    def run(x: torch.Tensor) -> torch.Tensor:
        if _ROWS_ON_SEQUENCE.get():
            return fn(x.transpose(0, 1)).transpose(0, 1)
        return fn(x)

    return run


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _with_first(out: Any, x: torch.Tensor) -> Any:
    return (x, *out[1:]) if isinstance(out, tuple) else x


@contextmanager
def edits(
    outputs: Sequence[tuple[nn.Module, Edit]] = (),
    inputs: Sequence[tuple[nn.Module, Edit]] = (),
) -> Iterator[None]:
    """Edit modules' outputs (first element of a tuple output) and first inputs for the
    duration of the block; every hook is removed on exit, whatever happens inside."""
    with ExitStack() as stack:
        for mod, edit in outputs:
            fn = _in_layout(edit)
            h = mod.register_forward_hook(
                lambda _m, _a, out, fn=fn: _with_first(out, fn(_first(out))))
            stack.callback(h.remove)
        for mod, edit in inputs:
            fn = _in_layout(edit)
            h = mod.register_forward_pre_hook(lambda _m, args, fn=fn: (fn(args[0]), *args[1:]))
            stack.callback(h.remove)
        yield


@contextmanager
def records(
    outputs: Sequence[nn.Module] = (), inputs: Sequence[nn.Module] = (), *,
    positions: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]]:
    """Record modules' outputs / first inputs at the last position (or `positions(x)`, which
    picks rows from x (B, T, D) → (n, D)) of every forward in the block, float32 on CPU."""
    pick = positions or (lambda x: x[:, -1])
    outs: list[list[torch.Tensor]] = [[] for _ in outputs]
    ins: list[list[torch.Tensor]] = [[] for _ in inputs]
    with ExitStack() as stack:
        for i, mod in enumerate(outputs):
            h = mod.register_forward_hook(
                lambda _m, _a, out, i=i: outs[i].append(pick(_first(out)).float().cpu()))
            stack.callback(h.remove)
        for i, mod in enumerate(inputs):
            h = mod.register_forward_pre_hook(
                lambda _m, args, i=i: ins[i].append(pick(args[0]).float().cpu()))
            stack.callback(h.remove)
        yield outs, ins


def set_last(x: torch.Tensor, rows: torch.Tensor | None, value: torch.Tensor,
             cols: slice = slice(None), *, add: bool = False) -> torch.Tensor:
    """x with its last position's `cols` set to (or increased by) `value` in `rows` (a bool
    mask over the batch; None: every row). value: (D,) or one row per selected row."""
    y = x.clone()
    r = slice(None) if rows is None else rows
    v = value.to(device=x.device, dtype=x.dtype)
    if add:
        y[r, -1, cols] = y[r, -1, cols] + v
    else:
        y[r, -1, cols] = v
    return y


# -- passes -----------------------------------------------------------------------------------


def prefix_of(cap: Capturer, ids: list[int]) -> Prefix:
    """The KV cache of `ids` (batch 1), never written by later passes."""
    with torch.no_grad():
        out = cap.base(input_ids=torch.tensor([ids], device=cap.device),
                       attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                 device=cap.device),
                       use_cache=True)
    return Prefix(ids=list(ids), cache=out.past_key_values)


def last_token_states(cap: Capturer, ids: list[int], rows: int,
                      prefix: Prefix | None = None) -> torch.Tensor:
    """h at the last token of `ids`, run `rows` times against one KV cache of the earlier
    tokens (pass it as `prefix` to reuse it): under a hook whose edit differs per row, each
    row is one candidate. (rows, d) float32

    The copies are packed into one sequence after the prefix (each sees the prefix and itself:
    `Capturer.forward_packed`), so the prefix's keys and values are not copied once per row,
    which on CPU cost more than the rows' own compute (FV's head sweep over a k=30 prompt);
    `edits` show hooks the batch layout either way. Kernels without a custom mask run the
    rows as a batch."""
    if len(ids) < 2:
        raise MethodError("a prompt of one token has no earlier positions to cache")
    pre = prefix or prefix_of(cap, ids[:-1])
    if cap.packed:
        token = _ROWS_ON_SEQUENCE.set(True)
        try:
            return cap.forward_packed([[ids[-1]]] * rows, pre)
        finally:
            _ROWS_ON_SEQUENCE.reset(token)
    last = torch.full((rows, 1), ids[-1], dtype=torch.long)
    return cap.forward_last(last, torch.ones_like(last), pre)


def restricted(cap: Capturer, h: torch.Tensor, label_ids: Sequence[int]) -> torch.Tensor:
    """Label-restricted logits (n, K) from final states h (n, d)."""
    w_c, b_c = label_head(cap.model, label_ids)
    return h @ w_c.T + b_c


def full_log_probs(cap: Capturer, h: torch.Tensor) -> torch.Tensor:
    """log-softmax over the whole vocabulary from final states h (n, d), float64."""
    head = lm_head(cap.model)
    with torch.no_grad():
        z = head(h.to(device=head.weight.device, dtype=head.weight.dtype))
    return torch.log_softmax(z.double().cpu(), -1)


def choose_on_val(
    ctx: Context,
    candidates: Sequence[int],
    edit_for: Callable[[torch.Tensor], Any],
    desc: str,
) -> tuple[int, list[float]]:
    """Pick the candidate with the best accuracy on the episode's labelled validation set
    (ties: the higher mean log-probability of the right label, restricted to the labels).

    `edit_for(values)` returns a context manager that applies candidate `values[r]` to row r
    of a batch (candidates are ints: layers, depths): each validation prompt's earlier tokens
    run once, its last token once per candidate.
    """
    from tqdm.auto import tqdm

    val = ctx.episode.val
    if len(val) < 2:
        raise MethodError(f"{desc}: needs labelled validation examples (the paper uses 32) and "
                          f"the episode has {len(val)}; pass --n-val")
    task = ctx.episode.task
    values = torch.tensor(list(candidates))
    correct = torch.zeros(len(candidates))
    logp = torch.zeros(len(candidates))
    for e in tqdm(val, desc=desc, unit="example", disable=not ctx.opts.progress, leave=False):
        ids = ctx.cap.encode(task.query(e.text))
        pre = prefix_of(ctx.cap, ids[:-1])
        z = []
        for chunk in values.split(ctx.opts.batch_size):
            with edit_for(chunk):
                z.append(restricted(ctx.cap, last_token_states(ctx.cap, ids, len(chunk), pre),
                                    ctx.label_ids))
        lp = torch.log_softmax(torch.cat(z).double(), -1)
        correct += (lp.argmax(-1) == e.label).float()
        logp += lp[:, e.label].float()
    score = [(float(c), float(p)) for c, p in zip(correct, logp, strict=True)]
    best = max(range(len(candidates)), key=lambda i: score[i])
    return candidates[best], [c / len(val) for c, _ in score]


def examples_prompts(task: Any, examples: Sequence[Example]) -> list[str]:
    return [task.query(e.text) for e in examples]


def extend_prefix(cap: Capturer, pre: Prefix, ids: list[int]) -> Prefix:
    """The KV cache of pre.ids + ids, computed from `pre`'s (which is left as it was)."""
    from transformers import DynamicCache

    cache = DynamicCache(ddp_cache_data=[(layer.keys, layer.values) for layer in pre.cache.layers],
                         config=cap.model.config)
    n = len(pre.ids)
    with torch.no_grad():
        out = cap.base(input_ids=torch.tensor([ids], device=cap.device),
                       attention_mask=torch.ones(1, n + len(ids), dtype=torch.long,
                                                 device=cap.device),
                       position_ids=torch.arange(n, n + len(ids), device=cap.device)[None],
                       past_key_values=cache, use_cache=True)
    return Prefix(ids=pre.ids + list(ids), cache=out.past_key_values)


def after_prefix(cap: Capturer, pre: Prefix, prefix: str, prompt: str) -> tuple[list[int], int]:
    """Token ids of prefix + prompt, and how many of them `pre` covers: len(pre.ids), or 0
    when the prompt's tokenisation merges across the boundary (then run it in full)."""
    full = cap.encode(prefix + prompt)
    n = len(pre.ids)
    return full, (n if full[:n] == pre.ids and len(full) > n else 0)


def run_after(cap: Capturer, pre: Prefix, prefix: str, prompt: str) -> torch.Tensor:
    """h at the last token of prefix + prompt, batch 1, reusing the prefix's cache. (1, d)"""
    full, n = after_prefix(cap, pre, prefix, prompt)
    ids = torch.tensor([full[n:]])
    return cap.forward_last(ids, torch.ones_like(ids), pre if n else None)


@contextmanager
def at_last(model: nn.Module, values: torch.Tensor, layer: int | torch.Tensor, *,
            add: bool = False) -> Iterator[None]:
    """Decoder layer outputs at the last position := values[layer] (or += with `add`);
    `layer` an int (every row) or one layer per batch row (a sweep: row r tries layer[r])."""
    layers = decoder_layers(model)
    if isinstance(layer, int):
        plan: dict[int, torch.Tensor | None] = {layer: None}
    else:
        plan = {int(ell): layer == ell for ell in layer.unique()}
    with edits(outputs=[(layers[ell], lambda x, ell=ell, rows=rows:
                         set_last(x, rows, values[ell], add=add))
                        for ell, rows in plan.items()]):
        yield
