"""A backend whose operations finish only when the test says so: deterministic engine tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcrdl.backends import Backend, Capabilities
from mcrdl.core._types import DType, OpKind, ReduceOp


@dataclass(eq=False)
class ManualGroup:
    rank: int = 0
    size: int = 1


@dataclass(eq=False)
class ManualRequest:
    op: str
    args: tuple[Any, ...]
    done: bool = False
    error: BaseException | None = None
    cancelled: bool = False


class ManualBackend(Backend):
    """Records every start; ``finish(req)`` marks a request done for the next poll."""

    name = "manual"
    capabilities = Capabilities(
        ops=frozenset(OpKind),
        dtypes=frozenset(DType),
        reductions={op: frozenset(DType) for op in ReduceOp if op is not ReduceOp.AVG},
        cancel=True,
    )

    def __init__(self, bootstrap: Any = None, *, name: str = "manual",
                 self_progressing: bool = False, rank: int = 0, size: int = 1,
                 capabilities: Capabilities | None = None) -> None:
        self.name = name  # type: ignore[misc]
        if self_progressing:
            self.capabilities = Capabilities(
                ops=self.capabilities.ops, dtypes=self.capabilities.dtypes,
                reductions=self.capabilities.reductions, cancel=True, self_progressing=True)
        self.started: list[ManualRequest] = []
        self.events: list[tuple[str, str]] = []
        self.fail_start: str | None = None
        if capabilities is not None:
            self.capabilities = capabilities
        self._world = ManualGroup(rank, size)

    @classmethod
    def is_available(cls) -> bool:
        return True

    def world(self) -> ManualGroup:
        return self._world

    def create_group(self, parent: Any, members: Any, tag: str) -> ManualGroup:
        return ManualGroup(rank=list(members).index(parent.rank), size=len(members))

    def free_group(self, group: Any) -> None:
        pass

    def _start(self, op: str, *args: Any) -> ManualRequest:
        if self.fail_start is not None:
            raise RuntimeError(self.fail_start)
        req = ManualRequest(op, args)
        self.started.append(req)
        self.events.append(("start", op))
        return req

    def test(self, requests: list[Any]) -> list[tuple[int, BaseException | None]]:
        return [(i, r.error) for i, r in enumerate(requests) if r.done]

    def cancel(self, request: Any) -> bool:
        request.cancelled = True
        return True

    def finish(self, req: ManualRequest, error: BaseException | None = None) -> None:
        req.done = True
        req.error = error


def _make_start(op: str) -> Any:
    def start(self: ManualBackend, *args: Any) -> ManualRequest:
        return self._start(op, *args)

    start.__name__ = f"start_{op}"
    return start


for _kind in OpKind:
    setattr(ManualBackend, f"start_{_kind.value}", _make_start(_kind.value))
ManualBackend.__abstractmethods__ = frozenset()
