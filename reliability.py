"""The tool did the work but the receipt was lost (Agent 可靠执行实战（一）).

A durable outbox on the sender, an idempotent receiver whose receipt commits in
the same SQLite transaction as its side effect, atomic claims with attempt
numbers and logical-tick leases, and an honest ``unknown`` for a tool that offers
no idempotency.  Standard library only; every database runs in WAL mode with
``synchronous=FULL`` and every write goes through ``BEGIN IMMEDIATE``.

Three files live in one directory and never share a transaction:
``sender.db`` (accepted requests and their outbox rows), ``receiver.db``
(synthetic tickets and idempotency receipts) and ``external.db`` (a synthetic
tool that keeps no receipts).  Guarantees hold under process crashes on one
machine whose storage honours fsync; see README.md for what is not proven.
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

# Named crash boundaries, in the order a request meets them.  Each one makes the
# process that owns it call os._exit(CRASH_EXIT): no finally, no flush, no COMMIT.
BOUNDARIES = (
    "before_intent_commit",       # sender: enqueue, inside the transaction
    "after_intent_commit",        # sender: enqueue, after COMMIT, before "accepted"
    "after_claim",                # sender: claim committed, tool not called
    "before_receiver_commit",     # receiver child: ticket and receipt written, no COMMIT
    "after_receiver_commit",      # receiver child: committed, nothing replied
    "after_response_write",       # receiver child: full reply flushed to the pipe
    "after_response_before_ack",  # sender: reply read, not yet recorded
    "after_ack",                  # sender: done committed
    "after_mark_before_send",     # sender, unsafe baseline: done committed, nothing sent
    "before_external_effect",     # external tool child: about to write
    "after_external_effect",      # external tool child: written, nothing replied
)
# Who owns each boundary: enqueue, the receiver child, the external tool child; the
# rest belong to the sender's dispatch.
ENQUEUE_BOUNDARIES = BOUNDARIES[:2]
RECEIVER_BOUNDARIES = BOUNDARIES[3:6]
EXTERNAL_BOUNDARIES = BOUNDARIES[9:]
CHILD_BOUNDARIES = RECEIVER_BOUNDARIES + EXTERNAL_BOUNDARIES
CRASH_EXIT = 73

# Delivery modes.  Only "idempotent" is safe; the others exist to show what breaks
# and are used only when a request is enqueued with them explicitly.
MODES = ("idempotent", "naive", "mark_before", "external")
STATES = ("pending", "inflight", "done", "unknown", "blocked", "abandoned")
DECISIONS = ("done", "retry", "abandon")  # what a person may record for an unknown row

# The boundaries a delivery in each mode can reach (a fault elsewhere would never fire).
_SENDER_BOUNDARIES = ("after_claim", "after_response_before_ack", "after_ack")
_REACHABLE = {"idempotent": _SENDER_BOUNDARIES + RECEIVER_BOUNDARIES,
              "naive": _SENDER_BOUNDARIES + RECEIVER_BOUNDARIES,
              "external": _SENDER_BOUNDARIES + EXTERNAL_BOUNDARIES,
              "mark_before": ("after_mark_before_send",)}

LEASE_TICKS = 10             # a claim at tick t may be taken over at tick t + 10
MAX_TICK = 2 ** 62           # logical ticks stay far inside SQLite's signed 64-bit integers
MAX_ATTEMPTS = 10            # an idempotent row still unanswered after this many claims is blocked
MAX_IDENTITY_LENGTH = 200    # caller and operation key, in characters
MAX_PAYLOAD_BYTES = 65536    # canonical UTF-8 form
CHILD_TIMEOUT = 15.0         # seconds a tool child may take before it is killed
BUSY_DEADLINE = 10.0         # seconds transaction() keeps retrying a busy database
BUSY_PAUSE_FIRST = 0.0005    # seconds: a queued writer pauses at random up to this,
BUSY_PAUSE = 0.02            # ...doubling to this,
BUSY_PATIENCE = 0.04         # ...until it has waited this long,
BUSY_PAUSE_URGENT = 0.0002   # ...then up to this

SENDER, RECEIVER, EXTERNAL = "sender.db", "receiver.db", "external.db"
# PRAGMA user_version tells our three kinds of file apart from any other SQLite file.
KINDS = {SENDER: 7301, RECEIVER: 7302, EXTERNAL: 7303}
SCHEMAS = {
    SENDER: """
        CREATE TABLE requests (
            caller TEXT NOT NULL, key TEXT NOT NULL, mode TEXT NOT NULL,
            digest TEXT NOT NULL, payload TEXT NOT NULL, issued_at INTEGER NOT NULL,
            PRIMARY KEY (caller, key)) WITHOUT ROWID;
        CREATE TABLE outbox (
            id INTEGER PRIMARY KEY, caller TEXT NOT NULL, key TEXT NOT NULL,
            state TEXT NOT NULL
                CHECK (state IN ('pending','inflight','done','unknown','blocked','abandoned')),
            attempts INTEGER NOT NULL DEFAULT 0, lease_until INTEGER, response TEXT,
            owner_pid INTEGER, tool_pid INTEGER,  -- who may still act for the current attempt
            UNIQUE (caller, key),
            FOREIGN KEY (caller, key) REFERENCES requests (caller, key));
        CREATE INDEX outbox_due ON outbox (state, lease_until);
        CREATE TABLE resolutions (
            id INTEGER PRIMARY KEY, caller TEXT NOT NULL, key TEXT NOT NULL,
            attempt INTEGER NOT NULL, decision TEXT NOT NULL CHECK (decision IN ('done','retry','abandon')),
            decided_by TEXT NOT NULL, reason TEXT NOT NULL, evidence TEXT,
            FOREIGN KEY (caller, key) REFERENCES requests (caller, key));
        CREATE TRIGGER resolutions_never_updated BEFORE UPDATE ON resolutions
            BEGIN SELECT RAISE(ABORT, 'a recorded decision is never rewritten'); END;
        CREATE TRIGGER resolutions_never_deleted BEFORE DELETE ON resolutions
            BEGIN SELECT RAISE(ABORT, 'a recorded decision is never rewritten'); END;
        -- INSERT OR REPLACE deletes without firing DELETE triggers: refuse a taken id too.
        CREATE TRIGGER resolutions_never_replaced BEFORE INSERT ON resolutions
            WHEN EXISTS (SELECT 1 FROM resolutions WHERE id = NEW.id)
            BEGIN SELECT RAISE(ABORT, 'a recorded decision is never rewritten'); END;
    """,
    RECEIVER: """
        CREATE TABLE tickets (
            id INTEGER PRIMARY KEY, caller TEXT NOT NULL, key TEXT NOT NULL,
            digest TEXT NOT NULL, payload TEXT NOT NULL);
        CREATE TABLE receipts (
            caller TEXT NOT NULL, key TEXT NOT NULL, digest TEXT NOT NULL,
            ticket_id INTEGER NOT NULL REFERENCES tickets (id),  -- the result a replay returns
            tick INTEGER NOT NULL,  -- when it was written, for purge()
            PRIMARY KEY (caller, key)) WITHOUT ROWID;
        -- Receipts older than low_water may be gone: a request issued before it is refused.
        CREATE TABLE retention (
            id INTEGER PRIMARY KEY CHECK (id = 1), low_water INTEGER NOT NULL);
        INSERT INTO retention VALUES (1, 0);
    """,
    EXTERNAL: """
        CREATE TABLE tickets (
            id INTEGER PRIMARY KEY, caller TEXT NOT NULL, key TEXT NOT NULL,
            digest TEXT NOT NULL, payload TEXT NOT NULL);
        -- The tool's own search, the way a ticketing API can be queried by reference.
        CREATE INDEX tickets_by_reference ON tickets (caller, key);
    """,
}


class Conflict(Exception):
    """The same (caller, key) already stands for a different intent."""


class Expired(Exception):
    """The key's receipt may have been purged: the request is refused; a new key is a new decision."""


