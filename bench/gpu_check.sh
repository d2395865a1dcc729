#!/usr/bin/env bash
# The first checks to run on a machine with a GPU, as one prepared script.
#
# Run: bash bench/gpu_check.sh [OUT]     (OUT default: gpu-check-out, in the current folder)
#
# With CUDA (torch sees a GPU):
#   1. `autosbp profile` on CUDA with nccl, quick (one rank per GPU, at most 8; the profiler
#      times collectives between pairs of ranks, so a machine of one GPU skips it);
#   2. `autosbp plan` of the zoo mlp for 1 GPU with that profile (dgx-h100's if the profile
#      failed: said so);
#   3. `autosbp train --check` on CUDA with nccl, 1 process under that plan; and the zoo gpt
#      under the auto plan for 2 GPUs on 2 processes (with one GPU: for 1 GPU on 1 process),
#      in fp32 and in bf16 (mixed precision: bf16 compute, fp32 masters, checked against one
#      device running the same recipe); and the zoo gpt on text (byte tokens of Python's own
#      source) in bf16 with AdamW, warmup, clipping and evaluation: the training job end to end;
#   4. a few matmul shapes' measured TFLOP/s beside the dgx profiles' assumed efficiency
#      (bench/matmul_efficiency.py).
# Without CUDA: says so on one line, skips 1-3, and runs 4 on the CPU against cpu-gloo (so CI
# keeps the script working: tests/cli/test_gpu_check.py).
# Everything goes under OUT (each step's output in its own .log); the summary (OUT/summary.txt)
# has one PASS / FAIL / SKIP line per step. A failing step does not stop the next ones; the
# exit status is 1 if any step failed. Each step is stopped after STEP_TIMEOUT_S seconds
# (default 300: a hung collective fails its step instead of the whole check).
set -uo pipefail

OUT=${1:-gpu-check-out}
# The interpreter autosbp is installed in: $PYTHON, else the active venv's, else python3.
PYTHON=${PYTHON:-${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1  # the repository root: `-m autosbp.cli` and bench/ from here
: > "$OUT/summary.txt"
failed=0

say() { echo "[gpu_check] $*" | tee -a "$OUT/summary.txt"; }

step() {  # step NAME COMMAND...: run, log to OUT/NAME.log, one summary line
    local name=$1
    shift
    local start=$SECONDS
    if timeout "${STEP_TIMEOUT_S:-300}" "$@" > "$OUT/$name.log" 2>&1; then
        say "PASS $name ($((SECONDS - start)) s): $*"
    else
        say "FAIL $name ($((SECONDS - start)) s, exit $?; see $OUT/$name.log): $*"
        failed=1
    fi
}

if ! gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>&1); then
    say "FAIL setup: $PYTHON cannot import torch ($gpus); set PYTHON=/path/to/the/venv/bin/python"
    exit 1
fi
say "torch $("$PYTHON" -c 'import torch; print(torch.__version__)'), $gpus CUDA device(s), output in $OUT"

if [ "$gpus" -ge 1 ]; then
    ranks=$((gpus < 8 ? gpus : 8))
    if [ "$ranks" -ge 2 ]; then
        step profile "$PYTHON" -m autosbp.cli profile --nproc "$ranks" --backend nccl --quick \
            --out "$OUT/cuda-profile.json"
    else
        say "SKIP profile: one GPU (the profiler times collectives between pairs of ranks)"
    fi
    profile="$OUT/cuda-profile.json"
    if [ ! -f "$profile" ]; then
        profile=dgx-h100
        say "no measured CUDA profile: planning with the shipped dgx-h100 profile instead"
    fi
    step plan-1gpu "$PYTHON" -m autosbp.cli plan mlp --devices 1 --profile "$profile" \
        --out "$OUT/plan-1gpu.json" --force
    step train-1gpu "$PYTHON" -m autosbp.cli train mlp --nproc 1 --plan "$OUT/plan-1gpu.json" \
        --device cuda --backend nccl --steps 5 --check
    gpt_ranks=$((gpus < 2 ? gpus : 2))
    step "train-gpt-${gpt_ranks}gpu" "$PYTHON" -m autosbp.cli train gpt --nproc "$gpt_ranks" \
        --plan auto --profile "$profile" --device cuda --backend nccl --steps 5 --check
    step "train-gpt-bf16-${gpt_ranks}gpu" "$PYTHON" -m autosbp.cli train gpt --nproc "$gpt_ranks" \
        --plan auto --profile "$profile" --device cuda --backend nccl --steps 5 --check \
        --dtype bf16
    step "train-text-bf16-${gpt_ranks}gpu" "$PYTHON" -m autosbp.cli train gpt --nproc "$gpt_ranks" \
        --model-args vocab=256,seq=64,batch=16,layers=4,hidden=128 --plan auto \
        --profile "$profile" --device cuda --backend nccl --dtype bf16 --optimizer adamw \
        --weight-decay 0.1 --lr 3e-3 --warmup-steps 10 --lr-schedule cosine --min-lr 3e-4 \
        --clip-grad-norm 1.0 --steps 100 --data stdlib_text --data-args seq=64 \
        --eval-data stdlib_text --eval-args seq=64,split=eval --eval-every 50 \
        --metrics "$OUT/text-metrics.jsonl"
else
    say "SKIP profile, plan-1gpu, train-1gpu, train-gpt, train-gpt-bf16, train-text-bf16: no CUDA device that torch can use (CPU build or no GPU); the matmul table below measures the CPU"
fi

step matmul "$PYTHON" bench/matmul_efficiency.py --repeats "${REPEATS:-20}"
cat "$OUT/matmul.log"
say "done: $( [ "$failed" -eq 0 ] && echo 'every step that ran passed' || echo 'some steps FAILED' )"
exit "$failed"
