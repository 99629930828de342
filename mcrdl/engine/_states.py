"""Future states, as small ints (compared on every poll) and their names."""

__all__ = ["CANCELLED", "DONE", "FAILED", "ISSUED", "PENDING", "STATE_NAMES"]

PENDING, ISSUED, DONE, FAILED, CANCELLED = range(5)
STATE_NAMES = ("PENDING", "ISSUED", "DONE", "FAILED", "CANCELLED")
