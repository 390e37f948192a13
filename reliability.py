"""Agent 可靠执行实战（一）：工具干完了，回执丢了怎么办？ — runnable companion.

A durable outbox on the sender (第一篇 §2), an idempotent receiver whose receipt commits in the same
BEGIN IMMEDIATE transaction as its ticket (§3), real processes that die at named boundaries (§4),
atomic claims with attempt numbers and logical-tick leases (§5), and an honest ``unknown`` for a
tool that offers no idempotency (§6).

Three SQLite files in one folder never share a transaction: ``sender.db`` (intents and their outbox
rows), ``receiver.db`` (synthetic tickets and their receipts) and ``external.db`` (a synthetic tool
that keeps no receipts).  Every file runs in WAL mode with synchronous=FULL.  The guarantees hold
under process crashes on one machine whose storage honours fsync; see README.md for what is not
proven.  Standard library only; this file runs alone.
"""
import sys

# One clear line, not a traceback, on an interpreter too old.
if sys.version_info < (3, 9):
    sys.stderr.write(f"reliability.py needs Python 3.9 or newer, not {sys.version.split()[0]}\n")
    sys.exit(2)

import collections
import contextlib
import errno
import functools
import hashlib
import json
import os
import signal
import sqlite3
import stat
from contextlib import contextmanager

__all__ = ["enqueue", "transaction", "receive", "dispatch", "deliver", "call_tool", "claim",
           "acknowledge", "external_create_ticket", "lookup_external", "reconcile", "resolve",
           "purge", "connect", "init", "snapshot", "serve", "tool_child", "Conflict", "Expired",
           "CorruptRecord"]

# 第一篇 §5: a claim at tick t may be taken over at tick t + 10.
LEASE_TICKS = 10
# An idempotent row unanswered this often since a person last decided on it is blocked.
MAX_ATTEMPTS = 10
# Caller and request key, in characters.
MAX_IDENTITY_LENGTH = 200
# The payload in canonical UTF-8 form, and how deep its objects and arrays may nest: far
# inside any JSON parser's recursion limit.
MAX_PAYLOAD_BYTES = 65536
MAX_PAYLOAD_DEPTH = 32
# Seconds a tool child may take before it is killed.
CHILD_TIMEOUT = 15.0
# Which tool an intent is for: the receiver, or one that keeps no receipts (§6).
MODES = ("idempotent", "external")
# twin: logical ticks stay far inside SQLite's signed 64-bit integers.
MAX_TICK = 2 ** 62
# twin: seconds BEGIN IMMEDIATE waits for another writer before "database is locked".
BUSY_TIMEOUT = 10.0

# 第一篇 §4: a process armed at a named boundary (a crash_point line) exits with this code there.
CRASH_EXIT = 73

SENDER, RECEIVER, EXTERNAL = "sender.db", "receiver.db", "external.db"
# PRAGMA application_id of each kind of file, and PRAGMA user_version of this schema.
KINDS = {SENDER: 7301, RECEIVER: 7302, EXTERNAL: 7303}
SCHEMA_VERSION = 2
SCHEMAS = {
    SENDER: (
        """CREATE TABLE requests (
            caller TEXT NOT NULL, key TEXT NOT NULL,
            mode TEXT NOT NULL CHECK (mode IN ('idempotent', 'external')),
            digest TEXT NOT NULL, payload TEXT NOT NULL, issued_at INTEGER NOT NULL,
            PRIMARY KEY (caller, key)) WITHOUT ROWID""",
        # owner_pid and tool_pid: who may still act for the current attempt (reconcile).
        """CREATE TABLE outbox (
            id INTEGER PRIMARY KEY, caller TEXT NOT NULL, key TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN
                ('pending', 'inflight', 'done', 'unknown', 'blocked', 'abandoned')),
            attempts INTEGER NOT NULL DEFAULT 0, lease_until INTEGER, response TEXT,
            owner_pid INTEGER, tool_pid INTEGER,
            UNIQUE (caller, key),
            FOREIGN KEY (caller, key) REFERENCES requests (caller, key))""",
        "CREATE INDEX outbox_due ON outbox (state, lease_until)",
        # A person's decisions on unknown or blocked rows: an audit trail never rewritten.
        """CREATE TABLE resolutions (
            id INTEGER PRIMARY KEY, caller TEXT NOT NULL, key TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            decision TEXT NOT NULL CHECK (decision IN ('done', 'retry', 'abandon')),
            decided_by TEXT NOT NULL, reason TEXT NOT NULL, evidence TEXT,
            FOREIGN KEY (caller, key) REFERENCES requests (caller, key))""",
        "CREATE INDEX resolutions_by_request ON resolutions (caller, key)",
        "CREATE TRIGGER resolutions_never_updated BEFORE UPDATE ON resolutions"
        " BEGIN SELECT RAISE(ABORT, 'a recorded decision is never rewritten'); END",
        "CREATE TRIGGER resolutions_never_deleted BEFORE DELETE ON resolutions"
        " BEGIN SELECT RAISE(ABORT, 'a recorded decision is never rewritten'); END",
        # INSERT OR REPLACE deletes without firing DELETE triggers: refuse a taken id too.
        "CREATE TRIGGER resolutions_never_replaced BEFORE INSERT ON resolutions"
        " WHEN EXISTS (SELECT 1 FROM resolutions WHERE id = NEW.id)"
        " BEGIN SELECT RAISE(ABORT, 'a recorded decision is never rewritten'); END",
    ),
    RECEIVER: (
        "CREATE TABLE tickets (id INTEGER PRIMARY KEY, caller TEXT NOT NULL,"
        " key TEXT NOT NULL, digest TEXT NOT NULL, payload TEXT NOT NULL)",
        # 第一篇 §3: the request ID, the digest of its canonical parameters, and the result a
        # replay returns (its ticket); tick is when it was written, for purge().
        """CREATE TABLE receipts (
            caller TEXT NOT NULL, key TEXT NOT NULL, digest TEXT NOT NULL,
            ticket_id INTEGER NOT NULL REFERENCES tickets (id),
            tick INTEGER NOT NULL,
            PRIMARY KEY (caller, key)) WITHOUT ROWID""",
        # Beyond 第一篇: receipts older than low_water may be gone; requests issued earlier refused.
        "CREATE TABLE retention (id INTEGER PRIMARY KEY CHECK (id = 1),"
        " low_water INTEGER NOT NULL)",
        "INSERT INTO retention VALUES (1, 0)",
    ),
    EXTERNAL: (
        "CREATE TABLE tickets (id INTEGER PRIMARY KEY, caller TEXT NOT NULL,"
        " key TEXT NOT NULL, digest TEXT NOT NULL, payload TEXT NOT NULL)",
        # The tool's own search by reference, the way a ticketing API can be queried.
        "CREATE INDEX tickets_by_reference ON tickets (caller, key)",
    ),
}


