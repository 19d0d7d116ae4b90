"""Atomic file writes: a crash or an error never leaves a half-written result behind."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, write: Callable[[str], object]) -> Path:
    """Call `write(tmp_path)` on a temp file beside `path`, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        # mkstemp makes 0600 files; give the result the mode a plain open() would.
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def umask() -> int:
    """The process's umask (reading it means setting it; put straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_figure(fig: object, path: str | Path, dpi: int = 120) -> Path:
    """Write a matplotlib figure as PNG atomically, then close it (frees its memory)."""
    import matplotlib.pyplot as plt

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return Path(path)


def check_writable(path: str | Path, *, option: str, suffixes: tuple[str, ...] = (),
                   directory: bool = False) -> Path:
    """Refuse an output path that cannot be written, before any work is done for it.

    The nearest existing ancestor must be a writable directory (missing parents are made
    later); a file output must not be an existing directory, and `suffixes` are the endings
    it may have.
    """
    from ltv_vllm.errors import ArgumentError

    path = Path(path).expanduser()
    if suffixes and not directory and path.suffix not in suffixes:
        raise ArgumentError(f"{option} {path}: must end in {' or '.join(suffixes)}")
    if path.exists() and path.is_dir() != directory:
        kind = "a directory" if path.is_dir() else "a file"
        raise ArgumentError(f"{option} {path}: is {kind}")
    probe = path if directory and path.exists() else path.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ArgumentError(f"{option} {path}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ArgumentError(f"{option} {path}: {probe} is not writable")
    try:  # what the permission bits do not tell (/proc, a read-only mount, root's access)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ArgumentError(f"{option} {path}: {probe} is not writable ({e.strerror})") from None
    return path
