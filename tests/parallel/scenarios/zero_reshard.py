"""ZeroOptimizer checkpoint across world sizes: `save PATH` trains 3 steps and writes the consolidated state;
`resume PATH` (on another number of ranks) loads it, trains the last 2 steps and checks the parameters against
one process training all 5 steps on the whole batch (run by tests/parallel/test_jobs.py: 2 ranks, then 3)."""

import sys

import torch

import hvdplus.torch as hvd

BATCH, STEPS, SAVED_AT = 6, 5, 3  # 6 rows per step split evenly over 2 or 3 ranks


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    generator = torch.Generator().manual_seed(7)
    data = [
        (torch.randn(BATCH, 5, generator=generator), torch.randn(BATCH, 2, generator=generator)) for _ in range(STEPS)
    ]
    return model, data


def steps(model, optimizer, data, rows):
    for x, y in data:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()


def main(phase: str, path: str) -> None:
    hvd.init()
    model, data = model_and_data()
    per_rank = BATCH // hvd.size()
    rows = slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)
    if phase == "resume":
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
    optimizer = hvd.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), named_parameters=model.named_parameters()
    )
    if phase == "save":
        steps(model, optimizer, data[:SAVED_AT], rows)
        full = optimizer.consolidated_state_dict(to=0)
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": full}, path)
    else:
        optimizer.load_state_dict(saved["optimizer"])
        steps(model, optimizer, data[SAVED_AT:], rows)
        expected, _ = model_and_data()
        steps(expected, torch.optim.AdamW(expected.parameters(), lr=1e-2), data, slice(None))
        for got, want in zip(model.parameters(), expected.parameters()):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
        print(f"rank {hvd.rank()} of {hvd.size()}: resumed state matches the uninterrupted reference", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
