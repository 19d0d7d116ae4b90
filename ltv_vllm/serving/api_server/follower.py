"""A shared task store, followed: this replica serves exactly the store's index, polled, and
resolves a name it does not serve yet when a request names it. Runs in vLLM's API-server
process (a part of `endpoints.TaskEndpoints`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

from ltv_vllm.serving.api_server.metrics import store_operation
from ltv_vllm.serving.store.shared_store import (
    SKIPS,
    StoreUnavailable,
)

logger = logging.getLogger("ltv_vllm.serving.api_server.endpoints")

# a request naming a task this replica does not serve waits this long (seconds) for the
# shared store's index and the task's copy (LTV_VLLM_RESOLVE_WAIT), then is answered 503
RESOLVE_WAIT_ENV = "LTV_VLLM_RESOLVE_WAIT"
RESOLVE_SECONDS = 10.0
# several API-server processes of one replica: how often each looks whether another changed
# the shared index (a local file's stat), so they serve the same tasks within about this long
NUDGE_SECONDS = 0.1

class Follower:
    """The shared store's follower: its part of the task endpoints."""

    async def _poll(self) -> None:
        """Follow the shared index every `poll` seconds, for the server's life."""
        from ltv_vllm.serving.store.taskstore import StoreError

        while True:
            await self._next_poll()
            try:
                await self._follow_soon()
            except StoreError as e:
                self._outage(e)
            except Exception:  # noqa: BLE001 - never stops following (the engine is not
                # touched here: a failure costs this round, logged)
                logger.exception("ltv-vllm: following the task store failed")

    async def _next_poll(self) -> None:
        """Sleep until the next poll, or until a sibling API-server process says it changed
        the index (checked every NUDGE_SECONDS: a local file's stat)."""
        if self.siblings is None:
            await asyncio.sleep(self.poll)
            return
        end = time.monotonic() + self.poll
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(NUDGE_SECONDS, left))
            if await asyncio.to_thread(self.siblings.nudged):
                return

    async def _siblings_follow(self) -> None:
        """After a change this process made to the shared index: tell its sibling API-server
        processes, and wait (at most LTV_VLLM_RESOLVE_WAIT seconds) until each serves that
        generation, so the answer holds whichever process a client reaches next."""
        if self.siblings is None or self.published < 0:
            return
        await asyncio.to_thread(self.siblings.nudge)
        end = time.monotonic() + float(os.environ.get(RESOLVE_WAIT_ENV) or RESOLVE_SECONDS)
        while behind := await asyncio.to_thread(self.siblings.behind, self.published):
            if time.monotonic() > end:
                logger.warning("ltv-vllm: API-server processes %s have not followed the task "
                               "store's generation %d yet", ", ".join(behind), self.published)
                return
            await asyncio.sleep(NUDGE_SECONDS / 2)

    def _outage(self, e: Exception) -> None:
        text = self._public(str(e))
        if text != self.outage:  # once per outage, not once per poll
            logger.warning("ltv-vllm: %s; serving the tasks this replica holds", text)
            self.outage = text

    async def _follow_soon(self) -> None:
        """A follow of the index that read it after this call began: the one under way, if
        it had not read the index yet, else the next (one at a time, shared by every caller
        meanwhile)."""
        asked = time.monotonic()
        for _ in range(2):
            if self.following is None or self.following.done():
                self.following = asyncio.ensure_future(self._follow())
            await asyncio.shield(self.following)
            if self.followed_at >= asked:
                return

    async def _follow(self) -> None:
        """Serve exactly the shared index (under the lock, read inside it, so no upload or
        DELETE of this replica's interleaves): names gone or holding another vector are
        unserved as a DELETE does (requests admitted before finish on their own pins); names
        new here are copied (outside the engine: the engine only ever loads a local pin),
        checked and served. The index is untrusted input: only entries in the shape this
        release writes are served, at most --max-tasks of them (`Index.servable`), the others
        skipped and reported (one line per generation, the metric, their cards). A name
        this replica cannot serve is logged once and skipped."""
        async with self.lock:
            read_at = time.monotonic()
            idx = await asyncio.to_thread(self.shared.index)
            if self.outage is not None:
                logger.warning("ltv-vllm: the task store answers again")
                self.outage = None
            self.followed_at = read_at
            await asyncio.to_thread(self._tidy)  # every follow: one local listing
            if idx.generation == self.seen:
                self._followed(idx.generation)
                return
            tasks, skipped = idx.servable(self.max_tasks)
            self._skipping(idx.generation, skipped)
            gone, new, whole = self._diff(tasks)
            for name in gone:
                await self._unserve(name)
            for name in new:
                whole = await self._adopt(name, tasks[name]) and whole
            self.listed = dict(tasks)
            # as bounded as the listing: why a name was not served, for names still listed
            self.unservable = {n: v for n, v in self.unservable.items() if n in tasks}
            self.seen = idx.generation if whole else -1
            self._followed(idx.generation)

    def _diff(self, tasks: dict[str, dict[str, Any]]) -> tuple[list[str], list[str], bool]:
        """The index's servable tasks against what this replica serves (no change made):
        (names to unserve: gone, or holding another vector; names to adopt; whether every
        name is settled — one under a compile or a removal here is settled when it is done,
        so this generation is looked at again)."""
        whole = True
        gone = []
        for name in sorted(self.digests):
            if name in self.jobs or name in self.deleting:
                whole = False
            elif (tasks.get(name) or {}).get("digest") != self.digests[name]:
                gone.append(name)
        new = []
        for name, item in sorted(tasks.items()):
            if name in self.jobs or name in self.deleting:
                whole = False
            elif not ((name in self.digests and name not in gone)  # a new vector: adopted
                      or self.unservable.get(name, ("",))[0] == item["digest"]):
                new.append(name)
        return gone, new, whole

    async def _adopt(self, name: str, item: dict[str, Any]) -> bool:
        """Copy one index task here, check it and serve it (or record why not, logged once);
        False when it must be looked at again (its name still held here)."""
        from ltv_vllm.serving.store.taskstore import EntryExists, StoreError

        digest = item["digest"]
        if self._served(name) or (self.store.root / name).exists():
            self.unservable[name] = (digest, "its name is taken on this replica")
            logger.warning("ltv-vllm: task store task %r is not served here: its name "
                           "is taken (a --task-vector?)", name)
            return True
        t0 = time.perf_counter()
        try:
            data = await asyncio.to_thread(self.shared.vector, digest)
            staged = await asyncio.to_thread(
                self.store.adopt, name, data, item["record"], self.model_dir,
                base_model=str(self.model_dir), max_rank=self.max_rank, adapter=self.lora,
                layers=self.layers)
            entry = await asyncio.to_thread(self.store.publish, staged, name)
        except StoreUnavailable:
            store_operation("load", "error", time.perf_counter() - t0)
            raise  # the next follow tries again
        except EntryExists as e:  # its name is still held here (being removed)
            logger.warning("ltv-vllm: task store task %r waits: %s", name, self._public(str(e)))
            return False
        except StoreError as e:  # nothing of it is left here (`adopt`, `publish`)
            store_operation("load", "refused", time.perf_counter() - t0)
            self.unservable[name] = (digest, self._public(str(e)))
            logger.warning("ltv-vllm: task store task %r is not served here: %s",
                           name, self._public(str(e)))
            return True
        failed = await self._serve(entry)
        store_operation("load", "ok" if failed is None else "error", time.perf_counter() - t0)
        if failed is not None:
            why = json.loads(failed.body)["error"]["message"]
            self.unservable[name] = (digest, why)
            logger.warning("ltv-vllm: task store task %r is not served here: %s", name, why)
            return True
        self.digests[name] = digest
        self.unservable.pop(name, None)
        return True

    def _skipping(self, generation: int, skipped: dict[str, tuple[str, str]]) -> None:
        """The index entries this replica does not serve, kept for its listing and metric
        and logged in one line, once per generation (not once per poll)."""
        from ltv_vllm.serving.store.taskstore import NAME

        self.skipped = {n: why for n, (_, why) in skipped.items() if NAME.fullmatch(n)}
        self.skip_counts = dict.fromkeys(SKIPS, 0)
        for reason, _ in skipped.values():
            self.skip_counts[reason] += 1
        if not skipped or generation == self.skips_logged:
            return
        self.skips_logged = generation
        counts = ", ".join(f"{c} {r}" for r, c in self.skip_counts.items() if c)
        # the broken entries first (past --max-tasks, each says the same)
        shown = ([(n, why) for n, (r, why) in skipped.items() if r != "max_tasks"][:3]
                 or [(n, why) for n, (_, why) in skipped.items()][:1])
        # names as repr, cut: an index's names are anyone's text (newlines, any length)
        examples = "; ".join(f"{n[:40]!r}: {why}" for n, why in shown)
        logger.warning("ltv-vllm: task store index generation %d: %d entries not served here "
                       "(by reason: %s), e.g. %s", generation, len(skipped), counts, examples)

    def _tidy(self) -> None:
        """This replica's copy holds only what it serves (under the lock): an entry
        directory no served task, compile or removal holds (a removal that failed, a record
        that does not read, anything else put there) is removed, so nothing in the copy
        takes a name or stops a route; the index's tasks are copied again as it follows."""
        from ltv_vllm.serving.store.taskstore import NAME

        for p in sorted(self.store.root.iterdir()):
            name = p.name
            if (not NAME.fullmatch(name) or not p.is_dir() or name in self.digests
                    or name in self.jobs or name in self.deleting or self._served(name)):
                continue
            self.store.discard(name)
            self.bad_dirs.discard(name)
            logger.warning("ltv-vllm: %r removed from this replica's copy of the task store: "
                           "it serves no such task", name)

    def _followed(self, generation: int) -> None:
        if self.siblings is not None:
            self.siblings.followed(generation)

    async def _fresh(self) -> Any:
        """Before a change: this replica follows the shared index first, so a name deleted
        or added on another replica is judged as the store holds it; a 503 answer when the
        store does not answer (None: go on, or no shared store)."""
        from ltv_vllm.serving.store.taskstore import StoreError

        if self.shared is None:
            return None
        try:
            await self._follow_soon()
        except StoreError as e:
            self._outage(e)
            return self._fail(503, e, "ServiceUnavailableError")
        return None

    async def resolve(self, name: str) -> str | None:
        """The gate's hook for a request naming `name` where this replica serves no such
        model: follow the shared index now (waiting at most LTV_VLLM_RESOLVE_WAIT seconds);
        None: answer it as it stands (served now, or no such task: vLLM's 404), else why
        it gets a 503 (the store did not answer, or the task cannot be served here)."""
        from ltv_vllm.serving.store.taskstore import NAME, StoreError

        if (self._served(name) or not NAME.fullmatch(name)
                or self.models.is_base_model(name)):
            return None
        wait = float(os.environ.get(RESOLVE_WAIT_ENV) or RESOLVE_SECONDS)
        # one index read per follow, shared by the requests that wait on it: a burst of
        # requests for names the store does not hold costs a read at a time, not one each
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self._follow_soon(), wait)
        except TimeoutError:
            store_operation("resolve", "error", time.perf_counter() - t0)
            return f"task {name!r}: the task store did not answer within {wait:g} s; retry"
        except StoreError as e:
            store_operation("resolve", "error", time.perf_counter() - t0)
            return f"task {name!r} could not be resolved: {self._public(str(e))}"
        store_operation("resolve", "ok" if self._served(name) or (
            name not in self.listed and name not in self.skipped) else "refused",
                        time.perf_counter() - t0)
        if self._served(name) or (name not in self.listed and name not in self.skipped):
            return None
        why = self.skipped.get(name) or self.unservable.get(name, ("", "it is being updated"))[1]
        return f"task {name!r} is in the task store but not served by this replica: {why}"
