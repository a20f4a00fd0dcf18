"""What a job's snapshot of a local source costs (issue 43: the weights are copied and hashed into the job's work
folder at inspect, so the engines read the bytes that were hashed): the snapshot (files.snapshot: one read pass
that hashes and writes), against hashing alone (what the identity cost before, on a cache miss), an in-kernel copy
(`os.copy_file_range`) followed by a hash of the copy, and the links the staging folder held before.

    .venv/bin/python benchmarks/snapshot_cost.py [--gib 4] [--dir /tmp]

Writes a random safetensors checkpoint of `--gib` GiB (one shard of BF16 tensors) and a config.json into a fresh
folder under `--dir`, times each way warm (the source in the page cache, as right after submit hashed it) and cold
(its pages dropped with posix_fadvise first), reports seconds, GB/s and the disk each uses, deletes everything,
and adds the run to benchmarks/results/snapshot_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
from pathlib import Path

from factory.checkpoints import files
from factory.identity import file_sha256

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1 << 24


def make_source(folder: Path, gib: float) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    rows = 4096
    per = rows * 4096 * 2  # one BF16 4096 x 4096 tensor
    count = max(1, int(gib * (1 << 30)) // per)
    header, offset = {}, 0
    for i in range(count):
        header[f"model.layers.{i}.weight"] = {
            "dtype": "BF16",
            "shape": [rows, 4096],
            "data_offsets": [offset, offset + per],
        }
        offset += per
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _ in range(count):
            f.write(os.urandom(per))


def drop_cache(folder: Path) -> None:
    os.sync()  # dirty pages are not dropped
    for p in folder.iterdir():
        if p.is_file() and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def disk(folder: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in folder.iterdir())


def hash_only(src: Path, dest: Path) -> None:
    dest.mkdir()
    for p in sorted(src.iterdir()):
        file_sha256(p)


def snapshot(src: Path, dest: Path) -> None:
    files.snapshot(src, dest)


def one_pass(src: Path, dest: Path) -> None:
    """Read, hash and write each 1 MiB in turn: the fallback where the kernel cannot copy."""
    dest.mkdir()
    for p in sorted(src.iterdir()):
        with open(p, "rb", buffering=0) as fi, open(dest / p.name, "w+b", buffering=0) as fo:
            files._copy_hashing(fi, fo, lambda _: None)


def links(src: Path, dest: Path) -> None:
    files.stage(src, dest)


WAYS = {
    "hash only": hash_only,
    "snapshot (copy+hash)": snapshot,
    "one pass (read, hash, write)": one_pass,
    "links (before)": links,
}


def _filesystem(folder: str) -> str:
    out = subprocess.run(["df", "--output=fstype", folder], capture_output=True, text=True).stdout
    return out.split()[-1] if out.split() else "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--dir", default="/tmp")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="qf-snapshot-", dir=args.dir))
    rows = []
    try:
        src = base / "source"
        start = time.monotonic()
        make_source(src, args.gib)
        size = sum(p.stat().st_size for p in src.iterdir())
        print(f"source: {size / 1e9:.2f} GB written in {time.monotonic() - start:.1f} s")
        for cache in ("warm", "cold", "warm", "cold"):
            for name, way in WAYS.items():
                dest = base / "dest"
                if cache == "cold":
                    drop_cache(src)
                else:
                    file_sha256(src / "model.safetensors")  # in the page cache, as right after submit
                start = time.monotonic()
                way(src, dest)
                os.sync()
                seconds = time.monotonic() - start
                row = {
                    "load": round(os.getloadavg()[0], 1),
                    "way": name,
                    "cache": cache,
                    "seconds": round(seconds, 2),
                    "gb_per_s": round(size / 1e9 / seconds, 2),
                    "extra_disk_bytes": disk(dest),
                }
                print(row)
                rows.append(row)
                shutil.rmtree(dest)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    out = ROOT / "benchmarks" / "results" / "snapshot_cost.json"
    runs = json.loads(out.read_text()) if out.exists() else []
    runs.append({"commit": commit.strip(), "source_bytes": size, "filesystem": _filesystem(args.dir), "rows": rows})
    out.write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
