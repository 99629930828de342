#!/usr/bin/env bash
# GPU checks, on a machine with a CUDA GPU and torch (>= 2.11) installed: what the machine has,
# the gpu-marked tests, then the GPU benchmarks. The repository is put on PYTHONPATH. The MPI
# cases run where mpi4py finds an MPI library and mpiexec is on PATH (`pip install mpi4py
# mpich` gives both). A machine without network gets what it lacks as wheels in .whl/, made
# where pip works, e.g. for Python 3.12:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 -d .whl mpi4py mpich
# which this script installs under $TMPDIR for its own run (mpich with its mpiexec).
#   bash tests/gpu/run.sh [lanes|torch]   (lanes: about two minutes on one H200)
# Every step has its own time limit, and a failed step does not stop the next ones; the exit
# status says whether any failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" >/dev/null; then
    tmp=${TMPDIR:-/tmp}
    pip_in() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$@"; }
    others=$(ls .whl/*.whl | grep -v '/mpich-')
    if [ -n "$others" ]; then
        pip_in --upgrade --target "$tmp/mcrdl-gpu-site" $others || exit 3
        export PYTHONPATH="$tmp/mcrdl-gpu-site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if compgen -G ".whl/mpich-*.whl" >/dev/null; then
        pip_in --ignore-installed --prefix "$tmp/mcrdl-gpu-mpich" .whl/mpich-*.whl || exit 3
        export PATH="$tmp/mcrdl-gpu-mpich/bin:$PATH"
        export LD_LIBRARY_PATH="$tmp/mcrdl-gpu-mpich/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MCRDL_TIMEOUT=60
status=0
step() {
    local limit=$1
    shift
    echo "== $* (limit ${limit} s)"
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "== exit $rc after $((SECONDS - t0)) s: $*"
    [ "$rc" -eq 0 ] || status=1
}

nvidia-smi -L 2>/dev/null || true
python3 - <<'EOF'
import importlib.util, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda",
      torch.version.cuda, "available", torch.cuda.is_available(), "nccl",
      ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-")
for name in ("cupy", "mpi4py", "uvloop", "numpy", "hypothesis"):
    found = importlib.util.find_spec(name)
    version = getattr(__import__(name), "__version__", "?") if found else "not installed"
    print(f"  {name} {version}")
EOF
echo "mpiexec: $(command -v mpiexec || echo none)"
# What to run: "lanes" (mcrdl's own GPU lanes), "torch" (torch.distributed over "mcrdl" on
# CUDA), or both (no argument). One visit of a few minutes fits one part.
parts=${1:-lanes torch}
has() { [[ " $parts " == *" $1 "* ]]; }
if has lanes; then
    # How this machine's MPI reaches the GPU (CUDA-aware: direct; otherwise staged).
    step 60 python3 -c "
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
    step 300 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -ra --timeout 150 \
        --deselect tests/gpu/test_torch_cuda.py
    step 150 python3 benchmarks/gpu_lanes.py
    step 120 env MCRDL_BACKENDS=gloo,nccl python3 -m mcrdl bench --device cuda --no-progress \
        --ops allreduce,alltoall --sizes 4:64M --factor 4 --backends nccl,gloo --budget 0.03
    if command -v mpiexec >/dev/null; then
        step 150 mpiexec -n 2 python3 benchmarks/gpu_staged.py
        step 60 mpiexec -n 1 python3 benchmarks/gpu_staged.py
        step 120 env MCRDL_BACKENDS=mpi,gloo mpiexec -n 2 python3 -m mcrdl bench --device cuda \
            --no-progress --ops allreduce,alltoall --sizes 4:16M --factor 4 --budget 0.03
    fi
fi
if has torch; then
    # DDP, FSDP2 and every collective through dist.* on CUDA (a world of one with nccl, two
    # ranks sharing the GPU over staged gloo); then the speed against NCCL's own group.
    step 300 python3 -m pytest -q -m gpu tests/gpu/test_torch_cuda.py -p no:cacheprovider -ra \
        --timeout 150 -s
    step 180 env MCRDL_BACKENDS=gloo,nccl python3 benchmarks/ddp.py --device cuda --steps 20 \
        --pairs 500
    if command -v mpiexec >/dev/null; then
        # DDP's CPU step at 2 ranks, with cores to spare per rank (target: 0.7x gloo's).
        step 180 mpiexec -n 2 python3 benchmarks/ddp.py --steps 20 --pairs 500
    fi
    # torch's own distributed tests that one GPU runs, against "mcrdl" and against "nccl".
    for suite_backend in mcrdl nccl; do
        step 300 env WORLD_SIZE=1 BACKEND=$suite_backend MCRDL_BACKENDS=gloo,nccl python3 -m \
            pytest -q -m "" -p no:cacheprovider tests/torch_suite/test_torch_distributed_suite.py \
            -k "cuda or gpu or Cuda or GPU" --timeout 60
    done
fi
exit $status
