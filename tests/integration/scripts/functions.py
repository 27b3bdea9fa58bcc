"""Functions for hvdplus.runner.run tests (importable by the workers through PYTHONPATH)."""


def rank_and_sum(offset: int) -> tuple[int, float]:
    import torch

    import hvdplus.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + offset)]), op=hvd.Sum).item()
    return hvd.rank(), total


def fail_on_rank_one() -> None:
    import hvdplus.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one refuses")
