"""A task store behind the server (compiled and uploaded tasks, added at run time): the
launcher's part — which store, its rank and entries, the upload limit. Runs in the
launcher process.
"""

from __future__ import annotations

from pathlib import Path

from ltv_vllm.core.vector import VectorError

DEFAULT_STORE_N = 256       # ridge fits on N queries have rank ≤ min(N, d)


def default_store(model_spec: str | None) -> Path:
    """`--task-store` without a value: one store per model under the cache."""
    import re

    from ltv_vllm.models.cache import DEFAULT_MODEL, cache_dir

    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", (model_spec or DEFAULT_MODEL).strip("/"))
    return cache_dir() / "task-stores" / key


def shared_store(spec: str | None) -> tuple[str | None, int]:
    """`--task-store` as a shared store (`store.shared_store`): its URL or directory and how
    many tasks its index holds; (None, 0) for a store of this server's own. Checked here, in
    one line, before anything starts: a store that does not answer, or is not one."""
    from ltv_vllm.serving.store.shared_store import SharedStore

    url = shared_url(spec)
    if url is None:
        return None, 0
    return url, SharedStore(url, create=False).size()  # a new one is made by `prepare`


def check_store_free(spec: str | None) -> None:
    """`--task-store DIR` that another running server holds: refused in one line before
    anything heavy (vLLM's import, the model); a shared store, or one not made yet, is
    not held by anyone."""
    from ltv_vllm.serving.store.taskstore import TaskStore

    if spec is None or shared_url(spec) is not None or not Path(spec).is_dir():
        return
    try:
        TaskStore(spec, create=False).check_free()
    except OSError:  # a lock file it cannot read: the start's own hold says why, in its line
        return


def shared_url(spec: str | None) -> str | None:
    """`--task-store` as a shared store's URL or absolute directory (None: not one)."""
    from ltv_vllm.serving.store.shared_store import is_shared

    if not is_shared(spec):
        return None
    assert spec is not None
    return spec if spec.startswith("s3://") else str(Path(spec.removeprefix("file://")).absolute())


def store_rank(model_dir: str | Path) -> int:
    """The LoRA rank a store server reserves: a compiled task's full rank min(N, d) at the
    default N (an upload of higher rank is cut to it)."""
    from ltv_vllm.models.checkpoint import identity_from_dir
    from ltv_vllm.serving.store.lora import lora_rank

    return lora_rank(min(identity_from_dir(model_dir).hidden_size, DEFAULT_STORE_N))


def store_entries(root: str, model_dir: Path, vectors: dict[str, Path], lora: bool = False
                  ) -> tuple[dict[str, Path], dict[str, str], bool]:
    """The store's entries a server on `model_dir` can serve (name → directory), those it
    cannot (name → why: they go to quarantine, never stop the start) and whether it holds a
    layer task (refused in one line for a LoRA server: no adapter carries one); read only."""
    from ltv_vllm.serving.store.taskstore import TaskStore

    entries, bad = TaskStore(root, create=False).checked(model_dir)
    if clash := sorted(set(entries) & set(vectors)):
        raise VectorError(f"task {clash[0]!r} is both a --task-vector and an entry of the task "
                          "store; rename one")
    layered = sorted(n for n, e in entries.items() if e.layer is not None)
    if layered and lora:
        raise VectorError(f"task store entry {layered[0]!r} is a layer task, which no LoRA "
                          "adapter carries: serve the store with --multi-task shift")
    return {name: e.path for name, e in entries.items()}, bad, bool(layered)


def upload_limit(model_dir: str | Path) -> int:
    """Bytes a task-vector upload may have: a float32 vector of vLLM's largest LoRA rank in
    logit space (vocab + d rows), its gram and bias, and 1 MiB for the header and framing."""
    from ltv_vllm.models.checkpoint import identity_from_dir
    from ltv_vllm.serving.store.lora import VLLM_LORA_RANKS

    ident = identity_from_dir(model_dir)
    r = VLLM_LORA_RANKS[-1]
    return 4 * (r * (ident.vocab_size + ident.hidden_size) + r * r + ident.vocab_size) + (1 << 20)
