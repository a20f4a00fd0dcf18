"""`qf` in this process with its own FACTORY_HOME and catalog (`Qf`), and a fresh catalog database: SQLite under
the test's home, or with QF_TEST_PG=postgresql://user@host:port/db a new PostgreSQL database on that server."""

from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from factory.cli import app

PG = os.environ.get("QF_TEST_PG")


@contextmanager
def fresh_database():
    """A new empty catalog database URL on the QF_TEST_PG server, dropped afterwards; "" (SQLite) without it."""
    if not PG:
        yield ""
        return
    name = f"qf_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG.replace("postgresql://", "postgresql+psycopg2://", 1), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield PG.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@dataclass
class Qf:
    home: Path
    db_url: str = ""
    runner: CliRunner = field(default_factory=CliRunner)

    @property
    def env(self) -> dict[str, str]:
        return {"FACTORY_HOME": str(self.home), "FACTORY_DB_URL": self.db_url}

    def __call__(self, *args: object):
        return self.runner.invoke(app, [str(a) for a in args], env=self.env)

    def json(self, *args: object):
        result = self(*args, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    def registry_files(self) -> list[Path]:
        registry = self.home / "registry"
        return sorted(p for p in registry.rglob("*") if p.is_file()) if registry.exists() else []
