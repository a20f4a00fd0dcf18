"""`python -I -S factory/engines/fence.py PATH MARK PID`: the watchdog of one engine child (factory/engines/child.py
`fenced`). Every POLL_SECONDS it reads PATH; once PATH does not hold MARK (another process took the unit over and
wrote its own mark: this engine's parent lost its claim, and may be stopped, unable to stop it), it SIGKILLs PID,
so that the engine writes nothing more into a folder that is no longer its own. It ends when PID does, and gets
SIGKILL from its parent when the engine ends (or SIGTERM when its parent dies). It imports the standard library
alone, so that it starts as a script, isolated and without site-packages, in a hundredth of a second of CPU.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

POLL_SECONDS = 0.5


def held(path: Path, mark: str) -> bool:
    try:
        return path.read_text() == mark
    except FileNotFoundError:  # its folder was removed: nothing the engine writes there is wanted
        return False
    except OSError:
        return True  # unreadable for a moment: the next poll decides


def main() -> None:
    path, mark, pid = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if not held(path, mark):
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(POLL_SECONDS)


if __name__ == "__main__":
    main()
