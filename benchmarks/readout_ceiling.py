"""How far any map of the zero-shot state can go: LTV at every λ, kernel LTV and a trained
linear probe, against the prompt, from the states `bench teachers` stored (no model).

A served vector sees one thing per query: h_zs, the final state of the zero-shot prompt, and
answers through the label rows of the LM head. Whatever it is fitted to, its accuracy is
bounded by what that state tells apart. This script measures the bound from the stored
episodes of `ltv-vllm bench teachers` (OUT/states/<task>_seed<s>.safetensors), per task, mean
over the stored seeds:

  * LTV fitted to each `--variants` teacher (base/calibration/gold weight, as the bench
    names them) at λ = 5, at λ by leave-one-out, and at the best λ of a grid chosen on the
    test queries themselves (an upper bound no honest fit reaches: it sees the answers);
  * kernel LTV (RBF, γ and λ by leave-one-out) fitted to the same targets: a nonlinear map;
  * LTV with its gold weight w and λ chosen per episode on the train queries alone: the
    pair of a grid whose closed-form leave-one-out label accuracy against the N gold labels
    is highest (`--select`, base/calibration pairs): model selection a user could run;
  * a multinomial logistic probe on standardized h_zs trained on the N gold labels alone,
    its L2 weight chosen by 4-fold cross-validation on the train queries (and the test-chosen
    best beside it): the best a linear read-out of h_zs does with those labels.

    python benchmarks/readout_ceiling.py \\
        --states benchmarks/results/teachers_qwen2.5-coder-1.5b/states \\
        --out benchmarks/results/teachers_qwen2.5-coder-1.5b/readout_ceiling
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from ltv_vllm.bench.report import write
from ltv_vllm.bench.teachers import parse_variant, teacher_base
from ltv_vllm.bench.workload import machine
from ltv_vllm.core.kernel import kernel_fit, rbf_delta
from ltv_vllm.core.metrics import accuracy
from ltv_vllm.core.probe import PROBE_L2, fit_probe
from ltv_vllm.core.ridge import ridge_fit
from ltv_vllm.core.teacher import TeacherOptions, fit_targets
from ltv_vllm.errors import ArgumentError
from ltv_vllm.models.hardware import machine_line

LAM_GRID = (0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0)
SELECT_W = (0.0, 0.5, 0.8, 0.9, 0.95)
SELECT_LAM = (5.0, 30.0, 100.0, 300.0, 1000.0)


def label_logits(h: torch.Tensor, st: dict[str, torch.Tensor]) -> torch.Tensor:
    return h @ st["w_c"].T + st["b_c"]


def probe_scores(st: dict[str, torch.Tensor], k: int) -> dict[str, float]:
    """The probe's test accuracy at the L2 weight 4-fold CV on the train queries picks, and
    the best over the grid on the test queries (an upper bound)."""
    x, y = st["h_zs"].double(), st["labels"].long()
    xt = st["h_zs_test"].double()
    folds = torch.arange(x.shape[0]) % 4
    cv = {}
    for l2 in PROBE_L2:
        right = 0
        for f in range(4):
            tr, va = folds != f, folds == f
            right += int((fit_probe(x[tr], y[tr], k, l2).logits(x[va]).argmax(-1)
                          == y[va]).sum())
        cv[l2] = right
    test = {l2: accuracy(fit_probe(x, y, k, l2).logits(xt), st["labels_test"])
            for l2 in PROBE_L2}
    return {"probe_cv": test[max(PROBE_L2, key=lambda l2: cv[l2])],
            "probe_best_on_test": max(test.values())}


def selected(st: dict[str, torch.Tensor], base: str,
             calibration: str) -> tuple[float, float, torch.Tensor]:
    """(w, λ, the train target at that w) of SELECT_W × SELECT_LAM with the best leave-one-out
    accuracy against the train queries' gold labels (ties: the lower LOO cross-entropy).
    Ridge's LOO prediction is closed form, (ŷ_i − S_ii y_i) / (1 − S_ii) with the hat matrix
    S = K (K + λI)⁻¹, K = H Hᵀ; only the label logits of the shift matter to accuracy, so only
    those are predicted."""
    t = teacher_base(st, base)
    h = st["h_zs"].double()
    w_c, b_c, gold = st["w_c"].double(), st["b_c"].double(), st["labels"].long()
    ev, q = torch.linalg.eigh(h @ h.T)
    best: tuple[tuple[float, float], float, float, torch.Tensor] | None = None
    for w in SELECT_W:
        target, _ = fit_targets(TeacherOptions(calibration=calibration, gold_weight=w),
                                t["h_icl"], t["h_icl_test"], st["w_c"], st["b_c"],
                                h_content_free=t["h_icl_cf"], gold=st["labels"])
        y = (target.double() - h) @ w_c.T  # the shift's label logits (N, K)
        for lam in SELECT_LAM:
            s = (q * (ev / (ev + lam))) @ q.T
            s_ii = s.diagonal().unsqueeze(1)
            z = h @ w_c.T + b_c + (s @ y - s_ii * y) / (1 - s_ii)
            key = ((z.argmax(-1) == gold).double().mean().item(),
                   -torch.nn.functional.cross_entropy(z, gold).item())
            if best is None or key > best[0]:
                best = (key, w, lam, target)
    assert best is not None
    return best[1], best[2], best[3]


def episode(st: dict[str, torch.Tensor], variants: list[str],
            select: list[str]) -> dict[str, float]:
    labels = st["labels_test"]
    sets = st["h_icl_test"]
    out = {"zero-shot": accuracy(label_logits(st["h_zs_test"], st), labels),
           "one prompt": statistics.fmean(accuracy(label_logits(sets[m], st), labels)
                                          for m in range(sets.shape[0] - 1)),
           "many-shot prompt": accuracy(label_logits(sets[-1], st), labels)}
    ht = st["h_zs_test"]
    for spec in variants:
        base, opts = parse_variant(spec)
        t = teacher_base(st, base)
        target, _ = fit_targets(opts, t["h_icl"], t["h_icl_test"], st["w_c"], st["b_c"],
                                h_content_free=t["h_icl_cf"], gold=st["labels"])
        y = target - st["h_zs"]

        def ltv_acc(lam: float | str, y: torch.Tensor = y) -> float:
            f = ridge_fit(st["h_zs"], y, lam)
            return accuracy(label_logits(ht + f.apply(ht), st), labels)

        grid = [ltv_acc(lam) for lam in LAM_GRID]
        kf = kernel_fit(st["h_zs"], y)
        out |= {f"{spec} λ=5": ltv_acc(5.0), f"{spec} λ by LOO": ltv_acc("auto"),
                f"{spec} best λ on test": max(grid),
                f"{spec} kernel": accuracy(label_logits(
                    ht + rbf_delta(ht, kf.U, kf.V, kf.gamma), st), labels)}
    for spec in select:
        base, calibration = spec.split("/")
        w, lam, target = selected(st, base, calibration)
        f = ridge_fit(st["h_zs"], target - st["h_zs"], lam)
        out[f"{spec}, w and λ by train LOO"] = accuracy(label_logits(ht + f.apply(ht), st),
                                                          labels)
        out[f"{spec}: chosen w"] = w  # per episode; its mean over seeds in the table
    k = st["w_c"].shape[0]
    return out | probe_scores(st, k)


def markdown(doc: dict) -> str:
    tasks, per = doc["tasks"], doc["per_task"]
    rows = list(per[tasks[0]])
    lines = ["# What a map of the zero-shot state can reach", "", "```", doc["command"], "```",
             "", f"States of `{doc['states']}` ({doc['episodes']} episodes, seeds "
             f"{doc['seeds']}); {doc['machine']}; wall time {doc['wall_seconds'] / 60:.1f} min. "
             "Accuracy (%) on each episode's test queries, mean over seeds. *best λ on test* "
             "and *probe, best on test* choose on the test queries (upper bounds); *probe* is "
             "a logistic regression on h_zs trained on the N gold labels alone, its L2 weight "
             "by 4-fold cross-validation on them; *w and λ by train LOO* picks both per episode by "
             "leave-one-out accuracy on the train queries' gold labels (*chosen w*: their mean "
             "over seeds, not a percentage).", "",
             "| | " + " | ".join(tasks) + " | Avg. |", "|---|" + "---|" * (len(tasks) + 1)]
    names = {"probe_cv": "probe (gold labels, CV)", "probe_best_on_test": "probe, best on test"}
    for r in rows:
        scale, fmt = (1, "{:.2f}") if r.endswith("chosen w") else (100, "{:.1f}")
        vals = [scale * per[t][r] for t in tasks]
        lines.append(f"| {names.get(r, r)} | " + " | ".join(fmt.format(v) for v in vals)
                     + f" | {fmt.format(statistics.fmean(vals))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    from safetensors.torch import load_file

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--states", type=Path, required=True, help="a `bench teachers` OUT/states")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default="one/icl/0.8,many/batch/0.8")
    ap.add_argument("--select", default="one/icl,many/batch",
                    help="base/calibration pairs whose w and λ are chosen by train LOO")
    args = ap.parse_args(argv)
    files = sorted(args.states.glob("*_seed*.safetensors"))
    if not files:
        ap.error(f"{args.states}: no <task>_seed<s>.safetensors (run `bench teachers` first)")
    variants = args.variants.split(",")
    select = [x for x in args.select.split(",") if x]
    try:  # refused in one line before any state is read
        for x in select:
            if x.count("/") != 1:
                raise ValueError(f"--select {x!r}: base/calibration, no gold weight")
        for v in [*variants, *(f"{x}/0" for x in select)]:
            parse_variant(v)
    except (ValueError, ArgumentError) as e:
        ap.error(str(e))
    t0 = time.perf_counter()
    tasks: list[str] = []
    rows: dict[str, list[dict[str, float]]] = {}
    seeds = set()
    for path in files:
        task, seed = path.stem.rsplit("_seed", 1)
        if task not in tasks:
            tasks.append(task)
        seeds.add(int(seed))
        rows.setdefault(task, []).append(episode(load_file(str(path)), variants, select))
        print(f"{path.name}: done", file=sys.stderr, flush=True)
    per = {t: {key: statistics.fmean(r[key] for r in rs) for key in rs[0]}
           for t, rs in rows.items()}
    doc = {"command": "python benchmarks/readout_ceiling.py " + shlex.join(argv),
           "states": str(args.states), "variants": variants, "select": select, "tasks": tasks,
           "seeds": sorted(seeds), "episodes": len(files), "machine": machine_line(machine()),
           "wall_seconds": time.perf_counter() - t0, "rows": rows, "per_task": per}
    args.out.mkdir(parents=True, exist_ok=True)
    md = markdown(doc)
    write(doc, args.out, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
