"""Plans: pure, deterministic functions that every rank computes alike, so nothing is exchanged: ZeRO sharding,
pipeline schedules, the planned path's agreements, DistributedOptimizer's gradient groups, LR schedule arithmetic."""
