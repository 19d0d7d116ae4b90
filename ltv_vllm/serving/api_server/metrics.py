"""Per-task metrics on vLLM's own `/metrics` (docs/operating.md says what each one means).

vLLM labels its request metrics by served model name, and every task of a multi-task server
runs on the base model: its `/metrics` cannot tell tasks apart. These are the API-server
process's, made with prometheus_client as vLLM's are, so they land where vLLM's do: the
default registry with one API server, the multiprocess files with several (vLLM sets
`PROMETHEUS_MULTIPROC_DIR` before it starts them; prometheus_client then writes each
process's values to a file that every scrape sums).

- Requests, generated and shifted tokens, latency and time to first token by task: read
  where the API server hands a request to the engine (`instrument`: its engine client's
  `generate`, the one call every generating route makes, with the request's sampling
  parameters as the engine will read them — `steps.RequestShift`, the engine's own reading
  of a request's task and step policy). A request's shifted tokens are the generated tokens
  its policy shifts: min(steps, generated) per choice.
- Refusals by reason: the gate's (`refused`).
- Requests by key id, admitted or over a limit (`key_request`: `api_server.tenancy`).
- Live fidelity: re-asked requests by outcome, their KL to the ICL prompt and argmax
  agreement, beside the extraction's d_NTP (`fidelity`: `api_server.fidelity`); its re-asks
  are not counted as the task's requests.
- Store operations and their durations: the task endpoints' (`store_operation`).
- What a replica holds (with rank and size) is read at each scrape (`endpoints.Residency`).
- The shift's relative size ‖W h‖ / ‖h‖ per task on live traffic: summed in the engine
  (`shift_sizes`), read every SHIFT_READ_SECONDS (`ShiftSizeCollector`).

Cardinality is bounded: a task label is a name this server serves; past LABELS distinct
names (a store's churn over a long life) new ones are counted as "other", since a
multiprocess metric's series can never be removed again.
"""

from __future__ import annotations

import time
from typing import Any

LABELS = 64  # distinct task label values a server's life may create (then "other")
OTHER = "other"
# request latency and time to first token (seconds): vLLM's own spread, from a CPU's
# milliseconds to a long generation's minutes
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
           160.0)
STORE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
# why the gate refused a request (`refused`): the label values
REASONS = ("unauthorized", "forbidden", "too_large", "unresolved", "malformed", "unknown_task",
           "two_names", "beam_search", "prompt_logprobs", "route", "rendering")
OUTCOMES = ("admitted", "in_flight", "rate")  # a key's request: admitted, or past a limit
PROBE_ID = "ltv-fidelity-"  # live fidelity's re-asks' request ids start so: not traffic


