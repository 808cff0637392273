"""The ledger: every run this user launched, in one SQLite file under $SKYSPOT_HOME.

The trainer's events (in the run directory or bucket) are the source of truth for
what happened; the ledger records what was launched (recipe, executor, store, job id)
and the executor's view (status, attempts), and caches a few figures so `status`
stays fast. SQLite in WAL mode with a busy timeout lets two launches and a `status`
run at once without corrupting anything. Files are private to the user (0600/0700).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal, Optional, Protocol, Sequence

from skyspot.errors import SkyspotError, UsageError
from skyspot.statuses import TERMINAL, RunStatus

if TYPE_CHECKING:
    from skyspot.recipe import Recipe

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    name TEXT PRIMARY KEY,
    recipe TEXT NOT NULL,
    executor TEXT NOT NULL,           -- 'local' or 'sky'
    status TEXT NOT NULL,             -- SkyPilot's managed-job status names
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    ended_at REAL,
    run_dir TEXT,                     -- local runs: the run root (checkpoints/, events/, logs/)
    store TEXT,                       -- where durable checkpoints and events live, if any
    job_id INTEGER,                   -- SkyPilot managed job id
    controller_pid INTEGER,           -- local runs: the executor process
    total_steps INTEGER,
    num_nodes INTEGER,
    exit_code INTEGER,
    info TEXT NOT NULL DEFAULT '{}'   -- JSON: candidates, options, where (never secrets)
);
"""

# One definition of SkyPilot's statuses (skyspot/statuses.py): a second list here lacked WINDING_DOWN and
# SUBMITTED, so recording a status SkyPilot reports raised "unknown status".
STATUSES = frozenset(RunStatus)


def skyspot_home() -> Path:
    # Absolute, whatever SKYSPOT_HOME says: the home names task mount sources (the wheel's folder, a
    # deadline's plan) and run directories, which processes started in other directories read.
    home = Path(os.path.abspath(os.path.expanduser(os.environ.get("SKYSPOT_HOME") or Path.home() / ".skyspot")))
    try:
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as error:
        raise SkyspotError(
            f"cannot use {home} as skyspot's home ({error.strerror or error}); set SKYSPOT_HOME to a directory you own"
        ) from None
    if not home.is_dir():
        raise SkyspotError(f"{home} is not a directory; set SKYSPOT_HOME to a directory you own")
    return home


ExecutorName = Literal["local", "sky"]
"""Which executor runs a run (skyspot/executors: `executor_for(run)`)."""


@dataclass
class Run:
    """One ledger row: what was launched and the executor's view of it."""

    name: str
    """The run name: the managed job's name, the node's run id and the store prefix."""
    recipe: str
    """The recipe's name."""
    executor: ExecutorName
    status: str
    """One of STATUSES, as SkyPilot spells managed-job statuses."""
    created_at: float
    """Unix time the run was recorded (before submission)."""
    updated_at: float
    ended_at: Optional[float]
    """Unix time it reached a TERMINAL status; None while it has not."""
    run_dir: Optional[str]
    """Local runs: the run root (checkpoints/, events/, logs/, local.json)."""
    store: Optional[str]
    """Where durable checkpoints and events live (s3://, gs://, az:// or a path), if any."""
    job_id: Optional[int]
    """SkyPilot runs: the managed job id."""
    controller_pid: Optional[int]
    """Local runs: the controller process."""
    total_steps: Optional[int]
    num_nodes: Optional[int]
    exit_code: Optional[int]
    info: dict[str, Any]
    """JSON extras: candidates, the rendered task (cloud runs), deadline, cause, cached summary; never secrets."""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


# Column -> the Python types a row may hold there; a row that disagrees is damaged.
_NUMBER = (int, float)
_COLUMN_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "recipe": (str,),
    "executor": (str,),
    "status": (str,),
    "created_at": _NUMBER,
    "updated_at": _NUMBER,
    "ended_at": _NUMBER + (type(None),),
    "run_dir": (str, type(None)),
    "store": (str, type(None)),
    "job_id": (int, type(None)),
    "controller_pid": (int, type(None)),
    "total_steps": (int, type(None)),
    "num_nodes": (int, type(None)),
    "exit_code": (int, type(None)),
    "info": (str, type(None)),
}


