"""Package indexes for tests of an engine's own packages (factory/engines/awq_ct/env.py), with no PyPI: a folder of
stand-in wheels for its pins (`pip_env(wheels(folder))`: pip installs them offline in a second), and an index that
accepts connections and never answers (`silent_index()`)."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import socket
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from factory.engines.awq_ct import env

# the module each pin installs, which says which it is: `import transformers; transformers.__version__ == "5.17.0"`
MODULES = {
    "llmcompressor": "llmcompressor",
    "compressed-tensors": "compressed_tensors",
    "transformers": "transformers",
    "huggingface-hub": "huggingface_hub",
    "tokenizers": "tokenizers",
    "loguru": "loguru",
}


def wheels(folder: Path) -> Path:
    """A stand-in wheel for each of the engine's pins in `folder`: its module holds `__version__` and `STAND_IN`."""
    folder.mkdir(parents=True, exist_ok=True)
    for pin in env.PINS:
        name, version = pin.split("==")
        _wheel(folder, name, version, {f"{MODULES[name]}/__init__.py": f"__version__ = {version!r}\nSTAND_IN = True\n"})
    return folder


def _wheel(folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name_in, text in {**files, f"{info}/RECORD": "\n".join(record) + "\n"}.items():
            whl.writestr(name_in, text)
    return path


def pip_env(cache: Path, find_links: Path | None = None, index: str | None = None) -> dict[str, str]:
    """This process's environment without pip settings of its own, the engine's packages cached under `cache`, pip
    reading `find_links` offline or the index at `index`."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    kept.update(XDG_CACHE_HOME=str(cache), PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1")
    if find_links is not None:
        kept.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(find_links))
    if index is not None:
        kept.update(PIP_INDEX_URL=index)
    return kept


@contextmanager
def silent_index() -> Iterator[str]:
    """An index URL whose server accepts every connection and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}/simple"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()
