"""Agent 可靠执行实战（七）：没有重复执行，为什么还是办错了？ — runnable companion.

A plan {"src", "dst", "amount", "expected"} moves ``amount`` from ``src`` to ``dst`` only
while both resources still carry the revisions the planner saw (第七篇 §1).  ``execute``
decides inside one BEGIN IMMEDIATE transaction, in the article's order: history first (the
receipt: "replayed" or "conflict", §2), then the present ("missing_resource", "stale",
"insufficient", "overflow", §3–§4), else "applied".  Every business outcome, rejections
included, is a terminal receipt (§5); malformed input and lock time-outs raise before
anything is stored.

Holds for writers that go through this module on one local SQLite file in WAL mode with
synchronous=FULL, under process crashes (§6).  Not covered: power loss beyond what fsync
gives, dependencies the plan does not declare (§7), cross-service snapshots, authorisation,
and backups restored over newer data.  Standard library only; this file runs alone.
"""
import sys

# One clear line, not a traceback, on an interpreter too old.
if sys.version_info < (3, 9):
    sys.stderr.write(f"preconditions.py needs Python 3.9 or newer, not {sys.version.split()[0]}\n")
    sys.exit(2)

import errno
import hashlib
import json
import os
import sqlite3
import stat
from contextlib import contextmanager

__all__ = ["execute", "history", "change", "purge", "connect", "init", "snapshot", "transaction"]

# 第七篇 §6: the named crash boundaries and the exit code of each.
EXIT_CODES = {"after_source_update": 71, "before_commit": 72, "after_commit": 73}

# op and resource names, in characters.
MAX_OP_LENGTH = 128
MAX_NAME_LENGTH = 64
# Below 2**53: any JSON reader, floats included, keeps an amount exact.
MAX_AMOUNT = 10 ** 15
# Quantities and revisions use SQLite's whole signed 64-bit range.
MAX_INT64 = 2 ** 63 - 1
# twin: logical ticks stay far inside SQLite's signed 64-bit integers.
MAX_TICK = 2 ** 62
# twin: seconds BEGIN IMMEDIATE waits for another writer before "database is locked".
BUSY_TIMEOUT = 10.0

# "PREC": connect() refuses any other file; the schema's version, in PRAGMA user_version.
APPLICATION_ID = 0x50524543
SCHEMA_VERSION = 2
SCHEMA = (
    """CREATE TABLE resources (
        name TEXT PRIMARY KEY,
        quantity INTEGER NOT NULL CHECK (typeof(quantity) = 'integer' AND quantity >= 0),
        revision INTEGER NOT NULL CHECK (typeof(revision) = 'integer' AND revision >= 1)
    ) WITHOUT ROWID""",
    # 第七篇 §2: one terminal receipt per op, never modified once committed.
    "CREATE TABLE receipt (op TEXT PRIMARY KEY, digest TEXT NOT NULL, result TEXT NOT NULL,"
    " tick INTEGER NOT NULL) WITHOUT ROWID",
    # At most one effect per transfer op; it outlives its receipt, since purge forgets
    # receipts, not history.
    "CREATE TABLE effects (op TEXT PRIMARY KEY, src TEXT NOT NULL, dst TEXT NOT NULL,"
    " amount INTEGER NOT NULL) WITHOUT ROWID",
    # One row per applied change(): with the effects, the history of every revision.
    "CREATE TABLE changes (op TEXT PRIMARY KEY, name TEXT NOT NULL, delta INTEGER NOT NULL,"
    " revision INTEGER NOT NULL) WITHOUT ROWID",
    # Beyond 第七篇: receipts older than low_water may be gone, so an op issued before it is
    # refused.
    "CREATE TABLE retention (id INTEGER PRIMARY KEY CHECK (id = 1), low_water INTEGER NOT NULL)",
    "INSERT INTO retention VALUES (1, 0)",
)


# --- 第七篇: the protocol ---------------------------------------------------------------------

