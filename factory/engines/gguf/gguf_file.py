"""What a .gguf file is called, and what it says about itself: its metadata (key -> value), read from the header
without the tensors, so the engine can check what llama.cpp wrote (the file type asked for). GGUF v3: magic, version,
tensor count, metadata count, then each key (a length-prefixed string), its value type and value."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
ARRAY_KEPT = 64  # arrays longer than this (a vocabulary) are skipped: their length is kept, not their items


def stem(model: str) -> str:
    """The files' name: the source's name as its owner wrote it, in characters every filesystem and the Hub take."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip(".-") or "model"


def name(model: str, type_: str) -> str:
    """`SmolLM2-135M-Instruct-Q4_K_M.gguf`, as uploaders name each type's file (`-imatrix` for the matrix)."""
    return f"{stem(model)}-{type_}.gguf"


def mmproj_name(model: str) -> str:
    """`mmproj-gemma-3-4b-it-F16.gguf`: a vision-language model's projector (and vision tower), as llama.cpp's
    multimodal tools load it beside the language model's file (`--mmproj`) and uploaders name it."""
    return f"mmproj-{stem(model)}-F16.gguf"


def model_files(folder: Path) -> list[Path]:
    """The quant's .gguf files in `folder`, not the importance matrix nor the vision projector: one, or gguf-split's
    parts in their order (`-00001-of-0000K.gguf` first, which llama.cpp loads, finding the others beside it)."""
    return sorted(
        p
        for p in Path(folder).glob("*.gguf")
        if not p.name.endswith("-imatrix.gguf") and not p.name.startswith("mmproj-")
    )


def mmproj_file(folder: Path) -> Path | None:
    """The vision projector's file in `folder`, where the model has one."""
    return next(iter(sorted(Path(folder).glob("mmproj-*.gguf"))), None)


def _read(f: BinaryIO, fmt: str):
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("the file ends inside its metadata")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int):
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == STRING:
        return _string(f)
    if kind == ARRAY:
        item, n = _read(f, "<I"), _read(f, "<Q")
        if n > ARRAY_KEPT and item in _SCALARS:
            f.seek(n * struct.calcsize(_SCALARS[item]), 1)
            return n
        values = [_value(f, item) for _ in range(n)]
        return values if n <= ARRAY_KEPT else n
    raise ValueError(f"unknown metadata type {kind}")


def metadata(path: Path) -> dict:
    """The file's metadata; ValueError where it is not a GGUF file."""
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise ValueError(f"{path.name} is not a GGUF file")
        meta = {"gguf.version": _read(f, "<I"), "gguf.tensor_count": _read(f, "<Q")}
        for _ in range(_read(f, "<Q")):
            key = _string(f)
            meta[key] = _value(f, _read(f, "<I"))
    return meta
