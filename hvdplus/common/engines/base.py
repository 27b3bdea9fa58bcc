"""The Engine protocol: the few collectives hvdplus composes, over a maintained library.

The host engine's buffers are flat, C-contiguous numpy arrays in host memory; `dtype` names the logical type
(bfloat16 travels as uint16 storage). A device engine (engines/nccl.py) runs the same data collectives on a
framework's tensors. Ranks and roots are indices within `group`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from hvdplus.common.handles import Work
from hvdplus.common.ops import ReduceOp

__all__ = [
    "Engine",
    "DataEngine",
    "ControlPlane",
    "Liveness",
    "Channels",
    "Group",
    "Channel",
    "Doorbell",
    "PlannedGroup",
    "bell_targets",
]

Group = Any  # an engine-specific communicator handle
_T = TypeVar("_T")


class Doorbell(Protocol):
    """Wakes idle ranks: while no rank has work, no control round runs; the first rank with work rings, and every
    rank joins the round it names. Rings travel point to point through rank 0 (`bell_targets`), so waking N ranks
    costs 2(N-1) messages however many of them ring at once."""

    # Whether `rung` must be polled: MPI progresses only inside its calls. A doorbell that is not polled calls
    # `on_ring` from a thread of its own when a ring arrives.
    polled: bool

    def ring(self, round_number: int) -> None:
        """Without blocking, ask the ranks `bell_targets` names to join control round `round_number`."""

    def rung(self, round_number: int) -> bool:
        """Without blocking: whether a peer has rung for round `round_number` or a later one."""

    def close(self) -> None:
        """Release what the doorbell holds (best effort: a peer may already be gone)."""


def bell_targets(rank: int, size: int) -> range:
    """Whom a ring reaches: rank 0 rings everyone, the others ring rank 0 (which rings everyone in turn)."""
    return range(1, size) if rank == 0 else range(0, 1)


class Channel(Protocol):
    """Point to point among all ranks of the job on a communicator of its own, apart from the collectives:
    no negotiation, no control round. Ranks are global; messages between two ranks with the same tag arrive
    in the order they were sent."""

    max_tag: int

    def isend(self, buf: np.ndarray, peer: int, tag: int) -> Work:
        """Start sending `buf` (kept alive and unchanged until the transfer completes) to rank `peer`."""

    def irecv(self, buf: np.ndarray, peer: int, tag: int) -> Work:
        """Start receiving a message of exactly `buf`'s size from rank `peer` into `buf`."""

    def close(self) -> None:
        """Release the channel's communicator."""


class PlannedGroup(Protocol):
    """A communicator of one process set's ranks that only the planned path uses (torch/planned/reducer.py), opened
    with `Channels.open_planned`. Its collectives are the engine's own data calls, in place, as every group's are
    (`DataEngine.start_allreduce`, `start_reducescatter` and `start_allgather`: the ones a plan makes); what sets it
    apart is that they may be started from any thread, several in flight, with no negotiation, and progress while
    the caller computes. Every member starts the same collectives in the same order; that is what freezing a plan
    agrees on."""

    size: int

    def close(self) -> None:
        """Release the communicator (collectives still in flight are abandoned)."""


class DataEngine(Protocol):
    """The data collectives of one kind of buffer, on either path. The host engine's buffers are flat numpy arrays;
    a device engine's are tensors of its framework on its device (common/data/buffer_ops.py).

    Every data call starts the collective and returns its `Work`, whose `wait(alive)` returns once the buffers hold
    the result; `alive` is called about once a second while it waits for the peers (a frozen peer is named as in a
    control round). On a group from `new_group` (the negotiated path, whose rounds wait for each call at once) a
    call may run when it is waited for, on the waiting thread: MPI's blocking collectives do, with the library's
    tuned algorithms and no thread hop (engines/ordered_calls.py says why not MPI's non-blocking ones). On a
    `PlannedGroup` several run at once, in the order started."""

    name: str
    rank: int
    size: int
    world: Group

    def new_group(self, ranks: Sequence[int]) -> Group:
        """Collective over all ranks: a communicator of `ranks` (None on ranks outside it)."""

    def start_allreduce(self, buf: Any, dtype: str, op: ReduceOp, group: Group, send: Any | None = None) -> Work:
        """Reduce `send` (default: `buf` itself) across `group` into `buf` (op is SUM, MIN, MAX or PRODUCT)."""

    def start_allgather(self, send: Any | None, recv: Any, counts: Sequence[int], group: Group) -> Work:
        """Concatenate every rank's `send` (counts[r] elements from rank r) into `recv`; in place when `send` is
        None: this rank's part already sits at its offset in `recv`."""

    def start_broadcast(self, buf: Any, root: int, group: Group) -> Work:
        """Copy root's `buf` into `buf` on every rank."""

    def start_reducescatter(
        self, send: Any | None, recv: Any, counts: Sequence[int], dtype: str, op: ReduceOp, group: Group
    ) -> Work:
        """Reduce `send` across `group`; rank r keeps the counts[r] elements of its slice in `recv`. In place when
        `send` is None: `recv` holds the whole input, and this rank's slice of the result lands at its own offset
        in `recv` (the rest of `recv` is left undefined)."""

    def start_barrier(self, group: Group) -> Work:
        """Complete once every rank of `group` has entered."""

    def shutdown(self) -> None:
        """Release the engine's resources (process groups, communicators)."""


