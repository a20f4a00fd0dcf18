"""exllamav3 1.6.5 cannot read or convert a text-only Gemma 3 checkpoint as it is. Its Gemma3TextModel passes
key_prefix "" to a parent that names every module f"{key_prefix}.model.…", so (H200, 2026-12-01):
- it asks the checkpoint (google/gemma-3-270m's layout: `model.embed_tokens.weight`) for
  `.model.embed_tokens.weight` (`ValueError: Required tensor .model.embed_tokens.weight not found`);
- its conversion saves each module's tensors as `qtensors/.model.layers.N.safetensors`, a hidden file that its
  loader's glob("*.safetensors") never sees, so the compile step finds no tensors, skips every module and writes a
  quant without weights, and exits 0 (the factory's output check refuses such a quant: engine.check_output).

Until exllamav3 fixes it, the conversion and the evaluations read such folders with the dot added to the
checkpoint's names, the way exllamav3 renames tensors itself (its tensor_name_fixes, in the same function), and
with hidden safetensors files listed. The quant then holds exllamav3 1.6.5's own names (`.model.…`, `.lm_head.…`),
which a stock exllamav3 1.6.5 loads as they are.

    python -m factory.engines.exl3.compat MODULE ARG... -i SOURCE ...   # factory/engines/script.py, so
"""

from __future__ import annotations

import contextlib
import glob
import sys
import threading
import types
from pathlib import Path

from factory.checkpoints.inspection import read_config
from factory.engines import script

DOTTED = frozenset({"Gemma3ForCausalLM"})  # exllamav3 1.6.5's architectures whose model class asks for ".model.…"


def needs_dots(folder: Path) -> bool:
    """A model folder (FP16 or EXL3) of such an architecture."""
    config = read_config(Path(folder) / "config.json", check_numbers=False)
    return bool(DOTTED & set(config.get("architectures") or []))


def dotted(header: dict) -> dict:
    return {f".{key}" if key.startswith("model.") else key: value for key, value in header.items()}


_READING = threading.RLock()  # reading()'s renaming, one at a time

# exllamav3's loader module looks files up through this in place of the glob module: hidden files included
WITH_HIDDEN = types.SimpleNamespace(glob=lambda pattern: glob.glob(pattern, include_hidden=True))


@contextlib.contextmanager
def reading(folder: Path):
    """While exllamav3 reads `folder` (Config.from_directory, a conversion), names its `model.…` tensors `.model.…`
    and lists hidden safetensors files (the conversion's own `.model.…` module files). One reading at a time in a
    process: the renaming is exllamav3's module-wide, so another thread's model read beside it would be renamed too
    (benchmarks/coverage.py's threads re-score pulled quants in one process: a Gemma 2 and a GLM-4 beside a Gemma 3
    asked their files for `.model.embed_tokens.weight`, 2026-12-07)."""
    with _READING:
        if not needs_dots(folder):
            yield
            return
        from exllamav3.loader import safetensors

        original, original_glob = safetensors.read_header, safetensors.glob

        def read_header(filename: str, tensor_name_fixes: dict | None) -> dict:
            return dotted(original(filename, tensor_name_fixes))

        safetensors.read_header, safetensors.glob = read_header, WITH_HIDDEN
        try:
            yield
        finally:
            safetensors.read_header, safetensors.glob = original, original_glob


def main() -> None:
    source = sys.argv[sys.argv.index("-i") + 1]
    with reading(Path(source)):
        script.main()


if __name__ == "__main__":
    main()
