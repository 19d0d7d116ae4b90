"""`ltv-vllm bench ...`: the benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from ltv_vllm.cli.base import (
    BATCH,
    DEVICE_HELP,
    DTYPE,
    DTYPE_HELP,
    EngineFlags,
    EpisodeFlags,
    ExecutorFlags,
    FitFlags,
    TeacherFlags,
    _command_line,
    _csv,
    _engine_options,
    _executor_options,
    _format_options,
    _ints,
    _task_specs,
    _teacher_options,
    exit_if_failed,
    friendly,
    grouped,
    lam_option,
    main,
)
from ltv_vllm.core.fileio import check_writable
from ltv_vllm.errors import ArgumentError


def _serving_bench(out_dir: Path, engine: EngineFlags, fit: FitFlags, **fields: Any) -> Any:
    """ServingBench from the command's options, output paths checked."""
    from ltv_vllm.bench.serving import ServingBench
    from ltv_vllm.bench.workload import EngineSettings

    check_writable(out_dir, option="--out", directory=True)
    if engine.work_dir is not None:
        check_writable(engine.work_dir, option="--work-dir", directory=True)
    settings = EngineSettings(dtype=engine.dtype, max_model_len=engine.max_model_len,
                              kv_cache_gib=engine.kv_cache_gib,
                              max_num_seqs=engine.max_num_seqs, seed=fit.seed)
    return ServingBench(out_dir=out_dir, work_dir=engine.work_dir, settings=settings,
                        repeats=engine.repeats, warmup=engine.warmup, resume=engine.resume,
                        **asdict(fit), **fields)


@dataclass(frozen=True)
class ModeFlags:
    """What bench serving serves: the offline modes, the modes served through the OpenAI
    server, and the online load (concurrency levels, requests per level)."""

    modes: str
    online_modes: str
    concurrency: str
    online_requests: int

    def fields(self) -> dict[str, Any]:
        """ServingBench's fields (the lists parsed: a bad one is one line)."""
        return {"modes": tuple(_csv(self.modes)), "online_modes": tuple(_csv(self.online_modes)),
                "levels": tuple(_ints(self.concurrency)),
                "online_requests": self.online_requests}


@dataclass(frozen=True)
class ShapeFlags:
    """bench extraction --shape: the whole extract() at a real model's shape on --device,
    per batch of --batch-sizes; checked by `_bench_device_extraction`."""

    shape: str | None
    device: str
    batch_sizes: str
    n_test: int
    layers: int | None


# the fit's flags as the benchmarks declare them (no help; λ a number)
_K = click.option("--k", default=30, show_default=True)
_N = click.option("--n", default=256, show_default=True)
_LAM = click.option("--lam", default=5.0, show_default=True)
_SEED = click.option("--seed", default=0, show_default=True)


@main.group()
def bench() -> None:
    """Benchmarks: serving modes side by side, ICL cost against k, extraction cost, rank."""


def _sweep_executor(execution: ExecutorFlags, model_spec: str, dtype: str) -> tuple[Any, str]:
    """A bench sweep's executor (None: here, in order; the cluster reached, or one line,
    before any model loads) and the concrete dtype every episode computes in: resolved
    once here, so workers on other CPUs do not each pick their own for `auto`. A worker
    that declares GPUs puts its model there; episodes here run on the CPU."""
    from ltv_vllm.models.hardware import resolve_for_model
    from ltv_vllm.models.loading import local_model_dir

    device = "cuda" if execution.executor == "ray" and execution.episode_gpus else "cpu"
    if dtype == "auto" and device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ArgumentError("--dtype auto on GPU workers needs a GPU here to resolve it "
                                "(every worker computes in one dtype): give --dtype "
                                "bfloat16 or float16")
    dtype = resolve_for_model(dtype, local_model_dir(model_spec), device)
    return execution.executor_for(model_spec, dtype, device), dtype


