"""ZeRO for torch: ZeroOptimizer (stages 1 and 2: optimizer state and gradients sharded), its checkpoints and
frozen step plan, and ZeRO-3 (parameters sharded too: shard_parameters, units, init and checkpoints)."""
