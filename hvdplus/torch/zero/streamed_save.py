"""Write a `torch.save` file one tensor at a time, so that a checkpoint bigger than memory can be written.

`torch.save(obj)` needs every tensor of `obj` in memory when it pickles. StreamedSave writes each tensor's bytes
into the zip archive as soon as it is handed over (and returns a small placeholder), then pickles the structure
of placeholders at the end, in the format `torch.save` writes: `torch.load` (weights_only=True, mmap=True
included) reads the file as if `torch.save` had written it."""

from __future__ import annotations

import collections
import io
import os
import pickle
import sys
from typing import Any, SupportsIndex

import torch

__all__ = ["StreamedSave"]


class _StorageRef:
    """Stands for one written storage in the pickle (a persistent id, as torch.save writes storages)."""

    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _WrittenTensor:
    """What `StreamedSave.tensor` returns: pickles as the tensor whose bytes are already in the archive."""

    __slots__ = ("storage", "shape")

    def __init__(self, storage: _StorageRef, shape: torch.Size) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        stride = torch.empty(self.shape, device="meta").stride()
        return torch._utils._rebuild_tensor_v2, (
            self.storage,
            0,
            tuple(self.shape),
            stride,
            False,
            collections.OrderedDict(),
        )


class StreamedSave:
    """`with StreamedSave(path) as out: obj = {"w": out.tensor(t), ...}; out.finish(obj)`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._writer = torch._C.PyTorchFileWriter(str(path))
        self._count = 0

    def tensor(self, tensor: torch.Tensor) -> _WrittenTensor:
        """Write `tensor`'s values now; the returned placeholder goes where the tensor would in the object."""
        data = tensor.detach().contiguous().cpu()
        key = str(self._count)
        self._count += 1
        storage = data.untyped_storage()
        if data.storage_offset() or storage.nbytes() != data.numel() * data.element_size():
            data = data.clone()
            storage = data.untyped_storage()
        # The binding takes an UntypedStorage (torch.save passes one); its stub lists only Storage.
        self._writer.write_record(f"data/{key}", storage, storage.nbytes())  # type: ignore[arg-type]
        return _WrittenTensor(_StorageRef(key, data.dtype, data.numel()), data.shape)

    def finish(self, obj: Any) -> None:
        """Pickle `obj` (with placeholders from `tensor`) and close the archive."""
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=2)
        pickler.persistent_id = self._persistent_id  # type: ignore[method-assign]
        pickler.dump(obj)
        value = buffer.getvalue()
        self._writer.write_record("data.pkl", value, len(value))
        for name, text in ((".format_version", "1"), (".storage_alignment", "64"), ("byteorder", sys.byteorder)):
            data = text.encode()
            self._writer.write_record(name, data, len(data))
        self._writer.write_end_of_file()

    def _persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        """torch.save's persistent ids: placeholders, and the storages of small tensors left in `obj`."""
        if isinstance(obj, _StorageRef):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return "storage", storage_type, obj.key, "cpu", obj.numel
        if isinstance(obj, torch.storage.TypedStorage):
            ref = self.tensor(torch.empty(0, dtype=obj.dtype).set_(obj._untyped_storage.cpu()))
            return self._persistent_id(ref.storage)
        return None

    def __enter__(self) -> StreamedSave:
        return self

    def __exit__(self, *exc: Any) -> None:
        del self._writer
