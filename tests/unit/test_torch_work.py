"""TorchWork: a torch.distributed collective in flight, on a real two-rank Gloo group of this process (rank 1 in a
thread), so that the collective changes the tensor and the steps can be seen to run after it."""

import datetime
import threading
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from hvdplus.common.engines.torch_collectives import TorchWork  # noqa: E402

LATE_S = 0.3  # how long rank 1 waits before it joins the allreduce: rank 0's work is in flight meanwhile


def _pair(numel: int):
    """Rank 0's group (this thread's), and `join` for rank 1: its group, made in a thread (the two meet in the
    store), allreduces `numel` twos LATE_S seconds later; `join()` returns once that allreduce is done."""
    store, groups = dist.HashStore(), [None, None]

    def make(rank):
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))

    maker = threading.Thread(target=make, args=(1,))
    maker.start()
    make(0)
    maker.join()

    def rank_1():
        time.sleep(LATE_S)
        groups[1].allreduce([torch.full((numel,), 2.0)]).wait()

    peer = threading.Thread(target=rank_1)
    peer.start()
    return groups[0], peer.join


@pytest.mark.parametrize("timed", [False, True])
def test_its_steps_run_once_in_order_after_the_collective(timed):
    seen: list[tuple[str, list[float]]] = []
    tensor = torch.ones(4)
    group, join = _pair(4)
    work = TorchWork(group.allreduce([tensor]), tensor, lambda: seen.append(("then", tensor.tolist())), timed=timed)
    assert work.followed_by(lambda: seen.append(("after", tensor.tolist()))) is work
    assert not work.done() and seen == []  # rank 1 has not joined yet: nothing ran
    work.wait(lambda: seen.append(("alive", [])))
    assert work.done()
    work.wait()
    join()
    assert [step for step in seen if step[0] != "alive"] == [("then", [3.0] * 4), ("after", [3.0] * 4)]


def test_done_runs_the_steps_once_the_collective_completed():
    seen: list[list[float]] = []
    tensor = torch.ones(2)
    group, join = _pair(2)
    work = TorchWork(group.allreduce([tensor]), tensor).followed_by(lambda: seen.append(tensor.tolist()))
    polls = 0
    while not work.done():  # a poll: it returns at once, without running the steps, until rank 1 joined
        assert seen == []
        polls += 1
    work.wait()
    join()
    assert polls > 0 and seen == [[3.0, 3.0]]
