"""`python -m factory.engines.gguf.build` (scripts/setup runs it): llama.cpp built once on this machine (llama.py),
or found already built. A failure is one sentence on stderr and its exit code (factory/errors.py: 1)."""

import sys
import time

from factory.engines.gguf import llama
from factory.errors import FactoryError

if __name__ == "__main__":
    start = time.monotonic()
    try:
        made = llama.build()
    except FactoryError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    print(f"llama.cpp ({llama.version()}, {llama.flavour()}) is in {made} ({time.monotonic() - start:.0f} s)")
