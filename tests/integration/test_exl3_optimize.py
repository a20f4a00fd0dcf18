"""EXL3 at a size with its bits chosen per tensor (`--exl3 4.0opt`, factory/engines/exl3/optimize.py), on the CPU:
how it is asked for and named, the units it adds to a job (its measurement shared and keyed by the quants it reads),
the command lines for exllamav3's measure and optimize, their output as progress, the checks of what they write, and
exllamav3's own optimize assembling a quant from three inputs without a GPU (tests/support/exl3_cpu.py: its CUDA
extension refuses every call). The measurement itself needs CUDA: tests/gpu/test_gpu_exl3.py runs it.

The measure transcript (tests/fixtures/exl3_measure_tiny.log) is what exllamav3 1.6.5's measure_model.py printed for
the 4-layer tiny Llama measured from three pulled quants on an H100 (tests/gpu/test_gpu_exl3.py, 2026-12-06 sitting,
benchmarks/results/gpu-2026-12-06-exl3opt/)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

import calibration
from factory import engines, identity, specs
from factory.checkpoints.inspection import read_header
from factory.engines import QuantizeRequest, child
from factory.engines.exl3 import engine as exl3
from factory.engines.exl3 import optimize
from factory.engines.exl3.spec import MEASURE_KLD, Exl3Spec
from factory.errors import JobFailed, SpecError
from factory.evaluation.evaluate import tokenize
from factory.jobs import conversions, graph
from factory.publish import hub
from factory.recipes import build_recipe, recipe_from_yaml
from factory.registry import naming
from factory.vram import tensor_bytes
from tests.support import FIXTURES, exl3_layout
from tests.support.catalog_jobs import bare_job

ENGINE = engines.get("exl3")
OPT = Exl3Spec(bpw=4.0, opt=True)


# -- asking for it ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flag", "tags"),
    [
        ("4.0opt", ["exl3-3.0bpw", "exl3-4.0bpw", "exl3-5.0bpw", "exl3-4.0bpw-opt"]),
        ("3.0, 4.5OPT", ["exl3-3.0bpw", "exl3-4.0bpw", "exl3-4.5bpw", "exl3-5.0bpw", "exl3-4.5bpw-opt"]),
        ("2.0,4.0opt,5.0", ["exl3-2.0bpw", "exl3-3.0bpw", "exl3-4.0bpw", "exl3-5.0bpw", "exl3-4.0bpw-opt"]),
        ("1.5opt", ["exl3-1.0bpw", "exl3-1.5bpw", "exl3-2.0bpw", "exl3-1.5bpw-opt"]),
        ("4.0", ["exl3-4.0bpw"]),
    ],
)
def test_a_size_with_opt_asks_for_it_and_the_uniform_sizes_it_is_made_from(flag, tags):
    recipe = build_recipe(exl3=flag)
    assert [s.tag for s in recipe.specs()] == tags
    again = build_recipe(exl3=",".join(str(s.flag_value) for s in recipe.specs()))  # how --fit writes flags back
    assert again.specs() == recipe.specs()


def test_the_recipe_key_and_head_bits():
    recipe = recipe_from_yaml("exl3: {opt: [4.0], head_bits: 8}\n", "test")
    assert [s.tag for s in recipe.specs()] == [
        "exl3-3.0bpw-h8",
        "exl3-4.0bpw-h8",
        "exl3-5.0bpw-h8",
        "exl3-4.0bpw-h8-opt",
    ]
    assert recipe.to_dict()["exl3"] == {"bpw": [], "opt": [4.0], "head_bits": 8}


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("8.0opt", "exl3 8.0opt needs a uniform size a bit below and a bit above it; use a size between 1.0 and 8.0, "),
        ("1.0opt", "exl3 1.0opt needs a uniform size a bit below and a bit above it"),
        ("8.5opt", "bpw 8.5 is outside [1.0, 8.0]"),
        ("fouropt", "bpw 'four' is not a number; use a number in [1.0, 8.0]"),
        (" , ", "--exl3 needs sizes in [1.0, 8.0] separated by commas (4.0, or 4.0opt for bits chosen per tensor)"),
    ],
)
def test_sizes_that_cannot_be_optimized_are_one_sentence(flag, message):
    with pytest.raises(SpecError) as e:
        build_recipe(exl3=flag)
    assert message in e.value.message and e.value.exit_code == 2


def test_a_recipe_without_sizes_is_refused():
    with pytest.raises(SpecError, match=r"exl3: exl3 needs sizes: bpw: \[4.0\] \(uniform\), opt: \[4.0\]"):
        recipe_from_yaml("exl3: {head_bits: 6}\n", "test")


def test_on_the_command_line_a_bad_size_is_exit_2(qf, tiny):
    result = qf("run", tiny, "--exl3", "8opt")
    assert result.exit_code == 2
    assert "exl3 8.0opt needs a uniform size a bit below and a bit above it" in result.stderr


def test_the_tag_says_opt_and_round_trips():
    assert (OPT.tag, OPT.flag_value, Exl3Spec(bpw=3.0, head_bits=8, opt=True).tag) == (
        "exl3-4.0bpw-opt",
        "4opt",
        "exl3-3.0bpw-h8-opt",
    )
    assert naming.parse(f"gemma-3-270m:{OPT.tag}").tag == OPT.tag and engines.of_tag(OPT.tag) is ENGINE
    place = hub.place("alice", "gemma-3-270m", OPT.tag, hub.templates({}))
    assert (place.repo, place.branch) == ("alice/gemma-3-270m-exl3", "4.0bpw-opt")
    assert ENGINE.card.tag_of_branch(place.branch) == OPT.tag
    assert specs.parse(OPT.model_dump()) == OPT and OPT.model_dump()["opt"] is True
    # a uniform size is stored as before `opt` existed: its weights keys, and so its published quants, stay reusable
    assert "opt" not in Exl3Spec(bpw=4.0).model_dump() and specs.parse(Exl3Spec(bpw=4.0).model_dump()).opt is False


# -- its units ----------------------------------------------------------------------------------------------------
@pytest.fixture
def catalog(db_url, tmp_path):
    from factory.catalog import Catalog

    return Catalog(db_url or f"sqlite:///{tmp_path / 'catalog.db'}")


def _resolved(flag: str, rows: int = 146) -> list[Exl3Spec]:
    """The specs as a job resolves them (fit_calibration: every size's rows from the same text)."""
    return [ENGINE.fit_calibration(s, rows * 2048, "cuda") for s in build_recipe(exl3=flag).specs()]


def test_the_units_the_measurement_waits_for_and_the_optimized_quant_after_it(catalog):
    job = bare_job(catalog, versions={"exl3": "1.6.5"}, device="cuda")
    specs = _resolved("3.0,4.0opt")
    keys = {s.tag: conversions.measurement_keys(job, s) for s in specs}
    assert [list(k) for k in keys.values()] == [[], [], [], [MEASURE_KLD]]  # only the optimized size has one
    units = graph.units(specs, keys, publish=True, push=False)
    measure = f"{MEASURE_KLD}:{keys[OPT.tag][MEASURE_KLD][:12]}"
    inputs = {"quantize:exl3-3.0bpw", "quantize:exl3-4.0bpw", "quantize:exl3-5.0bpw"}
    by_name = {u.name: u for u in units}
    assert [u.name for u in units[:5]] == [*sorted(inputs), measure, "quantize:exl3-4.0bpw-opt"]
    assert by_name[measure].needs == inputs and by_name[measure].kind == "measure"
    assert by_name["quantize:exl3-4.0bpw-opt"].needs == inputs | {measure}
    assert all(by_name[name].needs == frozenset() for name in inputs)
    assert by_name["evaluate:exl3-4.0bpw-opt"].needs == {"quantize:exl3-4.0bpw-opt", "evaluate:fp16"}
    assert {"evaluate:exl3-4.0bpw-opt:kv", "publish:exl3-4.0bpw-opt"} <= set(by_name)
    # what it is made from, in the order exllamav3 takes them (the base first), with the job's calibration rows
    made = ENGINE.made_from(specs[-1])
    assert [s.tag for s in made] == ["exl3-3.0bpw", "exl3-4.0bpw", "exl3-5.0bpw"] and made == specs[:3]
    assert ENGINE.rival(specs[-1]) == specs[1] and ENGINE.rival(specs[1]) is None
    assert ENGINE.calibration_windows(specs[-1]) is None and ENGINE.calibration_lengths(specs[-1]) == [(10, 1024)]
    assert ENGINE.describe_calibration(specs[-1], "builtin:mix") == (
        "builtin:mix, 146 x 2048 tokens; bits chosen per tensor from exl3-3.0bpw, exl3-4.0bpw, exl3-5.0bpw by KL "
        "divergence on 10 x 1024 tokens"
    )


def test_the_measurement_is_keyed_by_what_it_reads_and_shared_by_that(catalog):
    """Reused by key across jobs (conversions.measure): two jobs of the same source, calibration and sources share
    it whatever else they make; other head bits (other quants), other calibration or another size each have their
    own."""
    job = bare_job(catalog, 0, versions={"exl3": "1.6.5"}, device="cuda")
    other_job = bare_job(catalog, 1, source_identity=job.source_identity, versions={"exl3": "1.6.5"}, device="cuda")

    def key(job, flag: str, **fields) -> str:
        spec = next(s for s in _resolved(flag, **fields) if s.opt)
        return conversions.measurement_keys(job, spec)[MEASURE_KLD]

    base = key(job, "4.0opt")
    assert key(other_job, "2.0,4.0opt,6.0") == base
    assert key(job, "4.0opt", rows=100) != base  # other calibration rows: other source quants
    assert key(job, "4.5opt") != base
    head8 = next(s for s in build_recipe(exl3="4.0opt").specs() if s.opt).model_copy(update={"head_bits": 8})
    assert conversions.measurement_keys(job, head8)[MEASURE_KLD] != base
    recalibrated = bare_job(catalog, 2, source_identity=job.source_identity, calibration_sha="d", device="cuda")
    assert key(recalibrated, "4.0opt") != base
    # the uniform quants' weights keys are in it: the same key reads the same bytes
    weights = [conversions.publishing.weights_key(job, s) for s in _resolved("4.0opt")[:3]]
    assert base == identity.measurement_key(
        job.source_identity, job.calibration_sha, 10, 1024, ENGINE.version(), MEASURE_KLD, weights
    )


# -- exllamav3's measure and optimize -----------------------------------------------------------------------------
def test_the_command_lines(tmp_path):
    inputs = [tmp_path / f"q{b}" for b in (3, 4, 5)]
    measure = optimize.measure_command(tmp_path / "src", inputs, tmp_path / "cal.safetensors", 10, 1024, tmp_path / "m")
    assert measure[1:] == [
        "-u",
        "-m",
        "factory.engines.exl3.optimize",
        str(tmp_path / "cal.safetensors"),
        "exllamav3.conversion.measure_model",
        "-i",
        *map(str, inputs),
        "-r",
        str(tmp_path / "src"),
        "-o",
        str(tmp_path / "m"),
        "-l",
        "2",
        "-cr",
        "10",
        "-cc",
        "1024",
    ]
    assembled = optimize.optimize_command(tmp_path / "m.json", 4.0123, tmp_path / "out", inputs)
    assert assembled[1:] == [
        "-u",
        "-m",
        "factory.engines.exl3.compat",
        "exllamav3.conversion.optimize_model",
        "-m",
        str(tmp_path / "m.json"),
        "-b",
        "4.0123",
        "-o",
        str(tmp_path / "out"),
        "-i",
        *map(str, inputs),
    ]


def test_the_measure_transcript_becomes_one_event_per_module():
    parse = optimize.parser(modules=4 + 3)
    events = [e for e in map(parse, (FIXTURES / "exl3_measure_tiny.log").read_text().splitlines(True)) if e]
    done = [e for e in events if "done" in e]
    layers = [f"model.layers.{i}" for i in range(4)]
    assert [e["module"] for e in done] == ["model.embed_tokens", *layers, "model.norm", "lm_head"]
    assert [(e["done"], e["total"]) for e in done] == [(i, 7) for i in range(1, 8)]
    assert events[-1] == {"event": "progress", "peak_gpu_bytes": 659898368} and parse.errors == []


def test_a_measurement_in_passes_counts_every_pass():
    parse = optimize.parser(modules=2)
    lines = [
        " -- Starting pass 1/2...",
        " -- Loading module (ref): \x1b[32;1mmodel.embed_tokens\x1b[0m",
        " -- Loading module (\x1b[35;1m0\x1b[0m): \x1b[32;1mmodel.embed_tokens\x1b[0m",
        " -- Loading module (ref): \x1b[32;1mlm_head\x1b[0m",
        " -- Starting pass 2/2...",
        " -- Loading module (ref): \x1b[32;1mmodel.embed_tokens\x1b[0m",
        " -- Loading module (ref): \x1b[32;1mlm_head\x1b[0m",
    ]
    assert [(e["done"], e["total"]) for e in map(parse, lines) if e] == [(1, 4), (2, 4), (3, 4), (4, 4)]


@pytest.mark.parametrize(
    ("line", "refused"),
    [
        (" !! Error: Please specify --ref_dir", "Please specify --ref_dir"),
        (
            " !! \x1b[31;1mWarning, input models do not match reference model\x1b[0m",
            "Warning, input models do not match reference model",
        ),
        (
            " !! \x1b[31;1mWarning, input quantized models should be in order of increasing bitrate\x1b[0m",
            "Warning, input quantized models should be in order of increasing bitrate",
        ),
        (" !! Calibration file contains 3 rows, less than cal_rows (10)", None),  # said, not refused
    ],
)
def test_what_exllamav3_refuses_is_kept_as_the_steps_failure(line, refused):
    parse = optimize.parser(modules=5)
    assert parse(line + "\n") is None
    assert parse.errors == ([refused] if refused else [])


def _layout(tiny: Path, tmp_path: Path) -> list[Path]:
    return [exl3_layout.quant(tiny, tmp_path / f"exl3-{b}.0bpw", b) for b in (3, 4, 5)]


def test_a_measurement_is_checked_before_it_is_kept(tiny, tmp_path):
    inputs = _layout(tiny, tmp_path)
    good = exl3_layout.measurement(inputs, 2, [[-0.1, -0.2]] * 4)
    nan = {"dkld": float("nan"), "dbits": 1}
    path, log = tmp_path / "m.json", tmp_path / "engine.log"
    path.write_text(json.dumps(good))
    assert optimize.check_measurement(path, 3, log)["groups"] == good["groups"]
    assert optimize.measured_bits(path, 1) == exl3_layout.bpw(inputs[1], 2)
    problems = [
        ({**good, "alts": good["alts"][:1]}, "does not cover its 3 inputs"),
        ({**good, "groups": []}, "does not cover its 3 inputs"),
        ({**good, "groups": [{**good["groups"][0], "candidates": [nan] * 2}]}, "not finite"),
        ({"base": {}}, "wrote no measurement that reads"),
    ]
    for measured, problem in problems:
        path.write_text(json.dumps(measured))
        with pytest.raises(JobFailed, match=problem):
            optimize.check_measurement(path, 3, log)


@pytest.fixture
def no_gpu(monkeypatch):
    """exllamav3's children without a GPU: its extension refuses every call (tests/support/exl3_cpu.py)."""
    monkeypatch.setattr(optimize, "PYTHON", [*optimize.PYTHON, "tests.support.exl3_cpu"])


def test_exllamav3s_optimize_assembles_the_quant_at_the_uniform_sizes_bits(tiny, tmp_path, no_gpu):
    """From the inputs at 3, 4 and 5 bits and a measurement in which layer 0's MLP gains most from 5 bits and its
    attention from 4 and layer 1 gains nothing: exllamav3's optimize spends the bits the 4-bit quant takes (its `bpw`
    in the measurement) on layer 0 (MLP at 5, attention at 4), keeps layer 1 at 3 and writes a quant no larger than
    the uniform 4-bit one, from the folders it is given (the measurement names folders of another job)."""
    inputs = _layout(tiny, tmp_path / "in")
    dkld = [[-0.02, -0.02], [-0.10, -0.30], [0.001, 0.002], [0.001, 0.002]]  # attn 0, mlp 0, attn 1, mlp 1
    measurement = tmp_path / "measurement.json"
    measurement.write_text(json.dumps(exl3_layout.measurement(inputs, 2, dkld)))
    spec = ENGINE.fit_calibration(OPT, 146 * 2048, "cuda")
    request = QuantizeRequest(
        source_dir=tiny,
        out_dir=tmp_path / "work" / "out",
        work_dir=tmp_path / "work",
        spec=spec,
        measurements={MEASURE_KLD: measurement},
        quants={s.tag: folder for s, folder in zip(ENGINE.made_from(spec), inputs, strict=True)},
    )
    events = []
    ENGINE.quantize(request, events.append)
    out = request.out_dir
    header = read_header(out / "model.safetensors")
    widths = {k.removesuffix(".trellis"): i["shape"][2] // 16 for k, i in header.items() if k.endswith(".trellis")}
    assert widths == {
        **{f"model.layers.0.self_attn.{p}": 4 for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
        **{f"model.layers.0.mlp.{p}": 5 for p in ("gate_proj", "up_proj", "down_proj")},
        **{f"model.layers.1.{p}": 3 for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")},
        **{f"model.layers.1.{p}": 3 for p in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")},
        "lm_head": 6,
    }
    tensors = load_file(str(out / "model.safetensors"))
    assert (tensors["model.layers.0.mlp.up_proj.trellis"] == 5).all()  # the 5-bit input's own tensor, copied
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    target = exl3_layout.bpw(inputs[1], 2)
    assert qc["quant_method"] == "exl3" and qc["head_bits"] == 6 and 3.0 < qc["bits"] <= round(target, 2)
    assert [e["bits"] for e in events if "bits" in e] == [qc["bits"]]
    assert (out / "quantization_config.json").is_file() and (out / "tokenizer.json").is_file()
    assert sum(tensor_bytes(out).values()) <= sum(tensor_bytes(inputs[1]).values())


def test_a_refused_optimize_fails_its_step(tiny, tmp_path, no_gpu):
    inputs = _layout(tiny, tmp_path / "in")
    measurement = tmp_path / "measurement.json"
    measurement.write_text(json.dumps(exl3_layout.measurement(inputs, 2, [[-0.1, -0.2]] * 4)))
    with pytest.raises(JobFailed, match="exllamav3's optimize refused the measurement: Must specify at least two"):
        optimize.optimize(measurement, inputs[:1], 4.0, tmp_path / "out", tmp_path / child.LOG_NAME, lambda e: None)


@pytest.mark.parametrize(
    ("bits", "problem"),
    [
        (3.65, None),
        (3.0, None),
        (3.81, None),  # written rounded to 2 decimals
        (3.83, "reached 3.83 bits per weight, not the 3.0 to 3.80 asked for"),
        (2.9, "reached 2.9 bits per weight"),
    ],
)
def test_an_optimized_quant_is_checked_between_its_lowest_input_and_its_budget(tmp_path, bits, problem):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"x")
    qc = {"quant_method": "exl3", "bits": bits, "head_bits": 6}
    (out / "config.json").write_text(json.dumps({"quantization_config": qc}))
    (out / "quantization_config.json").write_text("{}")
    if problem is None:
        exl3.check_output(out, OPT, tmp_path / "engine.log", bits=(3.0, 3.8013))
    else:
        with pytest.raises(JobFailed, match=problem):
            exl3.check_output(out, OPT, tmp_path / "engine.log", bits=(3.0, 3.8013))


def test_measure_is_given_the_jobs_calibration_rows(tiny, tmp_path, no_gpu):
    """The measurement's calibration is `rows` x `length` windows of the job's text under the source's tokenizer,
    written as exllamav3 reads a `-cd` file; without a GPU exllamav3's measure stops at its device, and nothing is
    kept."""
    inputs = _layout(tiny, tmp_path / "in")
    text = calibration.TextSet("builtin:mix", calibration.builtin_text("c4")[:200_000], "sha")
    parquet = calibration.write_parquet(text, tmp_path / "calibration.parquet")
    work, out = tmp_path / "measure", tmp_path / "m.json"
    earlier = {s.tag: q for s, q in zip(ENGINE.made_from(OPT), inputs, strict=True)}
    with pytest.raises(JobFailed, match="exllamav3's measurement failed: RuntimeError: Cannot access accelerator"):
        ENGINE.measure(MEASURE_KLD, tiny, parquet, 10, 1024, work, out, earlier, lambda e: None)
    rows = load_file(str(work / "calibration.safetensors"))["input_ids"].tolist()
    assert rows == calibration.token_windows(tokenize(tiny, text.text), 10, 1024, "the calibration text")
    # measure's stdout reaches the log through the parent, its traceback straight from its stderr: the two interleave
    # by line (a CI run had the traceback between the inputs), so the inputs are looked for among stdout's lines
    said = [ln for ln in (work / child.LOG_NAME).read_text().splitlines() if ln.startswith(("    - ", "    Output"))]
    assert said == [*(f"    - {q}" for q in inputs), f"    Output file: {work / 'measurement.json'}"]
    assert not out.exists()


def _probe(tiny: Path, cal: Path, rows: int, length: int, log: Path) -> list[list[int]]:
    cmd = optimize.measure_command(tiny, [tiny], cal, rows, length, tmp := log.with_suffix(".json"))
    at = cmd.index(optimize.MEASURE)
    cmd[at : at + 1] = ["tests.support.exl3_calibration_probe"]
    out = []
    child.run_command(
        cmd,
        log,
        out.append,
        "the probe",
        parse=lambda line: {"rows": json.loads(line)} if line.startswith("[[") else None,
    )
    assert not tmp.exists()
    return out[-1]["rows"]


def test_measure_reads_the_jobs_rows_not_its_builtin_mix(tiny, tmp_path, no_gpu):
    """exllamav3's measure has no calibration option, and half its built-in mix is wiki.utf8, the default eval text.
    The wrapper puts the job's rows where measure_model takes its calibration (get_default_calibration, imported by
    name when it runs: checked in the installed source), read by exllamav3's own `-cd` reader, which refuses a token
    the model does not have."""
    package = Path(importlib.util.find_spec("exllamav3").submodule_search_locations[0])  # importing it builds CUDA
    source = (package / "conversion" / "measure_model.py").read_text()
    assert "from .calibration_data import get_default_calibration" in source
    assert "state = get_default_calibration(args, tokenizer)" in source
    rows = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    cal = exl3.write_calibration(rows, tmp_path / "cal.safetensors")
    assert _probe(tiny, cal, 3, 4, tmp_path / "probe.log") == [r[:4] for r in rows]
    bad = exl3.write_calibration([[0, 1, 99_999]], tmp_path / "bad.safetensors")
    with pytest.raises(JobFailed):
        _probe(tiny, bad, 1, 3, tmp_path / "bad.log")
    assert "contains token ids outside the model's vocab" in (tmp_path / "bad.log").read_text()
