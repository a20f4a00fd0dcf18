"""Calibration and evaluation text, by name.

Names:
    builtin:<name>   the text files shipped inside the exllamav2 wheel: c4, code, multilingual, technical,
                     tiny, wiki (read from its folder; exllamav2 is never imported here)
    file:<path>      a UTF-8 text file of your own (.txt)

Every text set carries the sha256 of its content, so a result made from it can name exactly what it saw.
Token windows are chosen deterministically (`token_windows`): the same text, tokenizer, rows and length
always give the same windows.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from factory.errors import SpecError

BUILTIN = ("c4", "code", "multilingual", "technical", "tiny", "wiki")
KINDS = ("builtin", "file")
FILE_SUFFIXES = (".txt",)


@dataclass(frozen=True)
class TextSet:
    name: str
    text: str
    sha256: str


def builtin_folder() -> Path:
    """exllamav2's standard_cal_data folder, found without running exllamav2's __init__ (it builds CUDA code)."""
    spec = importlib.util.find_spec("exllamav2")
    if spec is None or not spec.submodule_search_locations:
        raise SpecError("builtin calibration texts need the exllamav2 package installed; use file:<path> instead")
    return Path(spec.submodule_search_locations[0]) / "conversion" / "standard_cal_data"


def builtin_text(name: str) -> str:
    return (builtin_folder() / f"{name}.utf8").read_text(encoding="utf-8")


def resolve(name: str) -> TextSet:
    """Rules: `builtin:<one of BUILTIN>` or `file:<path to an existing .txt>`.
    Valid: builtin:c4, builtin:wiki, file:/data/my_corpus.txt. Not valid: c4, builtin:pile, file:missing.txt.
    """
    kind, _, rest = name.partition(":")
    if kind == "builtin" and rest in BUILTIN:
        text = builtin_text(rest)
    elif kind == "file" and rest:
        path = Path(rest).expanduser()
        if path.suffix not in FILE_SUFFIXES:
            raise SpecError(f"text set {name!r} is not a {'/'.join(FILE_SUFFIXES)} file")
        if not path.is_file():
            raise SpecError(f"text set {name!r}: no such file {str(path)!r}")
        text = path.read_text(encoding="utf-8")
        name = f"file:{path.resolve()}"
    else:
        allowed = ", ".join(f"builtin:{b}" for b in BUILTIN)
        raise SpecError(f"unknown text set {name!r}; use one of {allowed} or file:<path to a .txt file>")
    if not text.strip():
        raise SpecError(f"text set {name!r} is empty")
    return TextSet(name=name, text=text, sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())


def token_windows(ids: list[int], rows: int, length: int, name: str) -> list[list[int]]:
    """`rows` non-overlapping windows of `length` tokens, spread evenly from the start to the end of `ids`."""
    needed = rows * length
    if len(ids) < needed:
        raise SpecError(
            f"text set {name!r} has {len(ids)} tokens, fewer than the {rows} x {length} = {needed} requested; "
            f"ask for fewer rows or shorter rows, or use a longer text"
        )
    stride = (len(ids) - length) // max(rows - 1, 1)
    return [ids[i * stride : i * stride + length] for i in range(rows)]
