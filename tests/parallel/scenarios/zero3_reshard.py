"""ZeRO-3 checkpoints across world sizes: `save FILE DIR` (2 ranks) trains 2 steps of a sharded model and writes
both kinds, a consolidated file (which rank 0 also loads into a plain, unsharded model) and per-rank shards;
`resume FILE DIR` (3 ranks) loads each kind into a model built on the meta device, trains the last 2 steps and
checks the parameters and the optimizer state against one process training all 4 steps on the whole batch (run
by tests/parallel/test_jobs.py). Tolerance as tests/parallel/workers/test_torch_zero3.py's against one process."""

import sys

import torch

import hvdplus.torch as hvd

ROWS, STEPS, SAVED_AT, VOCAB = 6, 4, 2, 24  # 6 rows per step split evenly over 2 or 3 ranks


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(12)
        self.fc = torch.nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(torch.tanh(self.norm(x)))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 12)
        self.blocks = torch.nn.Sequential(Block(), Block(), Block())
        self.head = torch.nn.Linear(12, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def build(meta: bool = False) -> Model:
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return Model()
    return Model()


def data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (ROWS, 7), generator=generator) for _ in range(STEPS)]


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train(model, optimizer, batches, rows) -> None:
    for tokens in batches:
        optimizer.zero_grad()
        loss_of(model, tokens[rows]).backward()
        optimizer.step()


def sharded(meta: bool):
    model = hvd.shard_parameters(build(meta), units=[Block])
    return model, hvd.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), named_parameters=model.named_parameters()
    )


def main(phase: str, path: str, directory: str) -> None:
    hvd.init()
    per_rank = ROWS // hvd.size()
    rows = slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)
    if phase == "save":
        model, optimizer = sharded(meta=False)
        train(model, optimizer, data()[:SAVED_AT], rows)
        hvd.save_full_checkpoint(path, model, optimizer)
        hvd.save_sharded_checkpoint(directory, model, optimizer)
        with hvd.gathered_parameters(model):
            gathered = {name: p.detach().clone() for name, p in model.named_parameters()}
        if hvd.rank() == 0:
            plain = build()
            plain.load_state_dict(torch.load(path, weights_only=True)["model"])
            for name, p in plain.named_parameters():
                torch.testing.assert_close(p.detach(), gathered[name], rtol=0, atol=0)
            print("a plain model loads the consolidated checkpoint", flush=True)
    else:
        expected = build()
        expected_optimizer = torch.optim.AdamW(expected.parameters(), lr=1e-3)
        train(expected, expected_optimizer, data(), slice(None))
        for kind, load in (
            ("consolidated", lambda m, o: hvd.load_full_checkpoint(path, m, o)),
            ("sharded", lambda m, o: hvd.load_sharded_checkpoint(directory, m, o)),
        ):
            model, optimizer = sharded(meta=True)
            load(model, optimizer)
            train(model, optimizer, data()[SAVED_AT:], rows)
            full = optimizer.consolidated_state_dict(to=0)
            with hvd.gathered_parameters(model):
                for got, want in zip(model.parameters(), expected.parameters()):
                    torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=2e-5)
            if full is not None:
                plain_state = expected_optimizer.state_dict()["state"]
                for index, state in plain_state.items():
                    torch.testing.assert_close(full["state"][index]["exp_avg"], state["exp_avg"], rtol=0, atol=1e-6)
                    assert float(full["state"][index]["step"]) == float(state["step"]) == STEPS
            print(
                f"rank {hvd.rank()} of {hvd.size()}: resumed from the {kind} checkpoint as one process trains",
                flush=True,
            )
    hvd.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
