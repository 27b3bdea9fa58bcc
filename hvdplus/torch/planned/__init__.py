"""DistributedOptimizer's planned path: when a step plan is frozen (planned.py), what every frozen plan shares
(planned_steps.py) and the reducer that runs it from the backward hooks (reducer.py)."""
