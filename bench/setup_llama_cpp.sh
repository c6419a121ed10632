#!/usr/bin/env bash
# Build llama-cpp-python from source into its own venv for bench/engine.py's
# llama.cpp comparison. The prebuilt wheel found on this machine segfaults on
# its first eval (an AVX-512/AMX build), so the bench builds its own: portable
# AVX2 kernels, no OpenMP. Takes ~10 minutes on 2 cores.
#   bash bench/setup_llama_cpp.sh [VENV]      (default /tmp/llamabench)
set -euo pipefail
venv=${1:-/tmp/llamabench}
python3 -m venv "$venv"
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
-DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF" \
  "$venv/bin/pip" install --no-binary llama-cpp-python --no-cache-dir llama-cpp-python
echo "now: python bench/engine.py --llama-python $venv/bin/python"
