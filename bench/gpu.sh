#!/usr/bin/env bash
# The GPU machine's suites, one per device call, each planned to end inside one 10-minute call on a cold machine:
#   tests     the CUDA extension built from a clean cache, then the GPU tests: the kernel sweeps and the model and
#             server tests side by side (logs: tests-kernels.log, tests-model.log)
#   sanitize  compute-sanitizer memcheck and racecheck over the CUDA kernel tests
#   kernels   python -m bench kernels fused-ops in all three dtypes       -> bench/results/<gpu>/kernels.json
#   gemm      python -m bench kernels gemm-epilogues gemm-fp8           -> bench/results/<gpu>/kernels.json
#   decoder   python -m bench kernels decoder-ops in fp16 and bf16 (Liger-Kernel's rows: carry its wheel in .whl)
#                                                                        -> bench/results/<gpu>/kernels.json
#   qwen-encoder  python -m bench encoder's Qwen3-Embedding-0.6B rows (ARGS: the cases, default all three), the
#                 profile of its b32 s128 forward beside MiniLM's, then its 32k-token input (ours only)
#                                                                        -> bench/results/<gpu>/encoder.json
#   qwen-peer     Infinity beside our server on a random Qwen3-Embedding-0.6B-shape directory built here
#                 (tests/model/checkpoints.py; 2.4 GB, too large to carry) -> serve.json (peer-qwen3-0.6b)
#   encoder   python -m bench encoder (the four batch shapes)  -> bench/results/<gpu>/encoder.json
#   serve     python -m bench serve closed-loop single, then workers under CUDA MPS -> bench/results/<gpu>/serve.json
#   startup   python -m bench serve startup (cold and warm time to ready, first requests) -> serve.json
#   retune    the shipped tuning re-exported for this checkout's kernel sources (a start that tunes what changed, then
#             python -m fusedserve.kernels.tuning export), then the startup suite with it -> kernels/tuning/<gpu>.json,
#             serve.json
#   peer      python -m bench serve peer (Infinity beside our server; carry .whl-infinity too) -> serve.json
#   profile   python -m bench encoder profile                  -> bench/results/<gpu>/encoder.json (scenario profile)
#   fp8       PRECISION=fp8: its GPU tests, python -m bench encoder fp8-accuracy on the packaged MiniLM, the BERT-base
#             rows beside torch.compile + CUDA graphs, the profile with the FP8 rows and the small rows -> encoder.json
#   fp8-serve PRECISION=fp8 served with the reference check on 5% of batches (python -m bench serve openai-load
#             --as openai-load-fp8), the FP8 GEMMs and the quantizing kernels' launch sweep (bench kernels gemm-fp8),
#                                                              -> serve.json, kernels.json
#   nsight    Nsight Compute on one launch per fused row-wise op and provider (python -m bench.nsight)
#                                                                        -> bench/results/<gpu>/kernels.json (nsight)
#   floor     the encoder issue's rows in one call: MiniLM b1 s16 / b32 s128 and BERT-base b32 s128 / b128 varlen
#             beside torch.compile + CUDA graphs (fp16 and FP8), the profile of the four (host and replay time, CUDA
#             runtime calls), then nsight-fp8             -> bench/results/<gpu>/encoder.json, kernels.json
#   nsight-fp8  the same for PRECISION=fp8's quantizing kernels, each after its fp16 op (python -m bench.nsight --fp8;
#             Triton only: no CUDA build)                           -> bench/results/<gpu>/kernels.json (nsight-fp8)
#   compare   before/after in one session, the older tree (.gpu-assets/baseline) against this one: serving, python -m
#             bench serve openai-load --baseline (each tree's server started 3 times, alternating; medians side by
#             side) -> serve.json (scenario openai-load); then the encoder rows as compare-encoder does, in the time
#             left. Run retune first when the kernel sources changed, or this tree's starts tune
#   devices   (two GPUs or more) python -m bench serve devices: every GPU against one GPU and half the CPUs, both
#             WORKERS=auto, MiniLM float JSON and a random MPNet-base (BERT-base-shaped) with base64, then one GPU's
#             workers killed under load                         -> serve.json (scenario devices)
#   compare-encoder  before/after encoder rows only: the encoder suite's "ours" rows of the older tree, then of this
#             one -> $OUT/encoder-baseline.json, $OUT/encoder-current.json and their table (python -m bench report
#             --compare) in $OUT/encoder-compare.md
#
# Here (the development machine), once: the pip download of docs/development.md (the server's packages the GPU
# image lacks, py-spy among them -> .whl/; the image has aiohttp, which the openai-load clients use). Before each
# call: python -m bench.gpu_assets (the fp16 MiniLM copy and this checkout's commit -> .gpu-assets/, this tree's wheel
# -> .whl/), with --baseline COMMIT for the compare suites (the tree to compare with -> .gpu-assets/baseline/). The
# device call, carrying [".whl", ".gpu-assets"]:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/gpu.sh SUITE
# The import names fusedserve.kernels, .model and .server exist only in an install of this tree (pyproject maps them
# onto the top folders): here the editable one, there the wheel in /tmp/site, which this script checks is this tree's.
# This tree's own fusedserve/ folder holds the command only, so nothing may put the tree's root ahead of /tmp/site on
# the path: PYTHONSAFEPATH keeps `python -m` from prepending the working directory, and pytest appends the root
# rather than prepending it. $OUT comes back: the suite's log and, for a benchmark suite, its updated results file
# (copy it over bench/results/<gpu>/ and commit it).
set -uo pipefail
suites="tests|sanitize|kernels|gemm|decoder|encoder|qwen-encoder|serve|startup|retune|peer|qwen-peer|devices|profile|fp8|fp8-serve|nsight|nsight-fp8|floor|compare|compare-encoder"
suite=${1:?usage: bash bench/gpu.sh $suites [ARGS: compare: openai-load options; compare-encoder: encoder ones; qwen-encoder: its cases]}
shift
extra=("$@")  # more arguments of the compare suites' harness commands (e.g. --starts 1; encoder case names)
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONSAFEPATH=1 PYTEST_ADDOPTS="--import-mode=append ${PYTEST_ADDOPTS:-}"
export FUSEDSERVE_CUDA_CACHE=/tmp/fusedserve-cuda-cache  # one CUDA build for the tests, benches and servers
export FUSEDSERVE_TEST_MODEL_DIR=.gpu-assets/minilm
export FUSEDSERVE_BENCH_SOURCE=$PWD/.gpu-assets/source.json  # the commit the results headers record
MODEL=$PWD/.gpu-assets/minilm
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv
python3 - <<'PY'
import importlib.util
need = ("fastapi", "fastapi_offline", "uvicorn", "pydantic_settings", "orjson", "httptools", "prometheus_client",
        "tokenizers")
