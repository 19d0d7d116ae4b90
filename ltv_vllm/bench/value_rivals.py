"""The value protocol's rivals that run the model (`ltv-vllm bench value`): the model handle
loaded on first need, the LoRA fine-tune, the vector `extract` ships, and LTV at a decoder
block — each stored beside the episode's states so a rerun reuses it. Runs in the bench's
process (transformers, offline)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.bench.value_rows import DEFAULT_LAM, Fit, Split, digest
from ltv_vllm.core.teacher import DEFAULT_GOLD_WEIGHT, TeacherOptions


@dataclass
class ModelHandle:
    """The model, loaded on first need (a rerun over stored states may never load it)."""

    opts: Any  # bench.value.ValueOptions
    lm: Any = None
    caps: dict[str, Any] = field(default_factory=dict)

    def capturer(self, task: Any) -> Any:
        from ltv_vllm.extraction.capture import Capturer
        from ltv_vllm.models.loading import load_model

        if self.lm is None:
            self.lm = load_model(self.opts.model, dtype=self.opts.dtype)
        if task.name not in self.caps:
            self.caps[task.name] = Capturer(self.lm.model, self.lm.tokenizer,
                                            batch_size=self.opts.batch_size, progress=True,
                                            special_tokens=task.special_tokens)
        return self.caps[task.name]


def lora_record(model: ModelHandle, task: Any, ep: Any, label_ids: Sequence[int],
                path: Path, *, adapter_needed: bool = False) -> dict[str, Any]:
    """The LoRA rival of one episode: trained with lr and epochs chosen on dev, its dev and
    test label logits stored at `path` and its adapter beside it (`adapter_dir`), so a rerun
    over stored states reuses them (and trains again only where the adapter is needed, for
    serving, and missing)."""
    from ltv_vllm.core.fileio import atomic_write
    from ltv_vllm.extraction.finetune import LoraOptions, LoraTuner

    lo = replace(model.opts.lora_options or LoraOptions(), seed=ep.seed)
    key = {**model.opts.state_key(), "seed": ep.seed, "lora": lo.record()}
    adapter = adapter_dir(path)
    if path.is_file() and (not adapter_needed or (adapter / "adapter_config.json").is_file()):
        rec = json.loads(path.read_text())
        if rec.get("key") == key:
            return rec
    model.capturer(task)  # loads the model
    lm = model.lm
    with LoraTuner(lm.model, lm.tokenizer, label_ids, special_tokens=task.special_tokens,
                   opts=lo) as tuner:
        choice = tuner.fit([task.zero_shot(e.text) for e in ep.queries],
                           [e.label for e in ep.queries],
                           [task.zero_shot(e.text) for e in ep.val], [e.label for e in ep.val])
        # the kept adapter's test logits: computed once, read only by `score_test`
        z_test = tuner.label_logits([task.zero_shot(e.text) for e in ep.test], desc="lora test")
        z_dev = tuner.label_logits([task.zero_shot(e.text) for e in ep.val], desc="lora dev")
        tuner.save(adapter)  # what vLLM's LoRA serves (`bench value --serving`)
    rec = {"key": key, "lr": choice.lr, "epoch": choice.epoch,
           "dev_accuracy": choice.dev_accuracy, "curve": choice.curve,
           "train_seconds": choice.train_seconds, "dev_logits": z_dev.tolist(),
           "test_logits": z_test.tolist()}
    atomic_write(path, lambda p: Path(p).write_text(json.dumps(rec)))
    return rec


def adapter_dir(lora_json: Path) -> Path:
    """The PEFT adapter directory kept beside an episode's LoRA record."""
    return lora_json.with_name(lora_json.name.replace(".lora.json", ".adapter"))


def default_vector(model: ModelHandle, task: Any, ep: Any, path: Path) -> Path:
    """The vector `extract` ships for this episode (its first demonstration set, the gold
    blend at DEFAULT_GOLD_WEIGHT, λ = 5), written to `path` (kept when already there)."""
    from ltv_vllm.pipeline.extract import ExtractOptions, extract

    if path.is_file():
        return path
    model.capturer(task)  # loads the model
    o = model.opts
    res = extract(model.lm, task, "ltv", ExtractOptions(
        k=o.k, n=o.n, lam=DEFAULT_LAM, seed=ep.seed, n_test=o.n_test, n_val=o.n_dev,
        batch_size=o.batch_size, progress=False,
        teacher=TeacherOptions(gold_weight=DEFAULT_GOLD_WEIGHT)),
        episode=replace(ep, extra_demos=()))
    res.artifact.save(path)
    return path


