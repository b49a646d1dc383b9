"""Hugging Face checkpoint files: find them, read them tensor by tensor, write them in shards.

What ``save_pretrained`` writes, in the order ``from_pretrained`` looks for it:

- ``model.safetensors.index.json`` + ``model-0000i-of-0000n.safetensors`` (sharded),
- ``model.safetensors``,
- ``pytorch_model.bin.index.json`` + ``pytorch_model-0000i-of-0000n.bin``,
- ``pytorch_model.bin``.

``CheckpointReader`` never loads a file whole: a safetensors file is a JSON
header of byte offsets followed by raw little-endian tensors, so a tensor, or a
flat element range of one, is read with one positioned read (``os.preadv``)
into a fresh tensor, and nothing stays mapped (a memory map would leave every
page read counted in the rank's RSS until the file is closed). ``.bin`` files
are memory-mapped (``torch.load(mmap=True)``). A reader's footprint is the
tensor (or range) asked for. ``ShardWriter`` is the reverse:
it is told every tensor's name and size up front, plans HF-named shards under
``max_shard_bytes`` in that order, and writes each shard as soon as its last
tensor arrives, so a writer holds at most one shard.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import TypeGuard

import torch

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 << 30
"""Shard size when none is given (DeepSpeed/accelerate's 5 GB-class default, in bytes)."""

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class CheckpointError(ValueError):
    """A checkpoint (HF or ZeRO) cannot be read: a file is missing or malformed, a name
    leads out of the checkpoint's directory, or a count disagrees with what is on disk.
    The message names the file and the entry and says what to change."""


def path_inside(directory: str | os.PathLike[str], name: object, *, what: str,
                also_inside: Iterable[Path] = ()) -> Path:
    """``directory / name`` for a ``name`` read from a checkpoint's own files.

    A checkpoint handed over by someone else reads only inside its directory: ``name``
    must be a relative path without ``..`` parts, and the file it names, symlinks
    followed, must lie inside ``directory`` (or one of ``also_inside``: the blob store of
    a Hugging Face cache snapshot). Anything else raises ``CheckpointError`` naming
    ``what`` (the file and entry the name came from). Returns the path as named, not
    resolved: a ``.safetensors`` symlink into an HF cache keeps its suffix.
    """
    directory = Path(directory)
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{what} must name a file inside {directory}, got {name!r}")
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise CheckpointError(
            f"{what} names {name!r}, which is not inside {directory}: a checkpoint may only "
            f"name files in its own directory (a relative path without '..'); fix the entry "
            f"or copy the file into the checkpoint")
    path = directory / relative
    target = path.resolve()
    roots = [root.resolve() for root in (directory, *also_inside)]
    if not any(target.is_relative_to(root) for root in roots):
        raise CheckpointError(
            f"{what} names {name!r}, a symlink to {target}, outside {directory}: a checkpoint "
            f"may only read files in its own directory; replace the link by the file")
    return path


def _hf_cache_blobs(directory: Path) -> list[Path]:
    """Where the files of a Hugging Face cache snapshot (``.../snapshots/<rev>``) live."""
    if directory.parent.name == "snapshots":
        return [directory.parent.parent / "blobs"]
    return []


def parse_size(size: int | str) -> int:
    """``"5GB"``, ``"200MiB"`` or an int, in bytes (HF's ``max_shard_size`` spelling)."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be > 0 bytes, got {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
    if match is None or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"max_shard_size={size!r} is not a size; use an int (bytes) or a "
                         f"string such as '5GB' or '200MiB'")
    return parse_size(int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]))


# ---------------------------------------------------------------------------
# reading


def checkpoint_files(path: str | os.PathLike[str]) -> list[Path]:
    """The weight files of a ``save_pretrained`` directory (or one weight file), in order;
    every one inside the directory (``path_inside``)."""
    path = Path(path)
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _indexed_files(path)
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path} is neither a checkpoint directory nor a weight file")
    blobs = _hf_cache_blobs(path)
    for index_name, single in ((SAFE_INDEX, SAFE_WEIGHTS), (BIN_INDEX, BIN_WEIGHTS)):
        if (path / index_name).exists():
            path_inside(path, index_name, what=f"{path}'s index", also_inside=blobs)
            return _indexed_files(path / index_name)
        if (path / single).exists():
            return [path_inside(path, single, what=f"{path}'s weights", also_inside=blobs)]
    raise CheckpointError(f"{path} has no {SAFE_INDEX}, {SAFE_WEIGHTS}, {BIN_INDEX} or "
                          f"{BIN_WEIGHTS}; point at the directory save_pretrained wrote")


def _indexed_files(index_path: Path) -> list[Path]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{index_path} is not JSON ({error})") from error
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path} has no 'weight_map' object")
    names = dict.fromkeys(weight_map.values())
    if not names:
        raise CheckpointError(f"{index_path} has an empty weight_map")
    blobs = _hf_cache_blobs(index_path.parent)
    files = [path_inside(index_path.parent, name, what=f"{index_path}'s weight_map",
                         also_inside=blobs) for name in names]
    missing = [str(file) for file in files if not file.exists()]
    if missing:
        raise CheckpointError(f"{index_path} names shard(s) that do not exist: {missing}")
    return files


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


MAX_SAFETENSORS_HEADER_NBYTES = 100 << 20
"""Largest safetensors JSON header read (the safetensors library's own limit)."""


class _SafetensorsFile:
    """One safetensors file read by byte range (header: 8-byte length, then JSON).

    Every count in the header is checked against the file's size before anything is
    allocated from it: a tensor's bytes must lie inside the file and match its shape.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as file:
            file_nbytes = os.fstat(file.fileno()).st_size
            (length,) = struct.unpack("<Q", file.read(8).ljust(8, b"\0"))
            if not 0 < length <= min(file_nbytes - 8, MAX_SAFETENSORS_HEADER_NBYTES):
                raise CheckpointError(f"{path}: its header claims {length} bytes, but the "
                                      f"file holds {file_nbytes}; it is not a safetensors file")
            try:
                header = json.loads(file.read(length))
            except (ValueError, RecursionError) as error:
                raise CheckpointError(f"{path}: its header is not JSON ({error})") from error
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: its header is not a JSON object")
        header.pop("__metadata__", None)
        self.data_start = 8 + length
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {
            name: self._entry(name, entry, file_nbytes - self.data_start)
            for name, entry in header.items()}

    def _entry(self, name: str, entry: object,
               data_nbytes: int) -> tuple[torch.dtype, tuple[int, ...], int]:
        """A header entry as (dtype, shape, file offset), its counts checked."""
        if not isinstance(entry, dict) or entry.get("dtype") not in _SAFETENSORS_DTYPES:
            dtype = entry.get("dtype") if isinstance(entry, dict) else entry
            raise CheckpointError(f"{self.path}: tensor {name} has dtype {dtype!r}, "
                                  f"which this reader does not support")
        dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (_counts(shape) and _counts(offsets) and len(offsets) == 2
                and offsets[0] <= offsets[1] <= data_nbytes
                and offsets[1] - offsets[0] == math.prod(shape) * dtype.itemsize):
            raise CheckpointError(
                f"{self.path}: tensor {name} has shape {shape!r} and data_offsets "
                f"{offsets!r}, which do not fit its dtype and the file's "
                f"{data_nbytes} data bytes; the file is damaged or not safetensors")
        return dtype, tuple(shape), self.data_start + offsets[0]

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor, as a new 1-D tensor."""
        dtype, shape, offset = self.entries[name]
        if start < 0 or stop > math.prod(shape):
            raise CheckpointError(f"{self.path}: elements [{start}, {stop}) asked of tensor "
                                  f"{name}, which has {math.prod(shape)}")
        out = torch.empty(max(stop - start, 0), dtype=dtype)
        nbytes = out.numel() * out.element_size()
        if nbytes == 0:
            return out
        view = memoryview(out.view(torch.uint8).numpy())  # type: ignore[arg-type]
        descriptor = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            position, done = offset + start * out.element_size(), 0
            while done < nbytes:
                got = os.preadv(descriptor, [view[done:]], position + done)
                if got == 0:
                    raise CheckpointError(f"{self.path} is truncated inside tensor {name}")
                done += got
        finally:
            os.close(descriptor)
        return out


def _counts(value: object) -> TypeGuard[list[int]]:
    """A list of non-negative ints (a shape, a pair of offsets), as JSON gives them."""
    return isinstance(value, list) and all(
        type(item) is int and item >= 0 for item in value)


class CheckpointReader:
    """Tensors of an HF checkpoint by name, read lazily (see module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._safe: dict[Path, _SafetensorsFile] = {}
        self._bin: dict[Path, dict[str, torch.Tensor]] = {}
        self._file_of: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        for file in checkpoint_files(path):
            for name, shape in self._open(file).items():
                self._file_of[name] = file
                self._shape[name] = shape

    def _open(self, file: Path) -> dict[str, tuple[int, ...]]:
        if file.suffix == ".safetensors":
            handle = _SafetensorsFile(file)
            self._safe[file] = handle
            return {name: shape for name, (_, shape, _) in handle.entries.items()}
        try:
            tensors = torch.load(file, mmap=True, weights_only=True, map_location="cpu")
        except RuntimeError as error:
            raise CheckpointError(f"{file} cannot be memory-mapped ({error}); re-save it with "
                                  f"save_pretrained (safetensors) to stream it") from error
        self._bin[file] = tensors
        return {name: tuple(value.shape) for name, value in tensors.items()}

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (a fresh tensor, or a view of the mapped ``.bin``)."""
        file = self._file_of[name]
        if file in self._safe:
            shape = self._shape[name]
            return self._safe[file].read(name, 0, math.prod(shape)).view(shape)
        return self._bin[file][name]

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``name`` (only those bytes)."""
        file = self._file_of[name]
        if file in self._safe:
            return self._safe[file].read(name, start, stop)
        return self._bin[file][name].reshape(-1)[start:stop]


# ---------------------------------------------------------------------------
# writing


class ShardWriter:
    """Writes named tensors into HF-named shards as they arrive (see module docstring).

    ``sizes`` lists every tensor's name and byte size in the order ``add`` will be
    called. ``weights_name`` is the single-file name (``model.safetensors``,
    ``pytorch_model.bin``); several shards are named as HF names them
    (``model-00001-of-00003.safetensors``) with ``<weights_name>.index.json``.
    """

    def __init__(self, directory: str | os.PathLike[str], sizes: Iterable[tuple[str, int]], *,
                 weights_name: str = SAFE_WEIGHTS,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        self.fmt = weights_format(weights_name)
        self.directory = Path(directory)
        self.weights_name = weights_name
        self._plan = _plan_shards(list(sizes), max_shard_bytes)
        self._shard_of = {name: i for i, shard in enumerate(self._plan) for name in shard}
        self._pending: list[dict[str, torch.Tensor]] = [{} for _ in self._plan]
        self.total_bytes = 0
        self.files: list[Path] = []
        self._written: set[int] = set()

    @property
    def index_name(self) -> str:
        return self.weights_name + ".index.json"

    def filename(self, shard: int) -> str:
        if len(self._plan) == 1:
            return self.weights_name
        stem, dot, ext = self.weights_name.rpartition(".")
        return f"{stem}-{shard + 1:05d}-of-{len(self._plan):05d}{dot}{ext}"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        shard = self._shard_of[name]
        self._pending[shard][name] = tensor.detach().contiguous()
        if len(self._pending[shard]) == len(self._plan[shard]):
            self._write(shard)

    def _write(self, shard: int) -> None:
        tensors, self._pending[shard] = self._pending[shard], {}
        ordered = {name: tensors[name] for name in self._plan[shard]}
        self.total_bytes += sum(t.numel() * t.element_size() for t in ordered.values())
        target = self.directory / self.filename(shard)
        partial = target.with_name(target.name + ".partial")
        if self.fmt == "safetensors":
            from safetensors.torch import save_file

            save_file(ordered, str(partial), metadata={"format": "pt"})
        else:
            torch.save(ordered, partial)
        os.replace(partial, target)
        self.files.append(target)
        self._written.add(shard)

    def finish(self) -> list[Path]:
        """Check every planned tensor arrived, write the index (several shards); the files."""
        missing = [name for i, shard in enumerate(self._plan) if i not in self._written
                   for name in shard if name not in self._pending[i]]
        assert not missing, f"tensors planned but never added: {missing}"
        if len(self._plan) > 1:
            index_name = self.index_name
            weight_map = {name: self.filename(i) for i, shard in enumerate(self._plan)
                          for name in shard}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / index_name).write_text(json.dumps(index, indent=2) + "\n",
                                                     encoding="utf-8")
        return self.files


TORCH_SAVE_SUFFIXES = (".bin", ".pt", ".pth")
"""Names of torch.save weight files (a state dict in one file, or HF's ``.bin`` shards)."""


def weights_format(weights_name: str) -> str:
    """``"safetensors"`` or ``"bin"`` (torch.save) from a weight file's name."""
    if weights_name.endswith(".safetensors"):
        return "safetensors"
    if weights_name.endswith(TORCH_SAVE_SUFFIXES):
        return "bin"
    raise ValueError(f"weight file name {weights_name!r} must end in .safetensors (HF's "
                     f"default) or .bin/.pt/.pth (torch.save)")


def _plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive names grouped under ``max_shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def remove_stale_weights(directory: Path) -> None:
    """Drop weight files and indexes a previous export left, so HF cannot mix them up."""
    pattern = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)"
                         r"|(model\.safetensors|pytorch_model\.bin)\.index\.json")
    for entry in directory.iterdir():
        if entry.is_file() and pattern.fullmatch(entry.name):
            entry.unlink()