def history(c, op, digest):
    """第七篇 §2: what the receipt of ``op`` says, or None for a new op.  It checks nothing:
    execute() and change() pass it an ``op`` they have checked (a str).

    The article's query, unchanged: the same command is "replayed" with the stored result
    (history, not the present), another command under the same op is "conflict".
    """
    old = c.execute(
        'SELECT digest,result FROM receipt WHERE op=?', (op,)
    ).fetchone()
    if old:
        if old[0] != digest:
            return {'status': 'conflict'}
        return {'status': 'replayed', 'result': json.loads(old[1])}


def execute(c, op, command, *, issued_at, now):
    """第七篇 §2–§6: run a version-checked transfer plan once.

    In one BEGIN IMMEDIATE transaction: the receipt first (replayed / conflict), then the
    present: missing_resource, stale (with the observed revisions), insufficient, overflow,
    else applied (both rows updated with revision + 1, one effect row).  Each is stored as the
    op's terminal receipt, in the same transaction.  Beyond the article: an op issued
    (``issued_at``) before purge()'s low-water mark that has no receipt is "expired", not
    decided again, so a retry passes the tick its op was decided at.  Conflict and expired
    are not stored.
    """
    validate(op, command)
    check_ticks(issued_at, now)
    digest = hashlib.sha256(_dumps(command).encode("utf-8")).hexdigest()
    src, dst, amount, expected = (command[name] for name in ("src", "dst", "amount", "expected"))
    with transaction(c):
        answer = history(c, op, digest) or _expired(c, op, issued_at)
        if answer:
            return answer
        # 第七篇 §3: both rows are read under the write lock that the update below needs.
        rows = dict((name, (quantity, revision)) for name, quantity, revision in c.execute(
            "SELECT name, quantity, revision FROM resources WHERE name IN (?, ?)", (src, dst)))
        if len(rows) < 2:
            result = {"status": "missing_resource", "missing": sorted({src, dst} - set(rows))}
        elif rows[src][1] != expected[src] or rows[dst][1] != expected[dst]:
            result = {"status": "stale", "observed": {src: rows[src][1], dst: rows[dst][1]}}
        elif rows[src][0] < amount:
            result = {"status": "insufficient", "available": rows[src][0]}
        elif rows[src][1] >= MAX_INT64 or rows[dst][1] >= MAX_INT64:
            # 第七篇 §4: refused at the bound, never wrapped or turned into a REAL.
            full = src if rows[src][1] >= MAX_INT64 else dst
            result = {"status": "overflow", "resource": full, "column": "revision"}
        elif rows[dst][0] > MAX_INT64 - amount:
            result = {"status": "overflow", "resource": dst, "column": "quantity"}
        else:
            (sq, sr), (dq, dr) = rows[src], rows[dst]
            update = "UPDATE resources SET quantity = ?, revision = ? WHERE name = ?"
            c.execute(update, (sq - amount, sr + 1, src))
            # Half a transfer, inside the transaction.
            crash_point("after_source_update")
            c.execute(update, (dq + amount, dr + 1, dst))
            c.execute("INSERT INTO effects VALUES (?, ?, ?, ?)", (op, src, dst, amount))
            result = {"status": "applied", "revisions": {src: sr + 1, dst: dr + 1},
                      "quantities": {src: sq - amount, dst: dq + amount}}
        c.execute("INSERT INTO receipt VALUES (?, ?, ?, ?)", (op, digest, _dumps(result), now))
        # Everything written, nothing committed.
        crash_point("before_commit")
    # The decision is durable, and nobody has been told.
    crash_point("after_commit")
    return result


