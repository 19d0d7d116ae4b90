"""Where a sweep's episodes run: here, one after another (`LocalExecutor`, the default), or
as tasks on a Ray cluster (`RayExecutor`, `--executor ray`). Runs in the driver process;
Ray's worker processes run `EpisodeWorker`, one actor per slot of declared resources, which
loads the model once and keeps it across the episodes it is given.

Either way the executor only runs episodes and hands each result to the driver's `done`
(`evaluate`), which alone writes the checkpoint and the result document, in the sweep's own
order whatever order the episodes finish in. Ray is an optional extra (`cluster`), imported
on its path only.

Faults, as a cluster has them: a worker that dies mid-episode (killed, its node lost) is
replaced and its episode given to another, up to `retries` times; an episode that raises is
handed back with its error (the others go on); a cluster that cannot be reached is one line
before any work (`connect`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ltv_vllm.errors import ArgumentError

Done = Callable[[Any], None]  # the driver's: an `episodes.EpisodeResult` back


class LocalExecutor:
    """Every episode here, in the sweep's order, on the driver's own runner (its model, its
    episode checkpoint). An episode that raises stops the sweep (rerun to resume)."""

    def run(self, todo: list[tuple[str, int]], spec: Any,  # noqa: ARG002 - Ray's signature
            local: Callable[[], Any], done: Done, bar: Any = None) -> None:  # noqa: ARG002
        runner = local() if todo else None
        for name, run in todo:
            done(timed_episode(runner, name, run))


def run_sweep(sweep: Any, executor: Any, spec: Any, local: Callable[[], Any], *,
              keep: Done | None = None) -> dict[tuple[str, int], str]:
    """Every episode `sweep` (`evaluation.sweep.Sweep`) still needs, through `executor` (None:
    `LocalExecutor`): each result handed to `keep` (the caller's: a cost table, a file, a
    log line), then into the sweep, which alone writes the checkpoint. Returns the errors
    of the episodes that raised, by (task, run): they are not done, so a rerun retries them."""
    failed: dict[tuple[str, int], str] = {}

    def done(res: Any) -> None:
        if res.error is not None:
            failed[res.task, res.run] = res.error
            return
        if keep is not None:
            keep(res)
        sweep.finish(res.task, res.run, res.records, res.note)

    (executor or LocalExecutor()).run(sweep.todo(), spec, local, done, sweep.bar)
    sweep.bar.close()
    return failed


def timed_episode(runner: Any, name: str, run: int, **where: Any) -> Any:
    """`runner.run(name, run)`, each record stamped with where and how long it ran
    (`episode`: the node, the wall seconds, `where`, and what the runner adds itself)."""
    import socket

    t0 = time.perf_counter()
    res = runner.run(name, run)
    stamp = {"node": socket.gethostname(), "wall_seconds": time.perf_counter() - t0, **where}
    for r in res.records:
        r["episode"] = {**stamp, **r.get("episode", {})}
    return res


def failed_list(failed: dict[tuple[str, int], str]) -> list[dict[str, Any]]:
    """`run_sweep`'s errors as a result document lists them (`failed`)."""
    return [{"task": t, "run": r, "error": e} for (t, r), e in sorted(failed.items())]


@dataclass(frozen=True)
class ModelLoad:
    """How a worker loads the model (`models.loading.load_model`'s arguments)."""

    spec: str | None
    dtype: str = "auto"
    device: str = "cpu"


@dataclass(frozen=True)
class RayOptions:
    """`--executor ray`: the cluster (None: start one here), each episode's declared
    resources, how many workers (None: as many as the cluster's resources hold, at most one
    per episode) and how often a lost episode is given to another worker."""

    address: str | None = None
    episode_cpus: float = 1.0
    episode_gpus: float = 0.0
    episode_memory_gib: float | None = None
    workers: int | None = None
    retries: int = 2


def connect(address: str | None, timeout: float = 30.0) -> Any:
    """Ray, connected to the cluster at `address` (None: a new one here); one line when
    Ray is not installed or the cluster does not answer, before any work."""
    try:
        import ray
    except ImportError:
        raise ArgumentError('--executor ray needs Ray (the cluster extra): pip install -e '
                            '".[cluster]" in a checkout, or pip install "ray>=2.40"') from None
    if ray.is_initialized():
        return ray
    if address is not None and ":" in address and not address.startswith("ray://"):
        _check_reachable(address, timeout)
    try:
        ray.init(address=address, log_to_driver=False, include_dashboard=False,
                 configure_logging=False, ignore_reinit_error=True)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ArgumentError(f"--ray-address {address}: no Ray cluster answers ({first})"
                            ) from None
    return ray