class CorruptRecord(Exception):
    """A stored record cannot be trusted; nothing new was done on its strength."""


class Busy(sqlite3.OperationalError):
    """The write lock could not be taken before the deadline; nothing was written."""


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


# --- connections and transactions -------------------------------------------------

def connect(path):
    """Open an existing database of ours: WAL verified, synchronous=FULL, foreign keys on.

    A missing file raises FileNotFoundError and is never recreated; a file that is
    not SQLite, or not one of ours (an empty file included), raises DatabaseError.
    """
    uri = "file:" + path.replace("%", "%25").replace("?", "%3f").replace("#", "%23") + "?mode=rw"
    try:
        connection = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=BUSY_DEADLINE,
                                     factory=Connection)
    except sqlite3.OperationalError:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such database (it is never created on open)") from None
        raise
    try:
        try:
            kind = connection.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.OperationalError as error:
            raise sqlite3.OperationalError(f"{path}: cannot read it ({error}); WAL also needs a writable "
                                           "directory for its -wal and -shm files") from None
        except sqlite3.DatabaseError:
            raise sqlite3.DatabaseError(f"{path}: not a SQLite database") from None
        if kind not in KINDS.values():
            raise sqlite3.DatabaseError(f"{path}: not a reliability.py database (user_version {kind})")
        if connection.execute("PRAGMA journal_mode=WAL").fetchone()[0] != "wal":
            raise sqlite3.DatabaseError(f"{path}: cannot run in WAL mode")
        connection.execute("PRAGMA synchronous=FULL")
        connection.execute("PRAGMA foreign_keys=ON")
        if connection.execute("PRAGMA synchronous").fetchone()[0] != 2 \
                or connection.execute("PRAGMA foreign_keys").fetchone()[0] != 1:
            raise sqlite3.DatabaseError(f"{path}: synchronous=FULL or foreign_keys=ON did not take")
        if fcntl is not None:
            connection.queue = os.open(path + "-queue", os.O_RDWR | os.O_CREAT, 0o644)
    except BaseException:
        connection.close()
        raise
    return connection


def wal_reset_bug(version=None):
    """True if this SQLite (default: the linked one) has the WAL-reset race.

    The race, present from 3.7.0 through 3.51.2 and fixed in 3.51.3 (backported to
    3.50.7 and 3.44.6), can corrupt a WAL database or lose commits when several
    connections write and checkpoint: exactly the use these modules teach.
    """
    version = tuple(version or sqlite3.sqlite_version_info)
    if not (3, 7, 0) <= version < (3, 51, 3):
        return False
    return not ((3, 44, 6) <= version < (3, 45, 0) or (3, 50, 7) <= version < (3, 51, 0))


@contextlib.contextmanager
def transaction(connection, *, deadline=BUSY_DEADLINE):
    """Run the block in one BEGIN IMMEDIATE transaction: COMMIT on success, ROLLBACK on error.

    Writers first queue on ``<db>-queue``, a POSIX flock the kernel releases if its
    holder dies, for at most ``deadline`` seconds; BEGIN then waits at most the
    connection's busy timeout (BUSY_DEADLINE from connect()) for writers that do not
    queue.  Either wait ends in Busy with nothing written.  Without fcntl (Windows)
    only SQLite's busy handler waits.  An error raised by COMMIT itself (disk I/O,
    disk full) is an unknown outcome, not "nothing happened": WAL recovery may still
    replay that commit, so look the key up again from a fresh connection.
    """
    if connection.in_transaction:  # a nested call would release the outer one's place in the queue
        raise sqlite3.ProgrammingError("transaction() does not nest: this connection is already in one")
    queue = getattr(connection, "queue", None)
    if queue is not None:
        _wait_in_queue(queue, deadline)
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
                raise Busy(f"database still locked after {deadline} s; nothing was written") from None
        # Random pauses that double up to BUSY_PAUSE, then, once a writer has been patient
        # this long, short ones: SQLite's own back-off only grows (to 100 ms a sleep) and
        # starves an unlucky writer; this one lets it in within a few milliseconds.
        time.sleep(random.random() * (pause if waited < BUSY_PATIENCE else BUSY_PAUSE_URGENT))
        pause = min(2 * pause, BUSY_PAUSE)


