"""Cross-model transfer (paper appendix "Cross-Model Transfer"): a logit-space LTV.

A source model L (large, a good in-context learner) and a target model S (small) that share a
tokenizer share the vocabulary as a coordinate system, so the regression target moves from
hidden space to logit space:
    H  = [h_zs^S(x_j)]                      (d_S × N)   target's zero-shot post-norm states
    Y  = [z_icl^L(x_j) − z_zs^S(x_j)]       (V × N)     z = W_lm h (+ b), full vocabulary
    W̃ = argmin ‖Y − W̃ H‖²_F + λ‖W̃‖²_F     (V × d_S, rank ≤ N)   — `ridge.ridge_fit`
    z  = z_zs^S + W̃ h_zs^S                                        at inference

W̃ is only ever held as factors U (V, r), V (d_S, r): a dense 152k × 3584 matrix (Qwen2.5-7B)
would be 2 GiB in float32. When L = S, Y = W_lm (h_icl − h_zs) and ridge is linear in Y, so
W̃ = W_lm W* exactly (the paper's consistency remark; tests/test_transfer.py checks it).

Pure tensor functions; the passes that produce the states live in `ltv_vllm.pipeline.extract`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ltv_vllm.core.ridge import Factors, low_rank_delta, ridge_fit
from ltv_vllm.errors import UserError


class TransferError(UserError):
    """Source and target cannot be paired (different tokenizers)."""


def check_same_tokenizer(
    target: Any,
    source: Any,
    prompts: Sequence[str],
    *,
    names: tuple[str, str] = ("target", "source"),
) -> None:
    """Refuse a pair whose tokenizers would put different ids on the same text.

    Vocabulary (token → id) must be identical, and so must the ids of every prompt given
    (demo prefix, queries, label-word completions), which also covers added BOS tokens and
    normaliser differences that an equal vocabulary would not reveal.
    """
    t_name, s_name = names
    tv, sv = target.get_vocab(), source.get_vocab()
    if tv != sv:
        only_t = sorted(set(tv) - set(sv), key=tv.get)[:3]
        only_s = sorted(set(sv) - set(tv), key=sv.get)[:3]
        moved = [tok for tok in tv if tok in sv and tv[tok] != sv[tok]][:3]
        detail = (f"only in {t_name}: {only_t}" if only_t else
                  f"only in {s_name}: {only_s}" if only_s else f"ids differ for {moved}")
        raise TransferError(
            f"{t_name} and {s_name} do not share a tokenizer ({len(tv)} vs {len(sv)} tokens; "
            f"{detail}): logit-space transfer needs the same vocabulary"
        )
    for p in prompts:
        a, b = target(p)["input_ids"], source(p)["input_ids"]
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                      min(len(a), len(b)))
            raise TransferError(
                f"{t_name} and {s_name} tokenize {p[:40]!r}... differently (from token {at}: "
                f"{a[at:at + 3]} vs {b[at:at + 3]}): logit-space transfer needs the same ids"
            )


@torch.no_grad()
def full_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, rows: int = 16384
) -> torch.Tensor:
    """z = W_lm h (+ b) over the whole vocabulary, float32 on the CPU. (n, V)

    The head is multiplied a block of vocabulary rows at a time on its own device, in float32,
    so a float32 copy of a large head (2.5 GiB for a 152k × 4096 one) never exists at once.
    """
    out = torch.empty(h.shape[0], weight.shape[0], dtype=torch.float32)
    h_dev = h.to(device=weight.device, dtype=torch.float32)
    for start in range(0, weight.shape[0], rows):
        w = weight[start : start + rows].float()
        z = h_dev @ w.T
        if bias is not None:
            z = z + bias[start : start + rows].float()
        out[:, start : start + rows] = z.cpu()
    return out


def fit_transfer(
    h_zs_target: torch.Tensor,
    z_icl_source: torch.Tensor,
    z_zs_target: torch.Tensor,
    lam: float,
) -> Factors:
    """W̃ as factors U (V_S, r), V (d_S, r) from h_zs^S (N, d_S), z_icl^L (N, V_L), z_zs^S (N, V_S).

    Padded LM heads may differ in length (Qwen2.5 ≤ 3B: 151936 rows, ≥ 7B: 152064) although
    the tokenizer (151665 tokens) is the same: rows beyond the shorter head are ids no text
    produces, so the fit covers the common rows and leaves the target's extra rows unshifted.
    """
    n = h_zs_target.shape[0]
    if not (z_icl_source.shape[0] == z_zs_target.shape[0] == n):
        raise ValueError(
            f"row mismatch: h_zs {tuple(h_zs_target.shape)}, z_icl {tuple(z_icl_source.shape)}, "
            f"z_zs {tuple(z_zs_target.shape)}"
        )
    vocab = min(z_icl_source.shape[1], z_zs_target.shape[1])
    y = z_icl_source[:, :vocab].float() - z_zs_target[:, :vocab].float()  # (N, V)
    f = ridge_fit(h_zs_target, y, lam)
    extra = z_zs_target.shape[1] - vocab
    if extra:
        f = Factors(U=torch.cat([f.U, f.U.new_zeros(extra, f.U.shape[1])]), V=f.V, form=f.form,
                    gram=f.gram)
    return f


def transfer_label_logits(
    h_zs: torch.Tensor,
    w_c: torch.Tensor,
    b_c: torch.Tensor,
    factors: Factors,
    label_ids: Sequence[int],
) -> torch.Tensor:
    """Restricted logits of z_zs^S + W̃ h_zs^S on the label tokens, (n, K).

    Only the K label rows of U are needed: W̃ h restricted to C is U[C] (Vᵀ h).
    """

    idx = torch.tensor(list(label_ids), dtype=torch.long)
    h = h_zs.float()
    return h @ w_c.T + b_c + low_rank_delta(h, factors.U, factors.V, rows=idx)