def change(c, op, name, delta, *, issued_at, now, expected=None):
    """第七篇 §4: the other business write: quantity + delta and revision + 1, every time.

    Exactly once per op like execute(): a receipt in the same transaction, "replayed" /
    "conflict" for the op again.  Refusals are stored too: missing_resource, stale (beyond the
    article: ``expected`` lists the revisions the change was planned on, and the resource has
    none of them), insufficient (the quantity would go negative), overflow.
    """
    _check_text(op, "op", MAX_OP_LENGTH)
    _check_text(name, "name", MAX_NAME_LENGTH)
    _check_int(delta, "delta", -MAX_INT64, MAX_INT64)
    check_ticks(issued_at, now)
    command = {"change": name, "delta": delta}
    if expected is not None:
        # Read once, here: a generator walked by this check would be empty below.
        if type(expected) not in (list, tuple, set, frozenset):
            raise TypeError(f"expected must be a list, tuple or set of revisions, not"
                            f" {type(expected).__name__}")
        # Part of the command: the same op planned on other revisions is a conflict.
        for revision in expected:
            _check_int(revision, "an expected revision", 1, MAX_INT64)
        command["expected"] = sorted(set(expected))
    digest = hashlib.sha256(_dumps(command).encode("utf-8")).hexdigest()
    with transaction(c):
        answer = history(c, op, digest) or _expired(c, op, issued_at)
        if answer:
            return answer
        row = c.execute("SELECT quantity, revision FROM resources WHERE name = ?",
                        (name,)).fetchone()
        if row is None:
            result = {"status": "missing_resource", "missing": [name]}
        elif expected is not None and row[1] not in command["expected"]:
            result = {"status": "stale", "observed": {name: row[1]}}
        elif row[0] + delta < 0:
            result = {"status": "insufficient", "available": row[0]}
        elif row[0] + delta > MAX_INT64 or row[1] >= MAX_INT64:
            result = {"status": "overflow", "resource": name,
                      "column": "revision" if row[1] >= MAX_INT64 else "quantity"}
        else:
            quantity, revision = row[0] + delta, row[1] + 1
            result = {"status": "changed", "name": name, "quantity": quantity,
                      "revision": revision}
            c.execute("UPDATE resources SET quantity = ?, revision = ? WHERE name = ?",
                      (quantity, revision, name))
            c.execute("INSERT INTO changes VALUES (?, ?, ?, ?)", (op, name, delta, revision))
        c.execute("INSERT INTO receipt VALUES (?, ?, ?, ?)", (op, digest, _dumps(result), now))
    return result


# --- beyond 第七篇: receipts that are not kept forever --------------------------------------
# 第七篇 §5 says "本例没有实现回执清理"; this is one policy for it, and what it costs.

def purge(c, now, window):
    """Delete receipts written before ``now - window`` and raise the low-water mark to it.

    Both in one transaction.  From then on an op issued before the mark that has no receipt
    is "expired" (it may be a late retry of a decision already made); the mark never moves
    backwards.
    """
    check_ticks(0, now)
    if type(window) is not int or not 0 < window <= MAX_TICK:
        raise ValueError(f"window must be an int number of ticks from 1 to {MAX_TICK},"
                         f" not {window!r}")
    mark = now - window
    if mark < 0:
        raise ValueError(f"now - window = {mark}: nothing is old enough to purge yet")
    with transaction(c):
        low_water = c.execute("SELECT low_water FROM retention").fetchone()[0]
        if mark < low_water:
            raise ValueError(f"the low-water mark is {low_water}; now - window = {mark} would"
                             " move it backwards")
        deleted = c.execute("DELETE FROM receipt WHERE tick < ?", (mark,)).rowcount
        c.execute("UPDATE retention SET low_water = ?", (mark,))
    return {"deleted": deleted, "low_water": mark}


def _expired(c, op, issued_at):
    # No receipt, but it may have been purged: an op issued before the mark, or one whose
    # effect or change row survives its receipt, is a decision already made.
    low_water, acted = c.execute("SELECT low_water, EXISTS (SELECT 1 FROM effects WHERE op = ?)"
                                 " OR EXISTS (SELECT 1 FROM changes WHERE op = ?) FROM retention",
                                 (op, op)).fetchone()
    if acted or issued_at < low_water:
        return {"status": "expired", "low_water": low_water}


