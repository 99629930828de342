"""Run by the emulated cluster (tests/test_cluster.py): examples/elastic.py, where rank
``--die-rank``, instead of killing itself at ``--die-step``, is cut off: it writes
``$MCRDL_CLUSTER_DIR/ready`` (the test then takes its host's link down) and waits there,
alive and unreachable, for ``CUT_WAIT`` seconds (default 20) before it ends. The others
learn of it only from the silence of its host.

    mpiexec ... python tests/ranks/cut_off.py [example args...]
"""

import os
import runpy
import signal
import sys
import time

kill = os.kill


def cut_off_instead(pid: int, sig: int) -> None:
    if pid == os.getpid() and sig == signal.SIGKILL:
        with open(os.path.join(os.environ["MCRDL_CLUSTER_DIR"], "ready"), "w"):
            pass
        time.sleep(float(os.environ.get("CUT_WAIT", "20")))
        os._exit(0)
    kill(pid, sig)


os.kill = cut_off_instead
sys.argv = ["examples/elastic.py", *sys.argv[1:]]
runpy.run_path("examples/elastic.py", run_name="__main__")
