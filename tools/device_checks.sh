#!/usr/bin/env bash
# Issue 51's checks on a CUDA machine, in order of what they decide, each under its own time limit; everything is
# written to $OUT/log (or ./device-out/log). Prepared here, run there in one call:
#   the wheels in .whl/ (msprobe_ci's own, built with `pip wheel --no-deps -w .whl .`, and the requirements the
#   machine lacks), installed into /tmp/site; python3 there holds torch with CUDA and transformers.
# Steps (570 s at most, inside one 600 s call): the CUDA tests; the host reads and launches per record and per judged
# call (benchmarks/host_syncs.py); realistic_size's timings with the device and the upcast bench; the gate-quality
# grid with the upcast bench, whose budgets are drawn on the GPU; last, where an isolated step's time goes
# (benchmarks/step_profile.py: the host's launches and waits, the device's busy share). Run:
#   run(command="tools/device_checks.sh", carry=[".whl"], timeout_s=600)
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
# 1. the CUDA tests: budgets drawn on the device as on the CPU, the device's verdicts the CPU's (both bench kernels),
#    the loss's gradient in pieces on the device (its values and the allocator's peak)
step 150 "CUDA tests" python3 -m pytest -q -p no:cacheprovider -x tests/test_kernels.py tests/test_isolation.py \
    tests/test_standards.py -k "on_a_gpu or gpu_the"
# 2. host reads per record and per judged call, with the synchronising ops CUDA reports
step 90 "host syncs" python3 benchmarks/host_syncs.py --device cuda --modes off,device,upcast --layers 2 --tokens 512
# 3. the goals' figures: GPT-2 small 1 x 1024 against the plain steps, device bench then upcast (budgets on the GPU)
step 120 "realistic size, device bench" python3 benchmarks/realistic_size.py --device cuda --threads 8 \
    --ways plain-fp32,plain-bf16,check,check-noiso,check-budget
step 90 "realistic size, upcast bench" python3 benchmarks/realistic_size.py --device cuda --threads 8 \
    --ways plain-fp32,plain-bf16,check --bench-kernel upcast
# 4. truth: the grid with the upcast bench, its budgets now drawn on the GPU
step 75 "gate quality, upcast bench" python3 benchmarks/gate_quality.py --device cuda --anchor --seeds 1 \
    --models llama,gpt2 --dtypes bf16,fp16 --bench-kernel upcast
# 5. the floor: one isolated GPT-2 small step under torch.profiler (host launches and waits, device busy share)
step 45 "step profile, device bench" python3 benchmarks/step_profile.py --device cuda --threads 8 \
    --bench-kernel device
echo "done" >>"$LOG"
