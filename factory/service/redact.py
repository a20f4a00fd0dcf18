"""What the service shows a user: the jobs they may see (`visible_jobs`), and, to a user who is not its admin, none of
the server's own files (`shown`): no path outside the folders it
serves models from (FACTORY_SERVE_SOURCES, which its users name sources in). A job's work folder, FACTORY_HOME,
an engine's install or a source folder of the admin's own `qf run` appear as `<server>/<last part>`; the admin
sees them whole, and the server's log has them for everyone."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import PurePosixPath

from factory import settings
from factory.catalog import status
from factory.catalog.accounts import Account

# An absolute path (also as a `file:` text): a "/" that does not continue a word, a URL or a relative path, up to a
# space, a quote or a bracket.
_PATH = re.compile(r"(?:(?<=file:)|(?<![\w.:/~-]))/[^\s'\"`,;()<>\[\]{}]+")


def paths(value, config: settings.Settings):
    """`value` (JSON: dicts, lists, strings) with every server path outside the served folders masked."""
    if isinstance(value, str):
        return _PATH.sub(lambda m: _shown(m.group(), config), value)
    if isinstance(value, dict):
        return {k: paths(v, config) for k, v in value.items()}
    if isinstance(value, list):
        return [paths(v, config) for v in value]
    return value


def _shown(path: str, config: settings.Settings) -> str:
    pure = PurePosixPath(path.rstrip(".:"))
    if ".." not in pure.parts and any(pure.is_relative_to(root) for root in config.serve_sources):
        return path
    return f"<server>/{pure.name}" + path[len(str(pure)) :]


def shown(value, who: Account, config: settings.Settings):
    """`value` as `who` may see it: whole for the admin, without the server's own paths for others."""
    return value if who.admin else paths(value, config)


def visible_jobs(config: settings.Settings, who: Account, **query) -> list[dict]:
    """status.job_rows of the jobs `who` may see: their own, or every job (admin, the public dashboard); server
    paths masked for all but the admin."""
    rows = status.job_rows(
        config.db_url, user=None if who.sees_every_job else who.user, broker_url=config.broker_url, **query
    )
    return shown(rows, who, config)


def shown_events(events: Iterator[dict | None], who: Account, config: settings.Settings) -> Iterator[dict | None]:
    """A job's events (`GET /api/jobs/J/events`) as `who` may see them, as `shown` does for its rows; closing this
    closes `events` (its Redis subscription)."""
    try:
        for event in events:
            yield event if event is None else shown(event, who, config)
    finally:
        events.close()