class Conflict(Exception):
    """The same (caller, key) already stands for a different intent (第一篇 §2, §5)."""


class Expired(Exception):
    """The key's receipt may have been purged: refused; a new key is a new decision."""


class CorruptRecord(Exception):
    """A stored record cannot be trusted; nothing new was done on its strength."""


# --- 第一篇 §2: the intent is written first -------------------------------------------------

def enqueue(connection, caller, key, payload, *, now, mode="idempotent"):
    """第一篇 §2: persist the intent and its outbox row in one transaction, once per key.  "accepted",
    or "duplicate" for the same intent again (nothing added); the same key with another payload or
    mode raises Conflict.  ``now`` is the intent's issue tick, which every delivery carries to the
    receiver."""
    check_identity(caller, key)
    text, digest = canonical(payload)
    check_ticks(0, now)
    if type(mode) is not str or mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    with transaction(connection):
        old = connection.execute("SELECT mode, digest FROM requests WHERE caller = ? AND key = ?",
                                 (caller, key)).fetchone()
        if old:
            if old != (mode, digest):
                raise Conflict(f"key {key!r} of caller {caller!r} was enqueued with another"
                               " intent")
            return "duplicate"
        connection.execute("INSERT INTO requests VALUES (?, ?, ?, ?, ?, ?)",
                           (caller, key, mode, digest, text, now))
        connection.execute("INSERT INTO outbox (caller, key, state) VALUES (?, ?, 'pending')",
                           (caller, key))
        # Neither row survives: the caller must resubmit.
        crash_point("before_intent_commit")
    # Both rows survive, and the caller never heard "accepted".
    crash_point("after_intent_commit")
    return "accepted"


# --- 第一篇 §3: the receipt and the ticket in one transaction -------------------------------

# twin: identical in preconditions.py.  The article's wrapper, line for line.
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


def receive(connection, caller, key, payload, *, issued_at, now):
    """第一篇 §3: one ticket per (caller, key), however often the request arrives: the receipt check,
    the ticket and its receipt share one BEGIN IMMEDIATE transaction (see _replayed)."""
    check_identity(caller, key)
    text, digest = canonical(payload)
    check_ticks(issued_at, now)
    with transaction(connection):
        ticket = _replayed(connection, caller, key, text, digest, issued_at)
        if ticket is not None:
            return {"caller": caller, "key": key, "digest": digest, "ticket_id": ticket}
        ticket = connection.execute("INSERT INTO tickets (caller, key, digest, payload)"
                                    " VALUES (?, ?, ?, ?)", (caller, key, digest, text)).lastrowid
        connection.execute("INSERT INTO receipts VALUES (?, ?, ?, ?, ?)",
                           (caller, key, digest, ticket, now))
        crash_point("before_receiver_commit")
    crash_point("after_receiver_commit")
    return {"caller": caller, "key": key, "digest": digest, "ticket_id": ticket}


def _replayed(connection, caller, key, text, digest, issued_at):
    """The ticket the receipt of (caller, key) names, or None; Conflict for another payload,
    CorruptRecord where receipt and ticket disagree, Expired where purge() may have taken it.
    SQLite compares what is stored: no stored text is decoded here."""
    low_water, ticket, intact, same, holds = connection.execute(
        "SELECT w.low_water, r.ticket_id, t.caller IS r.caller AND t.key IS r.key AND t.digest"
        " IS r.digest, r.digest IS ?, t.payload IS ? FROM retention w LEFT JOIN receipts r"
        " ON r.caller = ? AND r.key = ? LEFT JOIN tickets t ON t.id = r.ticket_id",
        (digest, text, caller, key)).fetchone()
    if ticket is None and issued_at < low_water:
        raise Expired(f"{caller!r}/{key!r} was issued at tick {issued_at}, before the low-water"
                      f" mark {low_water}: it may be a late replay of a purged receipt, so it is"
                      " refused")
    if ticket is not None and intact and not same:
        raise Conflict(f"key {key!r} of caller {caller!r} was used for a different payload")
    if ticket is not None and not (intact and holds):
        raise CorruptRecord(f"receipt {caller!r}/{key!r} disagrees with its ticket")
    return ticket


# --- 第一篇 §4: delivery by a real child process --------------------------------------------

def dispatch(connection, root, now, *, start=None, timeout=CHILD_TIMEOUT):
    """第一篇 §4: claim one due row (§5), call its tool in a child, record what can be proven.  No
    database lock is held while the child runs.  Returns deliver()'s summary, or None when nothing
    is due."""
    row = claim(connection, now)
    if row is None:
        return None
    # Claimed and leased, nothing sent.
    crash_point("after_claim")
    return deliver(connection, root, row, start=start, timeout=timeout)