# --- helpers: the file, input checks ---------------------------------------------------------

def connect(path):
    """Open an existing preconditions database (see _open); never creates a file."""
    return _open(path, (APPLICATION_ID,))


def init(path, resources):
    """Create a database at ``path`` with each resource's quantity at revision 1, whole or not at
    all; never over an existing file (FileExistsError).  Killed midway, it may leave a file
    connect() refuses (it has no kind): remove it, then init again."""
    if type(resources) is not dict:
        raise TypeError(f"resources must be a dict, not {type(resources).__name__}")
    if not resources:
        raise ValueError("resources must name at least one resource")
    for name, quantity in resources.items():
        _check_text(name, "resource name", MAX_NAME_LENGTH)
        _check_int(quantity, f"quantity of {name!r}", 0, MAX_INT64)
    _create(path, APPLICATION_ID, SCHEMA, lambda c: c.executemany(
        "INSERT INTO resources VALUES (?, ?, 1)", sorted(resources.items())))


def snapshot(c):
    """Resources, effect and receipt counts from one consistent read."""
    # Inside a caller's transaction, read within it.
    own = not c.in_transaction
    if own:
        c.execute("BEGIN")
    try:
        resources = {name: {"quantity": quantity, "revision": revision}
                     for name, quantity, revision in c.execute(
                         "SELECT name, quantity, revision FROM resources ORDER BY name")}
        effects = c.execute("SELECT count(*) FROM effects").fetchone()[0]
        receipts = c.execute("SELECT count(*) FROM receipt").fetchone()[0]
    finally:
        if own:
            c.execute("COMMIT")
    return {"resources": resources, "effects": effects, "receipts": receipts}


def validate(op, command):
    """第七篇 §2: a fixed structure, two different non-empty names, bounded positive ints, no
    bools."""
    _check_text(op, "op", MAX_OP_LENGTH)
    if type(command) is not dict:
        raise TypeError(f"command must be a dict, not {type(command).__name__}")
    if set(command) != {"src", "dst", "amount", "expected"}:
        raise ValueError(f"command keys must be exactly amount, dst, expected, src; got"
                         f" {sorted(map(str, command))}")
    src, dst, expected = command["src"], command["dst"], command["expected"]
    _check_text(src, "src", MAX_NAME_LENGTH)
    _check_text(dst, "dst", MAX_NAME_LENGTH)
    if src == dst:
        raise ValueError("src and dst must be different resources")
    _check_int(command["amount"], "amount", 1, MAX_AMOUNT)
    if type(expected) is not dict:
        raise TypeError(f"expected must be a dict, not {type(expected).__name__}")
    if set(expected) != {src, dst}:
        raise ValueError(f"expected must name exactly src and dst ({src!r}, {dst!r})")
    _check_int(expected[src], f"expected[{src!r}]", 1, MAX_INT64)
    _check_int(expected[dst], f"expected[{dst!r}]", 1, MAX_INT64)


def _check_text(value, what, limit):
    if type(value) is not str:
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if not 0 < len(value) <= limit:
        raise ValueError(f"{what} must have 1 to {limit} characters")
    # A lone surrogate raises UnicodeEncodeError (a ValueError) here.
    value.encode("utf-8")


def _check_int(value, what, low, high):
    # bool and int subclasses are refused.
    if type(value) is not int:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{what} must be from {low} to {high}, not {value}")


# --- twin definitions: identical in reliability.py and preconditions.py ---------------------
# (test_the_twin_definitions_are_identical compares them; change both or neither)

# Sorted keys, compact, UTF-8 text, no NaN or Infinity: the canonical form digests are taken of.
_dumps = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode


@contextmanager
def transaction(connection):
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield
        connection.execute("COMMIT")
    except BaseException:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        raise


