"""Serving benchmark: zero-shot, ICL (prefix cache on/off) and LTV (fused, folded, LoRA) in vLLM.

Offline: each mode's engine(s) run in a fresh process (`engine.py`) over the same queries;
classification (one label-restricted token) and free generation (`gen_tokens` per request)
are timed `repeats` times, the median is reported. Online: each mode's server gets the same
requests at each concurrency level. Zero-shot runs first and again last, so the table shows
how much two identical runs differ on this machine (the noise floor for every ratio).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltv_vllm.bench import BenchError
from ltv_vllm.bench.modes import DEFAULT_MODES, MODES, Engine, engines, known_mode
from ltv_vllm.bench.report import derive_rates
from ltv_vllm.bench.workload import EngineSettings, Query, Workload, icl_queries, interleave
from ltv_vllm.serving.offline.jobs import job_paths, prestart, run_job

HOST = "127.0.0.1"
NOISE_MODE = "zero-shot (again)"
INNER_PASSES = 3  # timed passes per engine and round (the fastest counts)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _stem(label: str) -> str:
    """File-name stem of an engine label: `ltv-fused[sst2]` → `ltv-fused-sst2`."""
    return label.replace("[", "-").replace("]", "").replace(" ", "_")


def run_engine_job(engine: Engine, passes: list[dict[str, Any]], *, repeats: int, gen_tokens: int,
                   warmup: int, settings: EngineSettings, log_dir: Path,
                   resume: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """One offline job (`engine.py`) in a fresh process; its result dict."""
    stem = _stem(engine.label)
    job_path, out_path, _ = job_paths(log_dir, stem)
    job = json.dumps({"llm_kwargs": engine.llm_kwargs, "passes": passes, "repeats": repeats,
                      "gen_tokens": gen_tokens, "warmup": warmup})
    if resume and out_path.exists() and job_path.exists() and job_path.read_text() == job:
        # an interrupted run picks up the identical jobs it finished, with when they ran
        res = json.loads(out_path.read_text())
        res.setdefault("measured_at", time.strftime(
            "%Y-%m-%d %H:%M:%S %Z", time.localtime(out_path.stat().st_mtime)))
        log(f"{engine.label}: reusing the result measured at {res['measured_at']}")
        return res
    env = {**settings.env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TOKENIZERS_PARALLELISM": "false", **engine.env}
    return run_job("ltv_vllm.bench.engine", job, log_dir, stem, env=env,
                   what=f"{engine.label}: engine job", error=BenchError)


def _sum_runs(runs: list[list[float]]) -> list[float]:
    return [sum(xs) for xs in zip(*runs, strict=False)] if runs else []


def combine_offline(results: list[dict[str, Any]], pass_name: str = "main") -> dict[str, Any]:
    """Several engines (one per task) → one mode: times add up, peaks are maxima."""
    ps = [r["passes"][pass_name] for r in results]
    n = sum(p["requests"] for p in ps)
    cls = _sum_runs([p["classify_seconds"] for p in ps])
    gen = _sum_runs([p["generate_seconds"] for p in ps])
    toks = sum(p["generate_tokens"] for p in ps)
    preds = [x for p in ps for x in p["predictions"]]
    return derive_rates({
        "engines": len(results),
        "requests": n,
        "classify_seconds": cls,
        "generate_seconds": gen,
        "generate_tokens": toks,
        "accuracy": sum(x["pred"] == x["gold"] for x in preds) / max(1, len(preds)),
        "accuracy_per_task": _per_task_accuracy(preds),
        # per query, in workload order: predicted label index, label-restricted probabilities
        "predictions": [x["pred"] for x in sorted(preds, key=lambda x: x["qid"])],
        "probs": [x["probs"] for x in sorted(preds, key=lambda x: x["qid"])],
        "prompt_tokens_mean": sum(p["prompt_tokens_mean"] * p["requests"] for p in ps) / max(1, n),
        "prefix_cache_hit_rate": (
            sum(p["prefix_cache_hit_rate"] * p["requests"] for p in ps) / max(1, n)
        ),
        "peak_kv_usage": max(p["peak_kv_usage"] for p in ps),
        "kv_capacity_tokens": min(r["kv_blocks"] * r["block_size"] for r in results),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results),
        "startup_seconds": sum(r["startup_seconds"] for r in results),
        "measured_at": [r.get("measured_at") for r in results],
    })


def _per_task_accuracy(preds: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, list[bool]] = {}
    for x in preds:
        out.setdefault(x["task"], []).append(x["pred"] == x["gold"])
    return {t: sum(v) / len(v) for t, v in out.items()}


def run_offline(wl: Workload, modes: Sequence[str], settings: EngineSettings, *, repeats: int,
                gen_tokens: int, warmup: int, work_dir: Path, log: Callable[[str], None],
                resume: bool = False) -> dict[str, Any]:
    """Every mode's engines, `repeats` rounds interleaved: round 1 runs each mode once, then
    round 2 ..., each engine fresh and timed `INNER_PASSES` times back to back (the round
    keeps the fastest pass: a one-second pass is easily slowed by anything else on the
    machine), so slow drift of the machine spreads over
    every mode alike rather than landing on the modes measured last. Each mode's result
    holds its rounds' times (`classify_seconds`, one per round) and, per round, its rate
    over zero-shot's in the same round (`paired`): the spread a ratio really has here."""
    rounds: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in modes}
    for rnd in range(repeats):
        for mode in modes:
            base = MODES[0] if mode == NOISE_MODE else mode
            # ICL without a prefix cache re-encodes every demonstration for every query: one
            # timed classification pass (many times slower than the noise), no generation
            if base == "icl-no-cache" and rnd > 0:
                continue
            gen = 0 if base == "icl-no-cache" else gen_tokens
            results = []
            for eng in engines(base, wl, settings, wl.queries, work_dir / "adapters"):
                if mode == NOISE_MODE:
                    eng.label = "zero-shot-again"
                if repeats > 1:
                    eng.label += f"#{rnd + 1}"
                log(f"offline {eng.label}: {sum(map(len, eng.groups))} requests")
                t0 = time.time()
                results.append(run_engine_job(eng, [{"name": "main", "groups": eng.groups}],
                                              repeats=INNER_PASSES, gen_tokens=gen,
                                              warmup=warmup,
                                              settings=settings, log_dir=work_dir / "logs",
                                              resume=resume, log=log))
                log(f"  done in {time.time() - t0:.0f} s")
            rounds[mode].append(results)
    out: dict[str, Any] = {}
    for mode, rs in rounds.items():
        # one engine's rounds as one result with a time per round (what combine_offline sums
        # across a mode's engines); answers, memory and start-up from the first round
        merged = []
        for e, first in enumerate(rs[0]):
            main = {**first["passes"]["main"]}
            for key in ("classify_seconds", "generate_seconds"):
                # a round's time: the fastest of its engine's passes (as timeit reports)
                runs = [r[e]["passes"]["main"][key] for r in rs]
                main[key] = [min(x) for x in runs if x]
                main[f"{key}_passes"] = runs
            merged.append({**first, "passes": {"main": main},
                           "peak_rss_bytes": max(r[e]["peak_rss_bytes"] for r in rs)})
        out[mode] = {**combine_offline(merged), "repeats": len(rs),
                     "gen_tokens": 0 if mode == "icl-no-cache" else gen_tokens}
        log(f"  {mode}: {out[mode]['requests_per_s']:.1f} req/s, "
            f"accuracy {100 * out[mode]['accuracy']:.1f}%")
    if "zero-shot" in out:
        zs = out["zero-shot"]
        for r in out.values():
            r["paired"] = paired_ratios(r, zs)
    return out


