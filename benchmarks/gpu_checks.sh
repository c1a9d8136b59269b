#!/usr/bin/env bash
# ../shared/GPU.md's checks as one prepared command, for the few minutes a GPU is lent.
#
#   bash benchmarks/gpu_checks.sh [--cpu] [STEP ...]
#
# Steps, in GPU.md's order (all of them when none is named):
#   test-gpu     make test-gpu
#   step         gpu_step.py e, a, c on the 1.10 B Llama at batch 1 and batch 8, seq 1024
#   split        g ("auto" under the GPU's memory) beside e on the 1.10 B Llama; g, and f at a 16 GiB
#                device budget, on the 5.11 B
#   lowbit       g ("auto") with fp32, bf16 and int8 optimizer states on the 1.10 B Llama, then g with int8
#                states on the 5.11 B (GPU.md 4b: where each kind lives, "tier_bytes"; the 5.11 B's fp32
#                g is split's), then the CPU's update of a block per format beside fp32's fused AdamW
#                (benchmarks/state_formats.py): 11 minutes at most, one lent session's worth
#   lowbit-bf16-5b  g with bf16 states on the 5.11 B (not in the default list: a session of its own)
#   layer-major  a against a-plain at 8 micro-batches a step (tz.accumulate against the plain loop)
#   compile      e, e-compiled, a, a-compiled
#   anchors      d (torchao's CPUOffloadOptimizer, where it imports)
#   floor        nvme_floor.py 1b, clip
#
# Each step runs under its own time limit (seconds: LIMIT_<step> overrides), writes its output to
# $OUT/<step>.log (default OUT=runs/gpu-checks), and a step that fails or runs out of time is
# logged as such before the next one starts. The steps together take longer than one lent
# session's 15 minutes: name the ones the session is for. NVMe files go under $NVME_DIR
# (default /tmp/tz-gpu-checks) and are removed at the end.
#
# --cpu: the same commands at the tiny size with the CPU as the device and the asynchronous
# stream stand-in (GPU.md: try the list on the CPU first); test-gpu and the GPU-only
# configurations report that they need CUDA.
set -u
cd "$(dirname "$0")/.."
cpu=0
if [ "${1:-}" = "--cpu" ]; then cpu=1; shift; fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(test-gpu step split lowbit layer-major compile anchors floor)
OUT=${OUT:-runs/gpu-checks}
NVME=${NVME_DIR:-/tmp/tz-gpu-checks}
mkdir -p "$OUT" "$NVME"
trap 'rm -rf "$NVME"' EXIT
export PYTHONPATH=$PWD

if [ $cpu = 1 ]; then
  PY=${GPU_PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  small=(--device cpu --streams async --size tiny --seq 64 --steps 2)
  large=("${small[@]}")
  floor=(--sizes tiny --steps 2 --drive-bytes 256MiB --streams async)
  update=(--sizes 64K --rounds 1 --steps 1)
else
  PY=${GPU_PY:-python3}
  small=(--steps 3)
  large=(--size 5b --warmup 1 --steps 2)
  floor=(--sizes 1b --steps 4 --drive-bytes 2GiB)
  update=(--sizes 1M,16M --rounds 3)
fi
gpu_step=("$PY" benchmarks/gpu_step.py --log-dir "$OUT")

run() {  # run STEP LIMIT COMMAND...
  local name=$1 limit=$2; shift 2
  limit=$(eval "echo \${LIMIT_${name//-/_}:-$limit}")
  echo "== $name (limit ${limit} s): $*" | tee -a "$OUT/$name.log"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  local verdict="rc $rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="ran out of time ($rc)"
  echo "== $name: $verdict after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log" "$OUT/summary.txt"
}

for step in "${steps[@]}"; do
  case $step in
    test-gpu)
      if [ $cpu = 1 ]; then echo "== test-gpu: needs CUDA" | tee -a "$OUT/summary.txt"
      else run test-gpu 180 make test-gpu GPU_PY="$PY"; fi ;;
    step)
      run step 200 "${gpu_step[@]}" "${small[@]}" --configs e,a,c --timeout 60 --nvme-dir "$NVME/step" --json
      run step-batch8 200 "${gpu_step[@]}" "${small[@]}" --configs e,a,c --batch 8 --timeout 60 \
        --nvme-dir "$NVME/step8" --json ;;
    split)
      run split 200 "${gpu_step[@]}" "${small[@]}" --configs e,g --timeout 90 --nvme-dir "$NVME/split" --json
      run split-5b 300 "${gpu_step[@]}" "${large[@]}" --configs g --timeout 280 --nvme-dir "$NVME/split5" --json
      run split-5b-f 360 "${gpu_step[@]}" "${large[@]}" --configs f --device-budget 16GiB --timeout 330 \
        --nvme-dir "$NVME/split5f" --json ;;
    lowbit)
      run lowbit 240 "${gpu_step[@]}" "${small[@]}" --configs g,g-bf16,g-int8 --timeout 75 --nvme-dir "$NVME/lowbit" \
        --json
      run lowbit-5b 300 "${gpu_step[@]}" "${large[@]}" --configs g-int8 --timeout 280 --nvme-dir "$NVME/lowbit5" --json
      run lowbit-update 120 "$PY" benchmarks/state_formats.py "${update[@]}" --json ;;
    lowbit-bf16-5b)
      run lowbit-bf16-5b 300 "${gpu_step[@]}" "${large[@]}" --configs g-bf16 --timeout 280 --nvme-dir "$NVME/lowbit5b" \
        --json ;;
    layer-major)
      run layer-major 300 "${gpu_step[@]}" "${small[@]}" --configs a,a-plain --micro-batches 8 --timeout 140 \
        --nvme-dir "$NVME/lm" --json ;;
    compile)
      run compile 420 "${gpu_step[@]}" "${small[@]}" --warmup 2 --configs e,e-compiled,a,a-compiled --timeout 150 \
        --nvme-dir "$NVME/compile" --json ;;
    anchors)
      run anchors 200 "${gpu_step[@]}" "${small[@]}" --configs d --timeout 150 --nvme-dir "$NVME/anchors" --json ;;
    floor)
      run floor 300 "$PY" benchmarks/nvme_floor.py --nvme-dir "$NVME/floor" --modes clip "${floor[@]}" --json ;;
    *)
      echo "unknown step $step: give test-gpu, step, split, lowbit, lowbit-bf16-5b, layer-major, compile, anchors or" \
        "floor" >&2; exit 2 ;;
  esac
done
cat "$OUT/summary.txt"
