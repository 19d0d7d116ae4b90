"""`ltv-vllm selfcheck`, `serve`, `classify`, `compile` and `tasks remote`: serving, and a
running server's clients."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import click

from ltv_vllm.cli.base import (
    DTYPE,
    DTYPE_HELP,
    TeacherFlags,
    friendly,
    grouped,
    lam_option,
    main,
    teacher_options,
)
from ltv_vllm.cli.models import tasks
from ltv_vllm.serving.contract.settings import ServerSettings


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
    """Prove the per-request shift on this vLLM, runner and device: probe tasks (final-layer
    and layer tasks) mixed with bare rows, every policy, n > 1, chunked prefill, rows
    finishing at different steps; each row must carry exactly its own probe at exactly its
    own steps (exit 1 otherwise). With --multi-task lora the probes are LoRA adapters, each
    row checked for its own."""
    import tempfile

    from ltv_vllm.models.cache import DEFAULT_MODEL
    from ltv_vllm.models.loading import local_model_dir
    from ltv_vllm.serving.contract.vllm_support import check_version
    from ltv_vllm.serving.offline.selfcheck import SelfCheckOptions, selfcheck_in_subprocess

    check_version()
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


@dataclass(frozen=True)
class StoreFlags:
    """--task-store ("": the model's store) and what a task-store server holds at once and
    compiles with, as given; checked by `ServeOptions`."""

    task_store: str | None
    store_poll: float
    max_tasks: int
    compile_threads: int
    layer_uploads: bool


@dataclass(frozen=True)
class HttpFlags:
    """Where the OpenAI server listens, and the largest request body it reads."""

    max_body_mib: int
    host: str
    port: int
    api_keys: str | None
    allow_unauthenticated: bool
    key_in_flight: int | None
    key_rate: float | None
    key_burst: int | None
    audit_log: str | None
    task_metrics: bool
    fidelity_sample: float


@dataclass(frozen=True)
class ShiftFlags:
    """How the task vectors act: fused (--fold: in the LM head's weight), per request (the
    shift, or LoRA adapters cut to --lora-rank) and on which generated tokens; checked by
    `plan_server`."""

    fold: bool
    multi_task: str | None
    lora_rank: int | None
    shift_steps: str | None


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--model", "model_spec", default=None,
              help="Packaged alias, local HF directory or hub id [default: smollm2-135m].")
@click.option("--task-vector", "vectors", multiple=True,
              help="PATH (one task, fused) or NAME=PATH (repeat: multi-task, chosen per request "
                   "by the OpenAI `model` field).")
@grouped(
    StoreFlags,
    click.option("--task-store", default=None, is_flag=False, flag_value="",
                 help="Serve every task in this task store by name, and add tasks at runtime "
                      "(/v1/ltv/tasks); without a value: the model's store under the cache. "
                      "s3://BUCKET/PREFIX or file:///DIR: a store many replicas share."),
    click.option("--store-poll", default=ServerSettings.store_poll, show_default=True,
                 help="With a shared --task-store: seconds between reads of its index (a "
                      "change on another replica is served here within this)."),
    click.option("--max-tasks", default=ServerSettings.max_tasks, show_default=True,
                 help="With --task-store: how many tasks the server can hold at once."),
    click.option("--compile-threads", default=ServerSettings.compile_threads,
                 show_default=True,
                 help="With --task-store: torch threads of a compile worker (the engine keeps "
                      "the other cores; more compiles faster and slows traffic meanwhile)."),
    click.option("--layer-uploads", is_flag=True,
                 help="With --task-store: it may hold layer tasks (uploaded, or copied from a "
                      "shared store): the engine hooks its decoder blocks from the start (on "
                      "a GPU, piecewise CUDA graphs). On by itself when the store holds one."),
    name="store")
@grouped(
    HttpFlags,
    click.option("--max-body-mib", default=ServerSettings.max_body >> 20, show_default=True,
                 help="Largest request body the server reads (MiB; counted as it arrives); a "
                      "task-vector upload's limit follows from the model instead."),
    click.option("--host", default="127.0.0.1", show_default=True),
    click.option("--port", default=8000, show_default=True),
    click.option("--api-keys", default=None, metavar="FILE",
                 help="Keys with roles (inference, admin, metrics; `ltv-vllm keys add`): an "
                      "inference key gets a 403 on the task store's changes. The file is read "
                      "again when it changes (keys add, revoke, rotate). A shared "
                      "--task-store that holds keys (keys add --store) is served with those."),
    click.option("--allow-unauthenticated", is_flag=True,
                 help="Serve a --task-store with no key at all: anyone who reaches the port "
                      "may add, replace and delete tasks (refused without this flag)."),
    click.option("--key-in-flight", type=int, default=None, metavar="N",
                 help="Each key's requests in flight at once, unless its entry sets its own; "
                      "past it a 429 [default: no limit]."),
    click.option("--key-rate", type=float, default=None, metavar="R",
                 help="Each key's requests a second (a token bucket), unless its entry sets "
                      "its own; past it a 429 with Retry-After [default: no limit]."),
    click.option("--key-burst", type=int, default=None, metavar="B",
                 help="With --key-rate: requests a key may send at once over the rate "
                      "[default: one second's]."),
    click.option("--audit-log", default=None, metavar="FILE",
                 help="With --task-store: every store operation as a JSON line, appended "
                      "(- for stderr)."),
    click.option("--task-metrics/--no-task-metrics", default=ServerSettings.task_metrics,
                 show_default=True,
                 help="Per-task requests, tokens, latency, refusals and store operations on "
                      "vLLM's /metrics (docs/operating.md)."),
    click.option("--fidelity-sample", type=float, default=ServerSettings.fidelity_sample,
                 show_default=True, metavar="RATE",
                 help="Re-ask this share (0..1) of each task's completion requests with its "
                      "ICL prompt, after the answer, and export the live KL to it on "
                      "/metrics (docs/operating.md, \"Live fidelity\")."),
    name="http")
@click.option("--dtype", default="auto", show_default=True, type=DTYPE, help=DTYPE_HELP)
@click.option("--max-model-len", type=int, default=None)
@grouped(
    ShiftFlags,
    click.option("--fold", is_flag=True,
                 help="Fused mode: fold the shift into the LM-head weight at load (zero "
                      "cost)."),
    click.option("--multi-task", type=click.Choice(["shift", "lora"]), default=None,
                 help="Multi-task mode: shift each request's rows with its task's vector "
                      "inside the engine (shift), or serve every task as an lm_head LoRA "
                      "adapter any stock vLLM can load (lora) [default: shift, a task store's "
                      "tasks too]."),
    click.option("--lora-rank", type=int, default=None,
                 help="--multi-task lora: cut every adapter to rank R (cheaper LoRA serving; "
                      "see export-lora --rank) [default: full rank]."),
    click.option("--shift-steps", default=None,
                 help="Which generated tokens are shifted when a request names none (its "
                      "vllm_xargs ltv_steps): all, first, or the first N; not with --fold or "
                      "LoRA [default: each vector's meta.shift_steps (extract records first), "
                      "else all]."),
    name="shift")
@click.option("--skip-selfcheck", is_flag=True,
              help="Start without the start-up self-check (probe tasks sent through the "
                   "engine, each row checked to carry its own shift at its own steps; "
                   "`ltv-vllm selfcheck` runs it alone).")
@click.option("--dry-run", is_flag=True,
              help="Check everything, print the vLLM command and exit; writes nothing.")
@click.option("--export", "export_dir", default=None,
              type=click.Path(file_okay=False, path_type=Path),
              help="Check and prepare everything, then write the settings to DIR for your own "
                   "launcher instead of starting (LTV_VLLM_DEPLOY=DIR vllm serve --config "
                   "DIR/vllm.yaml).")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
@friendly
def serve(model_spec: str | None, vectors: tuple[str, ...], store: StoreFlags, http: HttpFlags,
          dtype: str, max_model_len: int | None, shift: ShiftFlags, skip_selfcheck: bool,
          dry_run: bool, export_dir: Path | None, vllm_args: tuple[str, ...]) -> None:
    """Start vLLM's OpenAI-compatible server with task vectors (extra args go to vLLM).

    On the CPU backend the engine runs eager (--enforce-eager) unless you pass a compilation
    flag of vLLM's own (--no-enforce-eager, -O, --compilation-config).
    """
    from ltv_vllm.serving.launcher.serve import ServeOptions, plan_server
    from ltv_vllm.serving.launcher.store_setup import check_store_free, default_store

    if store.task_store == "":
        store = replace(store, task_store=str(default_store(model_spec)))
    if not dry_run and export_dir is None:  # (a dry run says it in a warning)
        check_store_free(store.task_store)
    plan = plan_server(ServeOptions(model_spec, vectors, dtype=dtype, max_model_len=max_model_len,
                                    vllm_args=vllm_args, selfcheck=not skip_selfcheck,
                                    **asdict(store), **asdict(http), **asdict(shift)))
    from ltv_vllm.serving.contract.wire import ADMIT_ENV

    def announce() -> None:
        for line in plan.warnings(done=not dry_run):
            click.echo(line, err=True)
        if export_dir is not None:
            return
        # the admission key is the server's secret: never printed (a fresh one each start)
        shown = {k: "<a fresh key>" if k == ADMIT_ENV else v for k, v in plan.env.items()}
        argv = [("<your key>" if i and plan.argv[i - 1] == "--api-key" else
                 "--api-key=<your key>" if a.startswith("--api-key=") else a)
                for i, a in enumerate(plan.argv)]  # a key given to vLLM is not echoed
        click.echo(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in shown.items()),
                             *(shlex.quote(a) for a in argv)]), err=True)

    if export_dir is not None:
        from ltv_vllm.serving.launcher.deploy import DEPLOY_ENV

        announce()
        written = plan.export(export_dir.absolute())
        click.echo("wrote " + ", ".join(str(p) for p in written))
        click.echo(f"run: {DEPLOY_ENV}={shlex.quote(str(export_dir.absolute()))} vllm serve "
                   f"--config {shlex.quote(str(written[0]))}")
        return
    if dry_run:
        announce()
        if plan.lora is not None and (n := len(plan.lora.adapters) - len(plan.lora.prebuilt)):
            click.echo(f"(dry run: the {n} LoRA adapters above were not written)", err=True)
        return
    # writes the adapters and holds the store (one held by another server: its one line,
    # nothing printed before it), then prints the warnings and the command, then the server
    # replaces this process
    plan.start(announce)


# every command that talks to a server (classify, compile, tasks remote ...)
API_KEY = click.option("--api-key", envvar="LTV_VLLM_API_KEY", default=None,
                       help="The server's --api-key [env LTV_VLLM_API_KEY].")


@main.command()
@click.argument("texts", nargs=-1, required=True)
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
@click.option("--task", required=True, help="Task name (also the served model name) or spec.")
@click.option("--model", "served_model", default=None,
              help="Served model name to ask [default: the task name].")
@click.option("--chat", is_flag=True,
              help="Ask through /v1/chat/completions (the query as the user's message): for "
                   "a vector extracted with --format chat.")
@API_KEY
@friendly
def classify(texts: tuple[str, ...], url: str, task: str, served_model: str | None,
             chat: bool, api_key: str | None) -> None:
    """Classify TEXTS with a served task vector; prints label and restricted probabilities."""
    from ltv_vllm.serving.client import ClientError
    from ltv_vllm.serving.client import classify as run_classify
    from ltv_vllm.tasks.specs import get_task

    t = get_task(task)
    try:
        results = run_classify(url, t, list(texts), model=served_model, api_key=api_key,
                               chat=chat)
    except ClientError as e:
        raise click.ClickException(str(e)) from None
    for text, r in zip(texts, results, strict=True):
        probs = " ".join(f"{k}={v:.3f}" for k, v in r.probs.items())
        click.echo(f"{r.label}\t{probs}\t{text}")


# -- a server's task store ------------------------------------------------------------------
URL = click.option("--url", default="http://127.0.0.1:8000", show_default=True,
                   help="A server started with `ltv-vllm serve --task-store`.")


def _jsonl(path: str, what: str) -> list[Any]:

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
                    lam: float | str, teacher: Any = None, *,
                    auto_gold: bool = False) -> dict[str, Any]:
    """The JSON body of a compile from files (checked again, fully, by the server). `task`:
    a built-in task or the same spec file `extract` reads (its `data` not needed here); with
    an `input` template, each line's text is made from its fields as the data's are.
    `teacher` (`TeacherOptions`, None: the prompt): a gold blend keeps the queries' labels.
    `auto_gold` (no --gold-weight given): a queries file whose every line has a label blends
    them in at DEFAULT_GOLD_WEIGHT, as `extract` does with labelled queries."""
    from ltv_vllm.core.teacher import DEFAULT_GOLD_WEIGHT, TeacherOptions
    from ltv_vllm.serving.store.compile import compile_spec
    from ltv_vllm.tasks.data import input_text
    from ltv_vllm.tasks.specs import get_task

    t = get_task(task)

    def texts(path: str, rows: list[Any], labelled: bool) -> list[Any]:
        if not t.input:
            return rows
        return [{"text": input_text(t.input, r, f"{path}:{i}"),
                 **({"label": r.get("label")} if labelled else {})}
                if isinstance(r, dict) else r for i, r in enumerate(rows, 1)]

    def labelled_rows(path: str) -> list[Any]:
        return texts(path, _jsonl(path, 'one {"text": ..., "label": ...} per line'), True)

    query_rows = _jsonl(queries, 'one {"text": ...} or "string" per line ({"text", "label"} '
                                 'for a gold blend)')
    if auto_gold and all(isinstance(r, dict) and r.get("label") is not None
                         for r in query_rows):
        teacher = replace(teacher or TeacherOptions(), gold_weight=DEFAULT_GOLD_WEIGHT)
    if teacher is not None and teacher.gold_weight:
        qs = texts(queries, query_rows, True)  # the server refuses one without its label
    else:
        qs = [q["text"] if isinstance(q, dict) and "text" in q else q
              for q in texts(queries, query_rows, False)]
    body = {"name": name, "task": compile_spec(t), "demos": labelled_rows(demos),
            "queries": qs, "lam": lam}
    if teacher is not None and not teacher.is_default:
        body["teacher"] = teacher.record()
    if test:
        body["test"] = labelled_rows(test)
    return body


@main.command("compile")
@click.option("--name", required=True, help="The new task's name (the OpenAI `model` field).")
@click.option("--task", required=True,
              help="A built-in task (e.g. sst2) or a task spec file, as `extract --task` "
                   "takes (its data file is not read).")
@click.option("--demos", required=True, type=click.Path(exists=True, dir_okay=False),
              help='JSONL, one {"text", "label"} demonstration per line (k of them).')
@click.option("--queries", required=True, type=click.Path(exists=True, dir_okay=False),
              help='JSONL, one input per line: {"text"} or a string (no labels: the paper\'s '
                   'label-free fit), or {"text", "label"} on every line (labels blended in '
                   'by default); N of them.')
@click.option("--test", default=None, type=click.Path(exists=True, dir_okay=False),
              help="JSONL of labelled examples: the server reports accuracy and d_NTP on them.")
@lam_option()
@teacher_options(gold_by_labels=True)
@click.option("--wait", is_flag=True, help="Wait until the task is served (progress shown).")
@URL
@API_KEY
@friendly
def compile_cmd(name: str, task: str, demos: str, queries: str, test: str | None, lam: float | str,
                teacher: TeacherFlags, wait: bool, url: str, api_key: str | None) -> None:
    """Compile demonstrations into a task on a running server (no restart)."""

    from tqdm.auto import tqdm

    from ltv_vllm.serving.client import compile_remote

    body = compile_request(name, task, demos, queries, test, lam, teacher.options(),
                           auto_gold=teacher.auto_gold)
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
    """Upload a task-vector file as task NAME (checked by the server, then served); a layer
    task (`tasks import`, extract --method ltv-layer) needs a server started with
    --layer-uploads."""
    from ltv_vllm.serving.client import upload_task

    t = upload_task(url, name, vector, api_key=api_key)
    kind = (f"layer task at blocks {t.get('layers')}, positions {t.get('positions')}"
            if t.get("kind") == "layer" else f"rank {t.get('rank')}")
    click.echo(f"{t['name']} served ({kind}, {t.get('source')})")


# -- evaluate -----------------------------------------------------------------------------
