"""llama.cpp's convert_hf_to_gguf.py, run as __main__ with the pinned llama.cpp's own `conversion` and `gguf-py` first
on the path (not the `gguf` package a venv may hold):

    python -m factory.engines.gguf.convert LLAMA_CPP_DIR SRC --outtype f16 --outfile OUT.gguf

One thing added: the converter names a BPE vocabulary's pre-tokenizer by hashing how it tokenizes a test string, so
a vocabulary it has not seen (a tokenizer trained here, as the tests' tiny model's) is refused even when its
pre-tokenizer is GPT-2's exactly. Where the source's tokenizer.json says so (a lone ByteLevel with GPT-2's regex, no
prefix space), an unrecognized hash is taken as llama.cpp's `gpt-2`; any other is still refused.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def gpt2_pre_tokenizer(source: Path) -> bool:
    try:
        pre = json.loads((source / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return False
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)


def main() -> None:
    llama_dir, args = Path(sys.argv[1]), sys.argv[2:]
    sys.path[:0] = [str(llama_dir), str(llama_dir / "gguf-py")]
    if gpt2_pre_tokenizer(Path(args[0])):
        from conversion import base

        named = base.TextModel.get_vocab_base_pre

        def pre_tokenizer(self, tokenizer) -> str:
            try:
                return named(self, tokenizer)
            except NotImplementedError:
                return "gpt-2"

        base.TextModel.get_vocab_base_pre = pre_tokenizer
    script = llama_dir / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
