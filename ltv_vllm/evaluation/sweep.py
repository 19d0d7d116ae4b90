"""The resumable task × run loop that `evaluate`, `regress` and the `bench` sweeps share.

A sweep visits every (task, run) once, in order. After each it appends that episode's
records, updates its progress bar and, with a checkpoint, rewrites the checkpoint atomically
(`records`, `costs`, what is `done`, the wall time so far, keyed by a hash of the
configuration), so an interrupted sweep started again with the same configuration skips what
it finished, and one of another configuration is refused.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ltv_vllm.core.fileio import atomic_write
from ltv_vllm.errors import ArgumentError


def config_key(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def fresh_state() -> dict[str, Any]:
    return {"records": [], "costs": {}, "done": [], "wall_seconds": 0.0}


def read_checkpoint(checkpoint: str | Path | None, config: dict[str, Any]) -> dict[str, Any]:
    """The state a checkpoint of this configuration holds (fresh without one)."""
    fresh = fresh_state()
    if checkpoint is None or not Path(checkpoint).is_file():
        return fresh
    try:
        state = json.loads(Path(checkpoint).read_text())
    except (OSError, json.JSONDecodeError):
        raise ArgumentError(f"{checkpoint}: unreadable partial evaluation; remove it") from None
    if state.get("key") != config_key(config):
        raise ArgumentError(f"{checkpoint} holds a partial evaluation of another configuration;"
                            " remove it or choose another --out")
    return {k: state[k] for k in fresh}


class Sweep:
    """`for task, run in sweep:` yields what is still to do; `sweep.finish(...)` after each."""

    def __init__(self, config: dict[str, Any], tasks: Sequence[str], runs: int, *,
                 checkpoint: str | Path | None = None, state: dict[str, Any] | None = None,
                 progress: bool = True, desc: str = "episodes") -> None:
        self.config, self.tasks, self.runs = config, list(tasks), runs
        self.checkpoint = checkpoint
        state = state if state is not None else read_checkpoint(checkpoint, config)
        self.records: list[dict[str, Any]] = state["records"]
        self.costs: dict[str, Any] = state["costs"]
        self.done = {(t, r) for t, r in state["done"]}
        self.started = time.perf_counter() - state["wall_seconds"]
        self.bar = tqdm(total=len(self.tasks) * runs, initial=len(self.done), desc=desc,
                        unit="run", disable=not progress)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        yield from self.todo()
        self.bar.close()

    def todo(self) -> list[tuple[str, int]]:
        """What is still to do, in the sweep's order (tasks as given, runs ascending)."""
        return [(task, run) for task in self.tasks for run in range(self.runs)
                if (task, run) not in self.done]

    @property
    def wall_seconds(self) -> float:
        return time.perf_counter() - self.started

    def finish(self, task: str, run: int, records: list[dict[str, Any]], note: str = "") -> None:
        """(task, run) is done with these records: shown, and saved when checkpointing."""
        self.records.extend(records)
        # the sweep's order whatever order episodes finished in (a cluster's workers): stable,
        # so an episode's records keep theirs
        order = {t: i for i, t in enumerate(self.tasks)}
        self.records.sort(key=lambda r: (order.get(r.get("task"), len(order)), r.get("run", 0))
                          if isinstance(r, dict) else (len(order), 0))
        if note:
            self.bar.set_postfix_str(note)
        self.bar.update(1)
        self.done.add((task, run))
        if self.checkpoint is not None:
            doc = {"key": config_key(self.config), "config": self.config,
                   "records": self.records, "costs": self.costs,
                   "done": [list(d) for d in sorted(self.done)],
                   "wall_seconds": self.wall_seconds}
            atomic_write(self.checkpoint, lambda tmp: Path(tmp).write_text(json.dumps(doc)))
