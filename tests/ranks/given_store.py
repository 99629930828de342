"""A job whose ranks are brought up from a store they are given, as under torch's own test
harness: a file store, which lives in no process. mcrdl then serves its store in rank 0's
process, and nothing outside the ranks tells who died (tests/test_survivors.py).

    python tests/ranks/given_store.py N SCRIPT [args...]

starts N processes of ``python SCRIPT args...`` in which ``mcrdl.init()`` is given a
``FileStore`` of N ranks and the process's rank (``RANK`` is set too). It waits for all of
them and exits with the first failure's status (128 plus the signal for one a signal ended),
a rank's death leaving the others running.
"""

import os
import runpy
import subprocess
import sys
import tempfile


def main() -> int:
    n, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        procs = [subprocess.Popen([sys.executable, __file__, "rank", str(r), str(n), path,
                                   script, *args], env={**os.environ, "RANK": str(r)})
                 for r in range(n)]
        codes = [p.wait() for p in procs]
    failed = [128 - c if c < 0 else c for c in codes if c != 0]
    return failed[0] if failed else 0


def rank(r: int, n: int, path: str, script: str, args: list[str]) -> None:
    import torch.distributed as dist

    import mcrdl

    given = {"store": dist.FileStore(path, n), "rank": r, "world_size": n}
    init = mcrdl.init
    mcrdl.init = lambda **kw: init(**given, **kw)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6:])
    else:
        sys.exit(main())
