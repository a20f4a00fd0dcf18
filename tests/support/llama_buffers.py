"""What llama.cpp itself allocates for a GGUF file at a context: the model, KV cache and compute buffers its load log
prints (`CPU_Mapped model buffer size = 0.57 MiB`, `CPU KV buffer size`, `CPU compute buffer size`), read from
llama-imatrix at the pinned version with one sequence of `ctx` tokens (`-c ctx -b ctx`: a micro-batch of 512 tokens,
fewer for a shorter context, as llama-cli and llama-server run by default), stopped once it has made its context
and begins to tokenize (a pass over 8192 tokens on one thread took 5 minutes and allocates nothing more). The tests
hold GGUF's memory model (factory/engines/gguf/memory.py) to these numbers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from calibration import builtin_text
from factory.engines.gguf import llama

BUFFER = re.compile(r"(model|KV|compute) buffer size =\s*([\d.]+) MiB")
ALLOCATED = "compute_imatrix: tokenizing the input"  # the first line after the context's buffers
NAMES = {"model": "weights", "KV": "cache", "compute": "compute"}


def allocated(path: Path, ctx: int, work: Path) -> dict[str, float]:
    """{"weights", "cache", "compute"} in bytes (each to the log's 0.01 MiB), summed over llama.cpp's buffers."""
    text = work / "text.txt"
    text.write_text(builtin_text("wiki")[: 40 * ctx])
    cmd = [str(llama.tool("llama-imatrix")), "-lv", "4", "-m", str(path), "-f", str(text), "-o", str(work / "m.gguf")]
    log = []
    with subprocess.Popen(
        [*cmd, "-c", str(ctx), "-b", str(ctx), "--chunks", "1", "-t", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as tool:
        for line in tool.stdout:
            log.append(line)
            if ALLOCATED in line:
                tool.kill()
                break
    assert log and ALLOCATED in log[-1], "".join(log[-40:]) or "llama-imatrix printed nothing"
    sizes = {name: 0.0 for name in NAMES.values()}
    for kind, mib in BUFFER.findall("".join(log)):
        sizes[NAMES[kind]] += float(mib) * 2**20
    assert all(sizes.values()), "".join(log[-40:])
    return sizes
