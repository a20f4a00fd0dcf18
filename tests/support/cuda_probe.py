"""`python -m tests.support.cuda_probe`: whether CUDA was initialized before this module ran (it must not have been
in a process forked from one that imported torch), whether it started warm (forked by a starter:
factory/engines/warm.py), then a matmul on the card; one JSON line."""

from __future__ import annotations

import json
import os

import torch

from factory.engines import warm

if __name__ == "__main__":
    before = torch.cuda.is_initialized()
    x = torch.ones(256, 256, device="cuda")
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        warm_started = warm.STARTER.encode() in f.read()
    found = {"initialized_before": before, "warm": warm_started, "sum": float((x @ x).sum())}
    print(json.dumps({**found, "device": torch.cuda.get_device_name()}))
