"""Elastic training, framework-agnostic: Horovod's State, ObjectState and run loop (horovod/common/elastic.py).

`run_fn(func)` runs `func(state)` until it returns. A HorovodInternalError (a peer died, a collective
failed) restores the last commit; a HostsUpdatedInterrupt (the launcher planned a new generation) keeps the
current state. Either way `reset()` (shutdown and init by default) joins the next generation, the reset
callbacks run, and every rank syncs rank 0's state before `func` runs again. Whether to sync is decided
collectively: a worker that just joined always needs it, so no rank skips a sync that another one runs
(horovod#3494's deadlock).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from hvdplus.common.basics import elastic_worker, init, rank, shutdown
from hvdplus.common.collectives import broadcast_object, submit_allreduce
from hvdplus.common.elastic.plan import Plan
from hvdplus.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from hvdplus.common.ops import ReduceOp

log = logging.getLogger("hvdplus")

__all__ = ["Kept", "State", "ObjectState", "StateHandler", "OptimizerHandler", "HandledState", "run_fn", "restart"]


def _agreed_max(value: int, name: str) -> int:
    """The largest `value` over all ranks (a collective)."""
    found = np.array([value], dtype=np.int64)
    submit_allreduce(found, found, "int64", name, ReduceOp.MAX).wait()
    return int(found[0])


def _say_recovered(error: str, left: Plan | None) -> None:
    """One warning for a failure that elastic training recovered from: the workers the launcher saw fail in the
    generation `left` (it names them before it plans the next one), else the collective's error."""
    worker = elastic_worker()
    lost = worker.lost_in(left) if worker is not None and left is not None else []
    log.warning("hvdplus: %s; elastic training went on from the last commit", "; ".join(lost) or error)


def _mark_holding() -> None:
    """After the state sync every rank holds the last commit: tell the launcher, which keeps a worker that holds it
    in every generation (it never plans one that would start again from scratch)."""
    worker = elastic_worker()
    if worker is not None:
        worker.mark_holding()


class Kept:
    """What elastic training keeps across resets, and how: a whole State, or one attribute's StateHandler."""

    def save(self) -> None:
        """Keep the current value in memory (the commit that a failure restores)."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Go back to the last saved value, undoing what came after it."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Make every rank's value rank 0's."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Adjust to the new generation, before the sync (a hook)."""


class State(Kept):
    """What a job must keep across resets: saved at each commit, restored after a failure, synced from rank 0."""

    def __init__(
        self, bcast_object: Callable[[Any], Any] = broadcast_object, get_rank: Callable[[], int] = rank
    ) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Run `callbacks` after every reset, once the new generation has started (e.g. to rescale the learning
        rate to the new hvd.size())."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory, then check for host changes (HostsUpdatedInterrupt on every rank)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt, on every rank at the same call, if the launcher has planned a newer
        generation of the job (hosts added or removed). A collective: every rank must call it."""
        worker = elastic_worker()
        if worker is None or worker.plan is None:  # not an elastic job: hosts never change
            return
        newest = _agreed_max(worker.latest(), "hvdplus.elastic.check_host_updates")
        if newest > worker.plan.generation:
            newer = worker.planned(newest)
            raise HostsUpdatedInterrupt(skip_sync=set(newer.workers) <= set(worker.plan.workers))

    def wait_for_host_updates(self, timeout: float) -> bool:
        """Block until the launcher has planned a newer generation (hosts added or removed; it is acted on at the
        next commit or check_host_updates), or `timeout` seconds pass; whether it has. Not a collective."""
        worker = elastic_worker()
        return worker is not None and worker.wait_for_newer(timeout)


class ObjectState(State):
    """State of plain Python objects, given as keyword arguments and kept as attributes."""

    def __init__(
        self, bcast_object: Callable[[Any], Any] = broadcast_object, get_rank: Callable[[], int] = rank, **kwargs: Any
    ) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    if TYPE_CHECKING:  # the keyword attributes, whatever the job keeps (state.epoch, state.batch, ...)

        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


class StateHandler(Kept):
    """How a HandledState keeps one attribute of a kind it knows (a model, an optimizer, a sampler)."""

    sync_first = False  # optimizers: their sync may move parameters, which the models' sync then carries

    def __init__(self, value: Any) -> None:
        self.value = value

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class OptimizerHandler(StateHandler):
    """A StateHandler for optimizers: they sync first, and a reset drops a DistributedOptimizer's pending work (its
    old job's allreduces, its gradient accumulation), which the new generation would never finish."""

    sync_first = True  # initializing an empty state on rank 0 steps once, which may move the model's parameters

    def reset(self) -> None:
        discard = getattr(self.value, "discard_pending", None)
        if discard is not None:
            discard()


class HandledState(ObjectState):
    """ObjectState whose attributes of the kinds `handler_for` knows are kept by their handlers (tensors copied
    into buffers, synced by broadcasts); the others are plain Python objects. The frameworks' states build on it."""

    def __init__(
        self,
        handler_for: Callable[[Any], StateHandler | None],
        bcast_object: Callable[[Any], Any] = broadcast_object,
        get_rank: Callable[[], int] = rank,
        **kwargs: Any,
    ) -> None:
        self._handlers: dict[str, StateHandler] = {}
        plain = {}
        for name, value in kwargs.items():
            handler = handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                self._handlers[name] = handler
                setattr(self, name, value)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in sorted(self._handlers.values(), key=lambda handler: not handler.sync_first):
            handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and name in self.__dict__:  # a new model or optimizer: keep it from now on
            handlers[name].set_value(value)
        super().__setattr__(name, value)


def restart() -> None:
    """Leave this generation of the job and join the next one (hvd.init joins it in an elastic job)."""
    shutdown()
    init()


_StateT = TypeVar("_StateT", bound=State)
_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


def run_fn(
    func: Callable[Concatenate[_StateT, _Params], _Result], reset: Callable[[], None] = restart
) -> Callable[Concatenate[_StateT, _Params], _Result]:
    """Wrap `func(state, ...)` in the elastic loop (see the module's docstring); `reset` starts the next
    generation."""

    @functools.wraps(func)
    def wrapper(state: _StateT, *args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        needs_sync = True  # a worker's first run (a worker that joined late included) always syncs
        while True:
            # The error's text only: the exception's traceback holds the failed step's frames, whose Gloo work keeps
            # the old process group's connections open through reset(), so a peer blocked in it would never return.
            failed: str | None = None
            worker = elastic_worker()
            plan_before = worker.plan if worker is not None else None
            try:
                if _agreed_max(int(needs_sync), "hvdplus.elastic.sync"):
                    state.sync()
                _mark_holding()
                return func(state, *args, **kwargs)
            except HorovodInternalError as error:
                state.restore()
                needs_sync, failed = True, str(error)
            except HostsUpdatedInterrupt as interrupt:
                needs_sync = not interrupt.skip_sync
            reset()
            if failed is not None:
                _say_recovered(failed, plan_before)
            state.on_reset()

    return wrapper
