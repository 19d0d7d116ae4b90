#!/usr/bin/env bash
# Prove the package works as a wheel, not only as an editable install of this source tree:
# build a wheel, install it (no dependencies: the venv has them) into a throwaway directory,
# and from a directory where the source tree is not importable, import every module of the
# installed copy and run `ltv-vllm --help` and `ltv-vllm bench --help` from its own script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# Build from a copy of the files git would ship (tracked or not ignored): a `build/` left in the
# source tree by an earlier build would otherwise slip stale modules into the wheel.
mkdir "$WORK/src"
git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c \
  'test -e "{}" && mkdir -p "$0/$(dirname "{}")" && cp -p "{}" "$0/{}"' "$WORK/src"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$WORK/src" 2>/dev/null \
  || "$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/ltv_vllm-*.whl)
"$PY" -m pip install -q --no-deps --target "$WORK/site" "$WHEEL"
cd "$WORK"
export PYTHONPATH="$WORK/site"
"$PY" - "$WORK/site" "$WORK/src" <<'PY'
import importlib, pathlib, pkgutil, sys
site, src = sys.argv[1], pathlib.Path(sys.argv[2])
import ltv_vllm
assert ltv_vllm.__file__.startswith(site), f"imported {ltv_vllm.__file__}, not the wheel's copy"
names = ["ltv_vllm"] + [m.name for m in pkgutil.walk_packages(ltv_vllm.__path__, "ltv_vllm.")]
for name in names:
    mod = importlib.import_module(name)
    assert mod.__file__.startswith(site), f"{name} came from {mod.__file__}"
# every module of the source tree must have come with the wheel
expected = {".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
            for p in (src / "ltv_vllm").rglob("*.py")}
missing = expected - set(names)
assert not missing, f"the wheel lacks {sorted(missing)}"
print(f"wheel: imported {len(names)} modules from {site}")
PY
"$WORK/site/bin/ltv-vllm" --help >/dev/null
"$WORK/site/bin/ltv-vllm" bench --help >/dev/null
echo "wheel: ltv-vllm --help and ltv-vllm bench --help ran from $(basename "$WHEEL")"
