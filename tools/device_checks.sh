#!/usr/bin/env bash
# Issue 51's checks on a CUDA machine, in order of what they decide, each under its own time limit; everything is
# written to $OUT/log (or ./device-out/log). Prepared here, run there in one call:
#   the wheels in .whl/ (msprobe_ci's own, built with `pip wheel --no-deps -w .whl .`, and the requirements the
#   machine lacks), installed into /tmp/site; python3 there holds torch with CUDA and transformers.
# Steps: the LM-head GEMMs with and without cuBLAS's reduced-precision reduction; GPT-2 small's benign gate with the
# upcast bench both ways; a profile of the check without isolation; the gate-quality grid with the device and the
# upcast bench; realistic_size's timings.
set -u
OUT=${OUT:-./device-out}
mkdir -p "$OUT"
LOG=$OUT/log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 || { echo "install failed" >>"$LOG"; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
step() {  # step SECONDS TITLE COMMAND...
    local limit=$1 title=$2
    shift 2
    echo "=== $title ($(date +%T))" >>"$LOG"
    timeout "$limit" "$@" >>"$LOG" 2>&1
    echo "=== rc $? ($(date +%T))" >>"$LOG"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1
python3 -c "import torch, transformers, msprobe_ci; print(torch.__version__, transformers.__version__, msprobe_ci.__file__)" >>"$LOG" 2>&1
step 45 "LM-head GEMMs, bf16" python3 benchmarks/reduced_precision_gemm.py --dtype bf16
step 30 "LM-head GEMMs, fp16" python3 benchmarks/reduced_precision_gemm.py --dtype fp16
step 100 "GPT-2 small benign, upcast bench, reduced-precision reduction on (default)" \
    python3 benchmarks/gpt2_small_gate.py --device cuda --bench-kernel upcast --threads 8 --benign-only
step 100 "GPT-2 small benign, upcast bench, reduced-precision reduction off" \
    python3 benchmarks/gpt2_small_gate.py --device cuda --bench-kernel upcast --threads 8 --benign-only \
    --no-reduced-precision-reduction
step 50 "profile: check without isolation, GPT-2 small 1 x 1024" python3 -c "
import cProfile, pstats, sys
sys.argv = ['realistic_size.py', '--child', 'check-noiso', '--device', 'cuda', '--threads', '8']
sys.path.insert(0, 'benchmarks')
import realistic_size
cProfile.run('realistic_size.main()', '$OUT/noiso.prof')
st = pstats.Stats('$OUT/noiso.prof'); st.sort_stats('tottime').print_stats(35); st.sort_stats('cumulative').print_stats(45)"
step 120 "gate quality, device bench" python3 benchmarks/gate_quality.py --device cuda --anchor --seeds 1 \
    --models llama,gpt2 --dtypes bf16,fp16,fp32 --bench-kernel device
step 90 "realistic size" python3 benchmarks/realistic_size.py --device cuda --threads 8
step 150 "gate quality, upcast bench" python3 benchmarks/gate_quality.py --device cuda --anchor --seeds 1 \
    --models llama,gpt2 --dtypes bf16,fp16,fp32 --bench-kernel upcast
echo "done" >>"$LOG"