def stored_fit(rec: dict[str, Any], config: dict[str, Any], labels_used: int) -> Fit:
    """A rival computed apart (LoRA, the layer row) as a Fit: the logits its record stores
    of the split asked for, its dev accuracy as the record states it."""
    z = {s: torch.tensor(rec[f"{s}_logits"]) for s in ("dev", "test") if f"{s}_logits" in rec}

    def predict(s: Split) -> torch.Tensor:
        assert s.name in z, f"this row's record has no logits of a {s.name!r} split"
        return z[s.name]

    return Fit(config, predict, dev_accuracy=rec["dev_accuracy"], labels_used=labels_used,
               seconds=rec["train_seconds"])


def lora_fit(rec: dict[str, Any], train_n: int) -> Fit:
    """The LoRA row: the kept adapter's stored logits."""
    return stored_fit(rec, {"lr": rec["lr"], "epoch": rec["epoch"]}, train_n)


def layer_fit(rec: dict[str, Any]) -> Fit:
    """The layer row: the chosen block's test logits (no train label read)."""
    return stored_fit(rec, {"layer": rec["layer"], "lam": "auto", "lam_fitted": rec["lam"]}, 0)


def layer_record(model: ModelHandle, task: Any, ep: Any, label_ids: Sequence[int],
                 path: Path) -> dict[str, Any]:
    """The layer row of one episode (`--layer-rows`): `ltv-layer` fitted to the first k-shot
    prompt's states at every decoder block (λ by leave-one-out), the block chosen on the dev
    split (the method's own `choose_on_val`), then the test queries run once with the task
    applied as the method applies it (`Method.applied`, what `score_methods` does). Stored
    at `path` with the layer task beside it (`.layer.safetensors`), reused when its key
    matches."""
    from ltv_vllm.core.fileio import atomic_write
    from ltv_vllm.extraction.capture import label_head
    from ltv_vllm.methods import Context, get_method
    from ltv_vllm.pipeline.extract import ExtractOptions

    o = model.opts
    key = {**o.state_key(), "seed": ep.seed, "episode": ep.fingerprint(),
           "dev": digest(ep.val), "row": "ltv-layer"}
    if path.is_file():
        rec = json.loads(path.read_text())
        if rec.get("key") == key:
            return rec
    cap = model.capturer(task)  # loads the model
    one = replace(ep, extra_demos=())  # the first k-shot set: the prompt the row replaces
    mopts = ExtractOptions(k=o.k, n=o.n, lam="auto", seed=ep.seed, n_test=o.n_test,
                           n_val=o.n_dev, batch_size=o.batch_size).method_options()
    ctx = Context(cap, one, list(label_ids), mopts)
    m = get_method("ltv-layer")
    t0 = time.perf_counter()
    art = m.extract(ctx)
    seconds = time.perf_counter() - t0
    w_c, b_c = label_head(cap.model, list(label_ids))
    with m.applied(cap.model, art):
        h = cap.hidden([task.zero_shot(e.text) for e in ep.test],
                       desc=f"{task.name} ltv-layer test")
    extra = art.provenance.extra
    layer = int(art.layers[0])
    rec = {"key": key, "layer": layer, "lam": float(art.provenance.lam),
           "dev_accuracy": float(extra["val_accuracy"][layer]),
           "dev_by_layer": [float(a) for a in extra["val_accuracy"]],
           "train_seconds": seconds, "capture_seconds": float(extra["capture_seconds"]),
           "test_logits": (h.float() @ w_c.float().T + b_c.float()).tolist()}
    art.save(path.with_name(path.name.replace(".layer.json", ".layer.safetensors")))
    atomic_write(path, lambda p: Path(p).write_text(json.dumps(rec)))
    return rec
