"""Version-checked transfer plans on one SQLite file (article 7 of the series).

A plan {"src", "dst", "amount", "expected"} moves `amount` from `src` to `dst`
only if both resources still carry the revisions the planner saw. `execute`
answers, in this order and inside one BEGIN IMMEDIATE transaction:

1. history first: a stored receipt for the same op and command -> "replayed"
   with the stored result; the same op with another command -> "conflict";
2. then the present, for a new op only: "missing_resource", "stale" (with the
   observed revisions), "insufficient", "overflow";
3. otherwise "applied": both rows updated with revision + 1, one effect row
   and one receipt, committed together.

Every business outcome, rejections included, is stored as a terminal receipt,
so the same op and command get the same answer even after the state changes.
Malformed input and lock time-outs raise and are never recorded.

Guarantees hold for writers that go through this module on one local SQLite
file in WAL mode with synchronous=FULL. Not covered: power loss beyond what
SQLite's fsync gives, dependencies the plan does not declare (other rows,
aggregates, range reads), cross-service snapshots, authorisation, and backups
restored over newer data (revisions would move backwards).

Standard library only; copy this file alone. Command line: see main().
"""
import contextlib
import hashlib
import json
import os
import random
import sqlite3
import sys
import time

try:
    import fcntl  # POSIX: writers wait in line on a lock file, outside SQLite
except ImportError:
    fcntl = None

# Crash boundaries for real-process tests: execute(..., fault=NAME) calls
# os._exit(EXIT_CODES[NAME]) at that point.
BOUNDARIES = ("after_source_update", "before_commit", "after_commit")
EXIT_CODES = {"after_source_update": 71, "before_commit": 72, "after_commit": 73}

# Input bounds. MAX_AMOUNT stays below 2**53 so any JSON reader, floats
# included, round-trips it exactly; revisions and quantities use SQLite's
# whole signed 64-bit range.
MAX_OP_LENGTH = 128
MAX_NAME_LENGTH = 64
MAX_AMOUNT = 10 ** 15
MAX_INT64 = 2 ** 63 - 1
COMMAND_KEYS = frozenset(("src", "dst", "amount", "expected"))

# Busy policy of transaction(): see its docstring.
BUSY_DEADLINE = 10.0         # seconds a writer waits for the lock, then Busy
BUSY_PAUSE_FIRST = 0.0005    # seconds: a queued writer pauses at random up to this,
BUSY_PAUSE = 0.02            # ...doubling to this,
BUSY_PATIENCE = 0.04         # ...until it has waited this long,
BUSY_PAUSE_URGENT = 0.0002   # ...then up to this

# Schema marker: connect() refuses any file that does not carry both.
APPLICATION_ID = 0x50524543  # "PREC"
SCHEMA_VERSION = 1
SCHEMA = (
    """CREATE TABLE resources (
        name TEXT PRIMARY KEY,
        quantity INTEGER NOT NULL
            CHECK (typeof(quantity) = 'integer' AND quantity >= 0),
        revision INTEGER NOT NULL
            CHECK (typeof(revision) = 'integer' AND revision >= 1)
    ) WITHOUT ROWID""",
    # One row per op, immutable once committed; purge() may delete old ones.
    """CREATE TABLE receipts (
        op TEXT PRIMARY KEY,
        digest TEXT NOT NULL,
        result TEXT NOT NULL,
        tick INTEGER NOT NULL
    ) WITHOUT ROWID""",
    # Receipts older than low_water may be gone: an op issued before it is refused.
    """CREATE TABLE retention (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        low_water INTEGER NOT NULL
    )""",
    "INSERT INTO retention (id, low_water) VALUES (1, 0)",
    # Keyed by op: at most one effect per decision.  It commits in the same
    # transaction as its receipt, and outlives it: purge() forgets receipts, not history.
    """CREATE TABLE effects (
        op TEXT PRIMARY KEY,
        src TEXT NOT NULL,
        dst TEXT NOT NULL,
        amount INTEGER NOT NULL
    ) WITHOUT ROWID""",
    # One row per change(): with the effects, the full history of every revision,
    # so "revision = 1 + writes that touched it" can be checked from this file alone.
    """CREATE TABLE changes (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL,
        delta INTEGER NOT NULL,
        revision INTEGER NOT NULL
    )""",
)


