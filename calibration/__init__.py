"""Calibration and evaluation text, by name.

Names:
    builtin:<name>   the text files shipped inside the exllamav2 wheel: c4, code, multilingual, technical,
                     tiny, wiki (read from its folder; exllamav2 is never imported here)
    builtin:mix      c4, code, multilingual, technical and tiny joined (no wiki): about 370k tokens, enough for
                     exllamav2's 100 x 2048 quantization rows
    file:<path>      a file of your own: .txt (UTF-8 text), .jsonl (one JSON object per line with a "text"
                     field) or .parquet (a "text" column); records are joined with blank lines

Every text set carries the sha256 of its content, so a result made from it can name exactly what it saw.
Token windows are chosen deterministically (`token_windows`): the same text, tokenizer, rows and length
always give the same windows.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from factory.errors import ModelRefused, SpecError

BUILTIN = ("c4", "code", "multilingual", "technical", "tiny", "wiki", "mix")
MIX = ("c4", "code", "multilingual", "technical", "tiny")
KINDS = ("builtin", "file")
FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
TEXT_FIELD = "text"


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
    if name == "mix":
        return "\n\n".join(builtin_text(part) for part in MIX)
    return (builtin_folder() / f"{name}.utf8").read_text(encoding="utf-8")


@functools.cache
def _builtin(name: str) -> TextSet:
    """A builtin set, read and hashed once a process: package data does not change (a service submits many jobs)."""
    return _text_set(f"builtin:{name}", builtin_text(name))


def resolve(name: str) -> TextSet:
    """Rules: `builtin:<one of BUILTIN>` or `file:<path to an existing .txt>`.
    Valid: builtin:c4, builtin:wiki, file:/data/my_corpus.txt. Not valid: c4, builtin:pile, file:missing.txt.
    """
    kind, _, rest = name.partition(":")
    if kind == "builtin" and rest in BUILTIN:
        return _builtin(rest)
    if kind == "file" and rest:
        path = Path(rest).expanduser()
        if path.suffix not in FILE_SUFFIXES:
            raise SpecError(f"text set {name!r} is not a .txt, .jsonl or .parquet file")
        if not path.is_file():
            raise SpecError(f"text set {name!r}: no such file {str(path)!r}")
        text = read_file(path, name)
        name = f"file:{path.resolve()}"
    else:
        allowed = ", ".join(f"builtin:{b}" for b in BUILTIN)
        raise SpecError(
            f"unknown text set {name!r}; use one of {allowed} or file:<path to a .txt, .jsonl or .parquet file>"
        )
    return _text_set(name, text)


def _text_set(name: str, text: str) -> TextSet:
    if not text.strip():
        raise SpecError(f"text set {name!r} is empty")
    return TextSet(name=name, text=text, sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())


def public_name(name: str) -> str:
    """A text set's name as published (manifest, card): `file:/home/alice/corpus.txt` -> `file:corpus.txt`, so
    no local path leaves the machine; its sha256 says exactly which text it was."""
    kind, _, rest = name.partition(":")
    return f"file:{Path(rest).name}" if kind == "file" else name


def read_file(path: Path, name: str) -> str:
    if path.suffix == ".txt":
        return path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line)[TEXT_FIELD])
            except (ValueError, KeyError, TypeError):
                raise SpecError(f"line {number} of {name!r} is not a JSON object with a {TEXT_FIELD!r} field") from None
        return "\n\n".join(str(r) for r in records)
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception:
        raise SpecError(f"{name!r} is not a readable parquet file") from None
    if TEXT_FIELD not in table.column_names:
        raise SpecError(f"{name!r} has no {TEXT_FIELD!r} column; its columns: {', '.join(table.column_names)}")
    return "\n\n".join(str(t) for t in table.column(TEXT_FIELD).to_pylist() if t is not None)


def available(folder: Path | None = None) -> list[TextSet]:
    """The builtin sets, then the files in `folder` (FACTORY_HOME/texts) that `file:` can name."""
    names = [f"builtin:{b}" for b in BUILTIN]
    if folder is not None and folder.is_dir():
        names += [f"file:{p}" for p in sorted(folder.iterdir()) if p.suffix in FILE_SUFFIXES]
    return [resolve(n) for n in names]


def check_length(ids: list[int], rows: int, length: int, name: str) -> None:
    needed = rows * length
    if len(ids) < needed:
        raise SpecError(
            f"text set {name!r} has {len(ids)} tokens, fewer than the {rows} x {length} = {needed} requested; "
            f"ask for fewer rows or shorter rows, or use a longer text"
        )


def check_vocabulary(ids: list[int], vocab: int, name: str) -> None:
    """Every id of a text's tokens must have a row in the model's embedding (`vocab`, config.json's vocab_size):
    an id past it is a tokenizer that does not belong to the weights, which a converter refuses (exllamav3:
    "Calibration file contains token ids outside the model's vocab") or reads out of bounds."""
    top = max(ids, default=-1)
    if top >= vocab:
        raise ModelRefused(
            f"the checkpoint's tokenizer turns text set {name!r} into token id {top}, past the model's vocabulary of "
            f"{vocab} (config.json vocab_size): its tokenizer and its weights do not belong together"
        )


def write_parquet(text: TextSet, path: Path) -> Path:
    """The text as a one-row parquet file with a "text" column, for tools that read calibration from parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({TEXT_FIELD: [text.text]}), path)
    return path


def read_parquet(path: Path) -> str:
    """The text `write_parquet` wrote."""
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=[TEXT_FIELD]).column(TEXT_FIELD)[0].as_py()


def token_windows(ids: list[int], rows: int, length: int, name: str) -> list[list[int]]:
    """`rows` non-overlapping windows of `length` tokens, spread evenly from the start to the end of `ids`."""
    check_length(ids, rows, length, name)
    stride = (len(ids) - length) // max(rows - 1, 1)
    return [ids[i * stride : i * stride + length] for i in range(rows)]
