"""The final hidden state h of each prompt's last token, captured by vLLM's own engine.

A causal LM loaded with `runner="pooling"` and LAST pooling without activation returns the
last prompt token's final post-norm hidden state (the LM head's input: what every served map
shifts), with vLLM's kernels, tensor and pipeline parallelism and prefix caching; it builds
no LM head, so label logits come from h and the label rows of the head (`models.checkpoint`).
vLLM 0.32 refuses `normalize=`; `use_activation=False` is what keeps h raw.

    llm = capture_llm(model_dir, CaptureEngine(dtype="float32", tensor_parallel_size=2))
    h = final_hidden(llm, prompts)          # [len(prompts), d], float32

The engine keeps global state per process, so a run that also uses transformers or another
engine runs this in a job (`python -m ltv_vllm.serving.offline.capture JOB OUT`, `offline.jobs`).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.errors import UserError
from ltv_vllm.extraction.states import PromptStates
from ltv_vllm.models.checkpoint import identity_from_dir
from ltv_vllm.models.hardware import resolve_for_model
from ltv_vllm.models.plan import (
    GIB,
    Plan,
    PlanRequest,
    check_index,
    make_plan,
    read_shape,
    require_fit,
)
from ltv_vllm.pipeline.extract import CapturedModel, episode_prompts
from ltv_vllm.serving.contract.vllm_support import cpu_rank_binding
from ltv_vllm.serving.offline.jobs import job_main, run_job
from ltv_vllm.tasks.data import Episode


@dataclass(frozen=True)
class CaptureEngine:
    """vLLM's parallelism and engine arguments for a capture run (passed through as given)."""

    dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    max_model_len: int | None = None
    enforce_eager: bool | None = None  # vLLM's default unless given
    enable_prefix_caching: bool = True  # the demonstrations are every ICL prompt's prefix
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CaptureJobError(f"--{name.replace('_', '-')} must be at least 1, got {v}")
        clash = sorted(set(self.extra) & {f.name for f in fields(self)})
        if clash or "runner" in self.extra or "pooler_config" in self.extra:
            raise CaptureJobError(f"--engine-arg {(clash or ['runner'])[0]}: set by its own "
                                  "flag or by the capture itself")

    def llm_kwargs(self) -> dict[str, Any]:
        kw = {k: v for k, v in asdict(self).items() if k != "extra" and v is not None}
        return {**kw, **self.extra}

    def record(self) -> dict[str, Any]:
        """What a vector file records about the engine that captured its states."""
        import vllm

        return {"name": "vllm", "version": vllm.__version__, "runner": "pooling",
                **{k: v for k, v in self.llm_kwargs().items()
                   if k in ("dtype", "tensor_parallel_size", "pipeline_parallel_size",
                            "distributed_executor_backend", "enable_prefix_caching")}}


def capture_llm(model_dir: str, engine: CaptureEngine) -> Any:
    """A pooling-runner `vllm.LLM` whose output per prompt is h of its last token."""
    from vllm import LLM
    from vllm.config import PoolerConfig

    from ltv_vllm.serving.contract.vllm_support import check_version

    check_version()  # the pooling runner's LAST pooler is one of the internals relied on
    return LLM(model=model_dir, runner="pooling",
               pooler_config=PoolerConfig(pooling_type="LAST", use_activation=False),
               **engine.llm_kwargs())


def final_hidden(llm: Any, prompts: Sequence[str], *,
                 progress: bool = False) -> tuple[torch.Tensor, list[int]]:
    """h of each prompt's last token, in prompt order, as float32 [n, d], and how many of
    each prompt's tokens the engine's prefix cache held (vLLM's `num_cached_tokens`)."""
    outs = llm.embed(list(prompts), use_tqdm=progress)
    h = torch.tensor([o.outputs.embedding for o in outs], dtype=torch.float32)
    return h, [int(o.num_cached_tokens or 0) for o in outs]


