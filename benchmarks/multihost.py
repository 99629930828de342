"""mpi against gloo across emulated hosts, per op and size, at a few link rates.

    python benchmarks/multihost.py                        # 2 hosts, 1 and 10 Gbit/s links
    python benchmarks/multihost.py --hosts 4 --rates 1gbit --ops alltoall --sizes 4K:4M
    python benchmarks/multihost.py --tune                 # also: what `mcrdl tune` picks

Runs without mpiexec (it launches the ranks itself): for each rate it brings up
``mcrdl.testing.cluster.Cluster`` (one network namespace per host, every link shaped with
``tc tbf`` to the rate; MPI over TCP), runs ``python -m mcrdl bench`` across it, and prints
mcrdl's ``.wait()`` latency on each backend side by side, with the faster one and busbw
(nccl-tests' definition). ``--tune`` also runs ``python -m mcrdl tune`` there and prints the
backend its table picks per point, so that a table made across hosts can be compared with
one made on one host (where MPI's shared memory wins everywhere).

The hosts share this machine's cores: a rate above what two processes can copy through a
veth here (a few Gbit/s on a 2-core host) measures the CPU, not the link.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import host, human  # noqa: E402

from mcrdl.testing.cluster import Cluster  # noqa: E402
from mcrdl.tuning import TuningTable  # noqa: E402


def run(cluster: Cluster, argv: list[str], timeout: float) -> None:
    result = cluster.run([sys.executable, "-m", "mcrdl", *argv], timeout=timeout, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise SystemExit(f"python -m mcrdl {' '.join(argv)} failed across {cluster.hosts} hosts"
                         f" (exit {result.returncode}):\n{result.output[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rates", default="1gbit,10gbit", help="tc rates, comma-separated")
    ap.add_argument("--ops", default="allreduce,alltoall,allgather,broadcast")
    ap.add_argument("--sizes", default="4:16M", help="lo:hi (powers of 4) or a list")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of timed calls per point")
    ap.add_argument("--tune", action="store_true", help="also run `mcrdl tune` at each rate")
    args = ap.parse_args()
    reason = Cluster.unavailable()
    if reason is not None:
        raise SystemExit(f"cannot emulate hosts here: {reason}")
    print(f"# mpi against gloo across {args.hosts} emulated hosts; {host()}\n# mcrdl .wait()"
          " latency in µs (python -m mcrdl bench), busbw in GB/s; the faster backend marked")
    for rate in args.rates.split(","):
        cluster = Cluster(args.hosts, rate=rate)
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "bench.json"
            run(cluster, ["bench", "--ops", args.ops, "--sizes", args.sizes, "--factor", "4",
                          "--backends", "mpi,gloo", "--budget", str(args.budget),
                          "--no-progress", "--no-raw", "--format", "json",
                          "--output", str(report)], timeout=1800)
            points = json.loads(report.read_text())["points"]
            picks: dict[tuple[str, int], str] = {}
            if args.tune:
                table = Path(tmp) / "table.json"
                run(cluster, ["tune", "--ops", args.ops, "--sizes", args.sizes, "--factor", "4",
                              "--budget", str(args.budget), "--no-progress", "--output",
                              str(table)], timeout=1800)
                picks = tuned(table, points, args.hosts)
        print(f"\n## links at {rate}\n{'op':<10} {'size':>6} | {'mpi µs':>10} {'busbw':>7} |"
              f" {'gloo µs':>10} {'busbw':>7} | {'faster':>6}" + (" | tune picks" if picks else ""))
        rows: dict[tuple[str, int], dict[str, dict]] = {}
        for p in points:
            rows.setdefault((p["op"], p["nbytes"]), {})[p["backend"]] = p
        for (op, nbytes), by in rows.items():
            m, g = by.get("mpi"), by.get("gloo")
            if m is None or g is None:
                continue
            faster = "mpi" if m["time_us"] <= g["time_us"] else "gloo"
            line = (f"{op:<10} {human(nbytes):>6} | {m['time_us']:10.1f} {m['busbw']:7.3f} |"
                    f" {g['time_us']:10.1f} {g['busbw']:7.3f} | {faster:>6}")
            if picks:
                line += f" | {picks.get((op, nbytes), '?')}"
            print(line, flush=True)


def tuned(path: Path, points: list[dict], size: int) -> dict[tuple[str, int], str]:
    """(op, bytes) -> the backend the tuning table at ``path`` picks for each benched point."""
    table = TuningTable.load(str(path))
    return {(p["op"], p["nbytes"]): table.lookup(p["op"], p["dtype"], size, p["nbytes"]) or "?"
            for p in points}


if __name__ == "__main__":
    main()
