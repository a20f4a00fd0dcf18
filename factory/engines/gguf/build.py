"""`python -m factory.engines.gguf.build` (scripts/setup runs it): llama.cpp built once on this machine (llama.py),
or found already built."""

import time

from factory.engines.gguf import llama

if __name__ == "__main__":
    start = time.monotonic()
    made = llama.build()
    print(f"llama.cpp ({llama.version()}, {llama.flavour()}) is in {made} ({time.monotonic() - start:.0f} s)")
