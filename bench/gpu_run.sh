#!/usr/bin/env bash
# One packed H200 run through the device tool. Usage (from the repo root, on the device):
#   bash bench/gpu_run.sh tests     # CUDA build from a clean cache, GPU test suite, MiniLM parity (TESTS_PART=kernels|model:
#                                   # one half; both need more than one call)
#   bash bench/gpu_run.sh sanitize  # compute-sanitizer memcheck + racecheck on the CUDA kernel tests
#   bash bench/gpu_run.sh bench     # kernel benchmark: ours vs eager vs torch.compile, JSON + markdown
#   bash bench/gpu_run.sh check     # graph + GPU server tests and MiniLM fp16 parity (~4 min)
#   bash bench/gpu_run.sh serve     # the serving sweep alone (bench/serve.py on the GPU)
#   bash bench/gpu_run.sh gemm      # the Triton GEMM + bias + GELU epilogue: GPU tests and bench/linear_gelu.py
#   bash bench/gpu_run.sh pool      # segment_mean (pooling kernel) + GEMM tests, graphs + parity, the TMA GEMM rows,
#                                   # MiniLM encoder rows (ours only) and the MiniLM b1 s16 profile (~9 min)
#   bash bench/gpu_run.sh lnorm     # linear_add_layer_norm (split GEMM + LayerNorm kernel): GPU tests, fp16 graph
#                                   # tests + MiniLM parity, its bench rows, MiniLM encoder rows and b1 profile (~9 min)
#   bash bench/gpu_run.sh final     # lnorm's tests and bench rows again (vectorized epilogue), MiniLM rows with the split
#                                   # kernel on and off, fp16 parity, and one server's single-request split (~7 min)
#   bash bench/gpu_run.sh sdpa      # MiniLM rows with the dense SDPA call on torch's default (cuDNN), flash, and
#                                   # memory-efficient kernels (Triton backend, no CUDA build); one server's
#                                   # single-request latency with httpx and http.client (~6 min cold)
#   bash bench/gpu_run.sh small     # the Triton LayerNorm's few-row candidates: their device times, linear_add_layer_norm
#                                   # rows; one server's single-request latency (the encoder A/B is lnrows)
#   bash bench/gpu_run.sh serial    # a lone request's forward step by step (bench.serial_forward) + single-request latency
#   bash bench/gpu_run.sh idle      # the same after idle gaps, step by step, asleep / spinning / cores held out of deep idle
#   bash bench/gpu_run.sh poll      # single-request latency with and without idle_poll_ms, alternated
#   bash bench/gpu_run.sh next      # attention=fused (kernels.qkv_attention): GPU tests, MiniLM rows, b1 profile; the
#                                   # few-row GEMM + GELU configs forced one by one (~8 min cold)
#   bash bench/gpu_run.sh next2     # six MPS replicas at 64 clients: kernel choices across replicas, served / raw
#   bash bench/gpu_run.sh next3     # BERT-base b32 fixed and b128 varlen with torch.compile + CUDA graphs in the same run
#   bash bench/gpu_run.sh next4     # one server's single-request latency, default attention then attention=fused
#   bash bench/gpu_run.sh next5     # the fused model tests, MiniLM rows and b1 profile (FFN chunks), each also with PDL
#   bash bench/gpu_run.sh next6     # session 13's defaults (auto = few-token layer + varlen, PDL on): server, parity,
#                                   # fallback and switch tests
#   bash bench/gpu_run.sh next7     # the MiniLM rows on those defaults with HF and torch.compile (+ graphs), same run
#   bash bench/gpu_run.sh lnrows    # MiniLM rows without / with the few-row LayerNorm candidates (Triton), b1 profile
#   bash bench/gpu_run.sh replicas  # one server, then eight replicas on the GPU at 64 clients (token ids), with the
#                                   # servers' CPU time per request (~8 min)
#   bash bench/gpu_run.sh mps       # four replicas through a CUDA MPS daemon, 64 clients, token ids (~7 min)
#   bash bench/gpu_run.sh encoder   # bench/encoder.py (with torch.compile on three cases, and the what-if row with
#                                   # the Triton FFN-in epilogue) + the MiniLM and BERT profiles
# Results land in $OUT (the device tool brings them back).
set -uo pipefail
mode=${1:-tests}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv | tee "$OUT/nvidia-smi-$mode.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
# the server's packages the image lacks travel as wheels (../shared/tools/gpu-wheels.sh orjson httptools): say
# up front what is missing (session 14's first call lost its two server tests to a missing orjson)
python3 - <<'PY'
import importlib.util
need = ("fastapi", "uvicorn", "pydantic_settings", "orjson", "httptools", "prometheus_client", "tokenizers")
missing = [name for name in need if importlib.util.find_spec(name) is None]
print("server packages: all present" if not missing else
      f"server packages MISSING: {' '.join(missing)} (server tests fail, serving numbers change without httptools)")
