"""A quant made to beat another (Engine.rival; EXL3's optimized size against its uniform one): the gate's rule on the
catalog's evaluation rows (factory/jobs/rivals.py), and `qf run` end to end with the test engine whose mixed size is
made from the job's other sizes (tests/support/round_engine.py's MIXED): its shared unit after the quants it reads,
the one that beats its rival published, the one that does not skipped at publish with both numbers, the job
succeeded; and the ranking's curve of a format drawn from its uniform sizes only."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from benchmarks import exl3_opt
from factory import engines, ranking, vram
from factory.catalog import Catalog
from factory.catalog.status import summary
from factory.engines.exl3.spec import Exl3Spec
from factory.jobs import rivals
from factory.registry.published import QuantRow
from tests.support.catalog_jobs import bare_job
from tests.support.round_engine import MIXED

OPT, UNIFORM = Exl3Spec(bpw=4.0, opt=True), Exl3Spec(bpw=4.0)


@pytest.fixture
def catalog(db_url, tmp_path) -> Catalog:
    return Catalog(db_url or f"sqlite:///{tmp_path / 'catalog.db'}")


def _scored(catalog: Catalog, job_id: str, subject: str, kld: float | None) -> None:
    catalog.quants.add_evaluation(
        job_id=job_id,
        subject=subject,
        source_identity="sha256:0",
        evaluator="exllamav3",
        device="cuda",
        eval_sha="e",
        windows=48,
        window_length=2048,
        ppl=13.0,
        kld=kld,
        seconds=1.0,
    )


def _folder(path: Path, layer_bytes: int) -> Path:
    """A quant folder whose tensors take `layer_bytes` in its layers and 1 KiB besides."""
    path.mkdir(parents=True)
    tensors = {
        "model.layers.0.mlp.up_proj.trellis": np.zeros(layer_bytes // 2, dtype=np.int16),
        "model.norm.weight": np.zeros(512, dtype=np.float16),
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize(
    ("opt_kld", "uniform_kld", "opt_bytes", "kept", "why"),
    [
        (0.0120, 0.0135, 1000, True, ""),
        (0.0120, 0.0135, 1024, True, ""),  # the same size
        (0.0135, 0.0135, 1000, False, "not below exl3-4.0bpw's"),
        (0.0150, 0.0135, 1000, False, "not below exl3-4.0bpw's"),
        (0.0120, 0.0135, 1026, False, "larger than exl3-4.0bpw"),
        (None, 0.0135, 1000, False, "no KL divergence to compare"),
    ],
)
def test_an_optimized_quant_is_kept_only_where_its_kld_is_lower_at_the_same_size(
    catalog, tmp_path, opt_kld, uniform_kld, opt_bytes, kept, why
):
    job = bare_job(catalog)
    _scored(catalog, job.id, OPT.tag, 0.5)  # an earlier evaluation of the same subject: the latest row counts
    _scored(catalog, job.id, OPT.tag, opt_kld)
    _scored(catalog, job.id, f"{OPT.tag}:kv-q8", 0.0001)  # another score of it, not its divergence from FP16
    _scored(catalog, job.id, UNIFORM.tag, uniform_kld)
    folders = {OPT.tag: _folder(tmp_path / "opt", opt_bytes), UNIFORM.tag: _folder(tmp_path / "uniform", 1024)}
    [decision] = rivals.decide(catalog, job.id, [Exl3Spec(bpw=3.0), UNIFORM, OPT], folders)
    assert (decision.tag, decision.rival, decision.kept, decision.why) == (OPT.tag, UNIFORM.tag, kept, why)
    mine = "unknown" if opt_kld is None else f"{opt_kld:.5f}"
    numbers = (
        f"KL divergence from FP16 {mine} against exl3-4.0bpw's {uniform_kld:.5f}, "
        f"{opt_bytes + 1024:,} bytes of tensors against {2048:,}"
    )
    assert decision.numbers == numbers
    assert str(decision) == (f"{OPT.tag} kept: {numbers}" if kept else f"{OPT.tag} not kept ({why}): {numbers}")


def test_a_quant_without_a_rival_is_not_decided(catalog):
    job = bare_job(catalog)
    assert rivals.decide(catalog, job.id, [UNIFORM, Exl3Spec(bpw=5.0)], {}) == []


@pytest.fixture
def mixed(monkeypatch):
    engines.register(MIXED)
    monkeypatch.setenv("QF_TEST_MIX_ABOVE", "2")  # xround-m2-mix takes m3's tensors (kept), m3-mix m2's (dropped)
    yield MIXED
    engines.unregister(MIXED.name)


def test_a_mixed_size_runs_after_what_it_is_made_from_and_is_kept_only_where_it_beats_its_rival(
    qf, tiny, tmp_path, mixed
):
    recipe = tmp_path / "mixed.yaml"
    recipe.write_text("xround: {mix: [2, 3]}\n")
    result = qf("run", tiny, "--recipe", recipe, "--eval-windows", 1, "--json")
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    notes = [e["message"] for e in events if e["event"] == "note" and e["message"].startswith("gate: ")]
    assert [n.partition(": KL")[0] for n in notes] == [
        "gate: xround-m2-mix kept",
        "gate: xround-m3-mix not kept (not below xround-m3's)",
    ]
    # what benchmarks/exl3_opt.py reads of such a job's events (the GPU sitting's results)
    kept = exl3_opt.summarize(events, "xround-m2", "xround-m2-mix", [f"xround-m{m}" for m in (1, 2, 3)], "mixmeasure")
    assert kept["kept"] and kept["state"] == "succeeded" and len(kept["measurements"]) == 2
    assert kept["optimized"]["kld"] == kept["made_from"]["xround-m3"]["kld"] < kept["uniform"]["kld"]
    assert kept["optimized"]["tensor_bytes"] == kept["uniform"]["tensor_bytes"] > 0
    dropped = exl3_opt.summarize(events, "xround-m3", "xround-m3-mix", [f"xround-m{m}" for m in (2, 3, 4)])
    assert not dropped["kept"] and dropped["optimized"]["published_bytes"] is None
    assert dropped["gate"].startswith("xround-m3-mix not kept (not below xround-m3's): KL divergence from FP16 ")
    rows = qf.json("ls")
    assert sorted(r["name"] for r in rows) == sorted(
        [f"tiny:xround-m{m}" for m in (1, 2, 3, 4)] + ["tiny:xround-m2-mix"]
    )
    kld = {r["name"].partition(":")[2]: r["kld"] for r in rows}
    assert kld["xround-m2-mix"] == kld["xround-m3"] < kld["xround-m2"]  # m2-mix is m3's tensors: m3's divergence

    status = qf.json("status", rows[0]["job"])
    assert status["state"] == "succeeded"
    steps = {s["name"]: s for s in status["steps"]}
    skipped = steps["publish:xround-m3-mix"]
    assert skipped["state"] == "skipped" and skipped["error"].startswith("xround-m3-mix not kept (not below")
    assert steps["publish:xround-m2-mix"]["state"] == "succeeded"
    measured = [name for name in steps if name.startswith("mixmeasure:")]
    assert len(measured) == 2  # one per mixed size: each is keyed by the weights of the quants it reads

    def in_order(mix: int, name: str) -> bool:  # the measurement starts after its inputs, the mixed size after it
        inputs = [steps[f"quantize:xround-m{mix + d}"] for d in (-1, 0, 1)]
        start = steps[name]["started_at"]
        return (
            all(s["started_at"] <= start for s in inputs)
            and start <= steps[f"quantize:xround-m{mix}-mix"]["started_at"]
        )

    # which measurement is whose is in their keys (hashes), and the two may start in either order
    assert any(all(map(in_order, (2, 3), order)) for order in itertools.permutations(measured))
    done = summary(status["steps"])
    assert done["done"] == done["total"]  # a skipped publish is a finished step


def _row(spec: Exl3Spec, kld: float) -> QuantRow:
    return QuantRow(
        name="tiny", tag=spec.tag, rev="1234567", method="exl3", bits=spec.bits, bytes=1000, ppl=13.0, fp16_ppl=12.0,
        kld=kld, kld_p99=None, top1=None, source="/models/tiny", source_identity="sha256:0",
        calibration="builtin:mix", eval={"text": "builtin:wiki", "windows": 8, "window_length": 2048}, versions={},
        job="j", path="tiny/x", spec=spec, created_at="2026-12-06T00:00:00",
    )  # fmt: skip


def test_the_ranking_reads_a_formats_curve_off_its_uniform_sizes_only(tiny):
    """An optimized size has its rival's bits: it is ranked as measured, and the sizes between the uniform ones are
    expected from the uniform ones (exl3-3.5bpw between 3.0 and 4.0, not between 3.0 and 4.0-opt)."""
    quants = [_row(Exl3Spec(bpw=3.0), 0.05), _row(UNIFORM, 0.02), _row(OPT, 0.005)]
    ranked = ranking.rank("tiny", ranking.Model.of(str(tiny)), quants, 80 * vram.GiB, 512, formats=["exl3"])
    by_tag = {r.tag: r for r in ranked.rows}
    assert by_tag[OPT.tag].kind == "measured" and ranked.ranked[0].tag == OPT.tag
    assert by_tag["exl3-3.5bpw"].kind == "expected"
    assert by_tag["exl3-3.5bpw"].kld == pytest.approx(math.sqrt(0.05 * 0.02), rel=1e-9)
    assert "between exl3-3.0bpw and exl3-4.0bpw" in by_tag["exl3-3.5bpw"].basis