# --- canonical form and digest ----------------------------------------------------

def check_identity(caller, key):
    """Caller and operation key: non-empty strings of bounded length, valid UTF-8."""
    for name, value in (("caller", caller), ("key", key)):
        if type(value) is not str:
            raise TypeError(f"{name} must be a str, not {type(value).__name__}")
        if not 0 < len(value) <= MAX_IDENTITY_LENGTH:
            raise ValueError(f"{name} must have 1 to {MAX_IDENTITY_LENGTH} characters")
        value.encode("utf-8")  # a lone surrogate raises here, before any transaction


def check_ticks(issued_at, now):
    """Logical ticks are ints from 0 to MAX_TICK (``issued_at`` may be None), issued no later than now."""
    for name, value in (("now", now), ("issued_at", issued_at)):
        if (value is not None or name == "now") and (type(value) is not int or not 0 <= value <= MAX_TICK):
            raise ValueError(f"{name} must be an int tick from 0 to {MAX_TICK}")
    if issued_at is not None and issued_at > now:
        raise ValueError(f"issued_at {issued_at} is later than now {now}")


def canonical(payload):
    """Return (text, digest) for a JSON object: sorted keys, compact, UTF-8, SHA-256.

    Anything JSON cannot carry exactly (NaN, Infinity, non-string keys, tuples,
    bytes, sets) raises before any transaction.  The digest only detects a
    different intent behind the same key; it never replaces the key.
    """
    if type(payload) is not dict:
        raise TypeError(f"payload must be a dict, not {type(payload).__name__}")
    try:
        text = _dumps(payload)
    except (TypeError, ValueError) as error:
        raise type(error)(f"payload is not exact JSON: {error}") from None
    except RecursionError:
        raise ValueError("payload nests too deeply") from None
    # json silently turns int keys into strings and tuples into lists; a value that
    # does not come back equal would change meaning between sender and receiver.
    if json.loads(text) != payload:
        raise TypeError("payload is not exact JSON: keys must be str and arrays lists")
    data = text.encode("utf-8")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload exceeds {MAX_PAYLOAD_BYTES} bytes in canonical form")
    return text, hashlib.sha256(data).hexdigest()


def _check_fault(fault, allowed=BOUNDARIES):
    if fault is not None and fault not in allowed:
        raise ValueError(f"unknown fault {fault!r}; expected one of {', '.join(allowed)}")


def _crash(fault, boundary):
    if fault == boundary:
        os._exit(CRASH_EXIT)


# --- the idempotent receiver -------------------------------------------------------

def receive(connection, caller, key, payload, *, issued_at=None, now=0, fault=None):
    """Create one ticket per (caller, key), however often the request arrives.

    The receipt check, the ticket and the receipt (digest and ticket id) share one
    BEGIN IMMEDIATE transaction, so a replay returns the identical response and a
    different payload under the same key raises Conflict.  Holds while receipts are
    kept: once purge() has run, a request issued (``issued_at``) before its low-water
    mark and found without a receipt raises Expired instead of acting again.
    """
    check_identity(caller, key)
    text, digest = canonical(payload)
    check_ticks(issued_at, now)
    _check_fault(fault)
    # A committed receipt is never modified (purge() may only delete old ones), so a
    # receipt read outside the write lock is a true answer: replays cost no lock and no
    # fsync.  A miss proves nothing and is read again under the lock with the low-water mark.
    response = _stored_response(connection, caller, key, digest)
    if response is not None:
        return response
    with transaction(connection):
        # Another writer may have committed this key between the read above and our lock;
        # the mark is read under the lock too, since purge() moves it in a transaction of its own.
        response, low_water = _stored_response(connection, caller, key, digest, low_water=True)
        if response is not None:
            return response
        if low_water and (issued_at is None or issued_at < low_water):
            raise Expired(f"{caller!r}/{key!r} was issued before tick {low_water}, whose receipts may be "
                          "purged: it could be a late replay, so it is refused (a new key is a new decision)")
        ticket = connection.execute(
            "INSERT INTO tickets (caller, key, digest, payload) VALUES (?, ?, ?, ?)",
            (caller, key, digest, text)).lastrowid
        connection.execute("INSERT INTO receipts (caller, key, digest, ticket_id, tick) VALUES (?, ?, ?, ?, ?)",
                           (caller, key, digest, ticket, now))
        _crash(fault, "before_receiver_commit")  # the ticket exists only inside this transaction
    _crash(fault, "after_receiver_commit")  # committed, and nobody has been told
    return _response(caller, key, digest, ticket)


def purge(connection, now, window):
    """Delete receipts written before ``now - window`` and raise the low-water mark to it, atomically.

    From then on receive() refuses, as Expired, any request issued before the mark
    that finds no receipt; the mark never moves backwards.
    """
    check_ticks(None, now)
    if type(window) is not int or window <= 0:
        raise ValueError("window must be a positive int number of ticks")
    mark = now - window
    if mark < 0:
        raise ValueError(f"now - window = {mark}: nothing is old enough to purge yet")
    with transaction(connection):
        low_water = connection.execute("SELECT low_water FROM retention").fetchone()[0]
        if mark < low_water:
            raise ValueError(f"the low-water mark is {low_water}; now - window = {mark} would move it backwards")
        deleted = connection.execute("DELETE FROM receipts WHERE tick < ?", (mark,)).rowcount
        connection.execute("UPDATE retention SET low_water = ?", (mark,))
    return {"deleted": deleted, "low_water": mark}


