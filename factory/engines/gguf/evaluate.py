"""Scoring a GGUF quant through llama.cpp's own inference on the factory's windows: the token ids go to our driver
over libllama (`qf-llama logits`, llama.py builds it from logits.cpp) exactly as given, no BOS, and every position's
logits come back, so perplexity, KL divergence and top-1 are computed as for every other engine. llama-perplexity is
not used: it scores the second half of each chunk after a BOS. Where llama.cpp is built with CUDA, every layer is
offloaded (`-ngl 999`); on the CPU it runs in its own kernels (activations quantized as llama.cpp does)."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

from factory.engines import child
from factory.engines.gguf import gguf_file, llama
from factory.errors import JobFailed
from factory.settings import cpu_threads

ALL_LAYERS = "999"


def gpu_layers() -> list[str]:
    """llama.cpp's tools' option to put every layer on the GPU, where the build has CUDA."""
    return ["-ngl", ALL_LAYERS] if llama.flavour() == "cuda" else []


def model_file(folder: Path) -> Path:
    """The quant's .gguf in `folder` (its first part where gguf-split cut it), not the importance matrix."""
    files = gguf_file.model_files(folder)
    first = [p for p in files if "-00001-of-" in p.name] or files
    if not first:
        raise JobFailed(f"{folder} holds no .gguf model file")
    return first[0]


def _environment() -> dict[str, str]:
    return child.environment({"QF_LLAMA_THREADS": str(cpu_threads())})


class Driver:
    """`qf-llama logits` on one file, started at the first window (its context is the window's length) and kept for
    the others; it ends with this object."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc: subprocess.Popen | None = None
        self.ctx = 0
        self.vocab = 0

    def _start(self, ctx: int) -> None:
        self.close()
        cmd = [str(llama.tool(llama.DRIVER)), "logits", str(self.path), str(ctx), "0"]
        if gpu_layers():
            cmd[-1] = ALL_LAYERS
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_environment(),
            preexec_fn=child.die_with_parent,
        )
        self.ctx = ctx
        self.vocab = struct.unpack("<i", self._read(4))[0]

    def _read(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.proc.stdout.readinto(view[got:])
            if not k:
                error = self.proc.stderr.read().decode(errors="replace").strip().splitlines()
                raise JobFailed(f"llama.cpp stopped scoring {self.path.name}: {(error or ['no output'])[-1][:300]}")
            got += k
        return buf

    def __call__(self, ids):
        import numpy as np
        import torch

        row = ids[0].to(torch.int32).numpy()
        if self.proc is None or len(row) > self.ctx:
            self._start(len(row))
        self.proc.stdin.write(struct.pack("<i", len(row)) + row.tobytes())
        self.proc.stdin.flush()
        data = np.frombuffer(self._read(len(row) * self.vocab * 4), dtype=np.float32)
        return torch.from_numpy(data.reshape(1, len(row), self.vocab))

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.write(struct.pack("<i", 0))
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
            self.proc.stderr.close()
            self.proc = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the modules it needs may be gone; the child dies with its parent
            pass


def load(folder: Path, device: str) -> Driver:
    return Driver(model_file(folder))


def tokenize(path: Path, text: str) -> list[int]:
    """llama.cpp's tokenization of `text` with the file's vocabulary (no BOS, no special tokens parsed)."""
    done = subprocess.run(
        [str(llama.tool(llama.DRIVER)), "tokenize", str(path)],
        input=text.encode(),
        capture_output=True,
        env=_environment(),
    )
    if done.returncode != 0:
        raise JobFailed(f"llama.cpp could not tokenize with {path.name}: {done.stderr.decode(errors='replace')[-300:]}")
    return list(struct.unpack(f"<{len(done.stdout) // 4}i", done.stdout))