def check_ticks(issued_at, now):
    """Logical ticks are ints from 0 to MAX_TICK, and nothing is acted on before it was issued."""
    for name, value in (("issued_at", issued_at), ("now", now)):
        if type(value) is not int or not 0 <= value <= MAX_TICK:
            raise ValueError(f"{name} must be an int tick from 0 to {MAX_TICK}, not {value!r}")
    if issued_at > now:
        raise ValueError(f"issued_at {issued_at} is later than now {now}: ticks must not go"
                         " backwards")


def _open(path, application_ids):
    """Open an existing database of ours and let SQLite decide: WAL, synchronous=FULL, foreign
    keys, autocommit (transaction() begins).  A missing file is never created; another kind or
    schema version, and what _check_file refuses, raise before this writes anything; every SQLite
    error names the path (_Connection).  SQLite recovers each file it opens (-wal), refused too."""
    # One file for the checks and SQLite, as the system resolves it: a trailing /, .. after links.
    real = os.path.realpath(path)
    # "file://" and an empty authority, so that ?, #, % and a leading // stay in the name.
    uri = "file://" + real.replace("%", "%25").replace("?", "%3f").replace("#", "%23") + "?mode=rw"
    _check_file(path, real)
    try:
        connection = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=BUSY_TIMEOUT,
                                     factory=_Connection)
    except sqlite3.Error as error:
        raise type(error)(f"{path}: {error}") from None
    connection.path = path
    try:
        _check_kind(connection, application_ids)
        if connection.execute("PRAGMA journal_mode=WAL").fetchone()[0] != "wal":
            raise sqlite3.DatabaseError(f"{path}: cannot run in WAL mode")
        connection.execute("PRAGMA synchronous=FULL")
        connection.execute("PRAGMA foreign_keys=ON")
    except BaseException:
        connection.close()
        raise
    return connection


class _Connection(sqlite3.Connection):
    """A sqlite3 connection whose errors name its file, once, as SQLite decides them."""

    def execute(self, sql, parameters=()):
        try:
            return super().execute(sql, parameters)
        except sqlite3.Error as error:
            named = type(error)(f"{self.path}: {error}")
            # sqlite_errorcode and sqlite_errorname (Python 3.11+), kept.
            vars(named).update(vars(error))
            raise named from None


def _check_kind(connection, application_ids):
    """Refuses, before anything is written, a database of another kind or schema version."""
    kind, version = (connection.execute(f"PRAGMA {name}").fetchone()[0]
                     for name in ("application_id", "user_version"))
    # Schema 1 kept the kind in user_version: such a file is refused as schema 1.
    if kind == 0 and version in application_ids:
        kind, version = version, 1
    if kind not in application_ids or version != SCHEMA_VERSION:
        raise sqlite3.DatabaseError(f"{connection.path}: " + (
            f"not a database of this module (application_id {kind})" if kind not in
            application_ids else f"schema version {version}, but this code needs"
            f" {SCHEMA_VERSION}"))


def _check_file(path, real):
    """What SQLite would take silently at ``real``, refused naming ``path`` before it opens."""
    try:
        found = os.stat(real)
    # Missing or out of reach: SQLite says so.
    except OSError:
        return
    # SQLite keeps a -wal for each name of a file: through a second name, commits could be lost.
    if stat.S_ISREG(found.st_mode) and found.st_nlink > 1:
        raise OSError(errno.EMLINK, "the database has more than one name (a hard link), and"
                      " each name would keep its own -wal", path)
    # SQLite would open it read-only, and make a -wal and -shm its owner may not write.
    if stat.S_ISREG(found.st_mode) and not os.access(real, os.R_OK | os.W_OK):
        raise PermissionError(errno.EACCES, "the database is not writable by this process", path)
    # Beside the file a link names: a FIFO, device or folder there would fail every commit, or
    # hang, and SQLite would delete it on closing.
    for companion in (real + "-wal", real + "-shm"):
        try:
            if not stat.S_ISREG(os.lstat(companion).st_mode):
                raise OSError(errno.EINVAL, "SQLite's -wal and -shm must be regular files",
                              companion)
        except FileNotFoundError:
            pass