def _stored_response(connection, caller, key, digest, *, low_water=False):
    """The response the receipt for (caller, key) replays, or None; with ``low_water``,
    (response, low-water mark) from one read."""
    rows = connection.execute(_READ_RECEIPT_AND_MARK if low_water else _READ_RECEIPT, (caller, key)).fetchall()
    if not rows or rows[0][0] is None:
        return (None, rows[0][-1]) if low_water else None
    stored_digest, ticket, ticket_caller, ticket_key, ticket_digest = rows[0][:5]
    if stored_digest != digest:
        raise Conflict(f"key {key!r} of caller {caller!r} was used for a different payload")
    if type(ticket) is not int or (ticket_caller, ticket_key, ticket_digest) != (caller, key, digest):
        raise CorruptRecord(f"receipt {caller!r}/{key!r} disagrees with its ticket")
    response = _response(caller, key, digest, ticket)
    return (response, rows[0][-1]) if low_water else response


def _response(caller, key, digest, ticket):
    # The whole response is a function of the receipt row, so rebuilding it returns the
    # identical value on every replay without storing it twice (a narrower receipt is a
    # cheaper commit).  A response carrying more (a URL, a server time) must store it too.
    return {"caller": caller, "key": key, "digest": digest, "ticket_id": ticket}


_READ_RECEIPT = ("SELECT r.digest, r.ticket_id, t.caller, t.key, t.digest"
                 " FROM receipts r LEFT JOIN tickets t ON t.id = r.ticket_id WHERE r.caller = ? AND r.key = ?")
# Under the write lock the mark comes along, so one statement answers both questions.
_READ_RECEIPT_AND_MARK = ("SELECT r.digest, r.ticket_id, t.caller, t.key, t.digest, m.low_water"
                          " FROM retention m LEFT JOIN receipts r ON r.caller = ? AND r.key = ?"
                          " LEFT JOIN tickets t ON t.id = r.ticket_id")


# One encoder, made once: sorted keys, compact, UTF-8 text, no NaN or Infinity.
_dumps = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


# --- the durable outbox -------------------------------------------------------------

def enqueue(connection, caller, key, payload, *, mode="idempotent", now=0, fault=None):
    """Persist an intent and its outbox row in one transaction, once per (caller, key).

    Returns "accepted" or, for the same intent again, "duplicate" (nothing added);
    the same key with a different payload or mode raises Conflict.  ``now`` is kept
    as the intent's issue tick, which every delivery carries to the receiver.
    """
    check_identity(caller, key)
    text, digest = canonical(payload)
    check_ticks(None, now)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    _check_fault(fault, ENQUEUE_BOUNDARIES)
    with transaction(connection):
        rows = connection.execute("SELECT mode, digest FROM requests WHERE caller = ? AND key = ?",
                                  (caller, key)).fetchall()
        if rows:
            if rows[0] != (mode, digest):
                raise Conflict(f"key {key!r} of caller {caller!r} was enqueued with another intent")
            return "duplicate"
        connection.execute("INSERT INTO requests (caller, key, mode, digest, payload, issued_at)"
                           " VALUES (?, ?, ?, ?, ?, ?)", (caller, key, mode, digest, text, now))
        connection.execute("INSERT INTO outbox (caller, key, state) VALUES (?, ?, 'pending')", (caller, key))
        _crash(fault, "before_intent_commit")  # neither row survives: the caller must resubmit
    _crash(fault, "after_intent_commit")  # both rows survive, the caller never heard "accepted"
    return "accepted"


def claim(connection, now):
    """Atomically take the oldest due row: attempt + 1, leased until ``now + LEASE_TICKS``.

    Due means pending, or in flight with a lease that ended at or before ``now``.  An
    expired external (non-idempotent) row is not retried but marked unknown.  Returns
    the claimed row as a dict, or None.  Only one of many racing claimers wins a row.
    """
    check_ticks(None, now)
    with transaction(connection):
        while True:
            rows = connection.execute(
                "SELECT o.caller, o.key, o.state, o.attempts, r.mode, r.digest, r.payload, r.issued_at"
                " FROM outbox o JOIN requests r ON r.caller = o.caller AND r.key = o.key"
                " WHERE o.state = 'pending' OR (o.state = 'inflight' AND o.lease_until <= ?)"
                " ORDER BY o.id LIMIT 1", (now,)).fetchall()
            if not rows:
                return None
            caller, key, state, attempts, mode, digest, text, issued_at = rows[0]
            if mode not in MODES:
                _block(connection, caller, key, f"corrupt intent: unknown mode {mode!r}")
                continue
            if state == "inflight" and mode == "external":
                # The old attempt may have reached the tool: retrying could act twice.
                _set_state(connection, caller, key, attempts, "unknown")
                continue
            if attempts >= MAX_ATTEMPTS:
                _block(connection, caller, key, f"no valid answer after {attempts} attempts")
                continue
            row = {"caller": caller, "key": key, "attempt": attempts + 1, "mode": mode, "digest": digest,
                   "issued_at": issued_at, "now": now}
            try:
                row["payload"] = json.loads(text)
                if canonical(row["payload"])[1] != digest:
                    raise ValueError("digest mismatch")
            except (TypeError, ValueError) as error:
                _block(connection, caller, key, f"corrupt intent: {error}")
                continue
            # Who holds the attempt: reconcile() treats absence as proof only once it is gone.
            connection.execute(
                "UPDATE outbox SET state = 'inflight', attempts = ?, lease_until = ?, owner_pid = ?, tool_pid = NULL"
                " WHERE caller = ? AND key = ?", (attempts + 1, now + LEASE_TICKS, os.getpid(), caller, key))
            return row