def run_capture_job(job: dict[str, Any]) -> dict[str, Any]:
    """JOB {"model_dir", "prompts", "engine": CaptureEngine fields, "out": .safetensors path}
    → h written to `out` (key "h"); OUT says its shape, the prompt tokens the prefix cache
    held, and the seconds the engine took to start and to capture."""
    import time

    from safetensors.torch import save_file

    t0 = time.perf_counter()
    at_start = _memory(os.getpid())
    llm = capture_llm(job["model_dir"], CaptureEngine(**job.get("engine", {})))
    t1 = time.perf_counter()
    h, cached = final_hidden(llm, job["prompts"], progress=job.get("progress", False))
    t2 = time.perf_counter()
    import psutil

    # before the engine (and its TP workers) shuts down: each process's memory now
    memory = [_memory(os.getpid()), *(_memory(c.pid) for c in
                                        psutil.Process().children(recursive=True))]
    save_file({"h": h.contiguous()}, job["out"])
    return {"shape": list(h.shape), "cached_tokens": cached, "startup_seconds": t1 - t0,
            "capture_seconds": t2 - t1,
            # Linux reports KiB; the engine runs in this process (at TP 1 the one rank)
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            # this process (first) and the ones it started (vLLM's TP workers)
            "memory_at_start": at_start, "memory": [m for m in memory if m]}


