#!/usr/bin/env bash
# One device-machine session: install the repository, run the GPU tests and the benchmark,
# leave logs under $OUT. Usage (from the repository root, on the GPU machine):
#   source .device/prelude.sh; bash benchmarks/gpu_session.sh [tests|bench|all] [extra bench args...]
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/ssu-out}; mkdir -p "$OUT"
# Optional extras in .device/ (see docs/benchmarks.md, "Device notes"): FlashInfer modules built by
# an earlier machine (loaded as FlashInfer AOT modules: no 300 s rebuild), and the nv_internal
# sources FlashInfer's autotuner needs for its delay kernel (the bundle lacks them).
fi_data=$(python3 -c 'import flashinfer, os; print(os.path.join(os.path.dirname(flashinfer.__file__), "data"))')
if [[ -f .device/fi-aot.tar.xz ]]; then mkdir -p "$fi_data/aot" && tar -C "$fi_data/aot" -xJf .device/fi-aot.tar.xz; fi
if [[ -f .device/nv_internal.tar.xz ]]; then
  mkdir -p "$fi_data/csrc/nv_internal" && tar -C "$fi_data/csrc/nv_internal" -xJf .device/nv_internal.tar.xz
fi
export PYTHONUNBUFFERED=1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
if [[ $what == tests || $what == all ]]; then
  # every FlashInfer module the GPU tests use, built in parallel (ReplaySSM ones take ~300 s each)
  python3 benchmarks/flashinfer_prebuild.py fp32,bf16,128,64,1,int32 bf16,bf16,128,64,1,int32 \
    fp32,bf16,128,64,4,int32 fp32,bf16,128,80,1,int32 bf16,bf16,256,64,1,int32 fp16,bf16,128,64,1,int32,sr \
    replayssm:fp32,1,15 replayssm:bf16,1,15 replayssm:fp32,4,15 replayssm:bf16,4,15 | tee "$OUT/prebuild.log"
  timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider backends 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
fi
if [[ $what == bench || $what == all ]]; then
  timeout 400 python3 benchmarks/ssu_bench.py --out "$OUT/bench.md" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^\[ssu' | tail -60
fi