def _block(connection, caller, key, reason):
    # A record we cannot trust is parked for a person, never sent.
    connection.execute("UPDATE outbox SET state = 'blocked', response = ? WHERE caller = ? AND key = ?",
                       (_dumps({"error": reason}), caller, key))


def acknowledge(connection, caller, key, attempt, response):
    """Record a validated response as done, only for the attempt that still holds the row.

    Returns False (nothing changed) when the row is no longer in flight under that
    attempt number; raises ValueError for a response that does not answer this request.
    """
    with transaction(connection):
        rows = connection.execute("SELECT digest FROM requests WHERE caller = ? AND key = ?",
                                  (caller, key)).fetchall()
        if not rows:
            raise ValueError(f"no request {caller!r}/{key!r}")
        check_response(response, caller, key, rows[0][0])
        return connection.execute(
            "UPDATE outbox SET state = 'done', response = ? WHERE caller = ? AND key = ?"
            " AND state = 'inflight' AND attempts = ?",
            (_dumps(response), caller, key, attempt)).rowcount == 1


def check_response(response, caller, key, digest):
    """A response answers a request only with the same caller, key, digest and an int ticket id."""
    if type(response) is not dict or set(response) != {"caller", "key", "digest", "ticket_id"}:
        raise ValueError("response has the wrong structure")
    if (response["caller"], response["key"], response["digest"]) != (caller, key, digest):
        raise ValueError("response answers a different request")
    if type(response["ticket_id"]) is not int or response["ticket_id"] < 1:
        raise ValueError("response ticket_id must be a positive int")


def _set_state(connection, caller, key, attempt, state):
    # Guarded by the attempt: a newer attempt, or a person, may own the row by now.
    return connection.execute(
        "UPDATE outbox SET state = ? WHERE caller = ? AND key = ? AND state = 'inflight' AND attempts = ?",
        (state, caller, key, attempt)).rowcount == 1


def _end_attempt(connection, caller, key, attempt, state, response=None):
    """The attempt's owner gives it up as ``state``: its tool child is reaped, so nobody
    can act for it any more (the pids reconcile() would wait for are cleared)."""
    with transaction(connection):
        connection.execute(
            "UPDATE outbox SET state = ?, response = coalesce(?, response), owner_pid = NULL, tool_pid = NULL"
            " WHERE caller = ? AND key = ? AND state = 'inflight' AND attempts = ?",
            (state, None if response is None else _dumps(response), caller, key, attempt))


def dispatch(connection, root, now, *, fault=None, timeout=CHILD_TIMEOUT, start=None):
    """Claim one due row, call its tool in a child process, record what can be proven.

    No database lock is held while the child runs.  A valid response marks the row
    done (even if the child exits non-zero afterwards); a missing or invalid one
    leaves an idempotent row in flight until its lease ends, and makes an external
    row unknown, never retried automatically.  Returns a summary dict, or None.
    """
    _check_fault(fault)
    row = claim(connection, now)
    if row is None:
        return None
    if row["mode"] == "mark_before":
        return unsafe_dispatch_mark_before(connection, root, row, fault=fault, timeout=timeout, start=start)
    _crash(fault, "after_claim")
    return deliver(connection, root, row, fault=fault, timeout=timeout, start=start)


def deliver(connection, root, row, *, fault=None, timeout=CHILD_TIMEOUT, start=None):
    """Call the tool for a row claimed under ``row["attempt"]`` and record the outcome under it.

    An external call is sent only while the row is still in flight under that attempt
    (checked and recorded in one transaction before the request leaves); otherwise the
    child is killed unasked and "refused" is set.  An idempotent call is sent anyway:
    the attempt number guards only the acknowledgement, as the article says, and the
    receiver's receipt makes a late call harmless.
    """
    _check_fault(fault, _REACHABLE[row["mode"]])
    caller, key, attempt = row["caller"], row["key"], row["attempt"]
    on_start = None
    if row["mode"] == "external":
        def on_start(pid):
            # Committed before the request is sent, so reconcile() can tell whether the
            # one process that could still act for this attempt is gone; and nothing is
            # sent for a row that is unknown, done, or held by a newer attempt.
            with transaction(connection):
                return connection.execute(
                    "UPDATE outbox SET tool_pid = ? WHERE caller = ? AND key = ? AND state = 'inflight'"
                    " AND attempts = ?", (pid, caller, key, attempt)).rowcount == 1
    response, exit_code = call_tool(root, row, fault=fault if fault in CHILD_BOUNDARIES else None,
                                    timeout=timeout, start=start, on_start=on_start)
    if exit_code == "refused":
        return {"caller": caller, "key": key, "attempt": attempt, "exit_code": None, "response": None,
                "acknowledged": False, "refused": "not in flight under this attempt: nothing was sent"}
    _crash(fault, "after_response_before_ack")
    result = {"caller": caller, "key": key, "attempt": attempt, "exit_code": exit_code,
              "response": None, "acknowledged": False}
    if isinstance(response, dict) and response.get("error") in ("conflict", "expired"):
        # The receiver refused for good: a person, or a new key, decides what follows.
        _end_attempt(connection, caller, key, attempt, "blocked", response)
        result["response"] = response
        return result
    if response is not None:
        try:
            result["acknowledged"] = acknowledge(connection, caller, key, attempt, response)
            result["response"] = response
        except ValueError:
            response = None
    if response is None and row["mode"] == "external":
        # The tool may or may not have acted; only a lookup or a person can tell.
        _end_attempt(connection, caller, key, attempt, "unknown")
    if result["acknowledged"]:
        _crash(fault, "after_ack")
    return result


