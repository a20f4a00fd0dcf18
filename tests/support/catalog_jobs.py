"""A job row made straight in the catalog, for tests of the catalog's own rules (no planning, no source on disk)."""

from __future__ import annotations

from factory.catalog import Catalog, Job


def bare_job(catalog: Catalog, n: int | str = 0, **fields) -> Job:
    """`catalog.jobs.create` with placeholder fields (`m<n>`, key `key-<n>`), `fields` over them."""
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
    return catalog.jobs.create(**(made | fields))[0]
