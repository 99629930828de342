#!/usr/bin/env bash
# GPU checks, on a machine with a CUDA GPU and torch (>= 2.11) installed: the gpu-marked tests,
# then the GPU benchmark. Nothing is installed: the repository is put on PYTHONPATH.
#   bash tests/gpu/run.sh          (about a minute on one GPU)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
timeout 300 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -x; status=$?
timeout 180 python3 benchmarks/gpu_lanes.py || status=1
exit $status
