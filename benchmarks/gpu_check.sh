#!/usr/bin/env bash
# The checks that need a GPU, in one run of at most 8 minutes: the CUDA helper tests, then
# benchmarks/gpu_check.py (engine exactness against transformers on CUDA in float32 and bfloat16, decode
# tok/s at batch 1, 32 and 64 against transformers at the same batch, hand-off GB/s through pinned memory
# and CUDA IPC). Needs torch with CUDA, transformers, msgspec and cryptography. Results are JSON lines on
# stdout; exit status 1 if any check failed.
#   bash benchmarks/gpu_check.sh [--model DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="shared:services:.${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python3}"  # a venv's python3 keeps its packages only when run by its own path
"$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA device")'
# --noconftest: the suite's fixtures (NATS, S3, clusters) need packages a bare GPU image lacks; these tests use none
timeout 120 "$python" -m pytest -q -p no:cacheprovider --noconftest tests/transfer/test_cuda_ipc.py
timeout 330 "$python" -m benchmarks.gpu_check "$@"
