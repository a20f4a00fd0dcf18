"""EXL2's measurement in layer ranges (factory/engines/exl2/ranges.py) against exllamav2's own serial measurement
(`convert_exl2 -om`), on a CUDA machine: the same modules, the same candidates with the same bits, the same
accuracies, and a conversion that takes the merged file. Both measurements' seconds go to $QF_GPU_RANGES_OUT (a JSON
file) when it is set, for the sitting's record."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from factory import engines
from factory.engines import child
from factory.engines.exl2 import engine as exl2
from factory.engines.exl2 import ranges
from tests.support.tiny_model import make_tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _serial(source: Path, cal: Path, work: Path, out: Path) -> None:
    args = ["-i", source, "-o", work, "-c", cal, "-om", out, "-mr", 16, "-ml", 2048, "-so"]
    cmd = [sys.executable, "-m", "factory.engines.script", exl2.SCRIPT, *map(str, args)]
    child.run_command(
        cmd, work.parent / "serial.log", lambda event: None, "serial measurement", exl2.parse_status, exl2.ENV
    )


def test_ranges_measure_what_one_serial_measurement_does(tmp_path):
    import calibration

    source = make_tiny_llama(tmp_path / "tiny-llama", hidden=256, layers=8)
    cal = calibration.write_parquet(calibration.resolve("builtin:mix"), tmp_path / "cal.parquet")
    start = time.monotonic()
    _serial(source, cal, tmp_path / "serial", tmp_path / "serial.json")
    serial_seconds = time.monotonic() - start
    events: list[dict] = []
    start = time.monotonic()
    engines.get("exl2").measure(
        source, cal, 16, 2048, tmp_path / "ranges", tmp_path / "ranges.json", events.append, processes=ranges.RANGES
    )
    ranges_seconds = time.monotonic() - start

    serial = json.loads((tmp_path / "serial.json").read_text())
    split = json.loads((tmp_path / "ranges.json").read_text())
    assert split["last_module_idx"] == serial["last_module_idx"]
    assert split["measurement"].keys() == serial["measurement"].keys()
    for module, options in serial["measurement"].items():
        if options is None:  # norm, head: not measured
            assert split["measurement"][module] is None
            continue
        theirs = split["measurement"][module]
        assert [o["total_bits"] for o in theirs] == [o["total_bits"] for o in options], module
        for mine, ref in zip(theirs, options, strict=True):
            assert mine["accuracy"] == pytest.approx(ref["accuracy"], abs=1e-5), module
    assert max(e["done"] for e in events if e.get("stage") == "Measuring") == 100.0
    assert [e["peak_gpu_bytes"] for e in events if e.get("peak_gpu_bytes")]  # the ranges' peaks together
    assert not (tmp_path / "ranges").exists() and (tmp_path / "ranges.log").is_file()

    spec = engines.get("exl2").spec(bpw=4.0)
    request = engines.QuantizeRequest(
        source,
        tmp_path / "out",
        tmp_path / "quant",
        spec,
        calibration_file=cal,
        measurements={"measure": tmp_path / "ranges.json"},
    )
    engines.get("exl2").quantize(request, lambda event: None)  # checks its outputs and bits
    if out := os.environ.get("QF_GPU_RANGES_OUT"):
        record = {
            "model": "tiny-llama (8 layers, hidden 256)",
            "gpu": torch.cuda.get_device_name(0),
            "ranges": ranges.RANGES,
            "serial_seconds": round(serial_seconds, 1),
            "ranges_seconds": round(ranges_seconds, 1),
        }
        Path(out).write_text(json.dumps(record, indent=2) + "\n")