@bench.command("serving")
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True)
@click.option("--tasks", "task_list", default="sst2,subj,trec,agnews", show_default=True)
@click.option("--n-per-task", default=125, show_default=True, help="Test queries per task.")
@grouped(
    ModeFlags,
    click.option("--modes",
                 default="zero-shot,icl-prefix-cache,icl-no-cache,ltv-fused,ltv-folded,"
                         "ltv-shift,ltv-lora",
                 show_default=True,
                 help="Offline modes ('' for none); also ltv-lora-rR: LoRA adapters cut to "
                      "rank R; ltv-fused-first: fused, the first generated token shifted only; "
                      "kernel-fused: the kernel LTV (RBF) served fused."),
    click.option("--online-modes",
                 default="zero-shot,icl-prefix-cache,icl-no-cache,ltv-fused,ltv-shift,ltv-lora",
                 show_default=True,
                 help="Modes served through the OpenAI server ('' for none)."),
    click.option("--concurrency", default="1,8,32", show_default=True),
    click.option("--online-requests", default=100, show_default=True,
                 help="Requests per concurrency level (a balanced prefix of the queries)."),
    name="served")
@click.option("--gen-tokens", default=16, show_default=True,
              help="Tokens per query in the offline generation pass (0: skip).")
@grouped(
    FitFlags, _K, _N, _LAM, _SEED, name="fit")
@click.option("--no-noise-check", is_flag=True, help="Skip the second zero-shot run.")
@click.option("--no-reference", is_flag=True,
              help="Skip transformers' float32 answers for every served mode (they load the "
                   "model in float32 on the CPU: for a model that does not fit there).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("benchmarks/results/serving"), show_default=True)
@_engine_options
@friendly
def bench_serving_cmd(model_spec: str, task_list: str, n_per_task: int, served: ModeFlags,
                      gen_tokens: int, fit: FitFlags, no_noise_check: bool, no_reference: bool,
                      out_dir: Path, engine: EngineFlags) -> None:
    """Zero-shot vs ICL (prefix cache on/off) vs LTV (fused, folded, LoRA) in vLLM."""
    from ltv_vllm.bench.report import markdown
    from ltv_vllm.bench.serving import bench_serving
    b = _serving_bench(
        out_dir, engine, fit, model_spec=model_spec, tasks=_task_specs(task_list),
        n_per_task=n_per_task, **served.fields(), gen_tokens=gen_tokens,
        noise_check=not no_noise_check, reference=not no_reference)
    doc = bench_serving(b, command=_command_line(), log=lambda m: click.echo(m, err=True))
    click.echo(markdown(doc))
    click.echo(f"wrote {out_dir}/results.json, results.md and plots")


@bench.command("icl-cost")
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True)
@click.option("--tasks", "task_list", default="sst2,agnews", show_default=True)
@click.option("--ks", default="0,10,30,50", show_default=True, help="Demonstrations per prompt.")
@click.option("--n-per-task", default=64, show_default=True)
@grouped(
    FitFlags,
    click.option("--vector-k", "k", default=30, show_default=True,
                 help="Demonstrations behind the LTV vectors (their serving cost does not "
                      "depend on it)."),
    _N, _LAM, _SEED, name="fit")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("benchmarks/results/icl_cost"), show_default=True)
@_engine_options
@friendly
def bench_icl_cost_cmd(model_spec: str, task_list: str, ks: str, n_per_task: int, fit: FitFlags,
                       out_dir: Path, engine: EngineFlags) -> None:
    """ICL serving cost as k grows (prefix cache on/off); LTV's does not depend on k."""
    from ltv_vllm.bench.report import icl_cost_markdown
    from ltv_vllm.bench.serving import bench_icl_cost
    b = _serving_bench(
        out_dir, engine, fit, model_spec=model_spec, tasks=_task_specs(task_list),
        n_per_task=n_per_task, ks=tuple(_ints(ks)), modes=(), online_modes=())
    doc = bench_icl_cost(b, command=_command_line(), log=lambda m: click.echo(m, err=True))
    click.echo(icl_cost_markdown(doc))


