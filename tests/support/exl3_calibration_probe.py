"""What exllamav3 1.6.5's measure_model does with its calibration before any kernel runs, on any machine: it imports
get_default_calibration by name when it runs (`from .calibration_data import get_default_calibration`) and calls it
with its arguments and the source's tokenizer (`prepare_state`). This does the same and prints the rows it got as one
JSON line, for tests of the factory's measure wrapper (factory/engines/exl3/optimize.py's main), under
tests/support/exl3_cpu.py:

    python -m tests.support.exl3_cpu factory.engines.exl3.optimize CAL.safetensors \
        tests.support.exl3_calibration_probe -i SOURCE -cr ROWS -cc LENGTH
"""

from __future__ import annotations

import json
import sys

from exllamav3 import Config, Tokenizer
from exllamav3.conversion.calibration_data import get_default_calibration

if __name__ == "__main__":
    argv = sys.argv[1:]
    source, rows, length = (argv[argv.index(flag) + 1] for flag in ("-i", "-cr", "-cc"))
    tokenizer = Tokenizer.from_config(Config.from_directory(source))
    state = get_default_calibration({"cal_rows": int(rows), "cal_cols": int(length)}, tokenizer)
    print(json.dumps([row.flatten().tolist() for row in state[: int(rows)]]))
