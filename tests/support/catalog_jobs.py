"""A job row made straight in the catalog, for tests of the catalog's own rules (no planning, no source on disk)."""

from __future__ import annotations

from factory.catalog import Catalog, Job


def bare_job(catalog: Catalog, n: int | str = 0, **fields) -> Job:
    """`catalog.jobs.create` with placeholder fields (`m<n>`, key `key-<n>`), `fields` over them; the job's name is
    registered for its source first, as submit does (PostgreSQL holds jobs.name to models.name)."""
    made = {
        "key": f"key-{n}",
        "name": f"m{n}",
        "source": f"/models/m{n}",
        "source_identity": f"sha256:{n}",
        "base_model": f"m{n}",
        "specs": [],
        "calibration": "builtin:mix",
        "calibration_sha": "c",
        "eval": "builtin:wiki",
        "eval_sha": "e",
        "eval_windows": 1,
        "max_ppl_ratio": 1.5,
        "versions": {},
        "device": "cpu",
    }
    made |= fields
    catalog.jobs.name_for(made["source"], made["name"], None)
    return catalog.jobs.create(**made)[0]