@bench.command("report")
@click.argument("out_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
def bench_report_cmd(out_dir: Path) -> None:
    """Re-render a serving, icl-cost or scaling result directory from its results.json."""
    import json

    from ltv_vllm.bench import scaling, serving

    try:
        doc = json.loads((out_dir / "results.json").read_text())
    except (OSError, ValueError) as e:
        raise ArgumentError(f"{out_dir / 'results.json'}: unreadable ({e})") from None
    (scaling if isinstance(doc, dict) and "demo_sets" in doc else serving).rerender(out_dir)
    click.echo((out_dir / "results.md").read_text())


@bench.command("extraction")
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True)
@click.option("--tasks", "task_list", default="sst2", show_default=True)
@click.option("--ks", default="10,30,50", show_default=True)
@click.option("--ns", default="64,128,256", show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--batch-size", default=16, show_default=True)
@click.option("--dtype", default="auto", show_default=True, type=DTYPE, help=DTYPE_HELP)
@click.option("--naive/--no-naive", default=True, show_default=True,
              help="Also time the reference code's path (slow).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=None,
              help="[default: benchmarks/results/extraction_cost; with --shape "
                   "benchmarks/results/extraction_SHAPE_DEVICE]")
@grouped(
    ShapeFlags,
    click.option("--shape", default=None,
                 help="Instead: the whole extract() at this real model's shape (random "
                      "weights built on --device, --model's tokenizer), per --batch-sizes, at "
                      "k = 30 (or the first of --ks) and the largest of --ns; one of "
                      "tests/fixtures/configs (llama-3.1-8b, qwen2.5-32b, ...) or a "
                      "config.json."),
    click.option("--device", default="auto", show_default=True,
                 help="With --shape. " + DEVICE_HELP),
    click.option("--batch-sizes", default="16,32,64,128,256,auto", show_default=True,
                 help="With --shape: the batches timed."),
    click.option("--n-test", default=500, show_default=True, help="With --shape."),
    click.option("--layers", type=int, default=None,
                 help="With --shape: build only this many decoder layers [default: all]."),
    name="at_shape")
@friendly
def bench_extraction_cmd(model_spec: str, task_list: str, ks: str, ns: str, seed: int,
                         batch_size: int, dtype: str, naive: bool, out_dir: Path | None,
                         at_shape: ShapeFlags) -> None:
    """Extraction time as k and N grow, with the shared demo cache and without it; or, with
    --shape, the whole extract() at a real model's shape on the device, per batch size."""
    from ltv_vllm.bench.extraction import bench_extraction, extraction_markdown
    from ltv_vllm.pipeline.extract import check_counts

    _task_specs(task_list)
    if at_shape.shape is not None:
        return _bench_device_extraction(model_spec, task_list, ks, ns, seed, dtype, naive,
                                        out_dir, at_shape)
    out_dir = out_dir or Path("benchmarks/results/extraction_cost")
    for k_ in _ints(ks):
        check_counts(k=k_)
    for n_ in _ints(ns):
        check_counts(n=n_)
    check_counts(batch_size=batch_size)
    check_writable(out_dir, option="--out", directory=True)
    doc = bench_extraction(model_spec, _csv(task_list), ks=_ints(ks), ns=_ints(ns), seed=seed,
                           batch_size=batch_size, dtype=dtype, naive=naive, out_dir=out_dir,
                           command=_command_line(), log=lambda m: click.echo(m, err=True))
    click.echo(extraction_markdown(doc))



def _bench_device_extraction(model_spec: str, task_list: str, ks: str, ns: str, seed: int,
                             dtype: str, naive: bool, out_dir: Path | None,
                             at_shape: ShapeFlags) -> None:
    from ltv_vllm.bench.device_extraction import bench_device_extraction, markdown, shapes
    from ltv_vllm.models.hardware import resolve_device
    from ltv_vllm.pipeline.extract import check_counts

    shape, n_test, layers = at_shape.shape or "", at_shape.n_test, at_shape.layers
    if shape not in shapes() and not (shape.endswith(".json") and Path(shape).is_file()):
        raise ArgumentError(f"--shape {shape}: one of {', '.join(shapes())}, or a config.json")
    device = resolve_device(at_shape.device)
    try:
        batches: list[int | str] = [BATCH.convert(b, None, None)
                                    for b in _csv(at_shape.batch_sizes)]
    except click.BadParameter as e:
        raise ArgumentError(f"--batch-sizes: {e.message}") from None
    for b in batches:
        check_counts(batch_size=b)
    if layers is not None and layers < 1:
        raise ArgumentError(f"--layers must be at least 1, got {layers}")
    k_list, n_list = _ints(ks), _ints(ns)
    k = 30 if 30 in k_list else k_list[0]
    n = max(n_list)
    check_counts(k=k, n=n, n_test=n_test)
    out_dir = out_dir or Path(
        f"benchmarks/results/extraction_{Path(shape).stem}_{device.split(':')[0]}")
    check_writable(out_dir, option="--out", directory=True)
    doc = bench_device_extraction(shape, model_spec, device=device, dtype=dtype,
                                  batch_sizes=batches, task_name=_csv(task_list)[0], k=k, n=n,
                                  n_test=n_test, seed=seed, naive=naive, out_dir=out_dir,
                                  command=_command_line(), layers=layers,
                                  log=lambda m: click.echo(m, err=True))
    click.echo(markdown(doc))


@bench.command("capture")
@click.option("--models", default="smollm2-135m,qwen2.5-coder-1.5b", show_default=True)
@click.option("--task", "task_name", default="sst2", show_default=True)
@click.option("--k", default=30, show_default=True)
@click.option("--n", default=256, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--batch-size", default=16, show_default=True, help="transformers' batch.")
@click.option("--dtype", default="auto", show_default=True, type=DTYPE, help=DTYPE_HELP)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("benchmarks/results/capture_engines"), show_default=True)
@friendly
def bench_capture_cmd(models: str, task_name: str, k: int, n: int, seed: int, batch_size: int,
                      dtype: str, out_dir: Path) -> None:
    """Capture time of one episode's train states: vLLM (eager and compiled) against
    transformers, side by side in one run, with peak memory and h's agreement."""
    from ltv_vllm.bench.capture_engines import bench_capture_engines, markdown
    from ltv_vllm.pipeline.extract import check_counts

    _task_specs(task_name)
    check_counts(k=k, n=n, batch_size=batch_size)
    check_writable(out_dir, option="--out", directory=True)
    doc = bench_capture_engines(_csv(models), task_name, k=k, n=n, seed=seed, dtype=dtype,
                                batch_size=batch_size, out_dir=out_dir,
                                command=_command_line(), log=lambda m: click.echo(m, err=True))
    click.echo(markdown(doc))


@bench.command("real-width")
@click.option("--config", "config_name", default="qwen2.5-72b", show_default=True,
              help="A config of tests/fixtures/configs whose width is built.")
@click.option("--layers", default=1, show_default=True, help="Decoder layers built.")
@click.option("--tokenizer-model", default="qwen2.5-coder-1.5b", show_default=True,
              help="Packaged model whose tokenizer the built model gets.")
@click.option("--tps", default="1,2", show_default=True, help="Tensor-parallel sizes run.")
@click.option("--dtype", default="auto", show_default=True, type=DTYPE, help=DTYPE_HELP)
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the model is built (several GB) [default: a temporary directory].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("benchmarks/results/real_width"), show_default=True)
@friendly
def bench_real_width_cmd(config_name: str, layers: int, tokenizer_model: str, tps: str,
                         dtype: str, work_dir: Path | None, out_dir: Path) -> None:
    """The vLLM capture at a large model's real width (few layers), against the plan and
    transformers."""
    import tempfile

    from ltv_vllm.bench.real_width import CONFIGS, bench_real_width, markdown

    if not (CONFIGS / f"{config_name}.json").is_file():
        raise ArgumentError(f"--config {config_name}: one of "
                            f"{', '.join(sorted(p.stem for p in CONFIGS.glob('*.json')))}")
    if layers < 1:
        raise ArgumentError(f"--layers must be at least 1, got {layers}")
    check_writable(out_dir, option="--out", directory=True)
    with tempfile.TemporaryDirectory(prefix="ltv-vllm-real-width-",
                                     dir=work_dir) as work:
        doc = bench_real_width(config_name, layers, tokenizer_model, tps=_ints(tps),
                               dtype=dtype, work=Path(work), out_dir=out_dir,
                               command=_command_line(), log=lambda m: click.echo(m, err=True))
    click.echo(markdown(doc))


