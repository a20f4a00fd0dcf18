"""`python -m factory.engines.script MODULE ARG...`: a tool's own script (exllamav2's convert_exl2, exllamav3's
convert_model) as __main__ with those arguments, then the peak GPU memory it allocated as a `[PEAK_GPU_BYTES]N`
line, which the engines' parsers turn into an event (for VRAM planning and the step's record).

Run with -m, it is imported once, as __main__ (or by a wrapper that prepares the tool first: exl3/compat.py).
"""

from __future__ import annotations

import runpy
import sys

from factory.engines.child import PEAK


def main() -> None:
    import torch

    script = sys.argv[1]
    sys.argv = [script, *sys.argv[2:]]
    try:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    finally:
        if torch.cuda.is_available():
            print(f"{PEAK}{torch.cuda.max_memory_allocated()}", flush=True)


if __name__ == "__main__":
    main()