def call_tool(root, row, *, fault=None, timeout=CHILD_TIMEOUT, start=None, on_start=None):
    """Run the row's tool in a child process; return (parsed first output line or None, exit code).

    ``start(argv)`` launches ``reliability.py argv...`` as a child with piped stdin and
    stdout (default: a fresh interpreter); ``on_start(pid)`` runs before the request
    is sent, and if it returns False the child is killed unasked (exit code "refused").
    A child that outlives ``timeout`` is killed and reaped (exit code None).
    """
    import subprocess  # only the sender spawns; tool children start faster without it
    _check_fault(fault, CHILD_BOUNDARIES)
    kind = {"idempotent": "receive", "naive": "unsafe-receive", "external": "external"}[row["mode"]]
    argv = ["serve", kind, os.path.join(root, EXTERNAL if kind == "external" else RECEIVER)]
    if fault is not None:
        argv += ["--fault", fault]
    child = (start or start_child)(argv)
    request = _dumps({"caller": row["caller"], "key": row["key"], "payload": row["payload"],
                      "issued_at": row.get("issued_at"), "now": row.get("now", 0)})
    outcome = "refused"
    try:
        if on_start is None or on_start(child.pid) is not False:
            outcome = None  # a child killed at the time-out has no exit code to report
            output, _ = child.communicate(request + "\n", timeout=timeout)
            outcome = "answered"
    except subprocess.TimeoutExpired:
        pass
    finally:
        if outcome != "answered":  # refused, timed out or interrupted: never left running
            child.kill()
            child.communicate()
    if outcome != "answered":
        return None, outcome
    line = output.split("\n", 1)[0]
    try:
        return json.loads(line), child.returncode
    except ValueError:
        return None, child.returncode


def start_child(argv):
    """Start ``python3 -I -S reliability.py argv...`` with pipes: isolated, no site packages."""
    import subprocess
    return subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), *argv],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8")


def serve(kind, database, request_line, *, fault=None):
    """Child side of call_tool: answer one request and return the line to write."""
    request = json.loads(request_line)
    connection = connect(database)
    try:
        if kind == "receive":
            response = receive(connection, request["caller"], request["key"], request["payload"],
                               issued_at=request.get("issued_at"), now=request.get("now", 0), fault=fault)
        else:
            function = unsafe_receive_without_receipt if kind == "unsafe-receive" else external_create_ticket
            response = function(connection, request["caller"], request["key"], request["payload"], fault=fault)
    except (Conflict, Expired) as error:
        response = {"error": "conflict" if isinstance(error, Conflict) else "expired", "message": str(error)}
    finally:
        connection.close()
    return _dumps(response)


def external_create_ticket(connection, caller, key, payload, *, fault=None):
    """The synthetic external tool: it creates a ticket on every call and keeps no receipt."""
    check_identity(caller, key)
    text, digest = canonical(payload)
    _check_fault(fault)
    _crash(fault, "before_external_effect")
    with transaction(connection):
        ticket = connection.execute(
            "INSERT INTO tickets (caller, key, digest, payload) VALUES (?, ?, ?, ?)",
            (caller, key, digest, text)).lastrowid
    _crash(fault, "after_external_effect")
    return {"caller": caller, "key": key, "digest": digest, "ticket_id": ticket}


# --- leaving unknown: ask the tool, or record a person's decision --------------------

def lookup_external(connection, caller, key):
    """The external tool's own search by reference: its tickets for (caller, key), oldest first."""
    return [{"caller": caller, "key": key, "digest": digest, "ticket_id": ticket}
            for ticket, digest in connection.execute(
                "SELECT id, digest FROM tickets WHERE caller = ? AND key = ? ORDER BY id", (caller, key))]


def reconcile(connection, tool, caller, key, now):
    """Settle an unknown row from the tool's records (``tool``: an open external.db connection).

    One matching ticket makes the row done with it.  No ticket sends the row back to
    pending only if the unanswered attempt can no longer act: its lease has ended and
    the processes that held it (sender and tool child, same machine) are gone.
    Anything less certain leaves it unknown.  Returns a dict whose "status" is the row's state.
    """
    check_identity(caller, key)
    check_ticks(None, now)
    rows = connection.execute(
        "SELECT o.state, o.attempts, o.lease_until, o.owner_pid, o.tool_pid, r.digest FROM outbox o"
        " JOIN requests r ON r.caller = o.caller AND r.key = o.key WHERE o.caller = ? AND o.key = ?",
        (caller, key)).fetchall()
    if not rows:
        raise ValueError(f"no request {caller!r}/{key!r}")
    state, attempt, lease_until, owner_pid, tool_pid, digest = rows[0]
    if state != "unknown":
        return {"status": state, "reason": "not unknown: nothing to reconcile"}
    # Decided before the lookup: once nobody can act, an absent ticket stays absent.
    can_act = now < (lease_until or 0) or any(_alive(pid) for pid in (owner_pid, tool_pid) if pid)
    found = lookup_external(tool, caller, key)
    if len(found) == 1 and found[0]["digest"] == digest:
        if _settle(connection, "UPDATE outbox SET state = 'done', response = ? WHERE caller = ? AND key = ?"
                   " AND state = 'unknown' AND attempts = ?", (_dumps(found[0]), caller, key, attempt)):
            return {"status": "done", "response": found[0]}
        return _now_in(connection, caller, key)
    if found:
        return {"status": "unknown", "reason": f"the tool holds {len(found)} ticket(s) that do not settle it"}
    if can_act:
        return {"status": "unknown", "reason": "no ticket yet, but the unanswered attempt may still act"}
    if _settle(connection, "UPDATE outbox SET state = 'pending', owner_pid = NULL, tool_pid = NULL"
               " WHERE caller = ? AND key = ? AND state = 'unknown' AND attempts = ?", (caller, key, attempt)):
        return {"status": "pending", "reason": "proven absent: retry under the same key"}
    return _now_in(connection, caller, key)