PY
build_cached() {  # the CUDA extension into a cache the tests and benches share
  export FUSEDSERVE_CUDA_CACHE=/tmp/fusedserve-cuda-cache
  python3 -m kernels.cuda.build 2>&1 | tail -1
}
gpu_tests() {  # name, time limit, pytest args...: one pytest per call, its log kept whole, a summary printed.
  # -v names each test as it ends; at the limit pytest gets SIGINT, so it still prints its failures so far
  local name=$1 limit=$2; shift 2
  FUSEDSERVE_TEST_MODEL_DIR=.gpu-assets/minilm timeout --signal=INT --kill-after=30 "$limit" \
    python3 -m pytest -m gpu -v -s -rfs --tb=short --durations=15 \
    -p no:cacheprovider "$@" > "$OUT/gpu-tests-$name.log" 2>&1
  echo "== $name exit $?"
  grep -vE "^(INFO|Loading weights)" "$OUT/gpu-tests-$name.log" | grep -E "cosine|passed|failed|FAILED|Error|^E " | tail -16
}
lnorm_tests() {  # time limit, -k selection: the linear_add_layer_norm GPU tests (the split kernel, both backends' ops)
  FUSEDSERVE_TRITON_AUTOTUNE=0 gpu_tests lnorm "$1" -n 8 tests/kernels/test_linear_layer_norm.py \
    tests/kernels/test_triton_ops.py tests/kernels/test_cuda_ops.py -k "$2"
}
lnorm_bench() {  # time limit, shapes...: bench.linear_gelu --op linear_add_layer_norm
  local limit=$1; shift
  timeout "$limit" python3 -m bench.linear_gelu --op linear_add_layer_norm --shapes "$@" \
    --out "$OUT/linear-layer-norm.json" 2>&1 | tee "$OUT/linear-layer-norm.log" | grep -E "^  |M=" | tail -40
}
MINILM_ROWS=(--providers ours --cases "minilm-l6 b32 s128 fixed" "minilm-l6 b1 s16" --compile-cases --no-ffn-epilogue)
minilm_rows() {  # time limit, name: the MiniLM b32 / b1 encoder rows, ours only -> $OUT/<name>.json
  timeout "$1" python3 -m bench.encoder "${MINILM_ROWS[@]}" --out "$OUT/$2.json" 2>&1 | tee "$OUT/$2.log" | grep graphs
}
profile_b1() {  # time limit, backends...: the MiniLM b1 s16 profile
  local limit=$1; shift
  timeout "$limit" python3 -m bench.profile --preset minilm-l6 --batch 1 --seq 16 --backends "$@" \
    --out "$OUT/profile-minilm-b1.json" 2>&1 | tee "$OUT/profile-minilm-b1.log" | grep -E "us/forward"
}
serve_sweep() {  # one server, then four replicas on the GPU; texts (the server tokenizes) and token ids
  # (SERVE_CONFIGS / SERVE_PAYLOADS / SERVE_COUNTS / SERVE_MODEL / SERVE_S override: e.g. SERVE_CONFIGS="replicas=4 replicas=8")
  timeout ${SERVE_S:-540} python3 -m bench.serve --device cuda --seconds 6 --per-request 16 \
    --model "${SERVE_MODEL:-$PWD/.gpu-assets/minilm}" --payloads ${SERVE_PAYLOADS:-text ids} \
    --configs ${SERVE_CONFIGS:-replicas=1 replicas=4} --client-counts ${SERVE_COUNTS:-16 64 256} ${SERVE_EXTRA:-} \
    --out "$OUT/serve.json" 2>&1 \
    | tee "$OUT/serve.log" | grep -E "clients:|raw|sentence-trans|single|rror" | tail -24
}
case "$mode" in
  tests)
    # the CUDA extension builds here from a clean cache (and the xdist workers then load it)
    export FUSEDSERVE_CUDA_CACHE=/tmp/fusedserve-cuda-cache
    rm -rf "$FUSEDSERVE_CUDA_CACHE"
    python3 -m kernels.cuda.build 2>&1 | tee "$OUT/cuda-build.log" | tail -3
    # every shape of the sweep would otherwise be autotuned; the autotune path is exercised by the model tests.
    # Both halves need more than one 600 s device call on a cold cache: TESTS_PART=kernels or model runs one
    if [ "${TESTS_PART:-all}" != model ]; then
      FUSEDSERVE_TRITON_AUTOTUNE=0 FUSEDSERVE_TEST_MODEL_DIR=.gpu-assets/minilm \
        timeout --signal=INT --kill-after=30 ${KERNEL_TESTS_S:-420} python3 -m pytest -m gpu -q -rfs -p no:cacheprovider -n 8 tests/kernels 2>&1 \
        | tee "$OUT/gpu-tests-kernels.log" | tail -5
    fi
    if [ "${TESTS_PART:-all}" != kernels ]; then
      FUSEDSERVE_TRITON_AUTOTUNE=${AUTOTUNE_MODEL_TESTS:-1} FUSEDSERVE_TEST_MODEL_DIR=.gpu-assets/minilm \
        timeout --signal=INT --kill-after=30 ${MODEL_TESTS_S:-330} python3 -m pytest -m gpu -v -s -rfs -p no:cacheprovider ${MODEL_TESTS_WORKERS:+-n $MODEL_TESTS_WORKERS} \
        tests/gpu 2>&1 | tee "$OUT/gpu-tests-model.log" | tail -12
    fi
    ;;
  sanitize)
    build_cached
    # compute-sanitizer on the CUDA kernel tests: memcheck on the accuracy/config/misaligned tests (the 4 GB
    # int64-offset cases and the compile tests are too slow under it), racecheck on every LayerNorm launch
    # config (the kernels with shared memory)
    run_sanitizer() {
      local tool=$1 limit=$2 select=$3
      FUSEDSERVE_CUDA_TUNE=0 timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 99 \
        python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_cuda_ops.py -k "$select" \
        > "$OUT/sanitizer-$tool.log" 2>&1
      echo "compute-sanitizer $tool exit $?" | tee -a "$OUT/sanitizer-$tool.log"
      grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer-$tool.log" | tail -3
    }
    run_sanitizer memcheck "${MEMCHECK_S:-240}" "not offsets and not opcheck and not auto_mode and not tuner"
    run_sanitizer racecheck "${RACECHECK_S:-120}" "every_norm_launch_config or misaligned"
    ;;
  bench)
    shift
    timeout 560 python3 -m bench.kernels --providers triton cuda eager compile --out "$OUT/kernels.json" \
      --markdown "$OUT/kernels.md" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^\[' 
    ;;
  ncu)
    # Nsight Compute on the LayerNorm kernels at the shape the targets are argued on
    build_cached
    for provider in triton cuda; do
      for op in layer_norm_gelu add_layer_norm bias_gelu; do
        timeout 120 ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight --section MemoryWorkloadAnalysis \
          --section Occupancy --section LaunchStats python3 -m bench.ncu_kernels $provider $op bfloat16 32768x768 \
          > "$OUT/ncu-$provider-$op.txt" 2>&1
        grep -E "^  [a-z_]|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Block Size|Grid Size" \
          "$OUT/ncu-$provider-$op.txt" | head -12
      done
    done
    ;;
  check)
    # the default path's tests (graphs incl. the start-up capture, the GPU servers), then MiniLM parity; the
    # serving sweep is its own call (`serve`: with these tests it would pass a device call's 10 minutes)
    build_cached
    gpu_tests graphs 90 tests/gpu/test_graphs_gpu.py
    gpu_tests server 200 tests/gpu/test_server_gpu.py
    gpu_tests minilm 150 tests/gpu/test_minilm_gpu.py -k "float16 and not bfloat16"
    ;;
  serve)
    build_cached
    serve_sweep
    ;;
  gemm)
    # the Triton GEMM + bias + GELU epilogue: its GPU tests, then against cuBLAS + bias_gelu, eager and compile
    build_cached
    FUSEDSERVE_TRITON_AUTOTUNE=0 gpu_tests linear-gelu 240 -n 4 tests/kernels/test_linear_gelu.py
    timeout 300 python3 -m bench.linear_gelu --out "$OUT/linear-gelu.json" 2>&1 | tee "$OUT/linear-gelu.log" | tail -40
    ;;
  pool)
    build_cached
    FUSEDSERVE_TRITON_AUTOTUNE=0 gpu_tests segment-gemm 200 -n 8 tests/kernels \
      -k "segment_mean or linear_gelu or opcheck or auto_mode or pointwise"
    gpu_tests graphs-parity 320 tests/gpu/test_graphs_gpu.py tests/gpu/test_minilm_gpu.py -k "not bfloat16"
    timeout 100 python3 -m bench.linear_gelu --shapes "bert-base b32 s128" "minilm-l6 b32 s128" "minilm-l6 b1 s16" \
      --out "$OUT/linear-gelu-tma.json" 2>&1 | tee "$OUT/linear-gelu-tma.log" | tail -12
    minilm_rows 120 encoder-minilm
    profile_b1 60 cuda triton
    ;;
  lnorm)
    build_cached
    lnorm_tests 150 "linear_layer_norm or linear_add_layer_norm or opcheck"
    gpu_tests graphs-parity 200 tests/gpu/test_graphs_gpu.py tests/gpu/test_minilm_gpu.py \
      -k "(float16 and not bfloat16) or selection_change"
    lnorm_bench 120 "minilm-l6 attn-out b1 s16" "minilm-l6 ffn-out b1 s16" "minilm-l6 ffn-out 128 tokens" \
      "minilm-l6 ffn-out 512 tokens" "bert-base ffn-out b1 s16"
    minilm_rows 100 encoder-minilm
    profile_b1 60 cuda triton
    ;;
  final)
    build_cached
    lnorm_tests 120 "linear_layer_norm or linear_add_layer_norm"
    lnorm_bench 90 "minilm-l6 attn-out b1 s16" "minilm-l6 ffn-out b1 s16" "minilm-l6 ffn-out 64 tokens" \
      "bert-base ffn-out b1 s16"
    # the split kernel on below 128 rows (its default since session 7 is off), then the default
    timeout 80 python3 -c "import runpy, sys; import kernels.triton.linear_layer_norm as m; m.SMALL_ROWS = 128; \
      sys.argv = ['bench.encoder', *sys.argv[1:]]; runpy.run_module('bench.encoder', run_name='__main__')" \
      "${MINILM_ROWS[@]}" --out "$OUT/encoder-minilm-split-on.json" 2>&1 | tee "$OUT/encoder-minilm-split-on.log" | grep graphs
    minilm_rows 80 encoder-minilm
    profile_b1 40 triton
    gpu_tests parity 100 tests/gpu/test_minilm_gpu.py tests/gpu/test_graphs_gpu.py \
      -k "float16 and not bfloat16 and (triton or equal_eager_packed_and_padded)"
    SERVE_S=150 SERVE_PAYLOADS=ids SERVE_CONFIGS=replicas=1 SERVE_COUNTS=16 serve_sweep
    ;;
  sdpa)
    for b in default FLASH_ATTENTION EFFICIENT_ATTENTION; do
      timeout 60 python3 -c "import contextlib, runpy, sys; from torch.nn.attention import SDPBackend, sdpa_kernel; \
        b = sys.argv[1]; sys.argv = ['bench.encoder', *sys.argv[2:]]; \
        (contextlib.nullcontext() if b == 'default' else sdpa_kernel([getattr(SDPBackend, b)])).__enter__(); \
        runpy.run_module('bench.encoder', run_name='__main__')" $b "${MINILM_ROWS[@]}" --backends triton \
        --out "$OUT/encoder-sdpa-$b.json" 2>&1 | grep -E "triton packed graphs |rror" | sed "s/^/$b /"
    done
    # last, and with room: on a cold Triton cache the server's self-tests alone took 86 s (session 7), and a timeout
    # that kills bench.serve mid-start leaves the server shutting down beside the next step
    timeout 240 python3 -m bench.serve --device cuda --single-only --timing-rate 0 --model "$PWD/.gpu-assets/minilm" \
      --configs replicas=1,backend=triton --out "$OUT/serve-single.json" 2>&1 | tee "$OUT/serve-single.log" | tail -3
    ;;
  small)
    build_cached > "$OUT/cuda-build.log" 2>&1 &  # beside the kernel-level rows (device times of graph replays)
    for spec in add_layer_norm:float16:16x384 add_layer_norm:float16:64x384 add_layer_norm:float16:16x768 \
        layer_norm:float16:16x384; do
      timeout 60 python3 -m bench.triton_configs $spec 2>&1 | tee -a "$OUT/triton-configs.log" | tail -14
    done
    wait
    export FUSEDSERVE_CUDA_CACHE=/tmp/fusedserve-cuda-cache
    lnorm_bench 100 "minilm-l6 attn-out b1 s16" "minilm-l6 ffn-out b1 s16" "minilm-l6 ffn-out 64 tokens" \
      "bert-base ffn-out b1 s16"
    timeout 150 python3 -m bench.serve --device cuda --single-only --timing-rate 0 --model "$PWD/.gpu-assets/minilm" \
      --out "$OUT/serve-single.json" 2>&1 | tee "$OUT/serve-single.log" | tail -3
    ;;
  serial)
    # where a lone request's forward goes (host packing, copies, replay, wait vs the replay alone, with idle gaps),
    # the SM clock sampled beside it; then one server's single-request latency (no MPS, kernel timing off)
    build_cached
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 50 > "$OUT/serial-clocks.csv" &
    smi=$!
    timeout 200 python3 -m bench.serial_forward --model "$PWD/.gpu-assets/minilm" --out "$OUT/serial-forward.json" \
      2>&1 | tee "$OUT/serial-forward.log" | grep -E "bucket|serial"
    kill $smi
    timeout 240 python3 -m bench.serve --device cuda --single-only --timing-rate 0 --model "$PWD/.gpu-assets/minilm" \
      --out "$OUT/serve-single.json" 2>&1 | tee "$OUT/serve-single.log" | tail -3
    ;;
  idle)
    # serial: the lone request's forward slows after idle gaps on the host side; which step, asleep vs spinning,
    # and with the cores held out of deep idle states (PM QoS /dev/cpu_dma_latency = 0), then the server's
    # single-request latency with that hold
    build_cached
    { cat /sys/devices/system/cpu/cpuidle/current_driver /sys/devices/system/cpu/cpuidle/current_governor*
      grep . /sys/devices/system/cpu/cpu0/cpuidle/state*/{name,latency} ; lscpu | grep -iE "model name|mhz"
    } > "$OUT/cpuidle.txt" 2>&1
    for qos in none 0; do
      timeout 150 python3 -m bench.serial_forward --model "$PWD/.gpu-assets/minilm" --spin --steps --gaps 0 1 5 \
        $([ $qos = none ] || echo --cpu-dma-latency-us $qos) --out "$OUT/serial-forward-qos-$qos.json" 2>&1 \
        | tee "$OUT/serial-forward-qos-$qos.log" | grep -E "bucket|serial|steps|cpu_dma"
    done
    python3 -c "import sys, time; f = open('/dev/cpu_dma_latency', 'wb', buffering=0); f.write(bytes(4)); \
      print('holding /dev/cpu_dma_latency = 0', flush=True); time.sleep(600)" &
    holder=$!
    timeout 200 python3 -m bench.serve --device cuda --single-only --timing-rate 0 --model "$PWD/.gpu-assets/minilm" \
      --out "$OUT/serve-single-qos.json" 2>&1 | tee "$OUT/serve-single-qos.log" | tail -3
    kill $holder
    ;;
  poll)
    # one server's single-request latency with the worker polling between requests (idle_poll_ms) and without,
    # alternated (the first start also fills the Triton cache the others start from)
    build_cached
    for poll in 100 0 100 0; do
      timeout 200 python3 -m bench.serve --device cuda --single-only --timing-rate 0 --model "$PWD/.gpu-assets/minilm" \
        --configs replicas=1,idle_poll_ms=$poll --out "$OUT/serve-single-poll$poll-$SECONDS.json" 2>&1 | tail -2 \
        | sed "s/^/idle_poll_ms=$poll: /"
    done
    ;;
  next)
    # the next session's first call (~8 min cold): attention=fused on the GPU (kernels.qkv_attention, and for at most
    # 64 tokens the four-kernel layer: attention_partials, ffn_partials, partial_add_layer_norm): its tests (model
    # shapes fp16/bf16, graph replays, the sweeps, MiniLM through graphs), the MiniLM rows with a fused-attn graphs
    # row next to varlen and pad, the b1 s16 profile with it; then every few-row GEMM + GELU config forced vs the
    # autotuner's pick (the s8 b1 profile's 12.6 us pick where 4.4 was available)
    gpu_tests fused 200 -n 4 tests/kernels/test_qkv_attention.py tests/kernels/test_triton_ops.py \
      tests/gpu/test_graphs_gpu.py -k "qkv or partial or opcheck or fused or few_token"
    timeout 200 python3 -m bench.encoder "${MINILM_ROWS[@]}" --backends triton --out "$OUT/encoder-minilm.json" 2>&1 \
      | tee "$OUT/encoder-minilm.log" | grep graphs
    timeout 60 python3 -m bench.profile --preset minilm-l6 --batch 1 --seq 16 --backends triton --attention fused \
      --out "$OUT/profile-minilm-b1-fused.json" 2>&1 | tee "$OUT/profile-minilm-b1-fused.log" | grep -E "us/forward"
    for spec in linear_bias_gelu:float16:16x384x1536 linear_bias_gelu:float16:64x384x1536 \
        linear_bias_gelu:float16:16x768x3072; do
      timeout 60 python3 -m bench.triton_configs $spec 2>&1 | tee -a "$OUT/triton-configs.log" | tail -10
    done
    ;;
  next5)
    # after session 11 (whose runs of this mode, with shorter limits, are in bench/results/2026-12-01-h200-s11/):
    # the model-level fused tests (MiniLM through fused graphs vs padded, graph replays; a cold Triton cache compiles
    # and tunes the unrolled kernels first) and the MiniLM rows with fused-attn beside varlen: if b1 s16 confirms the
    # profile (158 vs 210 us), auto takes fused for buckets of <= 64 tokens
    # and programmatic dependent launch (FUSEDSERVE_TRITON_PDL, session 12): bitwise the same results (GPU test), the
    # MiniLM graphs rows and the b1 profile again with it
    gpu_tests fused-model 240 -n 4 tests/kernels/test_qkv_attention.py tests/gpu/test_graphs_gpu.py \
      -k "qkv or partial or fused or few_token or programmatic"
    timeout 200 python3 -m bench.encoder "${MINILM_ROWS[@]}" --backends triton --without-pdl --out "$OUT/encoder-minilm.json" \
      2>&1 | tee "$OUT/encoder-minilm.log" | grep graphs
    # 24 FFN partial sums (64-column chunks) against 12 (128): the partial-sum norm reads half as much
    timeout 120 python3 -m bench.profile --preset minilm-l6 --batch 1 --seq 16 --backends triton --attention fused \
      --ffn-chunks 64 128 --without-pdl --out "$OUT/profile-minilm-b1-fused-chunks.json" 2>&1 \
      | tee "$OUT/profile-minilm-b1-fused-chunks.log" | grep -E "us/forward"
    ;;
  next6)
    # session 13's defaults (auto attention: the few-token layer for <= 64 tokens, varlen above; programmatic
    # dependent launch on): the server on them (start-up report, warm-up captures, verifier), MiniLM parity, the
    # graphs' auto fallback to varlen with backend=cuda and auto following the fused switch, the PDL test (~8 min cold;
    # session 13 ran it with a 300 s limit and the MiniLM rows after: 7 of the tests ended, one failed unseen)
    build_cached
    gpu_tests defaults ${DEFAULTS_TESTS_S:-500} -n 3 tests/gpu/test_server_gpu.py tests/gpu/test_minilm_gpu.py \
      tests/gpu/test_graphs_gpu.py \
      -k "server or matches_sentence or capture_all or programmatic or follows_the_fused_switch"
    ;;
  next7)
    # the MiniLM acceptance rows on session 13's defaults with HF eager / sdpa / torch.compile / compile + CUDA
    # graphs in the same run, and the Triton rows without PDL beside them (~5 min cold)
    timeout 420 python3 -m bench.encoder --cases "minilm-l6 b32 s128 fixed" "minilm-l6 b1 s16" \
      --compile-cases "minilm-l6 b32 s128 fixed" "minilm-l6 b1 s16" --backends triton --no-ffn-epilogue \
      --without-pdl --out "$OUT/encoder-minilm-compile.json" 2>&1 | tee "$OUT/encoder-minilm-compile.log" | grep " ms "
    ;;
  next4)
    # one server's single-request latency with the default attention (varlen), then with attention=fused (the
    # four-kernel layer serves every bucket of at most 64 tokens), kernel timing off, no MPS (~6 min cold)
    for config in replicas=1 replicas=1,attention=fused; do
      timeout 250 python3 -m bench.serve --device cuda --single-only --timing-rate 0 --configs $config \
        --model "$PWD/.gpu-assets/minilm" --out "$OUT/serve-single-${config//[=,]/-}.json" 2>&1 \
        | tee "$OUT/serve-single-${config//[=,]/-}.log" | tail -3
    done
    ;;
  next2)
    # six MPS replicas again: do their kernel choices agree now that the race takes each backend's best round; does
    # the 99% row hold (~8 min)
    SERVE_CONFIGS="replicas=6" SERVE_S=420 bash "$0" mps
    ;;
  next3)
    # the BERT-base rows with torch.compile + CUDA graphs in the same run, the b128 varlen row included (issue #6's
    # acceptance compares every row with it; session 6 ran it for the fixed rows only), and the fused-attn rows
    # first, 20 s: what the varlen graphs' fixed max_seqlen (512 for BERT-base at 9216 tokens) costs the attention
    # against the batch's own longest row (eager varlen beat the graph replay at b128 by 4% in session 6)
    timeout 40 python3 -m bench.varlen_grid --out "$OUT/varlen-grid.json" 2>&1 | tee "$OUT/varlen-grid.log"
    timeout 540 python3 -m bench.encoder --cases "bert-base b32 s128 fixed" "bert-base b128 s128 varlen" \
      --compile-cases "bert-base b32 s128 fixed" "bert-base b128 s128 varlen" --no-ffn-epilogue \
      --out "$OUT/encoder-bert.json" 2>&1 | tee "$OUT/encoder-bert.log" | grep -E "ms "
    ;;
  lnrows)
    # the MiniLM rows without the few-row LayerNorm candidates (session 7's), then with them (the default), Triton
    # backend only, with room for a cold Triton cache (70 / 90 s limits cut both in session 8)
    timeout 200 python3 -c "import runpy, sys; import kernels.triton._norm as m; m.SMALL_ROWS = 0; \
      sys.argv = ['bench.encoder', *sys.argv[1:]]; runpy.run_module('bench.encoder', run_name='__main__')" \
      "${MINILM_ROWS[@]}" --backends triton --out "$OUT/encoder-minilm-before.json" 2>&1 \
      | tee "$OUT/encoder-minilm-before.log" | grep graphs
    timeout 150 python3 -m bench.encoder "${MINILM_ROWS[@]}" --backends triton --out "$OUT/encoder-minilm.json" 2>&1 \
      | tee "$OUT/encoder-minilm.log" | grep graphs
    profile_b1 60 triton
    ;;
  mps)
    # four replicas sharing the GPU through CUDA MPS (what the NVIDIA device plugin's MPS sharing gives pods) instead
    # of time-slicing between their contexts; the daemon is per-user, in /tmp, and quits at the end
    if ! command -v nvidia-cuda-mps-control > /dev/null; then echo "no nvidia-cuda-mps-control on this image"; exit 0; fi
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && echo "MPS daemon started"
    build_cached
    SERVE_S=${SERVE_S:-330} SERVE_PAYLOADS=ids SERVE_CONFIGS="${SERVE_CONFIGS:-replicas=4}" SERVE_COUNTS=64 \
      SERVE_EXTRA=--no-sentence-transformers serve_sweep
    echo quit | nvidia-cuda-mps-control
    cp -r "$CUDA_MPS_LOG_DIRECTORY" "$OUT/mps-log" 2>/dev/null
    ;;
  replicas)
    build_cached
    # one server first (it also fills the Triton cache the eight then start from), 64 clients each
    SERVE_S=${SERVE_S:-520} SERVE_PAYLOADS=ids SERVE_CONFIGS="${SERVE_CONFIGS:-replicas=1 replicas=8}" SERVE_COUNTS=64 \
      SERVE_EXTRA=--no-sentence-transformers serve_sweep
    ;;
  encoder)
    build_cached
    timeout ${ENCODER_S:-330} python3 -m bench.encoder --out "$OUT/encoder.json" \
      --compile-cases "bert-base b32 s128 fixed" "minilm-l6 b32 s128 fixed" "minilm-l6 b1 s16" 2>&1 | tee "$OUT/encoder.log" | tail -16
    timeout 60 python3 -m bench.profile --preset minilm-l6 --backends cuda --out "$OUT/profile-minilm.json" 2>&1 \
      | tee "$OUT/profile-minilm.log" | grep -E "us/forward"
    timeout 100 python3 -m bench.profile --backends cuda triton --out "$OUT/profile-bert.json" 2>&1 \
      | tee "$OUT/profile-bert.log" | grep -E "us/forward"
    ;;
esac
# the device tool brings back at most 8 files: past that, everything goes back as one archive (session 7 lost a
# serving JSON and a profile that way)
if [ "$(ls -A "$OUT" | wc -l)" -gt 8 ]; then
  # (the archive is written outside $OUT: tar reading a folder it writes into fails with "file changed as we read it")
  tar czf "/tmp/results-$mode.tar.gz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "/tmp/results-$mode.tar.gz" "$OUT/"
  echo "results bundled: $OUT/results-$mode.tar.gz"
fi
