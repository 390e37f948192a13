"""Beyond 第一篇: a late result is evidence: kept and shown, never applied.

reliability.acknowledge() takes a response only from the attempt that still holds its row.  An
attempt whose lease ended while its tool worked, and whose row a later attempt took (or
settled), gets "stale", and its response is dropped; yet a response that answers the request
shows that this attempt reached the tool.  As the PostgreSQL edition does (table late_results
in beyond/postgres/article1.sql), acknowledge() and deliver() here call reliability's and keep
such a response in late.db beside sender.db, once per (caller, key, attempt, response);
snapshot() and reconcile() show it.  It is never applied: no outbox row changes because of it,
and reconcile() never settles a row by it; it only keeps reconcile() from taking "the tool holds
no ticket" as proof that the tool never acted.

late.db is a file of its own, not a table in sender.db: sender.db's schema and version are
reliability's, and reconcile() needs a lock that is not sender.db's (see reconcile()).  Imports
reliability; nothing at the top level imports this.
"""
import contextlib
import errno
import json
import os
import sqlite3

import reliability

__all__ = ["LATE", "init", "connect", "acknowledge", "deliver", "snapshot", "reconcile"]

# The file, beside sender.db.
LATE = "late.db"
# PRAGMA application_id of late.db (reliability's files are 7301 to 7303), and PRAGMA
# user_version of its schema.
LATE_KIND = 7311
LATE_VERSION = 1
SCHEMA = (
    # A response is stored as reliability.canonical() writes it, so that the same response
    # again is the same text: one row per (caller, key, attempt, response), the first kept.
    """CREATE TABLE late_results (
        id INTEGER PRIMARY KEY, caller TEXT NOT NULL, key TEXT NOT NULL,
        attempt INTEGER NOT NULL CHECK (attempt >= 1),
        response TEXT NOT NULL, arrived_at INTEGER NOT NULL,
        UNIQUE (caller, key, attempt, response))""",
)
# reconcile()'s answers where a late result stands in for the row's own evidence: the first
# two are reliability.reconcile()'s words, the third the PostgreSQL edition's.
NOTHING_TO_RECONCILE = "not unknown: nothing to reconcile"
MAY_STILL_ACT = "no ticket yet, but the unanswered attempt may still act"
REACHED = "the tool holds no ticket, yet a late result shows an attempt reached it"


def init(root):
    """Make late.db beside the sender.db that reliability.init() made in ``root``: "created",
    or "present" where it is there already (its rows kept).

    Refused before anything is made: a ``root`` whose sender.db reliability.connect() refuses
    (missing, another kind, another schema version).  A file at late.db that is not one is
    refused, naming it, and left as it is.  late.db appears whole: each call makes one under a
    name of its own and links it into place unless something is there, so that a racing init()
    or a reader never meets it half made, and of racing inits one creates it.  A process killed
    while making it leaves that file, ``.late.db-PID-...``, behind.
    """
    sender = os.path.join(root, reliability.SENDER)
    with contextlib.closing(reliability.connect(sender)) as connection:
        _beside(connection)
    path = os.path.join(root, LATE)
    # Made whole every time and linked only where nothing is: what is there stands.
    made = _build(root)
    try:
        os.link(made, path)
        status = "created"
    except FileExistsError:
        status = "present"
    finally:
        os.remove(made)
    _sync_folder(root)
    # Made here or found: it must be a late.db.
    with contextlib.closing(_open(path)):
        pass
    return status


def connect(sender):
    """The late.db beside ``sender`` (a sender.db connection from reliability.connect()), open
    as reliability opens its files: WAL, synchronous=FULL, never created (init() makes it); a
    file of another kind or schema version raises before anything is written, and every SQLite
    error of this connection names the file.  Unlike reliability.connect(), it does not look
    for a hard link or an odd -wal or -shm beside it: init() links late.db into place, so for an
    instant it has two names."""
    return _open(_beside(sender))


def acknowledge(connection, caller, key, attempt, response, *, now, late=None):
    """reliability.acknowledge(), keeping what it refuses late: True where reliability records
    the response as done (again if asked again), False otherwise, as reliability answers.

    Where reliability refuses a response that answers the request (it raises ValueError for one
    that does not, as here) for an attempt already claimed when it was asked, because a later
    attempt took the row or it was settled, the response is recorded in late.db with ``now``,
    the tick it arrived at: once per (caller, key, attempt, response), the first arrival kept.
    An attempt not claimed by then records nothing.  The record is never applied: the outbox
    row is reliability's alone.  ``now`` and late.db are checked before anything is asked;
    ``late`` is late.db open (connect()), or it is opened for this call.

    Boundary: the refusal commits in sender.db and the record in late.db, two transactions; a
    process that dies between them loses the record, never anything else, and asking again
    records it.  A record that waits for late.db longer than reliability.BUSY_TIMEOUT (behind a
    reconcile()) raises, the refusal standing.
    """
    reliability.check_ticks(0, now)
    reliability.check_identity(caller, key)
    with _late_db(connection, late) as late:
        claimed = _attempts(connection, caller, key)
        if reliability.acknowledge(connection, caller, key, attempt, response):
            return True
        if claimed is not None and attempt <= claimed:
            _record(late, caller, key, attempt, response, now)
        return False


