"""The packages this engine's child runs with: llmcompressor 0.14.0.1 requires transformers 5.15 to 5.17 (and so a
huggingface-hub below 2), while the factory runs a newer transformers, on which AutoAWQ and the coverage of the
other engines were proven (5.17 breaks AutoAWQ on GPT-J: docs/measured.md).

PINS are installed (`pip install --no-deps --target`) into a folder of their own, made on first use and keyed by the
pins and the Python version, as pre-commit makes a hook's environment: `$XDG_CACHE_HOME/quantfactory/envs/awqct-<key>/`
(`~/.cache/...` by default; every FACTORY_HOME and worker of the machine shares it). The child
puts it first on its path, so it takes these packages from it and everything else (torch, tokenizers, safetensors,
accelerate, datasets, the factory) from the factory's own environment. pip's own settings apply: on a machine
without a package index, PIP_NO_INDEX=1 and PIP_FIND_LINKS=<folder of these wheels>. Made under a lock, in a
temporary folder renamed when complete, so concurrent jobs make it once and a killed install leaves nothing.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from factory.errors import JobFailed

PINS = (
    "llmcompressor==0.14.0.1",
    "compressed-tensors==0.19.0",
    "transformers==5.17.0",
    "huggingface-hub==1.33.0",
    "tokenizers==0.23.3",
    "loguru==0.7.3",
)
DONE = ".complete"


def key() -> str:
    python = f"{sys.implementation.name}{sys.version_info[0]}.{sys.version_info[1]}"
    return hashlib.sha256("\n".join((python, *PINS)).encode()).hexdigest()[:12]


def root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quantfactory" / "envs"


def folder() -> Path:
    return root() / f"awqct-{key()}"


def ensure() -> Path:
    """The packages' folder, installed first if it is not there yet."""
    target = folder()
    if (target / DONE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / DONE).is_file():  # another job made it while this one waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-compile",
                "--disable-pip-version-check",
                "--target",
                str(tmp),
                *PINS,
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONNOUSERSITE": "1"})
            if done.returncode != 0:
                last = [ln for ln in done.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
                raise JobFailed(
                    f"AWQ-CT could not install its packages ({', '.join(PINS)}) into {target}: {last[0][:300]}"
                )
            (tmp / DONE).write_text("\n".join(PINS) + "\n")
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def child_path() -> dict[str, str]:
    """The child's PYTHONPATH: the packages first, then whatever the factory's processes have."""
    paths = [str(ensure()), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(paths)}
