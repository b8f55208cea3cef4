#!/usr/bin/env bash
# One packed H200 run through the device tool. Usage (from the repo root, on the device):
#   bash bench/gpu_run.sh tests   # GPU test suite (+ interpreter-free kernel sweep), MiniLM parity
#   bash bench/gpu_run.sh bench   # kernel benchmark: ours vs eager vs torch.compile, JSON + markdown
# Results land in $OUT (the device tool brings them back).
set -uo pipefail
mode=${1:-tests}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv | tee "$OUT/nvidia-smi-$mode.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
case "$mode" in
  tests)
    # every shape of the sweep would otherwise be autotuned; the autotune path is exercised by the model tests
    FUSEDSERVE_TRITON_AUTOTUNE=0 FUSEDSERVE_TEST_MODEL_DIR=.gpu-assets/minilm \
      timeout 420 python3 -m pytest -m gpu -q -rs -p no:cacheprovider -n 8 tests/kernels 2>&1 | tee "$OUT/gpu-tests-kernels.log" | tail -5
    FUSEDSERVE_TRITON_AUTOTUNE=${AUTOTUNE_MODEL_TESTS:-1} FUSEDSERVE_TEST_MODEL_DIR=.gpu-assets/minilm \
      timeout 240 python3 -m pytest -m gpu -q -s -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu-tests-model.log" | tail -12
    ;;
  bench)
    shift
    timeout 560 python3 -m bench.kernels --providers triton eager compile --out "$OUT/kernels.json" \
      --markdown "$OUT/kernels.md" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^\[' 
    ;;
esac