# --- connection and transaction helpers -------------------------------------

class Busy(sqlite3.OperationalError):
    """The write lock could not be taken before the deadline; nothing was done."""


class CorruptRecord(Exception):
    """A stored record cannot be trusted; nothing new was done on its strength."""


class Connection(sqlite3.Connection):
    """A sqlite3 connection that also holds its database's writer queue (``<db>-queue``)."""
    queue = None

    def close(self):
        self.__del__()
        super().close()

    def __del__(self):  # also for a connection dropped without close(): the queue must not leak
        if self.queue is not None:
            os.close(self.queue)
            self.queue = None


def _uri(path):
    """A read-write-only SQLite URI: the file is never created by connect()."""
    absolute = os.path.abspath(path).replace(os.sep, "/")
    if not absolute.startswith("/"):
        absolute = "/" + absolute
    escaped = absolute.replace("%", "%25").replace("?", "%3f").replace("#", "%23")
    return "file://" + escaped + "?mode=rw"


def _open(path):
    try:
        # A generous timeout while opening: the first reader of a WAL file may
        # have to wait for another connection's WAL-index recovery.
        return sqlite3.connect(_uri(path), uri=True, isolation_level=None,
                               timeout=BUSY_DEADLINE, factory=Connection)
    except sqlite3.OperationalError:
        if not os.path.exists(path):
            raise FileNotFoundError(2, "no such database", path) from None
        raise


def _configure(connection, path, *, check_marker=True):
    """Verify our marker, then WAL + FULL + foreign keys, and open the writer queue."""
    try:
        if check_marker:
            # Read the marker before any PRAGMA that could write: setting WAL
            # on a 0-byte file would quietly turn it into a database.
            marker = (connection.execute("PRAGMA application_id").fetchone()[0],
                      connection.execute("PRAGMA user_version").fetchone()[0])
            if marker != (APPLICATION_ID, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(
                    f"{path}: not a preconditions database "
                    f"(application_id={marker[0]}, user_version={marker[1]})")
        mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise sqlite3.DatabaseError(f"{path}: journal_mode is {mode!r}, not 'wal'")
        connection.execute("PRAGMA synchronous=FULL")
        connection.execute("PRAGMA foreign_keys=ON")
        checks = (connection.execute("PRAGMA synchronous").fetchone()[0],
                  connection.execute("PRAGMA foreign_keys").fetchone()[0])
        if checks != (2, 1):
            raise sqlite3.DatabaseError(
                f"{path}: synchronous/foreign_keys are {checks}, not (2, 1)")
        if fcntl is not None:
            connection.queue = os.open(path + "-queue", os.O_RDWR | os.O_CREAT, 0o644)
    except BaseException as error:
        connection.close()
        # "file is not a database" and the like do not say which file.
        if type(error) in (sqlite3.DatabaseError, sqlite3.OperationalError) \
                and not str(error).startswith(f"{path}:"):
            raise type(error)(f"{path}: {error}") from error
        raise
    return connection


def connect(path):
    """Open an existing preconditions database; never creates a file.

    The connection runs in autocommit (isolation_level=None), WAL verified,
    synchronous=FULL, foreign_keys=ON, busy timeout BUSY_DEADLINE. Missing file -> FileNotFoundError; a file that is
    not SQLite or not ours (a 0-byte file included) -> sqlite3.DatabaseError
    naming the path.
    """
    return _configure(_open(path), path)


def wal_reset_bug(version=None):
    """True if this SQLite (default: the linked one) has the WAL-reset race.

    The race, present from 3.7.0 through 3.51.2 and fixed in 3.51.3 (backported to
    3.50.7 and 3.44.6), can corrupt a WAL database or lose commits when several
    connections write and checkpoint: exactly the use this module teaches.
    """
    version = tuple(version or sqlite3.sqlite_version_info)
    if not (3, 7, 0) <= version < (3, 51, 3):
        return False
    return not ((3, 44, 6) <= version < (3, 45, 0) or (3, 50, 7) <= version < (3, 51, 0))


@contextlib.contextmanager
def transaction(connection, *, deadline=None):
    """Run the block in one BEGIN IMMEDIATE transaction: COMMIT on success, ROLLBACK on error.

    Writers first queue on ``<db>-queue``, a POSIX flock the kernel releases if its
    holder dies, for at most ``deadline`` seconds (default BUSY_DEADLINE); BEGIN then
    waits at most the connection's busy timeout for writers that do not queue.
    Either wait ends in Busy with nothing written.  Without fcntl (Windows) only
    SQLite's busy handler waits.  An error raised by COMMIT itself (disk I/O, disk
    full) is an unknown outcome, not "nothing happened": WAL recovery may still
    replay that commit, so look the op up again from a fresh connection.
    """
    if connection.in_transaction:  # a nested call would release the outer one's place in the queue
        raise sqlite3.ProgrammingError("transaction() does not nest: this connection is already in one")
    queue = getattr(connection, "queue", None)
    if queue is not None:
        _wait_in_queue(queue, BUSY_DEADLINE if deadline is None else deadline)
    try:
        try:
            connection.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) and "busy" not in str(error):
                raise
            raise Busy("database still locked by a writer outside the queue; nothing was written") from error
        try:
            yield connection
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise
    finally:
        if queue is not None:
            fcntl.flock(queue, fcntl.LOCK_UN)


