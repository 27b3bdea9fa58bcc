"""BlockedCalls: the thread that calls `alive` for blocking engine calls (MPI's) while they last."""

import threading
import time

from hvdplus.common.engines.blocked_calls import BlockedCalls, CallAtWait
from hvdplus.common.handles import ALIVE_EVERY_S


def test_a_long_call_is_inspected_and_a_short_one_is_not():
    calls: list[str] = []
    watcher = BlockedCalls("test-watch", lambda error: calls.append(f"stuck: {error}"))
    try:
        watcher.watch(lambda: calls.append("short"))
        watcher.watch(None)  # returned at once: never inspected
        watcher.watch(lambda: calls.append("long"))
        time.sleep(2.5 * ALIVE_EVERY_S)
        watcher.watch(None)
        seen = list(calls)
        time.sleep(1.5 * ALIVE_EVERY_S)
    finally:
        watcher.close()
    assert seen and set(seen) == {"long"}, seen
    assert calls == seen  # nothing after the call ended


def test_the_verdict_of_a_call_still_blocked_reaches_on_stuck_once():
    stuck: list[BaseException] = []
    ended = threading.Event()
    watcher = BlockedCalls("test-watch", lambda error: (stuck.append(error), ended.set()))

    def alive() -> None:
        raise RuntimeError("rank 1 did not answer a control round")

    try:
        watcher.watch(alive)
        assert ended.wait(5 * ALIVE_EVERY_S)
        time.sleep(1.5 * ALIVE_EVERY_S)  # the watcher stopped: the call cannot be released, its process ends
    finally:
        watcher.watch(None)
        watcher.close()
    assert [str(error) for error in stuck] == ["rank 1 did not answer a control round"]


def test_each_thread_has_its_own_call():
    seen: set[str] = set()
    watcher = BlockedCalls("test-watch", lambda error: None)

    def blocked(name: str) -> None:
        watcher.watch(lambda: seen.add(name))
        time.sleep(2.5 * ALIVE_EVERY_S)
        watcher.watch(None)

    threads = [threading.Thread(target=blocked, args=(name,)) for name in ("a", "b")]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        watcher.close()
    assert seen == {"a", "b"}


def test_a_call_at_wait_runs_once_on_the_waiting_thread_watched_with_its_alive():
    ran: list[int] = []
    seen: list[str] = []
    watcher = BlockedCalls("test-watch", lambda error: None)

    def call() -> None:
        ran.append(threading.get_ident())
        time.sleep(1.6 * ALIVE_EVERY_S)  # long enough for the watcher to call the wait's alive

    work = CallAtWait(call, watcher)
    try:
        assert not work.done() and ran == []  # started, not run: it runs when it is waited for
        work.wait(lambda: seen.append("alive"))
        work.wait()  # once only
    finally:
        watcher.close()
    assert ran == [threading.get_ident()] and work.done()
    assert seen, "the wait's alive was not called while the call blocked"


def test_a_failed_call_at_wait_raises_at_every_wait():
    def call() -> None:
        raise RuntimeError("MPI_ERR_TRUNCATE")

    watcher = BlockedCalls("test-watch", lambda error: None)
    work = CallAtWait(call, watcher)
    try:
        for _ in range(2):
            try:
                work.wait(lambda: None)
            except RuntimeError as exc:
                assert str(exc) == "MPI_ERR_TRUNCATE"
            else:
                raise AssertionError("the call's error was not raised")
    finally:
        watcher.close()
    assert work.done()
