"""The ledger: each account's money as append-only rows in a real database.

One implementation, two owners: a course keeps one account per student (:mod:`workbench.course`),
the single-user wallet keeps one for its owner (:mod:`.wallet`). The ``student`` column names the
account either way.

Rows are never updated or deleted. Each has a ``kind``: ``credit`` (the course's starting credit),
``grant`` (an instructor's top-up), ``hold`` (money set aside before a run starts), ``charge``
(what a run cost) and ``release`` (ends a hold, written together with its charge). Amounts are
integers in the currency's minor units (fen, cents), never floats, so sums are exact::

    balance = credits + grants - charges - open holds      (an open hold has no release row)

A sweep's hold is drawn down by its trials' charges (:meth:`Ledger.charge_trial`); what an open
hold still holds is its amount less those charges, so the balance counts each fen once.

A hold that would take the balance below zero is refused inside the same write transaction that
reads the balance (SQLite: ``BEGIN IMMEDIATE``; other databases: the student's row is locked
``FOR UPDATE``), so two concurrent holds can never both pass. The ledger also keeps which run a
hold paid for (``runs``: insert-only), so settling survives a restart of the service.

    >>> ledger = Ledger("sqlite:////srv/course/ledger.sqlite")       # doctest: +SKIP
    >>> ledger.open_account("ana", 1000, actor="course")             # doctest: +SKIP
    >>> hold = ledger.hold("ana", 300, actor="ana")                  # doctest: +SKIP
    >>> ledger.settle(hold, charge=120, actor="course")              # doctest: +SKIP
    >>> ledger.balance("ana")                                        # doctest: +SKIP
    880
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from workbench.errors import CourseError, InsufficientCreditError, RunNotFoundError

KINDS = ("credit", "grant", "hold", "charge", "release")

_meta = sa.MetaData()
students = sa.Table(
    "students", _meta,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("created", sa.Float, nullable=False),
)
entries = sa.Table(
    "entries", _meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("student", sa.String(128), sa.ForeignKey("students.name"), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("amount", sa.BigInteger, nullable=False),  # minor units, >= 0; kind gives the sign
    sa.Column("hold_id", sa.Integer, nullable=True),  # charge/release: the hold they settle
    sa.Column("actor", sa.String(128), nullable=False),  # who caused the row (user or service)
    sa.Column("note", sa.Text, nullable=False, default=""),
    sa.CheckConstraint("amount >= 0", name="amount_not_negative"),
    sa.CheckConstraint(f"kind IN {KINDS!r}", name="known_kind"),
)
sa.Index("entries_student", entries.c.student)
sa.Index("entries_release_once", entries.c.hold_id, entries.c.kind, unique=True)
# What each hold paid for: a launch or resume of a run (``run_id``), an evaluation of it, or one
# block of an endpoint's time (``run_id`` is then the endpoint's name). ``base_cost`` is what the
# run had already billed when the hold was taken: a resume is charged only what it adds.
runs = sa.Table(
    "runs", _meta,
    sa.Column("hold_id", sa.Integer, primary_key=True),
    sa.Column("run_id", sa.String(200), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False, default="launch"),
    sa.Column("student", sa.String(128), nullable=False),
    sa.Column("run_dir", sa.Text, nullable=False),
    sa.Column("base_cost", sa.Float, nullable=False, default=0.0),
    sa.Column("created", sa.Float, nullable=False),
)
sa.Index("runs_run_id", runs.c.run_id)
# A sweep holds its whole budget once (``runs`` kind "sweep", run_id the sweep's id) and each of
# its trials is charged against that hold as it ends: a ``charge`` row (no hold_id: the hold's own
# charge is its final one) tied to the hold here, once per trial run. Until the hold's release,
# what those charges took is no longer held (Account.held).
trial_charges = sa.Table(
    "trial_charges", _meta,
    sa.Column("charge_id", sa.Integer, primary_key=True),  # the charge row in entries
    sa.Column("hold_id", sa.Integer, nullable=False),
    sa.Column("run_id", sa.String(200), nullable=False),
    sa.UniqueConstraint("hold_id", "run_id", name="trial_charged_once"),
)
HOLD_FOR = ("launch", "resume", "evaluate", "export", "endpoint", "sweep")


def to_minor(amount: float | Decimal | str, minor_per_unit: int = 100) -> int:
    """A price in currency units as whole minor units, rounded up (a hold or charge never
    undercounts): ``to_minor(0.4301) == 44``. A float is first rounded to 9 decimals, so the
    noise of float arithmetic (``14.4 * 0.25 / 60 == 0.060000000000000005``) costs no one a
    minor unit: ``to_minor(14.4 * 0.25 / 60) == 6``."""
    if isinstance(amount, float):
        amount = round(amount, 9)
    exact = Decimal(str(amount)) * minor_per_unit
    return int(exact.to_integral_value(rounding=ROUND_CEILING))


@dataclass(frozen=True)
class Account:
    """One student's sums, in minor units."""

    student: str
    credits: int
    grants: int
    charges: int
    held: int  # open holds

    @property
    def balance(self) -> int:
        return self.credits + self.grants - self.charges - self.held

    def to_dict(self) -> dict[str, Any]:
        return {"student": self.student, "credits": self.credits, "grants": self.grants,
                "charges": self.charges, "held": self.held, "balance": self.balance}