missing = [name for name in need if importlib.util.find_spec(name) is None]
print("server packages: all present" if not missing else
      f"server packages MISSING: {' '.join(missing)} (the server fails without them, or serves slower without httptools)")
if importlib.util.find_spec("aiohttp") is None:
    print("aiohttp MISSING: the openai-load clients need it (carry its wheels: see the header)")
PY
# the wheel in /tmp/site must be this tree: one built before an edit would run the old code under the new name
python3 -m bench.gpu_assets --check-installed || exit
BASELINE=$PWD/.gpu-assets/baseline
baseline() {  # a command of the older tree's own, from its root with its packages first on the path
  (cd "$BASELINE" && PYTHONPATH=$BASELINE:$PYTHONPATH FUSEDSERVE_BENCH_SOURCE=$BASELINE/source.json "$@")
}
need_baseline() {
  [ -f "$BASELINE/fusedserve/server/__main__.py" ] && return
  echo "no older tree in $BASELINE: python -m bench.gpu_assets --baseline COMMIT (here), and carry .gpu-assets" >&2
  exit 2
}
encoder_compare() {  # the encoder suite's "ours" rows of the older tree, then of this one, each within $1 seconds
  local limit=$1
  shift
  if [ "$limit" -lt 30 ]; then
    echo "encoder rows: no time left in this call (compare-encoder runs them alone)"
    return
  fi
  # the torch providers are the same code in both trees: only our rows are timed
  baseline timeout "$limit" python3 -m bench encoder --providers ours --out "$OUT/encoder-baseline.json" "$@" 2>&1 \
    | tee "$OUT/encoder-baseline.log" | grep -v '^\['
  timeout "$limit" python3 -m bench encoder --providers ours --out "$OUT/encoder-current.json" "$@" 2>&1 \
    | tee "$OUT/encoder-current.log" | grep -v '^\['
  python3 -m bench report --no-plots --compare "$OUT/encoder-baseline.json" "$OUT/encoder-current.json" \
    | tee "$OUT/encoder-compare.md"
}