class Ledger:
    def __init__(self, path: Optional[Path] = None):
        self.path = Path(path) if path else skyspot_home() / "ledger.db"
        self.skipped_rows = 0
        """Damaged rows `runs()` left out (wrong types in a column)."""
        try:
            if not self.path.exists():
                fd = os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600)
                os.close(fd)
            elif self.path.is_file() and self.path.stat().st_mode & 0o077 and self.path.stat().st_uid == os.getuid():
                os.chmod(self.path, 0o600)  # a ledger from an older version or a copy: make it private again
        except OSError as error:
            raise SkyspotError(
                f"cannot open the ledger {self.path} ({error.strerror or error}); check SKYSPOT_HOME"
            ) from None
        try:
            self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            self._db.execute("PRAGMA busy_timeout=30000")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
            self._columns = [d[0] for d in self._db.execute("SELECT * FROM runs LIMIT 0").description]
        except sqlite3.DatabaseError as error:
            raise self._damaged(error) from None

    def _damaged(self, error: Exception) -> SkyspotError:
        return SkyspotError(f"the ledger {self.path} is damaged ({error}); move it aside to start a new one")

    def _query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        try:
            return self._db.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as error:
            raise self._damaged(error) from None

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.DatabaseError as error:
            raise self._damaged(error) from None
        try:
            yield self._db
            self._db.execute("COMMIT")
        except BaseException as error:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.DatabaseError:
                pass
            if isinstance(error, sqlite3.DatabaseError) and not isinstance(error, sqlite3.IntegrityError):
                raise self._damaged(error) from None
            raise

    def add(self, name: str, recipe: str, executor: str, *, status: str = "PENDING", **fields: Any) -> None:
        now = time.time()
        info = json.dumps(fields.pop("info", {}), default=str)
        columns = ["name", "recipe", "executor", "status", "created_at", "updated_at", "info", *fields]
        values = [name, recipe, executor, status, now, now, info, *fields.values()]
        try:
            with self._tx() as db:
                db.execute(f"INSERT INTO runs ({', '.join(columns)}) VALUES ({', '.join('?' * len(values))})", values)
        except sqlite3.IntegrityError:
            raise UsageError(f"a run named '{name}' exists already; pick another -n/--name") from None

    # ------------------------------------------------------------------ named changes
    # Each change is one read-modify-write inside one `BEGIN IMMEDIATE` transaction: SQLite lets one
    # writer in at a time, so the controller, a `cancel` and a `status` refresh that meet on a row each
    # see the others' writes, and info keys are merged into the row's info there, never read earlier
    # in Python and written back whole (which loses whatever another writer merged in between).

    def _change(
        self,
        name: str,
        *,
        status: Optional[str] = None,
        unless_ended: bool = False,
        info: Optional[dict[str, Any]] = None,
        append: Optional[dict[str, Any]] = None,
        **columns: Any,
    ) -> bool:
        """Set `status` and `columns` and merge `info` into the row's info (`append`: key -> a value added
        to the list under that key), all in one transaction; with `unless_ended`, nothing when the row
        has reached a TERMINAL status. Whether the row changed."""
        if status is not None:
            if status not in STATUSES:
                raise ValueError(f"unknown status {status!r}")
            columns["status"] = status
            if status in TERMINAL:
                columns.setdefault("ended_at", time.time())
        with self._tx() as db:
            rows = db.execute("SELECT status, info FROM runs WHERE name = ?", (name,)).fetchall()
            if not rows or (unless_ended and rows[0][0] in TERMINAL):
                return False
            if info or append:
                merged = _info_of(rows[0][1])
                merged.update(info or {})
                for key, value in (append or {}).items():
                    earlier = merged.get(key)
                    merged[key] = [*(earlier if isinstance(earlier, list) else []), value]
                columns["info"] = json.dumps(merged, default=str)
            columns["updated_at"] = time.time()
            db.execute(
                f"UPDATE runs SET {', '.join(f'{k} = ?' for k in columns)} WHERE name = ?", [*columns.values(), name]
            )
        return True

    def set_status(
        self, name: str, status: str, *, unless_ended: bool = False, ended_at: Optional[float] = None
    ) -> bool:
        """The executor's status as it last saw it (SkyPilot's queue, a deadline waiting for capacity)."""
        ended: dict[str, Any] = {"ended_at": ended_at} if ended_at is not None else {}
        return self._change(name, status=status, unless_ended=unless_ended, **ended)

    def set_controller(self, name: str, pid: int) -> None:
        """The local controller's process, once started."""
        self._change(name, controller_pid=pid)

    def set_job(self, name: str, job_id: int) -> None:
        """The managed job SkyPilot accepted."""
        self._change(name, job_id=job_id)

    def set_resumed(self, name: str, *, previous_job_id: Optional[int] = None, **info: Any) -> None:
        """A stopped run started again under its name: PENDING, no end yet; a cloud run's earlier job id
        joins `previous_job_ids`."""
        self._change(
            name,
            status="PENDING",
            ended_at=None,
            exit_code=None,
            info=info,
            append={"previous_job_ids": previous_job_id} if previous_job_id is not None else None,
        )

    def set_started(self, name: str, controller_pid: int) -> None:
        """The local controller provisions the first attempt."""
        self._change(name, status="STARTING", controller_pid=controller_pid)

    def set_recovering(self, name: str, **info: Any) -> None:
        """The local controller provisions a replacement after an attempt ended."""
        self._change(name, status="RECOVERING", info=info)

    def record_attempt(
        self, name: str, attempt: int, where: dict[str, Any], *, controller_pid: int, **info: Any
    ) -> None:
        """An attempt's nodes are running: where, and its number."""
        self._change(
            name, status="RUNNING", controller_pid=controller_pid, info={**info, "where": where, "attempt": attempt}
        )

    def set_activity(self, name: str, text: Optional[str], **info: Any) -> None:
        """What the run is doing when no event says it (None: nothing to say), for `launch` to show."""
        self._change(name, info={**info, "activity": text})

    def set_finished(self, name: str, status: str, *, exit_code: Optional[int], **info: Any) -> None:
        """The run ended (a TERMINAL status), with its exit code and what the executor knows of why."""
        if status not in TERMINAL:
            raise ValueError(f"{status!r} is not an ending")
        self._change(name, status=status, exit_code=exit_code, info=info)

    def set_failed(self, name: str, *, exit_code: int = 1, **info: Any) -> None:
        """The run could not start or its executor failed: FAILED, so no row says PENDING or RUNNING forever."""
        self.set_finished(name, "FAILED", exit_code=exit_code, **info)

    def set_cancelling(self, name: str) -> bool:
        """`cancel` asked the controller to stop; not over a run that has ended meanwhile."""
        return self._change(name, status="CANCELLING", unless_ended=True)

    def set_cancelled(self, name: str, *, unless_ended: bool = False) -> bool:
        """The run is stopped by `cancel` (`unless_ended`: not when it ended on its own meanwhile)."""
        return self._change(name, status="CANCELLED", unless_ended=unless_ended)

    def set_controller_gone(self, name: str, cause: str) -> bool:
        """A local run whose controller died without a word: FAILED_CONTROLLER, with why, unless it has
        ended; whether this call marked it."""
        return self._change(name, status="FAILED_CONTROLLER", unless_ended=True, info={"cause": cause})

    def cache_summary(self, name: str, row: dict[str, Any], signature: str) -> None:
        """`status`'s row of a finished run, kept against the signature of the events it was made from."""
        self._change(name, info={"summary": row, "summary_of": signature})

    def merge_info(self, name: str, **keys: Any) -> None:
        """Set these keys of the run's info, keeping every other key."""
        self._change(name, info=keys)

    def get(self, name: str) -> Run:
        rows = self._query("SELECT * FROM runs WHERE name = ?", (name,))
        if not rows:
            names = [
                r[0]
                for r in self._query("SELECT name FROM runs ORDER BY created_at DESC LIMIT 200")
                if isinstance(r[0], str)
            ]
            import difflib

            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ";"
            raise UsageError(f"no run named '{name}'{hint} `skyspot status -a` lists runs")
        try:
            return self._row(rows[0])
        except ValueError as error:
            raise SkyspotError(
                f"the ledger's row for run '{name}' is damaged ({error}); move {self.path} aside to start a new ledger"
            ) from None

    def runs(self, include_finished: bool = True) -> list[Run]:
        # Sorted here, not by SQLite: a damaged created_at must not reorder or break the listing.
        runs = []
        self.skipped_rows = 0
        for row in self._query("SELECT * FROM runs"):
            try:
                run = self._row(row)
            except ValueError:
                self.skipped_rows += 1  # a damaged row: skip it rather than fail the listing
                continue
            if include_finished or not run.terminal:
                runs.append(run)
        runs.sort(key=lambda r: r.created_at, reverse=True)
        return runs

    def _row(self, row: tuple[Any, ...]) -> Run:
        """A row as a Run; ValueError when a column holds what this version never writes there."""
        data = dict(zip(self._columns, row))
        for column, types in _COLUMN_TYPES.items():
            value = data.get(column)
            if not isinstance(value, types) or isinstance(value, bool):
                raise ValueError(f"column {column} holds {type(value).__name__}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"column {column} holds {value}")
        data["info"] = _info_of(data.get("info"))
        values: dict[str, Any] = {column: data.get(column) for column in _COLUMN_TYPES}  # checked above
        return Run(**values)


def _info_of(text: Optional[str]) -> dict[str, Any]:
    """A row's info column as a dict; damaged JSON reads as empty: what was launched still shows, only the
    extras are lost."""
    try:
        info = json.loads(text or "{}")
    except (TypeError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


# --------------------------------------------------------------------------- naming and recording runs

# A run name becomes a directory and a SkyPilot job name: no separators, no dots, nothing to escape with.
RUN_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


def check_run_name(name: str) -> str:
    # fullmatch: `$` in re.match would also accept a trailing newline.
    if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
        raise UsageError(
            f"run name '{name}' is not allowed: use 1-63 lowercase letters, digits and hyphens, "
            "starting with a letter or digit"
        )
    return name


def new_run_name(recipe: str) -> str:
    """A fresh name for an unnamed launch: recipe, UTC time, and random bits, never one the ledger holds."""
    with Ledger() as ledger:
        taken = {run.name for run in ledger.runs(include_finished=True)}
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = recipe[:RUN_NAME_ROOM]
    while True:
        name = f"{base}-{stamp}-{secrets.token_hex(2)}"
        if name not in taken:
            return name


# new_run_name appends "-YYYYmmdd-HHMMSS-xxxx" (21 characters) to at most this much of the recipe's name.
RUN_NAME_ROOM = 63 - 21


def check_new_run_name(name: str) -> str:
    """A name given with -n: valid, and not a run the ledger already holds (that one is resumed, not relaunched)."""
    check_run_name(name)
    with Ledger() as ledger:
        existing = {run.name: run for run in ledger.runs(include_finished=True)}.get(name)
    if existing is not None:
        raise UsageError(
            f"a run named '{name}' exists already ({existing.status}); `skyspot resume {name}` "
            "continues it from its newest durable checkpoint, or pick another -n/--name"
        )
    return name


class _Placement(Protocol):
    """What the ledger records of a planned candidate (planning.candidates.Candidate)."""

    @property
    def cloud(self) -> str: ...
    @property
    def region(self) -> Optional[str]: ...
    @property
    def accelerators(self) -> Optional[str]: ...
    @property
    def instance_type(self) -> Optional[str]: ...
    @property
    def spot(self) -> bool: ...


class _Launch(Protocol):
    """What `record_launch` reads of a launch (task.render.RenderedTask), named by its shape: the ledger is a
    contract and imports no floor above it (tests/test_imports.py)."""

    @property
    def recipe(self) -> Recipe: ...
    @property
    def candidates(self) -> Sequence[_Placement]: ...


def record_launch(
    name: str, built: _Launch, executor: str, *, info: Optional[dict[str, Any]] = None, **fields: Any
) -> None:
    """The ledger row of a run, written before anything is submitted or started (never secrets)."""
    with Ledger() as ledger:
        ledger.add(
            name,
            built.recipe.name,
            executor,
            status="PENDING",
            store=built.recipe.storage.store,
            total_steps=built.recipe.train.steps,
            num_nodes=built.recipe.resources.num_nodes,
            info={**_info(built), **(info or {})},
            **fields,
        )


def _info(built: _Launch) -> dict[str, Any]:
    return {
        "candidates": [
            {
                "cloud": c.cloud,
                "region": c.region,
                "accelerators": c.accelerators,
                "instance_type": c.instance_type,
                "spot": c.spot,
            }
            for c in built.candidates
        ],
        "recipe_fingerprint": built.recipe.fingerprint(),
    }
