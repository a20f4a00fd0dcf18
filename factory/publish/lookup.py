"""Finding quants by name (`NAME[:TAG][@REV]`): what `qf show`, `qf pull` and the service share. A rev is a prefix:
`@<source rev>` (7 hex) selects the newest quant of that source revision, whether its rev is the source's own or
the source's followed by its files' hash (factory/publish/publishing.py). A quant removed with `qf rm` (a tombstone)
is never found."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from factory import engines
from factory.catalog import Catalog, Quant
from factory.errors import NotFound
from factory.registry import naming
from factory.registry.published import QuantRow


def find(catalog: Catalog, ref: naming.QuantRef) -> list[Quant]:
    """The quants of ref.name (matching ref.tag/ref.rev if given), newest first; NotFound listing what exists."""
    names = catalog.jobs.model_names()
    quants = catalog.quants.live(name=ref.name)
    if ref.name not in names:
        known = ", ".join(names) or "none yet"
        raise NotFound(f"no model named {ref.name!r}; known names: {known}")
    matching = [
        q for q in quants if (ref.tag is None or q.tag == ref.tag) and (ref.rev is None or q.rev.startswith(ref.rev))
    ]
    if ref.tag is not None and not matching:
        tags = ", ".join(sorted({f"{q.tag}@{q.rev}" for q in quants})) or "none yet"
        raise NotFound(f"{ref} does not exist; tags of {ref.name}: {tags}")
    return sorted(matching, key=lambda q: q.created_at, reverse=True)


def with_fits(catalog: Catalog, registry: Path, ref: naming.QuantRef) -> list[QuantRow]:
    """`find`'s quants as rows, each with what its engine says fits each GPU (its files are in `registry`)."""
    rows = []
    for q in find(catalog, ref):
        folder = registry / q.path
        rows.append(
            replace(catalog.quants.row(q), fits=engines.get(q.method).memory.fits(folder) if folder.is_dir() else None)
        )
    return rows
