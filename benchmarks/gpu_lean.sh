#!/usr/bin/env bash
# The lean presets' GPU check, one command on a CUDA machine (about 7 minutes on an H200):
#
#     bash benchmarks/gpu_lean.sh [OUT_DIR]      # logs: OUT_DIR/{tests,step,step_mix,step_mix_combo,gpu}.txt
#
# 1. tests: the compiled lean step's bits against the torch-ops path on the GPU (and the other
#    CUDA-only tests);
# 2. step: bench_step.py --device cuda, 64M parameters in 16 equal tensors (memory-bound), then a
#    transformer's mix of 60 tensors (more launches per byte), the second time also with Inductor's
#    combo kernels (TORCHINDUCTOR_COMBO_KERNELS=1: a batch of tensors in one launch);
# 3. gpu: gpu.py, tokens/s and peak memory of ours bf16, bf16_lean and bf16_sr against Lightning's
#    bf16-mixed on char_gpt (19M parameters).
#
# Each part has its own time limit; a failing part is reported and the others still run; the
# script exits 1 if any part failed. Needs torch with CUDA, pytest and Lightning; no install.
set -u
out=${1:-gpu_lean_out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
part() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    tail -n 40 "$out/$name.txt"
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || status=1
}
nvidia-smi -L
python3 -c "import torch, lightning; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Lightning', lightning.__version__)"
part tests 120 python3 -m pytest -q -p no:cacheprovider -k cuda \
    tests/master_weights/test_master_compiled.py tests/lightning/test_loss_scale_monitor.py
part step 100 python3 benchmarks/bench_step.py --device cuda --params 64 --chunks 16 --repeats 15
part step_mix 70 python3 benchmarks/bench_step.py --device cuda --params 64 --mix --repeats 15
part step_mix_combo 70 env TORCHINDUCTOR_COMBO_KERNELS=1 python3 benchmarks/bench_step.py --device cuda --params 64 --mix --repeats 15
part gpu 200 python3 benchmarks/gpu.py --warmup 15 --steps 100 --rounds 3 --budget-s 130 \
    --configs "ours bf16" "ours bf16_lean" "ours bf16_sr" "Lightning bf16-mixed"
exit $status
