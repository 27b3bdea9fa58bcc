"""Horovod's public API that hvdplus covers, in one place: the functions and classes with Horovod 0.28.1's
parameters in order (horovod_torch_api.txt, horovod_tensorflow_api.txt beside this file) and the objects each
module must have. The contract tests check hvdplus against it; scripts/docs_generate.py turns it into the
migrating page's coverage tables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TORCH_OBJECTS = (
    "Average",
    "Sum",
    "Min",
    "Max",
    "Product",
    "Adasum",
    "Compression",
    "ProcessSet",
    "global_process_set",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
)
TF_OBJECTS = ("Average", "Sum", "Adasum", "Compression", "ProcessSet", "global_process_set", "HorovodInternalError")
# The modules that must have TF_OBJECTS (hvdplus.tensorflow.keras is hvdplus.keras).
TF_OBJECT_MODULES = ("hvdplus.tensorflow", "hvdplus.tensorflow.keras")


@dataclass(frozen=True)
class ContractEntry:
    """One Horovod name of a contract list: hvdplus module, dotted name, parameters, and the comment above it."""

    module: str
    name: str
    params: tuple[str, ...]
    note: str


def read_contract(path: Path, default_module: str | None = None) -> list[ContractEntry]:
    """Parse a contract list: `name(params)` lines (`module name(params)` without `default_module`); a comment
    after the file's header belongs to the next entry."""
    entries: list[ContractEntry] = []
    comments: list[str] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            if entries:  # the comments before the first entry are the file's header
                comments.append(line.lstrip("# ").strip())
            continue
        module, call = (default_module, line) if default_module else line.split(" ", 1)
        name, params = call.rstrip(")").split("(")
        args = tuple(p.strip() for p in params.split(",") if p.strip())
        entries.append(ContractEntry(str(module), name, args, " ".join(comments)))
        comments = []
    return entries


def contract(framework: str) -> tuple[list[ContractEntry], list[tuple[str, str]]]:
    """The contract of "torch" or "tensorflow": its entries, and its objects as (module, name) pairs."""
    if framework == "torch":
        entries = read_contract(HERE / "horovod_torch_api.txt", "hvdplus.torch")
        return entries, [("hvdplus.torch", name) for name in TORCH_OBJECTS]
    entries = read_contract(HERE / "horovod_tensorflow_api.txt")
    return entries, [(module, name) for module in TF_OBJECT_MODULES for name in TF_OBJECTS]
