"""Which of the launcher's environment variables travel to the workers, and which must not."""

from __future__ import annotations

__all__ = ["INHERITED_LAUNCH_VARIABLES", "exportable"]

# Launch variables a worker must get from this launcher, never inherit from whatever started hvdplusrun.
INHERITED_LAUNCH_VARIABLES = frozenset(
    f"{prefix}_{name}"
    for prefix in ("HVDPLUS", "HOROVOD")
    for name in (
        "RANK",
        "SIZE",
        "LOCAL_RANK",
        "LOCAL_SIZE",
        "CROSS_RANK",
        "CROSS_SIZE",
        "HOSTNAME",
        "RENDEZVOUS_ADDR",
        "RENDEZVOUS_PORT",
        "RENDEZVOUS_FILE",
        "SECRET_KEY",
        "GLOO_RENDEZVOUS_ADDR",
        "GLOO_RENDEZVOUS_PORT",
        "ELASTIC_WORKER",
        "ELASTIC_GENERATION",
    )
)

_NOT_EXPORTED_PREFIXES = ("BASH_FUNC_", "SSH_", "OMPI_", "PMIX_", "PRTE_", "SLURM_")
_NOT_EXPORTED = frozenset(
    {"HOSTNAME", "SHLVL", "PWD", "OLDPWD", "_", "DISPLAY", "TMUX", "TERM", "LS_COLORS", "MAIL", "XAUTHORITY"}
)


def exportable(name: str) -> bool:
    """True for variables worth sending to other hosts (not shell, ssh, MPI or Slurm internals)."""
    return name not in _NOT_EXPORTED and not name.startswith(_NOT_EXPORTED_PREFIXES)
