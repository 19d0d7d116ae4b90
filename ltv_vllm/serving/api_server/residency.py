"""What a replica holds, on vLLM's `/metrics`: each task's residency, rank and size, and a
shared store's generation, reachability and skipped records. Runs in vLLM's API-server
process."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ltv_vllm.serving.store.shared_store import (
    SKIPS,
)

logger = logging.getLogger("ltv_vllm.serving.api_server.endpoints")


class Residency:
    """What this replica holds, for vLLM's `/metrics` (read at each scrape, so a task gone
    from the store is gone from the metrics): `ltv_vllm:task_loaded{task, digest}` 1 when
    this replica answers the task with that vector, 0 when the store lists it and this
    replica does not (yet); each served store task's rank and file size; with a shared store,
    the index generation it follows, whether the store answered its last read, and how many
    of the index's entries it skips, by reason. At most `--max-tasks` task series."""

    def __init__(self, endpoints: Any) -> None:
        self.endpoints = endpoints

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        ep = self.endpoints
        loaded = GaugeMetricFamily("ltv_vllm:task_loaded", "A task-store task this replica "
                                   "serves with the store's vector (1) or not yet (0)",
                                   labels=["task", "digest"])
        for card in ep.listing():
            loaded.add_metric([card["id"], card["ltv"]["digest"] or ""],
                              1.0 if card["ltv"]["loaded"] else 0.0)
        yield loaded
        rank = GaugeMetricFamily("ltv_vllm:task_rank", "The rank of a task this replica "
                                 "serves (its vector's, as stored)", labels=["task"])
        size = GaugeMetricFamily("ltv_vllm:task_bytes", "The size of a task's vector file on "
                                 "this replica", labels=["task"])
        for entry in ep._entries() if ep.store is not None else []:
            if ep._served(entry.name) and entry.name not in ep.deleting:
                try:
                    nbytes = entry.vector_path.stat().st_size
                except OSError:
                    continue  # removed meanwhile
                r = entry.record.get("rank")
                rank.add_metric([entry.name], float(r) if isinstance(r, int) else 0.0)
                size.add_metric([entry.name], float(nbytes))
        yield rank
        yield size
        if ep.shared is not None:
            yield GaugeMetricFamily("ltv_vllm:task_store_generation", "The shared task "
                                    "store's index generation this replica serves (-1: "
                                    "following)", value=ep.seen)
            yield GaugeMetricFamily("ltv_vllm:task_store_reachable", "Whether the shared "
                                    "task store answered this replica's last read",
                                    value=0.0 if ep.outage else 1.0)
            skipped = GaugeMetricFamily(
                "ltv_vllm:task_store_skipped_records", "Entries of the shared task store's "
                "index this replica does not serve: not in the shape this release writes "
                "(name, entry, digest, record, format), or past --max-tasks (max_tasks)",
                labels=["reason"])
            for reason in SKIPS:
                skipped.add_metric([reason], float(ep.skip_counts.get(reason, 0)))
            yield skipped


def _multiprocess_metrics(app: Any, endpoints: Any) -> None:
    """`/metrics` where several API-server processes serve (vLLM's multiprocess mode): vLLM
    answers it from prometheus_client's multiprocess files only, a registry made per scrape,
    which a collector cannot join; residency is a collector (its series come and go with the
    store), so this route, put first, answers the same files plus the residency of the
    process that answers (each follows the store; they agree within NUDGE_SECONDS of a change
    made by one of them, within the poll of another replica's)."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from starlette.responses import Response
    from starlette.routing import Route

    async def metrics(request: Any) -> Any:  # noqa: ARG001
        from ltv_vllm.serving.api_server.metrics import SHIFT_SIZES

        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        registry.register(Residency(endpoints))
        if SHIFT_SIZES.task is not None:
            registry.register(SHIFT_SIZES)
        text = await asyncio.to_thread(generate_latest, registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    app.router.routes.insert(0, Route("/metrics", metrics, methods=["GET"]))


def _register_residency(endpoints: Any) -> None:
    """Residency on vLLM's `/metrics` (its registry: prometheus_client's default one, where
    one API-server process serves; a task store allows only one)."""
    from prometheus_client import REGISTRY

    try:
        REGISTRY.register(Residency(endpoints))
    except ValueError:  # registered already (a second init in one process)
        pass
