"""Benchmark results → ratios against zero-shot, target checks, markdown tables, plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ltv_vllm.core.fileio import atomic_write, save_figure
from ltv_vllm.models.hardware import machine_line

GIB = 1024**3
MIB = 1024**2


def derive_rates(r: dict[str, Any]) -> dict[str, Any]:
    """Throughput from the raw timed passes. The headline is the fastest pass (the one least
    disturbed by anything else on the machine, as `timeit` does); the median is kept too."""
    cls, gen = r["classify_seconds"], r.get("generate_seconds") or []
    r["requests_per_s"] = r["requests"] / min(cls)
    r["requests_per_s_median"] = r["requests"] / statistics.median(cls)
    r["output_tokens_per_s"] = r["generate_tokens"] / min(gen) if gen else None
    r["output_tokens_per_s_median"] = r["generate_tokens"] / statistics.median(gen) if gen else None
    return r


def zero_shot_reference(offline: dict[str, Any], key: str) -> float | None:
    """The faster of the two zero-shot runs (first and last): on a machine whose speed drifts
    between runs, a mode meets a target only if it holds against the better baseline."""
    vals = [offline[m][key] for m in ("zero-shot", "zero-shot (again)")
            if m in offline and offline[m].get(key)]
    return max(vals) if vals else None


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The issues' targets, checked on offline throughput (req/s; tok/s where it says)."""
    off = doc.get("offline", {})
    zs = zero_shot_reference(off, "requests_per_s")

    def rate(mode: str) -> float | None:
        return off[mode]["requests_per_s"] if mode in off else None

    rows = []

    def check(name: str, num: float | None, den: float | None, bound: float, strict: bool = False):
        if num is None or den is None:
            return
        ratio = num / den
        ok = ratio > bound if strict else ratio >= bound
        rows.append({"target": name, "ratio": ratio, "bound": bound, "met": ok})

    check("LTV fused ≥ 0.97× zero-shot", rate("ltv-fused"), zs, 0.97)
    check("LTV folded ≥ 0.99× zero-shot", rate("ltv-folded"), zs, 0.99)
    check("LTV fused ≥ 5× ICL without prefix cache", rate("ltv-fused"), rate("icl-no-cache"), 5.0)
    check("LTV fused > ICL with prefix cache", rate("ltv-fused"), rate("icl-prefix-cache"), 1.0,
          strict=True)
    check("LTV multi-task LoRA ≥ 0.85× zero-shot", rate("ltv-lora"), zs, 0.85)
    check("LTV multi-task, per-request shift, ≥ 0.85× zero-shot", rate("ltv-shift"), zs, 0.85)
    zs_gen = zero_shot_reference(off, "output_tokens_per_s")
    gen = off.get("ltv-shift", {}).get("output_tokens_per_s")
    check("LTV multi-task, per-request shift, generation ≥ 0.85× zero-shot", gen, zs_gen, 0.85)
    check("Kernel LTV fused ≥ 0.97× zero-shot", rate("kernel-fused"), zs, 0.97)
    for mode in off:  # the same target for adapters cut to a lower rank (`ltv-lora-rR`)
        if mode.startswith("ltv-lora-r"):
            check(f"LTV multi-task LoRA, rank {mode.removeprefix('ltv-lora-r')}, ≥ 0.85× "
                  "zero-shot", rate(mode), zs, 0.85)
    return rows


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def _ratio(x: float | None, ref: float | None) -> str:
    return "—" if x is None or not ref else f"{x / ref:.2f}×"


