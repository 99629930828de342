"""``python -m mcrdl run -n N script.py [args...]``: N ranks on this host, and a rank that dies
leaves the others running.

torchrun's agent stops every worker when one fails (or restarts them all), and MPICH's
hydra ends the job (even under ``-disable-auto-cleanup`` it sometimes ends survivors). This
launcher does neither: it reports a rank that died and lets the others run on, and tells
them at once (a notice in the store each listens on): every communicator the dead rank is a
member of breaks with `PeerLostError` naming it, whether or not anything was in flight,
and communicators without it go on (docs/design.md, rule 9). Each rank
gets torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) with the store hosted here, as torchrun's agent hosts it
(``TORCHELASTIC_USE_AGENT_STORE``): the store lives in no rank, so no rank's death takes it
away. mcrdl, and torch's ``init_process_group`` from ``env://``, start from it as they do
under torchrun.

It returns once every rank has ended: 0 if all succeeded, else the exit status of the first
rank that failed (128 plus the signal, for one a signal ended). SIGINT and SIGTERM are passed
on to the ranks still running.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["run"]

#: How long the store waits for a key a rank asks for (as torchrun's default).
_STORE_TIMEOUT = datetime.timedelta(seconds=900)


def run(n: int, command: Sequence[str], host: str = "127.0.0.1") -> int:
    """Run ``python command...`` as ``n`` ranks; their exit status (see the module docstring).

    Raises:
        ValueError: ``n`` is below 1, or there is no command.
    """
    import torch.distributed as dist

    if n < 1:
        raise ValueError(f"-n {n}: a job needs at least one rank")
    if not command:
        raise ValueError("no command: pass a script and its arguments (or -- -m module ...)")
    store = dist.TCPStore(host, 0, n, True, _STORE_TIMEOUT,  # type: ignore[attr-defined]
                          wait_for_workers=False)
    common = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": host,
              "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
              "TORCHELASTIC_RESTART_COUNT": "0", "GROUP_RANK": "0"}
    ranks: dict[int, tuple[int, subprocess.Popen[Any]]] = {}
    for rank in range(n):
        env = {**os.environ, **common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        proc = subprocess.Popen([sys.executable, *command], env=env)
        ranks[proc.pid] = (rank, proc)

    def forward(signum: int, frame: Any) -> None:
        for _, proc in ranks.values():
            if proc.returncode is None:
                proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _wait_all(ranks, store)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait_all(ranks: dict[int, tuple[int, subprocess.Popen[Any]]], store: Any) -> int:
    """Reap the ranks as they end; of one that failed, tell the user and every rank still
    running (a notice on its queue in the store: `mcrdl.bootstrap._notices`). The job's exit
    status."""
    status = 0
    running = len(ranks)
    while running:
        pid, raw = os.wait()
        if pid not in ranks:
            continue
        rank, proc = ranks[pid]
        code = os.waitstatus_to_exitcode(raw)
        proc.returncode = code  # (reaped here: Popen must not wait for it again)
        running -= 1
        if code == 0:
            continue
        if code < 0:
            how = f"was ended by {signal.Signals(-code).name}"
            code = 128 - code
        else:
            how = f"exited with status {code}"
        sys.stderr.write(f"mcrdl run: rank {rank} {how}; the {running} still running go on\n")
        sys.stderr.flush()
        notice = json.dumps({"lost": rank, "cause": f"its process {how}"})
        for other, proc in ranks.values():
            if proc.returncode is None:
                store.queue_push(f"mcrdl/notices/{other}", notice)
        status = status or code
    return status