def _create(path, application_id, schema, fill=None):
    """Create a database of ours at ``path`` with ``schema`` (and ``fill(connection)``), whole
    or not at all (killed midway: a file without its kind, which connect() refuses); never over
    a file or a journal an earlier one left (FileExistsError)."""
    for leftover in (path, path + "-wal", path + "-journal"):
        if os.path.lexists(leftover):
            raise FileExistsError(errno.EEXIST, "exists; init never overwrites", leftover)
    # O_EXCL: of two inits, one wins.
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    try:
        connection = sqlite3.connect(path, isolation_level=None)
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            with transaction(connection):
                for statement in schema:
                    connection.execute(statement)
                if fill is not None:
                    fill(connection)
                # The markers commit with the schema: connect() never takes a half-built file.
                connection.execute(f"PRAGMA application_id = {int(application_id)}")
                connection.execute(f"PRAGMA user_version = {int(SCHEMA_VERSION)}")
        finally:
            connection.close()
    except BaseException:
        for leftover in (path, path + "-wal", path + "-shm"):
            if os.path.exists(leftover):
                os.remove(leftover)
        raise


# --- DELIBERATELY UNSAFE baseline (第七篇 §3): never called by the protocol above ----------

def unsafe_check_then_act(c, op, command, *, pause=None):
    """UNSAFE: checks in autocommit reads, releases the lock, calls ``pause()``, then writes.

    The write moves both rows relative to whatever they hold by then, WITHOUT checking again,
    so a change between the two phases is silently built upon: the bug that execute()
    closes.  Read-phase rejections are returned without being stored.
    """
    validate(op, command)
    digest = hashlib.sha256(_dumps(command).encode("utf-8")).hexdigest()
    src, dst, amount = command["src"], command["dst"], command["amount"]
    answer = history(c, op, digest)
    rows = dict((name, (quantity, revision)) for name, quantity, revision in c.execute(
        "SELECT name, quantity, revision FROM resources WHERE name IN (?, ?)", (src, dst)))
    if pause is not None:
        pause()
    if answer:
        return answer
    if len(rows) < 2:
        return {"status": "missing_resource", "missing": sorted({src, dst} - set(rows))}
    if any(rows[name][1] != command["expected"][name] for name in (src, dst)):
        return {"status": "stale", "observed": {name: rows[name][1] for name in (src, dst)}}
    if rows[src][0] < amount:
        return {"status": "insufficient", "available": rows[src][0]}
    with transaction(c):
        update = ("UPDATE resources SET quantity = quantity + ?, revision = revision + 1"
                  " WHERE name = ?")
        c.execute(update, (-amount, src))
        c.execute(update, (amount, dst))
        after = dict((name, (quantity, revision)) for name, quantity, revision in c.execute(
            "SELECT name, quantity, revision FROM resources WHERE name IN (?, ?)", (src, dst)))
        c.execute("INSERT INTO effects VALUES (?, ?, ?, ?)", (op, src, dst, amount))
        result = {"status": "applied",
                  "revisions": {name: after[name][1] for name in (src, dst)},
                  "quantities": {name: after[name][0] for name in (src, dst)}}
        c.execute("INSERT INTO receipt VALUES (?, ?, ?, 0)", (op, digest, _dumps(result)))
    return result


# --- crash boundaries (第七篇 §6) -----------------------------------------------------------

# The boundary at which this process dies, or None: set by whoever arms the process (the
# experiment's driver).
CRASH_AT = None


def crash_point(name):
    if name == CRASH_AT:
        # Unbuffered: said, then gone; no finally, no flush, no COMMIT, a real process death.
        os.write(2, f"preconditions.py: died at {name} (exit {EXIT_CODES[name]})\n".encode())
        os._exit(EXIT_CODES[name])
