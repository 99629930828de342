"""Run by ``python -m mcrdl run`` (tests/test_survivors.py): examples/elastic.py, with one
more rank killed inside its first shrink.

    python -m mcrdl run -n 4 tests/ranks/shrink_death.py VICTIM POINT [example args...]

Rank ``VICTIM`` dies (SIGKILL) right after it has written its answer to a round of the
survivors' agreement (`mcrdl.bootstrap._agree`): POINT ``in`` (it said it is alive: the
others' group creation cannot finish, and their next attempt goes on without it) or
``made`` (it said it made its groups: the new communicator has it, is broken at once, and a
second shrink goes on without it).
"""

import os
import runpy
import signal
import sys

import mcrdl.front._shrink as shrink

victim, point, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
if int(os.environ["RANK"]) == victim:
    agree = shrink.agree

    def answer_then_die(meeting, key, members, value, gone):
        if key.endswith(f"/{point}"):
            meeting.store.set(f"{key}/{meeting.rank}", value)  # (its own key in the round)
            os.kill(os.getpid(), signal.SIGKILL)
        return agree(meeting, key, members, value, gone)

    shrink.agree = answer_then_die
sys.argv = ["examples/elastic.py", *args]
runpy.run_path("examples/elastic.py", run_name="__main__")