until_s() {  # seconds from now until second $1 of this call, at least 1 (`timeout 0` would mean no limit)
  local left=$(( $1 - SECONDS ))
  echo $(( left > 1 ? left : 1 ))
}
floor_profile() {  # the profile of the encoder issue's four rows within $1 seconds, appended to log $2
  timeout "$1" python3 -m bench encoder profile --profile-cases bert-base-b128-varlen bert-base-b32-s128 \
    minilm-b32-s128 minilm-b1-s16 --backends auto 2>&1 | tee -a "$2" | grep "us/forward" | cut -c1-400
}
nsight_suite() {  # ncu over python -m bench.nsight within $1 seconds (more arguments: its options, e.g. --fp8), then
  # the profile stored into kernels.json and copied to $OUT
  local limit=$1 ncu_args
  shift
  read -ra ncu_args <<< "$(python3 -m bench.nsight --ncu-args)"
  timeout "$limit" ncu "${ncu_args[@]}" python3 -m bench.nsight "$@" --calls "$OUT/calls.json" > "$OUT/ncu.csv" \
    2> "$OUT/nsight.log"
  echo "ncu: exit $?"
  grep -E "^profiled|Error|error" "$OUT/nsight.log" | tail -8
  python3 -m bench.nsight "$@" --save "$OUT/ncu.csv" --calls "$OUT/calls.json" && results kernels
}
build() {  # the CUDA extension, into the cache every process here shares
  python3 -m fusedserve.kernels.cuda.build 2>&1 | tail -1
}
results() {  # the suite's results file, as the harness updated it, into $OUT
  local path
  path=$(python3 -c "from bench.results import default_path; print(default_path('$1', 'cuda'))")
  cp "$path" "$OUT/" && echo "results: $path (copied to \$OUT)"
}
startup_suite() {  # the cold and warm start on a fresh cache directory, logs in $1, results in serve.json
  timeout "$2" python3 -m bench serve startup --model "$MODEL" --log-dir "$1" 2>&1 | tee "$1/startup.log" \
    | grep -vE "^(INFO|Loading)"
}
pytest_summary() {  # log: the pass/fail line and the failures
  grep -E "passed|failed|error" "$1" | tail -3
  grep -E "^(FAILED|ERROR)" "$1" | head -20
}

