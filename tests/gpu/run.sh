#!/usr/bin/env bash
# GPU checks, on a machine with a CUDA GPU and torch (>= 2.11) installed: the gpu-marked tests,
# then the GPU benchmark. Nothing is installed: the repository is put on PYTHONPATH.
#   bash tests/gpu/run.sh          (about a minute on one GPU)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
# How this machine's MPI reaches the GPU (CUDA-aware: direct; otherwise staged), if it has one.
timeout 60 python3 -c "
import mcrdl
try:
    comm = mcrdl.init(backends=['mpi'])
except Exception as exc:
    print('mpi: not up here:', exc)
else:
    mpi = comm.runtime.backend('mpi')
    print('mpi: memory kinds', mpi.memory_kinds, 'MPIX_Query_cuda_support', mpi.cuda_support,
          'devices', sorted(mpi.capabilities.devices), 'staged', sorted(mpi.capabilities.staged),
          'direct', sorted(mpi.capabilities.direct))
    mcrdl.finalize()
"
timeout 300 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -x; status=$?
timeout 180 python3 benchmarks/gpu_lanes.py || status=1
exit $status