def markdown(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    wl = doc["workload"]
    lines = [
        f"# Serving benchmark: {doc['model']}",
        "",
        "```", doc["command"], "```",
        "",
        (f"Machine: {machine_line(doc['machine'])}; torch "
        f"{doc['machine']['torch']}, vLLM {doc['machine']['vllm']}. Started {doc['started']}."),
        (f"Engine settings (every mode): dtype {s['dtype']}, max_model_len {s['max_model_len']}, "
        f"KV cache {s['kv_cache_gib']} GiB, enforce_eager {s['enforce_eager']}, prefix caching "
        "on except `icl-no-cache`."),
        (f"Queries: {wl['queries']} test queries ("
        f"{', '.join(f'{t} {n}' for t, n in wl['queries_per_task'].items())}), "
        f"interleaved; ICL prompts carry k={wl['k']} demonstrations (k//K per class)."),
        "",
    ]
    off = doc.get("offline")
    if off:
        zs = zero_shot_reference(off, "requests_per_s")
        zs_gen = zero_shot_reference(off, "output_tokens_per_s")
        kv_tok = doc["kv_bytes_per_token"]
        lines += [
            (f"## Offline (`LLM.generate` over all queries; fastest of {doc['repeats']} "
             "interleaved rounds, a fresh engine each, a round counting its engine's fastest "
             "of back-to-back passes)"),
            "",
            ("Classification: one label-restricted token per query. Generation: "
            f"{doc['gen_tokens']} free tokens per query (ignore_eos), where the shift runs at "
            "every decoding step. × ZS: against the faster of the two zero-shot runs."),
            *[f"`{m}`: {r['repeats']} timed pass(es)"
              + ("" if r["gen_tokens"] else ", no generation pass") + "."
              for m, r in off.items() if r.get("repeats", doc["repeats"]) != doc["repeats"]],
            "",
            ("| Mode | req/s | (median) | × ZS | gen tok/s | (median) | × ZS | accuracy "
             "| prompt tok/req | KV/req (MiB) | peak KV | peak RSS (GiB) | prefix-cache hits |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for mode, r in off.items():
            lines.append(
                f"| {mode} | {r['requests_per_s']:.1f} | {r['requests_per_s_median']:.1f} "
                f"| {_ratio(r['requests_per_s'], zs)} | {_fmt(r['output_tokens_per_s'])} "
                f"| {_fmt(r['output_tokens_per_s_median'])} "
                f"| {_ratio(r['output_tokens_per_s'], zs_gen)} "
                f"| {100 * r['accuracy']:.1f}% | {r['prompt_tokens_mean']:.0f} "
                f"| {r['prompt_tokens_mean'] * kv_tok / MIB:.1f} | {100 * r['peak_kv_usage']:.1f}% "
                f"| {r['peak_rss_bytes'] / GIB:.2f} | {100 * r['prefix_cache_hit_rate']:.0f}% |")
        tm = doc["workload"].get("transformers_metrics") or {}
        ref = doc.get("transformers") or {}
        if ref:
            tasks = doc["workload"]["tasks"]
            lines += ["", ("Accuracy per task, vLLM offline (transformers in float32 on the same "
                      "queries, the same method; queries whose predicted label differs):"), "",
                      "| Mode | " + " | ".join(tasks) + " | all | differs |",
                      "|---|" + "---|" * (len(tasks) + 2)]
            for mode, r in off.items():
                t_ref = ref.get(mode.removesuffix(" (again)"))
                if t_ref is None:
                    continue
                diff = sum(a != b for a, b in zip(r["predictions"], t_ref["predictions"],
                                                  strict=True))
                lines.append(f"| {mode} | " + " | ".join(
                    f"{100 * r['accuracy_per_task'][t]:.1f} "
                    f"({100 * t_ref['accuracy_per_task'][t]:.1f})" for t in tasks)
                    + f" | {100 * r['accuracy']:.1f} ({100 * t_ref['accuracy']:.1f}) "
                    f"| {diff} of {len(r['predictions'])} |")
        elif tm:
            lines += ["", ("Accuracy per task (vLLM offline) and, for reference, what transformers "
                      "measured at extraction on the same queries:"), "",
                      "| Mode | " + " | ".join(tm) + " |", "|---|" + "---|" * len(tm)]
            for mode, r in off.items():
                lines.append(f"| {mode} | " + " | ".join(
                    f"{100 * r['accuracy_per_task'].get(t, float('nan')):.1f}" for t in tm) + " |")
            for m in ("zero-shot", "icl", "ltv"):
                lines.append(f"| transformers {m} | " + " | ".join(
                    _fmt(100 * v[m] if v.get(m) is not None else None) for v in tm.values()) + " |")
        rows = targets(doc)
        if any(len(r.get("paired", {}).get("requests_per_s") or []) > 1 for r in off.values()):
            lines += paired_table(off)
        elif "zero-shot" in off and "zero-shot (again)" in off:
            a, b = off["zero-shot"]["requests_per_s"], off["zero-shot (again)"]["requests_per_s"]
            lines += ["", ("Noise floor: the two identical zero-shot runs (first and last) "
                           f"differ by {100 * abs(a - b) / min(a, b):.1f}% in req/s.")]
        if rows:
            lines += ["", "### Targets (offline throughput)", "",
                      "| Target | measured | met |", "|---|---|---|"]
            lines += [f"| {t['target']} | {t['ratio']:.3f}× | {'yes' if t['met'] else '**no**'} |"
                      for t in rows]
    on = doc.get("online")
    if on:
        lines += ["",
                  "## Online (vLLM's OpenAI server; requests with a fixed number in flight)", "",
                  (f"{doc['online_requests']} requests per level, prefix cache reset before each "
                  "level; latency = send → full response (one output token, so also time to "
                  "first token); output tok/s = req/s."), "",
                  ("| Mode | concurrency | req/s | × ZS | p50 (ms) | p99 (ms) | accuracy | peak KV "
                  "| peak RSS (GiB) | differs from transformers |"),
                  "|---|---|---|---|---|---|---|---|---|---|"]
        ref_on = doc.get("transformers") or {}
        levels = [c for c in next(iter(on.values())) if c != "startup_seconds"]
        for c in levels:
            refs = [on[m][c]["requests_per_s"] for m in ("zero-shot", "zero-shot (again)")
                    if m in on]
            ref = max(refs) if refs else None
            for mode, r in on.items():
                x = r[c]
                lines.append(f"| {mode} | {c} | {x['requests_per_s']:.1f} | "
                             f"{_ratio(x['requests_per_s'], ref)} | {x['latency_p50_ms']:.0f} | "
                             f"{x['latency_p99_ms']:.0f} | {100 * x['accuracy']:.1f}% | "
                             f"{100 * x['peak_kv_usage']:.1f}% | {x['peak_rss_bytes'] / GIB:.2f} | "
                             f"{_differs(x, ref_on.get(mode.removesuffix(' (again)')))} |")
    return "\n".join(lines) + "\n"


def _spread(xs: list[float] | None) -> str:
    """'median [min–max]' of per-round ratios."""
    if not xs:
        return "—"
    return f"{statistics.median(xs):.2f}× [{min(xs):.2f}–{max(xs):.2f}]"


def noise_floor(off: dict[str, Any]) -> dict[str, float] | None:
    """The largest |zero-shot (again) / zero-shot − 1| over the rounds, per rate: how far
    two identical engines measured in the same round land apart on this machine."""
    again = (off.get("zero-shot (again)") or {}).get("paired")
    if not again:
        return None
    return {k: max(abs(x - 1) for x in v) for k, v in again.items() if v}


def paired_table(off: dict[str, Any]) -> list[str]:
    """Per mode, its rate over zero-shot's in the same round: median and range over the
    interleaved rounds, and the noise floor those ratios are read against."""
    n = max(len(r.get("paired", {}).get("requests_per_s") or []) for r in off.values())
    lines = ["", (f"Paired ratios over {n} interleaved rounds (each round runs every mode once, "
                  "fresh engines; a ratio divides by zero-shot's rate in the same round): "
                  "median [min–max]."), "",
             "| Mode | classify × ZS | generate × ZS |", "|---|---|---|"]
    for mode, r in off.items():
        pr = r.get("paired") or {}
        lines.append(f"| {mode} | {_spread(pr.get('requests_per_s'))} "
                     f"| {_spread(pr.get('output_tokens_per_s'))} |")
    floor = noise_floor(off)
    if floor:
        lines += ["", ("Noise floor: zero-shot against zero-shot in the same round differs by at "
                       f"most {100 * floor.get('requests_per_s', 0):.1f}% (classify) and "
                       f"{100 * floor.get('output_tokens_per_s', 0):.1f}% (generate).")]
    return lines


def _differs(x: dict[str, Any], ref: dict[str, Any] | None) -> str:
    """'k of n': online answers (the workload's first n queries) whose predicted label is not
    transformers' for the same method; '—' where either side was not recorded."""
    got = x.get("predictions")
    if ref is None or got is None:
        return "—"
    n = len(got)
    return f"{sum(a != b for a, b in zip(got, ref['predictions'][:n], strict=True))} of {n}"


def plot(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    off, on = doc.get("offline") or {}, doc.get("online") or {}
    if off:
        zs = zero_shot_reference(off, "requests_per_s")
        zs_gen = zero_shot_reference(off, "output_tokens_per_s")
        series: dict[str, dict[str, float]] = {"offline classify": {}, "offline generate": {}}
        for m, r in off.items():
            series["offline classify"][m] = r["requests_per_s"] / zs
            if r.get("output_tokens_per_s") and zs_gen:
                series["offline generate"][m] = r["output_tokens_per_s"] / zs_gen
        for c in [c for c in (next(iter(on.values())) if on else {}) if c != "startup_seconds"]:
            ref = max((on[m][c]["requests_per_s"] for m in ("zero-shot", "zero-shot (again)")
                       if m in on), default=None)
            if ref:
                series[f"online c={c}"] = {m: r[c]["requests_per_s"] / ref for m, r in on.items()}
        modes = list(off)
        fig, ax = plt.subplots(figsize=(10, 4.5))
        width = 0.8 / len(series)
        for i, (name, vals) in enumerate(series.items()):
            xs = [j + i * width for j, m in enumerate(modes) if m in vals]
            ax.bar(xs, [vals[m] for m in modes if m in vals], width, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(modes))], modes, rotation=20)
        ax.set_ylabel("throughput / zero-shot")
        ax.set_title(f"{doc['model']}: throughput relative to zero-shot (log scale)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(save_figure(fig, out_dir / "throughput_ratio.png"))

        fig, ax = plt.subplots(figsize=(6, 4.5))
        for m, r in off.items():
            ax.scatter(r["requests_per_s"], 100 * r["accuracy"], s=40)
            ax.annotate(m, (r["requests_per_s"], 100 * r["accuracy"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("offline requests/s (log)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title("accuracy against cost, same queries")
        fig.tight_layout()
        paths.append(save_figure(fig, out_dir / "accuracy_vs_throughput.png"))
    if on:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m, r in on.items():
            cs = [c for c in r if c != "startup_seconds"]
            line, = ax.plot([int(c) for c in cs], [r[c]["latency_p50_ms"] for c in cs], marker="o",
                            label=f"{m} p50")
            ax.plot([int(c) for c in cs], [r[c]["latency_p99_ms"] for c in cs], marker="x",
                    ls="--", color=line.get_color(), label=f"{m} p99")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("requests in flight")
        ax.set_ylabel("latency (ms, log)")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        paths.append(save_figure(fig, out_dir / "latency.png"))
    return paths


def icl_cost_markdown(doc: dict[str, Any]) -> str:
    r = doc["icl_cost"]
    fused = r["ltv-fused"]["requests_per_s"]
    lines = [f"# ICL serving cost as k grows: {doc['model']}", "", "```", doc["command"], "```", "",
             (f"Offline, {r['ltv-fused']['requests']} queries "
             f"({', '.join(doc['workload']['tasks'])}); "
             "fastest of the timed passes. k = 0 is the zero-shot prompt. LTV fused serves the "
             f"zero-shot prompt whatever k its vector came from: {fused:.1f} req/s."), "",
             ("| k | prompt tok/req | ICL + prefix cache req/s | ICL no cache req/s | LTV fused ÷ "
             "ICL+cache | LTV fused ÷ ICL no cache | ICL+cache accuracy |"),
             "|---|---|---|---|---|---|---|"]
    for k in r["k"]:
        on, off = r["icl-prefix-cache"][f"k={k}"], r["icl-no-cache"][f"k={k}"]
        lines.append(f"| {k} | {on['prompt_tokens_mean']:.0f} | {on['requests_per_s']:.1f} | "
                     f"{off['requests_per_s']:.1f} | {fused / on['requests_per_s']:.2f}× | "
                     f"{fused / off['requests_per_s']:.2f}× | {100 * on['accuracy']:.1f}% |")
    return "\n".join(lines) + "\n"


def icl_cost_plot(doc: dict[str, Any], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = doc["icl_cost"]
    ks = r["k"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("icl-prefix-cache", "o-"), ("icl-no-cache", "s-")):
        a.plot(ks, [r[mode][f"k={k}"]["requests_per_s"] for k in ks], style, label=mode)
    a.axhline(r["ltv-fused"]["requests_per_s"], color="g", ls="--", label="LTV fused (any k)")
    a.set_yscale("log")
    a.set_xlabel("k demonstrations in the prompt")
    a.set_ylabel("requests/s (log)")
    a.legend()
    b.plot(ks, [r["icl-prefix-cache"][f"k={k}"]["prompt_tokens_mean"] for k in ks], "o-",
           label="ICL prompt")
    b.axhline(r["ltv-fused"]["prompt_tokens_mean"], color="g", ls="--",
              label="LTV (zero-shot prompt)")
    b.set_xlabel("k")
    b.set_ylabel("prompt tokens per request (= KV-cache tokens)")
    b.legend()
    fig.suptitle(f"{doc['model']}: serving cost against k")
    fig.tight_layout()
    return save_figure(fig, out_dir / "icl_cost.png")


def write(doc: dict[str, Any], out_dir: Path, md: str) -> None:
    atomic_write(out_dir / "results.json", lambda t: Path(t).write_text(json.dumps(doc, indent=1)))
    atomic_write(out_dir / "results.md", lambda t: Path(t).write_text(md))
