"""DistributedOptimizer's planned path: when a step plan is frozen (planned.py) and the reducer that runs it from
the backward hooks (reducer.py); what every frozen plan shares is framework-free (common/planned_steps.py)."""