@dataclass(frozen=True)
class RunHold:
    """A hold and the run it paid for; ``charge`` is None while the hold is open."""

    hold_id: int
    student: str
    amount: int
    run_id: str | None
    run_dir: str | None
    charge: int | None
    at: float
    kind: str | None = None  # launch | resume | evaluate | endpoint (None: not attached yet)
    base_cost: float = 0.0
    since: float | None = None  # when the time this hold pays for starts


class Ledger:
    """The ledger in the database at ``url`` (any SQLAlchemy URL; SQLite by default)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine: Engine = _engine(url)
        self._sqlite = self.engine.dialect.name == "sqlite"
        _meta.create_all(self.engine)

    @contextmanager
    def _write(self, student: str | None = None) -> Iterator[Connection]:
        """One write transaction; with ``student``, that student's balance cannot change under
        it (SQLite: BEGIN IMMEDIATE takes the database's write lock before the first read)."""
        with self.engine.begin() as db:
            if student is not None:
                q = sa.select(students.c.name).where(students.c.name == student)
                if not self._sqlite:
                    q = q.with_for_update()
                if db.execute(q).first() is None:
                    raise CourseError(f"{student!r} is not a student of this course; ask an "
                                      "instructor to add them to the course file")
            yield db

    def _add(self, db: Connection, student: str, kind: str, amount: int, actor: str,
             note: str = "", hold_id: int | None = None) -> int:
        if not isinstance(amount, int) or not 0 <= amount < 2**63:  # what the column holds
            raise CourseError(f"a {kind} must be a whole, non-negative number of minor units "
                              f"below 2**63, got {amount!r}")
        res = db.execute(entries.insert().values(at=time.time(), student=student, kind=kind,
                                                 amount=amount, hold_id=hold_id, actor=actor,
                                                 note=note))
        return int(res.inserted_primary_key[0])  # type: ignore[index]

    # -- writes ----------------------------------------------------------------------------------
    def open_account(self, student: str, credit: int, actor: str) -> bool:
        """Give a new student their starting credit; a student already known is left as is."""
        with self.engine.begin() as db:
            if db.execute(sa.select(students.c.name).where(students.c.name == student)).first():
                return False
            db.execute(students.insert().values(name=student, created=time.time()))
            self._add(db, student, "credit", credit, actor, "starting credit")
            return True

    def grant(self, student: str, amount: int, actor: str, note: str = "") -> int:
        if amount <= 0:
            raise CourseError(f"a grant must be more than zero, got {amount} minor units")
        with self._write(student) as db:
            return self._add(db, student, "grant", amount, actor, note)

    def hold(self, student: str, amount: int, actor: str, note: str = "") -> int:
        """Set ``amount`` aside for a run; refused (nothing written) if the balance is short."""
        with self._write(student) as db:
            balance = self._account(db, student).balance
            if amount > balance:
                raise InsufficientCreditError(student, amount, balance)
            return self._add(db, student, "hold", amount, actor, note)

    def attach_run(self, hold_id: int, run_id: str, run_dir: str, kind: str = "launch",
                   base_cost: float = 0.0, since: float | None = None) -> None:
        """Record what a hold pays for; ``since``: when the time it pays for starts (an
        endpoint's next block starts where the last one ends), by default now."""
        if kind not in HOLD_FOR:
            raise CourseError(f"a hold pays for one of {HOLD_FOR}, not {kind!r}")
        with self.engine.begin() as db:
            student = self._hold_row(db, hold_id).student
            db.execute(runs.insert().values(run_id=run_id, hold_id=hold_id, student=student,
                                            run_dir=run_dir, kind=kind, base_cost=base_cost,
                                            created=time.time() if since is None else since))

    def settle(self, hold_id: int, charge: int, actor: str, note: str = "") -> bool:
        """Charge what the run cost, at most the hold, and release the hold, in one transaction.
        False if the hold was already settled (settling twice writes nothing)."""
        with self.engine.begin() as db:
            hold = self._hold_row(db, hold_id)
        with self._write(hold.student) as db:
            done = db.execute(sa.select(entries.c.id).where(
                entries.c.hold_id == hold_id, entries.c.kind == "release")).first()
            if done:
                return False
            # A charge never passes its hold: what the hold did not cover is the course's.
            charge = min(charge, hold.amount)
            self._add(db, hold.student, "charge", charge, actor, note, hold_id=hold_id)
            self._add(db, hold.student, "release", hold.amount, actor, note, hold_id=hold_id)
            return True

    def charge_trial(self, hold_id: int, run_id: str, amount: int, actor: str,
                     note: str = "") -> int | None:
        """Charge one trial of a sweep against the sweep's open hold; the amount charged (at most
        what is left of the hold: a student never passes it), or None when this trial was
        charged already or the hold is settled."""
        with self.engine.begin() as db:
            hold = self._hold_row(db, hold_id)
        with self._write(hold.student) as db:
            released = db.execute(sa.select(entries.c.id).where(
                entries.c.hold_id == hold_id, entries.c.kind == "release")).first()
            done = db.execute(sa.select(trial_charges.c.charge_id).where(
                trial_charges.c.hold_id == hold_id, trial_charges.c.run_id == run_id)).first()
            if released or done:
                return None
            charged = min(amount, hold.amount - self._trial_charged(db, hold_id))
            charge_id = self._add(db, hold.student, "charge", charged, actor, note)
            db.execute(trial_charges.insert().values(charge_id=charge_id, hold_id=hold_id,
                                                     run_id=run_id))
            return charged

    def _trial_charged(self, db: Connection, hold_id: int) -> int:
        q = (sa.select(sa.func.sum(entries.c.amount))
             .select_from(trial_charges.join(entries, entries.c.id == trial_charges.c.charge_id))
             .where(trial_charges.c.hold_id == hold_id))
        return int(db.execute(q).scalar() or 0)

    def hold_left(self, hold_id: int) -> int:
        """What an open hold still holds: its amount less its trials' charges."""
        with self.engine.connect() as db:
            return int(self._hold_row(db, hold_id).amount) - self._trial_charged(db, hold_id)

    def charged_trials(self, hold_id: int) -> dict[str, int]:
        """Each charged trial run of a sweep's hold: run id -> amount."""
        q = (sa.select(trial_charges.c.run_id, entries.c.amount)
             .select_from(trial_charges.join(entries, entries.c.id == trial_charges.c.charge_id))
             .where(trial_charges.c.hold_id == hold_id))
        with self.engine.connect() as db:
            return {r.run_id: int(r.amount) for r in db.execute(q)}

    # -- reads -----------------------------------------------------------------------------------
    def _hold_row(self, db: Connection, hold_id: int) -> Any:
        row = db.execute(sa.select(entries).where(entries.c.id == hold_id,
                                                  entries.c.kind == "hold")).first()
        if row is None:
            raise CourseError(f"no hold {hold_id} in the ledger")
        return row

    def _account(self, db: Connection, student: str) -> Account:
        sums = dict.fromkeys(KINDS, 0)
        q = (sa.select(entries.c.kind, sa.func.sum(entries.c.amount))
             .where(entries.c.student == student).group_by(entries.c.kind))
        for kind, total in db.execute(q):
            sums[kind] = int(total or 0)
        # Trial charges against a sweep's hold that is still open: taken from the hold already.
        released = sa.select(entries.c.hold_id).where(entries.c.kind == "release",
                                                      entries.c.hold_id.is_not(None))
        drawn = (sa.select(sa.func.sum(entries.c.amount))
                 .select_from(trial_charges.join(entries,
                                                 entries.c.id == trial_charges.c.charge_id))
                 .where(entries.c.student == student, trial_charges.c.hold_id.not_in(released)))
        held = sums["hold"] - sums["release"] - int(db.execute(drawn).scalar() or 0)
        return Account(student, sums["credit"], sums["grant"], sums["charge"], held)

    def account(self, student: str) -> Account:
        with self.engine.connect() as db:
            return self._account(db, student)

    def balance(self, student: str) -> int:
        return self.account(student).balance

    def students(self) -> list[str]:
        with self.engine.connect() as db:
            return [r[0] for r in db.execute(sa.select(students.c.name).order_by(students.c.name))]

    def entries(self, student: str | None = None) -> list[dict[str, Any]]:
        q = sa.select(entries).order_by(entries.c.id)
        if student is not None:
            q = q.where(entries.c.student == student)
        with self.engine.connect() as db:
            return [dict(r._mapping) for r in db.execute(q)]

    def holds(self, student: str | None = None, open_only: bool = False) -> list[RunHold]:
        """Every hold (newest first) with its run and, once settled, its charge."""
        charge = entries.alias("charge")
        q = (sa.select(entries.c.id, entries.c.student, entries.c.amount, entries.c.at,
                       runs.c.run_id, runs.c.run_dir, runs.c.kind, runs.c.base_cost,
                       runs.c.created.label("since"),
                       charge.c.amount.label("charged"))
             .select_from(entries.outerjoin(runs, runs.c.hold_id == entries.c.id)
                          .outerjoin(charge, sa.and_(charge.c.hold_id == entries.c.id,
                                                     charge.c.kind == "charge")))
             .where(entries.c.kind == "hold").order_by(entries.c.id.desc()))
        if student is not None:
            q = q.where(entries.c.student == student)
        if open_only:
            q = q.where(charge.c.id.is_(None))
        with self.engine.connect() as db:
            return [RunHold(r.id, r.student, r.amount, r.run_id, r.run_dir, r.charged, r.at,
                            r.kind, float(r.base_cost or 0.0), r.since)
                    for r in db.execute(q)]

    def run_hold(self, run_id: str, kinds: tuple[str, ...] = ("launch", "resume")) -> RunHold:
        """The newest hold of ``kinds`` for ``run_id`` (a run's launch or its latest resume)."""
        for h in self.holds():
            if h.run_id == run_id and h.kind in kinds:
                return h
        raise RunNotFoundError(f"no course run {run_id!r}; GET /runs lists yours")


def _engine(url: str) -> Engine:
    if not url.startswith("sqlite"):
        return sa.create_engine(url, pool_pre_ping=True)
    engine = sa.create_engine(url, connect_args={"timeout": 60, "check_same_thread": False},
                              poolclass=sa.pool.NullPool)

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi: Any, _record: Any) -> None:
        dbapi.isolation_level = None  # SQLAlchemy's BEGIN below, not pysqlite's deferred one
        dbapi.execute("PRAGMA journal_mode=WAL")
        dbapi.execute("PRAGMA busy_timeout=60000")

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # IMMEDIATE: the write lock is taken before the balance is read, not at the first insert.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine
