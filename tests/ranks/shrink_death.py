"""Run by ``python -m mcrdl run``, Open MPI's ``mpiexec --with-ft ulfm`` or
tests/ranks/given_store.py (tests/test_survivors.py): examples/elastic.py, with one more
rank killed inside its first shrink.

    python -m mcrdl run -n 4 tests/ranks/shrink_death.py VICTIM POINT [example args...]

Rank ``VICTIM`` dies (SIGKILL) right after it has given its answer to a round of the
survivors' agreement (the launcher's store's, `mcrdl.bootstrap._agree.Meeting`, or the
mesh's, `mcrdl.bootstrap._mesh.Mesh`): POINT ``in`` (it said it is alive: the others' group
creation cannot finish, and their next attempt goes on without it) or ``made`` (it said it
made its groups: the new communicator has it, is broken at once, and a second shrink goes on
without it).
"""

import os
import runpy
import signal
import sys

from mcrdl.bootstrap._agree import Meeting
from mcrdl.bootstrap._mesh import Mesh

victim, point, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))


def answering_then_dying(agree):
    def answer_then_die(meeting, key, members, value, gone):
        if key.endswith(f"/{point}"):
            if isinstance(meeting, Meeting):
                meeting.store.set(f"{key}/{meeting.rank}", value)  # (its own key in the round)
            else:  # the mesh's: its value sent to every other member
                for m in members:
                    if m != meeting.rank:
                        meeting._send(m, f"{key}/value", value)
            os.kill(os.getpid(), signal.SIGKILL)
        return agree(meeting, key, members, value, gone)
    return answer_then_die


if rank == victim:
    Meeting.agree = answering_then_dying(Meeting.agree)
    Mesh.agree = answering_then_dying(Mesh.agree)
sys.argv = ["examples/elastic.py", *args]
runpy.run_path("examples/elastic.py", run_name="__main__")