def paired_ratios(r: dict[str, Any], zs: dict[str, Any]) -> dict[str, list[float]]:
    """Per round: this mode's rate over zero-shot's in the same round (the time ratio)."""
    out = {}
    for key, what in (("classify_seconds", "requests_per_s"),
                      ("generate_seconds", "output_tokens_per_s")):
        a, b = r.get(key) or [], zs.get(key) or []
        out[what] = [tz / t for t, tz in zip(a, b, strict=False) if t]
    return out


def run_online(wl: Workload, modes: Sequence[str], settings: EngineSettings, *,
               queries: list[Query], levels: Sequence[int], warmup: int, work_dir: Path,
               log: Callable[[str], None], resume: bool = False) -> dict[str, Any]:
    from ltv_vllm.bench.online import Server, drive

    out: dict[str, Any] = {}
    env = {**settings.env(), "VLLM_SERVER_DEV_MODE": "1", "TOKENIZERS_PARALLELISM": "false"}
    (work_dir / "logs").mkdir(parents=True, exist_ok=True)
    for mode in modes:
        base = MODES[0] if mode == NOISE_MODE else mode
        per_level: dict[int, list[dict[str, Any]]] = {c: [] for c in levels}
        startup = 0.0
        for eng in engines(base, wl, settings, queries, work_dir / "adapters"):
            reqs = [r for g in eng.groups for r in g]
            stem = _stem(eng.label)
            if mode == NOISE_MODE:
                stem += "-again"
            cache = work_dir / "logs" / f"online-{stem}.json"
            key = json.dumps({"args": eng.server_args(HOST, 0), "requests": reqs,
                              "levels": list(levels), "warmup": warmup})
            if resume and cache.exists() and json.loads(cache.read_text())["key"] == key:
                done = json.loads(cache.read_text())
                log(f"online {eng.label}: reusing the result measured at {done['measured_at']}")
            else:
                done = {"key": key, "levels": {}}
                port = _free_port()
                log(f"online {eng.label}: starting server")
                with Server(eng.server_args(HOST, port), url=f"http://{HOST}:{port}",
                            env={**env, **eng.env},
                            log_path=work_dir / "logs" / f"server-{stem}.log") as srv:
                    done["startup"] = srv.startup_s
                    if warmup:
                        drive(srv.url, reqs[:warmup], min(8, warmup))
                    for c in levels:
                        srv.reset_prefix_cache()
                        with srv.sampling():
                            wall, res = drive(srv.url, reqs, c)
                        done["levels"][str(c)] = {"wall": wall, "results": res,
                                                  "peak_rss": srv.peak_rss, "peak_kv": srv.peak_kv}
                        log(f"  concurrency {c}: {len(reqs) / wall:.1f} req/s")
                done["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
                cache.write_text(json.dumps(done))
            startup += done["startup"]
            for c in levels:
                per_level[c].append(done["levels"][str(c)])
        out[mode] = {str(c): _combine_online(parts) for c, parts in per_level.items()}
        out[mode]["startup_seconds"] = startup
    return out


def _combine_online(parts: list[dict[str, Any]]) -> dict[str, Any]:
    res = [x for p in parts for x in p["results"]]
    wall = sum(p["wall"] for p in parts)
    lat = sorted(x["latency"] for x in res)
    return {
        "requests": len(res),
        "seconds": wall,
        "requests_per_s": len(res) / wall,
        "output_tokens_per_s": len(res) / wall,  # one token per classification request
        "latency_p50_ms": 1000 * _quantile(lat, 0.50),
        "latency_p99_ms": 1000 * _quantile(lat, 0.99),
        "accuracy": sum(x["pred"] == x["gold"] for x in res) / max(1, len(res)),
        # per query, in workload order, as offline: what the server answered, to be checked
        "predictions": [x["pred"] for x in sorted(res, key=lambda x: x["qid"])],
        "probs": [x["probs"] for x in sorted(res, key=lambda x: x["qid"])],
        "peak_rss_bytes": max(p["peak_rss"] for p in parts),
        "peak_kv_usage": max(p["peak_kv"] for p in parts),
    }


def _quantile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list."""
    if not sorted_xs:
        return float("nan")
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def run_icl_cost(wl: Workload, ks: Sequence[int], settings: EngineSettings, *, n_per_task: int,
                 seed: int, repeats: int, warmup: int, work_dir: Path,
                 log: Callable[[str], None], resume: bool = False) -> dict[str, Any]:
    """ICL serving cost as k grows (prefix cache on and off); LTV fused as the flat reference."""
    from ltv_vllm.bench.modes import request

    by_k: dict[int, list[Query]] = {}
    for k in ks:
        per_task = {name: icl_queries(t, k=k, n_test=n_per_task, seed=seed)
                    for name, t in wl.tasks.items()} if k else {}
        by_k[k] = interleave(per_task) if k else []
    out: dict[str, Any] = {"k": list(ks)}
    for mode in ("icl-prefix-cache", "icl-no-cache"):
        eng = engines(mode, wl, settings, wl.queries, work_dir / "adapters")[0]
        passes = []
        for k in ks:
            qs = by_k[k] or wl.queries  # k = 0: the zero-shot prompts
            groups: dict[str, list[dict[str, Any]]] = {}
            for q in qs:
                groups.setdefault(q.task, []).append(request(wl, q, icl=k > 0, model="base"))
            passes.append({"name": f"k={k}", "groups": list(groups.values())})
        log(f"icl-cost {mode}: k in {list(ks)}")
        eng.label = f"icl-cost-{mode}"
        res = run_engine_job(eng, passes, repeats=repeats, gen_tokens=0, warmup=warmup,
                             settings=settings, log_dir=work_dir / "logs", resume=resume, log=log)
        out[mode] = {p["name"]: combine_offline([res], p["name"]) for p in passes}
    fused = [run_engine_job(e, [{"name": "main", "groups": e.groups}], repeats=repeats,
                            gen_tokens=0, warmup=warmup, settings=settings,
                            log_dir=work_dir / "logs", resume=resume, log=log)
             for e in engines("ltv-fused", wl, settings, wl.queries, work_dir / "adapters")]
    out["ltv-fused"] = combine_offline(fused)
    return out


ONLINE_MODES = ("zero-shot", "icl-prefix-cache", "icl-no-cache", "ltv-fused", "ltv-shift",
                "ltv-lora")


@dataclass(frozen=True)
class ServingBench:
    """One serving (or ICL-cost) benchmark run: workload, modes, engine settings, output.

    Built once by the CLI and checked there (modes, counts, writable output), before any
    vector is extracted or engine started.
    """

    model_spec: str = "smollm2-135m"
    tasks: tuple[str, ...] = ("sst2", "subj", "trec", "agnews")
    n_per_task: int = 125
    modes: tuple[str, ...] = DEFAULT_MODES
    online_modes: tuple[str, ...] = ONLINE_MODES
    levels: tuple[int, ...] = (1, 8, 32)
    online_requests: int = 100
    gen_tokens: int = 16
    k: int = 30  # demonstrations behind the ICL prompts and the vectors
    n: int = 256
    lam: float = 5.0
    seed: int = 0
    noise_check: bool = True
    settings: EngineSettings = EngineSettings()
    repeats: int = 3
    warmup: int = 16
    out_dir: Path = Path("benchmarks/results/serving")
    work_dir: Path | None = None  # [default: out_dir/work]
    resume: bool = False
    ks: tuple[int, ...] = (0, 10, 30, 50)  # icl-cost only: demonstrations per prompt
    reference: bool = True  # serving: transformers' float32 answers for every served mode

    def __post_init__(self) -> None:
        from ltv_vllm.errors import ArgumentError
        from ltv_vllm.pipeline.extract import check_counts

        unknown = [m for m in [*self.modes, *self.online_modes] if not known_mode(m)]
        if unknown:
            raise ArgumentError(f"unknown mode(s) {', '.join(unknown)} "
                                f"(known: {', '.join(MODES)}, ltv-lora-rR for a rank-R cap)")
        if not self.tasks:
            raise ArgumentError("--tasks: give at least one task")
        check_counts(k=self.k, n=self.n, lam=self.lam)
        for name, v, low in (("--n-per-task", self.n_per_task, 1), ("--repeats", self.repeats, 1),
                             ("--online-requests", self.online_requests, 1),
                             ("--warmup", self.warmup, 0), ("--gen-tokens", self.gen_tokens, 0),
                             ("--kv-cache-gib", self.settings.kv_cache_gib, 1),
                             ("--max-model-len", self.settings.max_model_len, 1),
                             *(("--concurrency", c, 1) for c in self.levels),
                             *(("--ks", c, 0) for c in self.ks)):
            if v < low:
                raise ArgumentError(f"{name} must be at least {low}, got {v}")

    @property
    def work(self) -> Path:
        return self.work_dir or self.out_dir / "work"


def _resolved(wl: Workload, settings: EngineSettings) -> EngineSettings:
    """The settings with `auto` turned into the dtype this machine runs fast (`hardware`)."""
    from dataclasses import replace

    from ltv_vllm.models.hardware import resolve_for_model

    return replace(settings, dtype=resolve_for_model(settings.dtype, wl.model_dir))


def bench_serving(b: ServingBench, *, command: str,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the workload, run the offline and online modes, write JSON, markdown and plots."""
    from dataclasses import asdict

    from ltv_vllm.bench.workload import build_workload, kv_bytes_per_token, machine

    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if b.modes:
        prestart()  # the job forkserver imports vLLM while the workload is built
    wanted = [*b.modes, *b.online_modes]
    with_kernel = "kernel-fused" in wanted
    needs_vectors = with_kernel or any(m.startswith("ltv") for m in wanted)
    wl = build_workload(b.model_spec, list(b.tasks), n_per_task=b.n_per_task, k=b.k, n=b.n,
                        lam=b.lam, seed=b.seed, vector_dir=b.work / "vectors",
                        with_vectors=needs_vectors, with_kernel=with_kernel)
    settings = _resolved(wl, b.settings)
    doc: dict[str, Any] = {
        "command": command, "model": b.model_spec, "started": started, "machine": machine(),
        "settings": asdict(settings), "workload": wl.describe(), "repeats": b.repeats,
        "gen_tokens": b.gen_tokens, "online_requests": None,
        "kv_bytes_per_token": kv_bytes_per_token(wl.model_dir, settings.dtype),
    }
    if b.reference:
        from ltv_vllm.bench.reference import transformers_reference

        doc["transformers"] = transformers_reference(wl, list(dict.fromkeys(wanted)), log=log)
    t0 = time.time()
    if b.modes:
        order = list(b.modes)
        if b.noise_check and "zero-shot" in order:
            order.append(NOISE_MODE)
        doc["offline"] = run_offline(wl, order, settings, repeats=b.repeats,
                                     gen_tokens=b.gen_tokens, warmup=b.warmup, work_dir=b.work,
                                     log=log, resume=b.resume)
    if b.online_modes:
        queries = wl.queries[:b.online_requests]
        doc["online_requests"] = len(queries)
        order = list(b.online_modes)
        if b.noise_check and "zero-shot" in order:
            order.append(NOISE_MODE)
        doc["online"] = run_online(wl, order, settings, queries=queries, levels=b.levels,
                                   warmup=b.warmup, work_dir=b.work, log=log, resume=b.resume)
    doc["seconds"] = time.time() - t0
    return render(doc, b.out_dir)


def bench_icl_cost(b: ServingBench, *, command: str,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """ICL serving cost for each k in `b.ks`; LTV fused (vectors from `b.k` demos) beside it."""
    from dataclasses import asdict

    from ltv_vllm.bench.workload import build_workload, machine

    prestart()
    # LTV's serving cost does not depend on the k its vector came from (`b.k`)
    wl = build_workload(b.model_spec, list(b.tasks), n_per_task=b.n_per_task, k=b.k, n=b.n,
                        lam=b.lam, seed=b.seed, vector_dir=b.work / "vectors")
    settings = _resolved(wl, b.settings)
    doc: dict[str, Any] = {"command": command, "model": b.model_spec,
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
                           "settings": asdict(settings), "workload": wl.describe()}
    doc["icl_cost"] = run_icl_cost(wl, b.ks, settings, n_per_task=b.n_per_task, seed=b.seed,
                                   repeats=b.repeats, warmup=b.warmup, work_dir=b.work, log=log,
                                   resume=b.resume)
    return render(doc, b.out_dir)


def render(doc: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Rates, targets, results.json, results.md and plots of a serving or icl-cost doc."""
    from ltv_vllm.bench import report

    if "icl_cost" in doc:
        ic = doc["icl_cost"]
        for r in [*ic["icl-prefix-cache"].values(), *ic["icl-no-cache"].values(), ic["ltv-fused"]]:
            derive_rates(r)
        report.write(doc, out_dir, report.icl_cost_markdown(doc))
        plots = [report.icl_cost_plot(doc, out_dir)]
    else:
        for r in (doc.get("offline") or {}).values():
            derive_rates(r)
        doc["targets"] = report.targets(doc)
        report.write(doc, out_dir, report.markdown(doc))
        plots = report.plot(doc, out_dir)
    doc["plots"] = [str(p) for p in plots]
    return doc


def rerender(out_dir: Path) -> dict[str, Any]:
    """Re-render a result directory from its results.json (no engine runs)."""
    return render(json.loads((out_dir / "results.json").read_text()), out_dir)