def deliver(connection, root, row, *, start=None, timeout=CHILD_TIMEOUT):
    """第一篇 §4–§6: call the tool for a row claimed under ``row["attempt"]``; record the reply.
    Refused for good by the receiver: blocked.  A valid response: acknowledged, even if the child
    then exits non-zero (§4).  No valid answer from a tool without idempotency: unknown, never sent
    again automatically (§6).  Otherwise the row stays in flight until its lease ends (§5).
    Returns what happened, in "status": those four, or "stale" where another attempt holds the row,
    or "not sent" (see _record_tool)."""
    caller, key, attempt = row["caller"], row["key"], row["attempt"]
    external = row["mode"] == "external"
    on_start = functools.partial(_record_tool, connection, row) if external else None
    reply = call_tool(root, row, start=start, timeout=timeout, on_start=on_start)
    summary = {"caller": caller, "key": key, "attempt": attempt, "exit_code": reply.exit_code,
               "response": reply.response, "acknowledged": False}
    if not reply.sent:
        return dict(summary, status="not sent")
    # The reply is here, not yet recorded.
    crash_point("after_response_before_ack")
    if _refused_for_good(reply.response):
        return dict(summary, status=_end_attempt(connection, row, "blocked", reply.response))
    if _answers(reply.response, row):
        if not acknowledge(connection, caller, key, attempt, reply.response):
            return dict(summary, status="stale")
        # Done is durable.
        crash_point("after_ack")
        return dict(summary, acknowledged=True, status="done")
    if external:
        return dict(summary, response=None, status=_end_attempt(connection, row, "unknown"))
    return dict(summary, response=None, status="inflight")


# What call_tool() returns: the tool's reply (None: no valid JSON object line), the child's
# exit code (None: killed unasked or at the time-out), and whether the request was sent.
Reply = collections.namedtuple("Reply", "response exit_code sent")


def call_tool(root, row, *, start=None, timeout=CHILD_TIMEOUT, on_start=None):
    """第一篇 §4: run the row's tool in a child and return its Reply.  Request and reply cross the
    pipes as UTF-8 bytes whatever the locale.  ``start(argv)`` launches ``reliability.py argv...``
    (the tool, its database, the boundary this process is armed at) with piped stdin and stdout
    (default: start_child); ``on_start(pid)`` runs before the request is sent, and if it returns
    False the child is killed unasked.  A child that outlives ``timeout`` is killed and reaped."""
    # Only senders spawn: tool children start faster without subprocess.
    import subprocess
    tool = "external" if row["mode"] == "external" else "receive"
    # The request is made first: if it cannot be, no child is started.
    request = _dumps({"caller": row["caller"], "key": row["key"], "payload": row["payload"],
                      "issued_at": row["issued_at"], "now": row["now"]}).encode("utf-8") + b"\n"
    database = os.path.join(root, EXTERNAL if tool == "external" else RECEIVER)
    # A process armed at a boundary passes it on to the tool process it starts.
    child = (start or start_child)([tool, database] + ([CRASH_AT] if CRASH_AT else []))
    reply = Reply(None, None, False)
    try:
        if on_start is None or on_start(child.pid):
            reply = Reply(None, None, True)
            output, _ = child.communicate(request, timeout=timeout)
            reply = Reply(_first_object(output), child.returncode, True)
    except subprocess.TimeoutExpired:
        pass
    finally:
        # Refused, timed out or interrupted: never left running.
        if reply.exit_code is None:
            child.kill()
            child.communicate()
    return reply


def start_child(argv):
    """``python3 -I -S reliability.py argv...`` with binary pipes: isolated, no site packages.  The
    child runs in a session of its own, so a Ctrl-C at the terminal reaches only the process that
    started it, which kills and reaps it (call_tool does, whatever ends it)."""
    import subprocess
    return subprocess.Popen([_interpreter(), "-I", "-S", os.path.abspath(__file__), *argv],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)


def _interpreter():
    """The Python a child runs: sys.executable; where that is empty (python3 found by a shell
    that exports no PATH, as in ``env -i bash``), this installation's pythonX.Y if the kernel
    says it is the very program running (Linux /proc).  Otherwise an OSError naming the cause."""
    if sys.executable and os.access(sys.executable, os.X_OK):
        return sys.executable
    mine = os.path.join(sys.exec_prefix, "bin", "python%d.%d" % sys.version_info[:2])
    # Missing, or /proc hidden: no proof, so no guess.
    with contextlib.suppress(OSError):
        if os.path.samefile(mine, "/proc/self/exe"):
            return mine
    found = f"{sys.executable!r}, not executable" if sys.executable else "empty"
    raise FileNotFoundError(errno.ENOENT, "the Python interpreter is unknown (sys.executable is"
                            f" {found}): run python3 by its full path, or export PATH")


def _record_tool(connection, row, pid):
    """Before an external request leaves: the tool's pid, committed for reconcile(), only while the
    row is still in flight under this attempt with no tool recorded; False sends nothing."""
    with transaction(connection):
        return connection.execute(
            "UPDATE outbox SET tool_pid = ? WHERE caller = ? AND key = ? AND state = 'inflight'"
            " AND attempts = ? AND tool_pid IS NULL",
            (pid, row["caller"], row["key"], row["attempt"])).rowcount == 1


def _refused_for_good(response):
    """The receiver's refusal (§3): Conflict, Expired or CorruptRecord, as serve answers them."""
    return type(response) is dict and response.get("error") in ("conflict", "expired", "corrupt")


def _answers(response, row):
    """Whether ``response`` is a valid answer to the row's request (check_response)."""
    try:
        check_response(response, row["caller"], row["key"], row["digest"])
    except ValueError:
        return False
    return True


