"""The run record: runs, driver attempts, steps, side-effect events and the unit cache.

It lives in the same database as the engine's own tables (SQLite file or PostgreSQL), so one
URL names a run's whole durable state. Only plain SQLAlchemy here: the CLI and the report read
it without starting the engine.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .._errors import UserError
from .._procs import pid_alive
from ._sqlite import sqlite_engine

_meta = sa.MetaData()
runs = sa.Table(
    "drl_runs",
    _meta,
    sa.Column("run_id", sa.String(200), primary_key=True),
    sa.Column("config", sa.Text, nullable=False),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("started_at", sa.Float),
    sa.Column("finished_at", sa.Float),
)
attempts = sa.Table(
    "drl_driver_attempts",
    _meta,
    sa.Column("run_id", sa.String(200), primary_key=True),
    sa.Column("attempt", sa.Integer, primary_key=True),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("host", sa.String(255), nullable=False),
    sa.Column("started_at", sa.Float, nullable=False),
)
steps = sa.Table(
    "drl_steps",
    _meta,
    sa.Column("run_id", sa.String(200), primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True),
    sa.Column("n_trials", sa.Integer, nullable=False),
    sa.Column("n_specs", sa.Integer, nullable=False),
    sa.Column("mean_reward", sa.Float, nullable=False),
    sa.Column("mean_turns", sa.Float, nullable=False),
    sa.Column("weights_version", sa.Integer, nullable=False),
    sa.Column("wall_s", sa.Float, nullable=False),
    sa.Column("max_turns", sa.Integer, nullable=False),
    sa.Column("driver_attempt", sa.Integer, nullable=False),
    sa.Column("failed_trials", sa.Text, nullable=False),
    sa.Column("error", sa.Text),
)
trials = sa.Table(
    "drl_trials",
    _meta,
    sa.Column("run_id", sa.String(200), primary_key=True),
    sa.Column("trial_id", sa.String(200), primary_key=True),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("reward", sa.Float),
    sa.Column("rewards", sa.Text, nullable=False),
    sa.Column("error_type", sa.String(200)),
    sa.Column("error_message", sa.Text),
    sa.Column("info", sa.Text, nullable=False),
)
events = sa.Table(
    "drl_events",
    _meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(200), nullable=False, index=True),
    sa.Column("kind", sa.String(40), nullable=False),
    sa.Column("key", sa.String(300), nullable=False),
    sa.Column("attempt", sa.Integer),
    sa.Column("seconds", sa.Float),
    sa.Column("detail", sa.Text),
    sa.Column("at", sa.Float, nullable=False),
)
ledger = sa.Table(
    "drl_ledger",
    _meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(200), nullable=False, index=True),
    sa.Column("key", sa.String(300), nullable=False),
    sa.Column("model", sa.String(200), nullable=False),
    sa.Column("request", sa.Integer, nullable=False),
    sa.Column("outcome", sa.String(100), nullable=False),
    sa.Column("prompt_tokens", sa.Integer, nullable=False, default=0),
    sa.Column("completion_tokens", sa.Integer, nullable=False, default=0),
    sa.Column("cost_usd", sa.Float, nullable=False, default=0.0),
    sa.Column("latency_s", sa.Float),
    sa.Column("at", sa.Float, nullable=False),
)
cache = sa.Table(
    "drl_cache",
    _meta,
    sa.Column("identity", sa.String(64), primary_key=True),
    sa.Column("unit", sa.String(40), nullable=False),
    sa.Column("output", sa.Text, nullable=False),
    sa.Column("run_id", sa.String(200), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

# Counter name -> event kind it counts.
COUNTED_EVENTS = {
    "generate_executed": "generate_attempt",
    "generate_reused": "generate_reused",
    "judge_task_attempts": "verify_and_judge_attempt",
    "judge_calls": "judge_call",
    "worlds_built": "build_world_attempt",
    "worlds_reused": "build_world_reused",
    "train_steps_executed": "train_step_attempt",
    "train_steps_reused": "train_step_reused",
}


def default_url(cwd: Path) -> str:
    """SQLite in the project-local state folder."""
    return f"sqlite:///{(cwd / '.durable-rl' / 'state.sqlite').resolve()}"


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL, None for any other database."""
    if not url.startswith("sqlite:///"):
        return None
    return Path(url.removeprefix("sqlite:///"))


def state_dir(url: str, cwd: Path) -> Path:
    """Where files beside the database live (world snapshots, reports)."""
    path = sqlite_path(url)
    return path.parent if path is not None else cwd / ".durable-rl"


