"""Elastic training: the run loop and state (state.py), a worker's side of the launcher's generations
(rendezvous.py) and the plan the launcher publishes (plan.py, standard library only: hvdplusrun imports it, so this
package's __init__ imports nothing)."""
