"""Transports behind one contract (`Backend`), found by name through a lazy registry."""

from ._contract import Backend, Bootstrap, Capabilities, Group, Request
from ._registry import available_backends, backend_class, known_backends, register_backend

__all__ = [
    "Backend",
    "Bootstrap",
    "Capabilities",
    "Group",
    "Request",
    "available_backends",
    "backend_class",
    "known_backends",
    "register_backend",
]