class TaskMetrics:
    """The metric objects (one set per process: `get`)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram, Summary

        self.requests = Counter("ltv_vllm:task_requests", "Requests a task vector shifts, by "
                                "task and step policy (all, first, k: the first k > 1)",
                                ["task", "policy"])
        self.generated = Counter("ltv_vllm:task_generation_tokens", "Tokens generated for "
                                 "a task's requests", ["task", "policy"])
        self.shifted = Counter("ltv_vllm:task_shifted_tokens", "Generated tokens a task's "
                               "vector shifted (its step policy's share of them)",
                               ["task", "policy"])
        self.latency = Histogram("ltv_vllm:task_request_seconds", "A task's requests from "
                                 "the engine's hand-over to their last token", ["task"],
                                 buckets=BUCKETS)
        self.ttft = Histogram("ltv_vllm:task_time_to_first_token_seconds", "A task's "
                              "requests from the engine's hand-over to their first token",
                              ["task"], buckets=BUCKETS)
        self.refusals = Counter("ltv_vllm:refusals", "Requests the gate refused before vLLM "
                                "read them, by reason", ["reason"])
        self.store = Histogram("ltv_vllm:store_operation_seconds", "Task-store operations "
                               "(upload, compile, delete, resolve, load) and how they ended",
                               ["op", "result"], buckets=STORE_BUCKETS)
        self.keys = Counter("ltv_vllm:key_requests", "Requests by key id (the keys file's; "
                            "api-key: vLLM's --api-key; empty: no key), admitted or refused "
                            "over the key's limit (429)", ["key", "outcome"])
        self.fidelity = Counter("ltv_vllm:task_fidelity_samples", "A task's requests "
                                "offered for a live fidelity re-ask (`serve --fidelity-sample`)"
                                ", by outcome: measured, incomplete (cannot be read by "
                                "construction: see the log), dropped (one in flight), "
                                "unsupported, failed",
                                ["task", "outcome"])
        self.live_kl = Summary("ltv_vllm:task_fidelity_kl", "KL(P_icl || P_tv) of the next "
                               "token, in nats, over the re-asked requests of a task (over "
                               "its label tokens, as d_NTP)", ["task"])
        self.agree = Counter("ltv_vllm:task_fidelity_agreements", "Re-asked requests whose "
                             "ICL prompt and vector put the same token first", ["task"])
        self.baseline = Gauge("ltv_vllm:task_extraction_d_ntp", "A task's d_NTP at "
                              "extraction, on its held-out queries (the vector file's)",
                              ["task"], multiprocess_mode="max")
        self.span_baseline = Gauge("ltv_vllm:task_extraction_off_span", "A task's mean "
                                   "off-span share at extraction, on its held-out queries "
                                   "(the vector file's)", ["task"], multiprocess_mode="max")
        self.names: set[str] = set()
        self.key_ids: set[str] = set()

    def task(self, name: str) -> str:
        """`name` as a label value, bounded (LABELS)."""
        return _bounded(self.names, name)


def _bounded(seen: set[str], name: str) -> str:
    if name in seen:
        return name
    if len(seen) >= LABELS:
        return OTHER
    seen.add(name)
    return name


_METRICS: list[TaskMetrics] = []


def get() -> TaskMetrics:
    """This process's metrics (made on first use: after vLLM set up its multiprocess mode)."""
    if not _METRICS:
        _METRICS.append(TaskMetrics())
    return _METRICS[0]


def enabled() -> bool:
    from ltv_vllm.serving.contract.settings import ServerSettings

    return ServerSettings.from_env().task_metrics


def refused(reason: str) -> None:
    """Count a request the gate refused (`reason`: one of REASONS)."""
    if enabled():
        get().refusals.labels(reason if reason in REASONS else "malformed").inc()


def key_request(key_id: str, outcome: str) -> None:
    """Count a request by its key id (`outcome`: one of OUTCOMES)."""
    if enabled():
        m = get()
        m.keys.labels(_bounded(m.key_ids, key_id), outcome).inc()


FIDELITY = ("measured", "incomplete", "dropped", "unsupported", "failed")


def fidelity(task: str, outcome: str, kl: float | None = None,
             agree: bool | None = None) -> None:
    """Count a live fidelity offer (`outcome`: one of FIDELITY) and, measured, its KL and
    agreement (`api_server.fidelity`)."""
    if enabled():
        m = get()
        name = m.task(task)
        m.fidelity.labels(name, outcome).inc()
        if kl is not None:
            m.live_kl.labels(name).observe(kl)
            m.agree.labels(name).inc(1 if agree else 0)


def fidelity_baseline(task: str, d: float | None, off_span: float | None = None) -> None:
    """A task's extraction-time d_NTP and off-span share beside their live figures (each
    only where the file has it)."""
    if enabled():
        m = get()
        if d is not None:
            m.baseline.labels(m.task(task)).set(d)
        if off_span is not None:
            m.span_baseline.labels(m.task(task)).set(off_span)


def refusal_reason(refusal: tuple[Any, ...]) -> str:
    """A gate refusal's (message, type, param) as its reason label."""
    message, param = str(refusal[0]), str(refusal[2] or "")
    if param == "use_beam_search":
        return "beam_search"
    if param == "prompt_logprobs":
        return "prompt_logprobs"
    if param in ("messages", "prompt"):
        return "rendering"  # a chat without consent, another template, no generation prompt
    if message.startswith(("unknown ltv_task", "ltv_task names a task by its name; served")):
        return "unknown_task"
    if "name two tasks" in message or "beside vllm_xargs" in message:
        return "two_names"
    if "tasks are served on" in message:
        return "route"
    return "malformed"