def _check_reachable(address: str, timeout: float) -> None:
    """A cluster's head (HOST:PORT) accepts a connection, or one line: Ray itself retries an
    unreachable address for minutes before it says so."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return
    except (OSError, ValueError) as e:
        raise ArgumentError(f"--ray-address {address}: no Ray cluster answers ({e})") from None


class RayExecutor:
    """Episodes as Ray actor calls: `workers` actors with the declared resources, each given
    the next episode when it hands one back; results streamed to the driver as they come."""

    def __init__(self, load: ModelLoad, options: RayOptions) -> None:
        self.load, self.opts = load, options
        self.running: dict[Any, tuple[Any, tuple[str, int]]] = {}  # ref → (worker, episode)
        self.lost = 0  # episodes given to another worker after theirs died

    def run(self, todo: list[tuple[str, int]], spec: Any, local: Callable[[], Any],  # noqa: ARG002
            done: Done, bar: Any = None) -> None:
        if not todo:
            return
        ray = connect(self.opts.address)
        actor = ray.remote(EpisodeWorker).options(**self._resources())
        n = self._workers(ray, len(todo))
        spec_ref = ray.put(spec)
        idle = [actor.remote(self.load, spec_ref) for _ in range(n)]
        queue = list(todo)
        running = self.running = {}
        tries: dict[tuple[str, int], int] = {}
        failed = 0
        while queue or running:
            while queue and idle:
                w, ep = idle.pop(), queue.pop(0)
                running[w.run.remote(*ep)] = (w, ep)
            ready, _ = ray.wait(list(running), num_returns=1)
            w, ep = running.pop(ready[0])
            try:
                res = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                if "creation task" in str(e):  # no worker can start: nothing will run
                    for w2 in idle:
                        ray.kill(w2)
                    raise ArgumentError(f"a Ray worker could not load the model: "
                                        f"{_one_line(e)}") from None
                # its worker died mid-episode: a new worker, and the episode again (unless it
                # has killed `retries` workers: then it is an error of its own)
                tries[ep] = tries.get(ep, 0) + 1
                idle.append(actor.remote(self.load, spec_ref))
                if tries[ep] <= self.opts.retries:
                    queue.insert(0, ep)
                    self.lost += 1
                    continue
                res = _failed(ep, f"its worker died {tries[ep]} times")
            except ray.exceptions.RayTaskError as e:
                res = _failed(ep, _one_line(e.cause if e.cause is not None else e))
                idle.append(w)
            else:
                idle.append(w)
            failed += res.error is not None
            done(res)
            if bar is not None:
                bar.set_postfix_str(f"running {len(running)}, failed {failed}")
        for w in idle:
            ray.kill(w)

    def _resources(self) -> dict[str, Any]:
        o = self.opts
        # max_concurrency 2: `pid` answers while an episode runs (one episode at a time is
        # the executor's own rule: a worker is given the next only when it hands one back)
        res: dict[str, Any] = {"num_cpus": o.episode_cpus, "num_gpus": o.episode_gpus,
                               "max_restarts": 0, "max_concurrency": 2}
        if o.episode_memory_gib:
            res["memory"] = int(o.episode_memory_gib * (1 << 30))
        return res

    def _workers(self, ray: Any, episodes: int) -> int:
        """Workers to start: as many as the cluster's CPUs (and GPUs) hold at the declared
        resources now, or fewer as asked; at most one per episode, at least one. (Never
        more than fit: a worker that waits for resources would hold its episode while the
        others, done, keep theirs.)"""
        have = ray.cluster_resources()
        fits = int(have.get("CPU", 1) // max(self.opts.episode_cpus, 1e-9))
        if self.opts.episode_gpus:
            fits = min(fits, int(have.get("GPU", 0) // self.opts.episode_gpus))
        if self.opts.workers is not None:
            fits = min(fits, self.opts.workers)
        return max(1, min(fits, episodes))


def _failed(ep: tuple[str, int], why: str) -> Any:
    from ltv_vllm.evaluation.episodes import EpisodeResult

    return EpisodeResult(ep[0], ep[1], [], error=why)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


class EpisodeWorker:
    """A Ray actor (runs in a Ray worker process): the model loaded once, then any episode
    of the evaluation it was made for. An episode that raises comes back as Ray's task
    error (the worker stays: its model is still sound)."""

    def __init__(self, load: ModelLoad, spec: Any) -> None:
        from ltv_vllm.models.loading import load_model

        t0 = time.perf_counter()
        self.runner = spec.runner(load_model(load.spec, dtype=load.dtype, device=load.device))
        self.load_seconds = time.perf_counter() - t0

    def run(self, name: str, run: int) -> Any:
        import ray

        # two nodes may share a host name
        return timed_episode(self.runner, name, run,
                             ray_node=ray.get_runtime_context().get_node_id()[:12])

    def pid(self) -> int:
        import os

        return os.getpid()
