"""What ranks tell each other during negotiation: requests, and the responses agreed from them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, cast, overload

from hvdplus.common.ops import OpKind, ReduceOp, storage_dtype

__all__ = ["Request", "Response", "Key", "SameRequest"]

Key = tuple[int, str]  # (process set id, tensor name)

# Reduce-scatters fuse for the linear ops only: Min and Max need a NaN pass of their own (data/nan.py).
_FUSED_SCATTER_OPS = (ReduceOp.SUM, ReduceOp.AVERAGE)
_FUSED_KINDS = (OpKind.ALLREDUCE, OpKind.REDUCESCATTER, OpKind.ALLGATHER)


class Request(NamedTuple):
    """One rank's announcement that a named collective is ready on its side.

    A named tuple rather than a dataclass: one is built per tensor per step and compared with the
    cached one every cycle, and tuples do both several times faster."""

    name: str
    kind: OpKind
    process_set: int = 0
    dtype: str = "float32"
    shape: tuple[int, ...] = ()
    device: str = "cpu"
    op: ReduceOp = ReduceOp.SUM
    root: int = -1
    splits: tuple[int, ...] | None = None
    prescale: float = 1.0
    postscale: float = 1.0
    ranks: tuple[int, ...] | None = None  # for ADD_PROCESS_SET
    parts: tuple[tuple[int, ...], ...] | None = None  # a grouped allreduce packed into one flat buffer: its shapes
    group: int = 0  # the number of tensors of the grouped call this request belongs to (0: not a group of several)
    tag: str = ""  # what the call is for, when one name is reused for different data (ZeRO-3's positional names)
    call: str = ""  # a member of a named grouped call (not packed): the call's name, whose members fail together
    # Not to run: the mask of the ranks that hold this collective on its set's rounds, told to another set's rounds
    # whose entry of the same name waits for them (agreement.py: shadow_held); 0 for a collective to run.
    shadow: int = 0

    @property
    def key(self) -> Key:
        return (self.process_set, self.name)

    @property
    def nelements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    def describe(self) -> str:
        return f"{self.kind.name.lower()} {self.name!r}"


class SameRequest(Sequence[Request]):
    """The requests of `count` ranks that all sent the same one: a sequence of constant size, so that a
    response agreed by 1024 ranks costs no more to build, cache and check than one agreed by 2."""

    # `size`, not `count`: an attribute named count would hide Sequence.count(value), which then could not be called.
    __slots__ = ("request", "size")

    def __init__(self, request: Request, count: int) -> None:
        self.request, self.size = request, count

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> Request: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Request, ...]: ...

    def __getitem__(self, index: int | slice) -> Request | tuple[Request, ...]:
        if isinstance(index, slice):
            return tuple(self)[index]
        if not -self.size <= index < self.size:
            raise IndexError(f"rank index {index} out of range for {self.size} ranks")
        return self.request

    def __contains__(self, value: object) -> bool:
        return self.size > 0 and value == self.request

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == self.size and all(r == self.request for r in other)

    def __hash__(self) -> int:
        return hash((self.request, self.size))

    def __repr__(self) -> str:
        return f"SameRequest({self.request!r}, count={self.size})"


@dataclass(frozen=True)
class Response:
    """A collective every participating rank agreed to run now, or the error they all raise.

    `requests` holds one entry per member of the process set, in set-rank order (a SameRequest when they all
    agree); None marks a rank that has joined and contributes zeros.
    """

    key: Key
    kind: OpKind
    requests: Sequence[Request | None]
    error: str | None = None
    join_last_rank: int = -1
    members: tuple[int, ...] = field(default=())

    @cached_property
    def first(self) -> Request:
        """A request that stands for all of them (they agree on everything that matters)."""
        return next(r for r in self.requests if r is not None)

    @property
    def announced(self) -> Sequence[Request]:
        """`requests` where every member announced: any collective but allreduce, the only one that runs while
        ranks have joined (None for them)."""
        return cast("Sequence[Request]", self.requests)

    @cached_property
    def nbytes(self) -> int:
        """Bytes of one rank's tensor (remembered: fusion asks every cycle of a cached response)."""
        return self.first.nelements * storage_dtype(self.first.dtype).itemsize

    @cached_property
    def fusion_key(self) -> tuple | None:
        """What responses must share to fuse into one buffer (data/fusion.py): kind, set, dtype, device, op and
        scales; None for one that runs alone (an error, which may lack a joined rank's request, or a kind that does
        not fuse). Remembered: fusion asks every cycle of a cached response."""
        if self.error is not None or self.kind not in _FUSED_KINDS:
            return None
        first = self.first
        if self.kind == OpKind.REDUCESCATTER and first.op not in _FUSED_SCATTER_OPS:
            return None
        return (self.kind, self.key[0], first.dtype, first.device, first.op, first.prescale, first.postscale)

    @cached_property
    def fused_nbytes(self) -> int:
        """Bytes this response adds to a fusion buffer: one rank's tensor, or everything an allgather gathers."""
        if self.kind != OpKind.ALLGATHER:
            return self.nbytes
        return sum(r.nelements for r in self.announced) * storage_dtype(self.first.dtype).itemsize