def _settle(connection, update, parameters):
    # Guarded by state and attempt: a person (resolve) or another reconciler may have
    # settled the row meanwhile, and then this changes nothing.
    with transaction(connection):
        return connection.execute(update, parameters).rowcount == 1


def _now_in(connection, caller, key):
    state = connection.execute("SELECT state FROM outbox WHERE caller = ? AND key = ?", (caller, key)).fetchone()[0]
    return {"status": state, "reason": "settled by someone else meanwhile"}


def _alive(pid):
    try:
        os.kill(pid, 0)  # a reused pid counts as alive: the safe mistake
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve(connection, caller, key, decision, *, by, why, evidence=None):
    """Record a person's decision on an unknown or blocked row, with the audit row, atomically.

    ``decision``: "done" (``evidence`` must be the tool's response for this request),
    "retry" (back to pending, same key) or "abandon".  The audit row is never rewritten.
    """
    check_identity(caller, key)
    if decision not in DECISIONS:
        raise ValueError(f"decision must be one of {', '.join(DECISIONS)}")
    for name, value in (("by", by), ("why", why)):
        if type(value) is not str or not value.strip() or len(value) > 1000:
            raise ValueError(f"{name} must be a non-empty str of at most 1000 characters")
    if (evidence is None) == (decision == "done"):
        raise ValueError("evidence is required for done, and only for done")
    with transaction(connection):
        rows = connection.execute(
            "SELECT o.state, o.attempts, r.digest FROM outbox o JOIN requests r"
            " ON r.caller = o.caller AND r.key = o.key WHERE o.caller = ? AND o.key = ?", (caller, key)).fetchall()
        if not rows:
            raise ValueError(f"no request {caller!r}/{key!r}")
        state, attempt, digest = rows[0]
        if state not in ("unknown", "blocked"):
            raise ValueError(f"only an unknown or blocked row is resolved by hand; this one is {state}")
        if evidence is not None:
            check_response(evidence, caller, key, digest)
        new_state = {"done": "done", "retry": "pending", "abandon": "abandoned"}[decision]
        connection.execute("UPDATE outbox SET state = ?, response = ?, owner_pid = NULL, tool_pid = NULL"
                           " WHERE caller = ? AND key = ?",
                           (new_state, _dumps(evidence) if evidence else None, caller, key))
        audit = connection.execute(
            "INSERT INTO resolutions (caller, key, attempt, decision, decided_by, reason, evidence)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (caller, key, attempt, decision, by, why, _dumps(evidence) if evidence else None)).lastrowid
    return {"status": new_state, "resolution": audit}


# --- setup and observation ----------------------------------------------------------

def init(root):
    """Create sender.db, receiver.db and external.db under ``root``; never overwrite.

    On failure the files this call created are removed again.
    """
    os.makedirs(root, exist_ok=True)
    for name in KINDS:
        for suffix in ("", "-wal", "-shm", "-journal"):
            if os.path.exists(os.path.join(root, name + suffix)):
                raise FileExistsError(f"{os.path.join(root, name + suffix)} exists; init never overwrites")
    created = []
    try:
        for name, schema in SCHEMAS.items():
            path = os.path.join(root, name)
            # O_EXCL claims the name atomically: two inits cannot both succeed.
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            created.append(path)
            connection = sqlite3.connect(path, isolation_level=None)
            try:
                connection.execute("PRAGMA journal_mode=WAL")
                connection.executescript(f"BEGIN; {schema} PRAGMA user_version = {KINDS[name]}; COMMIT;")
            finally:
                connection.close()
    except BaseException:
        for path in created:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path + suffix)
        raise


def snapshot(connection):
    """Counts and outbox rows of one of our databases, for observers and tests."""
    kind = connection.execute("PRAGMA user_version").fetchone()[0]
    if kind == KINDS[SENDER]:
        rows = connection.execute(
            "SELECT o.caller, o.key, r.mode, o.state, o.attempts, o.lease_until, o.response"
            " FROM outbox o JOIN requests r ON r.caller = o.caller AND r.key = o.key ORDER BY o.id").fetchall()
        return {"intent_rows": connection.execute("SELECT count(*) FROM requests").fetchone()[0],
                "outbox": [{"caller": c, "key": k, "mode": m, "state": s, "attempts": a, "lease_until": l,
                            "response": json.loads(r) if r else None} for c, k, m, s, a, l, r in rows]}
    tickets = connection.execute("SELECT count(*) FROM tickets").fetchone()[0]
    if kind == KINDS[RECEIVER]:
        return {"tickets": tickets, "receipts": connection.execute("SELECT count(*) FROM receipts").fetchone()[0]}
    return {"tickets": tickets}


# --- deliberately unsafe baselines (for the experiments only) ------------------------

def unsafe_receive_without_receipt(connection, caller, key, payload, *, fault=None):
    """UNSAFE baseline: creates a ticket on every call; a replay after a lost reply duplicates."""
    check_identity(caller, key)
    text, digest = canonical(payload)
    _check_fault(fault)
    with transaction(connection):
        ticket = connection.execute(
            "INSERT INTO tickets (caller, key, digest, payload) VALUES (?, ?, ?, ?)",
            (caller, key, digest, text)).lastrowid
        _crash(fault, "before_receiver_commit")
    _crash(fault, "after_receiver_commit")
    return {"caller": caller, "key": key, "digest": digest, "ticket_id": ticket}


def unsafe_dispatch_mark_before(connection, root, row, *, fault=None, timeout=CHILD_TIMEOUT, start=None):
    """UNSAFE baseline: records done before sending, so a crash in between loses the task."""
    _end_attempt(connection, row["caller"], row["key"], row["attempt"], "done")
    _crash(fault, "after_mark_before_send")
    response, exit_code = call_tool(root, dict(row, mode="idempotent"), timeout=timeout, start=start)
    return {"caller": row["caller"], "key": row["key"], "attempt": row["attempt"], "exit_code": exit_code,
            "response": response, "acknowledged": False}


