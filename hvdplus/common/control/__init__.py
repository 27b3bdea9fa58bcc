"""The control plane: the rounds in which ranks agree which collectives run, in one order everywhere.

Each set of ranks runs its rounds (set_rounds, world_rounds, member_rounds, cycles, idle_spells); a round's words
are built and read by agreement (response cache, message table, announcements, stall and frozen-peer inspectors);
control_collectives runs join, process sets, channels and device planes; coordinator ties them together."""
