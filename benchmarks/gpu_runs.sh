#!/usr/bin/env bash
# The GPU runs behind the docs' figures and GPU test results, from the repository root on the GPU
# machine, logs under $OUT:
#   source scripts/gpu-setup.sh; bash benchmarks/gpu_runs.sh STAGE [STAGE...]
# Stages: replayssm-build (ReplaySSM modules, in the background: minutes each; replayssm-prebuild
# the same, waiting for them), prebuild (SSU modules the tests use), tests-triton, tests-flashinfer,
# tests-replayssm, tests-hf, verify-triton, verify-flashinfer, tests-replay, verify-replay,
# tests-lanes (builds the compiled lanes; lanes and the drop-in on the GPU), overhead, bench, bench-t4, bench-replay,
# bench-replay-t4, probe, probe-fold, probe-t4, hf, hf-overhead, hf-in-situ (the in-situ SSU calls
# and ssu compare alone), bench-all (the four GPU backends in one run), bench-8bit (triton's 8-bit
# states against bf16, one run), bench-8bit-all (int8 and bf16 states, the four GPU backends, one
# run), tests-engine-calls (both forms on the triton and flashinfer backends), bench-packed (vLLM's
# packed call, T = 4, triton and flashinfer, one run), bench-verify (SGLang's verify call, T = 4,
# one run; both build FlashInfer's modules of their call form first, in parallel), bench-engines (ssu
# bench --engine vllm, then sglang: the engines' own kernels, loaded from the folder scripts/engine-kernels
# writes, beside every GPU backend on the engines' calls; BENCH_ENGINES picks one), probe-packed (the
# engine calls' launch shapes on triton, PACKED_SHAPES of block_p:num_warps, PROBE_CALLS of packed, verify), engine-shapes
# (benchmarks/engine_shapes.py: the triton backend's launch shapes beside the engines' own kernels at batches 1 to 8,
# ENGINE_DECODE and ENGINE_CALLS the shapes), background and collect (below).
# Filters are line-buffered, so a stage cut off by its timeout keeps what it printed.
# SSU_TRITON_TUNING_CACHE, when set, is where both Triton backends keep their tuned plans.
# A run longer than one command: BG_STAGES="replayssm-prebuild bench-all" BENCH_TIMEOUT=1500 with the
# stage background, then, as the next commands on the warm machine, the stage collect until it says
# finished (bench-all takes BENCH_DTYPES, BENCH_BATCHES and BENCH_ARGS such as "--tokens 4").
set -uo pipefail
OUT=${OUT:-/tmp/ssu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
SSU_MODULES=(fp32,bf16,128,64,1,int32 bf16,bf16,128,64,1,int32 fp32,bf16,128,64,4,int32 fp32,bf16,128,80,1,int32
  bf16,bf16,256,64,1,int32 fp16,bf16,128,64,1,int32,sr fp32,bf16,128,32,1,int32 fp32,bf16,128,96,1,int32
  fp32,bf16,128,128,1,int32 fp32,bf16,32,64,1,int32 fp32,bf16,96,64,1,int32 fp32,fp32,128,64,1,int32
  bf16,bf16,128,64,4,int32)
REPLAYSSM_MODULES=(replayssm:fp32,1,15 replayssm:bf16,1,15)
# FlashInfer's modules of the engine call forms ($1: packed, verify or packed,verify) at the bench's
# shape, fp32 and bf16 states, built in parallel
call_modules() { python3 benchmarks/flashinfer_prebuild.py fp32,bf16,128,64,4,int32,"$1" bf16,bf16,128,64,4,int32,"$1" | tail -1; }
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    replayssm-build)
      setsid nohup python3 benchmarks/flashinfer_prebuild.py "${REPLAYSSM_MODULES[@]}" \
        >"$OUT/replayssm-build.log" 2>&1 < /dev/null & ;;
    replayssm-prebuild) python3 benchmarks/flashinfer_prebuild.py "${REPLAYSSM_MODULES[@]}" 2>&1 \
      | tee "$OUT/replayssm-build.log" ;;
    prebuild) python3 benchmarks/flashinfer_prebuild.py "${SSU_MODULES[@]}" 2>&1 | tee "$OUT/prebuild.log" ;;
    tests-triton) timeout 580 python3 -m pytest -q -m gpu -p no:cacheprovider backends/triton_ssu/tests/test_triton_gpu.py 2>&1 \
      | tee "$OUT/gpu-tests-triton.log" | tail -25 ;;
    tests-flashinfer) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider backends/flashinfer_ssu 2>&1 \
      | tee "$OUT/gpu-tests-flashinfer.log" | tail -25 ;;
    tests-replayssm) timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider backends/flashinfer_replayssm \
      -k "not fp32-4 and not bf16-4 and not hand_off" 2>&1 | tee "$OUT/gpu-tests-replayssm.log" | tail -25 ;;
    tests-hf) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_transformers_gpu.py tests/test_bench_gpu.py tests/test_devices.py \
      tests/test_state_safety.py tests/test_validation.py tests/test_engine_state.py 2>&1 \
      | tee "$OUT/gpu-tests-hf.log" | tail -25 ;;
    tests-replay) timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -s backends/triton_ssu/tests/test_replay_gpu.py \
      2>&1 | grep --line-buffered -v '^\[ssu' | tee "$OUT/gpu-tests-replay.log" | tail -40 ;;
    verify-replay) timeout 560 python3 -m ssu verify --backend triton-replay --device cuda --profile quick 2>&1 \
      | grep --line-buffered -v '^\[ssu' | tee "$OUT/verify-replay.log" | tail -40 ;;
    bench-replay) timeout 560 python3 -m ssu bench --state-dtype fp32,bf16 --batches "${BENCH_BATCHES:-1,8,32,128,256,512,1024}" \
      --backends "${BENCH_BACKENDS:-triton,triton-replay}" --out "$OUT/bench-replay" 2>&1 | grep --line-buffered -v '^\[ssu' \
      | tee "$OUT/bench-replay.log" | tail -70 ;;
    bench-replay-t4) timeout 560 python3 -m ssu bench --state-dtype fp32,bf16 --tokens 4 --batches "${BENCH_BATCHES:-1,8,32,128,512}" \
      --backends "${BENCH_BACKENDS:-triton,triton-replay}" ${BENCH_ARGS:-} --out "$OUT/bench-replay-t4" 2>&1 | grep --line-buffered -v '^\[ssu' \
      | tee "$OUT/bench-replay-t4.log" | tail -40 ;;
    probe) timeout 300 python3 benchmarks/replay_probe.py --state-dtype fp32,bf16 --batches 1024 \
      --plans 8:1:8:4,8:1:8:4:4,8:1:8:4:16 --regimes ring,mixed,flush 2>&1 | tee "$OUT/probe.log" ;;
    probe-fold) F=16:4:0:1,16:4:0:0,16:4:3:1,64:4:0:1,64:8:0:1,32:4:2:1,16:1:2:1
      { timeout 260 python3 benchmarks/replay_probe.py --state-dtype fp32 --batches 1024 --plans 8:1:8:4:16,8:1:8:4:4 \
          --regimes mixed --fold-shapes $F
        timeout 150 python3 benchmarks/replay_probe.py --state-dtype fp32 --batches 128 \
          --plans 8:1:8:4,8:1:8:4:4,8:1:8:4:1 --regimes mixed --fold-shapes $F
        timeout 100 python3 benchmarks/replay_probe.py --tokens 4 --state-dtype fp32 --batches 32 \
          --plans 8:1:8:4:1,8:1:8:4:4 --regimes mixed --fold-shapes 16:4:0:1,16:4:0:0,64:4:0:1,32:4:2:1
      } 2>&1 | tee "$OUT/probe-fold.log" ;;
    probe-t4) timeout 300 python3 benchmarks/replay_probe.py --tokens 4 --state-dtype fp32 --batches 32,128 \
      --plans 8:1:8:4,8:1:8:4:4,16:1:4:4 --regimes ring,mixed,write 2>&1 | tee "$OUT/probe-t4.log" ;;
    verify-triton) timeout 420 python3 -m ssu verify --backend triton --device cuda --profile default 2>&1 \
      | grep --line-buffered -v '^\[ssu' | tee "$OUT/verify-triton.log" | tail -40 ;;
    verify-flashinfer) timeout 400 python3 -m ssu verify --backend flashinfer --device cuda --profile smoke 2>&1 \
      | grep --line-buffered -v '^\[ssu' | tee "$OUT/verify-flashinfer.log" | tail -40 ;;
    overhead) python3 benchmarks/dispatch_overhead.py --calls 20000 --device cuda 2>&1 | tee "$OUT/overhead.log" ;;
    bench) timeout 500 python3 -m ssu bench --state-dtype fp32,bf16 --batches 1,8,32,128,256,512,1024 \
      --backends triton,flashinfer,flashinfer-replayssm --adopt --out "$OUT/bench" 2>&1 | grep --line-buffered -v '^\[ssu' \
      | tee "$OUT/bench.log" | tail -70 ;;
    bench-t4) timeout 400 python3 -m ssu bench --state-dtype fp32,bf16 --tokens 4 --batches 1,8,32,128,512 \
      --backends triton,flashinfer --out "$OUT/bench-t4" 2>&1 | grep --line-buffered -v '^\[ssu' | tee "$OUT/bench-t4.log" | tail -30 ;;
    hf) timeout 400 python3 benchmarks/hf_decode.py --arch nemotron_h --preset nemotron-h-8b --layers 4 --dtype bf16 \
      --batches 1,8,32,128 --backend triton --compile 2>&1 | grep --line-buffered -v 'falling back' | tee "$OUT/hf.log" ;;
    bench-all) timeout "${BENCH_TIMEOUT:-580}" python3 -m ssu bench --state-dtype "${BENCH_DTYPES:-fp32,bf16}" --batches "${BENCH_BATCHES:-1,8,32,128,512,1024}" \
      --backends triton,triton-replay,flashinfer,flashinfer-replayssm ${BENCH_ARGS:-} --out "$OUT/bench-all" 2>&1 | grep --line-buffered -v '^\[ssu' \
      | tee "$OUT/bench-all.log" | tail -70 ;;
    tests-lanes) { timeout 120 python3 -c 'import time; t = time.perf_counter(); from ssu_backend_triton import compiled_lanes as c
print("compiled lanes:", c.module() is not None, c.failure() or "", f"{time.perf_counter() - t:.1f} s")'
      timeout 100 python3 -m pytest -q -p no:cacheprovider backends/triton_ssu/tests/test_compiled_lanes.py
      timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider backends/triton_ssu/tests/test_triton_gpu.py \
      tests/test_transformers_gpu.py -k "lane or direct or dropin or (generation and triton)"; } 2>&1 \
      | tee "$OUT/gpu-tests-lanes.log" | tail -25 ;;
    hf-in-situ) { timeout 200 python3 benchmarks/hf_ssu_overhead.py --arch nemotron_h --preset nemotron-h-8b \
        --layers 4 --dtype fp32 --device cuda --backend triton --rounds 3
      timeout 150 python3 -m ssu compare --arch nemotron_h --preset nemotron-h-8b --layers 4 --device cuda \
        --backend triton; } 2>&1 | grep --line-buffered -v 'falling back' | tee "$OUT/hf-in-situ.log" ;;
    hf-overhead) { timeout 120 python3 benchmarks/hf_ssu_overhead.py --arch nemotron_h --preset nemotron-h-8b \
        --layers 4 --dtype fp32 --device cuda --backend triton --triton-dispatch 2>&1 | sed -n '/^hf_ssu/,/device time/p'
      timeout 240 python3 benchmarks/hf_ssu_overhead.py --arch nemotron_h --preset nemotron-h-8b \
        --layers 4 --dtype fp32 --device cuda --backend triton
      timeout 200 python3 -m ssu compare --arch nemotron_h --preset nemotron-h-8b --layers 4 --device cuda \
        --backend triton; } 2>&1 | grep --line-buffered -v 'falling back' | tee "$OUT/hf-overhead.log" ;;
    bench-8bit-all) timeout "${BENCH_TIMEOUT:-580}" python3 -m ssu bench --state-dtype bf16,int8 --batches "${BENCH_BATCHES:-1,8,128,512,1024}" \
      --backends triton,triton-replay,flashinfer,flashinfer-replayssm --out "$OUT/bench-8bit-all" 2>&1 \
      | grep --line-buffered -v '^\[ssu' | tee "$OUT/bench-8bit-all.log" | tail -50 ;;
    bench-8bit) timeout 560 python3 -m ssu bench --state-dtype bf16,int8,fp8_e4m3 --batches "${BENCH_BATCHES:-1,32,128,256,512,1024}" \
      --backends triton --adopt --out "$OUT/bench-8bit" 2>&1 | grep --line-buffered -v '^\[ssu' | tee "$OUT/bench-8bit.log" | tail -50 ;;
    tests-engine-calls) call_modules packed,verify
      timeout 500 python3 -m pytest -v -m gpu -p no:cacheprovider \
      backends/triton_ssu/tests/test_engine_calls_triton.py backends/flashinfer_ssu/tests/test_flashinfer_gpu.py \
      -k "engine" 2>&1 | grep --line-buffered -v '^\[ssu' | tee "$OUT/gpu-tests-engine-calls.log" | tail -25 ;;
    bench-engines) python3 benchmarks/flashinfer_prebuild.py fp32,bf16,128,64,1,int32 bf16,bf16,128,64,1,int32 \
        fp32,bf16,128,64,4,int32,packed,verify bf16,bf16,128,64,4,int32,packed,verify | tail -1
      for engine in ${BENCH_ENGINES:-vllm sglang}; do
        timeout "${BENCH_TIMEOUT:-280}" python3 -m ssu bench --engine "$engine" --engine-wheel "${ENGINE_KERNELS:-.device/engines}" \
          --state-dtype fp32,bf16 --batches "${BENCH_BATCHES:-1,8,32,128,256,512}" ${BENCH_ARGS:-} --out "$OUT/bench-engine-$engine" \
          2>&1 | grep --line-buffered -v '^\[ssu' | tee "$OUT/bench-engine-$engine.log" | tail -40
      done ;;
    bench-packed) call_modules packed
      timeout 580 python3 -m ssu bench --call packed --tokens 4 --state-dtype fp32,bf16 \
      --batches "${BENCH_BATCHES:-1,8,32,128,256,512}" --backends triton,flashinfer ${BENCH_ARGS:-} --out "$OUT/bench-packed" 2>&1 \
      | grep --line-buffered -v '^\[ssu' | tee "$OUT/bench-packed.log" | tail -40 ;;
    probe-packed) for call in ${PROBE_CALLS:-packed}; do for shape in ${PACKED_SHAPES:-4:1 8:1 8:4 16:1 16:4}; do
        printf '[ssu.backends.triton]\nblock_p = %s\nnum_warps = %s\n' "${shape%%:*}" "${shape##*:}" >/tmp/packed-shape.toml
        echo "--- $call block_p:num_warps $shape"
        timeout 120 python3 -m ssu bench --call "$call" --tokens 4 --state-dtype fp32,bf16 --config /tmp/packed-shape.toml \
          --batches "${BENCH_BATCHES:-32,128,512}" --backends triton 2>&1 | grep --line-buffered -E '^triton +(fp32|bf16)'
      done; done 2>&1 | tee "$OUT/probe-packed.log" ;;
    engine-shapes) timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/engine_shapes.py --engine-wheel "${ENGINE_KERNELS:-.device/engines}" \
        --batches "${BENCH_BATCHES:-1,2,4,8}" --decode "${ENGINE_DECODE:-4:1,8:1,16:2,4:1:1:0:1:1,8:1:1:0:0:0}" \
        --calls "${ENGINE_CALLS:-4:1:1:1,8:1:1:1,16:2:1:1,4:1:0:0,4:1:1:0}" 2>&1 | grep --line-buffered -v '^\[ssu' \
        | tee "$OUT/engine-shapes.log" ;;
    bench-verify) call_modules verify
      timeout 500 python3 -m ssu bench --call verify --tokens 4 --state-dtype fp32,bf16 \
      --batches "${BENCH_BATCHES:-1,8,32,128,256}" --backends triton,flashinfer ${BENCH_ARGS:-} --out "$OUT/bench-verify" 2>&1 \
      | grep --line-buffered -v '^\[ssu' | tee "$OUT/bench-verify.log" | tail -30 ;;
    background) # BG_STAGES detached from this command, their output under /tmp/ssu-bg: a run longer
      # than one command, on a machine kept warm by the next command (within its idle release)
      mkdir -p /tmp/ssu-bg
      OUT=/tmp/ssu-bg setsid nohup bash "$0" ${BG_STAGES:?BG_STAGES names the stages to detach} \
        >/tmp/ssu-bg/stages.log 2>&1 </dev/null &
      echo $! >/tmp/ssu-bg/pid
      echo "detached: $BG_STAGES (pid $!); collect them with the stage collect" ;;
    collect) # wait for the detached stages (at most COLLECT_S seconds, default 540), then copy what
      # they wrote to $OUT; if they still run, a later command collects again
      pid=$(cat /tmp/ssu-bg/pid 2>/dev/null) end=$((SECONDS + ${COLLECT_S:-540}))
      while [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
      if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "still running: collect again"; else echo "finished"; fi
      cp -r /tmp/ssu-bg/. "$OUT/" && rm -f "$OUT/pid"
      tail -40 /tmp/ssu-bg/stages.log ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "=== done $(date +%T)"