@bench.command("rank")
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True)
@click.option("--tasks", "task_list", default="sst2,subj,trec,agnews", show_default=True)
@click.option("--ranks", default="1,4,8,16,32,64,128", show_default=True,
              help="Ranks to cut each fit to (the full rank is always added).")
@click.option("--runs", default=1, show_default=True,
              help="Episodes per task (seeds seed, seed+1, ...).")
@grouped(
    EpisodeFlags, _K, _N, _LAM,
    click.option("--n-test", default=500, show_default=True),
    _SEED,
    click.option("--batch-size", default=16, show_default=True),
    name="episode")
@click.option("--dtype", default="auto", show_default=True, type=DTYPE, help=DTYPE_HELP)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("benchmarks/results/rank"), show_default=True)
@_executor_options
@friendly
def bench_rank_cmd(model_spec: str, task_list: str, ranks: str, runs: int,
                   episode: EpisodeFlags, dtype: str, out_dir: Path,
                   execution: ExecutorFlags) -> None:
    """Accuracy and d_NTP of each LTV cut to lower ranks (what cheaper LoRA serving costs)."""
    from ltv_vllm.bench.rank import bench_rank, rank_markdown
    from ltv_vllm.pipeline.extract import check_counts

    _task_specs(task_list)
    for r in _ints(ranks):
        check_counts(rank=r)
    e = episode
    check_counts(runs=runs, k=e.k, n=e.n, lam=e.lam, n_test=e.n_test, batch_size=e.batch_size)
    check_writable(out_dir, option="--out", directory=True)
    executor, dtype = _sweep_executor(execution, model_spec, dtype)
    doc = bench_rank(model_spec, _csv(task_list), ranks=_ints(ranks), runs=runs, k=e.k, n=e.n,
                     lam=e.lam, n_test=e.n_test, seed=e.seed, batch_size=e.batch_size,
                     dtype=dtype, out_dir=out_dir, command=_command_line(), executor=executor,
                     log=lambda m: click.echo(m, err=True))
    exit_if_failed(doc, f"the others are in {out_dir}/results.json")
    click.echo(rank_markdown(doc))