def _sqlalchemy_url(url: str) -> str:
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def shown(url: str) -> str:
    """A URL as it may be printed: without its password."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return url


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


@contextmanager
def database_errors(url: str) -> Iterator[None]:
    """Turn a database that cannot be reached, opened or written into one UserError line."""
    try:
        yield
    except sa.exc.DBAPIError as e:  # connection refused, no such database, disk full, read-only
        raise UserError(f"state database {shown(url)}: {_one_line(e.orig or e)}") from None
    except (sqlite3.Error, OSError) as e:
        raise UserError(f"state database {shown(url)}: {_one_line(e)}") from None


def check_url(url: str) -> None:
    """Refuse, as a UserError, a URL that cannot name a durable-rl state database."""
    if not url.startswith(("sqlite:///", "postgresql://", "postgres://", "postgresql+psycopg://")):
        raise UserError(f"unsupported state database URL {shown(url)!r}: use sqlite:///PATH or postgresql://...")
    path = sqlite_path(url)
    if path is None:
        return
    if not path.exists():
        if not path.parent.parent.is_dir():  # the state folder itself may be made, not a whole tree
            raise UserError(f"--db {url}: the folder {path.parent.parent} does not exist")
        return
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a state database")
    if path.stat().st_size == 0:
        raise UserError(f"{path} is an empty file, not a state database")
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
            names = {row[0] for row in conn.execute("select name from sqlite_master where type='table'")}
    except sqlite3.DatabaseError as e:
        if "not a database" in str(e):
            raise UserError(f"{path} is not a durable-rl state database (not SQLite)") from None
        raise UserError(f"{path}: cannot open it: {_one_line(e)}") from None
    if names and "drl_runs" not in names:
        raise UserError(f"{path} is not a durable-rl state database (it has other tables)")


@dataclass(frozen=True)
class RunRow:
    """One run as recorded."""

    run_id: str
    config: dict[str, Any]
    status: str
    created_at: float
    started_at: float | None
    finished_at: float | None


class Store:
    """Reads and writes the run record; every write is one short transaction."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine: Engine = _make_engine(url)

    @classmethod
    def open_existing(cls, url: str) -> Store | None:
        """The store at `url` if it holds a run record, else None; creates nothing."""
        check_url(url)
        path = sqlite_path(url)
        if path is not None and not path.exists():
            return None
        store = cls(url)
        with database_errors(url):
            found = sa.inspect(store.engine).has_table("drl_runs")
        if not found:
            store.engine.dispose()
            return None
        return store

    @classmethod
    def create(cls, url: str) -> Store:
        """The store at `url`, with its tables made if they were missing."""
        check_url(url)
        path = sqlite_path(url)
        new = path is not None and not path.exists()
        try:
            with database_errors(url):
                if path is not None:
                    path.parent.mkdir(exist_ok=True)
                store = cls(url)
                if path is not None:
                    with store.engine.connect() as conn:
                        # WAL persists in the file, so the engine's connections use it too: readers stop
                        # blocking writers, and a commit is one append (synchronous=FULL keeps it durable)
                        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
                _meta.create_all(store.engine)
        except UserError:
            if new and path is not None:  # nothing half-written: a database this call began goes
                for leftover in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
                    leftover.unlink(missing_ok=True)
            raise
        return store

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            yield conn

    # runs
    def create_run(self, run_id: str, config_json: str) -> None:
        with database_errors(self.url), self._tx() as c:
            c.execute(runs.insert().values(run_id=run_id, config=config_json, status="running", created_at=time.time()))

    def run(self, run_id: str) -> RunRow | None:
        with self._tx() as c:
            row = c.execute(runs.select().where(runs.c.run_id == run_id)).first()
        return _run_row(row) if row is not None else None

    def runs(self) -> list[RunRow]:
        with self._tx() as c:
            rows = c.execute(runs.select().order_by(runs.c.created_at, runs.c.run_id)).all()
        return [_run_row(r) for r in rows]

    def set_status(self, run_id: str, status: str) -> None:
        values: dict[str, Any] = {"status": status}
        if status == "succeeded":
            values["finished_at"] = time.time()
        with self._tx() as c:
            c.execute(runs.update().where(runs.c.run_id == run_id).values(**values))

    def record_start(self, run_id: str) -> float:
        """The run's start time: written once, then always read back."""
        with self._tx() as c:
            c.execute(
                runs.update().where(runs.c.run_id == run_id, runs.c.started_at.is_(None)).values(started_at=time.time())
            )
            started: float = c.execute(sa.select(runs.c.started_at).where(runs.c.run_id == run_id)).scalar_one()
        return started

    # driver attempts
    def add_attempt(self, run_id: str) -> int:
        """Record that a driver process took the run over; return its 1-based attempt number."""
        with self._tx() as c:
            last = c.execute(sa.select(sa.func.max(attempts.c.attempt)).where(attempts.c.run_id == run_id)).scalar()
            attempt = (last or 0) + 1
            c.execute(
                attempts.insert().values(
                    run_id=run_id, attempt=attempt, pid=os.getpid(), host=socket.gethostname(), started_at=time.time()
                )
            )
        return attempt

    def attempts(self, run_id: str) -> list[dict[str, Any]]:
        with self._tx() as c:
            rows = c.execute(attempts.select().where(attempts.c.run_id == run_id).order_by(attempts.c.attempt)).all()
        return [dict(r._mapping) for r in rows]

    # steps
    def record_step(self, row: dict[str, Any], trial_rows: list[dict[str, Any]]) -> None:
        """A finished step and its trials, once (a replay of the recording changes nothing)."""
        with self._tx() as c:
            exists = c.execute(
                sa.select(steps.c.step).where(steps.c.run_id == row["run_id"], steps.c.step == row["step"])
            ).first()
            if exists is None:
                c.execute(steps.insert().values(**row))
                if trial_rows:
                    c.execute(trials.insert(), trial_rows)

    def trials(self, run_id: str) -> list[dict[str, Any]]:
        """Per-trial results: reward(s), or the exception that made it skipped; what it reported."""
        with self._tx() as c:
            rows = c.execute(
                trials.select().where(trials.c.run_id == run_id).order_by(trials.c.step, trials.c.trial_id)
            )
            out = []
            for r in rows.all():
                d = dict(r._mapping)
                d["rewards"], d["info"] = json.loads(d["rewards"]), json.loads(d["info"])
                del d["run_id"]
                out.append(d)
        return out

    def steps(self, run_id: str) -> list[dict[str, Any]]:
        with self._tx() as c:
            rows = c.execute(steps.select().where(steps.c.run_id == run_id).order_by(steps.c.step)).all()
        out = []
        for r in rows:
            d = dict(r._mapping)
            d["failed_trials"] = json.loads(d["failed_trials"])
            out.append(d)
        return out

    # events and counters
    def event(
        self,
        run_id: str,
        kind: str,
        key: str,
        *,
        attempt: int | None = None,
        seconds: float | None = None,
        detail: str | None = None,
    ) -> None:
        with self._tx() as c:
            c.execute(
                events.insert().values(
                    run_id=run_id, kind=kind, key=key, attempt=attempt, seconds=seconds, detail=detail, at=time.time()
                )
            )

    def events(self, run_id: str, kind: str | None = None) -> list[dict[str, Any]]:
        query = events.select().where(events.c.run_id == run_id)
        if kind is not None:
            query = query.where(events.c.kind == kind)
        with self._tx() as c:
            return [dict(r._mapping) for r in c.execute(query.order_by(events.c.id)).all()]

    def counters(self, run_id: str) -> dict[str, int]:
        """The run's side-effect counters, across all its driver attempts and processes."""
        with self._tx() as c:
            counts: dict[str, int] = dict(
                c.execute(
                    sa.select(events.c.kind, sa.func.count()).where(events.c.run_id == run_id).group_by(events.c.kind)
                ).all()
            )
            n_attempts = c.execute(
                sa.select(sa.func.count()).select_from(attempts).where(attempts.c.run_id == run_id)
            ).scalar_one()
        step_rows = self.steps(run_id)
        out = {
            "trials_ok": sum(s["n_trials"] for s in step_rows),
            "trials_failed": sum(s["n_specs"] - s["n_trials"] for s in step_rows),
        }
        out.update({name: int(counts.get(kind, 0)) for name, kind in COUNTED_EVENTS.items()})
        out["driver_attempts"] = int(n_attempts)
        return out

    def summary(self, run_id: str) -> dict[str, Any]:
        """The run as `--json` prints it."""
        row = self.run(run_id)
        assert row is not None
        return {
            "run_id": run_id,
            "status": self.display_status(row),
            "steps": [
                {
                    k: s[k]
                    for k in (
                        "step",
                        "n_trials",
                        "n_specs",
                        "mean_reward",
                        "mean_turns",
                        "weights_version",
                        "wall_s",
                        "error",
                    )
                }
                for s in self.steps(run_id)
            ],
            "counters": self.counters(run_id),
            "ledger": self.ledger(run_id),
        }

    def display_status(self, row: RunRow) -> str:
        """The recorded status, or `interrupted` for a running run whose driver is gone."""
        if row.status != "running":
            return row.status
        tried = self.attempts(row.run_id)
        if not tried:
            return "interrupted" if time.time() - row.created_at > 60 else "running"
        last = tried[-1]
        if last["host"] == socket.gethostname() and not pid_alive(last["pid"]):
            return "interrupted"
        return "running"

    # the judge's ledger
    def ledger_sent(self, run_id: str, key: str, model: str, request: int) -> int:
        """Write the intent of a request before it goes out; a crash leaves it `sent`: billed, answer lost."""
        with self._tx() as c:
            row = c.execute(
                ledger.insert().values(
                    run_id=run_id,
                    key=key,
                    model=model,
                    request=request,
                    outcome="sent",
                    prompt_tokens=0,
                    completion_tokens=0,
                    cost_usd=0.0,
                    at=time.time(),
                )
            )
            assert row.inserted_primary_key is not None
            return int(row.inserted_primary_key[0])

    def ledger_done(self, row_id: int, outcome: str, prompt: int, completion: int, cost: float, latency: float) -> None:
        with self._tx() as c:
            c.execute(
                ledger.update()
                .where(ledger.c.id == row_id)
                .values(
                    outcome=outcome,
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    cost_usd=cost,
                    latency_s=latency,
                )
            )

    def ledger(self, run_id: str) -> dict[str, Any]:
        """What judging cost the run, and what replay and reuse saved it."""
        with self._tx() as c:
            rows = [dict(r._mapping) for r in c.execute(ledger.select().where(ledger.c.run_id == run_id)).all()]
        saved = [json.loads(e["detail"] or "{}") for e in self.events(run_id, "judge_reused")]
        answered = [r for r in rows if r["outcome"] == "answered"]
        return {
            "judge_calls": len(self.events(run_id, "judge_call")),
            "requests": len(rows),
            "answered": len(answered),
            "lost_answers": sum(r["outcome"] == "sent" for r in rows),
            "failed_requests": sum(r["outcome"] not in ("answered", "sent") for r in rows),
            "prompt_tokens": sum(r["prompt_tokens"] for r in answered),
            "completion_tokens": sum(r["completion_tokens"] for r in answered),
            "cost_usd": round(sum(r["cost_usd"] for r in answered), 6),
            "saved": {
                "calls": len(saved),
                "prompt_tokens": sum(s.get("prompt_tokens", 0) for s in saved),
                "completion_tokens": sum(s.get("completion_tokens", 0) for s in saved),
                "cost_usd": round(sum(s.get("cost_usd", 0.0) for s in saved), 6),
            },
        }

    # the unit cache
    def cache_get(self, identity: str) -> str | None:
        with self._tx() as c:
            value: str | None = c.execute(sa.select(cache.c.output).where(cache.c.identity == identity)).scalar()
        return value

    def cache_put(self, identity: str, unit: str, output: str, run_id: str, done: dict[str, Any] | None = None) -> None:
        """Record a unit's output under its identity (the first record wins, it never changes),
        and in the same transaction the `done` event of the call that produced it."""
        with self._tx() as c:
            exists = c.execute(sa.select(cache.c.identity).where(cache.c.identity == identity)).first()
            if exists is None:  # an identical call may have recorded it first: equal identities, equal outputs
                c.execute(
                    cache.insert().values(
                        identity=identity, unit=unit, output=output, run_id=run_id, created_at=time.time()
                    )
                )
            if done is not None:
                c.execute(events.insert().values(run_id=run_id, at=time.time(), **done))


def _run_row(row: Any) -> RunRow:
    m = row._mapping
    return RunRow(
        run_id=m["run_id"],
        config=json.loads(m["config"]),
        status=m["status"],
        created_at=m["created_at"],
        started_at=m["started_at"],
        finished_at=m["finished_at"],
    )


def _make_engine(url: str) -> Engine:
    if sqlite_path(url) is None:
        return sa.create_engine(_sqlalchemy_url(url), pool_pre_ping=True)
    return sqlite_engine(url)