case "$suite" in
  tests)
    rm -rf "$FUSEDSERVE_CUDA_CACHE"
    python3 -m fusedserve.kernels.cuda.build 2>&1 | tail -3
    # the heuristic Triton configs throughout: autotuning every new shape in every test process costs minutes on a
    # cold machine; the autotuned path is the one the encoder and serve suites run. The kernel sweeps run
    # beside the model and server tests; at the limit pytest gets SIGINT and still prints what failed so far
    export FUSEDSERVE_TRITON_AUTOTUNE=0
    limit=${TESTS_LIMIT_S:-480}  # a shorter call: pytest is interrupted there and reports what ran
    timeout --signal=INT --kill-after=30 "$limit" \
      python3 -m pytest -m gpu -q -rfs -p no:cacheprovider -n 8 tests/kernels > "$OUT/tests-kernels.log" 2>&1 &
    kernel_tests=$!
    timeout --signal=INT --kill-after=30 "$limit" python3 -m pytest -m gpu -v -rfs --durations=15 -p no:cacheprovider \
      -n 3 tests/gpu tests/model > "$OUT/tests-model.log" 2>&1
    echo "== model and server tests: exit $?"
    pytest_summary "$OUT/tests-model.log"
    wait "$kernel_tests"
    echo "== kernel tests: exit $?"
    pytest_summary "$OUT/tests-kernels.log"
    ;;
  sanitize)
    build
    # memcheck on the accuracy, config and misaligned-view tests (the 4 GB offset cases and the compile tests are
    # too slow under it), racecheck on every LayerNorm launch config (the kernels with shared memory)
    sanitizer() {
      local tool=$1 limit=$2 select=$3
      FUSEDSERVE_CUDA_TUNE=0 timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 99 \
        python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_cuda_ops.py -k "$select" \
        > "$OUT/sanitize-$tool.log" 2>&1
      echo "compute-sanitizer $tool: exit $?" | tee -a "$OUT/sanitize-$tool.log"
      grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize-$tool.log" | tail -3
    }
    sanitizer memcheck 300 "not offsets and not opcheck and not auto_mode and not tuner"
    sanitizer racecheck 180 "every_norm_launch_config or misaligned"
    ;;
  kernels)
    build
    # all 90 cells (6 ops x 3 dtypes x 5 shapes) x 4 providers in one run, each compiled and tuned once
    timeout 560 python3 -m bench kernels fused-ops --dtypes float16 bfloat16 float32 2>&1 \
      | tee "$OUT/kernels.log" | grep -v '^\['
    results kernels
    ;;
  gemm)
    build
    timeout 300 python3 -m bench kernels gemm-epilogues gemm-fp8 2>&1 | tee "$OUT/kernels.log"
    results kernels
    ;;
  decoder)
    build
    timeout 560 python3 -m bench kernels decoder-ops --dtypes float16 bfloat16 2>&1 | tee "$OUT/kernels.log"
    results kernels
    ;;
  qwen-encoder)
    build
    # the cases named (default: all three), the GEMM-bound one first: compiling 28 layers takes minutes on a cold
    # machine; then where the forward's time goes (beside MiniLM's), then the 32k-token input (ours only)
    cases=(${extra[@]+"${extra[@]}"})
    [ ${#cases[@]} -gt 0 ] || cases=(qwen3-0.6b-b32-s128 qwen3-0.6b-b1-s16 qwen3-0.6b-b128-varlen)
    timeout 400 python3 -m bench encoder "${cases[@]}" --backends auto triton 2>&1 | tee "$OUT/encoder.log" \
      | grep -v Warning
    timeout 120 python3 -m bench encoder profile --profile-cases minilm-b32-s128 qwen3-0.6b-b32-s128 \
      --backends auto 2>&1 | tee -a "$OUT/encoder.log" | grep -v Warning
    timeout $(( 570 - SECONDS )) python3 -m bench encoder qwen3-0.6b-b1-s32768 --providers ours --backends auto \
      2>&1 | tee -a "$OUT/encoder.log" | grep -v Warning
    results encoder
    ;;
  encoder)
    build
    timeout 540 python3 -m bench encoder 2>&1 | tee "$OUT/encoder.log"
    results encoder
    ;;
  fp8)
    build
    timeout 240 python3 -m pytest -m gpu -q -rfs -p no:cacheprovider tests/kernels/test_fp8.py tests/gpu/test_fp8_gpu.py \
      > "$OUT/tests-fp8.log" 2>&1
    pytest_summary "$OUT/tests-fp8.log"
    timeout 90 python3 -m bench encoder fp8-accuracy --model "$MODEL" 2>&1 | tee "$OUT/fp8.log" | grep held-out
    timeout 150 python3 -m bench encoder bert-base-b128-varlen bert-base-b32-s128 --providers \
      "torch.compile + CUDA graphs" ours --backends auto 2>&1 | tee -a "$OUT/fp8.log" | grep -E "^  "
    floor_profile 150 "$OUT/fp8.log"
    results encoder
    ;;
  fp8-serve)
    build
    # the server first, while the call is young: 500 checked batches at 5% take about 10,000 batches
    timeout 300 python3 -m bench serve openai-load --model "$MODEL" --openai-points 64x1 64x16 --seconds 90 \
      --setting precision=fp8 --setting verify_sample_rate=0.05 --as openai-load-fp8 --log-dir "$OUT" 2>&1 \
      | tee "$OUT/fp8-serve.log" | grep -vE "^(INFO|Loading)"
    results serve
    timeout 150 python3 -m bench kernels gemm-fp8 2>&1 | tee "$OUT/gemm-fp8.log" | grep -E "default rows|layer"
    results kernels
    ;;
  nsight)
    build
    nsight_suite 400
    ;;
  floor)
    build
    timeout 240 python3 -m bench encoder minilm-b1-s16 minilm-b32-s128 bert-base-b32-s128 bert-base-b128-varlen \
      --providers "torch.compile + CUDA graphs" ours --backends auto 2>&1 | tee "$OUT/floor.log" | grep -E "^  "
    results encoder  # the rows back even if a later step runs out of the call's time
    floor_profile "$(until_s 420)" "$OUT/floor.log"
    results encoder
    [ "$(until_s 570)" -gt 60 ] && OUT=$OUT/nsight NSIGHT_LIMIT_S=$(until_s 570) bash "$0" nsight-fp8
    ;;
  nsight-fp8)
    nsight_suite "${NSIGHT_LIMIT_S:-300}" --fp8
    ;;
  profile)
    build
    timeout 540 python3 -m bench encoder profile 2>&1 | tee "$OUT/profile.log"
    results encoder
    ;;
  serve)
    build
    # one server (its first start on a fresh machine compiles and tunes the kernels the later starts find cached)
    # py-spy comes with the carried wheels (docs/development.md): a flame graph of the server during
    # the first closed-loop point
    flame=()
    if [ -x /tmp/site/bin/py-spy ]; then
      export PY_SPY=/tmp/site/bin/py-spy
      flame=(--flame-graph "$OUT/server-flame.svg")
    fi
    timeout 360 python3 -m bench serve closed-loop single --model "$MODEL" --clients 16 64 --log-dir "$OUT" \
      ${flame[@]+"${flame[@]}"} 2>&1 \
      | tee "$OUT/serve.log" | grep -vE "^(INFO|Loading)"
    # then one server with WORKERS=n sharing the GPU through CUDA MPS; the daemon is this run's own, in /tmp, and
    # quits at the end
    if command -v nvidia-cuda-mps-control > /dev/null; then
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d && echo "MPS daemon started"
    fi
    # short sentences (1-20 words, 16 a request) as text and as token ids, beside sentence-transformers on them
    timeout 300 python3 -m bench serve workers --model "$MODEL" --max-words 20 --seconds 5 --log-dir "$OUT" 2>&1 \
      | tee -a "$OUT/serve.log" | grep -vE "^(INFO|Loading)"
    if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then echo quit | nvidia-cuda-mps-control; fi
    results serve
    ;;
  startup)
    build
    # the cold start compiles and tunes into an empty cache directory of its own; the warm one reuses it
    startup_suite "$OUT" 540
    results serve
    ;;
  retune)
    build
    # after a change to the kernel sources the shipped entries measured on the changed files no longer apply: this
    # start tunes and races those into its own cache directory, and the export writes them over the shipped entries
    # that still apply (the start-up report in $OUT/untuned)
    mkdir -p "$OUT/untuned"
    startup_suite "$OUT/untuned" 300
    FUSEDSERVE_CACHE_DIR=$(ls -td /tmp/fusedserve-cache-* | head -1) python3 -m fusedserve.kernels.tuning export || exit
    path=$(python3 -c "from fusedserve.kernels import cache; print(cache.SHIPPED / f'{cache.gpu_slug()}.json')")
    cp "$path" "$OUT/" && echo "shipped tuning: $path (copied to \$OUT; commit it with the start-up below)"
    startup_suite "$OUT" 180
    results serve
    ;;
  peer)
    build
    # Infinity beside one server of ours; its wheels (bash bench/peer-wheels.sh -> .whl-infinity/, carried too) go to
    # an install folder of their own: its pins conflict with the server's packages
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/infinity-site \
      .whl-infinity/*.whl || exit
    timeout 400 python3 -m bench serve peer --model "$MODEL" --peer-batch-sizes 64 128 --log-dir "$OUT" 2>&1 \
      | tee "$OUT/peer.log" | grep -vE "^(INFO|Loading)"
    results serve
    ;;
  qwen-peer)
    build
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/infinity-site \
      .whl-infinity/*.whl || exit
    # built outside the tree's root: with the root on the path transformers' probe for Hugging Face's `kernels`
    # package would find our kernels/ folder
    repo=$PWD
    (cd /tmp && PYTHONPATH=/tmp/site python3 -c "import sys; from pathlib import Path; \
sys.path.append('$repo/tests/model'); import checkpoints; checkpoints.qwen(Path('/tmp/qwen3-0.6b'), '0.6b')") || exit
    timeout 420 python3 -m bench serve peer --model /tmp/qwen3-0.6b --peer-batch-sizes 64 --as peer-qwen3-0.6b \
      --log-dir "$OUT" 2>&1 | tee "$OUT/peer.log" | grep -vE "^(INFO|Loading)"
    results serve
    ;;
  devices)
    build
    repo=$PWD  # the checkpoint is built outside the tree's root, as qwen-peer's is
    (cd /tmp && PYTHONPATH=/tmp/site python3 -c "import sys; from pathlib import Path; \
sys.path.append('$repo/tests/model'); import checkpoints; checkpoints.mpnet(Path('/tmp/mpnet-base'), shape='base')") \
      || exit
    timeout 560 python3 -m bench serve devices --model "$MODEL" --devices-big-model /tmp/mpnet-base --log-dir "$OUT" \
      2>&1 | tee "$OUT/devices.log" | grep -vE "^(INFO|Loading)"
    results serve
    ;;
  compare)
    need_baseline
    build
    baseline python3 -m fusedserve.kernels.cuda.build 2>&1 | tail -1
    # each tree's server started 3 times, alternating; every point 2 s of warm-up and 8 s measured
    timeout 400 python3 -m bench serve openai-load --baseline "$BASELINE" --model "$MODEL" --seconds 8 \
      --warm-seconds 2 --log-dir "$OUT" ${extra[@]+"${extra[@]}"} 2>&1 | tee "$OUT/compare.log" \
      | grep -vE "^(INFO|Loading)"
    results serve
    encoder_compare $(( (570 - SECONDS) / 2 ))
    ;;
  compare-encoder)
    need_baseline
    build
    baseline python3 -m fusedserve.kernels.cuda.build 2>&1 | tail -1
    encoder_compare 270 ${extra[@]+"${extra[@]}"}
    ;;
  *)
    echo "unknown suite $suite: $suites" >&2
    exit 2
    ;;
esac
# $OUT comes back as at most 8 files: past that, everything goes back as one archive (written outside $OUT:
# tar reading a folder it writes into fails with "file changed as we read it")
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar czf "/tmp/$suite-out.tar.gz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "/tmp/$suite-out.tar.gz" "$OUT/"
  echo "bundled: \$OUT/$suite-out.tar.gz"
fi
