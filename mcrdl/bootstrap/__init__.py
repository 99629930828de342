"""Bringing a job up: which launcher started this process, addresses, the store, and the
notices by which members tell each other that a communicator broke."""

from ._launch import Bootstrap, detect_launcher, finalize_mpi, import_mpi, mpi_up
from ._notices import Notices

__all__ = ["Bootstrap", "Notices", "detect_launcher", "finalize_mpi", "import_mpi", "mpi_up"]
