# Set up a GPU machine for this repository's GPU tests and benchmarks. Source it from the
# repository root, so that the variables it exports stay set:
#
#   source scripts/gpu-setup.sh                      # FlashInfer from the package index
#   source scripts/gpu-setup.sh --find-links DIR     # FlashInfer's wheels from a folder (no network)
#   source scripts/gpu-setup.sh --no-install         # only find CUDA and set the variables
#
# It finds the CUDA toolkit FlashInfer's JIT compiles with (CUDA_HOME, else nvcc on PATH, else the
# folders of SSU_CUDA_SEARCH, default /usr/local/cuda /usr/local/cuda-*), sets FlashInfer's target architecture to this GPU's
# compute capability, installs flashinfer-python (SSU_FLASHINFER_VERSION, default 0.7.4) and every
# distribution of this repository (editable, --no-deps: torch and Triton stay as the machine has
# them), then prints what it found. It changes nothing else; a step that fails says why and how
# to fix it, and the sourcing shell keeps running.

_ssu_gpu_setup() {
  local install=1 links=() version=${SSU_FLASHINFER_VERSION:-0.7.4} arg
  while (($#)); do
    arg=$1
    shift
    case $arg in
      --no-install) install=0 ;;
      --find-links)
        [ $# -gt 0 ] || { echo "gpu-setup: --find-links needs a folder" >&2; return 2; }
        links=(--no-index --find-links "$1")
        shift
        ;;
      -h | --help) sed -n '1,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; return 0 ;;
      *) echo "gpu-setup: unknown option $arg (see --help)" >&2; return 2 ;;
    esac
  done
  if [ ! -f pyproject.toml ] || [ ! -d backends ]; then
    echo "gpu-setup: run it from the repository root (source scripts/gpu-setup.sh)" >&2
    return 2
  fi
  local python=${PYTHON:-python3}

  # the CUDA toolkit: FlashInfer JIT-compiles its modules with nvcc and the toolkit's headers
  if [ -z "${CUDA_HOME:-}" ] || [ ! -f "$CUDA_HOME/include/cuda_runtime.h" ]; then
    local candidate found=""
    local nvcc
    nvcc=$(command -v nvcc 2>/dev/null || true)
    # shellcheck disable=SC2086  # the folders are split and their globs expanded on purpose
    for candidate in ${nvcc:+"$(dirname "$(dirname "$nvcc")")"} ${SSU_CUDA_SEARCH:-/usr/local/cuda /usr/local/cuda-*}; do
      if [ -f "$candidate/include/cuda_runtime.h" ] && [ -x "$candidate/bin/nvcc" ]; then
        found=$candidate
        break
      fi
    done
    if [ -n "$found" ]; then
      export CUDA_HOME=$found
    else
      echo "gpu-setup: no CUDA toolkit found (nvcc and include/cuda_runtime.h): the flashinfer backends" \
        "cannot compile; install the CUDA toolkit matching torch's CUDA and set CUDA_HOME" >&2
    fi
  fi
  [ -n "${CUDA_HOME:-}" ] && case ":$PATH:" in *":$CUDA_HOME/bin:"*) ;; *) export PATH=$CUDA_HOME/bin:$PATH ;; esac

  # FlashInfer compiles for this GPU only (one architecture: minutes less per module)
  if [ -z "${FLASHINFER_CUDA_ARCH_LIST:-}" ]; then
    local arch
    arch=$("$python" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)
    if [ -n "$arch" ]; then
      export FLASHINFER_CUDA_ARCH_LIST=$arch
    else
      echo "gpu-setup: torch sees no CUDA device here; FLASHINFER_CUDA_ARCH_LIST left unset" >&2
    fi
  fi
  export MAX_JOBS=${MAX_JOBS:-$(nproc 2>/dev/null || echo 4)} PYTHONUNBUFFERED=1

  if ((install)); then
    local dists=(-e .) d
    for d in backends/*/; do [ -f "$d/pyproject.toml" ] && dists+=(-e "$d"); done
    if ! "$python" -m pip install -q "${links[@]}" "flashinfer-python==$version"; then
      echo "gpu-setup: could not install flashinfer-python==$version; without network, download its wheels" \
        "(and apache-tvm-ffi's) elsewhere and pass --find-links FOLDER" >&2
    fi
    if ! "$python" -m pip install -q --no-deps --no-build-isolation "${dists[@]}"; then
      echo "gpu-setup: installing this repository's distributions failed (see pip's message above)" >&2
    fi
  fi

  local fi_version
  fi_version=$("$python" -c 'import importlib.metadata as m; print(m.version("flashinfer-python"))' 2>/dev/null ||
    echo "not installed")
  echo "gpu-setup: CUDA_HOME=${CUDA_HOME:-unset} FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-unset}" \
    "flashinfer-python $fi_version"
}
_ssu_gpu_setup "$@"
_ssu_gpu_setup_status=$?
unset -f _ssu_gpu_setup
# shellcheck disable=SC2317  # return when sourced, exit when run
return $_ssu_gpu_setup_status 2>/dev/null || exit $_ssu_gpu_setup_status
