"""TorchWork: a torch.distributed collective in flight, on a real one-rank Gloo group of this process."""

import datetime

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from hvdplus.common.engines.torch_collectives import TorchWork  # noqa: E402


def _group():
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))


@pytest.mark.parametrize("timed", [False, True])
def test_its_steps_run_once_in_order_after_the_collective(timed):
    order: list[str] = []
    tensor = torch.ones(4)
    work = TorchWork(_group().allreduce([tensor]), tensor, lambda: order.append("then"), timed=timed)
    assert work.followed_by(lambda: order.append("after")) is work
    work.wait(lambda: order.append("alive"))
    assert work.done()
    work.wait()
    assert order == ["then", "after"]
    assert tensor.tolist() == [1.0] * 4


def test_done_runs_the_steps_once_the_collective_completed():
    order: list[str] = []
    tensor = torch.ones(2)
    work = TorchWork(_group().allreduce([tensor]), tensor).followed_by(lambda: order.append("after"))
    while not work.done():
        pass
    work.wait()
    assert order == ["after"]
