"""Scores of an evaluation over M demonstration sets (`--demo-sets M`): the references a
multi-prompt vector is judged against, as pure functions of label-restricted logits.

One ICL prompt is a noisy target (which demonstrations, in which order); with M sets per
episode there are two references and two targets:
  * single-prompt ICL: each set's prompt on its own; its accuracy is the mean over the M
    prompts, and a method's d_NTP against it the mean over the prompts of KL(P_m ‖ P_method);
  * the ICL ensemble: the M prompts' label distributions averaged, P_ens = mean_m P_m (what
    running every prompt per query and voting by probability would answer);
and "ICL, states averaged" (softmax of the LM head on the mean of the M prompts' final
states): the target the multi-prompt vector is fitted to, scored so a table shows how far
averaging states is from averaging distributions.

With M = 1 every quantity here is today's: single-prompt ICL is the prompt, d_NTP the KL to
it, and the ensemble the prompt itself.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

import torch

from ltv_vllm.core.metrics import accuracy, d_ntp, restricted_log_probs

ENSEMBLE = "icl-ensemble"    # the M prompts' label distributions averaged
STATES = "icl-states"        # the LM head on the M prompts' mean final state
MULTI = "ltv-multi"          # LTV fitted to the mean of the M prompts' states
METHODS = (ENSEMBLE, STATES, MULTI)  # an evaluation's methods that need M > 1
LABELS = {ENSEMBLE: "ICL ensemble (M prompts)", STATES: "ICL, states averaged",
          MULTI: "LTV, M prompts"}
COLORS = {ENSEMBLE: "darkgreen", STATES: "mediumseagreen", MULTI: "tab:purple"}


def ensemble_logits(z_sets: torch.Tensor) -> torch.Tensor:
    """log mean_m softmax(z_m): the ensemble's label log-probabilities, usable wherever
    label logits are (their softmax is the mean distribution). z_sets (M, n, K) → (n, K)"""
    lp = restricted_log_probs(z_sets.double())
    return torch.logsumexp(lp, 0) - math.log(z_sets.shape[0])


def set_scores(logits: Mapping[str, torch.Tensor], z_sets: torch.Tensor,
               labels: torch.Tensor) -> dict[str, dict[str, float]]:
    """Each method's accuracy, d_NTP against single-prompt ICL (`d_ntp`, the mean over the M
    prompts) and against the ensemble (`d_ntp_ensemble`), from label logits (n, K) and the
    M prompts' own (M, n, K). "icl" is single-prompt ICL: the mean over its prompts (its
    d_NTP 0 by definition), with each prompt's accuracy in `set_accuracy`."""
    z_ens = ensemble_logits(z_sets)
    out: dict[str, dict[str, float]] = {}
    for m, z in logits.items():
        if m == "icl":
            accs = [accuracy(z_m, labels) for z_m in z_sets]
            out[m] = {"accuracy": statistics.fmean(accs), "d_ntp": 0.0,
                      "d_ntp_ensemble": statistics.fmean(d_ntp(z_ens, z_m) for z_m in z_sets),
                      "set_accuracy": accs}
            continue
        out[m] = {"accuracy": accuracy(z, labels),
                  "d_ntp": statistics.fmean(d_ntp(z_m, z) for z_m in z_sets),
                  "d_ntp_ensemble": d_ntp(z_ens, z)}
    return out


def references(h_icl_test_sets: torch.Tensor, w_c: torch.Tensor,
               b_c: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The M prompts' label logits (M, n, K) from their test states (M, n, d), and the two
    multi-prompt references' label logits: the ensemble and the mean state."""
    z_sets = h_icl_test_sets @ w_c.T + b_c
    return z_sets, {ENSEMBLE: ensemble_logits(z_sets),
                    STATES: h_icl_test_sets.mean(0) @ w_c.T + b_c}