def _memory(pid: int) -> dict[str, int]:
    """A process's memory from /proc, in bytes: anonymous (its heap, weights, KV cache) and
    file-backed pages resident now (a read checkpoint's mapped pages), and its peak RSS."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields_ = {"RssAnon:": "anon", "RssFile:": "file", "VmHWM:": "peak"}
    return {fields_[line.split()[0]]: int(line.split()[1]) * 1024
            for line in status.splitlines() if line.split()[:1] and line.split()[0] in fields_}


class CaptureJobError(UserError):
    """A capture run that failed or was asked for impossibly."""


def job_env(engine: CaptureEngine, kv_cache_gib: int = 2) -> dict[str, str]:
    """The environment a capture job adds: the engine in the job's own process, and on the
    CPU backend a KV-cache size and (TP > 1 on one NUMA node) a core per rank, unless the
    caller's environment already says."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    if not torch.cuda.is_available():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                 str(kv_cache_gib)))
        ranks = engine.tensor_parallel_size * engine.pipeline_parallel_size
        cores = max(1, (os.cpu_count() or 1) // ranks)
        # vLLM drops an engine process to one torch thread "for serving" unless
        # OMP_NUM_THREADS says otherwise; a capture is all prefill, run on every core
        # (measured once by hand, Intel Xeon AVX512 bf16, 2 cores: SmolLM2 eager 8.6 → 8.1 s,
        # Qwen2.5-Coder-1.5B compiled 36.0 → 32.1 s for a k = 30, N = 256 episode)
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(cores)
        env.update(cpu_rank_binding(ranks))
    return env


def capture_states(model_dir: str, prompts: Sequence[str], engine: CaptureEngine,
                   work: Path, *, progress: bool = False) -> tuple[torch.Tensor, dict[str, Any]]:
    """h of every prompt from one engine in a job of its own (`run_capture_job`): float32
    (n, d) in prompt order, and the job's report (cached tokens, seconds)."""
    from safetensors.torch import load_file

    out = work / "h.safetensors"
    report = run_job("ltv_vllm.serving.offline.capture",
                     {"model_dir": str(model_dir), "prompts": list(prompts),
                      "engine": asdict(engine), "out": str(out), "progress": progress},
                     work, "capture", env=job_env(engine), what="vLLM capture job",
                     error=CaptureJobError)
    h = load_file(str(out))["h"]
    out.unlink()
    return h, report


if __name__ == "__main__":
    job_main(run_capture_job)


# -- an extraction's capture on vLLM: its plan, then its states --------------------------------


def plan_capture(model_dir: str, episodes: Sequence[Episode], engine: CaptureEngine, *,
                 tokenizer: Any = None, devices: int | None = None,
                 device_gib: float | None = None, full_head: bool = False,
                 gpu_memory_utilization: float = 0.9) -> tuple[Plan, PlanRequest, bool]:
    """The memory plan of capturing `episodes` on `engine` from `model_dir`'s config.json
    and weight index alone (`models.plan`); the third value says whether the token counts are
    estimated (no tokenizer: 4 characters a token) rather than counted.

    Devices: `devices` × `device_gib` where given, else the visible GPUs, else this CPU's
    memory shared by the TP × PP ranks. `auto` plans the checkpoint's 16-bit dtype on GPUs
    (vLLM's rule) and what `serve` resolves on a CPU."""
    shape, total = read_shape(model_dir)
    check_index(shape, total)
    ranks = engine.tensor_parallel_size * engine.pipeline_parallel_size
    gpus = torch.cuda.device_count()
    on_gpus = bool(gpus) or device_gib is not None  # named devices are GPUs
    if devices is None:
        devices = gpus if gpus or device_gib is not None else ranks
    if device_gib is None:
        device_gib = (torch.cuda.get_device_properties(0).total_memory / GIB if gpus
                      else _ram_gib() / max(devices, 1))
    dtype = engine.dtype
    if dtype == "auto":
        ckpt = shape.checkpoint_dtype
        dtype = ((ckpt if ckpt in ("bfloat16", "float16") else "bfloat16") if on_gpus
                 else resolve_for_model("auto", model_dir, "cpu"))

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"]) if tokenizer is not None else -(-len(text) // 4)

    # every demonstration set's prefix: the longest one bounds the engine's max_model_len
    prefix = max(count(p) for ep in episodes for p in ep.demo_prefixes())
    queries = [ep.task.query(e.text) for ep in episodes for e in (*ep.queries, *ep.test)]
    longest = max((count(q) for q in queries), default=1)
    req = PlanRequest(tp=engine.tensor_parallel_size, pp=engine.pipeline_parallel_size,
                      dtype=dtype, devices=devices, device_gib=device_gib,
                      gpu_memory_utilization=gpu_memory_utilization, prefix_tokens=prefix,
                      query_tokens=longest, batch=min(len(queries), 256),
                      n_labels=max(ep.task.num_classes for ep in episodes), full_head=full_head,
                      max_model_len=engine.max_model_len or prefix + longest)
    plan = make_plan(shape, req)
    return plan, req, tokenizer is None


def check_run(model_dir: str, episodes: Sequence[Episode], engine: CaptureEngine, *,
              devices: int | None = None, device_gib: float | None = None,
              full_head: bool = False) -> None:
    """Before a capture's engine starts: a layout vLLM can run here and a plan that fits."""
    from ltv_vllm.serving.launcher.recipe import check_pipeline_parallel

    check_pipeline_parallel(engine.pipeline_parallel_size)
    plan, _, _ = plan_capture(model_dir, episodes, engine, devices=devices,
                              device_gib=device_gib, full_head=full_head)
    require_fit(plan)


def _ram_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError):
        return 16.0


def captured_model(spec: str, model_dir: str, episodes: Sequence[Episode],
                   engine: CaptureEngine, work: Path, *,
                   tokenizer: Any = None) -> tuple[CapturedModel, dict[str, Any]]:
    """Every prompt of `episodes` (`episode_prompts`) captured by one vLLM engine in one job,
    as the CapturedModel the pipeline extracts from; and the job's report, with the share of
    the ICL prompts' tokens the engine's prefix cache held."""
    from transformers import AutoTokenizer

    prompts = list(dict.fromkeys(p for ep in episodes for p in episode_prompts(ep)))
    h, report = capture_states(model_dir, prompts, engine, work)
    cached = report.get("cached_tokens") or [0] * len(prompts)
    tok = tokenizer or AutoTokenizer.from_pretrained(model_dir)
    icl = [i for i, p in enumerate(prompts)
           if any(p.startswith(pre) and ep.demos for ep in episodes
                  for pre in ep.demo_prefixes())]
    prefix_tokens = sum(len(tok(ep.demo_prefix())["input_ids"]) for ep in episodes[:1])
    report["icl_prompts"] = len(icl)
    report["prefix_tokens"] = prefix_tokens
    report["icl_cached_tokens"] = sum(cached[i] for i in icl)
    states = PromptStates(prompts, h)
    lm = CapturedModel(spec=spec, path=model_dir, tokenizer=tok,
                       identity=identity_from_dir(model_dir, name=spec), states=states,
                       dtype=engine.dtype, engine=engine.record(),
                       capture_seconds=report["capture_seconds"],
                       startup_seconds=report["startup_seconds"])
    return lm, report