def deliver(connection, root, row, *, now, late=None, start=None,
            timeout=reliability.CHILD_TIMEOUT):
    """reliability.deliver() for a row claimed under ``row["attempt"]``, keeping a late result:
    its summary, unchanged.  Where it says "stale" with a response that answers the request
    (acknowledge() refused it), the response is recorded as acknowledge() here records it,
    arrived at tick ``now``; a refusal from the tool, or no valid answer, records nothing.

    ``now`` and late.db are checked before the tool is called.  A sender that wants the
    evidence claims with reliability.claim() and delivers with this, in place of
    reliability.dispatch().  Boundary: as acknowledge()'s.
    """
    reliability.check_ticks(0, now)
    with _late_db(connection, late) as late:
        claimed = _attempts(connection, row["caller"], row["key"])
        summary = reliability.deliver(connection, root, row, start=start, timeout=timeout)
        if (summary["status"] == "stale" and _answers(summary["response"], row)
                and claimed is not None and row["attempt"] <= claimed):
            _record(late, row["caller"], row["key"], row["attempt"], summary["response"], now)
        return summary


def snapshot(sender, *, late=None):
    """reliability.snapshot(sender), and "late": every late result, in the order they were
    recorded, {"caller", "key", "attempt", "response", "arrived_at"}.

    late.db is read first, then sender.db in reliability's own transaction: every late result
    shown was recorded before the outbox was read, so its attempt is at most its row's
    attempts shown.  Each file is read consistently; the two together are not one snapshot.
    Call it outside a transaction of ``sender``'s, whose reads could be older than late.db's.
    """
    with _late_db(sender, late) as late:
        shown = _late_results(late)
    return dict(reliability.snapshot(sender), late=shown)


def reconcile(sender, tool, caller, key, now, *, late=None):
    """reliability.reconcile()'s answer, where a late result keeps "no ticket" from proving
    absence: with late results for the row, "late" lists them, {"attempt", "response",
    "arrived_at"}, in the order they were recorded, and the row is never sent back to pending.

    Such a row is settled as reliability settles it from the tool's records (one matching
    ticket: done) and otherwise stays as it is: unknown, for a person's resolve(), whose
    evidence may be the late response.  A late result never settles a row by itself.

    Race-free: a late result is recorded only in a write transaction on late.db, and this holds
    late.db's write lock from reading the row's late results until reliability's decision has
    committed in sender.db; so a late result is recorded either before (and seen) or after the
    decision.  reliability.reconcile() is asked only where it cannot send the row to pending:
    the row has no late result, or the tool holds tickets for it (external.db's are never
    deleted, and a row with tickets is never sent back to pending).  Deadlock-free: a recorder
    never holds late.db's lock while it waits for sender.db's.
    """
    reliability.check_identity(caller, key)
    reliability.check_ticks(0, now)
    with _late_db(sender, late) as late, reliability.transaction(late):
        shown = [{name: entry[name] for name in ("attempt", "response", "arrived_at")}
                 for entry in _late_results(late, caller, key)]
        if not shown:
            return reliability.reconcile(sender, tool, caller, key, now)
        if reliability.lookup_external(tool, caller, key):
            answer = reliability.reconcile(sender, tool, caller, key, now)
        else:
            answer = _no_ticket(sender, caller, key, now)
        return dict(answer, late=shown)


# --- helpers ----------------------------------------------------------------------------------

def _no_ticket(sender, caller, key, now):
    """What reconcile() answers for a row with a late result and no ticket: reliability's
    answer where the row is not unknown or its attempt may still act (its lease has not ended,
    or a process that held it lives), and otherwise REACHED.  Reads; changes nothing."""
    found = sender.execute("SELECT state, lease_until, owner_pid, tool_pid FROM outbox"
                           " WHERE caller = ? AND key = ?", (caller, key)).fetchall()
    if not found:
        raise ValueError(f"no request {caller!r}/{key!r}")
    state, lease_until, owner_pid, tool_pid = found[0]
    if state != "unknown":
        return {"status": state, "reason": NOTHING_TO_RECONCILE}
    # reliability.reconcile()'s rule: this process acts only through its tool child.
    others = [pid for pid in (owner_pid, tool_pid) if pid and pid != os.getpid()]
    if now < (lease_until or 0) or any(map(_alive, others)):
        return {"status": "unknown", "reason": MAY_STILL_ACT}
    return {"status": "unknown", "reason": REACHED}


def _alive(pid):
    """Whether a process ``pid`` exists; a reused pid counts as alive, the safe mistake."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _attempts(sender, caller, key):
    """The row's attempts so far, or None where there is no such request."""
    found = sender.execute("SELECT attempts FROM outbox WHERE caller = ? AND key = ?",
                           (caller, key)).fetchall()
    return found[0][0] if found else None