def _wait_in_queue(queue, deadline):
    # Waiting here, not inside SQLite, keeps waiters from pinning WAL snapshots (the WAL
    # stays small) and lets the current writer run several transactions on a warm cache.
    started, pause = time.monotonic(), BUSY_PAUSE_FIRST
    while True:
        try:
            fcntl.flock(queue, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            waited = time.monotonic() - started
            if waited >= deadline:
                raise Busy(f"database busy: still locked after {deadline:g} s; nothing was written") from None
        # Random pauses that double up to BUSY_PAUSE, then, once a writer has been patient
        # this long, short ones: SQLite's own back-off only grows (to 100 ms a sleep) and
        # starves an unlucky writer; this one lets it in within a few milliseconds.
        time.sleep(random.random() * (pause if waited < BUSY_PATIENCE else BUSY_PAUSE_URGENT))
        pause = min(2 * pause, BUSY_PAUSE)


# --- canonical form and digest -----------------------------------------------

_ENCODE = json.JSONEncoder(sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False).encode
_quote = json.encoder.encode_basestring


def canonical(value):
    """Sorted-key compact JSON; deterministic for the restricted command format."""
    return _ENCODE(value)


def command_json(command):
    """canonical(command) for a validated command, spelled out for speed.

    Same bytes as canonical(): keys in sorted order, strings escaped by the
    encoder json uses with ensure_ascii=False (a test compares the two).
    """
    src, dst, expected = command["src"], command["dst"], command["expected"]
    first, second = (src, dst) if src < dst else (dst, src)
    return '{"amount":%d,"dst":%s,"expected":{%s:%d,%s:%d},"src":%s}' % (
        command["amount"], _quote(dst), _quote(first), expected[first],
        _quote(second), expected[second], _quote(src))


def digest(command):
    """SHA-256 hex of the canonical UTF-8 JSON of the whole (validated) command."""
    return hashlib.sha256(command_json(command).encode("utf-8")).hexdigest()


# --- validation ---------------------------------------------------------------

def _check_text(value, what, limit):
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{what} must not be empty")
    if len(value) > limit:
        raise ValueError(f"{what} is longer than {limit} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode text") from None


def _check_int(value, what, low, high):
    if type(value) is not int:  # bool and int subclasses are refused
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{what} must be between {low} and {high}, got {value}")


def validate(op, command):
    """Raise TypeError/ValueError unless op and command are well formed."""
    _check_text(op, "op", MAX_OP_LENGTH)
    if not isinstance(command, dict):
        raise TypeError(f"command must be a dict, not {type(command).__name__}")
    keys = set(command)
    if keys != COMMAND_KEYS:
        missing = sorted(map(str, COMMAND_KEYS - keys))
        extra = sorted(map(repr, keys - COMMAND_KEYS))
        raise ValueError(f"command keys must be exactly {sorted(COMMAND_KEYS)}; "
                         f"missing {missing}, extra {extra}")
    src, dst, expected = command["src"], command["dst"], command["expected"]
    _check_text(src, "src", MAX_NAME_LENGTH)
    _check_text(dst, "dst", MAX_NAME_LENGTH)
    if src == dst:
        raise ValueError("src and dst must be different resources")
    _check_int(command["amount"], "amount", 1, MAX_AMOUNT)
    if not isinstance(expected, dict):
        raise TypeError(f"expected must be a dict, not {type(expected).__name__}")
    if set(expected) != {src, dst}:
        raise ValueError(f"expected must name exactly src and dst "
                         f"({src!r}, {dst!r}), got {sorted(map(repr, expected))}")
    _check_int(expected[src], f"expected[{src!r}]", 1, MAX_INT64)
    _check_int(expected[dst], f"expected[{dst!r}]", 1, MAX_INT64)


def _check_fault(fault):
    if fault is not None and fault not in BOUNDARIES:
        raise ValueError(f"fault must be None or one of {BOUNDARIES}, got {fault!r}")


def check_ticks(issued_at, now):
    """Logical ticks are non-negative ints, and nothing is issued after it is executed."""
    _check_int(now, "now", 0, MAX_INT64)
    if issued_at is not None:
        _check_int(issued_at, "issued_at", 0, now)


def _check_resources(resources):
    if not isinstance(resources, dict):
        raise TypeError(f"resources must be a dict, not {type(resources).__name__}")
    if not resources:
        raise ValueError("resources must name at least one resource")
    for name, quantity in resources.items():
        _check_text(name, "resource name", MAX_NAME_LENGTH)
        _check_int(quantity, f"quantity of {name!r}", 0, MAX_INT64)


# --- protocol -------------------------------------------------------------------

def init(path, resources):
    """Create a fresh database with each name: quantity at revision 1.

    Refuses an existing path (FileExistsError); on failure removes what it made.
    Returns the snapshot.
    """
    _check_resources(resources)
    for leftover in (path + "-wal", path + "-journal"):
        # SQLite would replay a journal left by an earlier file of this name
        # into the fresh database.
        if os.path.exists(leftover):
            raise FileExistsError(17, "a journal of an earlier database is in the way", leftover)
    # O_EXCL claims the path atomically: two inits cannot both succeed, and an
    # existing file is never touched.
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    connection = None
    try:
        connection = _configure(_open(path), path, check_marker=False)
        with transaction(connection):
            for statement in SCHEMA:
                connection.execute(statement)
            connection.executemany(
                "INSERT INTO resources (name, quantity, revision) VALUES (?, ?, 1)",
                sorted(resources.items()))
            # The marker commits with the schema, so connect() never accepts a
            # half-built file.
            connection.execute(f"PRAGMA application_id={APPLICATION_ID}")
            connection.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        return snapshot(connection)
    except BaseException:
        if connection is not None:
            connection.close()
            connection = None
        for leftover in (path, path + "-wal", path + "-shm", path + "-queue"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)
        raise
    finally:
        if connection is not None:
            connection.close()


def _answer(stored_digest, stored_result, command_digest):
    """What a committed receipt says about this op and command."""
    if stored_digest != command_digest:
        return {"status": "conflict"}
    try:
        return {"status": "replayed", "result": json.loads(stored_result)}
    except (TypeError, ValueError):
        raise CorruptRecord("a stored receipt is not JSON: nothing was decided on its strength") from None


def _store(connection, op, command_digest, result, now):
    connection.execute("INSERT INTO receipts (op, digest, result, tick) VALUES (?, ?, ?, ?)",
                       (op, command_digest, canonical(result), now))
    return result


# Everything one decision depends on, in one read under the write lock: the
# receipt (history), the retention mark, and both resource rows (the present).
_READ_DECISION = """
    SELECT receipts.digest, receipts.result, (SELECT low_water FROM retention),
           effects.op IS NOT NULL, src.quantity, src.revision, dst.quantity, dst.revision
    FROM (SELECT ? AS op, ? AS src_name, ? AS dst_name) AS wanted
    LEFT JOIN receipts ON receipts.op = wanted.op
    LEFT JOIN effects ON effects.op = wanted.op
    LEFT JOIN resources AS src ON src.name = wanted.src_name
    LEFT JOIN resources AS dst ON dst.name = wanted.dst_name"""


def _decide(connection, op, command_digest, command, fault, issued_at, now):
    """History first, then the present; runs under the write lock.

    Returns (result, stored): stored is True when this call wrote a receipt.
    """
    src, dst, amount = command["src"], command["dst"], command["amount"]
    (stored_digest, stored_result, low_water, acted, src_quantity, src_revision,
     dst_quantity, dst_revision), = connection.execute(
        _READ_DECISION, (op, src, dst)).fetchall()
    # A receipt committed since the unlocked read wins over any state check,
    # so a lost-ack retry is never called stale.
    if stored_digest is not None:
        return _answer(stored_digest, stored_result, command_digest), False
    # No receipt, but it may have been purged: an op issued before the mark could be
    # a late retry of a decision already made, so it is refused, not decided again.
    # An effect without a receipt is an applied op whose receipt was purged: decided already.
    if acted or (low_water and (issued_at is None or issued_at < low_water)):
        return {"status": "expired", "low_water": low_water}, False
    store = lambda result: _store(connection, op, command_digest, result, now)
    if src_revision is None or dst_revision is None:
        missing = [name for name, revision in sorted(((src, src_revision), (dst, dst_revision)))
                   if revision is None]
        return store({"status": "missing_resource", "missing": missing}), True
    expected = command["expected"]
    if src_revision != expected[src] or dst_revision != expected[dst]:
        return store({"status": "stale", "observed": {src: src_revision, dst: dst_revision}}), True
    if src_quantity < amount:
        return store({"status": "insufficient", "available": src_quantity}), True
    for name, revision in ((src, src_revision), (dst, dst_revision)):
        if revision >= MAX_INT64:
            return store({"status": "overflow", "resource": name, "column": "revision"}), True
    if dst_quantity > MAX_INT64 - amount:
        return store({"status": "overflow", "resource": dst, "column": "quantity"}), True
    # Absolute values computed from the rows read under this same lock: no
    # other writer can have moved them, and SQL arithmetic could turn an
    # overflow into a REAL instead of failing.
    update = "UPDATE resources SET quantity = ?, revision = ? WHERE name = ?"
    connection.execute(update, (src_quantity - amount, src_revision + 1, src))
    if fault == "after_source_update":
        os._exit(EXIT_CODES["after_source_update"])
    connection.execute(update, (dst_quantity + amount, dst_revision + 1, dst))
    connection.execute("INSERT INTO effects (op, src, dst, amount) VALUES (?, ?, ?, ?)",
                       (op, src, dst, amount))
    result = store({
        "status": "applied",
        "revisions": {src: src_revision + 1, dst: dst_revision + 1},
        "quantities": {src: src_quantity - amount, dst: dst_quantity + amount},
    })
    if fault == "before_commit":
        os._exit(EXIT_CODES["before_commit"])
    return result, True


def execute(connection, op, command, *, issued_at=None, now=0, fault=None):
    """Run a version-checked transfer plan once; see the module docstring.

    Returns {"status": "applied", "revisions": {...}, "quantities": {...}},
    {"status": "stale", "observed": {...}}, {"status": "insufficient",
    "available": q}, {"status": "missing_resource", "missing": [...]},
    {"status": "overflow", "resource": name, "column": c},
    {"status": "replayed", "result": <stored result>}, {"status": "conflict"} or,
    after purge(), {"status": "expired", "low_water": t} for an op issued
    (``issued_at``) before the mark that has no receipt; conflict and expired are
    not stored.  "replayed" is history, not the present: read snapshot() for that.
    Raises TypeError/ValueError for malformed input and Busy on lock time-out;
    neither is recorded. `fault` exits the process at a named boundary (tests);
    "after_commit" fires only when this call committed a new outcome.
    """
    validate(op, command)
    check_ticks(issued_at, now)
    _check_fault(fault)
    command_digest = digest(command)
    # A committed receipt is never modified (purge() may only delete old ones), so
    # a receipt seen by this autocommit read (no lock) is a true answer; fetchall()
    # ends the read before BEGIN IMMEDIATE. A miss proves nothing and is re-checked
    # under the lock, with the low-water mark, in _decide.
    rows = connection.execute("SELECT digest, result FROM receipts WHERE op = ?", (op,)).fetchall()
    if rows:
        return _answer(rows[0][0], rows[0][1], command_digest)
    with transaction(connection):
        result, stored = _decide(connection, op, command_digest, command, fault, issued_at, now)
    # After COMMIT of whatever outcome this call stored, rejections included.
    if fault == "after_commit" and stored:
        os._exit(EXIT_CODES["after_commit"])
    return result


def purge(connection, now, window):
    """Delete receipts written before ``now - window`` and raise the low-water mark to it, atomically.

    From then on execute() answers "expired" for an op issued before the mark that
    has no receipt; the mark never moves backwards.
    """
    check_ticks(None, now)
    _check_int(window, "window", 1, MAX_INT64)
    mark = now - window
    with transaction(connection):
        low_water = connection.execute("SELECT low_water FROM retention").fetchone()[0]
        if mark < low_water:
            raise ValueError(f"the low-water mark is {low_water}; {mark} would move it backwards")
        deleted = connection.execute("DELETE FROM receipts WHERE tick < ?", (mark,)).rowcount
        connection.execute("UPDATE retention SET low_water = ?", (mark,))
    return {"deleted": deleted, "low_water": mark}


def change(connection, name, delta):
    """The other business write: quantity + delta and revision + 1, with an audit row, atomically.

    Returns {"status": "changed", "name", "quantity", "revision"}. Refusals
    raise ValueError and change nothing: missing resource, negative result,
    quantity or revision past MAX_INT64. A bool or non-int delta: TypeError.
    """
    _check_text(name, "name", MAX_NAME_LENGTH)
    _check_int(delta, "delta", -MAX_INT64, MAX_INT64)
    with transaction(connection):
        row = connection.execute(
            "SELECT quantity, revision FROM resources WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise ValueError(f"no resource named {name!r}")
        quantity, revision = row[0] + delta, row[1] + 1
        if quantity < 0:
            raise ValueError(f"{name!r} would go negative ({row[0]} + {delta})")
        if quantity > MAX_INT64 or revision > MAX_INT64:
            raise ValueError(f"{name!r} would pass the signed 64-bit maximum")
        connection.execute("UPDATE resources SET quantity = ?, revision = ? WHERE name = ?",
                           (quantity, revision, name))
        connection.execute("INSERT INTO changes (name, delta, revision) VALUES (?, ?, ?)",
                           (name, delta, revision))
    return {"status": "changed", "name": name, "quantity": quantity, "revision": revision}


def snapshot(connection):
    """Resources, effect and receipt counts from one consistent read."""
    own = not connection.in_transaction  # inside a caller's transaction, read within it
    if own:
        connection.execute("BEGIN")
    try:
        resources = {name: {"quantity": quantity, "revision": revision}
                     for name, quantity, revision in connection.execute(
                         "SELECT name, quantity, revision FROM resources ORDER BY name")}
        effects = connection.execute("SELECT count(*) FROM effects").fetchone()[0]
        receipts = connection.execute("SELECT count(*) FROM receipts").fetchone()[0]
    finally:
        if own:
            connection.execute("COMMIT")
    return {"resources": resources, "effects": effects, "receipts": receipts}


# --- UNSAFE baseline: check, release, pause, then act. Never used above. -------

def unsafe_check_then_act(connection, op, command, *, pause=None):
    """DELIBERATELY UNSAFE: checks in one read, writes in a later transaction.

    The check (receipt, revisions, balance) runs in autocommit reads and the
    lock is released; `pause()` (if given) is called; then both rows are moved
    relative to whatever they hold now, WITHOUT re-checking. A write between
    the two phases is silently built upon: the bug the safe `execute` closes.
    Read-phase rejections are returned without being stored.
    """
    validate(op, command)
    command_digest = digest(command)
    src, dst, amount = command["src"], command["dst"], command["amount"]
    receipt = connection.execute(
        "SELECT digest, result FROM receipts WHERE op = ?", (op,)).fetchall()
    rows = {name: (quantity, revision) for name, quantity, revision in connection.execute(
        "SELECT name, quantity, revision FROM resources WHERE name IN (?, ?)",
        (src, dst)).fetchall()}
    if pause is not None:
        pause()
    if receipt:
        return _answer(receipt[0][0], receipt[0][1], command_digest)
    if len(rows) != 2:
        return {"status": "missing_resource",
                "missing": sorted(name for name in (src, dst) if name not in rows)}
    if any(rows[name][1] != command["expected"][name] for name in (src, dst)):
        return {"status": "stale", "observed": {name: rows[name][1] for name in (src, dst)}}
    if rows[src][0] < amount:
        return {"status": "insufficient", "available": rows[src][0]}
    with transaction(connection):
        update = ("UPDATE resources SET quantity = quantity + ?, revision = revision + 1 "
                  "WHERE name = ?")
        connection.execute(update, (-amount, src))
        connection.execute(update, (amount, dst))
        after = {name: (quantity, revision) for name, quantity, revision in connection.execute(
            "SELECT name, quantity, revision FROM resources WHERE name IN (?, ?)",
            (src, dst)).fetchall()}
        connection.execute("INSERT INTO effects (op, src, dst, amount) VALUES (?, ?, ?, ?)",
                           (op, src, dst, amount))
        return _store(connection, op, command_digest, {
            "status": "applied",
            "revisions": {name: after[name][1] for name in (src, dst)},
            "quantities": {name: after[name][0] for name in (src, dst)},
        }, 0)


# --- CLI ----------------------------------------------------------------------------

def _emit(value):
    sys.stdout.write((value if isinstance(value, str) else canonical(value)) + "\n")
    sys.stdout.flush()


def _wait_for_go():
    """Print READY, then block until the parent sends GO on stdin."""
    _emit("READY")
    line = sys.stdin.readline()
    if line.strip() != "GO":
        raise ValueError(f"expected GO on stdin, got {line.strip()!r}")


def _parse_command(text):
    def no_duplicates(pairs):
        keys = [key for key, _ in pairs]
        if len(keys) != len(set(keys)):
            raise ValueError("COMMAND_JSON repeats a key")
        return dict(pairs)
    return json.loads(text, object_pairs_hook=no_duplicates)


_COMMANDS = {  # subcommand: (help, [(flags, add_argument options)])
    "init": ("create a fresh database", [(("db",), {}), (("resources",), {"nargs": "+", "metavar": "NAME=QTY"})]),
    "execute": ("run a plan through the safe entry", [
        (("db",), {}), (("op",), {}), (("command",), {"metavar": "COMMAND_JSON"}),
        (("--fault",), {"choices": BOUNDARIES}),
        (("--wait",), {"action": "store_true", "help": "print READY and wait for GO on stdin before executing"})]),
    "unsafe-check-then-act": ("UNSAFE baseline: READY/GO between the check and the write", [
        (("db",), {}), (("op",), {}), (("command",), {"metavar": "COMMAND_JSON"})]),
    "change": ("quantity + DELTA, revision + 1", [(("db",), {}), (("name",), {}), (("delta",), {"type": int})]),
    "snapshot": ("print the current state", [(("db",), {})]),
}


def main(argv=None):
    """Command line used by the experiment driver's child processes.

      init DB NAME=QTY [NAME=QTY ...]                         -> snapshot
      execute DB OP COMMAND_JSON [--fault BOUNDARY] [--wait]  -> result
      unsafe-check-then-act DB OP COMMAND_JSON                -> READY, GO?, result
      change DB NAME DELTA                                    -> change result
      snapshot DB                                             -> snapshot

    Each prints one line of compact sorted-key JSON (after a READY line where
    the child waits for GO on stdin). Exit 0 done, 1 refused or failed (one
    line on stderr), 2 bad usage; --fault exits with EXIT_CODES[BOUNDARY].
    """
    import argparse
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="preconditions.py",
                                     description="Version-checked transfer plans on SQLite.")
    sub = parser.add_subparsers(dest="subcommand", required=True)
    # Only the subcommand asked for is built: argparse spends about a millisecond on each,
    # and experiment children start often.  --help and mistakes still see them all.
    wanted = argv[0] if argv[:1] and argv[0] in _COMMANDS else None
    for name, (helptext, arguments) in _COMMANDS.items():
        if wanted in (None, name):
            p = sub.add_parser(name, help=helptext)
            for flags, options in arguments:
                p.add_argument(*flags, **options)
    args = parser.parse_args(argv)

    resources = {}
    if args.subcommand == "init":
        for item in args.resources:
            name, sep, quantity = item.rpartition("=")
            if not sep or not name:
                parser.error(f"expected NAME=QTY, got {item!r}")
            if name in resources:
                parser.error(f"resource {name!r} named twice")
            try:
                resources[name] = int(quantity)
            except ValueError:
                parser.error(f"quantity must be an integer in {item!r}")
    try:
        if args.subcommand == "init":
            _emit(init(args.db, resources))
            return 0
        command = getattr(args, "command", None)
        if command is not None:
            command = _parse_command(command)
        connection = connect(args.db)
        try:
            if args.subcommand == "execute":
                if args.wait:
                    _wait_for_go()
                _emit(execute(connection, args.op, command, fault=args.fault))
            elif args.subcommand == "unsafe-check-then-act":
                _emit(unsafe_check_then_act(connection, args.op, command, pause=_wait_for_go))
            elif args.subcommand == "change":
                _emit(change(connection, args.name, args.delta))
            else:
                _emit(snapshot(connection))
        finally:
            connection.close()
        return 0
    except (ValueError, TypeError, OSError, CorruptRecord, sqlite3.Error) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        sys.stderr.write(f"preconditions.py {args.subcommand}: {type(error).__name__}: {message}\n")
        sys.stderr.flush()
        return 1


if __name__ == "__main__":
    sys.exit(main())
