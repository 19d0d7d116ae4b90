"""TaskVector: the one object that travels from extraction to application and serving.

A hidden-space vector (kind "hidden") maps the post-norm hidden state h (d) to
    h_tv = h + U (Vᵀ h) + bias
right before the LM head. A logit-space vector (kind "logit", cross-model transfer) adds
U (Vᵀ h) + bias to the logits (U is vocab-sized). `bias` carries the constant-mapping
baseline; LTV itself has none.

Files describe themselves and are checked on load:
  *.safetensors  tensors U, V[, bias] + a JSON header under the metadata key "ltv_vllm";
  *.pt           a dict of tensors and one JSON string, read with torch.load(weights_only=True).
Neither format can run code when loaded (`core.vector_files` reads them). Writes go to a temp
file that is renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import torch

from ltv_vllm.core.fileio import atomic_write
from ltv_vllm.core.kernel import rbf_delta
from ltv_vllm.core.ridge import Factors, head_gram, low_rank_delta, truncate
from ltv_vllm.core.vector_files import VectorError, read_safetensors, torch_load
from ltv_vllm.tasks.specs import is_regression, label_token_ids, task_from_dict

FORMAT = "ltv-vllm-task-vector"
FORMAT_VERSION = 2  # 2: the optional nonlinear `map` (files without one are written as 1)
Kind = Literal["hidden", "logit"]


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    hidden_size: int
    vocab_size: int
    lm_head_fingerprint: str
    # Decoder depth: a copy keeping only its first layers (`ltv-vllm models derive`) shares the
    # LM head, so the fingerprint alone would not tell it apart. None in files that predate it.
    num_layers: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "lm_head_fingerprint": self.lm_head_fingerprint,
        }
        if self.num_layers is not None:
            d["num_layers"] = self.num_layers
        return d

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> ModelIdentity:
        layers = m.get("num_layers")
        return cls(
            name=str(m["name"]),
            hidden_size=int(m["hidden_size"]),
            vocab_size=int(m["vocab_size"]),
            lm_head_fingerprint=str(m["lm_head_fingerprint"]),
            num_layers=int(layers) if layers is not None else None,
        )


def fingerprint_lm_head(weight: torch.Tensor) -> str:
    """A short hash of the LM-head weight that survives a dtype change.

    Hashes a strided sample of ~4096 rows rounded to bfloat16: a bf16 model and the fp32
    model it came from (or vLLM's copy of either) give the same value; another model does not.
    """
    vocab = weight.shape[0]
    rows = torch.arange(0, vocab, max(1, vocab // 4096), device=weight.device)
    sample = weight.detach().index_select(0, rows).to(torch.bfloat16).float().cpu().contiguous()
    h = hashlib.sha256()
    h.update(f"{tuple(weight.shape)}".encode())
    h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def model_identity(model: Any, name: str | None = None) -> ModelIdentity:
    """Identity of a transformers causal LM (the model a vector is fitted on or applied to)."""
    head = model.get_output_embeddings()
    cfg = (model.config.get_text_config() if hasattr(model.config, "get_text_config")
           else model.config)
    return ModelIdentity(
        name=name or str(getattr(cfg, "_name_or_path", "") or type(model).__name__),
        hidden_size=int(cfg.hidden_size),
        vocab_size=int(head.weight.shape[0]),
        lm_head_fingerprint=fingerprint_lm_head(head.weight),
        num_layers=_num_layers(cfg),
    )


def _num_layers(cfg: Any) -> int | None:
    n = (cfg.get("num_hidden_layers") if isinstance(cfg, dict)
         else getattr(cfg, "num_hidden_layers", None))
    return int(n) if n is not None else None


_INT_FIELDS = ("k", "k_used", "n", "seed", "n_test", "metrics_rank")
_STR_FIELDS = ("method", "episode", "ridge_form", "dtype", "package_version", "shift_steps")

# What an extracted vector recommends its server shift: the first generated token only. At
# every token a classification vector turns free text into label runs (trec " Ab Ab Ab ...")
# and a regression vector into dash or digit runs; at the first it answers like ICL and then
# writes on as the model would (benchmarks/results/step_policy_smollm2-135m: 84-99 % clean
# answers; docs/regression.md: every answer parses).
DEFAULT_SHIFT_STEPS = "first"
ALL = None  # the policy "every step"


def parse_steps(value: Any) -> int | None:
    """A step policy, as a vector's `meta.shift_steps`, `serve --shift-steps` and a request's
    `ltv_steps` spell it: `all` | `first` | a count n ≥ 0 (an int, or a string of ASCII
    digits) → the number of leading generated tokens shifted (None: every one); a layer
    task's positions (`core.layer_task`) `last`, `prompt` (1) and `generated` (every one)
    are the same vocabulary, their prompt part read by `LayerPolicy.parse`. Anything
    else is a ValueError (JSON `true` is not 1, nor is "١" or "２" a digit here)."""
    if value == "all" and isinstance(value, str):
        return ALL
    if value in ("first", "last", "prompt") and isinstance(value, str):
        return 1  # a layer task's "last" and "prompt" also shift the first token's row
    if value == "generated" and isinstance(value, str):
        return ALL
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_STEPS:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(f"ltv_steps must be 'all', 'first' or a count from 0 to "
                         f"{MAX_STEPS - 1} (or a layer task's 'last', 'prompt', "
                         f"'generated'), got {shown}")
    return value


# counts past this are "all" in effect; vLLM reads xargs numbers as int64 (and Python's int()
# refuses over 4,300 digits with a message of its own): a clear 400 here instead
MAX_STEPS = 1 << 62
_DICT_FIELDS = ("task", "hardware", "timings", "source_model", "source_load", "metrics",
                "engine", "prompt_format", "teacher")
PROMPT_DEMOS = ("turns", "inline")


def check_prompt_format(v: dict[str, Any], where: str = "meta.prompt_format") -> None:
    """A vector's prompt format as a server reads it: {"name": "completion"}, or {"name":
    "chat", "demos": "turns"|"inline", "template_sha256": 64 hex digits}."""
    name = v.get("name")
    if name == "completion":
        return
    if name != "chat":
        raise VectorError(f"{where}.name: 'completion' or 'chat', got {str(name)[:40]!r}")
    if v.get("demos") not in PROMPT_DEMOS:
        raise VectorError(f"{where}.demos: one of {', '.join(PROMPT_DEMOS)}, "
                          f"got {str(v.get('demos'))[:40]!r}")
    digest = v.get("template_sha256")
    if not (isinstance(digest, str) and len(digest) == 64
            and all(c in "0123456789abcdef" for c in digest)):
        raise VectorError(f"{where}.template_sha256: 64 lowercase hex digits")


def check_demonstrations(v: Any, where: str = "meta.demonstrations") -> None:
    """A vector's demonstration sets as a server reads them: a non-empty list of non-empty
    lists of {"text": str, "label": int | float}, nothing else (a server builds ICL prompts
    from them)."""
    if not isinstance(v, list) or not v:
        raise VectorError(f"{where}: a non-empty list of demonstration sets, got {_kind(v)}")
    for i, demos in enumerate(v):
        if not isinstance(demos, list) or not demos:
            raise VectorError(f"{where}[{i}]: a non-empty list of demonstrations, "
                              f"got {_kind(demos)}")
        for j, e in enumerate(demos):
            label = e.get("label") if isinstance(e, dict) else None
            if (not isinstance(e, dict) or set(e) != {"text", "label"}
                    or not isinstance(e["text"], str) or isinstance(label, bool)
                    or not isinstance(label, int | float)
                    or not math.isfinite(float(label))):
                raise VectorError(f"{where}[{i}][{j}]: an object {{text: string, label: "
                                  "number}}")


def _kind(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def finite_or_none(v: Any) -> Any:
    """v with every NaN/inf float replaced by None: a metric undefined at extraction (an MSE
    with nothing parsed) must not make the file unloadable, nor its meta (or a server's
    answer about it) invalid JSON."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite_or_none(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [finite_or_none(x) for x in v]
    return v