def unsafe_delete_receipts(connection, before_tick):
    """UNSAFE baseline: deletes old receipts without a low-water mark, so a late replay acts again."""
    with transaction(connection):
        return connection.execute("DELETE FROM receipts WHERE tick < ?", (before_tick,)).rowcount


def unsafe_retry_unknown(connection, root, caller, key, *, timeout=CHILD_TIMEOUT, start=None):
    """UNSAFE baseline: calls the external tool again for an unknown row, ignoring the policy."""
    attempts = connection.execute("SELECT attempts FROM outbox WHERE caller = ? AND key = ?",
                                  (caller, key)).fetchone()[0]
    return call_tool(root, _claimed_row(connection, caller, key, attempts), timeout=timeout, start=start)


# --- command line --------------------------------------------------------------------

def main(argv=None):
    """Small CLI over ROOT (the folder of the three databases); prints one JSON line.

    init, enqueue, claim, dispatch, deliver, snapshot, reconcile, resolve, purge, and
    the tool child's serve.  Exit 0 done, 1 refused or failed (one line on stderr),
    2 bad usage; --fault exits with CRASH_EXIT at that boundary.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        # Parsed by hand: one child starts per tool call, and its start-up is the call's cost.
        fault = argv[4] if argv[3:4] == ["--fault"] else None
        line = serve(argv[1], argv[2], sys.stdin.readline(), fault=fault)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        _crash(fault, "after_response_write")  # the complete reply is already in the pipe
        return 0
    import argparse
    parser = argparse.ArgumentParser(prog="reliability.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    # Only the subcommand asked for is built: argparse spends about a millisecond on each,
    # and experiment children start often.  --help and mistakes still see them all.
    names = ("init", "enqueue", "claim", "dispatch", "deliver", "snapshot", "reconcile", "resolve", "purge")
    wanted = argv[0] if argv[:1] and argv[0] in names else None
    skipped = argparse.Namespace(add_argument=lambda *args, **kwargs: None)

    def command(name, helptext, *positional, now=False):
        if wanted not in (None, name):
            return skipped
        p = sub.add_parser(name, help=helptext)
        for argument in ("root",) + positional:
            p.add_argument(argument)
        if now:
            p.add_argument("--now", type=int, required=True, help="logical tick")
        return p

    command("init", "create the three databases")
    p = command("enqueue", "accept an intent into the outbox", "caller", "key", "payload")
    p.add_argument("--mode", choices=MODES, default="idempotent")
    p.add_argument("--now", type=int, default=0, help="logical tick the intent is issued at")
    p.add_argument("--fault", choices=ENQUEUE_BOUNDARIES)
    command("claim", "claim one due row", now=True)
    command("dispatch", "claim one due row and call its tool", now=True).add_argument(
        "--fault", choices=BOUNDARIES[2:])
    command("deliver", "call the tool for a row claimed earlier, under its attempt", "caller", "key",
            now=True).add_argument("--attempt", type=int, required=True)
    command("snapshot", "print what the three databases hold")
    command("reconcile", "settle an unknown row from the external tool's records", "caller", "key", now=True)
    p = command("resolve", "record a person's decision on an unknown or blocked row", "caller", "key", "decision")
    p.add_argument("--by", required=True), p.add_argument("--why", required=True)
    p.add_argument("--evidence", help="for done: the tool's response, as JSON")
    command("purge", "delete old receipts and raise the low-water mark", now=True).add_argument(
        "--window", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        result = _run(args)
    except (Conflict, Expired, CorruptRecord, OSError, ValueError, TypeError, OverflowError, sqlite3.Error) as error:
        print(f"reliability.py {args.command}: {error}", file=sys.stderr)
        return 1
    print(_dumps(result))
    return 0


def _run(args):
    if args.command == "init":
        init(args.root)
        return "initialised"
    with contextlib.ExitStack() as stack:
        def open_(name):
            connection = connect(os.path.join(args.root, name))
            stack.callback(connection.close)
            return connection
        if args.command == "snapshot":
            return {name[:-3]: snapshot(open_(name)) for name in KINDS}
        if args.command == "purge":
            return purge(open_(RECEIVER), args.now, args.window)
        sender = open_(SENDER)
        if args.command == "enqueue":
            return enqueue(sender, args.caller, args.key, json.loads(args.payload), mode=args.mode,
                           now=args.now, fault=args.fault)
        if args.command == "claim":
            return claim(sender, args.now)
        if args.command == "dispatch":
            return dispatch(sender, args.root, args.now, fault=args.fault)
        if args.command == "deliver":
            return deliver(sender, args.root, _claimed_row(sender, args.caller, args.key, args.attempt, args.now))
        if args.command == "reconcile":
            return reconcile(sender, open_(EXTERNAL), args.caller, args.key, args.now)
        evidence = json.loads(args.evidence) if args.evidence else None
        return resolve(sender, args.caller, args.key, args.decision, by=args.by, why=args.why, evidence=evidence)


def _claimed_row(connection, caller, key, attempt, now=0):
    rows = connection.execute("SELECT mode, digest, payload, issued_at FROM requests WHERE caller = ? AND key = ?",
                              (caller, key)).fetchall()
    if not rows:
        raise ValueError(f"no request {caller!r}/{key!r}")
    mode, digest, text, issued_at = rows[0]
    return {"caller": caller, "key": key, "attempt": attempt, "mode": mode, "digest": digest,
            "payload": json.loads(text), "issued_at": issued_at, "now": now}


if __name__ == "__main__":
    sys.exit(main())
