"""Whether the MPI library's own allreduce is already hierarchical: Open MPI's `han` coll component, read through
the MPI tool interface (MPI_T control variables, which reflect every way Open MPI takes its MCA parameters: mpirun's
--mca, OMPI_MCA_* variables, parameter files).

Open MPI 5 opens `han` with priority 35, above `tuned`'s 30, so han serves every communicator whose ranks span
several nodes: within a node, then across nodes, as hvdplus's hierarchical allreduce does. hvdplus's own three steps
on top of it then cost more than the flat call (2 hosts x 2 ranks, 64 MB: 836 ms against 609 ms). `--mca coll ^han`
(or a `coll` list without han) leaves han closed, and its variables absent.
"""

from __future__ import annotations

import ctypes
import re
import struct

__all__ = ["han_serves_allreduce", "int_control_variable"]


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library mpi4py loaded into this process (Linux: found in /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if re.search(r"/libmpi\.so", line)), None)
    except OSError:
        return None
    return ctypes.CDLL(path) if path else None


def int_control_variable(lib: ctypes.CDLL, name: str) -> int | None:
    """The value of MPI_T control variable `name` (an int), or None where the library has no such variable."""
    index, handle, count = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_int()
    if lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(index)) != 0:
        return None
    if lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) != 0:
        return None
    buffer = ctypes.create_string_buffer(max(8, 8 * count.value))
    try:
        if lib.MPI_T_cvar_read(handle, buffer) != 0:
            return None
    finally:
        lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
    value: int = struct.unpack_from("i", buffer.raw)[0]
    return value


def han_serves_allreduce() -> str:
    """Why this process's MPI library reduces multi-host communicators hierarchically itself (Open MPI's han open
    with a priority above tuned's), or "" when it does not or cannot be told (a library that cannot be loaded or
    lacks MPI_T: never an exception, since the ranks agree on the answer next). Needs MPI initialised (mpi4py)."""
    try:
        return _han_reason()
    except (OSError, AttributeError):
        return ""


def _han_reason() -> str:
    from mpi4py import MPI

    if not MPI.Get_library_version().startswith("Open MPI"):
        return ""
    lib = _libmpi()
    # At MPI's own thread level: Open MPI takes MPI_T's level as the library's, and a lower one would leave
    # hvdplus's threads calling an MPI that no longer serialises them.
    if lib is None or lib.MPI_T_init_thread(MPI.Query_thread(), ctypes.byref(ctypes.c_int())) != 0:
        return ""
    try:
        han = int_control_variable(lib, "coll_han_priority")
        tuned = int_control_variable(lib, "coll_tuned_priority")
    finally:
        lib.MPI_T_finalize()
    if han is None or han <= 0 or han <= (tuned or 0):
        return ""
    return (
        f"Open MPI's han component already reduces across hosts hierarchically (coll_han_priority {han} > "
        f"coll_tuned_priority {tuned}); the flat call is the faster one. To measure hvdplus's hierarchical "
        "collectives instead, run with --mpi-args='--mca coll ^han'"
    )
