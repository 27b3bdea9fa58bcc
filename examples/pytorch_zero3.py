"""ZeRO-3 with hvdplus: a small character-level GPT, built on the meta device, each rank holding 1/N of it.

    mpirun -np 2 --oversubscribe python examples/pytorch_zero3.py
    hvdplusrun -np 2 python examples/pytorch_zero3.py --steps 300 --bf16

The text is the source of a few modules of Python's standard library (it ships with every Python). The model is
built on the meta device, so no rank ever holds it whole: `hvd.shard_parameters` materialises one block at a time
and keeps this rank's slice. Each step every rank trains on its own rows of the batch. At the end the whole
model and optimizer are written to one checkpoint, streamed unit by unit, that a plain unsharded model loads:
rank 0 checks that the plain model's loss equals the sharded model's, and samples some text from it.
"""

import argparse
import inspect
import json
import os
import tempfile

import torch

import hvdplus.torch as hvd


class Block(torch.nn.Module):
    """Pre-norm causal self-attention and MLP: the sharding unit."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(width)
        self.attention = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(torch.nn.Module):
    """Token and position embeddings, blocks, and an output layer tied to the token embedding."""

    def __init__(self, vocab: int, width: int = 128, layers: int = 4, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def corpus() -> str:
    import argparse as a  # noqa: E401 (the text: their sources)
    import inspect as i
    import json as j
    import textwrap

    return "".join(inspect.getsource(module) for module in (a, textwrap, j.decoder, i))


def windows(data: torch.Tensor, rows: int, context: int, step: int) -> torch.Tensor:
    """`rows` random windows of context + 1 characters, the same on every rank for a given step."""
    starts = torch.randint(0, len(data) - context - 1, (rows,), generator=torch.Generator().manual_seed(step))
    return torch.stack([data[s : s + context + 1] for s in starts])


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch, split over the ranks")
    parser.add_argument("--bf16", action="store_true", help="gather and compute in bfloat16 (fp32 shards)")
    parser.add_argument("--checkpoint", default=None, help="where to write the consolidated checkpoint")
    args = parser.parse_args()
    hvd.init()
    text = corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    context = 64

    torch.manual_seed(0)
    with torch.device("meta"):  # no memory: shard_parameters materialises one block at a time
        model = GPT(len(chars), context=context)
    hvd.shard_parameters(model, units=[Block], param_dtype=torch.bfloat16 if args.bf16 else None)
    optimizer = hvd.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01), named_parameters=model.named_parameters()
    )
    units = model._hvdplus_zero3.units
    held = sum(unit.nbytes() for unit in units)
    total = sum(shape.numel() for unit in units for shape in unit.shapes) * 4
    print(f"rank {hvd.rank()}: holds {held} of the model's {total} parameter bytes", flush=True)

    per_rank = args.batch_size // hvd.size()
    mine = slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)
    evaluation = windows(data, 64, context, step=-1)
    for step in range(args.steps):
        batch = windows(data, args.batch_size, context, step)[mine]
        optimizer.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            average = hvd.allreduce(loss.detach(), name="loss")
            if hvd.rank() == 0:
                print(f"step {step}: loss {float(average):.3f}", flush=True)

    with torch.no_grad():
        sharded_loss = float(loss_of(model, evaluation))
    path = args.checkpoint or os.path.join(tempfile.gettempdir(), f"zero3-example-{os.getppid()}.pt")
    path = hvd.broadcast_object(path, root_rank=0)
    hvd.save_full_checkpoint(path, model, optimizer)  # streamed: no rank holds the whole model
    if hvd.rank() == 0:
        plain = GPT(len(chars), context=context)
        plain.load_state_dict(torch.load(path, weights_only=True)["model"])
        with torch.no_grad():
            plain_loss = float(loss_of(plain, evaluation))
            tokens = data[:context].clone()
            for _ in range(80):
                logits = plain(tokens[None, -context:])[0, -1]
                tokens = torch.cat(
                    [
                        tokens,
                        torch.multinomial(
                            torch.softmax(logits, -1), 1, generator=torch.Generator().manual_seed(len(tokens))
                        ),
                    ]
                )
        print(
            json.dumps(
                {
                    "sharded_eval_loss": round(sharded_loss, 5),
                    "plain_eval_loss": round(plain_loss, 5),
                    "checkpoint": path,
                }
            ),
            flush=True,
        )
        print("sample:", repr("".join(chars[t] for t in tokens[context:])), flush=True)
        if not args.checkpoint:
            os.remove(path)
    hvd.shutdown()


if __name__ == "__main__":
    main()
