"""Transports behind one contract (`Backend`), found by name through a lazy registry."""

from ._contract import Backend, Capabilities, Group, Rendezvous, Request
from ._device import Device, device_kind
from ._registry import available_backends, backend_class, known_backends, register_backend

__all__ = [
    "Backend",
    "Capabilities",
    "Device",
    "Group",
    "Rendezvous",
    "Request",
    "available_backends",
    "backend_class",
    "device_kind",
    "known_backends",
    "register_backend",
]