Report = Callable[[str], None]  # a progress line for the user (stderr in the CLI)


def _announce(what: str, engine: CaptureEngine, work: str, report: Report | None) -> None:
    if report is not None:
        report(f"capturing {what} on vLLM (TP {engine.tensor_parallel_size} × PP "
               f"{engine.pipeline_parallel_size}, {engine.dtype}); engine log in {work}")


def capture_model(spec: str | None, episodes: Sequence[Episode], engine: CaptureEngine, *,
                  devices: int | None = None, device_gib: float | None = None,
                  report: Report | None = None) -> CapturedModel:
    """`--engine vllm`: every prompt of `episodes` through vLLM's engine in one job, as the
    CapturedModel the pipeline extracts from (`captured_model`). `engine`'s `auto` precision
    is resolved as `serve` resolves it, so the states and the served answers come from one
    precision (float32 on a CPU without native bf16); the plan is checked first, so a run
    that cannot fit is refused before the engine starts. `report`: progress lines (None:
    none)."""
    import tempfile

    from ltv_vllm.models.cache import DEFAULT_MODEL
    from ltv_vllm.models.loading import local_model_dir

    spec = spec or DEFAULT_MODEL
    path = local_model_dir(spec)
    engine = replace(engine, dtype=resolve_for_model(engine.dtype, path))
    check_run(path, episodes, engine, devices=devices, device_gib=device_gib)
    with tempfile.TemporaryDirectory(prefix="ltv-vllm-capture-") as work:
        _announce("the model", engine, work, report)
        lm, rep = captured_model(spec, path, episodes, engine, Path(work))
    if report is not None and rep["icl_prompts"]:
        held = rep["icl_cached_tokens"] / max(1, rep["icl_prompts"] * rep["prefix_tokens"])
        report(f"vLLM: {rep['shape'][0]} prompts in {rep['capture_seconds']:.1f} s (engine "
               f"start {rep['startup_seconds']:.1f} s); the prefix cache held "
               f"{100 * held:.0f} % of the demonstrations' tokens of the ICL prompts")
    return lm


def capture_source(source: Any, episodes: Sequence[Episode], engine: CaptureEngine, *,
                   devices: int | None = None, device_gib: float | None = None,
                   report: Report | None = None) -> int:
    """`--source-engine vllm`: a transfer source's missing capture chunks, all in one vLLM
    run, into its capture store (`pipeline.transfer.prefetch_source`); the plan, with the
    source's whole LM head on the host, checked first. How many prompts were captured."""
    import tempfile

    from ltv_vllm.pipeline.transfer import prefetch_source

    engine = replace(engine, dtype=source.load["dtype"])  # the store's key holds this dtype
    check_run(source.path, episodes, engine, devices=devices, device_gib=device_gib,
              full_head=True)
    with tempfile.TemporaryDirectory(prefix="ltv-vllm-capture-") as work:
        _announce("the source", engine, work, report)
        n = prefetch_source(source, episodes, lambda prompts: capture_states(
            source.path, prompts, engine, Path(work))[0])
    if report is not None:
        report(f"vLLM captured {n} source prompts into {source.cap.dir}")
    return n
