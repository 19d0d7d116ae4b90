"""Resumable captures: a model's passes saved in chunks, so an interrupted pass resumes.

The large-model pass of cross-model transfer can run for hours across several GPUs. A
`StoredCapturer` has the `hidden` / `icl` interface of `Capturer`, but splits the prompts into
fixed chunks and saves each finished chunk's states (float32, safetensors) under

    ROOT / <model key hash> / <kind>-<chunk hash>.safetensors

The model key holds everything that changes the numbers (model identity, dtype, quantisation);
a chunk's hash covers its prompts and, for ICL, the demonstrations. A run that stops after
chunk 7 finds chunks 0–7 on the next start and computes the rest only; any other run that asks
for the same prompts (another run over the same test subset) reuses them too. Files appear
through a rename, so a killed process leaves no half chunk. The model itself is loaded only
when some chunk is missing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ltv_vllm.core.fileio import atomic_write
from ltv_vllm.extraction.capture import Capturer


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


class StoredCapturer:
    """`hidden` / `icl` like `Capturer`, backed by a directory of finished chunks."""

    def __init__(
        self,
        root: str | Path,
        key: dict[str, Any],
        make_capturer: Callable[[], Capturer],
        *,
        chunk_size: int = 64,
        progress: bool = True,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
        key_json = json.dumps(key, sort_keys=True)
        self.dir = Path(root) / _digest(key_json)[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        key_file = self.dir / "key.json"
        if not key_file.exists():  # for people looking at the cache
            atomic_write(key_file, lambda tmp: Path(tmp).write_text(key_json + "\n"))
        self._make = make_capturer
        self._cap: Capturer | None = None
        self.chunk_size = chunk_size
        self.progress = progress
        self.computed = 0  # chunks computed (not found) by this object
        self.reused = 0    # chunks found from an earlier run
        self._filled: set[Path] = set()  # computed ahead by `fill`, read back by the passes

    @property
    def loaded(self) -> bool:
        """Whether the model had to be loaded (some chunk was missing)."""
        return self._cap is not None

    @property
    def capturer(self) -> Capturer:
        if self._cap is None:
            self._cap = self._make()
        return self._cap

    def hidden(self, prompts: Sequence[str], desc: str = "forward") -> torch.Tensor:
        return self._run("hidden", "", prompts, lambda ps, d: self.capturer.hidden(ps, d), desc)

    def icl(self, prefix: str, prompts: Sequence[str], desc: str = "icl") -> torch.Tensor:
        return self._run(
            "icl", prefix, prompts, lambda ps, d: self.capturer.icl(prefix, ps, d), desc
        )

    def _chunk_path(self, kind: str, context: str, chunk: Sequence[str]) -> Path:
        return self.dir / f"{kind}-{_digest(kind, context, *chunk)[:24]}.safetensors"

    def missing(self, calls: Sequence[tuple[str, str, Sequence[str]]]
                ) -> list[tuple[Path, list[str]]]:
        """The chunks that `hidden` / `icl` calls (kind, context, prompts) would compute, as
        (file, full prompts) — what an engine that captures ahead fills with `fill`."""
        out: dict[Path, list[str]] = {}
        for kind, context, prompts in calls:
            for start in range(0, len(prompts), self.chunk_size):
                chunk = list(prompts[start : start + self.chunk_size])
                path = self._chunk_path(kind, context, chunk)
                if not path.is_file():
                    out[path] = [context + p for p in chunk]
        return list(out.items())

    def fill(self, chunks: Sequence[tuple[Path, list[str]]], h: torch.Tensor) -> None:
        """Write the states of `missing`'s chunks (their prompts' rows of `h`, in order),
        each file through a rename as `_run` writes them."""
        from safetensors.torch import save_file

        start = 0
        for path, prompts in chunks:
            t = h[start : start + len(prompts)].float().contiguous()
            if t.shape[0] != len(prompts):
                raise ValueError(f"{h.shape[0]} states for the chunks' prompts")
            atomic_write(path, lambda tmp, t=t: save_file({"h": t}, tmp))
            self.computed += 1
            self._filled.add(path)
            start += len(prompts)

    def _run(
        self,
        kind: str,
        context: str,
        prompts: Sequence[str],
        fn: Callable[[list[str], str], torch.Tensor],
        desc: str,
    ) -> torch.Tensor:
        from safetensors.torch import load_file, save_file

        parts: list[torch.Tensor] = []
        starts = range(0, len(prompts), self.chunk_size)
        bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not self.progress,
                   leave=False)
        for start in starts:
            chunk = list(prompts[start : start + self.chunk_size])
            path = self._chunk_path(kind, context, chunk)
            if path.is_file():
                h = load_file(str(path))["h"]
                self.reused += path not in self._filled
            else:
                h = fn(chunk, f"{desc} [{start // self.chunk_size + 1}/{len(starts)}]")
                t = h.float().contiguous()
                atomic_write(path, lambda tmp, t=t: save_file({"h": t}, tmp))
                self.computed += 1
            if h.shape[0] != len(chunk):
                raise ValueError(f"{path}: holds {h.shape[0]} rows for {len(chunk)} prompts")
            parts.append(h)
            bar.update(len(chunk))
        bar.close()
        return torch.cat(parts) if parts else torch.empty(0, 0)


class CallRecorder:
    """`hidden` / `icl` that only record what they were asked, as a StoredCapturer keys it
    (kind, context, prompts), and return zeros: run a pass against it to learn which chunks
    that pass will need (`StoredCapturer.missing`)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[str]]] = []

    def hidden(self, prompts: Sequence[str], desc: str = "") -> torch.Tensor:  # noqa: ARG002
        self.calls.append(("hidden", "", list(prompts)))
        return torch.zeros(len(prompts), 1)

    def icl(self, prefix: str, prompts: Sequence[str],
            desc: str = "") -> torch.Tensor:  # noqa: ARG002 - Capturer's interface
        self.calls.append(("icl", prefix, list(prompts)))
        return torch.zeros(len(prompts), 1)
