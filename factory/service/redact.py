"""What the service shows a user who is not its admin of the server's own files: no path outside the folders it
serves models from (FACTORY_SERVE_SOURCES, which its users name sources in). A job's work folder, FACTORY_HOME,
an engine's install or a source folder of the admin's own `qf run` appear as `<server>/<last part>`; the admin
sees them whole, and the server's log has them for everyone."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from factory import settings

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
