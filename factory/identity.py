"""Identities and keys, in one place: what a source is (a Hub commit or the sha256 of a folder's files), the
sha256 of a file, and the keys that decide when a job or a measurement is the same as an earlier one.

    source identity   `org/name@<commit sha>` for a Hub model; `sha256:<hex>` over a local folder's allowlisted
                      files (factory/checkpoints/files.py). At submit it is computed with each file's sha256 cached
                      by path, size and mtime (checkpoints/sources.py's folder_identity): a hint, which the job
                      verifies at inspect by hashing the bytes it
                      copies into its own snapshot of the folder (files.snapshot); every unit reads the snapshot,
                      so what is quantized, evaluated, measured and published under an identity is what was hashed
    job key           hash(source identity, specs as written, calibration and eval sha256, windows, engine
                      versions, device)
    weights key       hash(source identity, the resolved spec, calibration sha256, the engine's version, device):
                      two jobs with the same weights key make the same quant, so a later job reuses a published
                      one (its evaluation windows and text may differ) instead of converting again
    files sha         sha256 of a quant's file table (every file's name, sha256 and size) but its card and
                      manifest: what a registry entry `name:tag@rev` names, for ever
    measurement key   hash(source identity, calibration sha256, rows, length, tool version; the stage when not
                      EXL2's `measure`; the weights keys of the quants it measures, for a shared unit made from them)
    tokens key        hash(source identity, text sha256, tokenizers version)
    holder            `host:pid` of a process that holds a lease or a claim
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path


def is_hub(identity: str) -> bool:
    return not identity.startswith("sha256:")


def rev(identity: str) -> str:
    """The short revision of a source identity: `sha256:1a2b3c4...` or `org/name@1a2b3c4...` -> `1a2b3c4`."""
    return identity.rsplit("@", 1)[-1].removeprefix("sha256:")[:7]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def of_files(hashes: dict[str, str]) -> str:
    """A local source's identity from its files' names and sha256s."""
    return "sha256:" + hashlib.sha256("\n".join(f"{n}:{h}" for n, h in sorted(hashes.items())).encode()).hexdigest()


def digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def job_key(
    source_identity: str,
    specs: list[dict],
    calibration_sha: str,
    eval_sha: str,
    eval_windows: int,
    versions: dict[str, str],
    device: str,
) -> str:
    """Specs as the user wrote them; with the device they resolve to the same concrete specs every time."""
    return digest([source_identity, specs, calibration_sha, eval_sha, eval_windows, versions, device])


def weights_key(source_identity: str, spec: dict, calibration_sha: str, engine_version: str | None, device: str) -> str:
    """What decides a quant's weights: the evaluation (text, windows) does not."""
    return digest(["weights", source_identity, spec, calibration_sha, engine_version, device])


def files_sha(table: dict[str, dict]) -> str:
    """A quant's file table (name -> sha256, bytes) as one hash; the caller leaves out its card and manifest."""
    return digest(table)


def measurement_key(
    source_identity: str,
    calibration_sha: str,
    rows: int,
    length: int,
    tool_version: str,
    stage: str = "measure",
    inputs: list[str] | None = None,
) -> str:
    """An engine's shared unit (engines.Shared). EXL2's `measure` keys predate stages and are kept as they were, so
    its measurements stay reusable; every other stage is hashed in, and so are `inputs`, the weights keys of the
    quants a unit reads (EXL3's per-tensor measurement reads the uniform quants it measures)."""
    stage_part = [stage] if stage != "measure" else []
    return digest(
        [source_identity, calibration_sha, rows, length, tool_version, *stage_part, *([inputs] if inputs else [])]
    )


def reference_key(
    source_identity: str, eval_sha: str, windows: int, window_length: int, device: str, layout: object
) -> str:
    """FP16's reference for KL divergence (factory/evaluation/kld.py) on one eval stream; `layout` its top K, samples,
    seed."""
    return digest([source_identity, eval_sha, windows, window_length, device, layout])


def tokens_key(source_identity: str, text_sha: str, tokenizer_version: str) -> str:
    """A text's token ids under a source's tokenizer (whose files the source identity covers)."""
    return digest([source_identity, text_sha, tokenizer_version])


def inspection_key(source_identity: str, version: int) -> str:
    """What inspection learned of a source's files (which the source identity covers), by inspection's version."""
    return digest([source_identity, "inspection", version])


def holder_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def gone(worker: str | None) -> bool:
    """A holder on this machine whose process has ended (a `qf run` killed with SIGKILL): no need to wait out its
    lease."""
    host, _, pid = (worker or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