@bench.command("scaling")
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True)
@click.option("--tasks", "task_list", default="packaged", show_default=True,
              help="Comma-separated task names/spec files, or 'packaged' for all seven.")
@click.option("--ns", default="64,256,1024", show_default=True,
              help="Train query counts N to fit at (each smaller N: the first N queries of the "
                   "largest; captured once, in nested slices).")
@click.option("--demo-sets", default=4, show_default=True,
              help="Demonstration sets M per episode (multi-prompt LTV fits their mean state; "
                   "1: the paper's LTV alone).")
@click.option("--runs", default=3, show_default=True,
              help="Episodes per task (seeds seed, seed+1, ...).")
@click.option("--k", default=30, show_default=True)
@lam_option("Both fits, each episode and N its own λ.")
@click.option("--n-test", default=100, show_default=True)
@_SEED
@click.option("--batch-size", default=16, show_default=True)
@click.option("--dtype", default="float32", show_default=True, type=DTYPE, help=DTYPE_HELP)
@_format_options
@_teacher_options
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("benchmarks/results/scaling"), show_default=True)
@_executor_options
@friendly
def bench_scaling_cmd(model_spec: str, task_list: str, ns: str, demo_sets: int, runs: int,
                      k: int, lam: float | str, n_test: int, seed: int, batch_size: int,
                      dtype: str, prompt_format: Any, teacher: TeacherFlags, out_dir: Path,
                      execution: ExecutorFlags) -> None:
    """Recovery of ICL's accuracy against N, for the paper's LTV and multi-prompt LTV, with
    the ICL ensemble and the capture time (rerun the same command to resume)."""
    from ltv_vllm.bench.scaling import bench_scaling, scaling_markdown
    from ltv_vllm.models.checkpoint import context_length
    from ltv_vllm.models.loading import load_tokenizer, local_model_dir
    from ltv_vllm.pipeline.extract import (
        ExtractOptions,
        check_context,
        check_counts,
        check_teacher,
        plan_episode,
    )
    from ltv_vllm.tasks.specs import get_tasks, label_token_ids

    sizes = _ints(ns)
    for n in sizes:
        check_counts(n=n)
    check_counts(runs=runs, k=k, lam=lam, n_test=n_test, batch_size=batch_size)
    if demo_sets < 1:
        raise ArgumentError(f"--demo-sets must be at least 1, got {demo_sets}")
    prompt_format.check(["ltv"])
    check_writable(out_dir, option="--out", directory=True)
    tok = load_tokenizer(model_spec)
    tasks = [prompt_format.render(t, tok) for t in get_tasks(task_list)]
    teacher_opts = teacher.options()
    context = context_length(local_model_dir(model_spec))
    for t in tasks:  # labels, k, N, the sets, the context, the teacher, before the model
        label_token_ids(t, tok)
        ep = plan_episode(t, ExtractOptions(k=k, n=max(sizes), n_test=n_test, seed=seed,
                                            n_val=0, demo_sets=demo_sets))
        check_context(tok, ep, t.special_tokens, context)
        check_teacher(teacher_opts, "ltv", t, None, ep)
    executor, dtype = _sweep_executor(execution, model_spec, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / "partial.json"  # rewritten after every episode; rerun to resume
    doc = bench_scaling(model_spec, tasks, ns=sizes, demo_sets=demo_sets, runs=runs, k=k,
                        lam=lam, n_test=n_test, seed=seed, batch_size=batch_size, dtype=dtype,
                        out_dir=out_dir, command=_command_line(), checkpoint=partial,
                        teacher=teacher_opts, executor=executor,
                        log=lambda m: click.echo(m, err=True))
    exit_if_failed(doc, f"the others are kept in {partial}: run the command again "
                               "to run only what is missing")
    partial.unlink(missing_ok=True)
    click.echo(scaling_markdown(doc))


@bench.command("teachers")
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True)
@click.option("--tasks", "task_list", default="packaged", show_default=True,
              help="Comma-separated task names/spec files, or 'packaged' for all seven.")
