"""`ltv-vllm bench value`: the held-out value protocol's command (`bench.value`), its flags
parsed and checked before any model loads. Part of the `bench` group (`cli.bench`)."""

from __future__ import annotations

from pathlib import Path

import click

from ltv_vllm.cli.base import (
    DTYPE,
    DTYPE_HELP,
    _command_line,
    _csv,
    _ints,
    friendly,
)
from ltv_vllm.cli.bench import bench
from ltv_vllm.core.fileio import check_writable
from ltv_vllm.errors import ArgumentError


@bench.command("value")
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True)
@click.option("--tasks", "task_list", default="packaged", show_default=True,
              help="Comma-separated task names/spec files, or 'packaged' for all seven.")
@click.option("--k", default=30, show_default=True,
              help="Demonstrations of each k-shot prompt (the prompt a vector replaces).")
@click.option("--demo-sets", default=3, show_default=True,
              help="k-shot demonstration sets M; the dev split chooses among them.")
@click.option("--many-k", default="max", show_default=True,
              help="Demonstrations of the many-shot prompt (k//K per class), or 'max': as "
                   "many as fit the model's context after the longest query.")
@click.option("--n", default=256, show_default=True,
              help="Train queries N: what a fit sees (their labels where a row uses labels).")
@click.option("--n-dev", default=200, show_default=True,
              help="Labelled dev queries (n_dev//K per class), disjoint from everything "
                   "else: every choice is made on them.")
@click.option("--n-test", default=500, show_default=True,
              help="Test queries (the whole test split where it has fewer), the same for "
                   "every seed and row.")
@click.option("--seeds", default="0,1,2", show_default=True,
              help="Comma-separated episode seeds (demonstrations, train and dev queries).")
@click.option("--batch-size", default=16, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True, type=DTYPE, help=DTYPE_HELP)
@click.option("--lora/--no-lora", default=True, show_default=True,
              help="Train the PEFT LoRA rival (r 8; lr and epochs chosen on dev).")
@click.option("--lora-lrs", default="1e-4,3e-4,1e-3", show_default=True,
              help="Comma-separated learning rates of the LoRA grid (the dev split chooses).")
@click.option("--lora-epochs", default=4, show_default=True,
              help="Epochs per learning rate; the dev split chooses the epoch too.")
@click.option("--layer-rows/--no-layer-rows", default=False, show_default=True,
              help="A third table: LTV fitted at a decoder block (ltv-layer; the block chosen "
                   "on dev among all, λ by leave-one-out), against the prompt it replaces and "
                   "the final-layer fits. Runs the model on dev and test for each episode.")
@click.option("--serving/--no-serving", default=False, show_default=True,
              help="Also measure each way's serving throughput in vLLM (zero-shot, the k-shot "
                   "and many-shot prompts with the prefix cache, the default vector, the LoRA "
                   "adapter), one engine each, on the first seed's episode of every task.")
@click.option("--serving-tasks", default=None,
              help="Comma-separated tasks whose serving costs are measured (a subset of "
                   "--tasks) [default: every task].")
@click.option("--serving-queries", default=200, show_default=True,
              help="Test queries each serving engine answers.")
@click.option("--gen-tokens", default=16, show_default=True,
              help="Free tokens generated per query in the serving passes.")
@click.option("--repeats", default=3, show_default=True,
              help="Timed serving passes per engine (the fastest counts).")
