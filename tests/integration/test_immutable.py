"""A published quant never changes under its name (issue 31, items 2 and 3): a second job with the same weights
reuses the quant and adds its evaluation; `qf rm` then the same `qf run` makes the quant again and says so."""

from __future__ import annotations

from factory.catalog import Catalog
from factory.identity import file_sha256


def _files(qf) -> dict[str, str]:
    return {str(p.relative_to(qf.home)): file_sha256(p) for p in qf.registry_files()}


def test_a_second_job_with_other_windows_reuses_the_quant(qf, tiny):
    first = qf("run", tiny, "--awq", "--eval-windows", "1")
    assert first.exit_code == 0, first.output
    [quant] = qf.json("ls")
    folder = qf.home / "registry" / quant["path"]
    before, stat = _files(qf), folder.stat()
    second = qf("run", tiny, "--awq", "--eval-windows", "2")
    assert second.exit_code == 0, second.output
    assert "reused " in second.output
    assert _files(qf) == before and (folder.stat().st_ino, folder.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    [again] = qf.json("ls")
    assert (again["name"], again["rev"], again["ppl"]) == (quant["name"], quant["rev"], quant["ppl"])
    [shown] = qf.json("show", quant["name"])["quants"]
    evaluations = shown["evaluations"]
    assert [e["windows"] for e in evaluations] == [1, 2]
    assert len({e["job"] for e in evaluations}) == 2 and all(e["ppl"] > 0 and e["text"] for e in evaluations)
    jobs = qf.json("jobs")
    second_job = next(j for j in jobs if j["id"] != quant["job"])
    catalog = Catalog(qf.db_url or f"sqlite:///{qf.home / 'catalog.db'}")
    steps = {s.name: s for s in catalog.jobs.get(second_job["id"]).steps}
    quantize = next(s for name, s in steps.items() if name.startswith("quantize:"))
    assert quantize.note.startswith(f"reused {quant['name']}@{quant['rev']}, published by job {quant['job']}")
    shown = qf("status", second_job["id"])  # the table says it too, and --json keeps the note
    assert f"reused {quant['name']}@{quant['rev']}" in shown.stdout, shown.stdout
    assert any((s["note"] or "").startswith("reused ") for s in qf.json("status", second_job["id"])["steps"])


def test_rm_then_the_same_run_makes_the_quant_again(qf, tiny):
    assert qf("run", tiny, "--awq", "--eval-windows", "1").exit_code == 0
    [quant] = qf.json("ls")
    ref = f"{quant['name']}@{quant['rev']}"
    removed = qf("rm", ref)
    assert removed.exit_code == 0 and "the same `qf run` makes it again" in removed.stderr
    assert qf.json("ls") == []
    again = qf("run", tiny, "--awq", "--eval-windows", "1")
    assert again.exit_code == 0, again.output
    assert f"its quant {ref} was removed with qf rm; making it again" in again.output
    [back] = qf.json("ls")
    assert back["name"] == quant["name"] and back["rev"].startswith(quant["rev"])
    assert quant["name"] in again.stdout
