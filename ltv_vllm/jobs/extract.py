"""`ltv-vllm extract` as one call: `extract_file(ExtractJob(...))`.

Every refusal a user can cause is checked first (`check_job`: the method against the engine,
the task's kind, a transfer, the prompt format, the user's own examples; then the output
path, the tokenizer, the labels and the episode's data), before a model loads; then the engine
is chosen (transformers in this process, or vLLM's engine for the model or a transfer's
source), the states captured, the artifact fitted by the pipeline (`pipeline.extract`, or
`pipeline.transfer`, or `evaluation.regress` for a regression task) and written. The command
parses its flags into an ExtractJob and prints the `Outcome`; a Python caller makes the same
call. Runs in the user's process (a vLLM capture in the offline job it starts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ltv_vllm.core.fileio import check_writable
from ltv_vllm.errors import ArgumentError
from ltv_vllm.jobs.formats import PromptFormat
from ltv_vllm.pipeline.extract import ExtractOptions

Report = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class ExtractJob:
    """One extraction as a user asks for it. `opts.teacher` is the teacher as given;
    `auto_gold`: with no gold weight given, labelled queries' labels are blended in at the
    default weight where that applies (`pipeline.extract.default_teacher`). `source`: a
    transfer's large model (`pipeline.transfer.SourceOptions`). `engine`: what captures the
    model's states ("transformers" or "vllm"); `vllm`: the vLLM engine's settings
    (`serving.offline.capture.CaptureEngine`) wherever one side runs on vLLM, with the
    planned `devices` and `device_gib`."""

    task: str
    method: str = "ltv"
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    opts: ExtractOptions = field(default_factory=ExtractOptions)
    auto_gold: bool = True
    prompt_format: PromptFormat = field(default_factory=PromptFormat)
    output: str | Path | None = None
    demos_file: str | None = None
    queries_file: str | None = None
    source: Any = None
    engine: str = "transformers"
    vllm: Any = None
    devices: int | None = None
    device_gib: float | None = None

    @property
    def on_vllm(self) -> bool:
        return self.engine == "vllm"

    @property
    def source_on_vllm(self) -> bool:
        return self.source is not None and self.source.engine == "vllm"


@dataclass(frozen=True)
class Checked:
    """A job past the checks that need no tokenizer: its task, options (k and N from the
    user's examples), the user's examples, the device and the output path."""

    task: Any
    opts: ExtractOptions
    demos: tuple[Any, ...] | None
    queries: tuple[Any, ...] | None
    device: str
    output: Path
    regression: bool

    @property
    def given(self) -> dict[str, Any]:
        return {"demos": self.demos, "queries": self.queries}


@dataclass(frozen=True)
class Outcome:
    """What an extraction made: the file written, its artifact, the held-out metrics, the
    timings and choices, on which model and device (a regression task: `metrics` are MSE,
    parse rate and first-token KL per method)."""

    job: ExtractJob
    task: Any
    output: Path
    artifact: Any
    metrics: dict[str, dict[str, float]]
    timings: dict[str, float]
    params: dict[str, Any]
    model: str
    device: str
    opts: ExtractOptions
    source: Any = None  # the transfer's SourceModel (its capture store's counts)
    regression: bool = False


def check_job(job: ExtractJob) -> Checked:
    """Everything about `job` that can be refused without a tokenizer or a model, in one
    line each."""
    from ltv_vllm.methods import check_options_apply, get_method
    from ltv_vllm.models.hardware import engine_device, resolve_device
    from ltv_vllm.pipeline.extract import check_engine, states_methods
    from ltv_vllm.tasks.specs import get_task

    opts, method = job.opts, job.method
    m = get_method(method)
    check_options_apply([method], opts.method_options())
    if not opts.teacher.is_default and (job.source is not None
                                        or method not in states_methods()):
        raise ArgumentError(f"--teacher {opts.teacher.calibration} / --gold-weight shape the "
                            "states a map is fitted to: methods "
                            f"{', '.join(states_methods())}, without --source-model")
    check_engine(method, job.engine)  # an inner-layer method on vLLM: refused here
    if job.on_vllm and (job.source is not None or job.device not in ("auto", engine_device())):
        raise ArgumentError("--engine vllm places the model itself (no --device) and does not "
                            "capture a transfer's small target (--source-engine vllm runs its "
                            "source on vLLM)")
    device = resolve_device(job.device)
    t = get_task(job.task, regression=True)
    regression = t.kind == "regression"
    job.prompt_format.check([method], regression=regression, transfer=job.source is not None,
                            engine=job.engine)
    demos, queries = _given_examples(t, job.demos_file, job.queries_file, opts)
    if demos is not None or queries is not None:
        opts = replace(opts, **({"k": len(demos)} if demos else {}),
                       **({"n": len(queries)} if queries else {}))
    if regression and job.on_vllm:
        raise ArgumentError(f"{t.name} is a regression task: it is scored on generated answers "
                            "(extract with --engine transformers)")
    if regression:
        if opts.demo_sets > 1:
            raise ArgumentError(f"{t.name} is a regression task: --demo-sets draws its sets "
                                "from a classification task's data")
        if job.source or opts.rank is not None or "regression" not in m.supports:
            raise ArgumentError(f"{t.name} is a regression task: extract --method ltv or mean, "
                                "without --source-model or --rank")
    elif job.source is not None and method != "ltv":
        raise ArgumentError(f"--method {method}: --source-model transfers LTV only")
    return Checked(t, opts, demos, queries, device, default_output(job, t), regression)


def default_output(job: ExtractJob, t: Any) -> Path:
    """`-o` when not given: TASK.pt for ltv, TASK.METHOD.pt for another task-vector method,
    TASK.METHOD.safetensors for a baseline's artifact, TASK.transfer.pt for a transfer."""
    suffixes = output_suffixes(job.method, t.kind == "regression")
    if job.output is not None:
        return Path(job.output)
    if t.kind == "regression":
        return Path(f"{t.name}{'' if job.method == 'ltv' else f'.{job.method}'}.pt")
    return Path(f"{t.name}.transfer.pt" if job.source else f"{t.name}.pt"
                if job.method == "ltv" else f"{t.name}.{job.method}{suffixes[0]}")


def output_suffixes(method: str, regression: bool = False) -> tuple[str, ...]:
    """A task-vector file (what a server loads; a regression task's vector) is .pt or
    .safetensors; another method's artifact, .safetensors."""
    from ltv_vllm.methods import get_method

    vector_file = regression or "fused" in get_method(method).supports
    return (".pt", ".safetensors") if vector_file else (".safetensors",)


def _given_examples(t: Any, demos_file: str | None, queries_file: str | None,
                    opts: ExtractOptions) -> tuple[Any, Any]:
    """The user's --demos / --queries, read before any model loads."""
    from ltv_vllm.tasks.data import read_examples

    if demos_file is None and queries_file is None:
        return None, None
    if t.kind == "regression":
        raise ArgumentError(f"{t.name} is a regression task: its demonstrations and queries "
                            "are drawn from its function (no --demos or --queries)")
    if demos_file is not None and opts.k is not None:
        raise ArgumentError("--demos gives the demonstrations (k is their count): drop --k")
    return (read_examples(demos_file, t, labelled=True) if demos_file else None,
            read_examples(queries_file, t, labelled=False) if queries_file else None)


def plan_lines(job: ExtractJob) -> list[str]:
    """`--dry-run`: the memory plan of the job's vLLM capture (the model's, or a transfer
    source's with its whole LM head on the host), from config.json (and the index) alone;
    refused in one line when it does not fit. Nothing is loaded or written."""
    from ltv_vllm.pipeline.extract import plan_episode

    if not (job.on_vllm or job.source_on_vllm):
        raise ArgumentError("--dry-run plans an --engine vllm or --source-engine vllm run")
    c = check_job(job)  # a regression task on vLLM, or transferred: refused there
    transfer = not job.on_vllm
    spec = job.source.spec if transfer else job.model
    return capture_plan_lines(spec, [plan_episode(c.task, c.opts, transfer=transfer,
                                                  **c.given)],
                              job.vllm, devices=job.devices, device_gib=job.device_gib,
                              full_head=transfer)


def capture_plan_lines(model_spec: str | None, episodes: list[Any], engine: Any, *,
                       devices: int | None, device_gib: float | None,
                       full_head: bool = False) -> list[str]:
    """The plan of capturing `episodes` on vLLM, as lines (`extract` and `evaluate`
    --dry-run); refused in one line when it does not fit."""
    from ltv_vllm.models.loading import load_tokenizer, local_model_dir
    from ltv_vllm.models.plan import describe, require_fit
    from ltv_vllm.serving.offline.capture import plan_capture

    # a hub id's config, index and tokenizer: a plan loads nothing, so it fetches no weights
    path = local_model_dir(model_spec or "smollm2-135m", weights=False)
    tokenizer = None  # a config-only directory: token counts are estimated
    if any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                                 "vocab.json")):
        # (transformers 5 builds an empty tokenizer from a config alone: asked only where
        # there are tokenizer files)
        tokenizer = load_tokenizer(path)
    plan, req, estimated = plan_capture(path, episodes, engine, tokenizer=tokenizer,
                                        devices=devices, device_gib=device_gib,
                                        full_head=full_head)
    lines = describe(plan, req, name=model_spec or "smollm2-135m")
    if estimated:
        lines.append("  (no tokenizer in the directory: token counts estimated at 4 "
                     "characters a token)")
    require_fit(plan)
    return [*lines, "(dry run: nothing loaded, nothing written)"]


