"""Future states, as small ints (compared on every poll) and their names; and the kinds of
the operations the engine treats apart."""

__all__ = ["AGREEMENT_KIND", "CANCELLED", "CHECK_KIND", "DONE", "FAILED", "ISSUED", "PENDING",
           "STATE_NAMES"]

PENDING, ISSUED, DONE, FAILED, CANCELLED = range(5)
STATE_NAMES = ("PENDING", "ISSUED", "DONE", "FAILED", "CANCELLED")

#: The kind of debug mode's fingerprint checks (`mcrdl.front`): a failure of one is the
#: verdict of its dependants too (a desync, or the peers not arriving in time).
CHECK_KIND = "fingerprint"

#: The kind of a `Names` agreement round. One that fails here, in flight or in its finishing
#: step, breaks its communicator: its peers place what they agreed on, and this member no
#: longer knows what that is (rule 8 of docs/design.md).
AGREEMENT_KIND = "agreement"
