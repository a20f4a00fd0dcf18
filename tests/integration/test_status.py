"""factory/catalog/status.py reads jobs with plain SQL; it must read what the catalog (SQLAlchemy) wrote, on SQLite and
on PostgreSQL (the second pass of scripts/test)."""

from __future__ import annotations

import json

from sqlalchemy import text

from factory import engines, specs
from factory.catalog import Catalog, status
from tests.support.catalog_jobs import bare_job
from tests.support.round_engine import ENGINE as ROUND


def test_plain_sql_reads_what_the_catalog_wrote(finished):
    qf, events = finished
    url = qf.db_url or f"sqlite:///{qf.home / 'catalog.db'}"
    job = Catalog(url).jobs.get(events[-1]["job"])
    (row,) = status.job_rows(url, job_id=job.id)
    assert row == {
        "id": job.id,
        "name": job.name,
        "state": "succeeded",
        "error": None,
        "exit_code": job.exit_code,
        "source": job.source,
        "source_identity": job.source_identity,
        "specs": [s.model_dump() for s in job.specs],
        "device": job.device,
        "created_at": job.created_at.isoformat(timespec="seconds"),
        "steps": [
            {
                "name": s.name,
                "state": s.state,
                "started_at": s.started_at.isoformat(),
                "seconds": s.seconds,
                "expected_seconds": s.expected_seconds,
                "error": s.error,
                "peak_gpu_bytes": s.peak_gpu_bytes,
                "holder": s.holder,
                "note": s.note,
            }
            for s in job.steps
        ],
        "holder": None,
        "attempts": 1,  # `qf run` held it once and released it
        "summary": {  # what every view of the job says: each step once, all of them done here
            "done": len({s.name for s in job.steps}),
            "total": len({s.name for s in job.steps}),
            "running": [],
            "seconds": round(sum(s.seconds for s in job.steps), 1),
        },
        "expected_end": None,
        "eta_seconds": None,  # only while it runs
        "waiting": None,  # only for a queued job that no worker takes (tests/integration/test_fleet_cpu.py)
    }
    names = [s["name"] for s in row["steps"]]
    assert names[0] == "inspect" and "quantize:awq-w4g128" in names
    assert status.job_rows(url, name=job.name) == [row] == status.job_rows(url)
    assert status.job_rows(url, name="other") == [] == status.job_rows(url, job_id="nope")


def test_no_catalog_yet_is_no_jobs(qf):
    result = qf("status", "--json")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "[]"
    assert qf("status", "nope").exit_code == 4


def test_unsupported_database_url(qf):
    qf.db_url = "mysql://u:secret@db/x"
    result = qf("status")
    assert result.exit_code == 2
    assert "mysql://u:***@db/x is neither sqlite:///PATH nor postgresql://" in result.stderr


def test_specs_are_stored_as_dicts_and_read_back_typed(tmp_path, db_url):
    """The catalog's edge (catalog/schema.py's Spec and Specs): a job's specs go in as their model_dump(), the form
    every catalog holds already, and come out as their engines' spec classes; a spec whose engine this process has
    not registered (a plugin that is not loaded here) comes out as specs.Unregistered, its fields as stored."""
    catalog = Catalog(db_url or f"sqlite:///{tmp_path / 'catalog.db'}")
    awq = engines.get("awq").spec(group_size=128)
    engines.register(ROUND)
    try:
        job = bare_job(catalog, specs=[awq, ROUND.spec(mantissa=3)])
        assert catalog.jobs.get(job.id).specs == [awq, ROUND.spec(mantissa=3)]
    finally:
        engines.unregister(ROUND.name)
    with catalog.db.session() as s:
        stored = s.execute(text("SELECT specs FROM jobs WHERE id = :id"), {"id": job.id}).scalar_one()
    assert (json.loads(stored) if isinstance(stored, str) else stored) == [
        awq.model_dump(),
        {"method": "round", "mantissa": 3},
    ]
    read = catalog.jobs.get(job.id).specs
    assert read[0] == awq and type(read[1]) is specs.Unregistered
    assert read[1].model_dump() == {"method": "round", "mantissa": 3}