@click.option("--merge", "merge", multiple=True,
              type=click.Path(exists=True, path_type=Path),
              help="An earlier result of this bench (its folder) with the same options and "
                   "other tasks: its episodes join the tables (repeatable), so a sweep too "
                   "long for one machine runs task by task.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("benchmarks/results/value"), show_default=True)
@friendly
def bench_value_cmd(model_spec: str, task_list: str, k: int, demo_sets: int, many_k: str,
                    n: int, n_dev: int, n_test: int, seeds: str, batch_size: int, dtype: str,
                    lora: bool, lora_lrs: str, lora_epochs: int, layer_rows: bool,
                    serving: bool, serving_tasks: str | None, serving_queries: int,
                    gen_tokens: int, repeats: int,
                    merge: tuple[Path, ...], out_dir: Path) -> None:
    """The vector's value under a held-out protocol: train / dev / test splits, every
    choice on dev, the test read once per row, per-query records and paired bootstrap
    intervals; two tables (no labels; with the N queries' labels, against a probe, a LoRA
    fine-tune and the prompts), and with --layer-rows a third (LTV at a decoder block).
    States are kept under --out/states: a rerun reuses them."""
    from dataclasses import replace

    from ltv_vllm.bench.value import ValueOptions, bench_value, plan
    from ltv_vllm.bench.value_report import merge_docs
    from ltv_vllm.bench.value_serving import ServingOptions
    from ltv_vllm.extraction.finetune import LoraOptions
    from ltv_vllm.models.checkpoint import context_length
    from ltv_vllm.models.loading import load_tokenizer, local_model_dir
    from ltv_vllm.pipeline.extract import check_context
    from ltv_vllm.tasks.data import check_disjoint
    from ltv_vllm.tasks.specs import get_tasks, label_token_ids

    seed_list = tuple(_ints(seeds))
    if many_k != "max":
        try:
            many_k = int(many_k)  # type: ignore[assignment]
        except ValueError:
            raise ArgumentError(f"--many-k must be a number or 'max', got {many_k!r}") from None
    for name, v in (("--serving-queries", serving_queries), ("--gen-tokens", gen_tokens),
                    ("--repeats", repeats), ("--lora-epochs", lora_epochs)):
        if v < 1:
            raise ArgumentError(f"{name} must be at least 1, got {v}")
    try:
        lrs = tuple(float(x) for x in _csv(lora_lrs))
    except ValueError:
        lrs = ()
    if not lrs or not all(0 < x < 1 for x in lrs):
        raise ArgumentError(f"--lora-lrs must be learning rates in (0, 1), got {lora_lrs!r}")
    opts = ValueOptions(model=model_spec, k=k, many_k=many_k, demo_sets=demo_sets, n=n,
                        n_dev=n_dev, n_test=n_test, seeds=seed_list, dtype=dtype,
                        batch_size=batch_size, lora=lora,
                        lora_options=LoraOptions(lrs=lrs, epochs=lora_epochs),
                        layer_rows=layer_rows,
                        serving=ServingOptions(queries=serving_queries, gen_tokens=gen_tokens,
                                               repeats=repeats) if serving else None,
                        serving_tasks=tuple(_csv(serving_tasks)) if serving_tasks else None)
    check_writable(out_dir, option="--out", directory=True)
    if lora:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise ArgumentError("--lora needs PEFT (pip install peft), or pass --no-lora"
                                ) from None
    tok = load_tokenizer(model_spec)
    context = context_length(local_model_dir(model_spec))
    tasks = get_tasks(task_list)
    unknown = sorted(set(opts.serving_tasks or ()) - {t.name for t in tasks})
    if unknown:
        raise ArgumentError(f"--serving-tasks {', '.join(unknown)}: not among --tasks")
    if opts.serving_tasks and not serving:
        raise ArgumentError("--serving-tasks needs --serving")
    for t in tasks:  # labels, splits and every prompt's length before the model loads
        label_token_ids(t, tok)
        for s in seed_list:
            ep, many = plan(t, opts, s, tok, context)
            check_disjoint(ep, many)
            for e in (ep, replace(ep, demos=many, extra_demos=())):
                check_context(tok, e, t.special_tokens, context)
    merged = merge_docs(merge, opts, [t.name for t in tasks])
    doc = bench_value(tasks, opts, out_dir, _command_line(),
                      log=lambda m: click.echo(m, err=True), merged=merged)
    click.echo(f"results in {out_dir}: {len(doc['episodes'])} episodes")
