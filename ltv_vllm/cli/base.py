"""What every command group shares: the root group, one-line errors, the option types
(λ, batch, dtype, device), `grouped` (options handed to a command as one frozen object) and
the groups several commands use: a transfer source, a vLLM capture, the model, an episode."""

from __future__ import annotations

import dataclasses
import functools
import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from ltv_vllm import __version__
from ltv_vllm.core.fileio import check_writable
from ltv_vllm.errors import ArgumentError
from ltv_vllm.jobs.formats import PromptFormat


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Anything a user can cause (`UserError`) ends in one line and exit status 1, not a
    traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from ltv_vllm.errors import UserError

        try:
            return fn(*args, **kwargs)
        except UserError as e:
            raise click.ClickException(" ".join(str(e).split())) from None

    return wrapper


def grouped(cls: type, *options: Callable[[Any], Any], name: str, prefix: str = ""
            ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator adding `options` to a command (in this order in its --help) and handing
    the command their values as one frozen `cls`, the keyword `name`: field `f` is the value
    of the parameter `prefix + f`. An option of the group may be declared apart from the
    others, to keep its place in --help (`--n-val` after `--quiet`): the group takes it by
    its name all the same. Checks stay in the command (`cls`'s methods), so a bad value is
    still one line."""
    names = [prefix + f.name for f in dataclasses.fields(cls)]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {n[len(prefix):]: kwargs.pop(n) for n in names if n in kwargs}
            return fn(*args, **{name: cls(**values)}, **kwargs)

        for opt in reversed(options):
            wrapper = opt(wrapper)
        return wrapper

    return decorate


def _command_line() -> str:
    """The running command with every option spelled out (defaults too), for reproduction."""
    ctx = click.get_current_context()
    names, c = [], ctx
    while c.parent is not None:  # the root's name is "python -m ltv_vllm.cli" when run so
        names.insert(0, c.info_name)
        c = c.parent
    parts = ["ltv-vllm", *names]
    for p in ctx.command.get_params(ctx):
        value = ctx.params.get(p.name)
        if not isinstance(p, click.Option) or value is None:
            continue
        flag = max(p.opts, key=len)
        if p.is_flag and p.secondary_opts:  # an on/off switch: whichever side was chosen
            parts += [flag if value else max(p.secondary_opts, key=len)]
        elif p.is_flag:
            parts += [flag] if value else []
        elif p.multiple:  # a repeatable option: the flag once per value, none when empty
            for v in value:
                parts += [flag, shlex.quote(str(v))]
        else:
            parts += [flag, shlex.quote(str(value))]
    return " ".join(parts)


class _Lam(click.ParamType):
    """--lam: a positive number, or `auto` (λ by closed-form leave-one-out error)."""

    name = "λ|auto"

    def convert(self, value, param, ctx):  # noqa: ANN001, ANN201 - click's signature
        if isinstance(value, int | float) or value == "auto":
            return value
        try:
            return float(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number nor 'auto'", param, ctx)


LAM = _Lam()


class _Batch(click.ParamType):
    """--batch-size: a count ≥ 1, or `auto` (from the device's free memory and the prompts'
    lengths, per pass: `extraction.batching`)."""

    name = "N|auto"

    def convert(self, value, param, ctx):  # noqa: ANN001, ANN201 - click's signature
        if isinstance(value, int) or value == "auto":
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a count nor 'auto'", param, ctx)


BATCH = _Batch()
BATCH_HELP = ("Prompts per forward pass, or auto: the most that fit in half the device's "
              "free memory at these prompts' lengths (at most 128 on a GPU, 16 on a CPU).")
LAM_HELP = ("Ridge penalty λ (> 0), or `auto`: the λ with the least closed-form "
            "leave-one-out error on a grid scaled to the states (no labels).")


def lam_option(more: str = "") -> Any:
    """--lam as every fitting command takes it (a number or `auto`); `more`: what it fits."""
    return click.option("--lam", default=5.0, show_default=True, type=LAM,
                        help=LAM_HELP + (f" {more}" if more else ""))

# the settings every method reads have their own flags in each command (`methods.base.COMMON`)
_OWN_FLAGS = ("lam", "seed", "batch_size", "progress")


class MethodCommand(click.Command):
    """A command whose method flags come from the method registry: every option a method
    declares in its own module (`methods.base.Option`) becomes a --flag here, with its
    default, type and help. The registry imports torch, so the flags are derived when the
    command parses or shows its help — never for `ltv-vllm --help` — and afresh each time
    (a method registered later shows up)."""

    def __init__(self, *args: Any, method_param: Callable[[], click.Parameter] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._static = list(self.params)
        self._method_param = method_param

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        from ltv_vllm.methods.base import DECLARED

        derived: list[click.Parameter] = [self._method_param()] if self._method_param else []
        for o in DECLARED.values():
            if o.name in _OWN_FLAGS:
                continue
            if o.type is bool:
                derived.append(click.Option([o.flag], is_flag=True, default=o.default,
                                            help=o.help))
            else:
                derived.append(click.Option([o.flag], type=o.type, default=o.default,
                                            show_default=o.default is not None, help=o.help))
        self.params = [*self._static, *derived]
        return super().get_params(ctx)


def _method_names_help() -> str:
    from ltv_vllm.methods import METHODS

    return "; ".join(f"{name} ({m.label}" + (", served by `serve`" if "fused" in m.supports
                                             else "") + ")" for name, m in METHODS.items())


def _method_option() -> click.Option:
    from ltv_vllm.methods import METHODS

    return click.Option(["--method"], default="ltv", show_default=True,
                        type=click.Choice(list(METHODS)),
                        help="The method extracted: " + _method_names_help() + ".")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ltv-vllm")
def main() -> None:
    """Linear Task Vectors: extract once with transformers, serve inside vLLM."""


# -- models ------------------------------------------------------------------------------


def _print_metrics(metrics: dict[str, dict[str, float]]) -> None:
    """The metrics table; a vector file's metrics are untrusted: an entry that is missing or
    not a finite number prints as "-" (never a traceback)."""
    from ltv_vllm.core.metrics import untrusted_number

    if not metrics:
        click.echo("nothing scored (no labelled test examples: the task names no data)")
        return
    width = max(10, *(len(str(m)) for m in metrics))
    click.echo(f"{'method':<{width}} {'accuracy':>9} {'d_NTP':>8}")
    for m, v in metrics.items():
        acc, d = (untrusted_number(v.get(k)) if isinstance(v, dict) else None
                  for k in ("accuracy", "d_ntp"))
        a_s = f"{100 * acc:>8.1f}%" if acc is not None else f"{'-':>9}"
        d_s = f"{d:>8.4f}" if d is not None else f"{'-':>8}"
        click.echo(f"{str(m)[:width]:<{width}} {a_s} {d_s}")


DEVICE_HELP = "auto: CUDA when there is a GPU, else the CPU; or cpu, cuda, cuda:1, ..."


DTYPE = click.Choice(["auto", "bfloat16", "float16", "float32"])
DTYPE_HELP = ("auto: what the device computes natively (CPU: bfloat16 only with native bf16, "
              "else float32; CUDA: bfloat16 where supported).")


@dataclass(frozen=True)
class SourceFlags:
    """The --source-* flags of a transfer, as given; `options` checks them into the
    pipeline's `SourceOptions` (inside the command, so a bad value is one line)."""

    spec: str | None
    dtype: str
    device_map: str | None
    quantization: str
    work_dir: Path | None
    chunk_size: int
    engine: str = "transformers"

    def options(self, batch_size: int, quiet: bool) -> Any:
        """SourceOptions (None without --source-model)."""
        from ltv_vllm.pipeline.transfer import SourceOptions

        if self.spec is None:
            return None
        if self.work_dir is not None:
            check_writable(self.work_dir, option="--work-dir", directory=True)
        import torch

        # the source on every GPU when there is one (a device map), else on the CPU
        device_map = self.device_map or ("auto" if torch.cuda.is_available() else None)
        return SourceOptions(self.spec, dtype=self.dtype, device_map=device_map,
                             quantization=None if self.quantization == "none"
                             else self.quantization,
                             work_dir=str(self.work_dir) if self.work_dir else None,
                             chunk_size=self.chunk_size, batch_size=batch_size,
                             progress=not quiet, engine=self.engine)


# the large model of a cross-model transfer (extract, evaluate), as one `source: SourceFlags`
_source_options = grouped(
    SourceFlags,
    click.option("--source-model", "source_spec", default=None,
                 help="Large model whose ICL the vector imitates (same tokenizer as --model): "
                      "fits a logit-space vector for --model."),
    click.option("--source-dtype", default="auto", show_default=True, type=DTYPE,
                 help=DTYPE_HELP),
    click.option("--source-device-map", default=None,
                 help="transformers device_map for the source [default: 'auto' (spread "
                      "over every GPU) when there is a GPU, else the CPU]."),
    click.option("--source-quantization", default="none", show_default=True,
                 type=click.Choice(["none", "8bit", "4bit"]),
                 help="Load the source with bitsandbytes (needs CUDA)."),
    click.option("--work-dir", "source_work_dir",
                 type=click.Path(file_okay=False, path_type=Path), default=None,
                 help="Where source captures are saved chunk by chunk; a rerun resumes from "
                      "them [default: the ltv-vllm cache's captures/]."),
    click.option("--chunk-size", "source_chunk_size", default=64, show_default=True,
                 help="Source prompts per saved chunk."),
    click.option("--source-engine", default="transformers", show_default=True,
                 type=click.Choice(["transformers", "vllm"]),
                 help="What captures the source: transformers, or vLLM's engine with "
                      "--tensor-parallel-size etc. (the missing chunks in one run)."),
    name="source", prefix="source_")


@dataclass(frozen=True)
class CaptureFlags:
    """--engine and vLLM's parallelism for the capture, as given; `engine` checks them into
    `serving.capture.CaptureEngine` (inside the command, so a bad value is one line)."""

    engine: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    distributed_executor_backend: str | None
    engine_args: tuple[str, ...]
    dry_run: bool
    devices: int | None
    device_gib: float | None

    def capture_engine(self, dtype: str, source_engine: str = "transformers") -> Any:
        """The CaptureEngine of whichever model runs on vLLM (`--engine vllm`, or the
        transfer source with `--source-engine vllm`)."""
        from ltv_vllm.serving.offline.capture import CaptureEngine

        if "vllm" not in (self.engine, source_engine) and (
                self.tensor_parallel_size != 1 or self.engine_args
                                      or self.pipeline_parallel_size != 1
                                      or self.distributed_executor_backend):
            raise ArgumentError("--tensor-parallel-size, --pipeline-parallel-size, "
                                "--distributed-executor-backend and --engine-arg need "
                                "--engine vllm or --source-engine vllm")
        extra: dict[str, Any] = {}
        for arg in self.engine_args:
            key, eq, value = arg.partition("=")
            if not eq or not key.strip():
                raise ArgumentError(f"--engine-arg {arg!r}: KEY=VALUE (a vllm.LLM argument)")
            try:
                extra[key.strip().replace("-", "_")] = json.loads(value)
            except json.JSONDecodeError:
                extra[key.strip().replace("-", "_")] = value
        own = ("dtype", "tensor_parallel_size", "pipeline_parallel_size",
               "distributed_executor_backend", "model", "runner", "pooler_config")
        if clash := [k for k in extra if k in own]:
            raise ArgumentError(f"--engine-arg {clash[0]}: set by its own flag or by the "
                                "capture itself")
        named = {k: extra.pop(k) for k in ("max_model_len", "enforce_eager",
                                            "enable_prefix_caching") if k in extra}
        if not self.dry_run:  # a plan may name GPUs this machine lacks; a run may not
            from ltv_vllm.serving.launcher.recipe import check_pipeline_parallel

            check_pipeline_parallel(self.pipeline_parallel_size)
        return CaptureEngine(dtype=dtype, tensor_parallel_size=self.tensor_parallel_size,
                             pipeline_parallel_size=self.pipeline_parallel_size,
                             distributed_executor_backend=self.distributed_executor_backend,
                             extra=extra, **named)


# what captures the hidden states (transformers here, or vLLM's engine with its
# parallelism) and the memory plan of a vLLM run, as one `capture: CaptureFlags`
_capture_options = grouped(
    CaptureFlags,
    click.option("--engine", default="transformers", show_default=True,
                 type=click.Choice(["transformers", "vllm"]),
                 help="What captures the hidden states: transformers in this process, or "
                      "vLLM's engine (pooling runner; tensor/pipeline parallelism, prefix "
                      "cache) for the methods fitted on final states alone."),
    click.option("--tensor-parallel-size", "-tp", default=1, show_default=True,
                 help="vLLM tensor parallelism (--engine vllm)."),
    click.option("--pipeline-parallel-size", "-pp", default=1, show_default=True,
                 help="vLLM pipeline parallelism (--engine vllm)."),
    click.option("--distributed-executor-backend", default=None,
                 type=click.Choice(["mp", "ray", "uni", "external_launcher"]),
                 help="vLLM's executor for TP/PP (ray across nodes) [default: vLLM's]."),
    click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE",
                 help="Any other vllm.LLM argument (VALUE read as JSON where it parses), "
                      "e.g. --engine-arg max_model_len=4096; repeatable."),
    click.option("--dry-run", is_flag=True,
                 help="--engine vllm: print the memory plan from config.json alone and "
                      "exit (refused when it does not fit); loads and writes nothing."),
    click.option("--devices", type=int, default=None,
                 help="Plan for this many GPUs [default: the ones visible; on a CPU, "
                      "TP × PP ranks sharing its memory]."),
    click.option("--device-gib", type=float, default=None,
                 help="Memory of each planned device in GiB [default: the visible GPU's; "
                      "on a CPU, its memory / (TP × PP)]."),
    name="capture")


@dataclass(frozen=True)
class ExecutorFlags:
    """Where a sweep's episodes run (`evaluation.executor`), as given."""

    executor: str
    ray_address: str | None
    episode_cpus: float
    episode_gpus: float
    episode_memory_gib: float | None
    workers: int | None

    def executor_for(self, spec: str | None, dtype: str, device: str) -> Any:
        """None (here, in order) or the Ray executor, the cluster reached (one line if not)
        before any model loads."""
        if self.executor == "local":
            if self.ray_address is not None or self.workers is not None:
                raise ArgumentError("--ray-address and --workers are for --executor ray")
            return None
        from ltv_vllm.evaluation.executor import ModelLoad, RayExecutor, RayOptions, connect

        if self.episode_cpus <= 0 or self.episode_gpus < 0 or (
                self.workers is not None and self.workers < 1):
            raise ArgumentError("--episode-cpus must be > 0, --episode-gpus ≥ 0 and "
                                "--workers ≥ 1")
        connect(self.ray_address)
        return RayExecutor(ModelLoad(spec, dtype, device), RayOptions(
            self.ray_address, self.episode_cpus, self.episode_gpus, self.episode_memory_gib,
            self.workers))


def exit_if_failed(doc: dict[str, Any], kept: str) -> None:
    """Episodes that raised on a cluster (`doc["failed"]`): each in one line, then exit 1;
    `kept` says where what finished is, so the command again runs only what is missing."""
    if not doc.get("failed"):
        return
    for f in doc["failed"]:
        click.echo(f"failed: {f['task']} run {f['run']}: {f['error']}", err=True)
    click.echo(f"{len(doc['failed'])} episodes failed; {kept}", err=True)
    raise click.exceptions.Exit(1)


_executor_options = grouped(
    ExecutorFlags,
    click.option("--executor", default="local", show_default=True,
                 type=click.Choice(["local", "ray"]),
                 help="Where the (task, run) episodes run: here, one after another, or as "
                      "Ray tasks, each worker loading the model once (Ray: the `cluster` "
                      "extra); the same results either way."),
    click.option("--ray-address", default=None, metavar="ADDR",
                 help="--executor ray: the cluster's head (HOST:PORT, ray://..., or auto) "
                      "[default: a Ray instance started here]."),
    click.option("--episode-cpus", type=float, default=1.0, show_default=True,
                 help="--executor ray: CPUs each worker declares."),
    click.option("--episode-gpus", type=float, default=0.0, show_default=True,
                 help="--executor ray: GPUs each worker declares (its model goes there)."),
    click.option("--episode-memory-gib", type=float, default=None,
                 help="--executor ray: memory each worker declares (GiB) [default: none]."),
    click.option("--workers", type=int, default=None,
                 help="--executor ray: at most this many workers [default: as many as the "
                      "cluster's resources hold now, at most one per episode]."),
    name="execution")


@dataclass(frozen=True, kw_only=True)
class ModelFlags:
    """--model, its --dtype and --device: the model a command loads, and where. Each command
    declares --model itself, first (its help differs); `_model_options` adds the other two."""

    spec: str | None
    dtype: str
    device: str


_model_options = grouped(
    ModelFlags,
    click.option("--dtype", "model_dtype", default="auto", show_default=True, type=DTYPE,
                 help=DTYPE_HELP),
    click.option("--device", "model_device", default="auto", show_default=True,
                 help="Device of --model. " + DEVICE_HELP),
    name="model", prefix="model_")


@dataclass(frozen=True, kw_only=True)
class FitFlags:
    """What a task vector is fitted on, as given: k demonstrations, N queries (their labels,
    where they have them, blended in by default), the ridge penalty λ and the seed."""

    k: int | None
    n: int
    lam: float | str
    seed: int


@dataclass(frozen=True, kw_only=True)
class EpisodeFlags(FitFlags):
    """One episode, as given: its fit, the held-out queries scored, the labelled validation
    examples and the batch of the capture; checked where the pipeline's options are built
    from it (`ExtractOptions`, `EvalConfig`), inside the command."""

    n_test: int
    batch_size: int | str
    n_val: int = 32  # (bench rank has no --n-val: the pipeline's default)


# --format, --chat-demos and --chat-template as one `prompt_format` (checked and rendered by
# the library's own object)
FormatFlags = PromptFormat


_format_options = grouped(
    FormatFlags,
    click.option("--format", "prompt_name", default="completion", show_default=True,
                 type=click.Choice(["completion", "chat"]),
                 help="The prompts a vector is fitted on: the task's completion prompt, or "
                      "the model's chat template (the query as the user's turn, the label at "
                      "the assistant's first token; served through /v1/chat/completions)."),
    click.option("--chat-demos", "prompt_demos", default="turns", show_default=True,
                 type=click.Choice(["turns", "inline"]),
                 help="--format chat: the demonstrations as prior user/assistant turns, or "
                      "inside the one user message."),
    click.option("--chat-template", "prompt_template", default=None, metavar="FILE|JINJA",
                 help="--format chat: render through this template instead of the "
                      "tokenizer's (a file, or the template itself, as vLLM's --chat-template "
                      "takes it); serve the vector with the same --chat-template."),
    name="prompt_format", prefix="prompt_")


@dataclass(frozen=True, kw_only=True)
class TeacherFlags:
    """--teacher, --gold-weight and --gold-share as given: what a vector imitates
    (`core.teacher`); `options()` checks them, inside the command. `gold_weight` None: not
    given, where the command's default depends on the queries (`auto_gold`)."""

    calibration: str
    gold_weight: float | None
    gold_share: float

    @property
    def auto_gold(self) -> bool:
        """No --gold-weight given to a command whose default blends labelled queries' labels
        in (extract, compile): the caller applies `DEFAULT_GOLD_WEIGHT` where they have them."""
        return self.gold_weight is None

    def options(self) -> Any:
        """The teacher as given (an unset gold weight: no blend; see `auto_gold`)."""
        from ltv_vllm.core.teacher import TeacherOptions

        return TeacherOptions(self.calibration, self.gold_weight or 0.0, self.gold_share)


def teacher_options(*, gold_by_labels: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--teacher, --gold-weight, --gold-share as one `teacher: TeacherFlags`. `gold_by_labels`
    (extract, compile): --gold-weight defaults to `DEFAULT_GOLD_WEIGHT` where every query has
    a label, else 0; otherwise (evaluate, bench: the paper's comparison) to 0."""
    # 0.8 is core.teacher.DEFAULT_GOLD_WEIGHT, written out: --help imports no torch
    gold_default = ("0.8 where every query has a label of the task and "
                    "the method is fitted on states, else 0" if gold_by_labels else "0.0")
    return grouped(
        TeacherFlags,
        click.option("--teacher", "teacher_calibration", default="icl", show_default=True,
                     type=click.Choice(["icl", "batch", "contextual"]),
                     help="What the vector imitates: the ICL prompt's states (icl), batch-"
                          "calibrated (the label log-probabilities less their mean over the N "
                          "queries) or contextually calibrated (divided by content-free "
                          "inputs'); docs/methods.md. A many-shot teacher: more "
                          "demonstrations (k up to the context)."),
        click.option("--gold-weight", "teacher_gold_weight", type=float,
                     default=None if gold_by_labels else 0.0,
                     help="Blend each labelled query's gold label into its target with this "
                          "weight (0 ≤ w < 1; 0: the teacher alone, the paper's fit) "
                          f"[default: {gold_default}]."),
        click.option("--gold-share", "teacher_gold_share", default=1.0, show_default=True,
                     type=float,
                     help="With --gold-weight: the share of the N queries whose labels are "
                          "used."),
        name="teacher", prefix="teacher_")


_teacher_options = teacher_options(gold_by_labels=False)


def _csv(value: str) -> list[str]:
    return [s.strip() for s in value.split(",") if s.strip()]


def _ints(value: str) -> list[int]:
    try:
        return [int(s) for s in _csv(value)]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


@dataclass(frozen=True)
class EngineFlags:
    """How a serving benchmark runs its engines (identical for every mode): vLLM's settings,
    the timed passes and warm-up, where the jobs work and whether they resume."""

    dtype: str
    max_model_len: int
    kv_cache_gib: int
    max_num_seqs: int | None
    repeats: int
    warmup: int
    work_dir: Path | None
    resume: bool


def _engine_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Every serving benchmark's engine flags, handed to it as one `engine: EngineFlags`."""
    from ltv_vllm.bench.workload import EngineSettings as E

    return grouped(
        EngineFlags,
        click.option("--dtype", default=E.dtype, show_default=True, type=DTYPE,
                     help=DTYPE_HELP),
        click.option("--max-model-len", default=E.max_model_len, show_default=True),
        click.option("--kv-cache-gib", default=E.kv_cache_gib, show_default=True,
                     help="VLLM_CPU_KVCACHE_SPACE for the CPU backend."),
        click.option("--max-num-seqs", type=int, default=None, help="[default: vLLM's]"),
        click.option("--repeats", default=3, show_default=True,
                     help="Timed passes (bench serving: interleaved rounds, every mode's "
                          "engines started afresh in each, ratios paired per round); the "
                          "fastest is reported, the median kept."),
        click.option("--warmup", default=16, show_default=True,
                     help="Untimed warm-up requests per engine."),
        click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path),
                     default=None, help="Vectors, LoRA adapters and logs [default: OUT/work]."),
        click.option("--resume", is_flag=True,
                     help="Reuse engine jobs an interrupted run finished (identical job "
                          "only)."),
        name="engine")(fn)


def _task_specs(task_list: str) -> tuple[str, ...]:
    """--tasks checked now (names, spec files), passed on as given."""
    from ltv_vllm.tasks.specs import get_tasks

    tasks = get_tasks(task_list)
    return (tuple(t.name for t in tasks) if task_list.strip() == "packaged"
            else tuple(_csv(task_list)))
