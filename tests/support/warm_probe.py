"""A stand-in engine child (tests/integration/test_warm.py): `python -m tests.support.warm_probe MODE [ARG]` sends one
event saying how it started (argv, working folder, environment, umask, whether torch was imported before it ran, its
pid and its parent's; with `report`, the CPU seconds its own imports of torch and transformers took, and a numpy
matrix product), writes a line to stderr, then by MODE: `report` ends, `exit N` exits N, `raise` raises, `kill
SIGNAL` sends itself SIGNAL, `sleep` waits to be killed, `unflushed` writes a line to stdout without flushing it and
waits to be killed."""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import sys
import time

PRELOADED = "torch" in sys.modules  # before anything here imports it


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    mode, *args = sys.argv[1:]
    before = cpu_seconds()
    blas = None
    if mode == "report":
        for name in ("torch", "transformers", "transformers.modeling_utils"):
            importlib.import_module(name)
        import numpy

        signal.alarm(60)  # a BLAS whose threads did not survive the fork hangs: fail instead
        blas = float((numpy.ones((512, 512)) @ numpy.ones((512, 512))).sum())
        signal.alarm(0)
    umask = os.umask(0)
    os.umask(umask)
    event = {
        "event": "probe",
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "umask": umask,
        "preloaded": PRELOADED,
        "import_seconds": cpu_seconds() - before,
        "blas": blas,  # numpy's matrix product (OpenBLAS) of two 512 x 512 matrices of ones, summed
        "pid": os.getpid(),
        "ppid": os.getppid(),
    }
    print(json.dumps(event), flush=True)
    print("the probe's stderr", file=sys.stderr, flush=True)
    if mode == "exit":
        sys.exit(int(args[0]))
    if mode == "raise":
        raise ValueError("the probe raised")
    if mode == "kill":
        os.kill(os.getpid(), signal.Signals[args[0]])
    if mode == "unflushed":
        print("unflushed")
    if mode in ("sleep", "unflushed"):
        time.sleep(600)


if __name__ == "__main__":
    main()
