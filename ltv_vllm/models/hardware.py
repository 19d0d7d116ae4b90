"""What the hardware runs fast, and what to record about it beside every number.

`--dtype auto` means "the precision this device computes natively", not "the checkpoint's":
the packaged models are bfloat16 checkpoints, and on a CPU without native bf16 (AVX2 only:
no AVX512-BF16, no AMX) PyTorch emulates bf16 matmuls and runs them ~5× slower than float32
(measured: SmolLM2-135M, batch 16 × 24 tokens, 61 vs 307 tok/s). The rule, owned
by `resolve_dtype` and used by every path (transformers passes, the vLLM engine and server,
the benchmarks):

  CPU   bfloat16 where the CPU has native bf16 (AVX512-BF16 or AMX on x86, the BF16
        extension on Arm) and the checkpoint is half precision; float32 otherwise
        (a float32 checkpoint stays float32: auto never loses precision on a CPU);
  CUDA  bfloat16 where the GPU supports it, else float16 (as vLLM does on GPUs).

An explicit dtype is always taken as given.
"""

from __future__ import annotations

import functools
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.errors import UserError

DTYPES = ("bfloat16", "float16", "float32")
DTYPE_CHOICES = ("auto", *DTYPES)
_HALF = ("bfloat16", "float16")


def cpu_capability() -> str:
    """PyTorch's dispatch level for this CPU: "AVX512", "AVX2", "SVE256", "DEFAULT", ..."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - very old torch: report, do not fail
        return "unknown"


@functools.cache
def cpu_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 in hardware (not by conversion to float32).

    x86: AVX512-BF16 or AMX tiles. oneDNN's own check (`_is_mkldnn_bf16_supported`) is also
    true for plain AVX512, where bf16 is converted in registers; we ask for the instructions.
    Elsewhere (Arm) oneDNN's check is the instruction check.
    """
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        # torch.cpu's checks moved between releases (torch._C._cpu before, torch.cpu since);
        # ask whichever this torch has, and the kernel's flags when it has neither.
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        for owner in (torch.cpu, getattr(torch._C, "_cpu", None)):
            found = [getattr(owner, c) for c in checks if hasattr(owner, c)]
            if found:
                return any(bool(f()) for f in found)
        return bool({"avx512_bf16", "amx_bf16"} & _proc_cpu_flags())
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - no oneDNN in this build
        return False


def _proc_cpu_flags() -> set[str]:
    """The first CPU's flags from /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype a local HF checkpoint declares in config.json (None if it says nothing)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    for c in (cfg, text):
        value = c.get("dtype") or c.get("torch_dtype")
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None


def resolve_dtype(requested: str, *, device: str = "cpu", checkpoint: str | None = None) -> str:
    """The concrete dtype name for `requested` ("auto" or one of DTYPES) on `device`.

    `checkpoint` is the checkpoint's own dtype (`checkpoint_dtype`), when known: on a CPU a
    float32 checkpoint is never cast down by "auto".
    """
    if requested != "auto":
        if requested not in DTYPES:
            raise UserError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {requested!r}")
        return requested
    if str(device).startswith("cuda"):
        return ("bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported()
                else "float16")
    if checkpoint is not None and checkpoint not in _HALF:
        return "float32"
    return "bfloat16" if cpu_native_bf16() else "float32"


def resolve_device(requested: str) -> str:
    """`--device`: "auto" is the GPU when there is one, else the CPU; another value must be a
    device torch knows and this machine has (one line otherwise)."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(requested).type
    except (RuntimeError, TypeError, ValueError):
        raise UserError(f"unknown device {requested!r} (auto, cpu, cuda, cuda:1, ...)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {requested!r}: torch sees no CUDA device it can use "
                        f"(torch {torch.__version__}); use cpu or auto")
    return requested


def engine_device() -> str:
    """Where a vLLM engine started here runs: the GPU when there is one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_for_model(requested: str, model_dir: str | Path, device: str | None = None) -> str:
    """`resolve_dtype` for a local model directory, on `device` (default: `engine_device()`)."""
    return resolve_dtype(requested, device=device or engine_device(),
                         checkpoint=checkpoint_dtype(model_dir))


def device_line(device: str = "cpu") -> str:
    """`CPU AVX2, no native bf16` (or the GPU's name): what decided `auto`, for printouts."""
    if str(device).startswith("cuda"):
        return f"{gpu_name() or 'GPU'}"
    bf16 = "native bf16" if cpu_native_bf16() else "no native bf16"
    return f"CPU {cpu_capability()}, {bf16}"


def gpu_name() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        return str(torch.cuda.get_device_name(0))
    except Exception:  # noqa: BLE001
        return "cuda"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> dict[str, Any]:
    """What a reader needs to know about the machine a number came from."""
    return {
        "cpu": cpu_model(),
        "cpu_capability": cpu_capability(),
        "cpu_native_bf16": cpu_native_bf16(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu_name(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def machine_line(hw: dict[str, Any]) -> str:
    """`AMD EPYC, AVX2 (no native bf16), 2 cores` — the short form printed beside timings.

    Also reads the older result files' `machine` records (processor/cpus, no capability).
    """
    cpu = hw.get("cpu") or hw.get("processor") or "?"
    cores = hw.get("cores") or hw.get("cpus") or "?"
    cap = hw.get("cpu_capability")
    if cap is None:
        return f"{cpu}, {cores} cores (CPU capability not recorded)"
    bf16 = "native bf16" if hw.get("cpu_native_bf16") else "no native bf16"
    gpu = f", GPU {hw['gpu']}" if hw.get("gpu") else ""
    return f"{cpu}, {cap} ({bf16}), {cores} cores{gpu}"
