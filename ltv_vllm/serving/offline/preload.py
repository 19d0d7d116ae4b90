"""What the job forkserver (`offline.jobs`) does once, so that no forked job does it again.

Imported by the forkserver only, before any job forks from it; never by library code (its
import has the side effects below). An offline SmolLM2-135M engine job went from 10.2 s to
6.1 s (`benchmarks/job_start.py`, 2-core Intel Xeon, AVX512, float32), of which:

- importing the modules every engine imports after `vllm.entrypoints.llm` (the worker and
  model runner, the model classes, the weight loader, LoRA, our plugin): engine start-up
  4.0 → 3.0 s;
- torch inductor's per-process probes, run on a job's first `generate` when vLLM compiles
  its logprob-rank kernel (`batched_count_greater_than`, `torch.compile`d): which vector ISA
  the C++ compiler can build *and load*, which starts a Python subprocess that imports torch
  (about 1.1 s per process), and the source hashes of torch and triton keying its caches
  (0.4 s): the first `generate` 4.1 → 1.2 s. Their results are `functools.cache`d module
  state, which a forked child inherits.

Fork safety holds as for the imports alone: nothing here builds an engine, makes a CUDA
context or runs a parallel torch op (the probes run compilers in subprocesses and hash
files). A probe that fails costs only the time it would have cost each job; it never stops
the forkserver (which only forgives an ImportError).
"""

from __future__ import annotations

import importlib

# each pulls in dozens of others; a name absent from this build of vLLM is skipped
MODULES = (
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.gpu_worker",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
    "vllm.v1.sample.rejection_sampler",
    "vllm.lora.worker_manager",
    "vllm.lora.punica_wrapper.punica_cpu",
    "compressed_tensors",
    "ltv_vllm.serving.engine.models",
    "ltv_vllm.serving.engine.steps",
    "torch._dynamo.backends.inductor",
)


def _warm_inductor() -> None:
    from torch._inductor import codecache, cpu_vec_isa

    cpu_vec_isa.pick_vec_isa()  # builds and load-tests each candidate ISA, then caches
    codecache.torch_key()
    codecache.CacheBase.get_system()


for _name in MODULES:
    try:
        importlib.import_module(_name)
    except ImportError:
        pass
try:
    _warm_inductor()
except Exception:  # a job then probes for itself, as it always did
    pass
