"""What exllamav3 reads of a checkpoint before any kernel runs, on any machine: its config (the architecture's
class and every key it requires), the model's modules built from it and their weights loaded on the CPU (through
exllamav3's Python loader: each found, of the shape the config gives), and its tokenizer's vocabulary (what
exllamav3's conversion checks calibration ids against). Without CUDA, exllamav3's extension is replaced by an
empty module first: importing exllamav3 would build it, and reading a checkpoint never calls it.

    python -m tests.support.exl3_reads FOLDER
    # one JSON line: {"config": ..., "vocab_size": ..., "tokenizer_vocab": ...}
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from unittest import mock


def read(folder: Path) -> dict:
    import torch

    if not torch.cuda.is_available():
        ext = types.ModuleType("exllamav3.ext")
        ext.exllamav3_ext = mock.MagicMock()
        sys.modules["exllamav3.ext"] = ext
    from exllamav3 import Config, Model, Tokenizer

    from factory.engines.exl3 import compat

    with compat.reading(folder):
        config = Config.from_directory(str(folder), load_method="python")
        # every module's weights found and of the shape the config gives it (a layer kind or head width read
        # otherwise than the checkpoint was written fails here as the conversion would on a GPU)
        Model.from_config(config).load("cpu")
    return {
        "config": type(config).__name__,
        "vocab_size": config.vocab_size,
        "tokenizer_vocab": Tokenizer.from_config(config).actual_vocab_size,
    }


if __name__ == "__main__":
    print(json.dumps(read(Path(sys.argv[1]))))
