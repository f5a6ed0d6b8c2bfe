#!/usr/bin/env bash
# The checks that need a GPU, prepared for a machine with one (issue 14). NOT RUN YET: no GPU was lent
# to the session that wrote it. At most 8 minutes: the CUDA helper tests, then benchmarks/gpu_check.py
# (engine exactness against transformers on CUDA, decode tok/s at batch 1 and 32, hand-off GB/s through
# pinned memory and CUDA IPC). Results are JSON lines on stdout; exit status 1 if any check failed.
#   bash benchmarks/gpu_check.sh [--model DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="shared:services:.${PYTHONPATH:+:$PYTHONPATH}"
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA device")'
timeout 120 python -m pytest -q -p no:cacheprovider tests/transfer/test_cuda_ipc.py
timeout 330 python -m benchmarks.gpu_check "$@"
