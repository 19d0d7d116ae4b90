"""A PEFT LoRA fine-tune on labelled queries: the rival a user with labels and a GPU budget
picks instead of a task vector, trained and scored here so the value protocol can put it in
the same table (docs/methods.md, "Measuring value"). Runs in the process that loaded the
transformers model (a benchmark, offline).

The adapter is trained on the zero-shot prompt of each labelled query with the ordinary
next-token loss on the label's first token (full vocabulary: what a supervised fine-tune of
the answer does), r = 8 on the attention projections. Its learning rate and epoch count are
chosen on the dev split alone: every learning rate of the grid starts from the same seeded
initial adapter, the dev accuracy (label-restricted argmax) is read after every epoch, and
the best (lr, epoch) state is kept (ties: the lower dev cross-entropy, then the earlier one).
The test split is never seen here: `label_logits` scores any split with the kept adapter.

The model is wrapped by PEFT for the tuner's lifetime and restored by `close()` (PEFT's
`unload`, which puts the original modules back), so a caller's model is unchanged after.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ltv_vllm.errors import UserError
from ltv_vllm.extraction.capture import base_model, left_pad, lm_head, positions


class FinetuneError(UserError):
    """A fine-tune that cannot run (PEFT missing, modules the model lacks)."""


@dataclass(frozen=True)
class LoraOptions:
    """The adapter and its search grid (the dev split chooses lr and epochs)."""

    r: int = 8
    alpha: int = 16
    lrs: tuple[float, ...] = (1e-4, 3e-4, 1e-3)
    epochs: int = 4
    batch_size: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    seed: int = 0

    def record(self) -> dict[str, Any]:
        return {"r": self.r, "alpha": self.alpha, "lrs": list(self.lrs), "epochs": self.epochs,
                "batch_size": self.batch_size, "target_modules": list(self.target_modules),
                "seed": self.seed}


@dataclass
class LoraChoice:
    lr: float
    epoch: int
    dev_accuracy: float
    dev_loss: float
    curve: list[dict[str, float]] = field(default_factory=list)  # every (lr, epoch) on dev
    train_seconds: float = 0.0


class LoraTuner:
    """One model, one task's label tokens: `fit(...)` chooses on dev, `label_logits(...)`."""

    def __init__(self, model: Any, tokenizer: Any, label_ids: Sequence[int], *,
                 special_tokens: bool = True, opts: LoraOptions = LoraOptions(),
                 progress: bool = True) -> None:
        try:
            from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
        except ImportError:
            raise FinetuneError("the LoRA baseline needs PEFT: pip install peft") from None
        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        missing = [m for m in opts.target_modules if m not in names]
        if missing:
            raise FinetuneError(f"the model has no {', '.join(missing)} modules to put a LoRA "
                                "adapter on")
        self.tokenizer = tokenizer
        self.label_ids = torch.tensor(list(label_ids), dtype=torch.long)
        self.special_tokens = special_tokens
        self.opts = opts
        self.progress = progress
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id or 0)
        torch.manual_seed(opts.seed)  # the adapter's initial A: the same for every lr
        config = LoraConfig(r=opts.r, lora_alpha=opts.alpha, lora_dropout=0.0,
                            target_modules=list(opts.target_modules), task_type="CAUSAL_LM")
        self.model = get_peft_model(model, config)
        self._state_dict = get_peft_model_state_dict
        self.init = {k: v.detach().clone() for k, v in get_peft_model_state_dict(
            self.model).items()}
        self.best: dict[str, torch.Tensor] | None = None
        self.device = next(model.parameters()).device

    def close(self) -> Any:
        """The original model, every LoRA layer removed."""
        return self.model.unload()

    def __enter__(self) -> LoraTuner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- passes ---------------------------------------------------------------------------
    def _encode(self, prompts: Sequence[str]) -> list[list[int]]:
        return [list(x) for x in self.tokenizer(list(prompts), add_special_tokens=
                                                self.special_tokens)["input_ids"]]

    def _last_logits(self, seqs: list[list[int]]) -> torch.Tensor:
        """Full-vocabulary logits at each row's last token (B, vocab). The LM head is applied
        to the (B, d) last states as one 2-D product: through the model's own forward a tied
        head on (B, 1, d) went through a batched matmul that copied the whole embedding per
        row on the CPU (0.9 s of a 1.0 s batch on SmolLM2-135M)."""
        ids, mask = left_pad(seqs, self.pad_id)
        inner = self.model.get_base_model()
        out = base_model(inner)(input_ids=ids.to(self.device),
                                attention_mask=mask.to(self.device),
                                position_ids=positions(mask).to(self.device), use_cache=False)
        return lm_head(inner)(out.last_hidden_state[:, -1]).float()

    @torch.no_grad()
    def label_logits(self, prompts: Sequence[str], desc: str = "lora") -> torch.Tensor:
        """Label logits (n, K) of zero-shot prompts under the kept adapter (the initial,
        zero-effect one before `fit`)."""
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, self.best if self.best is not None else self.init)
        self.model.eval()
        seqs = self._encode(prompts)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        out = torch.empty(len(seqs), len(self.label_ids))
        bs = self.opts.batch_size
        for s in tqdm(range(0, len(order), bs), desc=desc, unit="batch", leave=False,
                      disable=not self.progress):
            idx = order[s:s + bs]
            z = self._last_logits([seqs[i] for i in idx])
            out[torch.tensor(idx)] = z[:, self.label_ids.to(z.device)].cpu()
        return out

    def fit(self, prompts: Sequence[str], labels: Sequence[int], dev_prompts: Sequence[str],
            dev_labels: Sequence[int]) -> LoraChoice:
        """Train on (prompts, labels: label indices) at every lr of the grid; keep the
        (lr, epoch) with the best dev accuracy."""
        from peft import set_peft_model_state_dict

        seqs = self._encode(prompts)
        targets = self.label_ids[torch.as_tensor(list(labels), dtype=torch.long)]
        dev_y = torch.as_tensor(list(dev_labels), dtype=torch.long)
        curve: list[dict[str, float]] = []
        best_key: tuple[float, float] | None = None
        t0 = time.perf_counter()
        params = [p for n, p in self.model.named_parameters() if "lora_" in n]
        for lr in self.opts.lrs:
            set_peft_model_state_dict(self.model, self.init)
            for p in params:
                p.requires_grad_(True)
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
            g = torch.Generator().manual_seed(self.opts.seed)
            for epoch in range(1, self.opts.epochs + 1):
                self.model.train()
                order = torch.randperm(len(seqs), generator=g).tolist()
                bs = self.opts.batch_size
                for s in tqdm(range(0, len(order), bs), desc=f"lora lr={lr:g} epoch {epoch}",
                              unit="batch", leave=False, disable=not self.progress):
                    idx = order[s:s + bs]
                    z = self._last_logits([seqs[i] for i in idx])
                    loss = torch.nn.functional.cross_entropy(z, targets[idx].to(z.device))
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                state = {k: v.detach().clone() for k, v in self._state_dict(self.model).items()}
                saved, self.best = self.best, state
                z_dev = self.label_logits(dev_prompts, desc="lora dev")
                self.best = saved
                acc = float((z_dev.argmax(-1) == dev_y).double().mean())
                ce = float(torch.nn.functional.cross_entropy(z_dev.double(), dev_y))
                curve.append({"lr": lr, "epoch": epoch, "dev_accuracy": acc, "dev_loss": ce})
                key = (acc, -ce if math.isfinite(ce) else -math.inf)
                if best_key is None or key > best_key:
                    best_key, self.best = key, state
                    chosen = LoraChoice(lr=lr, epoch=epoch, dev_accuracy=acc, dev_loss=ce)
        chosen.curve = curve
        chosen.train_seconds = time.perf_counter() - t0
        return chosen

    def save(self, directory: str | Path) -> Path:
        """The kept adapter as a PEFT directory (what vLLM's --enable-lora serves)."""
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, self.best if self.best is not None else self.init)
        self.model.save_pretrained(str(directory))
        return Path(directory)
