"""The registry: one SQLite file under WORKBENCH_HOME listing every run and endpoint.

The kernel helpers, the CLI and the Jupyter server extension all read and write it through this
module. WAL mode and one short transaction per call keep it safe for concurrent readers and
writers (several kernels, the CLI and the lab panel at once). The run directory stays the source
of truth for a run's state; the registry caches it so listing runs never has to open every folder.

    >>> reg = Registry()                                           # doctest: +SKIP
    >>> [r.name for r in reg.list_runs()]                          # doctest: +SKIP
    ['quickstart']
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import EndpointNotFoundError, RunNotFoundError
from workbench.runs.home import home

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    target TEXT NOT NULL,
    backend_job_id TEXT,
    run_dir TEXT NOT NULL,
    state TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_name ON runs(name);
CREATE TABLE IF NOT EXISTS endpoints (
    name TEXT PRIMARY KEY,
    target TEXT NOT NULL,
    url TEXT NOT NULL,
    state TEXT NOT NULL,      -- starting | healthy | stopped | failed
    pid INTEGER,              -- the guard process (process group leader) on the target
    server_pid INTEGER,       -- the vLLM server process
    endpoint_dir TEXT NOT NULL,
    serves TEXT NOT NULL,     -- JSON: model, served names, adapters, runs, max_lora_rank, ...
    created REAL NOT NULL,
    updated REAL NOT NULL,
    deployment TEXT           -- a new id per deploy: which deployment of NAME the row describes
);
"""
# Columns added after a table's first release: (table, column, type). A registry written by an
# older workbench gets them on first open; its rows read NULL there.
_ADDED_COLUMNS = (("endpoints", "deployment", "TEXT"),)


@dataclass(frozen=True)
class RunRecord:
    id: str
    name: str
    target: str
    backend_job_id: str | None
    run_dir: str
    state: str
    created: float
    updated: float


@dataclass(frozen=True)
class EndpointRecord:
    name: str
    target: str
    url: str
    state: str
    pid: int | None
    server_pid: int | None
    endpoint_dir: str
    serves: str
    created: float
    updated: float
    # The deploy this row describes (workbench.serve.identity): a name outlives its deployments.
    # None for a row that records none.
    deployment: str | None = None


class Registry:
    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else home() / "registry.sqlite"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.executescript(_SCHEMA)
            _add_missing_columns(db)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # A fresh connection per call: cheap for SQLite, and safe across threads and forks.
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA busy_timeout=30000")
            db.row_factory = sqlite3.Row
            yield db
        finally:
            db.close()

    def add_run(self, record: RunRecord) -> RunRecord:
        with self._connect() as db:
            db.execute(
                "INSERT INTO runs VALUES (:id, :name, :target, :backend_job_id, :run_dir, :state, "
                ":created, :updated)", record.__dict__,
            )
        return record

    def _update(self, table: str, key: str, value: str, allowed: set[str],
                fields: dict[str, object], where: str = "",
                params: dict[str, object] | None = None) -> bool:
        """Set ``fields`` on the row whose ``key`` is ``value`` (and that matches ``where``);
        whether a row was changed."""
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"cannot update {sorted(bad)}; updatable: {sorted(allowed)}")
        fields["updated"] = time.time()
        cols = ", ".join(f"{k} = :{k}" for k in fields)
        with self._connect() as db:
            cur = db.execute(f"UPDATE {table} SET {cols} WHERE {key} = :{key}{where}",
                             {**fields, **(params or {}), key: value})
            return cur.rowcount > 0

    def update_run(self, run_id: str, **fields: object) -> None:
        self._update("runs", "id", run_id, {"state", "backend_job_id", "run_dir", "target"},
                     fields)

    def get_run(self, id_or_name: str) -> RunRecord:
        """By exact id, else the newest run with that name, else a unique id prefix."""
        with self._connect() as db:
            row = db.execute("SELECT * FROM runs WHERE id = ?", (id_or_name,)).fetchone()
            if row is None:
                row = db.execute("SELECT * FROM runs WHERE name = ? ORDER BY created DESC LIMIT 1",
                                 (id_or_name,)).fetchone()
            if row is None:
                rows = db.execute("SELECT * FROM runs WHERE id LIKE ? ESCAPE '\\'",
                                  (_like_prefix(id_or_name),)).fetchall()
                if len(rows) == 1:
                    row = rows[0]
        if row is None:
            raise RunNotFoundError(
                f"no run with id or name {id_or_name!r}; `workbench status` lists the runs"
            )
        return RunRecord(**dict(row))

    def list_runs(self, limit: int | None = None) -> list[RunRecord]:
        sql = "SELECT * FROM runs ORDER BY created DESC"
        params: tuple = ()
        if limit is not None:
            sql += " LIMIT ?"
            params = (limit,)
        with self._connect() as db:
            return [RunRecord(**dict(r)) for r in db.execute(sql, params).fetchall()]

    def delete_run(self, run_id: str) -> None:
        with self._connect() as db:
            db.execute("DELETE FROM runs WHERE id = ?", (run_id,))

    # -- endpoints (workbench.serve) ---------------------------------------------------------------
    def add_endpoint(self, record: EndpointRecord) -> EndpointRecord:
        with self._connect() as db:
            db.execute(
                "INSERT INTO endpoints (name, target, url, state, pid, server_pid, endpoint_dir, "
                "serves, created, updated, deployment) VALUES (:name, :target, :url, :state, "
                ":pid, :server_pid, :endpoint_dir, :serves, :created, :updated, :deployment)",
                record.__dict__,
            )
        return record

    def update_endpoint(self, name: str, *, deployment: str | None, **fields: object) -> bool:
        """Set ``fields`` on endpoint ``name`` only while its row still describes ``deployment``
        (None: a row recorded without one); False, and nothing written, once the name belongs to
        another deployment or to none. A name is reused by every deploy, so a write by name
        alone could land on a newer endpoint."""
        return self._update("endpoints", "name", name,
                            {"state", "url", "pid", "server_pid", "serves"}, fields,
                            " AND deployment IS :deployment", {"deployment": deployment})

    def get_endpoint(self, name: str) -> EndpointRecord:
        with self._connect() as db:
            row = db.execute("SELECT * FROM endpoints WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise EndpointNotFoundError(
                f"no endpoint named {name!r}; `workbench endpoints --all` lists the endpoints"
            )
        return EndpointRecord(**dict(row))

    def list_endpoints(self) -> list[EndpointRecord]:
        with self._connect() as db:
            rows = db.execute("SELECT * FROM endpoints ORDER BY created DESC").fetchall()
        return [EndpointRecord(**dict(r)) for r in rows]

    def delete_endpoint(self, name: str) -> None:
        with self._connect() as db:
            db.execute("DELETE FROM endpoints WHERE name = ?", (name,))


def _add_missing_columns(db: sqlite3.Connection) -> None:
    for table, column, kind in _ADDED_COLUMNS:
        if column in {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}:
            continue
        try:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        except sqlite3.OperationalError as exc:  # another process added it first
            if "duplicate column" not in str(exc):
                raise


def _like_prefix(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
