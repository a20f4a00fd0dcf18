"""exllamav3 1.6.5 cannot read a text-only Gemma 3 checkpoint: its Gemma3TextModel passes key_prefix "" to a parent
that names every module f"{key_prefix}.model.…", so it asks for `.model.embed_tokens.weight` where the checkpoint
(google/gemma-3-270m's layout) has `model.embed_tokens.weight` (H200, 2026-12-01: `ValueError: Required tensor
.model.embed_tokens.weight not found`). Its conversion writes the quant under the checkpoint's names again
(`model.…`), so a stock exllamav3 1.6.5 loads neither the FP16 model nor an EXL3 quant of it, its own included.

Until exllamav3 fixes it, the conversion and the evaluations read such folders' headers with the dot added, the way
exllamav3 renames tensors itself (its tensor_name_fixes, applied in the same function). The quant on disk keeps the
checkpoint's names, the ones a fixed exllamav3 will ask for.

    python -m factory.engines.exl3.compat MODULE ARG... -i SOURCE ...   # factory/engines/script.py, so
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from factory.inspect import read_config

DOTTED = frozenset({"Gemma3ForCausalLM"})  # exllamav3 1.6.5's architectures whose model class asks for ".model.…"


def needs_dots(folder: Path) -> bool:
    """A model folder (FP16 or EXL3) of such an architecture."""
    config = read_config(Path(folder) / "config.json", check_numbers=False)
    return bool(DOTTED & set(config.get("architectures") or []))


def dotted(header: dict) -> dict:
    return {f".{key}" if key.startswith("model.") else key: value for key, value in header.items()}


@contextlib.contextmanager
def reading(folder: Path):
    """While exllamav3 reads `folder`'s headers (Config.from_directory), names its `model.…` tensors `.model.…`."""
    if not needs_dots(folder):
        yield
        return
    from exllamav3.loader import safetensors

    original = safetensors.read_header

    def read_header(filename: str, tensor_name_fixes: dict | None) -> dict:
        return dotted(original(filename, tensor_name_fixes))

    safetensors.read_header = read_header
    try:
        yield
    finally:
        safetensors.read_header = original


def main() -> None:
    from factory.engines import script

    source = sys.argv[sys.argv.index("-i") + 1]
    with reading(Path(source)):
        script.main()


if __name__ == "__main__":
    main()
