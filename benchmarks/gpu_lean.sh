#!/usr/bin/env bash
# The lean presets' GPU check, one command on a CUDA machine:
#
#     bash benchmarks/gpu_lean.sh [OUT_DIR [PART ...]]     # logs: OUT_DIR/PART.txt
#
# Parts (default: tests gpu step, about 7 minutes on an H200; each has its own time limit):
#   tests     the Triton and compiled lean steps' bits against the torch-ops path on the GPU,
#             bf16_split's masters against FP32 masters there, and the other CUDA-only tests (2 min)
#   triton    the Triton step's CUDA tests alone (1 min)
#   gpu       gpu.py: tokens/s and peak memory of ours bf16, bf16_lean and bf16_sr against
#             Lightning's bf16-mixed on char_gpt (19M parameters, 78 tensors) (4 min)
#   step      bench_step.py --device cuda --memory: every step path against fused FP32 AdamW, 16M
#             parameters in 16 tensors, and each path's peak memory in one step (2 min)
#   mix       the same over a transformer's mix of 60 tensors, 64M parameters: four slabs of the
#             passes' step (2.5 min)
#   combo     mix with Inductor's combo kernels (TORCHINDUCTOR_COMBO_KERNELS=1: a batch of
#             tensors in one launch) (2.5 min)
#   profile   one round of bf16_lean and bf16_sr in gpu.py with torch.profiler tables (host and
#             device time by operator): where a lean training step's time goes (2 min)
#
# A failing part is reported and the others still run; the script exits 1 if any failed.
# Needs torch with CUDA, pytest and Lightning; runs the checkout as it is (no install).
set -u
out=${1:-gpu_lean_out}
shift $(($# > 0 ? 1 : 0))
parts=${*:-tests gpu step}
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
for name in $parts; do
    case $name in
    tests) # AMP_PLUGIN_FUSED=0: no build of the CPU kernels, which these tests do not run
        part tests 120 env AMP_PLUGIN_FUSED=0 python3 -m pytest -q -p no:cacheprovider -k cuda \
            tests/master_weights/test_master_triton.py tests/master_weights/test_master_compiled.py \
            tests/master_weights/test_master_passes.py tests/master_weights/test_master_layouts.py \
            tests/lightning/test_loss_scale_monitor.py ;;
    triton) part triton 90 env AMP_PLUGIN_FUSED=0 python3 -m pytest -q -p no:cacheprovider -k cuda \
        tests/master_weights/test_master_triton.py ;;
    gpu) part gpu 240 python3 benchmarks/gpu.py --warmup 15 --steps 100 --rounds 3 --budget-s 170 \
        --configs "ours bf16" "ours bf16_lean" "ours bf16_sr" "Lightning bf16-mixed" ;;
    step) part step 120 python3 benchmarks/bench_step.py --device cuda --params 16 --chunks 16 --repeats 15 --memory ;;
    mix) part mix 150 python3 benchmarks/bench_step.py --device cuda --params 64 --mix --repeats 15 --memory ;;
    combo) part combo 150 env TORCHINDUCTOR_COMBO_KERNELS=1 \
        python3 benchmarks/bench_step.py --device cuda --params 64 --mix --repeats 15 ;;
    profile) part profile 150 python3 benchmarks/gpu.py --warmup 15 --steps 100 --rounds 1 --budget-s 60 \
        --configs "ours bf16_lean" "ours bf16_sr" --profile "ours bf16_lean" "ours bf16_sr" ;;
    *) echo "unknown part $name: choose from tests triton gpu step mix combo profile" >&2; exit 2 ;;
    esac
done
exit $status