def extract_file(job: ExtractJob, report: Report | None = None) -> Outcome:
    """Run `job`: checks, capture (transformers or vLLM), fit, score, and the artifact
    written to its output (nothing is written when a check refuses it). `report`: a vLLM
    capture's progress lines."""
    from ltv_vllm.models.loading import load_model, load_tokenizer
    from ltv_vllm.pipeline.extract import default_teacher, extract, plan_episode
    from ltv_vllm.pipeline.transfer import extract_transfer, open_source
    from ltv_vllm.tasks.specs import label_token_ids

    c = check_job(job)
    if c.regression:
        return _regression(job, c)
    output = check_writable(c.output, option="--output", suffixes=output_suffixes(job.method))
    tok = load_tokenizer(job.model)
    t = job.prompt_format.render(c.task, tok)  # a chat template it cannot use: refused
    label_token_ids(t, tok)  # labels sharing a first token: refused
    transfer = job.source is not None
    planned = plan_episode(t, c.opts, transfer=transfer, **c.given)  # reads the data
    opts = c.opts
    if job.auto_gold:  # labelled queries: their gold labels blended in (core.teacher)
        opts = replace(opts, teacher=default_teacher(opts.teacher, job.method, t, planned,
                                                     transfer=transfer))
    large = open_source(job.source) if transfer else None  # tokenizer and identity only
    device = c.device
    if job.on_vllm or job.source_on_vllm:
        from ltv_vllm.serving.offline.capture import capture_model, capture_source
    if job.source_on_vllm:
        capture_source(large, [planned], job.vllm, devices=job.devices,
                       device_gib=job.device_gib, report=report)
    if job.on_vllm:
        lm = capture_model(job.model, [planned], job.vllm, devices=job.devices,
                           device_gib=job.device_gib, report=report)
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"  # where vLLM placed it
    else:
        lm = load_model(job.model, dtype=job.dtype, device=device)
    if large is None:
        r = extract(lm, t, job.method, opts, episode=planned)
        art, metrics, tm, params = r.artifact, r.metrics, r.timings, r.params
    else:
        art, res = extract_transfer(lm, large, t, opts, episode=planned)
        metrics, tm, params = res.metrics, res.timings, {}
    art.save(output)
    return Outcome(job, t, output, art, metrics, tm, params, lm.spec, device, opts, large)


def _regression(job: ExtractJob, c: Checked) -> Outcome:
    """A regression task: the vector of one instance, scored by generated answers."""
    from ltv_vllm.evaluation.regress import extract_regression
    from ltv_vllm.models.loading import load_model

    output = check_writable(c.output, option="--output",
                            suffixes=output_suffixes(job.method, regression=True))
    lm = load_model(job.model, dtype=job.dtype, device=c.device)
    tv, metrics = extract_regression(lm, c.task, c.opts, method=job.method)
    tv.save(output)
    return Outcome(job, c.task, output, tv, metrics, dict(tv.provenance.timings), {}, lm.spec,
                   c.device, c.opts, regression=True)
