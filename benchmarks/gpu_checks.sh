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
[ ${#steps[@]} -eq 0 ] && steps=(test-gpu step split layer-major compile anchors floor)
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
else
  PY=${GPU_PY:-python3}
  small=(--steps 3)
  large=(--size 5b --warmup 1 --steps 2)
  floor=(--sizes 1b --steps 4 --drive-bytes 2GiB)
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
      echo "unknown step $step: give test-gpu, step, split, layer-major, compile, anchors or floor" >&2; exit 2 ;;
  esac
done
cat "$OUT/summary.txt"
