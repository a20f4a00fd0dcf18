"""An EXL3 quant whose bits are chosen per tensor (`exl3-4.0bpw-opt`), by exllamav3 1.6.5's own measure and optimize,
in child processes:

    measure:  python -m factory.engines.exl3.optimize CAL.safetensors exllamav3.conversion.measure_model
                  -i Q3.0 Q4.0 Q5.0 -r SRC -o MEASUREMENT.json -l 2 -cr ROWS -cc LENGTH
    optimize: python -m factory.engines.exl3.compat exllamav3.conversion.optimize_model
                  -m MEASUREMENT.json -b BITS -o OUT -i Q3.0 Q4.0 Q5.0
The measurement is the job's shared unit `measure-kld:<key>`; the optimized quant its quantize unit.

How exllamav3 does it (conversion/measure_model.py, optimize_model.py): measure streams the FP16 source and two or
more quants of it (lowest bits first, the first the base) a module at a time, and for each group of tensors of each
layer swaps in the group from each higher quant and records what that does to the KL divergence of the output from
the source's (`dkld`) and what it adds in bits (`dbits`). Optimize starts from the base, upgrades groups greedily by
KL divergence saved per bit until a budget of BITS per weight of the layers is spent, and writes the quant it
assembles from the inputs' own tensors (no new quantization). Its -rcp recipes (util/sc_optimize.py) are not in the
wheel: this path is the one 1.6.5 installs.

What we add, and why:
- the inputs are the uniform sizes the job makes around the size asked for (spec.py's `sources`: 4.0 -> 3.0, 4.0,
  5.0), the same size among them, and BITS is that uniform quant's own storage bits per weight as measure recorded
  it (the measurement's `bpw` of each input): the optimized quant is at most the uniform one's size, so their KL
  divergences compare at the same size (the gate keeps it only where it is lower: Engine.rival);
- measure has no calibration option and its built-in mix is half wiki.utf8, the default eval text, so this module
  (main) hands it the job's calibration rows in its place, through exllamav3's own reader of a `-cd` file;
- `-i` on optimize: the measurement names the folders it measured, which may be another job's (it is reused by key);
- both exit 0 after ` !! Error: ...`, and measure only warns when the inputs do not match the source: both are
  failures here; outputs are checked, not the exit code;
- their progress: measure prints ` -- Loading module (ref): <key>` for each module of each pass (` -- Starting pass
  i/n...`), which become progress events; optimize prints the bits it reached.
exllamav3 is never imported by the parent: importing it builds its CUDA extension.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

from factory.checkpoints.inspection import read_config
from factory.engines import child
from factory.engines.exl3 import compat
from factory.errors import JobFailed

MEASURE = "exllamav3.conversion.measure_model"
OPTIMIZE = "exllamav3.conversion.optimize_model"
# how a child module runs (tests run them without a GPU through tests/support/exl3_cpu.py)
PYTHON = [sys.executable, "-u", "-m"]
LEVEL = 2  # measure's -l: how finely a layer's tensors are grouped (0-3; exllamav3 recommends 2)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PASS = re.compile(r"^ -- Starting pass (?P<i>\d+)/(?P<n>\d+)\.\.\.$")
REF_MODULE = re.compile(r"^ -- Loading module \(ref\): (?P<key>\S+)$")
BITRATE = re.compile(r"^ -- New estimated model bitrate: (?P<bits>[\d.]+) bpw / (?P<head>[\d.]+) bpw \(head\)$")
REFUSED = re.compile(r"^ !! (?:Error: (?P<error>.*)|(?P<warning>Warning, input .*))$")  # measure only warns


def parser(modules: int):
    """A parse function for measure's and optimize's lines (ANSI colours stripped): a module of a pass done, the bits
    optimize reached, the peak GPU memory; what they refuse is kept in `parse.errors`."""
    state = {"pass": 1, "passes": 1, "done": 0}
    errors: list[str] = []

    def parse(line: str) -> dict | None:
        line = ANSI.sub("", line).rstrip("\n")
        if line.startswith(child.PEAK):
            return {"event": "progress", "peak_gpu_bytes": int(line.removeprefix(child.PEAK))}
        if match := PASS.match(line):
            state.update({"pass": int(match["i"]), "passes": int(match["n"]), "done": 0})
            return None
        if match := REF_MODULE.match(line):
            state["done"] = min(state["done"] + 1, modules)
            return {
                "event": "progress",
                "done": (state["pass"] - 1) * modules + state["done"],
                "total": state["passes"] * modules,
                "unit": "module",
                "module": match["key"],
            }
        if match := BITRATE.match(line):
            return {"event": "progress", "done": 1, "total": 1, "unit": "model", "bits": float(match["bits"])}
        if match := REFUSED.match(line):
            errors.append(match["error"] or match["warning"])
        return None

    parse.errors = errors  # type: ignore[attr-defined]
    return parse


def modules_of(source_dir: Path) -> int:
    """The modules exllamav3 walks: the embedding, every layer, the final norm, the head."""
    return read_config(source_dir / "config.json", check_numbers=False)["num_hidden_layers"] + 3


def measure_command(
    source_dir: Path, inputs: list[Path], calibration: Path, rows: int, length: int, out: Path
) -> list[str]:
    args = ["-i", *inputs, "-r", source_dir, "-o", out, "-l", LEVEL, "-cr", rows, "-cc", length]
    return [*PYTHON, __name__, str(calibration), MEASURE, *map(str, args)]


def optimize_command(measurement: Path, bits: float, out_dir: Path, inputs: list[Path]) -> list[str]:
    args = ["-m", measurement, "-b", bits, "-o", out_dir, "-i", *inputs]
    return [*PYTHON, compat.__name__, OPTIMIZE, *map(str, args)]


def measure(
    source_dir: Path, inputs: list[Path], calibration: Path, rows: int, length: int, work_dir: Path, out: Path, emit
) -> None:
    """The measurement of `inputs` (lowest bits first) against the FP16 source, into `out` once it checks."""
    log, written = work_dir / child.LOG_NAME, work_dir / "measurement.json"
    parse = parser(modules_of(source_dir))
    cmd = measure_command(source_dir, inputs, calibration, rows, length, written)
    child.run_command(cmd, log, emit, "exllamav3's measurement", parse=parse)
    if parse.errors:
        raise JobFailed(f"exllamav3's measure refused its inputs: {parse.errors[-1]}; see {log}")
    check_measurement(written, len(inputs), log)
    tmp = out.with_name(f"{out.name}.part")
    shutil.copyfile(written, tmp)
    os.replace(tmp, out)


def check_measurement(path: Path, inputs: int, log: Path) -> dict:
    """What optimize reads: a base and one alternative for each input after the first, and groups whose every
    candidate has a finite dkld and dbits."""
    try:
        measured = json.loads(path.read_text())
        groups, alts = measured["groups"], measured["alts"]
        candidates = [c for g in groups for c in g["candidates"]]
        bits = [measured["base"]["bpw"], *(a["bpw"] for a in alts)]
    except (OSError, ValueError, KeyError, TypeError):
        raise JobFailed(f"exllamav3's measure wrote no measurement that reads at {path}; see {log}") from None
    if len(alts) != inputs - 1 or not groups or any(len(g["candidates"]) != len(alts) for g in groups):
        raise JobFailed(f"exllamav3's measurement at {path} does not cover its {inputs} inputs; see {log}")
    numbers = [*bits, *(v for c in candidates for v in (c["dkld"], c["dbits"]))]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers):
        raise JobFailed(f"exllamav3's measurement at {path} holds numbers that are not finite; see {log}")
    return measured


def measured_bits(measurement: Path, index: int) -> float:
    """The storage bits per weight measure recorded for its `index`-th input (0: the base)."""
    measured = json.loads(measurement.read_text())
    return float((measured["base"] if index == 0 else measured["alts"][index - 1])["bpw"])


def optimize(measurement: Path, inputs: list[Path], bits: float, out_dir: Path, log: Path, emit) -> None:
    shutil.rmtree(out_dir, ignore_errors=True)  # exllamav3 only warns about what a folder holds already
    parse = parser(modules=1)
    child.run_command(
        optimize_command(measurement, bits, out_dir, inputs), log, emit, "exllamav3's optimize", parse=parse
    )
    if parse.errors:
        raise JobFailed(f"exllamav3's optimize refused the measurement: {parse.errors[-1]}; see {log}")


def main() -> None:
    """python -m factory.engines.exl3.optimize CAL.safetensors MODULE ARG...: exllamav3's MODULE (its measure) with
    the calibration rows of CAL.safetensors (`input_ids`, rows x length) where it would take its built-in mix."""
    from exllamav3.conversion import calibration_data

    path = sys.argv.pop(1)
    read = calibration_data.get_file_calibration

    def job_rows(args: dict, tokenizer) -> list:
        return read({**args, "cal_data": path}, tokenizer)

    calibration_data.get_default_calibration = job_rows  # measure_model imports it by name when it runs
    compat.main()


if __name__ == "__main__":
    main()
