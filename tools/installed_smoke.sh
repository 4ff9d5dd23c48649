#!/usr/bin/env bash
# The package as users install it: build the sdist and the wheel, install the wheel into a clean virtual environment
# outside the checkout (no editable install, no source tree on the path), and from there run the commands a user
# runs first. Then the same package from the sdist and from a git URL (non-editable), each checked to load.
#
#   tools/installed_smoke.sh            # cheap: the GPT-2 example only (.ci/run)
#   tools/installed_smoke.sh --full     # every example (the CI workflow's install job)
#
# TORCH_PIP_ARGS: how to install the pinned CPU torch (default "torch==2.13.0"; the GitHub job adds its index URL).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
full=0
[ "${1:-}" = "--full" ] && full=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
py="${PYTHON:-python3}"
quiet_pip() {  # pip, its output shown only when it fails
  "$@" >"$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
}

echo "-- build the sdist and the wheel"
quiet_pip "$py" -m pip install -q build
"$py" -m build -q --outdir "$work/dist" "$root" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel="$(ls "$work"/dist/*.whl)"
sdist="$(ls "$work"/dist/*.tar.gz)"
echo "built $(basename "$wheel") and $(basename "$sdist")"

echo "-- a clean virtual environment outside the checkout, the wheel installed"
"$py" -m venv "$work/venv"
vpy="$work/venv/bin/python"
quiet_pip "$vpy" -m pip install -q --upgrade pip
# shellcheck disable=SC2086
quiet_pip "$vpy" -m pip install -q ${TORCH_PIP_ARGS:-torch==2.13.0}
quiet_pip "$vpy" -m pip install -q "$wheel[examples]"
export PATH="$work/venv/bin:$PATH"
cd "$work"
unset PYTHONPATH
where="$("$vpy" -c 'import msprobe_ci, os; print(os.path.dirname(msprobe_ci.__file__))')"
case "$where" in "$root"*) echo "msprobe_ci imported from the checkout ($where), not the wheel"; exit 1;; esac
echo "msprobe_ci from $where"

check_loads() {  # the console script, the pytest plugin, every subpackage, and PrecisionDebugger on a small model
  msprobe-ci --help >/dev/null
  pytest --help >"$work/help.txt" 2>&1 || { cat "$work/help.txt"; exit 1; }
  grep -q -- "--msprobe-bench" "$work/help.txt" || { cat "$work/help.txt"; echo "plugin options missing"; exit 1; }
  "$vpy" - <<'PY'
import importlib, pkgutil, sys

import msprobe_ci

for mod in pkgutil.walk_packages(msprobe_ci.__path__, "msprobe_ci."):
    if ".pytest_plugin" not in mod.name:
        importlib.import_module(mod.name)
import torch

from msprobe_ci import PrecisionDebugger

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
debugger = PrecisionDebugger(dump_path="pd-dump", level="mix")
for step in range(2):
    debugger.start(model)
    model(torch.randn(3, 8)).sum().backward()
    debugger.stop()
    debugger.step()
harness = sorted(m for m in ("pytest", "_pytest", "pluggy") if m in sys.modules)
assert not harness, f"PrecisionDebugger loaded a test framework: {harness}"
print("PrecisionDebugger: 2 steps dumped, no test framework loaded")
PY
  [ -s pd-dump/step1/rank/dump.json ] || { ls -R pd-dump; echo "no dump.json for step 1"; exit 1; }
  rm -rf pd-dump
}
check_loads

echo "-- the README's main job on examples/, from the installed wheel"
cp -r "$root/examples" "$work/examples"
if [ "$full" = 1 ]; then
  pytest examples/ --msprobe-bench=cpu --msprobe-target=cpu --msprobe-target-dtype=bf16 -p no:cacheprovider
else
  pytest examples/test_gpt2.py --msprobe-bench=cpu --msprobe-target=cpu --msprobe-target-dtype=bf16 \
    -p no:cacheprovider -q
fi

echo "-- a fault's reproduction, run alone from the installed wheel: fails with the fault, passes without it"
set +e
pytest examples/test_gpt2.py --msprobe-bench=cpu --msprobe-target=cpu --msprobe-target-dtype=bf16 \
  --msprobe-inject examples/faults/layer_norm.yaml -p no:cacheprovider -q >"$work/fault.log" 2>&1
set -e
repro="$(grep -m1 -o 'reproduce this call alone.*: python .*\.py' "$work/fault.log" | sed 's/.*: python //')"
[ -n "$repro" ] || { cat "$work/fault.log"; echo "no reproduction command in the failure message"; exit 1; }
set +e
"$vpy" "$repro" >"$work/repro.log" 2>&1; rc=$?
"$vpy" "$repro" --no-fault >>"$work/repro.log" 2>&1; rc_clean=$?
set -e
[ "$rc" -eq 1 ] && [ "$rc_clean" -eq 0 ] || { cat "$work/repro.log"; echo "repro: exit $rc with the fault, $rc_clean without"; exit 1; }
echo "reproduction $(basename "$repro"): fails with the fault, passes without it"

echo "-- the same package from the sdist (no dependencies reinstalled)"
quiet_pip "$vpy" -m pip install -q --no-deps --force-reinstall "$sdist"
check_loads

if git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
  echo "-- the same package from a git URL, non-editable (the checkout's HEAD)"
  quiet_pip "$vpy" -m pip install -q --no-deps --force-reinstall "git+file://$root"
  check_loads
fi
echo "installed smoke: ok"
