"""A rank dies and the others train on (docs/design.md, rule 9): examples/elastic.py under
``python -m mcrdl run`` loses a rank mid-step, the survivors shrink the world and end with
the parameters of a reference that trains with every rank before the loss and with the
survivors from it on. Rank 0 included (the store lives in the launcher), with one more rank
killed inside the shrink, at each round of the survivors' agreement, and through torch
(examples/elastic_ddp.py: DDP over "mcrdl", wrapped again on the survivors' default group).
"""

from __future__ import annotations

import json

import pytest

from tests.launch import finish, start_ranks

pytestmark = pytest.mark.multirank

#: (ranks, the rank that dies mid-step, the one that dies in the shrink, and where).
JOBS = {"0 of 4, 2 in the shrink's first round": (4, 0, (2, "in")),
        "3 of 4, 1 having made its groups": (4, 3, (1, "made"))}


def test_the_survivors_shrink_and_end_as_the_reference(tmp_path):
    # Through torch as well: DDP over "mcrdl" loses rank 0 (the store it was started from
    # is the launcher's, not rank 0's), the survivors' default group is remade, DDP too.
    ddp = start_ranks(3, ["examples/elastic_ddp.py", "--die-rank", "0", "--die-step", "3"],
                      launcher="mcrdl")
    started = {}
    for name, (n, dies, in_shrink) in JOBS.items():
        out = tmp_path / name.replace(" ", "_").replace(",", "").replace("'", "")
        out.mkdir()
        example = ["--die-rank", str(dies), "--die-step", "3", "--out", str(out)]
        argv = (["examples/elastic.py", *example] if in_shrink is None else
                ["tests/ranks/shrink_death.py", str(in_shrink[0]), in_shrink[1], *example])
        started[name] = (start_ranks(n, argv, launcher="mcrdl"), out, n, dies, in_shrink)
    for name, (proc, out, n, dies, in_shrink) in started.items():
        done = finish(proc, 90)
        log = (done.stdout + done.stderr)[-6000:]
        assert done.returncode == 128 + 9, f"{name}:\n{log}"
        gone = {dies} | ({in_shrink[0]} if in_shrink else set())
        survivors = sorted(set(range(n)) - gone)
        ends = {r: json.loads((out / f"rank{r}.json").read_text())
                for r in range(n) if (out / f"rank{r}.json").exists()}
        assert sorted(ends) == survivors, f"{name}:\n{log}"
        for end in ends.values():
            assert end["members"] == survivors and end["match"], f"{name}: {end}\n{log}"
        assert len({tuple(end["w"]) for end in ends.values()}) == 1, name
        # Going on takes a moment (a new store connection can take 5 s here), not a
        # timeout (the jobs' MCRDL_TIMEOUT, and so gloo's, is 30 s).
        killed = float((out / "killed_at").read_text())
        for end in ends.values():
            assert end["first_step_after"] - killed < 15, f"{name}: {end}\n{log}"
        assert "the parameters match the reference" in done.stdout, f"{name}:\n{log}"
    done = finish(ddp, 90)
    log = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 128 + 9, log
    assert "survivors [1, 2] of 3: the parameters match the reference" in done.stdout, log
