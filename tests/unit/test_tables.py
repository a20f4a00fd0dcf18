"""The CLI's tables at 80 columns: the name a user copies is never cut, every line fits, one line per row."""

from __future__ import annotations

import pytest
from rich.console import Console

from factory import tables
from factory.catalog.status import summary
from factory.registry.published import QuantRow
from tests.support import ROOT
from tests.support.quant_rows import quant_row


def quant(
    ref: str, rev: str, method: str, bits: float, size: float, ppl: float, change: float, source_identity: str, **fields
) -> QuantRow:
    return quant_row(
        ref,
        rev=rev,
        method=method,
        bits=bits,
        bytes=int(size),
        ppl=ppl,
        fp16_ppl=ppl / (1 + change),
        source_identity=source_identity,
        **fields,
    )


QUANTS = [
    quant(
        "smollm2-135m-instruct:awq-w4g64",
        "c2f4786",
        "awq",
        4,
        174_168_064,
        14.1926,
        0.1467,
        "sha256:c2f4786a1b2c3d4e5f",
    ),
    quant(
        "smollm2-135m-instruct:exl2-4.31bpw-h8",
        "c2f4786",
        "exl2",
        4.31,
        147_636_224,
        15.676,
        0.199,
        "sha256:c2f4786a1b2c3d4e5f",
    ),
]
STEPS = [
    {"name": "inspect", "state": "succeeded", "seconds": 1.2, "error": None, "peak_gpu_bytes": None},
    {
        "name": "quantize:exl2-4.0bpw",
        "state": "succeeded",
        "seconds": 128.4,
        "error": None,
        "peak_gpu_bytes": 1_610_612_736,
    },
    {
        "name": "evaluate:exl2-4.0bpw",
        "state": "failed",
        "seconds": 3.0,
        "error": "quality gate refused exl2-4.0bpw: perplexity 32.38 vs FP16 13.08 (ratio 2.476), allowed at most "
        "1.5 x FP16",
        "peak_gpu_bytes": None,
    },
]
JOBS = [
    {
        "id": "5afb7b31dd95",
        "name": "smollm2-135m-instruct",
        "state": "failed",
        "created_at": "2026-12-01T10:40:00",
        "error": STEPS[-1]["error"],
        "steps": STEPS,
        "summary": summary(STEPS),
    },
    {
        "id": "a1b2c3d4e5f6",
        "name": "qwen2.5-7b-instruct",
        "state": "running",
        "created_at": "2026-12-01T10:41:00",
        "error": None,
        "steps": [{**STEPS[0]}, {**STEPS[1], "state": "running", "seconds": None}],
        "summary": summary([{**STEPS[0]}, {**STEPS[1], "state": "running", "seconds": None}]),
    },
]


def render(table, width: int = 80) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(table)
    return [line.rstrip() for line in console.export_text().rstrip("\n").splitlines()]


@pytest.mark.parametrize("width", [80, 200])
def test_quant_table(width):
    lines = render(tables.quants(QUANTS, width), width)
    note = [] if width == 200 else ["METHOD, BITS, KLD, TOP-1, SOURCE hidden at 80 columns: see --wide or --json"]
    assert lines[1 + len(QUANTS) :] == note and all(len(line) <= width for line in lines)
    for line, q in zip(lines[1 : 1 + len(QUANTS)], QUANTS, strict=True):
        assert line.startswith(f"{q.ref}@{q.rev}  ")
    assert "166.1 MiB" in lines[1] and "+14.67%" in lines[1] and "14.1926" in lines[1]
    assert ("SOURCE" in lines[0]) == (width == 200)  # the source gives way first, then what the tag says
    assert ("0.0500" in lines[1] and "90.0%" in lines[1]) == (width == 200)


def test_job_table_at_80_columns():
    lines = render(tables.jobs(JOBS, 80))
    assert len(lines) == 2 + len(JOBS) and all(len(line) <= 80 for line in lines)
    assert lines[-1] == "STEPS, CREATED hidden at 80 columns: see --json"
    assert lines[1].startswith("5afb7b31dd95  smollm2-135m-instruct  failed   quality gate refused")
    assert lines[1].endswith("…")
    assert lines[2].startswith("a1b2c3d4e5f6  qwen2.5-7b-instruct    running")


def test_job_table_wide():
    lines = render(tables.jobs(JOBS, 240), 240)
    assert "quantize:exl2-4.0bpw running" in lines[2] and "2/3 done, 133s" in lines[1]
    assert lines[1].endswith("allowed at most 1.5 x FP16")


def test_steps_of_one_job():
    lines = render(tables.steps(JOBS[0], 80))
    assert lines[0] == "job 5afb7b31dd95 (smollm2-135m-instruct): failed"
    assert len(lines) == 2 + len(STEPS) and all(len(line) <= 80 for line in lines)
    assert lines[3].startswith("quantize:exl2-4.0bpw  succeeded    128.4") and "1.5 GiB" not in lines[3]


def test_sizes_are_binary():
    assert [tables.size(n) for n in (512, 2048, 174_168_064, 3 * 2**30)] == [
        "512 B",
        "2.0 KiB",
        "166.1 MiB",
        "3.00 GiB",
    ]


def test_piped_progress_prints_a_heartbeat(monkeypatch, capsys):
    """Without a terminal a long step prints its progress at least every HEARTBEAT_SECONDS, so it does not look hung."""
    from factory.cli import render as cli  # what Renderer prints with

    monkeypatch.setattr(cli, "HEARTBEAT_SECONDS", 0)
    monkeypatch.setattr(cli, "err", Console(stderr=True, soft_wrap=True, force_terminal=False))
    with cli.Renderer(as_json=False) as render:
        render({"event": "step", "step": "quantize:exl2-4.0bpw", "state": "running"})
        render({"event": "progress", "step": "quantize:exl2-4.0bpw", "done": 37.5, "total": 100, "unit": "%"})
    assert capsys.readouterr().err.splitlines() == ["quantize:exl2-4.0bpw ...", "quantize:exl2-4.0bpw: 37.5%"]


def test_the_readmes_sample_output_is_what_qf_prints():
    """The demo's table in the README, rendered again from its own numbers the way `qf run` prints it piped."""

    readme = (ROOT / "README.md").read_text()
    block = readme.split("```\njob ", 1)[1].split("```", 1)[0].splitlines()
    title, header, line = block[0], block[1], block[2]
    name, method, bits, size, unit, ppl, change, kld, top1, source = line.split()
    row = quant(
        name.split("@")[0],
        name.split("@")[1],
        method,
        float(bits),
        float(size) * 2**20,
        float(ppl),
        float(change.rstrip("%")) / 100,
        source,
        kld=float(kld),
        top1=float(top1.rstrip("%")) / 100,
    )
    assert render(tables.quants([row], 200, title=f"job {title}"), 200) == [f"job {title}", header, line]
