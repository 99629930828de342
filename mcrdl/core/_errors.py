"""The exceptions mcrdl raises: one root, `MCRDLError`, and a class per failure a caller can act on."""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "CommBrokenError",
    "CommClosedError",
    "CommTimeoutError",
    "DependencyFailedError",
    "DesyncError",
    "FutureCancelledError",
    "InvalidStateError",
    "MCRDLError",
    "RuntimeFinalizedError",
    "StartError",
    "UnknownBackendError",
    "UnsupportedOperationError",
]


class MCRDLError(Exception):
    """Root of every exception mcrdl raises on purpose.

    All subclasses carry only their message, so they pickle and cross process boundaries intact.
    """


class UnknownBackendError(MCRDLError, ValueError):
    """A backend name that no registry entry has (``"ncl"`` instead of ``"nccl"``)."""


class BackendUnavailableError(MCRDLError):
    """A known backend that cannot run here or was not brought up by this runtime."""


class UnsupportedOperationError(MCRDLError, TypeError):
    """A backend cannot carry this dtype, or cannot run this operation or reduction on it.

    The message names the backends that can.
    """


class CommClosedError(MCRDLError):
    """An operation was submitted to a communicator after ``close()``."""


class RuntimeFinalizedError(MCRDLError):
    """The runtime was finalized: its futures cannot be waited on and nothing can be submitted."""


class InvalidStateError(MCRDLError):
    """``result()`` or ``exception()`` on a future that has not finished yet."""


class BackendError(MCRDLError):
    """A backend reported a failure for one operation; the message is the backend's own."""


class StartError(BackendError):
    """A backend could not start the operation on this rank: it never reached the peers, so
    its communicator breaks (the peers would otherwise match the next operation in its place)."""


class DependencyFailedError(MCRDLError):
    """An operation could not run because an operation it depends on failed or was cancelled."""


class FutureCancelledError(MCRDLError):
    """The future was cancelled before it was issued."""


class CommTimeoutError(MCRDLError, TimeoutError):
    """An operation did not complete within the runtime's per-operation timeout."""


class DesyncError(MCRDLError):
    """Members of a communicator submitted different collectives at the same sequence number."""


class CommBrokenError(MCRDLError):
    """The operation's communicator broke: a member could not run one of its operations as
    its peers expect (cancelled, a dependency failed, timed out...), so nothing more runs on
    it, on any member. The message names that first cause."""


class PeerLostError(CommBrokenError):
    """The operation's communicator broke because a member's process is gone (it died, or
    its host was cut off), as the launcher or the mesh between the ranks reported: the
    message names the lost ranks (world ranks). Communicators without them go on."""
