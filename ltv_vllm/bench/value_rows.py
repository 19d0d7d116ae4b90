"""The value protocol's vocabulary (`ltv-vllm bench value`): its rows' names, the tables
and comparisons they form, and the split, head and fit types every part passes. Pure: no
model, no files; it runs in whichever process imports it (the bench's)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ltv_vllm.core.teacher import CALIBRATIONS

DEFAULT_LAM = 5.0
LAMS: tuple[float | str, ...] = (5.0, "auto")
GOLD_WEIGHTS = (0.5, 0.8, 0.9, 0.95)
GOLD_CALIBRATIONS = ("icl", "batch")
MIX = (0.25, 0.5, 0.75)  # the probe's weight in the LTV + probe mixture (0 and 1: its parts)

# row names (stable: docs and tests read them from results.json)
ZERO_SHOT = "zero-shot"
PROMPT_K = "prompt, one k-shot"
PROMPT_MANY = "prompt, many-shot"
PROMPT_BEST = "prompt, best on dev"
FREE_BEST = "LTV label-free, chosen on dev"
FREE_BEST_TEACHER = "teacher of the chosen label-free fit"
DEFAULT = "default (one k-shot, gold 0.8, λ=5)"
GOLD_BEST = "LTV gold, chosen on dev"
MIXED = "LTV gold + probe, mix on dev"
PROBE = "probe (L2 on dev)"
LORA = "LoRA r8 (lr, epochs on dev)"
LAYER = "LTV at a block (block on dev, λ=LOO)"  # `bench value --layer-rows`

FREE_BASES = ("one", "many")


def free_row(base: str, calibration: str, lam: float | str) -> str:
    lam_s = "LOO" if lam == "auto" else f"{lam:g}"
    return f"LTV {base}/{calibration}, λ={lam_s}"


def teacher_row(base: str, calibration: str) -> str:
    """The prompt a label-free fit imitates: the prompt itself, or it calibrated."""
    if calibration == "icl":
        return PROMPT_K if base == "one" else PROMPT_MANY
    return f"prompt {base}, {calibration}-calibrated"


def regimes(lora: bool, layer: bool = False) -> dict[str, dict[str, Any]]:
    """Each table's rows and the comparisons ("row", "reference") it reports. `layer`: the
    third table, LTV at a decoder block against the prompt it replaces, the same fit on the
    final state (prompt, teacher and λ rule alike), the final-layer default and the
    final-layer fit chosen on dev."""
    free_rows = [free_row(b, c, lam) for b in FREE_BASES for c in CALIBRATIONS for lam in LAMS]
    teachers = [teacher_row(b, c) for b in FREE_BASES for c in CALIBRATIONS if c != "icl"]
    free_pairs = [(free_row(b, c, lam), teacher_row(b, c))
                  for b in FREE_BASES for c in CALIBRATIONS for lam in LAMS]
    free_pairs += [(FREE_BEST, FREE_BEST_TEACHER), (FREE_BEST, PROMPT_BEST),
                   (FREE_BEST, PROMPT_K)]
    labelled = [DEFAULT, GOLD_BEST, MIXED, PROBE, *([LORA] if lora else []), PROMPT_MANY,
                PROMPT_K]
    refs = [PROBE, *([LORA] if lora else []), PROMPT_MANY, PROMPT_K]
    gold_pairs = [(row, ref) for row in (DEFAULT, GOLD_BEST, MIXED) for ref in refs]
    out = {
        "no_labels": {"rows": [ZERO_SHOT, PROMPT_K, PROMPT_MANY, *teachers, PROMPT_BEST,
                               FREE_BEST_TEACHER, *free_rows, FREE_BEST],
                      "pairs": free_pairs},
        "labels": {"rows": [ZERO_SHOT, *labelled], "pairs": gold_pairs},
    }
    if layer:
        final = free_row("one", "icl", "auto")
        refs = [PROMPT_K, final, DEFAULT, FREE_BEST, ZERO_SHOT]
        out["layer"] = {"rows": [ZERO_SHOT, PROMPT_K, LAYER, final, FREE_BEST, DEFAULT],
                        "pairs": [(LAYER, ref) for ref in refs]}
    return out


@dataclass(frozen=True)
class Split:
    """One split's states: h_zs (n, d), h_icl (P, n, d) (the M k-shot prompts, then the
    many-shot one), labels (n,)."""

    h_zs: torch.Tensor
    h_icl: torch.Tensor
    labels: torch.Tensor
    name: str = ""  # train, dev or test


@dataclass
class Fit:
    """A row: what it chose on dev, its dev accuracy, and its map from a split to logits."""

    config: dict[str, Any]
    predict: Callable[[Split], torch.Tensor]
    dev_accuracy: float = float("nan")
    labels_used: int = 0  # train labels the fit reads (dev labels are counted apart)
    seconds: float = 0.0  # fitting or training time (captures are counted apart)


@dataclass(frozen=True)
class Head:
    w_c: torch.Tensor  # (K, d) the label rows of the LM head
    b_c: torch.Tensor  # (K,)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return h.float() @ self.w_c.float().T + self.b_c.float()


def digest(examples: Sequence[Any]) -> str:
    """A short hash of examples (texts and labels): what a stored result was made from."""
    return hashlib.sha256(json.dumps([[e.text, e.label] for e in examples]).encode()
                          ).hexdigest()[:16]