@click.option("--k", default=30, show_default=True,
              help="Demonstrations of each k-shot prompt (the prompt a vector replaces).")
@click.option("--many-k", default=120, show_default=True,
              help="Demonstrations of the many-shot teacher's prompt (k//K per class).")
@click.option("--demo-sets", default=2, show_default=True,
              help="k-shot demonstration sets M (the `sets` teacher and the ensemble).")
@click.option("--n", default=256, show_default=True)
@click.option("--runs", default=3, show_default=True,
              help="Episodes per task (seeds seed, seed+1, ...).")
@lam_option("Every fit, each episode its own λ.")
@click.option("--n-test", default=100, show_default=True)
@click.option("--n-dev", default=0, show_default=True,
              help="Labelled dev queries per episode (n_dev//K per class, disjoint from the "
                   "queries, demonstrations and test): every variant is scored on them and "
                   "a row chosen on dev is added (0: none; every row is then a test score).")
@_SEED
@click.option("--batch-size", default=16, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True, type=DTYPE, help=DTYPE_HELP)
@click.option("--variants", default=None,
              help="Comma-separated base/calibration[/gold weight] fits (base one|sets|many, "
                   "calibration icl|batch|contextual) [default: all bases × calibrations and "
                   "four gold blends].")
@click.option("--rescore", is_flag=True,
              help="Score the variants from the states stored under --out alone (refused "
                   "where an episode's are missing); loads no model.")