def store_operation(op: str, result: str, seconds: float) -> None:
    if enabled():
        get().store.labels(op, result).observe(seconds)


def policy(steps: int | None) -> str:
    """A step policy as a label value: all, first, or k (the first k > 1: one value, so a
    client's counts cannot multiply the series)."""
    return "all" if steps is None else "first" if steps == 1 else "k"


def instrument(engine_client: Any, base: str, registry: Any) -> None:
    """Count each request a vector shifts where the API server hands it to the engine: its
    engine client's `generate` wrapped (vLLM's request metrics know the served model only;
    its stat loggers see no request's sampling parameters). `base`: the label of a fused
    server's one vector (the model's first served name); `registry`: the process's task
    registry (`api_server.registry`), whose served keys label the shift sizes."""
    from ltv_vllm.serving.store.vectors import FUSED, RequestShift, StoreVectors

    if getattr(engine_client, "_ltv_instrumented", False):
        return
    # the API server's own cache of store vectors (a store task's own default policy)
    shift = RequestShift(engine_client.vllm_config, StoreVectors(None))
    inner = engine_client.generate

    def label(params: Any, lora: Any) -> tuple[str, int | None] | None:
        if lora is not None:  # LoRA multi-task: the adapter is the task, every step
            return str(lora.lora_name), None
        if params is None or not getattr(params, "extra_args", None):
            return None
        task, steps = shift.of(params)
        if steps == 0:
            return None  # not admitted for a shift: the bare model
        return (base if task == FUSED else task.partition("@")[0]), steps

    async def generate(prompt: Any, sampling_params: Any, request_id: str, *args: Any,
                       **kwargs: Any) -> Any:
        try:
            which = (label(sampling_params, kwargs.get("lora_request"))
                     if enabled() and not str(request_id).startswith(PROBE_ID) else None)
        except Exception:  # noqa: BLE001 - the engine decides and answers; never the metrics
            which = None
        if which is None:
            async for out in inner(prompt, sampling_params, request_id, *args, **kwargs):
                yield out
            return
        from vllm.sampling_params import RequestOutputKind

        m = get()
        name, steps = m.task(which[0]), which[1]
        pol = policy(steps)
        m.requests.labels(name, pol).inc()
        delta = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
        counts: dict[int, int] = {}
        t0 = time.perf_counter()
        first = None
        try:
            async for out in inner(prompt, sampling_params, request_id, *args, **kwargs):
                for o in out.outputs:
                    n = len(o.token_ids)
                    counts[o.index] = counts.get(o.index, 0) + n if delta else n
                if first is None and any(counts.values()):
                    first = time.perf_counter()
                    m.ttft.labels(name).observe(first - t0)
                yield out
        finally:
            m.latency.labels(name).observe(time.perf_counter() - t0)
            generated = sum(counts.values())
            m.generated.labels(name, pol).inc(generated)
            m.shifted.labels(name, pol).inc(
                generated if steps is None else sum(min(steps, c) for c in counts.values()))

    engine_client.generate = generate
    engine_client._ltv_instrumented = True
    SHIFT_SIZES.base = base
    SHIFT_SIZES.registry = registry
    SHIFT_SIZES.start(engine_client)


# the engine's sums are read this often (seconds; LTV_VLLM_SHIFT_READ): one utility call
SHIFT_READ_ENV = "LTV_VLLM_SHIFT_READ"
SHIFT_READ_SECONDS = 5.0