class ControlPlane(Protocol):
    """What the coordinator's control rounds run on: small collectives on the world, and the doorbell."""

    def allgather_bytes(self, data: bytes, group: Group) -> list[bytes]:
        """Control plane: every rank's `data`, in rank order."""

    def start_bitwise_and(self, words: np.ndarray, group: Group, spin_s: float = 0.0) -> Work:
        """Control plane: start the bitwise AND of an int64 vector across `group`, whose `wait` returns it;
        non-blocking, so the coordinator waits for a late peer without polling a core (MPI's blocking calls spin).
        Engines whose waits poll test back to back for `spin_s` first (the peers are expected at once), then
        sleep between tests, so that a late peer costs no core."""

    def run_watched(self, call: Callable[[], _T], alive: Callable[[], None] | None) -> _T:
        """Run `call`, blocking control collectives of this engine (a process set's groups, a channel), on this
        thread, with `alive` called about once a second while it blocks, as a data call's wait calls it (MPI's
        blocking calls cannot call it themselves); engines whose blocking calls end at a timeout of their own run it
        as it is."""

    def open_doorbell(self, on_ring: Callable[[], None], ranks: Sequence[int] | None = None) -> Doorbell | None:
        """Collective over all ranks (at the coordinator's start, or as a process set is added): this rank's
        doorbell among `ranks` (sorted global ranks; None: all), which calls `on_ring` when a ring arrives unless
        it is `polled`; None on a rank outside `ranks`. Rings travel through `ranks[0]`."""


class Liveness(Protocol):
    """How ranks tell a frozen or failed peer from a slow one, beside the collectives."""

    def send_beacon(self, round_number: int, stream: int = 0, peers: Sequence[int] | None = None) -> None:
        """Stall path: tell `peers` (None: every other rank), without blocking, that this one is alive and waiting
        in control round `round_number` of `stream` (0: the world's rounds; a process set's id: that set's own),
        a frozen or hung rank sends none, which is how the others name it."""

    def beacons(self, stream: int = 0, peers: Sequence[int] | None = None) -> dict[int, int]:
        """Stall path: the latest round of `stream` each of `peers` (None: every other rank) has announced with
        `send_beacon` (never blocks long)."""

    def announce_failure(self, message: str) -> None:
        """Failure path: tell every other rank, without blocking, that this rank's runtime stopped and why (best
        effort: the peers read it with `failures` while they wait, and name this rank's error in their own)."""

    def failures(self) -> dict[int, str]:
        """Failure path: the message of each other rank that has announced a failure (never blocks long)."""


class Channels(Protocol):
    """Communicators of their own, used from other threads than the coordinator's."""

    def open_channel(self) -> Channel:
        """Collective over all ranks (run on the coordinator's thread, in the agreed order): a new point-to-point
        channel among all ranks."""

    def open_planned(
        self, ranks: Sequence[int], key: int, timeout_s: float | None, alive: Callable[[], None]
    ) -> PlannedGroup:
        """Collective over `ranks` only (sorted global ranks, this rank among them), from any thread: a new
        `PlannedGroup`. `key` (equal on every member) tells apart groups opened at the same time; `timeout_s`
        ends a collective that waits longer (None: never; engines whose waits poll check stalls themselves).
        `alive()` is called about once a second while this rank waits for the other members to arrive, and raises
        to give up (hvdplus stopped, say because a member died; a stall limit passed)."""


@runtime_checkable
class Engine(DataEngine, ControlPlane, Liveness, Channels, Protocol):
    """The job's host engine: the data collectives on numpy buffers, the control plane every rank runs, the
    liveness signals and the channels. Each concern is a protocol of its own above."""

    # Fusion policy, from what an engine call costs against a copy. A tensor of `alone_bytes` or more is reduced
    # alone, in place, instead of being copied into and out of a fusion buffer (None: everything fuses); a
    # DistributedOptimizer packs gradients into buckets of `bucket_bytes` unless HVDPLUS_BUCKET_BYTES is set.
    alone_bytes: int | None
    bucket_bytes: int

    def start_alltoall(
        self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray, recv_counts: Sequence[int], group: Group
    ) -> Work:
        """Send send_counts[r] elements to rank r and receive recv_counts[r] from it."""

    def start_sendrecv(
        self, send: np.ndarray, recv: np.ndarray, peer: int, group: Group, source: int | None = None
    ) -> Work:
        """Point to point: send `send` to rank `peer` of `group` and receive into `recv` what rank `source`
        (default: `peer`) sends this rank in the same exchange (each message has the size its receiver expects)."""