@dataclass(frozen=True)
class Provenance:
    """How a task vector was made: the file's `meta`, typed and frozen (as `ModelIdentity`).

    Every field is optional (files from older versions, hand-made vectors); keys this version
    does not know are kept in `extra` and written back, so a round trip loses nothing.
    """

    method: str | None = None                  # "ltv", "ltv-transfer", ...
    task: dict[str, Any] | None = None         # the Task spec (`Task.to_dict`)
    k: int | None = None                       # demonstrations asked for
    k_used: int | None = None                  # demonstrations used (k//K per class)
    n: int | None = None                       # unlabeled train queries N
    lam: float | None = None                   # ridge penalty λ
    seed: int | None = None
    n_test: int | None = None
    episode: str | None = None                 # fingerprint of demos, queries and test subset
    ridge_form: str | None = None              # "primal" | "dual"
    metrics_rank: int | None = None            # the rank the metrics were measured at
    dtype: str | None = None                   # precision of the extraction passes
    hardware: dict[str, Any] | None = None     # `hardware.hardware()` of the extracting machine
    package_version: str | None = None
    metrics: dict[str, dict[str, float]] | None = None  # method → accuracy, d_ntp at extraction
    timings: dict[str, float] | None = None
    source_model: dict[str, Any] | None = None  # transfer: the source's ModelIdentity
    source_load: dict[str, Any] | None = None   # transfer: how the source was loaded
    engine: dict[str, Any] | None = None        # what captured the states: name, version,
    #                                             dtype, tensor/pipeline parallel sizes
    shift_steps: str | None = None  # the generated tokens a server shifts by default:
    #                                 "first" | "all" | "N" (None: older files, "all")
    # the prompts it was fitted on: {"name": "chat", "demos", "template_sha256"} through a
    # chat template (`tasks.chat`); None or {"name": "completion"}: the completion format
    prompt_format: dict[str, Any] | None = None
    # the demonstration sets it was fitted on, each [{"text", "label"}, ...] (label: the class
    # index, a regression task's number): a server re-asks sampled requests with the first
    # set's ICL prompt to watch its fidelity live (`api_server.fidelity`)
    demonstrations: list[list[dict[str, Any]]] | None = None
    # what it was fitted to imitate (`core.teacher`): calibration, gold weight and share,
    # and the demonstration prefix's token count
    teacher: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Provenance:
        """Type the known keys; a key of the wrong type is one VectorError line naming it
        (a file's `meta` is untrusted input: a server reads uploads with this)."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise VectorError(f"meta: an object, got {_kind(d)}")
        d = dict(d)
        known = {f.name for f in fields(cls)} - {"extra"}
        kw: dict[str, Any] = {k: d.pop(k) for k in list(d) if k in known}
        # None is "not recorded", whatever the field
        for k, v in kw.items():
            if v is None:
                continue
            where = f"meta.{k}"
            if k in _INT_FIELDS:
                # bool is an int to Python, never a count to us
                if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                    raise VectorError(f"{where}: an integer, got {_kind(v)}")
                kw[k] = int(v)
            elif k == "lam":
                if isinstance(v, bool) or not isinstance(v, numbers.Real):
                    raise VectorError(f"{where}: a finite number, got {_kind(v)}")
                if not math.isfinite(float(v)):
                    raise VectorError(f"{where}: a finite number, got {float(v)}")
                kw[k] = float(v)
            elif k in _STR_FIELDS:
                if not isinstance(v, str):
                    raise VectorError(f"{where}: a string, got {_kind(v)}")
                if k == "shift_steps":
                    # a server reads it for every request that names no policy: a value it
                    # cannot parse must never get that far (a file is checked where it enters)
                    try:
                        parse_steps(v)
                    except ValueError:
                        raise VectorError(f"{where}: {v[:40]!r} is not a step policy ('all', "
                                          "'first' or a count ≥ 0)") from None
            elif k in _DICT_FIELDS:
                if not isinstance(v, dict):
                    raise VectorError(f"{where}: an object, got {_kind(v)}")
                if k == "metrics":
                    for m, sc in v.items():
                        if not isinstance(sc, dict):
                            raise VectorError(f"{where}[{m!r}]: an object, got {_kind(sc)}")
                if k in ("metrics", "timings"):
                    kw[k] = finite_or_none(v)
                if k == "prompt_format":
                    check_prompt_format(v)
            elif k == "demonstrations":
                check_demonstrations(v, where)
        return cls(**kw, extra=d)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name != "extra" and getattr(self, f.name) is not None}
        return {**out, **self.extra}


@dataclass(frozen=True)
class TaskVector:
    kind: Kind
    U: torch.Tensor            # (d_out, r): d_out = hidden size (hidden) or vocab (logit)
    V: torch.Tensor            # (d_in, r): d_in = hidden size of the model it is applied to
    bias: torch.Tensor | None  # (d_out,) or None
    model: ModelIdentity
    label_token_ids: tuple[int, ...]
    # how it was made; a plain dict (a file's `meta`) is accepted and typed on construction
    provenance: Provenance = field(default_factory=Provenance)
    gram: torch.Tensor | None = None  # (r, r) training states in V's coordinates (rank cuts)
    # "linear": W h = U Vᵀ h; "rbf": U exp(−gamma ‖h − V_j‖²)_j, V's columns the support
    # states (`kernel`): not linear, so never folded, carried as a LoRA or cut in rank
    map: str = "linear"
    gamma: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.provenance, dict):
            object.__setattr__(self, "provenance", Provenance.from_dict(self.provenance))
        if self.kind not in ("hidden", "logit"):
            raise VectorError(f"kind must be 'hidden' or 'logit', got {self.kind!r}")
        if self.U.ndim != 2 or self.V.ndim != 2 or self.U.shape[1] != self.V.shape[1]:
            raise VectorError(
                f"factors must be U (d_out, r) and V (d_in, r); got {tuple(self.U.shape)}, "
                f"{tuple(self.V.shape)}"
            )
        d_out = self.model.hidden_size if self.kind == "hidden" else self.model.vocab_size
        if self.U.shape[0] != d_out or self.V.shape[0] != self.model.hidden_size:
            raise VectorError(
                f"{self.kind} vector for hidden size {self.model.hidden_size} / vocab "
                f"{self.model.vocab_size} has factors {tuple(self.U.shape)}, {tuple(self.V.shape)}"
            )
        if self.bias is not None and tuple(self.bias.shape) != (d_out,):
            raise VectorError(f"bias must have shape ({d_out},), got {tuple(self.bias.shape)}")
        if self.map not in ("linear", "rbf"):
            raise VectorError(f"map must be 'linear' or 'rbf', got {self.map!r}")
        if (self.map == "rbf") != (self.gamma is not None) or (
                self.gamma is not None and not self.gamma > 0):
            raise VectorError("an rbf map needs its gamma > 0, a linear one none")
        r = self.U.shape[1]
        if self.gram is not None and tuple(self.gram.shape) != (r, r):
            raise VectorError(f"gram must have shape ({r}, {r}), got {tuple(self.gram.shape)}")
        # a NaN/inf factor would turn every served logit into NaN: refuse it where it enters
        for name in ("U", "V", "bias", "gram"):
            t = getattr(self, name)
            if t is not None and not bool(torch.isfinite(t).all()):
                raise VectorError(f"task vector {self.task_name!r}: {name} holds non-finite "
                                  "values (NaN or inf)")

    @property
    def rank(self) -> int:
        return int(self.U.shape[1])

    @property
    def meta(self) -> dict[str, Any]:
        """The provenance as the JSON dict a file stores (read-only view)."""
        return self.provenance.to_dict()

    @property
    def task_name(self) -> str:
        return str((self.provenance.task or {}).get("name", "?"))

    def truncated(self, rank: int, lm_head: torch.Tensor | None = None) -> TaskVector:
        """This vector cut to rank `rank` (unchanged if rank ≥ its own), losing as little as
        possible of its effect on the training states (`gram`) as seen through `lm_head`
        (vocab, d) for a hidden-space vector: see `ridge.truncate`.

        The metrics in `provenance` stay those measured at extraction, at its `metrics_rank`.
        """

        if rank >= self.rank:
            return self
        self.require_linear("cut to a lower rank")
        hg = head_gram(lm_head) if self.kind == "hidden" and lm_head is not None else None
        try:
            f = truncate(Factors(self.U, self.V, form=str(self.provenance.ridge_form or "?"),
                                 gram=self.gram), rank, head_gram=hg)
        except torch.linalg.LinAlgError:
            # a Gram matrix of real states is positive semi-definite (and jittered to
            # definite): one that is not was damaged or hand-made
            raise VectorError(f"task vector {self.task_name!r}: its gram is not positive "
                              "definite, so it cannot be cut in rank (a damaged file)") from None
        return replace(self, U=f.U, V=f.V, gram=f.gram)

    def to(self, device: torch.device | str | None = None,
           dtype: torch.dtype | None = None) -> TaskVector:
        """A copy whose U, V and bias live on `device` in `dtype` (as steering-vectors'
        `SteeringVector.to`): the one explicit point where a stored float32 CPU vector meets a
        model. `gram` stays as it is (float32, CPU: it only serves rank cuts)."""

        # Tensor.to returns the tensor itself when nothing changes: no copy then
        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.to(device=device, dtype=dtype) if t is not None else None

        return replace(self, U=cast(self.U), V=cast(self.V), bias=cast(self.bias))

    def delta(self, h: torch.Tensor, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        """U (Vᵀ h) + bias for rows h (B, d_in) → (B, d_out), only the outputs `rows` if given.

        h must share the vector's device and dtype: cast the vector once with `to`.
        """
        if self.map == "rbf":
            assert self.gamma is not None
            return rbf_delta(h, self.U, self.V, self.gamma, self.bias, rows)

        return low_rank_delta(h, self.U, self.V, self.bias, rows)

    def require_linear(self, what: str) -> None:
        """One line for a use only a linear map supports (folding, a LoRA, a rank cut)."""
        if self.map != "linear":
            raise VectorError(f"task vector {self.task_name!r} has a nonlinear ({self.map}) "
                              f"map, which cannot be {what}; serve it fused (one vector, "
                              "no --fold)")

    def shift_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """h_tv = h + W h (+ bias) for a hidden-space vector. (B, d)"""
        if self.kind != "hidden":
            raise VectorError("shift_hidden needs a hidden-space vector; this one is logit-space")
        return h + self.delta(h)

    # -- validation ---------------------------------------------------------------------
    def check_model(self, ident: ModelIdentity) -> None:
        """Refuse a model this vector was not fitted on, with a one-line reason."""
        check_identity(self.model, ident, f"task vector {self.task_name!r}")

    def check_tokenizer(self, tokenizer: Any) -> None:
        """The label words must still map to the token ids recorded at extraction."""

        task = task_from_dict(self.provenance.task or {})
        if is_regression(task):
            return  # a generated number: no label tokens to check
        ids = tuple(label_token_ids(task, tokenizer))
        if ids != self.label_token_ids:
            raise VectorError(
                f"task vector {self.task_name!r}: label tokens {list(self.label_token_ids)} were "
                f"recorded at extraction, but this tokenizer gives {list(ids)}"
            )

    # -- files --------------------------------------------------------------------------
    def _header(self) -> dict[str, Any]:
        head = {
            # a linear file keeps format 1, so older readers still load it; a kernel file is
            # 2, so they refuse it instead of applying its factors as a linear map
            "format": FORMAT,
            "format_version": 1 if self.map == "linear" else FORMAT_VERSION,
            "kind": self.kind,
            "model": self.model.to_dict(),
            "label_token_ids": list(self.label_token_ids),
            "meta": self.provenance.to_dict(),
        }
        if self.map != "linear":
            head["map"] = {"kind": self.map, "gamma": self.gamma}
        return head

    def _tensors(self) -> dict[str, torch.Tensor]:
        t = {"U": self.U.float().contiguous(), "V": self.V.float().contiguous()}
        if self.bias is not None:
            t["bias"] = self.bias.float().contiguous()
        if self.gram is not None:
            t["gram"] = self.gram.float().contiguous()
        return t

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        suffix = path.suffix
        if suffix not in (".pt", ".safetensors"):
            raise VectorError(f"task-vector files end in .pt or .safetensors, got {path.name!r}")
        header = json.dumps(self._header())
        if suffix == ".safetensors":
            from safetensors.torch import save_file

            return atomic_write(
                path, lambda tmp: save_file(self._tensors(), tmp, metadata={"ltv_vllm": header})
            )
        return atomic_write(
            path, lambda tmp: torch.save({"tensors": self._tensors(), "ltv_vllm": header}, tmp)
        )


def check_identity(mine: ModelIdentity, ident: ModelIdentity, what: str) -> None:
    """Refuse model `ident` for an artifact (`what`) made on model `mine`, in one line."""
    if ident.hidden_size != mine.hidden_size:
        raise VectorError(
            f"{what} is for hidden size {mine.hidden_size} "
            f"({mine.name}), but the model has hidden size {ident.hidden_size} ({ident.name})"
        )
    if ident.vocab_size != mine.vocab_size:
        raise VectorError(
            f"{what} is for vocabulary size {mine.vocab_size} "
            f"({mine.name}), but the model has {ident.vocab_size} ({ident.name})"
        )
    if ident.lm_head_fingerprint != mine.lm_head_fingerprint:
        raise VectorError(
            f"{what} was extracted from {mine.name} (LM head "
            f"{mine.lm_head_fingerprint}), not from {ident.name} (LM head "
            f"{ident.lm_head_fingerprint})"
        )
    if None not in (ident.num_layers, mine.num_layers) and ident.num_layers != mine.num_layers:
        raise VectorError(
            f"{what} was extracted from {mine.name} "
            f"({mine.num_layers} layers), not from {ident.name} ({ident.num_layers} layers)"
        )


def _parse(header_json: Any, tensors: dict[str, Any], path: Path) -> TaskVector:
    if header_json is None:
        raise VectorError(f"{path}: not an ltv-vllm task-vector file (no ltv_vllm header)")
    try:
        header = json.loads(header_json)
    except (TypeError, json.JSONDecodeError):
        raise VectorError(f"{path}: task-vector header is not valid JSON") from None
    if isinstance(header, dict) and header.get("format") == "ltv-vllm-method-artifact":
        raise VectorError(f"{path}: a {header.get('method')!r} artifact (a baseline method), "
                          "not a task vector: only ltv and mean vectors are served")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise VectorError(f"{path}: not an ltv-vllm task-vector file")
    if header.get("kind") == "layer":  # `core.layer_task`: read by what applies it at a layer
        layers = (header.get("layer") or {}).get("layers") if isinstance(
            header.get("layer"), dict) else None
        raise VectorError(f"{path}: a layer task (it shifts decoder blocks "
                          f"{str(layers)[:40]}), where a final-layer task vector is needed")
    if header.get("format_version", 0) > FORMAT_VERSION:
        raise VectorError(
            f"{path}: written by a newer ltv-vllm (format {header['format_version']}); upgrade"
        )
    for name in ("U", "V"):
        if not isinstance(tensors.get(name), torch.Tensor):
            raise VectorError(f"{path}: missing tensor {name!r}")
    try:
        ident = ModelIdentity.from_dict(header["model"])
        kmap = header.get("map") or {"kind": "linear", "gamma": None}
        return TaskVector(
            kind=header["kind"],
            U=tensors["U"].float(),
            V=tensors["V"].float(),
            bias=tensors["bias"].float() if "bias" in tensors else None,
            model=ident,
            label_token_ids=tuple(int(i) for i in header["label_token_ids"]),
            provenance=Provenance.from_dict(header.get("meta")),
            gram=tensors["gram"].float() if "gram" in tensors else None,
            map=str(kmap["kind"]),
            gamma=float(kmap["gamma"]) if kmap.get("gamma") is not None else None,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # any malformed header
        if isinstance(e, VectorError):
            raise VectorError(f"{path}: {e}") from None
        raise VectorError(f"{path}: malformed task-vector header ({e!r})") from None


def load_task_vector(path: str | Path) -> TaskVector:
    """Read a .pt or .safetensors task vector; refuses anything that is not one."""
    path = Path(path)
    if not path.is_file():
        raise VectorError(f"task-vector file not found: {path}")
    if path.suffix == ".safetensors":
        return _parse(*read_safetensors(path), path)
    if path.suffix == ".pt":
        obj = torch_load(path)
        if not isinstance(obj, dict) or not isinstance(obj.get("tensors"), dict):
            raise VectorError(f"{path}: not an ltv-vllm task-vector file")
        return _parse(obj.get("ltv_vllm"), obj["tensors"], path)
    raise VectorError(f"task-vector files end in .pt or .safetensors, got {path.name!r}")