class ShiftSizeCollector:
    """`ltv_vllm:task_shift_relative_size{task}` (a summary: the sum of ‖W h‖ / ‖h‖ over the
    rows a task shifted, and their count) from the engine's sums (`shift_sizes`), as last
    read; the tasks served now only (a deleted task's sums leave with it)."""

    def __init__(self) -> None:
        self.base = ""
        self.latest: dict[str, list[float]] = {}
        self.task: Any = None
        self.registry: Any = None  # the process's task registry (`instrument`)

    def start(self, engine: Any) -> None:
        import asyncio

        if self.task is None:
            self.task = asyncio.ensure_future(self._follow(engine))
            _register(self)

    async def _follow(self, engine: Any) -> None:
        import asyncio
        import logging
        import os

        from ltv_vllm.serving.api_server.shutdown import stopping
        from ltv_vllm.serving.contract.names import SHIFT_SIZES_RPC as READ

        every = float(os.environ.get(SHIFT_READ_ENV) or SHIFT_READ_SECONDS)
        failed = False
        while True:
            await asyncio.sleep(every)
            if stopping(engine):  # the server is going down: nothing to read, nothing wrong
                return
            try:
                # by the worker's method name: what both of vLLM's executors accept from
                # here (`shift_sizes.serve_reads`)
                results = await engine.collective_rpc(READ, timeout=30)
            except Exception as e:  # noqa: BLE001 - a dead engine answers nothing else either
                if stopping(engine):
                    return
                if not failed:
                    logging.getLogger(__name__).warning(
                        "ltv-vllm: the engine's shift sizes could not be read: %s", e)
                failed = True
                continue
            failed = False
            merged: dict[str, list[float]] = {}
            for r in _flat(results):
                if r.get("tp_rank", 0) != 0:
                    continue  # every tensor-parallel rank shifts the same rows
                for key, sums in r.get("sizes", {}).items():
                    m = merged.setdefault(key, [0.0] * 4)
                    for i, v in enumerate(sums[:4]):
                        m[i] += v
            self.latest = merged

    def collect(self) -> Any:
        from prometheus_client.core import SummaryMetricFamily

        from ltv_vllm.serving.contract.wire import named_tasks
        from ltv_vllm.serving.store.vectors import FUSED

        keys = self.registry.served_keys() if self.registry is not None else named_tasks()
        served = set(keys) | {FUSED}
        fam = SummaryMetricFamily("ltv_vllm:task_shift_relative_size", "The shift's size "
                                  "relative to the hidden state, ||W h|| / ||h||, over the "
                                  "rows a task shifted (read from the engine every few "
                                  "seconds)", labels=["task"])
        span = SummaryMetricFamily("ltv_vllm:task_off_span", "The share of the zero-shot "
                                   "state outside the span the task's map reads, "
                                   "||h - Q Q^T h|| / ||h||, over its live fidelity re-asks "
                                   "(against ltv_vllm:task_extraction_off_span: traffic unlike "
                                   "the fitted queries sits further out)", labels=["task"])
        by_name: dict[str, list[float]] = {}
        for key, sums in self.latest.items():
            if key in served:
                m = by_name.setdefault(self.base if key == FUSED else key.partition("@")[0],
                                       [0.0] * 4)
                for i, v in enumerate(sums):
                    m[i] += v
        for name, (total, rows, span_total, span_rows) in sorted(by_name.items()):
            if rows:
                fam.add_metric([name], count_value=rows, sum_value=total)
            if span_rows:
                span.add_metric([name], count_value=span_rows, sum_value=span_total)
        yield fam
        yield span


def _flat(results: Any) -> list[dict[str, Any]]:
    """collective_rpc's answers: one per worker (a list of lists with several engines)."""
    out: list[dict[str, Any]] = []
    for r in results if isinstance(results, list) else [results]:
        out.extend(_flat(r) if isinstance(r, list) else [r] if isinstance(r, dict) else [])
    return out


def _register(collector: Any) -> None:
    """On vLLM's registry with one API server (prometheus_client's default one); with
    several, `endpoints`' own /metrics route adds it to each scrape's registry."""
    import os

    from prometheus_client import REGISTRY

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    try:
        REGISTRY.register(collector)
    except ValueError:  # registered already (a second start in one process)
        pass


SHIFT_SIZES = ShiftSizeCollector()