def _answers(response, row):
    """Whether ``response`` answers the row's request, as reliability.deliver() judges it."""
    try:
        reliability.check_response(response, row["caller"], row["key"], row["digest"])
    except ValueError:
        return False
    return True


def _record(late, caller, key, attempt, response, now):
    """A late result, once per (caller, key, attempt, response): the first arrival kept."""
    text = reliability.canonical(response)[0]
    with reliability.transaction(late):
        late.execute("INSERT INTO late_results (caller, key, attempt, response, arrived_at)"
                     " VALUES (?, ?, ?, ?, ?)"
                     " ON CONFLICT (caller, key, attempt, response) DO NOTHING",
                     (caller, key, attempt, text, now))


def _late_results(late, caller=None, key=None):
    """Late results, of (caller, key) or all, in the order they were recorded."""
    rows = late.execute("SELECT caller, key, attempt, response, arrived_at FROM late_results"
                        " WHERE ? IS NULL OR caller = ? AND key = ? ORDER BY id",
                        (caller, caller, key)).fetchall()
    return [{"caller": c, "key": k, "attempt": a, "response": json.loads(r), "arrived_at": t}
            for c, k, a, r, t in rows]


def _beside(sender):
    """The path of late.db beside the file of ``sender``, a sender.db connection; ValueError
    for a connection to anything else."""
    if not isinstance(sender, sqlite3.Connection):
        raise TypeError(f"sender must be a sqlite3 connection, not {type(sender).__name__}")
    kind = sender.execute("PRAGMA application_id").fetchone()[0]
    if kind != reliability.KINDS[reliability.SENDER]:
        raise ValueError(f"not a connection to a {reliability.SENDER} (application_id {kind})")
    return os.path.join(os.path.dirname(_file_of(sender)), LATE)


def _file_of(connection):
    """The file of a connection's main database, as SQLite names it."""
    return next(row[2] for row in connection.execute("PRAGMA database_list")
                if row[1] == "main")


@contextlib.contextmanager
def _late_db(sender, late):
    """late.db beside ``sender``: ``late`` where given (it must be that file), or opened for
    the block and closed after it."""
    path = _beside(sender)
    if late is None:
        with contextlib.closing(_open(path)) as opened:
            yield opened
        return
    mine = _file_of(late)
    if not (mine and os.path.exists(path) and os.path.samefile(mine, path)):
        raise ValueError(f"late is {mine or 'no file'}, not the {LATE} beside this"
                         f" {reliability.SENDER}: {path}")
    yield late


def _open(path):
    """Open an existing late.db: WAL, synchronous=FULL, autocommit (transaction() begins)."""
    if not os.path.lexists(path):
        raise FileNotFoundError(errno.ENOENT, f"no {LATE} here: late.init(root) makes it", path)
    # "file://" and an empty authority, so that ?, # and % stay in the name.
    uri = "file://" + os.path.abspath(path).replace("%", "%25").replace("?", "%3f").replace(
        "#", "%23") + "?mode=rw"
    try:
        connection = sqlite3.connect(uri, uri=True, isolation_level=None,
                                     timeout=reliability.BUSY_TIMEOUT,
                                     factory=reliability._Connection)
    except sqlite3.Error as error:
        raise type(error)(f"{path}: {error}") from None
    connection.path = path
    try:
        kind, version = (connection.execute(f"PRAGMA {name}").fetchone()[0]
                         for name in ("application_id", "user_version"))
        if kind != LATE_KIND:
            raise sqlite3.DatabaseError(f"{path}: not a {LATE} (application_id {kind})")
        if version != LATE_VERSION:
            raise sqlite3.DatabaseError(f"{path}: schema version {version}, but this code"
                                        f" needs {LATE_VERSION}")
        if connection.execute("PRAGMA journal_mode=WAL").fetchone()[0] != "wal":
            raise sqlite3.DatabaseError(f"{path}: cannot run in WAL mode")
        connection.execute("PRAGMA synchronous=FULL")
    except BaseException:
        connection.close()
        raise
    return connection


def _build(root):
    """A new late.db, schema and markers committed together, under a name of its own in
    ``root``: its path.  Removed again on failure."""
    made = os.path.join(root, f".{LATE}-{os.getpid()}-{os.urandom(8).hex()}")
    os.close(os.open(made, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    try:
        with contextlib.closing(sqlite3.connect(made, isolation_level=None)) as connection:
            # Made in WAL mode: openers that meet it at once would each have to switch it, and
            # SQLite answers all but one of them "locked" at once, without waiting.
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=FULL")
            with reliability.transaction(connection):
                for statement in SCHEMA:
                    connection.execute(statement)
                connection.execute(f"PRAGMA application_id = {int(LATE_KIND)}")
                connection.execute(f"PRAGMA user_version = {int(LATE_VERSION)}")
    except BaseException:
        for leftover in (made, made + "-journal", made + "-wal", made + "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)
        raise
    return made


def _sync_folder(root):
    """The folder's entries on disk: late.db's name survives a power cut."""
    descriptor = os.open(root, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