def _first_object(output):
    """The first line of a child's output as a JSON object, or None."""
    try:
        value = json.loads(output.split(b"\n", 1)[0].decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return value if type(value) is dict else None


# --- 第一篇 §5: atomic claims with attempt numbers ------------------------------------------

def claim(connection, now):
    """第一篇 §5: atomically take the oldest due row (issued by ``now``, pending or in flight past its
    lease): attempt + 1, leased to now + LEASE_TICKS; of racing claimers one wins.  Rows that may
    not be sent are parked on the way, with their reason (see _sendable)."""
    check_ticks(0, now)
    with transaction(connection):
        row = _sendable(connection, now)
        if row is None:
            return None
        # The owner's pid: reconcile() takes absence as proof only once it is gone.
        connection.execute("UPDATE outbox SET state = 'inflight', attempts = attempts + 1,"
                           " lease_until = ?, owner_pid = ?, tool_pid = NULL WHERE id = ?",
                           (now + LEASE_TICKS, os.getpid(), row.pop("id")))
        return dict(row, attempt=row.pop("attempts") + 1, now=now)


def _sendable(connection, now):
    """The oldest due row that may be sent, as claim() returns it, or None.  On the way, in
    claim()'s transaction: an external row whose lease ended becomes unknown (§6: its attempt may
    have reached the tool), and a row unanswered MAX_ATTEMPTS times since a person last decided, or
    not what enqueue() stores, is blocked with its reason."""
    while True:
        found = _oldest_due(connection, now)
        if found is None:
            return None
        number, state, mode, used, row, fault = found
        if state == "inflight" and mode == "external":
            parked = "unknown", None
        elif fault is not None:
            parked = "blocked", {"error": f"corrupt intent: {fault}"}
        elif used >= MAX_ATTEMPTS:
            parked = "blocked", {"error": f"no valid answer after {used} attempts"}
        else:
            return dict(row, id=number)
        connection.execute("UPDATE outbox SET state = ?, response = coalesce(?, response)"
                           " WHERE id = ?", (parked[0], parked[1] and _dumps(parked[1]), number))


def _oldest_due(connection, now):
    """(id, state, mode, attempts since a person last decided, the row as claim() returns it, what
    is wrong with it) of the oldest due row, or None.  The row is None and the fault a reason where
    it is not what enqueue() stores; stored text is read as bytes, so that what another program
    wrote cannot raise here."""
    found = connection.execute(
        "SELECT o.id, o.state, o.attempts - coalesce((SELECT max(attempt) FROM resolutions s"
        " WHERE s.caller = o.caller AND s.key = o.key), 0), (typeof(o.caller), typeof(o.key),"
        " typeof(r.digest), typeof(r.payload)) = ('text', 'text', 'text', 'text'), o.attempts,"
        " r.issued_at, r.mode, CAST(o.caller AS BLOB), CAST(o.key AS BLOB), CAST(r.digest AS"
        " BLOB), CAST(r.payload AS BLOB) FROM outbox o JOIN requests r ON r.caller = o.caller"
        " AND r.key = o.key WHERE (o.state = 'pending' OR o.state = 'inflight'"
        " AND o.lease_until <= ?) AND (r.issued_at <= ? OR typeof(r.issued_at) <> 'integer')"
        " ORDER BY o.id LIMIT 1", (now, now)).fetchone()
    if found is None:
        return None
    number, state, used, texts, attempts, issued_at, mode = found[:7]
    try:
        if not texts:
            raise ValueError("caller, key, digest and payload must be stored as text")
        caller, key, digest, text = (value.decode("utf-8") for value in found[7:])
        check_identity(caller, key)
        check_ticks(issued_at, issued_at)
        if type(attempts) is not int or not 0 <= attempts < MAX_TICK:
            raise ValueError(f"attempts must be an int from 0 to {MAX_TICK - 1}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        payload = json.loads(text)
        if canonical(payload) != (text, digest):
            raise ValueError("not the text, payload and digest enqueue() stores")
    except (ValueError, TypeError, RecursionError) as error:
        return number, state, mode, used, None, str(error) or type(error).__name__
    row = {"caller": caller, "key": key, "mode": mode, "digest": digest, "payload": payload,
           "issued_at": issued_at, "attempts": attempts}
    return number, state, mode, used, row, None


def acknowledge(connection, caller, key, attempt, response):
    """第一篇 §5: record a validated response as done, only for the attempt holding the row: True
    (again if asked again), or False for any other attempt; ValueError for a response that does not
    answer the request."""
    check_identity(caller, key)
    if type(attempt) is not int or not 0 < attempt <= MAX_TICK:
        raise ValueError(f"attempt must be an int from 1 to {MAX_TICK}, not {attempt!r}")
    check_response(response, caller, key)
    with transaction(connection):
        digest = connection.execute("SELECT digest FROM requests WHERE caller = ? AND key = ?",
                                    (caller, key)).fetchone()
        if digest is None:
            raise ValueError(f"no request {caller!r}/{key!r}")
        check_response(response, caller, key, digest[0])
        return connection.execute(
            "UPDATE outbox SET state = 'done', response = ? WHERE caller = ? AND key = ?"
            " AND attempts = ? AND (state = 'inflight' OR state = 'done' AND response IS ?)",
            (_dumps(response), caller, key, attempt, _dumps(response))).rowcount == 1


def check_response(response, caller, key, digest=None):
    """第一篇 §4: a response answers a request only with its caller, key, digest (when given)
    and a positive int ticket id."""
    if type(response) is not dict or set(response) != {"caller", "key", "digest", "ticket_id"}:
        raise ValueError("a response is a JSON object with exactly caller, key, digest and"
                         " ticket_id")
    digest = response["digest"] if digest is None else digest
    if (response["caller"], response["key"], response["digest"]) != (caller, key, digest):
        raise ValueError(f"response answers a different request: this one is {caller!r}/{key!r},"
                         f" digest {digest}")
    if type(response["ticket_id"]) is not int or response["ticket_id"] < 1:
        raise ValueError("response ticket_id must be a positive int")


# --- 第一篇 §6: a tool that keeps no receipts -----------------------------------------------

def external_create_ticket(connection, caller, key, payload):
    """第一篇 §6: the synthetic external tool: a new ticket on every call, no receipt."""
    check_identity(caller, key)
    text, digest = canonical(payload)
    crash_point("before_external_effect")
    with transaction(connection):
        ticket = connection.execute("INSERT INTO tickets (caller, key, digest, payload)"
                                    " VALUES (?, ?, ?, ?)", (caller, key, digest, text)).lastrowid
    crash_point("after_external_effect")
    return {"caller": caller, "key": key, "digest": digest, "ticket_id": ticket}


# --- beyond 第一篇: leaving unknown, and receipts that are not kept forever -----------------

def lookup_external(connection, caller, key):
    """The external tool's own search by reference: its tickets for (caller, key), oldest first."""
    return [{"caller": caller, "key": key, "digest": digest, "ticket_id": ticket}
            for ticket, digest in connection.execute(
                "SELECT id, digest FROM tickets WHERE caller = ? AND key = ? ORDER BY id",
                (caller, key))]


def reconcile(connection, tool, caller, key, now):
    """Settle an unknown row from the tool's records (``tool``: an open external.db connection).
    One matching ticket makes the row done with it.  No ticket sends the row back to pending only
    once the unanswered attempt can no longer act: its lease has ended, and the processes that held
    it (sender and tool child, same machine) are gone; this process counts as gone (it acts only
    through a tool child, recorded before it is asked).  Anything less certain leaves it unknown.
    Returns a dict whose "status" is the row's state."""
    check_identity(caller, key)
    check_ticks(0, now)
    row = connection.execute(
        "SELECT o.state, o.attempts, o.lease_until, o.owner_pid, o.tool_pid, r.digest"
        " FROM outbox o JOIN requests r ON r.caller = o.caller AND r.key = o.key"
        " WHERE o.caller = ? AND o.key = ?", (caller, key)).fetchone()
    if row is None:
        raise ValueError(f"no request {caller!r}/{key!r}")
    state, attempt, lease_until, owner_pid, tool_pid, digest = row
    if state != "unknown":
        return {"status": state, "reason": "not unknown: nothing to reconcile"}
    # Decided before the lookup: once nobody can act, an absent ticket stays absent.  This
    # process acts for an attempt only through its tool child, whose pid is recorded first.
    others = [pid for pid in (owner_pid, tool_pid) if pid and pid != os.getpid()]
    can_act = now < (lease_until or 0) or any(map(_alive, others))
    found = lookup_external(tool, caller, key)
    if len(found) == 1 and found[0]["digest"] == digest:
        return _settle(connection, caller, key, attempt, "done", _dumps(found[0]),
                       {"status": "done", "response": found[0]})
    if found:
        return {"status": "unknown",
                "reason": f"the tool holds {len(found)} ticket(s) that do not settle it"}
    if can_act:
        return {"status": "unknown",
                "reason": "no ticket yet, but the unanswered attempt may still act"}
    return _settle(connection, caller, key, attempt, "pending", None,
                   {"status": "pending", "reason": "proven absent: retry under the same key"})


def resolve(connection, caller, key, decision, *, attempt, by, why, evidence=None):
    """Record a person's decision on an unknown or blocked row, with its audit row, atomically.
    ``decision``: "done" (``evidence`` must be the tool's response for this request), "retry" (back
    to pending under the same key, with MAX_ATTEMPTS attempts again) or "abandon".  ``attempt`` is
    the row's attempt the person looked at: once a claim has taken the row since, the decision is
    refused (the row moved on), so that a decision asked again after a lost reply never becomes a
    second one.  The same call again, while the row is as that decision left it, answers it again
    without a second audit row.  Refusals raise ValueError; the audit row is never rewritten."""
    check_identity(caller, key)
    if decision not in ("done", "retry", "abandon"):
        raise ValueError("decision must be one of done, retry, abandon")
    if type(attempt) is not int or not 0 <= attempt <= MAX_TICK:
        raise ValueError(f"attempt must be an int from 0 to {MAX_TICK}, not {attempt!r}")
    for name, value in (("by", by), ("why", why)):
        if type(value) is not str or not value.strip() or len(value) > 1000:
            raise ValueError(f"{name} must be a non-empty str of at most 1000 characters")
    if (evidence is None) == (decision == "done"):
        raise ValueError("evidence is required for done, and only for done")
    given = None if evidence is None else _dumps(evidence)
    new_state = {"done": "done", "retry": "pending", "abandon": "abandoned"}[decision]
    with transaction(connection):
        row = connection.execute(
            "SELECT o.state, o.attempts, r.digest FROM outbox o JOIN requests r"
            " ON r.caller = o.caller AND r.key = o.key WHERE o.caller = ? AND o.key = ?",
            (caller, key)).fetchone()
        if row is None:
            raise ValueError(f"no request {caller!r}/{key!r}")
        state, current, digest = row
        if attempt > current:
            raise ValueError(f"attempt {attempt} of {caller!r}/{key!r} was never claimed: it is"
                             f" at attempt {current}")
        last = connection.execute(
            "SELECT id, attempt, decision, decided_by, reason, evidence FROM resolutions"
            " WHERE caller = ? AND key = ? ORDER BY id DESC LIMIT 1", (caller, key)).fetchone()
        # This very decision, already recorded at this attempt: its reply was lost.
        if current == attempt and last is not None and last[1:] == (attempt, decision, by, why,
                                                                    given):
            if state != new_state:
                raise ValueError(f"the row moved on since this decision was recorded; it is"
                                 f" {state} now")
            return {"status": new_state, "resolution": last[0]}
        if current != attempt:
            raise ValueError(f"the row moved on: a claim took it since the attempt decided on;"
                             f" {caller!r}/{key!r} is at attempt {current} now, not {attempt}")
        if state not in ("unknown", "blocked"):
            raise ValueError(f"only an unknown or blocked row is resolved by hand; this one is"
                             f" {state}")
        if evidence is not None:
            check_response(evidence, caller, key, digest)
        connection.execute("UPDATE outbox SET state = ?, response = ?, owner_pid = NULL,"
                           " tool_pid = NULL WHERE caller = ? AND key = ?",
                           (new_state, given, caller, key))
        # The attempt it was decided at: claim() counts MAX_ATTEMPTS from here.
        audit = connection.execute(
            "INSERT INTO resolutions (caller, key, attempt, decision, decided_by, reason,"
            " evidence) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (caller, key, attempt, decision, by, why, given)).lastrowid
    return {"status": new_state, "resolution": audit}


def purge(connection, now, window):
    """Delete receipts written before ``now - window`` and raise the low-water mark to it.  Both in
    one transaction.  From then on receive() refuses, as Expired, a request issued before the mark
    that finds no receipt; the mark never moves backwards."""
    check_ticks(0, now)
    if type(window) is not int or not 0 < window <= MAX_TICK:
        raise ValueError(f"window must be an int number of ticks from 1 to {MAX_TICK},"
                         f" not {window!r}")
    mark = now - window
    if mark < 0:
        raise ValueError(f"now - window = {mark}: nothing is old enough to purge yet")
    with transaction(connection):
        low_water = connection.execute("SELECT low_water FROM retention").fetchone()[0]
        if mark < low_water:
            raise ValueError(f"the low-water mark is {low_water}; now - window = {mark} would"
                             " move it backwards")
        deleted = connection.execute("DELETE FROM receipts WHERE tick < ?", (mark,)).rowcount
        connection.execute("UPDATE retention SET low_water = ?", (mark,))
    return {"deleted": deleted, "low_water": mark}


def _end_attempt(connection, row, state, response=None):
    """The attempt's owner gives it up as ``state``, if the row is still in flight under it
    ("stale" otherwise): its tool child is reaped, so nobody can act for it any more (the pids
    reconcile() would wait for are cleared)."""
    with transaction(connection):
        ended = connection.execute(
            "UPDATE outbox SET state = ?, response = coalesce(?, response), owner_pid = NULL,"
            " tool_pid = NULL WHERE caller = ? AND key = ? AND state = 'inflight'"
            " AND attempts = ?", (state, None if response is None else _dumps(response),
                                  row["caller"], row["key"], row["attempt"])).rowcount
    return state if ended else "stale"


def _settle(connection, caller, key, attempt, state, response, answer):
    """reconcile()'s decision, made only while the row is still unknown under ``attempt``: a person
    (resolve) or another reconciler may have settled it meanwhile, and then this changes nothing
    and says what the row is now."""
    with transaction(connection):
        if connection.execute(
                "UPDATE outbox SET state = ?, response = ?, owner_pid = NULL, tool_pid = NULL"
                " WHERE caller = ? AND key = ? AND state = 'unknown' AND attempts = ?",
                (state, response, caller, key, attempt)).rowcount == 1:
            return answer
        now_in = connection.execute("SELECT state FROM outbox WHERE caller = ? AND key = ?",
                                    (caller, key)).fetchone()[0]
    return {"status": now_in, "reason": "settled by someone else meanwhile"}


def _alive(pid):
    try:
        # A reused pid counts as alive, the safe mistake; so does another user's (PermissionError).
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError) as error:
        return isinstance(error, PermissionError)
    return True


# --- helpers: the files, the canonical form, input checks -----------------------------------

def connect(path):
    """Open an existing sender.db, receiver.db or external.db (see _open); never creates a file."""
    return _open(path, tuple(KINDS.values()))


def init(root):
    """Create sender.db, receiver.db and external.db under ``root``, all or none; never over an
    existing file (FileExistsError).  Killed midway, it may leave a file connect() refuses (it has
    no kind): remove it, then init again."""
    os.makedirs(root, exist_ok=True)
    made = []
    try:
        for name, kind in KINDS.items():
            _create(os.path.join(root, name), kind, SCHEMAS[name])
            made.append(os.path.join(root, name))
    except BaseException:
        # Each was closed whole: no -wal or -shm is left beside it.
        for path in made:
            os.remove(path)
        raise


def snapshot(connection):
    """What one of our databases holds, read in one transaction: for observers, tests, a reader.
    sender.db: the number of intents, the outbox rows with their request's digest (what resolve()'s
    evidence must carry) and the response recorded, the rows parked for a person (unknown or
    blocked) with the reason, and the audit rows; receiver.db: the number of tickets, the receipts
    and the low-water mark; external.db: its tickets, each in the form of the tool's response.
    Meant for small databases."""
    # Inside a caller's transaction, read within it.
    own = not connection.in_transaction
    if own:
        connection.execute("BEGIN")
    try:
        rows = lambda sql, *names: [dict(zip(names, row)) for row in connection.execute(sql)]
        one = lambda sql: connection.execute(sql).fetchone()[0]
        kind = one("PRAGMA application_id")
        if kind == KINDS[SENDER]:
            # Read as bytes, so that a row another program damaged is still shown.
            outbox = rows("SELECT CAST(o.caller AS BLOB), CAST(o.key AS BLOB), CAST(r.mode AS"
                          " BLOB), o.state, o.attempts, o.lease_until, CAST(r.digest AS BLOB),"
                          " CAST(o.response AS BLOB)"
                          " FROM outbox o JOIN requests r ON r.caller = o.caller AND r.key ="
                          " o.key ORDER BY o.id", "caller", "key", "mode", "state", "attempts",
                          "lease_until", "digest", "response")
            for row in outbox:
                row.update({name: _shown(row[name]) for name in ("caller", "key", "mode",
                                                                 "digest")},
                           response=_stored_json(row["response"]))
            audit = rows("SELECT caller, key, attempt, decision, decided_by, reason, evidence"
                         " FROM resolutions ORDER BY id", "caller", "key", "attempt", "decision",
                         "decided_by", "reason", "evidence")
            for row in audit:
                row["evidence"] = _stored_json(row["evidence"])
            parked = [{"caller": row["caller"], "key": row["key"], "state": row["state"],
                       "reason": _parked_because(row)} for row in outbox
                      if row["state"] in ("unknown", "blocked")]
            return {"intent_rows": one("SELECT count(*) FROM requests"), "outbox": outbox,
                    "parked": parked, "resolutions": audit}
        if kind == KINDS[RECEIVER]:
            return {"tickets": one("SELECT count(*) FROM tickets"),
                    "low_water": one("SELECT low_water FROM retention"),
                    "receipts": rows("SELECT caller, key, digest, ticket_id, tick FROM receipts"
                                     " ORDER BY tick, ticket_id", "caller", "key", "digest",
                                     "ticket_id", "tick")}
        return {"tickets": rows("SELECT caller, key, digest, id FROM tickets ORDER BY id",
                                "caller", "key", "digest", "ticket_id")}
    finally:
        if own:
            connection.execute("COMMIT")


def _parked_because(row):
    """Why an unknown or blocked row waits for a person, from what its state and response say."""
    if row["state"] == "unknown":
        return ("no valid answer from a tool without receipts, which may have acted: never sent"
                " again automatically (reconcile, or resolve by hand)")
    refusal = row["response"] if type(row["response"]) is dict else {}
    reason = " ".join(str(refusal.get(name, "")) for name in ("error", "message")).strip()
    return reason or "blocked"


def _shown(data):
    """Stored bytes as text, with backslash escapes where they are not UTF-8."""
    return None if data is None else data.decode("utf-8", "backslashreplace")


def _stored_json(data):
    """Stored JSON as what it holds, or as the text it is where it does not parse."""
    if data is None:
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return _shown(data) if type(data) is bytes else data


def canonical(payload):
    """第一篇 §3: (text, SHA-256 digest) of a JSON object: sorted keys, compact, UTF-8.  Exact JSON
    types only, at most MAX_PAYLOAD_DEPTH deep and MAX_PAYLOAD_BYTES long, or it raises; each value
    is charged its fewest bytes wherever it appears, so sharing hides no size."""
    if type(payload) is not dict:
        raise TypeError(f"payload must be a dict, not {type(payload).__name__}")
    level, depth, budget = [payload], 1, MAX_PAYLOAD_BYTES
    while level:
        inner = []
        for value in level:
            # Charged before what it holds is taken in: the walk stays within the budget too.
            budget -= _least_bytes(value)
            if budget < 0 or depth == MAX_PAYLOAD_DEPTH and type(value) in (dict, list) and value:
                raise ValueError(f"payload nests over {MAX_PAYLOAD_DEPTH} deep or exceeds"
                                 f" {MAX_PAYLOAD_BYTES} bytes")
            if type(value) is dict:
                inner += value.values()
            elif type(value) is list:
                inner += value
        level, depth = inner, depth + 1
    # A lone surrogate raises UnicodeEncodeError (a ValueError) here.
    data = _dumps(payload).encode("utf-8")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload exceeds {MAX_PAYLOAD_BYTES} bytes in canonical form")
    return data.decode("utf-8"), hashlib.sha256(data).hexdigest()


def _least_bytes(value):
    """The fewest bytes a value takes in canonical form, what it holds aside; TypeError for
    anything but an exact JSON type, NaN and infinities included."""
    kind = type(value)
    if kind in (str, list):
        return len(value) + (2 if kind is str else 1)
    if kind is int:
        # At most 4300 digits, what CPython 3.11+ reads by default (counted only past 2**14284).
        if value.bit_length() > 14284 and abs(value) >= 10 ** 4300:
            raise ValueError("payload holds an int of more than 4300 digits")
        return 1 + value.bit_length() // 5
    if kind is dict and all(type(name) is str for name in value):
        return 1 + sum(map(len, value)) + 3 * len(value)
    if kind in (bool, type(None)) or kind is float and value - value == 0:
        return 1
    raise TypeError(f"payload is not exact JSON: a {kind.__name__} that is NaN, has a key not"
                    " str or is no JSON type")


def check_identity(caller, key):
    """Caller and request key: non-empty strings of bounded length, valid UTF-8."""
    for name, value in (("caller", caller), ("key", key)):
        if type(value) is not str:
            raise TypeError(f"{name} must be a str, not {type(value).__name__}")
        if not 0 < len(value) <= MAX_IDENTITY_LENGTH:
            raise ValueError(f"{name} must have 1 to {MAX_IDENTITY_LENGTH} characters")
        value.encode("utf-8")


# --- twin definitions: identical in reliability.py and preconditions.py ---------------------
# (test_the_twin_definitions_are_identical compares them; change both or neither)

# Sorted keys, compact, UTF-8 text, no NaN or Infinity: the canonical form digests are taken of.
_dumps = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode


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


# --- DELIBERATELY UNSAFE baselines: the experiments' counterexamples, never called above ----

def unsafe_receive_without_receipt(connection, caller, key, payload):
    """UNSAFE (第一篇 §4): a receiver that keeps no receipt: a replay after a lost reply
    duplicates."""
    check_identity(caller, key)
    text, digest = canonical(payload)
    with transaction(connection):
        ticket = connection.execute("INSERT INTO tickets (caller, key, digest, payload)"
                                    " VALUES (?, ?, ?, ?)", (caller, key, digest, text)).lastrowid
        crash_point("before_receiver_commit")
    crash_point("after_receiver_commit")
    return {"caller": caller, "key": key, "digest": digest, "ticket_id": ticket}


def unsafe_dispatch_mark_before(connection, root, now, *, start=None, timeout=CHILD_TIMEOUT):
    """UNSAFE (第一篇 开头): records done before sending, so a crash in between loses the task."""
    row = claim(connection, now)
    if row is None:
        return None
    _end_attempt(connection, row, "done")
    crash_point("after_mark_before_send")
    reply = call_tool(root, row, start=start, timeout=timeout)
    return {"caller": row["caller"], "key": row["key"], "attempt": row["attempt"],
            "exit_code": reply.exit_code, "response": reply.response, "acknowledged": False,
            "status": "done", "note": "UNSAFE: recorded as done before it was sent"}


def unsafe_delete_receipts(connection, before_tick):
    """UNSAFE (第一篇 §7): deletes old receipts without a low-water mark: a late replay acts again."""
    with transaction(connection):
        return connection.execute("DELETE FROM receipts WHERE tick < ?", (before_tick,)).rowcount


def unsafe_retry_unknown(connection, root, caller, key, *, start=None, timeout=CHILD_TIMEOUT):
    """UNSAFE (第一篇 §6): calls the external tool again for an unknown row, ignoring the policy."""
    mode, digest, text, issued_at = connection.execute(
        "SELECT mode, digest, payload, issued_at FROM requests WHERE caller = ? AND key = ?",
        (caller, key)).fetchone()
    row = {"caller": caller, "key": key, "attempt": 0, "mode": mode, "digest": digest,
           "payload": json.loads(text), "issued_at": issued_at, "now": issued_at}
    return call_tool(root, row, start=start, timeout=timeout)


# --- crash boundaries (第一篇 §4) -----------------------------------------------------------

# The boundary at which this process dies, or None: set by whoever arms the process (the
# experiment's driver; in a tool child, the boundary its sender passed on).
CRASH_AT = None


def crash_point(name):
    if name == CRASH_AT:
        # Unbuffered: said, then gone; no finally, no flush, no COMMIT, a real process death.
        os.write(2, f"reliability.py: died at {name} (exit {CRASH_EXIT})\n".encode())
        os._exit(CRASH_EXIT)


# --- the tool child (第一篇 §4): the one process this module starts --------------------------

def serve(act, database):
    """第一篇 §4: a tool child's work: one request line from stdin, ``act(connection, request)`` on
    ``database``, its reply as one JSON line on stdout, UTF-8 bytes whatever the locale.  A refusal
    for good is a reply too, so that the sender blocks the row at once.  The exit status: 0
    answered, 1 no request (the sender went away before asking)."""
    line = sys.stdin.buffer.readline()
    if not line:
        return 1
    request = json.loads(line.decode("utf-8"))
    with contextlib.closing(connect(database)) as connection:
        try:
            reply = act(connection, request)
        except (Conflict, Expired, CorruptRecord) as error:
            refusal = {Conflict: "conflict", Expired: "expired"}.get(type(error), "corrupt")
            reply = {"error": refusal, "message": str(error)}
    sys.stdout.buffer.write(_dumps(reply).encode("utf-8") + b"\n")
    sys.stdout.buffer.flush()
    # The complete reply is in the pipe.
    crash_point("after_response_write")
    return 0


# Each tool a child serves, as act(connection, request).
TOOLS = {"receive": lambda c, r: receive(c, r["caller"], r["key"], r["payload"],
                                         issued_at=r["issued_at"], now=r["now"]),
         "external": lambda c, r: external_create_ticket(c, r["caller"], r["key"], r["payload"])}


def tool_child(argv):
    """``python3 reliability.py receive|external DATABASE [BOUNDARY]``: serve one request, armed at
    BOUNDARY.  Exit 0 answered, 1 failed (one line on stderr), 2 bad usage, CRASH_EXIT at the
    boundary, 130 stopped (Ctrl-C, SIGTERM or SIGHUP; one line on stderr)."""
    global CRASH_AT
    if len(argv) not in (2, 3) or argv[0] not in TOOLS:
        sys.stderr.write("usage: python3 reliability.py receive|external DATABASE [BOUNDARY]\n")
        return 2
    CRASH_AT = argv[2] if len(argv) == 3 else None
    try:
        return serve(TOOLS[argv[0]], argv[1])
    except BrokenPipeError:
        # The sender went away before it read the reply: nobody to tell.
        said = None
    except KeyboardInterrupt:
        said = "interrupted"
    except (OSError, ValueError, TypeError, KeyError, RecursionError, sqlite3.Error) as error:
        said = f"{type(error).__name__}: " + (" ".join(str(error).split()) or "failed")
    # A reply that broke off stays unsaid: the exit's own flush too.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    with contextlib.suppress(OSError, ValueError):
        if said:
            sys.stderr.write(f"reliability.py {argv[0]}: {said}\n")
    return 130 if said == "interrupted" else 1


if __name__ == "__main__":
    # At the command line each stop is Ctrl-C's, SIGINT even where a background start ignores
    # it; a SIGTERM or SIGHUP that is ignored (nohup) stays ignored.
    for _name in ("SIGINT", "SIGTERM", "SIGHUP"):
        _number = getattr(signal, _name, None)
        if _number and (_name == "SIGINT" or signal.getsignal(_number) is not signal.SIG_IGN):
            signal.signal(_number, signal.default_int_handler)
    sys.exit(tool_child(sys.argv[1:]))
