"""Configuration: the only reader of ``MCRDL_*`` environment variables.

``init()`` keyword arguments win over the environment, which wins over the defaults.

| variable | init() argument | meaning |
|---|---|---|
| ``MCRDL_BACKENDS`` | ``backends`` | comma-separated backends to bring up (default: all that can run) |
| ``MCRDL_TIMEOUT`` | ``timeout`` | seconds an issued operation may take; ``0`` or ``none``: no limit |
| ``MCRDL_DEBUG`` | ``debug`` | ``1``: check every collective's fingerprint across its group |
| ``MCRDL_CHECK_TASKS`` | ``check_tasks`` | ``1``: warn when two asyncio tasks have unnamed collectives unfinished on one communicator at once (``mcrdl.front._taskcheck``) |
| ``MCRDL_TUNING`` | ``tuning`` | path of a tuning table for ``backend="auto"`` |
| ``MCRDL_PROGRESS_THREAD`` | ``progress_thread`` | ``0``: no background progress thread |
| ``MCRDL_FLIGHT_RECORDER`` | ``flight_recorder`` | where a timeout dumps the flight recorder: ``stderr`` or a path |
| ``MCRDL_LOG`` | ``log`` | ``1``: record every operation; a summary at ``finalize()`` (``comm.log_summary()``) |
| ``MCRDL_TRACE`` | ``trace`` | write a timeline of every rank's operations here at ``finalize()`` (trace-event JSON) |
| ``MCRDL_FUSION_BYTES`` | ``fusion_bytes`` | the most bytes one fused allreduce of small named ones carries; ``0``: no fusion (the same on every rank) |
| ``MCRDL_HOST`` | ``host`` | this host's interface name or own address, to bind and advertise (default: loopback where all ranks share a network, else the interface that reaches rank 0) |
| ``MCRDL_PEER_TIMEOUT`` | | seconds a peer's host may not answer before its ranks count as gone (default 10; the mesh's, where the store lives in a rank: ``mcrdl.bootstrap._mesh``) |
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Config", "DEFAULT_FUSION_BYTES", "DEFAULT_PEER_TIMEOUT", "DEFAULT_TIMEOUT"]

#: Seconds an issued operation may take before it fails with CommTimeoutError.
DEFAULT_TIMEOUT = 300.0
#: Bytes one fused allreduce carries at most (`mcrdl.engine._fusion`; docs/performance-log.md,
#: "Fusion of small named allreduces; awaiting tasks that finished meanwhile").
DEFAULT_FUSION_BYTES = 1 << 20
#: Seconds a peer's host may not answer before its ranks count as gone (`mcrdl.bootstrap._mesh`).
DEFAULT_PEER_TIMEOUT = 10.0

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _flag(name: str, value: str) -> bool:
    low = value.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; use 1 or 0")


def _seconds(name: str, value: str | float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() in ("none", "0", ""):
            return None
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a number of seconds") from None
    if value != value or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative number of seconds")
    return None if value == 0 else float(value)


def _peer_timeout(value: str) -> float:
    seconds = _seconds("MCRDL_PEER_TIMEOUT", value)
    if seconds is None or seconds < 1:
        raise ValueError(f"MCRDL_PEER_TIMEOUT={value!r} must be at least 1 second (the "
                         f"kernel's keep-alive probes count whole seconds)")
    return seconds


def _bytes(name: str, value: str | int) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a number of bytes") from None
    if type(value) is not int or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative number of bytes (0: off)")
    return value


@dataclass(frozen=True)
class Config:
    """Settings of one runtime (see the module docstring for where each comes from)."""

    backends: tuple[str, ...] | None = None
    timeout: float | None = DEFAULT_TIMEOUT
    debug: bool = False
    check_tasks: bool = False
    tuning: str | None = None
    progress_thread: bool = True
    flight_recorder: str = "stderr"
    host: str | None = None
    log: bool = False
    trace: str | None = None
    fusion_bytes: int = DEFAULT_FUSION_BYTES
    peer_timeout: float = DEFAULT_PEER_TIMEOUT

    @classmethod
    def load(
        cls,
        *,
        backends: Sequence[str] | str | None = None,
        timeout: float | None | str = "unset",
        debug: bool | None = None,
        check_tasks: bool | None = None,
        tuning: str | None = None,
        progress_thread: bool | None = None,
        flight_recorder: str | None = None,
        host: str | None = None,
        log: bool | None = None,
        trace: str | None = None,
        fusion_bytes: int | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Config:
        """Merge ``init()`` arguments (None: not given) over ``environ`` (default os.environ)."""
        env = os.environ if environ is None else environ
        if backends is None and env.get("MCRDL_BACKENDS"):
            backends = env["MCRDL_BACKENDS"]
        if isinstance(backends, str):
            backends = [b.strip() for b in backends.split(",") if b.strip()]
        if timeout == "unset":
            timeout = _seconds("MCRDL_TIMEOUT", env.get("MCRDL_TIMEOUT", str(DEFAULT_TIMEOUT)))
        else:
            timeout = _seconds("timeout", timeout)
        if debug is None:
            debug = _flag("MCRDL_DEBUG", env.get("MCRDL_DEBUG", "0"))
        if check_tasks is None:
            check_tasks = _flag("MCRDL_CHECK_TASKS", env.get("MCRDL_CHECK_TASKS", "0"))
        if progress_thread is None:
            progress_thread = _flag(
                "MCRDL_PROGRESS_THREAD", env.get("MCRDL_PROGRESS_THREAD", "1")
            )
        return cls(
            backends=tuple(backends) if backends is not None else None,
            timeout=timeout,
            debug=bool(debug),
            check_tasks=bool(check_tasks),
            tuning=tuning if tuning is not None else env.get("MCRDL_TUNING") or None,
            progress_thread=bool(progress_thread),
            flight_recorder=flight_recorder or env.get("MCRDL_FLIGHT_RECORDER") or "stderr",
            host=host or env.get("MCRDL_HOST") or None,
            log=bool(log) if log is not None else _flag("MCRDL_LOG", env.get("MCRDL_LOG", "0")),
            trace=trace or env.get("MCRDL_TRACE") or None,
            fusion_bytes=(_bytes("fusion_bytes", fusion_bytes) if fusion_bytes is not None
                          else _bytes("MCRDL_FUSION_BYTES", env.get(
                              "MCRDL_FUSION_BYTES", str(DEFAULT_FUSION_BYTES)))),
            peer_timeout=_peer_timeout(env.get("MCRDL_PEER_TIMEOUT", str(DEFAULT_PEER_TIMEOUT))),
        )
