"""What llama.cpp itself allocates for a GGUF file at a context: the model, KV cache and compute buffers its load log
prints (`CPU_Mapped model buffer size = 0.57 MiB`, `CPU KV buffer size`, `CPU compute buffer size`), read from
llama-imatrix at the pinned version with one sequence of `ctx` tokens (`-c ctx -b ctx`: a micro-batch of 512 tokens,
fewer for a shorter context, as llama-cli and llama-server run by default). The tests hold GGUF's memory model
(factory/engines/gguf/memory.py) to these numbers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from calibration import builtin_text
from factory.engines.gguf import llama

BUFFER = re.compile(r"(model|KV|compute) buffer size =\s*([\d.]+) MiB")
NAMES = {"model": "weights", "KV": "cache", "compute": "compute"}


def allocated(path: Path, ctx: int, work: Path) -> dict[str, float]:
    """{"weights", "cache", "compute"} in bytes (each to the log's 0.01 MiB), summed over llama.cpp's buffers."""
    text = work / "text.txt"
    text.write_text(builtin_text("wiki")[: 40 * ctx])
    cmd = [str(llama.tool("llama-imatrix")), "-lv", "4", "-m", str(path), "-f", str(text), "-o", str(work / "m.gguf")]
    done = subprocess.run(
        [*cmd, "-c", str(ctx), "-b", str(ctx), "--chunks", "1", "-t", "1"], capture_output=True, text=True, check=True
    )
    sizes = {name: 0.0 for name in NAMES.values()}
    for kind, mib in BUFFER.findall(done.stdout + done.stderr):
        sizes[NAMES[kind]] += float(mib) * 2**20
    assert all(sizes.values()), done.stderr[-2000:]
    return sizes