@click.option("--merge", "merge", multiple=True,
              type=click.Path(exists=True, path_type=Path),
              help="An earlier results.json of this bench (or its folder) with the same "
                   "configuration and other seeds: its episodes join the tables (repeatable), "
                   "so runs can be added without recapturing the earlier ones.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("benchmarks/results/teachers"), show_default=True)
@_executor_options
@friendly
def bench_teachers_cmd(model_spec: str, task_list: str, k: int, many_k: int, demo_sets: int,
                       n: int, runs: int, lam: float | str, n_test: int, n_dev: int, seed: int,
                       batch_size: int, dtype: str, variants: str | None, rescore: bool,
                       merge: tuple[Path, ...], out_dir: Path, execution: ExecutorFlags
                       ) -> None:
    """Fit vectors to better teachers than one k-shot prompt (many-shot, calibrated, gold
    blends) and score them against it; every episode's states are kept under --out/states,
    so rerunning with other --variants or --lam rescores without a recapture."""
    from dataclasses import replace

    from ltv_vllm.bench.teachers import (
        DEFAULT_VARIANTS,
        bench_teachers,
        merge_docs,
        parse_variant,
    )
    from ltv_vllm.models.checkpoint import context_length
    from ltv_vllm.models.loading import load_tokenizer, local_model_dir
    from ltv_vllm.pipeline.extract import (
        ExtractOptions,
        check_context,
        check_counts,
        plan_episode,
    )
    from ltv_vllm.tasks.data import check_disjoint, load_dataset, many_shot_demos
    from ltv_vllm.tasks.specs import get_tasks, label_token_ids

    check_counts(runs=runs, k=k, n=n, lam=lam, n_test=n_test, batch_size=batch_size)
    check_counts(k=many_k)
    if n_dev < 0:
        raise ArgumentError(f"--n-dev must be ≥ 0, got {n_dev}")
    if demo_sets < 1:
        raise ArgumentError(f"--demo-sets must be at least 1, got {demo_sets}")
    chosen = _csv(variants) if variants else list(DEFAULT_VARIANTS)
    for v in chosen:
        try:
            parse_variant(v)
        except ValueError as e:
            raise ArgumentError(f"--variants: {e}") from None
    check_writable(out_dir, option="--out", directory=True)
    tok = load_tokenizer(model_spec)
    context = context_length(local_model_dir(model_spec))
    tasks = get_tasks(task_list)
    if rescore and execution.executor == "ray":
        raise ArgumentError("--rescore loads no model: not with --executor ray")
    executor, concrete = _sweep_executor(execution, model_spec, dtype)
    merged = merge_docs(merge, {"model": model_spec, "dtype": concrete, "k": k, "many_k": many_k,
                                "demo_sets": demo_sets, "n": n, "n_test": n_test, "lam": lam,
                                "n_dev": n_dev},
                        [t.name for t in tasks], chosen, range(seed, seed + runs))
    for t in tasks:  # labels, k, N, the sets and the many-shot set before the model loads
        label_token_ids(t, tok)
        ep = plan_episode(t, ExtractOptions(k=k, n=n, n_test=n_test, seed=seed, n_val=n_dev,
                                            demo_sets=demo_sets))
        many = many_shot_demos(load_dataset(t), ep, many_k)
        check_disjoint(ep, many)
        for e in (ep, replace(ep, demos=many, extra_demos=())):  # each prompt fits the context
            check_context(tok, e, t.special_tokens, context)
    doc = bench_teachers(model_spec, tasks, k=k, many_k=many_k, demo_sets=demo_sets, n=n,
                         runs=runs, lam=lam, n_test=n_test, seed=seed, batch_size=batch_size,
                         dtype=concrete, variants=chosen, out_dir=out_dir, rescore=rescore,
                         merged=merged, n_dev=n_dev, command=_command_line(),
                         executor=executor, log=lambda m: click.echo(m, err=True))
    exit_if_failed(doc, f"the others' states are in {out_dir}/states: run the "
                               "command again to capture only what is missing")
    click.echo(f"results in {out_dir}: {len(doc['rows'])} episodes")
