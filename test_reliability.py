"""Boundary tests for reliability.py, in the order of 第一篇「工具干完了，回执丢了怎么办？」.

Run with ``python3 test_reliability.py`` or ``python3 -X dev -W error -m unittest test_reliability``.
Every test works on real SQLite files in a fresh temporary directory; crashes are real
child processes that exit 73 at a named boundary.

How the suite runs its children: most are forked, as the driver forks them
(run_experiment.fork_start), and run the module's own command line, main(argv); a fork costs
a few milliseconds where a fresh interpreter costs about 30.  The rule that buys it: the
parent holds no SQLite connection to a file the child opens (SQLite's lock records would be
copied into the child), so tests close theirs first (ws.close()), and on Linux fork_start
checks the rule by inode through /proc/self/fd.  Fresh interpreters run only where the
interpreter itself is under test: each module's real entry point once per exit code, the
locale and strace tests, the five-file downloads, the copy kits, the walk-through, Ctrl-C.

Races are forced, not hoped for: race() releases its forked racers together at barriers the
test checks, its watchdog measures silence rather than work, and racers retry "database is
locked" (which wrote nothing), so a loaded machine makes a race slower, never failed.  Two
things only are simulated with unittest.mock, as the article says: a tool child that times
out, and a fork that fails half way through a batch.  The driver tests come last: results.json's
figures (run_experiment.py --check proves the live run equals it), the driver, the README.
"""
import os
import sys

if sys.version_info < (3, 9):  # one clear line (unittest would turn SystemExit into a traceback)
    sys.stderr.write("test_reliability.py needs Python 3.9 or newer; this is %s\n" % sys.version.split()[0])
    sys.stderr.flush()
    os._exit(2)

import ast
import contextlib
import errno
import functools
import hashlib
import importlib.util
import io
import itertools
import json
import random
import re
import select
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import time
import types
import unittest
from unittest import mock

import reliability
import run_experiment
from reliability import (CRASH_EXIT, EXTERNAL, KINDS, LEASE_TICKS, MAX_ATTEMPTS, MAX_PAYLOAD_BYTES, RECEIVER,
                         SENDER, Conflict, CorruptRecord, Expired)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.abspath(reliability.__file__)
WATCHDOG = 60.0  # seconds: only ends a hung child, never asserted as a measurement
PAYLOAD = {"title": "打印机卡纸", "priority": 2, "tags": ["office", "hardware"]}
OTHER_PAYLOAD = {"title": "打印机卡纸", "priority": 3, "tags": ["office", "hardware"]}
GARBAGE = bytes(range(256)) * 16  # deterministic, and not an SQLite header


# This run's interpreter flags (-X dev, -W error), for the fresh interpreters that run the driver.
SAME_FLAGS = (["-X", "dev"] if sys.flags.dev_mode else []) + [f"-W{option}" for option in sys.warnoptions]
# The article's download: these five files alone run it.
DOWNLOAD = ("reliability.py", "run_experiment.py", "results.json", "test_reliability.py", "README.md")


def fs_name(text, fallback):
    """``text`` if this process can name a file with it, else ``fallback`` (an ASCII locale without UTF-8 mode)."""
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        return fallback
    return text


# --- helpers ----------------------------------------------------------------------

TEMPLATE = {}  # the three databases made once by init(), copied per test (no fsyncs per test)


def setUpModule():
    TEMPLATE["dir"] = tempfile.TemporaryDirectory()
    reliability.init(TEMPLATE["dir"].name)


def tearDownModule():
    TEMPLATE.pop("dir").cleanup()


@contextlib.contextmanager
def workspace():
    """A fresh root with the three databases; ws.sender, ws.receiver and ws.external are
    connections opened on first use and closed on exit; ws.close() before a child opens their files."""
    with tempfile.TemporaryDirectory() as root, contextlib.ExitStack() as stack:
        for name in KINDS:
            shutil.copyfile(os.path.join(TEMPLATE["dir"].name, name), os.path.join(root, name))
        yield Workspace(root, stack)


class Workspace:
    FILES = {"sender": SENDER, "receiver": RECEIVER, "external": EXTERNAL}

    def __init__(self, root, stack):
        self.root, self._stack = root, stack

    def close(self, *names):
        """Close these connections (default: all) before forking a child that opens their files."""
        for name in names or self.FILES:
            if name in vars(self):
                vars(self).pop(name).close()

    def path(self, name):
        return os.path.join(self.root, self.FILES.get(name, name))

    def __getattr__(self, name):  # only called for a connection not opened yet
        if name not in self.FILES:
            raise AttributeError(name)
        connection = reliability.connect(self.path(name))
        self._stack.callback(connection.close)
        setattr(self, name, connection)
        return connection


@contextlib.contextmanager
def raw(path):
    """A plain sqlite3 connection (foreign keys off, autocommit) for tampering behind the module's back."""
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        yield connection
    finally:
        connection.close()


def enqueue(ws, key="k1", payload=PAYLOAD, *, now=0, mode="idempotent", caller="agent"):
    return reliability.enqueue(ws.sender, caller, key, payload, now=now, mode=mode)


def receive(ws, key="k1", payload=PAYLOAD, *, issued_at=0, now=0, caller="agent"):
    return reliability.receive(ws.receiver, caller, key, payload, issued_at=issued_at, now=now)


def receive_on(connection, key="k1", payload=PAYLOAD, *, issued_at=0, now=0):
    return reliability.receive(connection, "agent", key, payload, issued_at=issued_at, now=now)


def counts(ws):
    """Rows in every table that matters, or (tickets, receipts) of one receiver.db connection."""
    one = lambda connection, sql: connection.execute(sql).fetchone()[0]
    if isinstance(ws, sqlite3.Connection):
        return one(ws, "SELECT count(*) FROM tickets"), one(ws, "SELECT count(*) FROM receipts")
    return {"requests": one(ws.sender, "SELECT count(*) FROM requests"),
            "outbox": one(ws.sender, "SELECT count(*) FROM outbox"),
            "tickets": one(ws.receiver, "SELECT count(*) FROM tickets"),
            "receipts": one(ws.receiver, "SELECT count(*) FROM receipts"),
            "external": one(ws.external, "SELECT count(*) FROM tickets")}


EMPTY = {"requests": 0, "outbox": 0, "tickets": 0, "receipts": 0, "external": 0}


def outbox(ws, key="k1", caller="agent"):
    found = [row for row in reliability.snapshot(ws.sender)["outbox"] if (row["caller"], row["key"]) == (caller, key)]
    assert len(found) == 1, found
    return found[0]


def state(ws, key="k1"):
    row = outbox(ws, key)
    return row["state"], row["attempts"]


def rows(connection, table):
    """Every row, text that is not UTF-8 included (a tampered one), for before/after comparisons."""
    factory, connection.text_factory = connection.text_factory, lambda data: data.decode("utf-8", "surrogateescape")
    try:
        return connection.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
    finally:
        connection.text_factory = factory


def pids(ws, key="k1"):
    return ws.sender.execute("SELECT owner_pid, tool_pid FROM outbox WHERE caller = 'agent' AND key = ?",
                             (key,)).fetchone()


def set_pids(ws, owner_pid, tool_pid, key="k1"):
    # Through raw(): the precise pids a crashed sender and its tool child would leave.
    with raw(ws.path("sender")) as tamper:
        tamper.execute("UPDATE outbox SET owner_pid = ?, tool_pid = ? WHERE caller = 'agent' AND key = ?",
                       (owner_pid, tool_pid, key))


def set_state(ws, new_state, key="k1"):
    with raw(ws.path("sender")) as tamper:
        tamper.execute("UPDATE outbox SET state = ? WHERE caller = 'agent' AND key = ?", (new_state, key))


def audit(ws):
    return ws.sender.execute("SELECT id, caller, key, attempt, decision, decided_by, reason, evidence"
                             " FROM resolutions ORDER BY id").fetchall()


def sender_rows(ws):
    return rows(ws.sender, "requests"), rows(ws.sender, "outbox"), audit(ws)


def file_bytes(path):
    with open(path, "rb") as handle:
        return handle.read()


def write_file(path, data):
    with open(path, "wb") as handle:
        handle.write(data)


# A fresh interpreter whose text streams are not UTF-8, as an 8-bit locale makes them: the C locale
# with UTF-8 mode off, and latin-1 streams (-I would ignore PYTHONIOENCODING, so -S alone).
LEGACY = ["-S", "-X", "utf8=0"], dict({key: value for key, value in os.environ.items() if not key.startswith("PYTHON")},
                                      LC_ALL="C", LANG="C", PYTHONIOENCODING="latin-1")


def launcher(crash=None, started=None, legacy=False):
    """A start= hook for call_tool: a tool child running reliability.py's own CLI ``serve ...``,
    dying at ``crash``; each child is appended to ``started``.  It is forked, as the driver's
    children are (run_experiment.fork_start), or if ``legacy`` a fresh interpreter in the LEGACY locale."""
    def start(argv):
        argv = [*argv, *(["--crash", crash] if crash else [])]
        if not legacy:  # its crash line ("died at ...") is not this run's output: the cli() tests read it
            with open(os.devnull, "wb") as quiet:
                child = run_experiment.fork_start(reliability, argv, stderr=quiet.fileno())
        else:
            child = subprocess.Popen([sys.executable, *LEGACY[0], SCRIPT, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=LEGACY[1])
        if started is not None:
            started.append(child)
        return child
    return start


def cli(*argv, stdin=b""):
    """reliability.py's command line, main(argv), in a forked child; (exit code, stdout, stderr) as UTF-8."""
    code, out, err = run_experiment.fork_main(reliability, argv, stdin)
    return code, out.decode("utf-8"), err.decode("utf-8")


def answering(response):
    """A tool child that is a real forked process but answers ``response`` (a dict, or a function of
    the request) whatever it is asked: for answers a real tool would not give."""
    module = types.ModuleType("stand_in_tool")

    def main(argv):
        request = json.loads(sys.stdin.buffer.readline())
        answer = response(request) if callable(response) else response
        sys.stdout.buffer.write(json.dumps(answer).encode("utf-8") + b"\n")
        return 0
    module.main = main

    def start(argv):
        with open(os.devnull, "wb") as quiet:
            return run_experiment.fork_start(module, argv, stderr=quiet.fileno())
    return start


def unknown_external(ws, key="k1"):
    """A real unknown row: enqueued external at tick 0, claimed at 0 (lease until LEASE_TICKS), its
    tool child exits 73 before acting, so deliver() marks it unknown and clears both pids."""
    enqueue(ws, key, mode="external")
    ws.close("external")  # its tool child opens it
    result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher("before_external_effect"))
    assert (result["exit_code"], state(ws, key)) == (CRASH_EXIT, ("unknown", 1)), result
    assert pids(ws, key) == (None, None)


def race(body, n=8, may_die=False):
    """Run ``body(wait)`` in ``n`` forked processes; each wait() is a barrier that all n reach
    before any goes on, so the interleaving is forced, not hoped for.  Returns the n JSON results
    (None for a racer that SIGKILLed itself, which only ``may_die`` allows).

    The watchdog measures silence, not work: every barrier byte and every racer's end resets it,
    so a loaded machine makes a race slower, never failed.  The caller must hold no SQLite
    connection to a file the body opens.
    """
    ready_r, ready_w = os.pipe()
    fds, pids, children = {ready_r, ready_w}, set(), []
    try:
        for _ in range(n):
            out_r, out_w = os.pipe()
            go_r, go_w = os.pipe()  # its own: a fast racer cannot take a slow one's turn
            pid = os.fork()
            if pid == 0:  # never returns into the test runner
                code = 1
                try:
                    def wait():
                        os.write(ready_w, b"r")
                        if os.read(go_r, 1) != b"g":
                            raise RuntimeError("barrier broken")
                    try:
                        os.write(out_w, json.dumps(body(wait)).encode("utf-8"))
                        code = 0
                    except BaseException as error:  # what went wrong, for the assertion below
                        os.write(out_w, json.dumps({"racer failed": f"{type(error).__name__}: {error}"}).encode())
                    os.write(ready_w, b"d")  # done: progress, like a barrier byte
                finally:
                    os._exit(code)
            pids.add(pid)
            os.close(out_w)
            os.close(go_r)
            fds |= {out_r, go_w}
            children.append((pid, out_r, go_w))
        os.close(ready_w)
        fds.discard(ready_w)
        waiting = 0
        while True:
            if not select.select([ready_r], [], [], WATCHDOG)[0]:
                raise AssertionError(f"no racer moved for {WATCHDOG:g} s: one hangs")
            data = os.read(ready_r, 64)
            if not data:
                break  # every racer has ended
            waiting += data.count(b"r")
            if waiting == n:
                for _, _, go_w in children:
                    os.write(go_w, b"g")
                waiting = 0
        results = []
        for pid, out_r, _ in children:
            fds.discard(out_r)
            with os.fdopen(out_r, "rb") as pipe:
                output = pipe.read()
            pids.discard(pid)
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if may_die and code == -signal.SIGKILL:
                results.append(None)
                continue
            assert code == 0, f"racer exited {code}: {output.decode('utf-8', 'replace')}"
            results.append(json.loads(output.decode("utf-8")))
        return results
    finally:
        for pid in pids:  # only if something above failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for fd in fds:
            os.close(fd)


MANY_AGENTS, MANY_OPERATIONS, MANY_SEED = 3, 400, 7  # agents, connections by each, their choices


def _many_agents(database, folder, wait):
    """One of MANY_AGENTS agents: MANY_OPERATIONS times it opens ``database``, then receives a
    key others receive too (1 in 10) and notes the answer in its journal, or checkpoints (1 in
    20), or only reads, and closes.  Odd agents SIGKILL themselves in their second half, at a
    seeded moment: just opened, inside the transaction, or answered but not yet noted."""
    index, journal = _numbered(folder, "agent")
    rng = random.Random(f"{MANY_SEED}/{index}")
    death = (rng.randrange(MANY_OPERATIONS // 2, MANY_OPERATIONS),
             rng.choice(("opened", "writing", "answered"))) if index % 2 else None
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    with open(journal, "ab", buffering=0) as journal:
        wait()
        for operation in range(MANY_OPERATIONS):
            connection, work = reliability.connect(database), rng.random()
            try:
                if death == (operation, "opened"):
                    die()
                if work < 0.1 or death and death[0] == operation:
                    key = f"k{rng.randrange(MANY_OPERATIONS // 10)}"
                    if death == (operation, "writing"):
                        connection.set_progress_handler(die, rng.randint(1, 40))
                    answer = written(lambda: reliability.receive(
                        connection, "agent", key, {"key": key}, issued_at=0, now=0))
                    if death == (operation, "answered"):
                        die()
                    journal.write(json.dumps(answer).encode("utf-8") + b"\n")
                elif work < 0.15:
                    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                else:
                    connection.execute("SELECT count(*) FROM receipts").fetchone()
            finally:
                connection.close()
    return "done"


def _numbered(folder, name):
    """(i, a descriptor of the journal folder/name-i that this process created): racers number
    themselves 0, 1, ... in the order they come, each journal appended to by one process only."""
    for index in itertools.count():
        try:
            return index, os.open(os.path.join(folder, f"{name}-{index}"),
                                  os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        except FileExistsError:
            continue


def written(call):
    """call() again while SQLite answers "database is locked", which wrote nothing: on a loaded
    machine a writer among eight can wait past its busy timeout, and a race asserts outcomes."""
    while True:
        try:
            return call()
        except sqlite3.OperationalError as error:
            if "database is locked" not in str(error):
                raise


class Case(unittest.TestCase):
    def assert_integrity(self, ws):
        for name in ("sender", "receiver", "external"):
            connection = getattr(ws, name)
            with self.subTest(database=name):
                self.assertEqual(connection.execute("PRAGMA quick_check").fetchall(), [("ok",)])
                self.assertEqual(connection.execute("PRAGMA foreign_key_check").fetchall(), [])


# === 第一篇 §1: WAL and synchronous=FULL on every connection; files are never recreated ===

class DatabaseFileTest(Case):
    """§1 先说清楚这次到底运行了什么: WAL + synchronous=FULL, and a file is opened, never created."""

    def test_every_connection_runs_wal_full_synchronous_with_foreign_keys_in_autocommit(self):
        with workspace() as ws:
            for name in ("sender", "receiver", "external"):
                connection = getattr(ws, name)
                with self.subTest(database=name):
                    self.assertEqual(connection.execute("PRAGMA journal_mode").fetchone()[0], "wal")
                    self.assertEqual(connection.execute("PRAGMA synchronous").fetchone()[0], 2)  # FULL
                    self.assertEqual(connection.execute("PRAGMA foreign_keys").fetchone()[0], 1)
                    self.assertIsNone(connection.isolation_level)
            receive(ws)
            with self.assertRaises(sqlite3.IntegrityError):  # foreign keys are really enforced
                ws.receiver.execute("DELETE FROM tickets")
            self.assertEqual(counts(ws)["tickets"], 1)

    def test_init_creates_the_three_databases_with_their_kind_and_schema_version(self):
        with tempfile.TemporaryDirectory() as root:
            reliability.init(root)
            self.assertEqual(sorted(os.listdir(root)), sorted(KINDS))
            for name, kind in KINDS.items():
                with contextlib.closing(reliability.connect(os.path.join(root, name))) as connection:
                    self.assertEqual(connection.execute("PRAGMA application_id").fetchone()[0], kind)
                    self.assertEqual(connection.execute("PRAGMA user_version").fetchone()[0], 2)
        self.assertEqual(KINDS, {SENDER: 7301, RECEIVER: 7302, EXTERNAL: 7303})
        self.assertEqual(reliability.SCHEMA_VERSION, 2)

    def test_init_refuses_to_overwrite_and_leaves_existing_files_identical(self):
        for existing in (*KINDS, RECEIVER + "-wal", SENDER + "-journal"):
            with self.subTest(existing=existing), tempfile.TemporaryDirectory() as root:
                write_file(os.path.join(root, existing), GARBAGE)
                with self.assertRaises(FileExistsError):
                    reliability.init(root)
                self.assertEqual(os.listdir(root), [existing])  # nothing else was created either
                self.assertEqual(file_bytes(os.path.join(root, existing)), GARBAGE)
        with tempfile.TemporaryDirectory() as root:  # a real, used root
            reliability.init(root)
            with contextlib.closing(reliability.connect(os.path.join(root, RECEIVER))) as connection:
                reliability.receive(connection, "agent", "k1", PAYLOAD, issued_at=0, now=0)
            before = {name: file_bytes(os.path.join(root, name)) for name in sorted(os.listdir(root))}
            with self.assertRaises(FileExistsError):
                reliability.init(root)
            self.assertEqual({name: file_bytes(os.path.join(root, name)) for name in sorted(os.listdir(root))},
                             before)

    def test_connect_never_creates_a_file_and_names_the_path_it_refuses(self):
        with tempfile.TemporaryDirectory() as root:
            for path in (os.path.join(root, RECEIVER), os.path.join(root, "missing", RECEIVER)):
                with self.subTest(path=path), self.assertRaises(FileNotFoundError) as caught:
                    reliability.connect(path)
                self.assertIn(path, str(caught.exception))
            with self.assertRaises(IsADirectoryError) as caught:
                reliability.connect(root)
            self.assertIn(root, str(caught.exception))
            self.assertEqual(os.listdir(root), [])

    def test_garbage_empty_and_foreign_files_raise_database_error_naming_the_path_and_stay_unchanged(self):
        with tempfile.TemporaryDirectory() as root:
            foreign = os.path.join(root, "foreign", SENDER)
            os.mkdir(os.path.dirname(foreign))
            with raw(foreign) as connection:
                connection.execute("CREATE TABLE notes (text TEXT)")
                connection.execute("INSERT INTO notes VALUES ('mine')")
            files = {"foreign": foreign}
            for label, content in (("garbage", GARBAGE), ("0-byte", b"")):
                files[label] = os.path.join(root, label, RECEIVER)
                os.mkdir(os.path.dirname(files[label]))
                write_file(files[label], content)
            for label, path in files.items():
                content = file_bytes(path)
                with self.subTest(file=label):
                    with self.assertRaises(sqlite3.DatabaseError) as caught:
                        reliability.connect(path)
                    self.assertIn(path, str(caught.exception))
                    self.assertEqual(file_bytes(path), content)
                    self.assertEqual(os.listdir(os.path.dirname(path)), [os.path.basename(path)])  # no -wal, -shm

    def test_paths_with_uri_special_characters_open_the_named_file(self):
        with tempfile.TemporaryDirectory() as parent:
            root = os.path.join(parent, "a?mode=ro#b%41 c")
            reliability.init(root)
            with contextlib.closing(reliability.connect(os.path.join(root, RECEIVER))) as connection:
                reliability.receive(connection, "agent", "k1", PAYLOAD, issued_at=0, now=0)
            with raw(os.path.join(root, RECEIVER)) as check:
                self.assertEqual(check.execute("SELECT count(*) FROM tickets").fetchone()[0], 1)
            self.assertEqual(os.listdir(parent), [os.path.basename(root)])


    def test_snapshot_reads_one_state_even_while_another_process_writes(self):
        with workspace() as ws:
            class Between(sqlite3.Connection):  # another writer commits between snapshot's two reads
                def execute(self, sql, *args):
                    if sql.startswith("SELECT o.caller"):
                        enqueue(ws, "k2")
                    return super().execute(sql, *args)
            enqueue(ws)
            with contextlib.closing(sqlite3.connect(ws.path("sender"), factory=Between, isolation_level=None)) as c:
                seen = reliability.snapshot(c)
            self.assertEqual((seen["intent_rows"], len(seen["outbox"])), (1, 1))
            self.assertEqual(counts(ws)["requests"], 2)

    def test_a_refused_open_leaves_the_database_and_a_foreign_wal_byte_for_byte(self):
        # Another database's -wal beside receiver.db: SQLite would apply its frames, and closing the
        # last read-write connection would checkpoint them into the file.  The check runs read-only.
        with workspace() as ws, tempfile.TemporaryDirectory() as other:
            receive(ws)
            ws.close()
            foreign = os.path.join(other, "notes.db")
            with raw(foreign) as notes:
                notes.execute("PRAGMA journal_mode=WAL")
                notes.execute("PRAGMA wal_autocheckpoint=0")
                notes.execute("PRAGMA application_id = 4242")
                notes.execute("CREATE TABLE notes (text TEXT)")
                shutil.copyfile(foreign + "-wal", ws.path("receiver") + "-wal")  # while its frames are unapplied
            before = file_bytes(ws.path("receiver")), file_bytes(ws.path("receiver") + "-wal")
            with self.assertRaises(sqlite3.DatabaseError) as caught:
                reliability.connect(ws.path("receiver"))
            self.assertIn(ws.path("receiver"), str(caught.exception))
            self.assertEqual((file_bytes(ws.path("receiver")), file_bytes(ws.path("receiver") + "-wal")), before)
            os.remove(ws.path("receiver") + "-wal")
            self.assertEqual(counts(ws)["tickets"], 1)  # still itself, its ticket kept

    def test_a_foreign_wal_without_page_1_or_reached_through_a_symlink_is_refused_too(self):
        # Another database's -wal whose frames leave page 1 alone passes the kind check: a -wal left
        # without its -shm is checked whole (quick_check).  Through a symlink, SQLite keeps -wal and
        # -shm beside the target, so that is where the checks must look.
        try:
            import preconditions
        except ModuleNotFoundError:
            self.skipTest("the foreign -wal is preconditions.py's (article 1's download has no such file)")
        with workspace() as ws, tempfile.TemporaryDirectory() as other:
            receive(ws)
            ws.close()
            foreign = os.path.join(other, "transfer.db")
            preconditions.init(foreign, {"A": 10, "B": 0})
            with contextlib.closing(preconditions.connect(foreign)) as transfer:
                transfer.execute("PRAGMA wal_autocheckpoint=0")  # one change, its data pages kept in the -wal
                preconditions.change(transfer, "op-1", "A", 1, issued_at=0, now=0)
                shutil.copyfile(foreign + "-wal", os.path.join(other, "data-only-wal"))
            link = os.path.join(other, "link.db")
            os.symlink(ws.path("receiver"), link)
            for label, path in (("directly", ws.path("receiver")), ("through a symlink", link)):
                with self.subTest(label):
                    shutil.copyfile(os.path.join(other, "data-only-wal"), ws.path("receiver") + "-wal")
                    before = file_bytes(ws.path("receiver")), file_bytes(ws.path("receiver") + "-wal")
                    with self.assertRaises(sqlite3.DatabaseError) as caught:
                        reliability.connect(path)
                    self.assertIn(path, str(caught.exception))
                    self.assertEqual((file_bytes(ws.path("receiver")), file_bytes(ws.path("receiver") + "-wal")),
                                     before)
                    for leftover in ("-wal", "-shm"):
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(ws.path("receiver") + leftover)
            self.assertEqual(counts(ws)["tickets"], 1)

    def test_a_fifo_or_another_file_that_is_not_regular_is_refused_at_once(self):
        with tempfile.TemporaryDirectory() as root:
            fifo = os.path.join(root, SENDER)
            os.mkfifo(fifo)  # opening it to read would wait for ever for a writer: so in a child, watched
            code, out, err = cli("snapshot", root)
            self.assertEqual((code, out), (1, ""))
            self.assertIn(f"not a regular file, so not a database: '{fifo}'", err)

    def test_a_database_with_a_second_name_is_refused_naming_the_path(self):
        with workspace() as ws:
            ws.close()
            alias = os.path.join(ws.root, "alias.db")
            os.link(ws.path("receiver"), alias)  # two names, two -wal files: commits could be lost
            for path in (ws.path("receiver"), alias):
                with self.subTest(path=path), self.assertRaises(OSError) as caught:
                    reliability.connect(path)
                self.assertIn(path, str(caught.exception))
                self.assertIn("more than one name", str(caught.exception))
            self.assertEqual(sorted(os.listdir(ws.root)), sorted([*KINDS, "alias.db"]))  # no -wal, no -shm
            os.remove(alias)
            self.assertEqual(counts(ws)["tickets"], 0)  # one name again: opened as before

    def test_a_path_starting_with_two_slashes_is_a_path_not_a_uri_authority(self):
        with tempfile.TemporaryDirectory() as top:
            root = "/" + os.path.join(top, "root")  # //tmp/...: POSIX lets it mean the same file
            reliability.init(root)
            with contextlib.closing(reliability.connect(os.path.join(root, RECEIVER))) as connection:
                self.assertEqual(receive_on(connection)["ticket_id"], 1)
            self.assertEqual(cli("purge", root, "--now", 100, "--window", 50)[0], 0)
            self.assertEqual(sorted(os.listdir(os.path.join(top, "root"))), sorted(KINDS))

    def test_connect_never_creates_a_file_that_vanished_after_its_check(self):
        with workspace() as ws:
            ws.close()
            path, real = ws.path("receiver"), sqlite3.connect

            def vanishing(database, *args, **kwargs):  # the file goes after every check, just before it is opened to write
                if database.endswith("mode=rw") and os.path.exists(path):
                    os.remove(path)
                return real(database, *args, **kwargs)
            with mock.patch.object(reliability.sqlite3, "connect", vanishing), \
                    self.assertRaises(sqlite3.OperationalError) as caught:
                reliability.connect(path)
            self.assertIn(path, str(caught.exception))
            self.assertEqual(sorted(os.listdir(ws.root)), sorted([SENDER, EXTERNAL]))

    def test_the_loser_of_two_inits_never_removes_the_winners_database(self):
        with tempfile.TemporaryDirectory() as root:
            reliability.init(root)  # the winner
            with contextlib.closing(reliability.connect(os.path.join(root, SENDER))) as sender:
                reliability.enqueue(sender, "agent", "k1", PAYLOAD, now=0)
            before = {name: file_bytes(os.path.join(root, name)) for name in KINDS}
            with mock.patch("os.path.lexists", return_value=False):  # it looked before the winner created
                with self.assertRaises(FileExistsError):
                    reliability.init(root)
            self.assertEqual({name: file_bytes(os.path.join(root, name)) for name in sorted(os.listdir(root))},
                             before)

    @unittest.skipUnless(hasattr(os, "fork"), "the half-built file is left by a forked child")
    def test_a_database_whose_creation_died_half_way_is_refused_by_connect(self):
        # The kind and schema markers commit with the schema: a file left mid-creation has none.
        with tempfile.TemporaryDirectory() as root:
            path = os.path.join(root, RECEIVER)

            def dies_half_way(connection):
                os._exit(9)  # the schema is written, nothing committed
            pid = os.fork()
            if pid == 0:
                try:
                    reliability._create(path, KINDS[RECEIVER], reliability.SCHEMAS[RECEIVER], dies_half_way)
                finally:
                    os._exit(1)
            self.assertEqual(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), 9)
            with self.assertRaisesRegex(sqlite3.DatabaseError, "not a database of this module"):
                reliability.connect(path)


    def test_the_kind_and_schema_version_commit_in_the_schemas_own_transaction(self):
        statements, connect = [], sqlite3.connect

        def traced(*args, **kwargs):  # every connection init opens, its statements recorded
            connection = connect(*args, **kwargs)
            connection.set_trace_callback(statements.append)
            return connection
        with tempfile.TemporaryDirectory() as root, mock.patch("sqlite3.connect", traced):
            reliability.init(root)
        for kind in KINDS.values():
            with self.subTest(kind=kind):
                marker = statements.index(f"PRAGMA application_id = {kind}")
                begin = max(i for i in range(marker) if statements[i] == "BEGIN IMMEDIATE")
                commit = statements.index("COMMIT", marker)
                self.assertEqual(statements[marker + 1], f"PRAGMA user_version = {reliability.SCHEMA_VERSION}")
                self.assertLess(marker + 1, commit)
                self.assertTrue(all(s.startswith(("CREATE", "INSERT")) for s in statements[begin + 1:marker]))

# === 第一篇 §2: the durable outbox ===

class OutboxTest(Case):
    """§2 两本账之间，没有一个共同的提交按钮: the intent is written once, before anything is sent."""

    def test_enqueue_stores_intent_and_outbox_row_once_and_a_duplicate_adds_nothing(self):
        with workspace() as ws:
            self.assertEqual(enqueue(ws, now=7), "accepted")
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))
            self.assertEqual(ws.sender.execute("SELECT issued_at FROM requests").fetchall(), [(7,)])
            before = rows(ws.sender, "requests"), rows(ws.sender, "outbox")
            self.assertEqual(enqueue(ws, payload=dict(PAYLOAD), now=9), "duplicate")
            self.assertEqual((rows(ws.sender, "requests"), rows(ws.sender, "outbox")), before)
            row = reliability.claim(ws.sender, 9)  # a duplicate of a claimed intent neither resets nor re-queues it
            self.assertEqual((row["issued_at"], row["now"]), (7, 9))
            self.assertEqual(enqueue(ws, now=9), "duplicate")
            self.assertEqual(state(ws), ("inflight", 1))

    def test_same_key_with_another_payload_or_mode_is_a_conflict_and_changes_nothing(self):
        with workspace() as ws:
            enqueue(ws)
            before = rows(ws.sender, "requests"), rows(ws.sender, "outbox")
            for label, payload, mode in (("payload", OTHER_PAYLOAD, "idempotent"), ("mode", PAYLOAD, "external"),
                                         ("both", OTHER_PAYLOAD, "external")):
                with self.subTest(differs=label), self.assertRaises(Conflict):
                    enqueue(ws, payload=payload, mode=mode)
            self.assertEqual((rows(ws.sender, "requests"), rows(ws.sender, "outbox")), before)
            self.assertEqual(enqueue(ws, payload=OTHER_PAYLOAD, caller="other"), "accepted")  # another caller's key
            self.assertEqual(counts(ws), dict(EMPTY, requests=2, outbox=2))

    def test_only_the_two_modes_exist_in_code_and_in_the_schema(self):
        self.assertEqual(reliability.MODES, ("idempotent", "external"))
        with workspace() as ws:
            for mode in ("naive", "mark_before", "unsafe", "", "IDEMPOTENT", None, ["idempotent"]):
                with self.subTest(mode=mode), self.assertRaises(ValueError):
                    enqueue(ws, mode=mode)
            self.assertEqual(counts(ws), EMPTY)
            with raw(ws.path("sender")) as tamper:  # the CHECK constraint refuses them as well
                for n, mode in enumerate(("naive", "mark_before", "idempotent", "external")):
                    insert = lambda: tamper.execute("INSERT INTO requests VALUES ('agent', ?, ?, 'd', '{}', 0)",
                                                    (f"k{n}", mode))
                    if mode in reliability.MODES:
                        insert()
                    else:
                        with self.subTest(mode=mode), self.assertRaises(sqlite3.IntegrityError):
                            insert()
                self.assertEqual(tamper.execute("SELECT count(*) FROM requests").fetchone()[0], 2)

    def test_enqueue_dying_before_its_commit_leaves_nothing_and_the_upstream_retry_is_accepted(self):
        with workspace() as ws:
            code, out, _ = cli("enqueue", ws.root, "agent", "k1", json.dumps(PAYLOAD), "--now", 0,
                               "--crash", "before_intent_commit")
            self.assertEqual((code, out), (CRASH_EXIT, ""))
            self.assertEqual(counts(ws), EMPTY)
            self.assertEqual(enqueue(ws), "accepted")
            self.assertEqual(state(ws), ("pending", 0))

    def test_enqueue_dying_after_its_commit_keeps_the_intent_and_the_retry_is_a_duplicate(self):
        with workspace() as ws:
            code, out, _ = cli("enqueue", ws.root, "agent", "k1", json.dumps(PAYLOAD), "--now", 0,
                               "--crash", "after_intent_commit")
            self.assertEqual((code, out), (CRASH_EXIT, ""))  # the caller never heard "accepted"
            self.assertEqual(state(ws), ("pending", 0))
            self.assertEqual(enqueue(ws), "duplicate")
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))


# === 第一篇 §3: the receipt and the ticket in one transaction ===

ARTICLE_TRANSACTION = '''\
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
'''
ARTICLE = os.path.join(HERE, "..", "shared", "seeds", "000_672431c61ad6d6f5.txt")


class ReceiptTest(Case):
    """§3 把幂等记录和业务动作放进同一个事务: one ticket per (caller, key), replayed from its receipt."""

    def test_a_replay_returns_the_identical_response_and_creates_no_ticket(self):
        with workspace() as ws:
            first = receive(ws)
            self.assertEqual(first, {"caller": "agent", "key": "k1", "digest": reliability.canonical(PAYLOAD)[1],
                                     "ticket_id": 1})
            self.assertEqual(receive(ws, now=5), first)
            with contextlib.closing(reliability.connect(ws.path("receiver"))) as again:  # as a restarted process
                self.assertEqual(reliability.receive(again, "agent", "k1", dict(PAYLOAD), issued_at=0, now=9), first)
            self.assertEqual(counts(ws), dict(EMPTY, tickets=1, receipts=1))

    def test_same_key_other_payload_is_a_conflict_and_the_ticket_is_unchanged(self):
        with workspace() as ws:
            first = receive(ws, payload={"n": 1})
            before = rows(ws.receiver, "tickets"), rows(ws.receiver, "receipts")
            # {"n": True} and {"n": 1.0} equal {"n": 1} in Python but are other JSON intents.
            for changed in ({"n": 2}, {"n": True}, {"n": 1.0}, {"n": 1, "extra": None}, {}):
                with self.subTest(payload=changed), self.assertRaises(Conflict):
                    receive(ws, payload=changed)
            self.assertEqual((rows(ws.receiver, "tickets"), rows(ws.receiver, "receipts")), before)
            self.assertEqual(receive(ws, payload={"n": 1}), first)

    def test_keys_are_scoped_by_caller_and_equal_content_under_a_new_key_is_a_new_ticket(self):
        with workspace() as ws:
            alice, bob = receive(ws, caller="alice"), receive(ws, caller="bob")
            self.assertNotEqual(alice["ticket_id"], bob["ticket_id"])
            self.assertEqual(receive(ws, payload=OTHER_PAYLOAD, caller="carol")["ticket_id"], 3)
            self.assertEqual((receive(ws, caller="alice"), receive(ws, caller="bob")), (alice, bob))
            again = receive(ws, "k2", caller="alice")
            self.assertEqual((again["digest"], again["ticket_id"]), (alice["digest"], 4))
            self.assertEqual(counts(ws), dict(EMPTY, tickets=4, receipts=4))

    def test_key_order_does_not_change_the_canonical_form_or_the_digest(self):
        one = {"b": [1, {"d": 1, "c": "é"}], "a": 1}
        two = {"a": 1, "b": [1, {"c": "é", "d": 1}]}
        text, digest = reliability.canonical(one)
        self.assertEqual(text, '{"a":1,"b":[1,{"c":"é","d":1}]}')  # sorted, compact, not \u-escaped
        self.assertEqual(digest, hashlib.sha256(text.encode("utf-8")).hexdigest())
        self.assertEqual(reliability.canonical(two), (text, digest))
        self.assertNotEqual(reliability.canonical({"a": 1, "b": [{"c": "é", "d": 1}, 1]})[1], digest)  # list order
        with workspace() as ws:
            self.assertEqual(receive(ws, payload=two), receive(ws, payload=one))
            self.assertEqual((enqueue(ws, payload=one), enqueue(ws, payload=two)), ("accepted", "duplicate"))
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1, tickets=1, receipts=1))

    def test_transaction_is_the_articles_wrapper_line_for_line(self):
        node = DEFINITIONS["transaction"]
        self.assertEqual("\n".join(segment(node)) + "\n", ARTICLE_TRANSACTION)
        if os.path.exists(ARTICLE):  # the article itself sits beside the project, not in the download
            with open(ARTICLE, encoding="utf-8") as handle:
                self.assertIn(ARTICLE_TRANSACTION, handle.read())

    def test_transaction_commits_on_success_and_rolls_back_and_reraises_on_an_exception(self):
        class Boom(Exception):
            pass
        insert = "INSERT INTO tickets (caller, key, digest, payload) VALUES ('a', 'b', 'c', '{}')"
        with workspace() as ws:
            with self.assertRaises(Boom):
                with reliability.transaction(ws.external):
                    ws.external.execute(insert)
                    raise Boom
            self.assertFalse(ws.external.in_transaction)
            self.assertEqual(counts(ws)["external"], 0)
            with reliability.transaction(ws.external):
                self.assertTrue(ws.external.in_transaction)
                ws.external.execute(insert)
            with raw(ws.path("external")) as other:
                self.assertEqual(other.execute("SELECT count(*) FROM tickets").fetchone()[0], 1)


    def test_transaction_rolls_back_on_keyboard_interrupt_too(self):
        # BaseException, as the article prints it: a Ctrl-C inside a transaction must not leave it open.
        with workspace() as ws:
            with self.assertRaises(KeyboardInterrupt):
                with reliability.transaction(ws.receiver):
                    ws.receiver.execute("INSERT INTO tickets (caller, key, digest, payload) VALUES ('a', 'b', 'c', '{}')")
                    raise KeyboardInterrupt
            self.assertFalse(ws.receiver.in_transaction)
            self.assertEqual(counts(ws)["tickets"], 0)

    def test_transaction_does_not_nest_and_the_failed_inner_begin_rolls_the_outer_one_back(self):
        with workspace() as ws:
            with self.assertRaises(sqlite3.OperationalError):
                with reliability.transaction(ws.receiver):
                    ws.receiver.execute("INSERT INTO tickets (caller, key, digest, payload) VALUES ('a', 'b', 'c', '{}')")
                    with reliability.transaction(ws.receiver):
                        pass
            self.assertFalse(ws.receiver.in_transaction)
            self.assertEqual(counts(ws)["tickets"], 0)

    def test_a_writer_blocked_past_its_busy_timeout_gets_database_is_locked_and_writes_nothing(self):
        self.assertEqual(reliability.BUSY_TIMEOUT, 10.0)
        with workspace() as ws, raw(ws.path("receiver")) as other_writer:
            other_writer.execute("BEGIN IMMEDIATE")
            ws.receiver.execute("PRAGMA busy_timeout = 20")  # not the 10 s default: the outcome is the same
            with self.assertRaises(sqlite3.OperationalError) as caught:
                receive(ws)
            self.assertIn("database is locked", str(caught.exception))
            other_writer.execute("ROLLBACK")
            self.assertFalse(ws.receiver.in_transaction)
            self.assertEqual(counts(ws)["tickets"], 0)
            self.assertEqual(receive(ws)["ticket_id"], 1)  # the lock is free again


class _HidingList(list):  # json reads a list its own way: what iter() shows need not be what it writes
    def __iter__(self):
        return iter(())


class _HidingDict(dict):  # and a dict through items(), not values()
    def values(self):
        return []


BAD_PAYLOADS = {
    "NaN": {"a": float("nan")}, "Infinity": {"a": float("inf")}, "-Infinity": {"a": float("-inf")},
    "int dict key": {1: "a"}, "nested int dict key": {"a": {2: "b"}}, "bool dict key": {True: "a"},
    "None dict key": {None: "a"}, "float dict key": {1.5: "a"}, "int key beside str keys": {"a": 1, 2: "b"},
    "tuple value": {"a": (1, 2)}, "nested tuple": {"a": [(1,)]}, "bytes": {"a": b"x"}, "set": {"a": {1}},
    "list payload": [1, 2], "JSON text payload": '{"a": 1}', "None payload": None,
    "over-size payload": {"a": "x" * MAX_PAYLOAD_BYTES},
    "over-size in UTF-8 bytes only": {"a": "é" * (MAX_PAYLOAD_BYTES // 2)},
    "lone surrogate value": {"a": "\ud800"}, "lone surrogate key": {"\udc00": 1},
    "list subclass hiding a tuple": {"a": _HidingList([(1, 2)])}, "dict subclass hiding one": {"a": _HidingDict(b=(1,))},
    "str subclass": {"a": type("Text", (str,), {})("x")}, "int subclass": {"a": type("Number", (int,), {})(1)},
}
BAD_IDENTITIES = {"empty": "", "over-long": "k" * (reliability.MAX_IDENTITY_LENGTH + 1), "int": 7,
                  "bytes": b"k1", "None": None, "lone surrogate": "k\ud800"}


def writers(ws):
    """Every public function that would store an (identity, payload) pair, one per database."""
    return {"receive": lambda c, k, p: reliability.receive(ws.receiver, c, k, p, issued_at=0, now=0),
            "enqueue": lambda c, k, p: reliability.enqueue(ws.sender, c, k, p, now=0),
            "external_create_ticket": lambda c, k, p: reliability.external_create_ticket(ws.external, c, k, p)}


class ValidationTest(Case):
    """§3 参数的规范化同样是协议: what JSON cannot carry exactly is refused before any transaction."""

    def test_invalid_payloads_are_rejected_with_nothing_stored(self):
        with workspace() as ws:
            for label, payload in BAD_PAYLOADS.items():
                for name, write in writers(ws).items():
                    with self.subTest(payload=label, function=name):
                        with self.assertRaises((TypeError, ValueError)):
                            write("agent", "k1", payload)
                        self.assertEqual(counts(ws), EMPTY)
                        self.assertFalse(ws.sender.in_transaction or ws.receiver.in_transaction
                                         or ws.external.in_transaction)

    def test_invalid_identities_are_rejected_with_nothing_stored(self):
        with workspace() as ws:
            for label, bad in BAD_IDENTITIES.items():
                for name, write in writers(ws).items():
                    for position, (caller, key) in (("caller", (bad, "k1")), ("key", ("agent", bad))):
                        with self.subTest(identity=label, position=position, function=name):
                            with self.assertRaises((TypeError, ValueError)):
                                write(caller, key, PAYLOAD)
                            self.assertEqual(counts(ws), EMPTY)

    def test_size_limits_are_inclusive_payload_in_utf8_bytes_identity_in_characters(self):
        filler = MAX_PAYLOAD_BYTES - len('{"a":""}')
        self.assertEqual(len(reliability.canonical({"a": "x" * filler})[0].encode()), MAX_PAYLOAD_BYTES)
        with self.assertRaises(ValueError):
            reliability.canonical({"a": "x" * (filler + 1)})
        longest = "𝄞" * reliability.MAX_IDENTITY_LENGTH  # 4 UTF-8 bytes each, still allowed
        with workspace() as ws:
            receive(ws, payload={"a": "x" * filler})
            receive(ws, longest, caller=longest)
            self.assertEqual(enqueue(ws, longest, caller=longest), "accepted")
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1, tickets=2, receipts=2))

    def test_a_payload_nested_too_deeply_is_a_value_error_before_any_transaction(self):
        self.assertEqual(reliability.MAX_PAYLOAD_DEPTH, 32)

        def nested(levels):  # a payload of exactly ``levels`` nested objects and lists
            value = []
            for _ in range(levels - 2):
                value = [value]
            return {"x": value}
        with workspace() as ws:
            for levels in (33, 991, 100000):
                payload = nested(levels)  # built once: 100,000 levels take a while
                for name, write in writers(ws).items():
                    with self.subTest(levels=levels, function=name), self.assertRaises(ValueError):
                        write("agent", "k1", payload)
            self.assertEqual(counts(ws), EMPTY)
            looped = {"x": []}
            looped["x"].append(looped)  # a cycle is endless nesting
            with self.assertRaises(ValueError):
                reliability.canonical(looped)
            # The deepest payload accepted goes all the way: claimed, sent, answered, acknowledged.
            self.assertEqual(enqueue(ws, payload=nested(32)), "accepted")
            ws.close()
            self.assertEqual(reliability.dispatch(ws.sender, ws.root, 0, start=launcher())["acknowledged"], True)
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("done", 1), 1))

    def test_a_lone_surrogate_is_refused_before_the_transaction_begins(self):
        with workspace() as ws:
            statements = []
            ws.receiver.set_trace_callback(statements.append)
            for bad in ({"a": "\ud800"}, {"\udc00": 1}):
                with self.subTest(payload=bad), self.assertRaises(ValueError):
                    receive(ws, payload=bad)
            with self.assertRaises(ValueError):
                reliability.receive(ws.receiver, "agent", "k\ud800", PAYLOAD, issued_at=0, now=0)
            ws.receiver.set_trace_callback(None)
            self.assertEqual(statements, [])  # not even BEGIN IMMEDIATE

    def test_a_payload_of_many_shared_values_is_refused_before_it_is_encoded(self):
        shared = []
        for _ in range(25):  # 2 ** 25 values to walk, 26 levels deep, each no more than a pointer to the last
            shared = [shared, shared]
        text, number = "x" * 20000, 10 ** 4000  # one object each, written 60,000 times
        payloads = {"shared lists": {"x": shared}, "a shared string": {"a": [text] * 60000},
                    "a shared int": {"a": [number] * 60000}, "a shared long key": {"a": [{"k" * 20000: 0}] * 30000},
                    "one long list": {"a": [0] * (MAX_PAYLOAD_BYTES // 2)},
                    "a few long strings": {"a": ["x" * 20000] * 4}, "a few long ints": {"a": [10 ** 4000] * 30},
                    "a few long keys": {"a": [{"k" * 20000: 0}] * 4}}
        for label, payload in payloads.items():  # counted as walked, each value's fewest bytes each time it is met
            with self.subTest(label), mock.patch.object(reliability, "_dumps", side_effect=AssertionError("encoded")):
                with self.assertRaisesRegex(ValueError, "exceeds 65536 bytes"):
                    reliability.canonical(payload)
        self.assertEqual(len(reliability.canonical({"a": [0] * (MAX_PAYLOAD_BYTES // 2 - 4)})[0]), MAX_PAYLOAD_BYTES - 1)

    def test_the_command_line_refuses_a_repeated_key_or_json_nested_too_deeply_in_one_line(self):
        with workspace() as ws:
            ws.close()
            for payload, said in (('{"x": 1, "x": 2}', "repeats a key"), ("[" * 50000 + "]" * 50000, "nests too deeply")):
                with self.subTest(said):
                    code, out, err = cli("enqueue", ws.root, "agent", "k1", payload, "--now", 0)
                    self.assertEqual((code, out, len(err.splitlines())), (1, "", 1))
                    self.assertIn(said, err)
            self.assertEqual(counts(ws), EMPTY)

class FailClosedTest(Case):
    """§3: a receipt or an intent that cannot be trusted is refused, never acted on."""

    def test_corrupt_receipt_makes_receive_raise_and_creates_no_ticket(self):
        tampering = {
            "receipt ticket_id not an int": "UPDATE receipts SET ticket_id = 'one' WHERE key = :key",
            "receipt points at another ticket": "UPDATE receipts SET ticket_id = "
                                                "(SELECT id FROM tickets WHERE key = 'other') WHERE key = :key",
            "ticket caller edited": "UPDATE tickets SET caller = 'mallory' WHERE key = :key",
            "ticket key edited": "UPDATE tickets SET key = 'elsewhere' WHERE key = :key",
            "ticket digest edited": "UPDATE tickets SET digest = 'x' WHERE key = :key",
            "ticket payload edited": "UPDATE tickets SET payload = '{}' WHERE key = :key",
            "ticket payload not UTF-8": "UPDATE tickets SET payload = CAST(x'ff' AS TEXT) WHERE key = :key",
            "ticket deleted": "DELETE FROM tickets WHERE key = :key",
        }
        with workspace() as ws:
            receive(ws, "other")
            for index, (label, sql) in enumerate(tampering.items()):
                key = f"k{index}"
                with self.subTest(tampering=label):
                    receive(ws, key)
                    with raw(ws.path("receiver")) as tamper:
                        tamper.execute(sql, {"key": key})
                    before = rows(ws.receiver, "tickets")
                    for _ in range(2):  # and again: the refusal does not wear off
                        with self.assertRaises(CorruptRecord):
                            receive(ws, key)
                    self.assertEqual(rows(ws.receiver, "tickets"), before)
            receive(ws, "last")  # an edited receipt digest looks like another intent: refused as well
            ws.receiver.execute("UPDATE receipts SET digest = 'x' WHERE key = 'last'")
            before = rows(ws.receiver, "tickets")
            with self.assertRaises((Conflict, CorruptRecord)):
                receive(ws, "last")
            self.assertEqual(rows(ws.receiver, "tickets"), before)

    def test_corrupted_outbox_payload_is_blocked_never_sent_and_does_not_hold_back_the_next_row(self):
        tampering = {"payload replaced": ("payload", json.dumps(OTHER_PAYLOAD)),
                     "invalid JSON": ("payload", '{"title": "打印机'), "JSON but not an object": ("payload", "[1, 2]"),
                     "NaN literal": ("payload", '{"a": NaN}'), "digest replaced": ("digest", "0" * 64)}
        with workspace() as ws:
            for index, (label, (column, value)) in enumerate(tampering.items()):
                key = f"k{index}"
                with self.subTest(tampering=label):
                    enqueue(ws, key)
                    ws.sender.execute(f"UPDATE requests SET {column} = ? WHERE key = ?", (value, key))
                    self.assertIsNone(reliability.dispatch(ws.sender, ws.root, 0))  # None: no child was started
                    self.assertEqual(state(ws, key), ("blocked", 0))
            enqueue(ws, "bad")
            enqueue(ws, "good")
            ws.sender.execute("UPDATE requests SET payload = 'garbage' WHERE key = 'bad'")
            self.assertEqual(reliability.claim(ws.sender, 0)["key"], "good")
            self.assertEqual(state(ws, "bad"), ("blocked", 0))
            self.assertEqual(counts(ws), dict(EMPTY, requests=7, outbox=7))

    def test_a_stored_payload_or_digest_that_is_not_text_is_blocked_as_corrupt_and_the_next_row_goes_out(self):
        text, digest = reliability.canonical(PAYLOAD)
        deep = "[" * 5000 + "]" * 5000  # what another program could write: too deep for any JSON parser
        tampering = {  # column: value, each as another program might store it ("both": with its own digest)
            "payload as BLOB": ("payload", text.encode("utf-8")), "digest as BLOB": ("digest", digest.encode()),
            "payload not UTF-8": ("payload", None), "payload too deep": ("payload", deep),
            "deep payload with its own digest": ("both", deep), "keys out of order": ("both", '{"b":1,"a":2}'),
            "spaces": ("both", '{"a": 1}'), "NaN": ("both", '{"a":NaN}'), "a lone surrogate": ("both", '{"a":"\\ud800"}'),
            "nested 40 deep": ("both", '{"a":' * 40 + "1" + "}" * 40), "an array": ("both", "[1]"),
            "over 64 KiB": ("both", '{"a":"' + "x" * reliability.MAX_PAYLOAD_BYTES + '"}'),
            "attempts as text": ("attempts", "none"),
            "not the canonical text of its own digest": ("payload", json.dumps(PAYLOAD))}
        with workspace() as ws:
            for key, (column, value) in tampering.items():
                with self.subTest(key):
                    enqueue(ws, key)
                    enqueue(ws, key + "/next")
                    if value is None:
                        ws.sender.execute("UPDATE requests SET payload = CAST(x'ff7b7d' AS TEXT) WHERE key = ?", (key,))
                    elif column == "both":
                        ws.sender.execute("UPDATE requests SET payload = ?, digest = ? WHERE key = ?",
                                          (value, hashlib.sha256(value.encode()).hexdigest(), key))
                    elif column == "attempts":  # an outbox column
                        ws.sender.execute("UPDATE outbox SET attempts = ? WHERE key = ?", (value, key))
                    else:
                        ws.sender.execute(f"UPDATE requests SET {column} = ? WHERE key = ?", (value, key))
                    self.assertEqual(reliability.claim(ws.sender, 0)["key"], key + "/next")  # not held back
                    self.assertEqual(state(ws, key), ("blocked", value if column == "attempts" else 0))
                    self.assertIn("corrupt intent", outbox(ws, key)["response"]["error"])

    def test_stored_json_nested_too_deeply_is_a_one_line_refusal_of_the_command_line(self):
        deep = "[" * 100000 + "]" * 100000  # what another program could store
        with workspace() as ws:
            enqueue(ws)
            reliability.claim(ws.sender, 0)
            ws.close()
            with raw(ws.path("sender")) as tamper:
                tamper.execute("UPDATE requests SET payload = ?", (deep,))
                tamper.execute("UPDATE outbox SET response = ?", (deep,))
            for command in (("snapshot", ws.root), ("deliver", ws.root, "agent", "k1", "--attempt", 1, "--now", 0)):
                with self.subTest(command[0]):
                    code, out, err = cli(*command)
                    self.assertEqual((code, out, len(err.splitlines())), (1, "", 1), err)
                    self.assertTrue(err.startswith(f"reliability.py {command[0]}: RecursionError: "), err)
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))

    def test_a_row_whose_identity_is_not_text_is_parked_and_named_and_the_next_row_is_delivered(self):
        for label, column, value in (("caller not UTF-8", "caller", "CAST(x'61ff' AS TEXT)"),
                                     ("key as a BLOB", "key", "x'6b31'")):
            with self.subTest(label), workspace() as ws:
                enqueue(ws)
                enqueue(ws, "k2")
                ws.close()
                with raw(ws.path("sender")) as tamper:  # both tables: the outbox row keeps its request
                    tamper.execute(f"UPDATE requests SET {column} = {value} WHERE key = 'k1'")
                    tamper.execute(f"UPDATE outbox SET {column} = {value} WHERE key = 'k1'")
                code, out, err = cli("dispatch", ws.root, "--now", 0)
                line = json.loads(out)
                self.assertEqual((code, err, line["key"], line["status"]), (0, "", "k2", "done"))
                shown = {"caller": "a\\xff", "key": "k1"} if column == "caller" else {"caller": "agent", "key": "k1"}
                self.assertEqual([(row["caller"], row["key"], row["state"]) for row in line["parked"]],
                                 [(shown["caller"], shown["key"], "blocked")])
                self.assertIn("corrupt intent", line["parked"][0]["response"]["error"])
                self.assertEqual(counts(ws)["tickets"], 1)

    def test_a_corrupt_receipt_is_answered_as_such_and_the_sender_blocks_the_row_at_once(self):
        with workspace() as ws:
            enqueue(ws)
            receive(ws)
            ws.receiver.execute("UPDATE tickets SET payload = '{}'")  # the ticket no longer is what was asked
            ws.close()
            result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher())
            self.assertEqual((result["exit_code"], result["response"]["error"]), (0, "corrupt"))
            self.assertEqual(state(ws), ("blocked", 1))  # at once, not after MAX_ATTEMPTS tries
            self.assertIn("disagrees with its ticket", outbox(ws)["response"]["message"])
            self.assertIsNone(reliability.claim(ws.sender, 1000))


# === 第一篇 §4: real crashes at the named boundaries ===

def timed_out_child():
    """The only simulated child (the article says so): one that outlives its time-out."""
    child = mock.Mock(name="child")
    child.pid = 4194304  # above Linux's pid_max: no process has it
    child.communicate.side_effect = [subprocess.TimeoutExpired(cmd="serve", timeout=0.5), (b"", None)]
    return child


class CrashBoundaryTest(Case):
    """§4 让进程真的死在那道缝里: children exit 73 at a named boundary; what survives is read back."""

    def test_the_crash_hook_names_exactly_the_boundaries_and_no_function_takes_a_fault(self):
        self.assertEqual(CRASH_EXIT, 73)
        self.assertIsNone(reliability.CRASH_AT)
        called = [node.args[0].value for node in ast.walk(TREE) if isinstance(node, ast.Call)
                  and getattr(node.func, "id", None) == "crash_point" and isinstance(node.args[0], ast.Constant)]
        self.assertEqual(set(called), set(reliability.BOUNDARIES))
        self.assertEqual(set(reliability.BOUNDARIES.values()),
                         {"enqueue", "dispatch", "receiver", "external", "unsafe-dispatch-mark-before"})
        for name in reliability.__all__:
            function = DEFINITIONS[name]
            if isinstance(function, ast.FunctionDef):
                arguments = function.args
                names = {a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs}
                self.assertFalse(names & {"fault", "crash"}, name)

    def test_a_flushed_reply_counts_although_the_receiver_then_exits_73(self):
        with workspace() as ws:
            enqueue(ws)
            result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher("after_response_write"))
            self.assertEqual((result["exit_code"], result["acknowledged"], result["attempt"]), (CRASH_EXIT, True, 1))
            self.assertEqual(state(ws), ("done", 1))
            self.assertIsNone(reliability.dispatch(ws.sender, ws.root, 11))  # done is never sent again
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1, tickets=1, receipts=1))

    def test_a_receiver_dying_before_its_commit_leaves_neither_ticket_nor_receipt(self):
        with workspace() as ws:
            enqueue(ws)
            result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher("before_receiver_commit"))
            self.assertEqual((result["exit_code"], result["response"]), (CRASH_EXIT, None))
            self.assertEqual((state(ws), counts(ws)["tickets"], counts(ws)["receipts"]), (("inflight", 1), 0, 0))
            ws.close("receiver")
            self.assertEqual(reliability.dispatch(ws.sender, ws.root, 11, start=launcher())["acknowledged"], True)
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("done", 2), 1))

    def test_a_reply_lost_after_the_receivers_commit_is_replayed_with_the_same_ticket(self):
        with workspace() as ws:
            enqueue(ws)
            result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher("after_receiver_commit"))
            self.assertEqual((result["exit_code"], state(ws), counts(ws)["tickets"]), (CRASH_EXIT, ("inflight", 1), 1))
            ws.close("receiver")
            recovery = reliability.dispatch(ws.sender, ws.root, 11, start=launcher())
            self.assertEqual((recovery["attempt"], recovery["response"]["ticket_id"]), (2, 1))
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("done", 2), 1))

    def test_the_naive_receiver_without_receipts_issues_a_second_ticket_on_the_retry(self):
        with workspace() as ws:
            enqueue(ws)

            def naive(crash=None):
                return lambda argv: launcher(crash)(["serve", "unsafe-receive", *argv[2:]])
            first = reliability.dispatch(ws.sender, ws.root, 0, start=naive("after_receiver_commit"))
            self.assertEqual((first["exit_code"], counts(ws)["tickets"]), (CRASH_EXIT, 1))
            ws.close("receiver")
            reliability.dispatch(ws.sender, ws.root, 11, start=naive())
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("done", 2), 2))

    def test_marking_done_before_sending_then_dying_loses_the_task_for_good(self):
        with workspace() as ws:
            enqueue(ws)
            ws.close()
            code, out, _ = cli("unsafe-dispatch-mark-before", ws.root, "--now", 0, "--crash", "after_mark_before_send")
            self.assertEqual((code, out), (CRASH_EXIT, ""))
            self.assertIsNone(reliability.dispatch(ws.sender, ws.root, 11))
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("done", 1), 0))

    def test_sender_dying_after_claim_before_ack_or_after_ack_recovers_to_one_ticket(self):
        for boundary, recovered in (("after_claim", ("done", 2)), ("after_response_before_ack", ("done", 2)),
                                    ("after_ack", ("done", 1))):
            with self.subTest(boundary), workspace() as ws:
                enqueue(ws)
                ws.close()
                code, _, _ = cli("dispatch", ws.root, "--now", 0, "--crash", boundary)
                self.assertEqual(code, CRASH_EXIT)
                reliability.dispatch(ws.sender, ws.root, 11, start=launcher())
                self.assertEqual((state(ws), counts(ws)["tickets"], counts(ws)["receipts"]), (recovered, 1, 1))

    def test_a_tool_child_given_a_malformed_request_line_fails_with_one_line_and_stores_nothing(self):
        complete = {"caller": "agent", "key": "k1", "payload": PAYLOAD, "issued_at": 0, "now": 0}
        lines = {"not JSON": b"not json\n", "not UTF-8": b"\xff\n", "a list": b"[]\n",
                 "nested 100,000 deep": b"[" * 100000 + b"]" * 100000 + b"\n",
                 **{f"without {field}": json.dumps({k: v for k, v in complete.items() if k != field}).encode() + b"\n"
                    for field in complete}}
        with workspace() as ws:
            for label, line in lines.items():
                with self.subTest(label):
                    code, out, err = cli("serve", "receive", ws.path("receiver"), stdin=line)
                    self.assertEqual((code, out), (1, ""))
                    self.assertEqual(len(err.splitlines()), 1, err)
                    self.assertTrue(err.startswith("reliability.py serve: "), err)
            self.assertEqual(counts(ws), EMPTY)

    def test_a_child_that_times_out_is_killed_reaped_and_yields_no_result(self):
        with workspace() as ws:
            enqueue(ws)
            row = reliability.claim(ws.sender, 0)
            child = timed_out_child()
            with mock.patch("subprocess.Popen", return_value=child) as popen:
                self.assertEqual(reliability.call_tool(ws.root, row, timeout=0.5), (None, None))
            self.assertIn("serve", popen.call_args.args[0])
            self.assert_killed_and_reaped(child)

    def test_a_time_out_through_deliver_makes_external_unknown_and_keeps_idempotent_in_flight(self):
        for mode, expected in (("external", "unknown"), ("idempotent", "inflight")):
            with self.subTest(mode=mode), workspace() as ws:
                enqueue(ws, mode=mode)
                row = reliability.claim(ws.sender, 0)
                child = timed_out_child()
                with mock.patch("subprocess.Popen", return_value=child):
                    result = reliability.deliver(ws.sender, ws.root, row, timeout=0.5)
                self.assertEqual((result["exit_code"], result["response"], result["acknowledged"]), (None, None, False))
                self.assert_killed_and_reaped(child)
                self.assertEqual(state(ws), (expected, 1))
                self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))

    def assert_killed_and_reaped(self, child):
        names = [entry[0] for entry in child.mock_calls]
        self.assertEqual(names.count("kill"), 1)
        self.assertEqual(child.communicate.call_args_list[0].kwargs.get("timeout"), 0.5)
        self.assertIn("communicate", names[names.index("kill") + 1:])  # reaped after the kill

    def test_help_lists_every_command_serve_included_and_dispatch_every_boundary_of_a_delivery(self):
        code, out, _ = cli("--help")  # printed through sys.stdout: the child flushes it before it exits
        self.assertEqual(code, 0)
        for command in ("init", "enqueue", "claim", "dispatch", "deliver", "serve", "snapshot", "reconcile",
                        "resolve", "purge", "unsafe-dispatch-mark-before"):
            self.assertIn(command, out)
        code, out, _ = cli("dispatch", "--help")
        self.assertEqual(code, 0)
        for boundary in ("after_claim", "before_receiver_commit", "after_receiver_commit", "after_response_write",
                         "after_response_before_ack", "after_ack", "before_external_effect", "after_external_effect"):
            self.assertIn(boundary, " ".join(out.split()))

    def test_the_script_run_by_a_fresh_interpreter_exits_0_1_2_and_73(self):
        # The real entry point, `python3 -I -S reliability.py ...` and its sys.exit(main()), once per
        # exit code, side by side; the other tests fork main(argv) as the driver does.
        request = json.dumps({"caller": "agent", "key": "k1", "payload": PAYLOAD, "issued_at": 0, "now": 0}).encode()
        with workspace() as ws, workspace() as other:  # the snapshot reads other, so the crash cannot race it
            commands = {0: ["snapshot", other.root], 1: ["snapshot", ws.path("missing")], 2: ["bogus"],
                        CRASH_EXIT: ["serve", "receive", ws.path("receiver"), "--crash", "after_receiver_commit"]}
            fresh = [[sys.executable, "-I", "-S", SCRIPT, *argv] for argv in commands.values()]
            done = run_experiment.run_together(fresh, request + b"\n")
            self.assertEqual([code for code, _, _ in done], list(commands))
            self.assertEqual(json.loads(done[0][1])["sender"], {"intent_rows": 0, "outbox": [], "resolutions": []})
            self.assertTrue(done[1][2].startswith(b"reliability.py snapshot: "), done[1][2])
            self.assertIn(b"invalid choice", done[2][2])
            self.assertEqual((done[3][1], counts(ws)["tickets"]), (b"", 1))  # committed, then died before replying

    def test_the_tool_childs_command_line_refuses_a_boundary_it_does_not_own(self):
        with workspace() as ws:
            for argv in (("serve", "receive", ws.path("receiver"), "--crash", "after_claim"),
                         ("serve", "receive", ws.path("receiver"), "--crash", "after_external_effect"),
                         ("serve", "nothing", ws.path("receiver")), ("serve",),
                         ("dispatch", ws.root, "--now", 0, "--crash", "after_mark_before_send")):
                with self.subTest(argv=argv[:2]):
                    code, out, err = cli(*argv)
                    self.assertEqual((code, out), (2, ""))
                    self.assertIn("usage", err)
            self.assertEqual(counts(ws), EMPTY)

    def test_dispatch_passes_a_tool_childs_boundary_on_only_to_the_tool_that_owns_it(self):
        with workspace() as ws:
            enqueue(ws)
            ws.close()
            code, out, err = cli("dispatch", ws.root, "--now", 0, "--crash", "after_receiver_commit")
            line = json.loads(out)
            self.assertEqual((code, line["exit_code"], line["status"]), (0, CRASH_EXIT, "inflight"))
            self.assertNotIn("not_reached", line)  # the child died there
            self.assertIn("died at after_receiver_commit (exit 73)", err)
            # An external tool's boundary does not apply to the receiver: it answers, and the line says so.
            code, out, err = cli("dispatch", ws.root, "--now", 11, "--crash", "before_external_effect")
            line = json.loads(out)
            self.assertEqual((code, line["status"], line["not_reached"], err), (0, "done", "before_external_effect", ""))
            # The sender's own boundary, never met when nothing is due.
            code, out, _ = cli("dispatch", ws.root, "--now", 12, "--crash", "after_ack")
            self.assertEqual(json.loads(out), {"now": 12, "not_reached": "after_ack", "status": "nothing due"})

    def test_dispatch_names_the_rows_a_claim_parked_on_its_way_and_only_those(self):
        with workspace() as ws:
            enqueue(ws, "old", mode="external")
            reliability.claim(ws.sender, 0)
            reliability.claim(ws.sender, 10)  # "old" was made unknown before this command
            enqueue(ws, "ext", mode="external", now=20)
            reliability.claim(ws.sender, 20)  # in flight until tick 30, its sender gone
            ws.close()
            code, out, _ = cli("dispatch", ws.root, "--now", 30)
            line = json.loads(out)
            self.assertEqual((code, line["status"]), (0, "nothing due"))
            self.assertEqual([(row["key"], row["state"]) for row in line["parked"]], [("ext", "unknown")])

    def test_deliver_on_the_command_line_refuses_an_attempt_or_a_tick_that_never_was(self):
        with workspace() as ws:
            enqueue(ws, now=5)
            reliability.claim(ws.sender, 5)
            ws.close()
            for attempt, now, said in ((2, 5, "never claimed"), (0, 5, "never claimed"), (1, 4, "later than now")):
                with self.subTest(attempt=attempt, now=now):
                    code, out, err = cli("deliver", ws.root, "agent", "k1", "--attempt", attempt, "--now", now)
                    self.assertEqual((code, out), (1, ""))
                    self.assertIn(said, err)
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("inflight", 1), 0))  # nothing was sent


# === 第一篇 §5: atomic claims, attempt numbers and leases ===

class ClaimTest(Case):
    """§5 两个工作进程同时醒来: one claimer wins; lease 10, recovery at 11; stale acknowledgements refused."""

    def test_eight_claimer_processes_released_together_produce_exactly_one_winner(self):
        with workspace() as ws:
            with contextlib.closing(reliability.connect(ws.path("sender"))) as setup:
                reliability.enqueue(setup, "agent", "k1", PAYLOAD, now=0)

            def claimer(wait):
                with contextlib.closing(reliability.connect(ws.path("sender"))) as connection:
                    wait()
                    row = reliability.claim(connection, 0)
                return row and row["attempt"]
            self.assertEqual(sorted(race(claimer), key=str), [1] + [None] * 7)
            self.assertEqual(state(ws), ("inflight", 1))

    def test_the_barrier_catches_a_non_atomic_claim_with_more_than_one_winner(self):
        # The counterexample the race above would expose: SELECT, then UPDATE, each in autocommit.
        with workspace() as ws:
            with contextlib.closing(reliability.connect(ws.path("sender"))) as setup:
                reliability.enqueue(setup, "agent", "k1", PAYLOAD, now=0)

            def non_atomic(wait):
                with contextlib.closing(sqlite3.connect(ws.path("sender"), isolation_level=None,
                                                        timeout=WATCHDOG)) as connection:
                    wait()
                    row = connection.execute("SELECT attempts FROM outbox WHERE key = 'k1' AND state = 'pending'")\
                        .fetchone()
                    wait()  # every claimer has looked before any writes: what a start barrier makes happen
                    if row is None:
                        return None
                    connection.execute("UPDATE outbox SET state = 'inflight', attempts = ? WHERE key = 'k1'",
                                       (row[0] + 1,))
                    return row[0] + 1
            winners = [result for result in race(non_atomic) if result is not None]
            self.assertGreater(len(winners), 1)
            self.assertEqual(winners, [1] * 8)

    def test_lease_is_10_ticks_a_claim_at_0_is_reclaimable_at_10_and_recovery_at_11_delivers(self):
        self.assertEqual(LEASE_TICKS, 10)
        with workspace() as ws:
            self.assertIsNone(reliability.claim(ws.sender, 0))  # nothing enqueued
            enqueue(ws)
            first = reliability.claim(ws.sender, 0)
            self.assertEqual({k: first[k] for k in ("caller", "key", "attempt", "mode", "payload")},
                             {"caller": "agent", "key": "k1", "attempt": 1, "mode": "idempotent", "payload": PAYLOAD})
            self.assertEqual(outbox(ws)["lease_until"], 10)
            self.assertIsNone(reliability.claim(ws.sender, 9))
            self.assertEqual(state(ws), ("inflight", 1))
            self.assertEqual(reliability.claim(ws.sender, 10)["attempt"], 2)
        with workspace() as ws:  # the article's recovery: a sender that died after its claim at tick 0
            # Its tool child is started as in production, by start_child: `python3 -I -S reliability.py serve ...`.
            enqueue(ws)
            reliability.claim(ws.sender, 0)
            self.assertIsNone(reliability.dispatch(ws.sender, ws.root, 9))
            result = reliability.dispatch(ws.sender, ws.root, 11)
            self.assertEqual((result["attempt"], result["acknowledged"]), (2, True))
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("done", 2), 1))

    def test_a_stale_acknowledgement_is_refused_while_the_current_one_succeeds(self):
        with workspace() as ws:
            enqueue(ws)
            response = receive(ws)
            self.assertEqual(reliability.claim(ws.sender, 0)["attempt"], 1)
            self.assertEqual(reliability.claim(ws.sender, 11)["attempt"], 2)
            self.assertIs(reliability.acknowledge(ws.sender, "agent", "k1", 1, response), False)
            self.assertEqual((outbox(ws)["state"], outbox(ws)["response"]), ("inflight", None))
            self.assertIs(reliability.acknowledge(ws.sender, "agent", "k1", 2, response), True)
            self.assertEqual((state(ws), outbox(ws)["response"]), (("done", 2), response))
            # Asked again, as after a reply lost on its way: the same answer, and nothing changes.
            self.assertIs(reliability.acknowledge(ws.sender, "agent", "k1", 2, response), True)
            other = dict(response, ticket_id=response["ticket_id"] + 1)
            for attempt, answer in ((1, response), (2, other)):  # a stale attempt, another answer
                self.assertIs(reliability.acknowledge(ws.sender, "agent", "k1", attempt, answer), False)
            self.assertEqual((state(ws), outbox(ws)["response"]), (("done", 2), response))

    def test_forged_or_mismatched_responses_raise_and_never_mark_done(self):
        with workspace() as ws:
            enqueue(ws)
            good = receive(ws)
            attempt = reliability.claim(ws.sender, 0)["attempt"]
            forged = {
                "wrong key": dict(good, key="k2"), "wrong caller": dict(good, caller="mallory"),
                "wrong digest": dict(good, digest=reliability.canonical(OTHER_PAYLOAD)[1]),
                "True as ticket_id": dict(good, ticket_id=True), "0 as ticket_id": dict(good, ticket_id=0),
                "negative ticket_id": dict(good, ticket_id=-1), "float ticket_id": dict(good, ticket_id=1.0),
                "str ticket_id": dict(good, ticket_id="1"), "extra field": dict(good, status="ok"),
                "missing field": {k: v for k, v in good.items() if k != "digest"},
                "conflict report": {"error": "conflict", "message": "x"}, "list": [good], "None": None,
                "JSON text": json.dumps(good),
            }
            for label, response in forged.items():
                with self.subTest(response=label):
                    with self.assertRaises(ValueError):
                        reliability.acknowledge(ws.sender, "agent", "k1", attempt, response)
                    with self.assertRaises(ValueError):
                        reliability.check_response(response, "agent", "k1", good["digest"])
                    self.assertEqual((outbox(ws)["state"], outbox(ws)["response"]), ("inflight", None))
            with self.assertRaises(ValueError):  # an acknowledgement for a request that was never made
                reliability.acknowledge(ws.sender, "agent", "k2", attempt, dict(good, key="k2"))
            self.assertIs(reliability.acknowledge(ws.sender, "agent", "k1", attempt, good), True)

    def test_same_key_other_payload_at_the_receiver_blocks_the_row_and_keeps_the_original_ticket(self):
        with workspace() as ws:
            original = receive(ws, payload=OTHER_PAYLOAD)
            receipts = rows(ws.receiver, "receipts")
            enqueue(ws)
            ws.close("receiver")
            result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher())
            self.assertEqual((result["exit_code"], result["acknowledged"], result["response"]["error"]),
                             (0, False, "conflict"))
            self.assertEqual(state(ws), ("blocked", 1))
            self.assertIsNone(reliability.claim(ws.sender, 1000))
            self.assertEqual(rows(ws.receiver, "receipts"), receipts)
            self.assertEqual(receive(ws, payload=OTHER_PAYLOAD), original)

    def test_eight_receiver_processes_on_one_request_make_one_ticket_one_receipt_one_answer(self):
        with workspace() as ws:
            def receiver(wait):
                with contextlib.closing(reliability.connect(ws.path("receiver"))) as connection:
                    wait()
                    shared = written(lambda: reliability.receive(connection, "agent", "shared", PAYLOAD,
                                                                 issued_at=0, now=0))
                    for i in range(10):  # and each writes its own keys while the others do
                        written(lambda: reliability.receive(connection, "agent", f"{os.getpid()}-{i}", {"i": i},
                                                            issued_at=0, now=0))
                return shared
            answers = race(receiver)
            self.assertEqual(len({json.dumps(answer, sort_keys=True) for answer in answers}), 1)
            self.assertEqual(answers[0]["ticket_id"], ws.receiver.execute(
                "SELECT ticket_id FROM receipts WHERE key = 'shared'").fetchone()[0])
            self.assertEqual(ws.receiver.execute("SELECT count(*) FROM tickets WHERE key = 'shared'").fetchone()[0], 1)
            self.assertEqual(counts(ws), dict(EMPTY, tickets=81, receipts=81))
            self.assert_integrity(ws)


class ManyAgentsTest(Case):
    """§5, with many agents on one machine: processes open, write, close and checkpoint one
    receiver.db at once while some are SIGKILLed, and every open succeeds and nothing is lost."""

    def test_agents_opening_writing_closing_and_killed_at_once_lose_nothing_and_all_connect(self):
        with workspace() as ws:
            database, folder = ws.path("receiver"), ws.root
            ws.close()
            results = race(functools.partial(_many_agents, database, folder), MANY_AGENTS, may_die=True)
            self.assertEqual([r for r in results if r not in ("done", None)], [])
            self.assertIn(None, results)  # the seed kills some agents, and each kill is a SIGKILL
            answers = {}
            for index in range(MANY_AGENTS):
                with open(os.path.join(folder, f"agent-{index}"), "rb") as journal:
                    for line in journal.read().splitlines():
                        answer = json.loads(line)
                        answers.setdefault(answer["key"], set()).add(answer["ticket_id"])
            receipts = dict(ws.receiver.execute("SELECT key, ticket_id FROM receipts"))
            tickets = dict(ws.receiver.execute("SELECT id, key FROM tickets"))
            # Every answer an agent was given is committed: one ticket per key, named by its receipt.
            self.assertEqual({key: ids for key, ids in answers.items() if ids != {receipts.get(key)}}, {})
            self.assertEqual(sorted(tickets), sorted(receipts.values()))
            self.assertEqual({tickets[ticket] for ticket in receipts.values()}, set(receipts))
            self.assert_integrity(ws)


# === 第一篇 §6: a tool without idempotency leaves an honest unknown ===

class UnknownTest(Case):
    """§6 接收端不配合时，要敢于留下 unknown: never retried automatically, whatever the tool did."""

    def test_external_crash_before_or_after_the_effect_is_unknown_exit_73_and_never_retried(self):
        for boundary, tickets in (("before_external_effect", 0), ("after_external_effect", 1)):
            with self.subTest(boundary), workspace() as ws:
                enqueue(ws, mode="external")
                result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher(boundary))
                self.assertEqual((result["exit_code"], result["acknowledged"]), (CRASH_EXIT, False))
                for now in (11, 1000):
                    self.assertIsNone(reliability.dispatch(ws.sender, ws.root, now))
                self.assertEqual((state(ws), counts(ws)["external"]), (("unknown", 1), tickets))
                self.assertEqual(ws.sender.execute("SELECT payload FROM requests").fetchone()[0],
                                 reliability.canonical(PAYLOAD)[0])  # kept for reconciliation

    def test_an_expired_inflight_external_row_becomes_unknown_and_the_queue_moves_on(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            self.assertEqual(reliability.claim(ws.sender, 0)["mode"], "external")
            enqueue(ws, "k2")
            self.assertEqual(reliability.claim(ws.sender, 11)["key"], "k2")
            self.assertEqual(state(ws), ("unknown", 1))
            self.assertEqual(reliability.claim(ws.sender, 1000)["key"], "k2")  # never the unknown row again
            self.assertIsNone(reliability.claim(ws.sender, 1000))
            self.assertEqual(state(ws), ("unknown", 1))


    def test_an_external_row_in_flight_inside_its_lease_is_left_alone(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            reliability.claim(ws.sender, 0)  # leased until tick 10
            for now in (0, 5, 9):
                self.assertIsNone(reliability.claim(ws.sender, now))
                self.assertEqual(state(ws), ("inflight", 1))
            self.assertIsNone(reliability.claim(ws.sender, 10))  # the lease has ended: unknown, not resent
            self.assertEqual(state(ws), ("unknown", 1))

    def test_retrying_an_unknown_call_anyway_duplicates_the_external_ticket(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            reliability.dispatch(ws.sender, ws.root, 0, start=launcher("after_external_effect"))
            answer, code = reliability.unsafe_retry_unknown(ws.sender, ws.root, "agent", "k1", start=launcher())
            self.assertEqual((code, answer["ticket_id"]), (0, 2))
            self.assertEqual((state(ws), counts(ws)["external"]), (("unknown", 1), 2))

    def test_a_locale_without_utf8_does_not_garble_a_chinese_key_in_either_mode(self):
        # Not LC_ALL=C alone: by default C means UTF-8 and would prove nothing (see LEGACY).
        probe = subprocess.run([sys.executable, *LEGACY[0], "-c",
                                "import sys; print(sys.stdin.encoding, sys.stdout.encoding)"],
                               env=LEGACY[1], stdin=subprocess.DEVNULL, capture_output=True, check=True)
        self.assertEqual(probe.stdout.strip(), b"iso8859-1 iso8859-1")  # the child's text streams really are not UTF-8
        for mode, database in (("idempotent", "receiver"), ("external", "external")):
            with self.subTest(mode=mode), workspace() as ws:
                payload = {"title": "打印机卡纸", "备注": "三楼"}
                enqueue(ws, "工单-1", payload, mode=mode)
                result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher(legacy=True))
                self.assertEqual((result["exit_code"], result["acknowledged"]), (0, True))
                self.assertEqual(state(ws, "工单-1"), ("done", 1))
                self.assertEqual(getattr(ws, database).execute("SELECT key, payload FROM tickets").fetchall(),
                                 [("工单-1", reliability.canonical(payload)[0])])

    def test_the_command_line_reads_and_prints_utf8_whatever_the_locale(self):
        # Typed in a C locale, non-ASCII arguments reach Python as surrogates: read as the UTF-8 typed.
        with workspace() as ws:
            ws.close()
            legacy = lambda *argv: [sys.executable, *LEGACY[0], SCRIPT, *map(str, argv)]
            [(code, out, err)] = run_experiment.run_together(
                [legacy("enqueue", ws.root, "代理", "工单-1", '{"title": "打印机卡纸"}', "--now", 0)], env=LEGACY[1])
            self.assertEqual((code, err), (0, b""))
            self.assertEqual(json.loads(out.decode("utf-8"))["key"], "工单-1")
            [(code, out, err)] = run_experiment.run_together([legacy("dispatch", ws.root, "--now", 0)], env=LEGACY[1])
            self.assertEqual((code, err), (0, b""))
            self.assertEqual(json.loads(out.decode("utf-8"))["response"]["caller"], "代理")  # the sender read it right
            self.assertEqual(outbox(ws, "工单-1", caller="代理")["state"], "done")


# === beyond 第一篇: leaving unknown, retention, the opt-in queue, files and ticks ===

class RecordedAttemptTest(Case):
    """Beyond 第一篇: who may still act for an attempt is recorded, for reconcile()."""

    def test_deliver_records_the_tool_pid_before_sending_and_clears_both_when_it_marks_unknown(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            row = reliability.claim(ws.sender, 0)
            seen, started = [], []

            def observed(argv):  # a real child; we look at the database as its request leaves
                child = launcher("before_external_effect", started=started)(argv)
                send = child.communicate
                child.communicate = lambda input=None, timeout=None: (
                    seen.append(pids(ws)) if input is not None else None, send(input, timeout))[1]
                return child
            result = reliability.deliver(ws.sender, ws.root, row, start=observed)
            self.assertEqual(result["exit_code"], CRASH_EXIT)
            self.assertEqual(seen, [(os.getpid(), started[0].pid)])
            self.assertEqual((state(ws), pids(ws)), (("unknown", 1), (None, None)))

    def test_claim_records_its_process_as_owner_and_an_idempotent_delivery_records_no_tool(self):
        with workspace() as ws:
            enqueue(ws)
            set_pids(ws, 1, 1)  # left over: a claim must replace both
            row = reliability.claim(ws.sender, 0)
            self.assertEqual(pids(ws), (os.getpid(), None))
            reliability.deliver(ws.sender, ws.root, row, start=launcher("before_receiver_commit"))
            self.assertEqual((state(ws), pids(ws)), (("inflight", 1), (os.getpid(), None)))

    def test_a_late_deliver_sends_nothing_for_an_external_row_that_is_no_longer_its_own(self):
        with workspace() as ws:
            unknown_external(ws)
            row = reliability._claimed_row(ws.sender, "agent", "k1", 1, 0)
            for attempt in (1, 7):
                with self.subTest(attempt=attempt):
                    started = []
                    result = reliability.deliver(ws.sender, ws.root, dict(row, attempt=attempt),
                                                 start=launcher(started=started))
                    self.assertIn("refused", result)
                    self.assertEqual(started[0].returncode, -signal.SIGKILL)  # killed before any request
            self.assertEqual((state(ws), counts(ws)["external"]), (("unknown", 1), 0))

    def test_a_second_delivery_of_an_attempt_whose_tool_is_still_running_sends_nothing_and_keeps_its_pids(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            row = reliability.claim(ws.sender, 0)
            tool = LiveChild(self)  # the first delivery's tool child, still running
            set_pids(ws, os.getpid(), tool.pid)
            started = []
            result = reliability.deliver(ws.sender, ws.root, row, start=launcher("before_external_effect",
                                                                                   started=started))
            self.assertIn("refused", result)
            self.assertEqual(started[0].returncode, -signal.SIGKILL)  # killed before any request
            self.assertEqual((state(ws), pids(ws), counts(ws)["external"]), (("inflight", 1), (os.getpid(), tool.pid), 0))
            self.assertIsNone(reliability.claim(ws.sender, 11))  # the expired external row becomes unknown
            tool_db = ws.external
            self.assertEqual(reliability.reconcile(ws.sender, tool_db, "agent", "k1", 11)["status"], "unknown")
            tool.end()  # only once the tool is gone may absence count
            self.assertEqual(reliability.reconcile(ws.sender, tool_db, "agent", "k1", 11)["status"], "pending")



    def test_an_external_reply_that_answers_another_request_makes_the_row_unknown(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            row = reliability.claim(ws.sender, 0)
            other = lambda request: {"caller": "agent", "key": "k2", "digest": row["digest"], "ticket_id": 1}
            result = reliability.deliver(ws.sender, ws.root, row, start=answering(other))
            self.assertEqual((result["exit_code"], result["acknowledged"], result["response"]), (0, False, None))
            self.assertEqual((state(ws), pids(ws)), (("unknown", 1), (None, None)))  # it may have acted: never resent

    def test_giving_up_an_attempt_changes_only_that_attempt_and_only_while_in_flight(self):
        refusal = {"error": "conflict", "message": "another payload"}
        with workspace() as ws:
            enqueue(ws)
            first = reliability.claim(ws.sender, 0)
            reliability.claim(ws.sender, 11)  # attempt 2 holds the row now
            reliability.deliver(ws.sender, ws.root, first, start=answering(refusal))  # attempt 1's late refusal
            self.assertEqual((state(ws), outbox(ws)["response"]), (("inflight", 2), None))
            done = receive(ws)
            ws.close("receiver")
            self.assertIs(reliability.acknowledge(ws.sender, "agent", "k1", 2, done), True)
            reliability.deliver(ws.sender, ws.root, dict(first, attempt=2), start=answering(refusal))
            self.assertEqual((state(ws), outbox(ws)["response"]), (("done", 2), done))  # done stays done

class LiveChild:
    """A real child process that lives until end() closes its stdin and reaps it."""

    def __init__(self, test):
        self.process = subprocess.Popen([sys.executable, "-I", "-S", "-c", "import sys; sys.stdin.read()"],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        self.pid = self.process.pid
        test.addCleanup(self.end)

    def end(self):
        if self.process.returncode is None:
            self.process.communicate()  # EOF: it exits, and is reaped (no zombie counts as alive)


class ReconcilingConnection(sqlite3.Connection):
    """A real connection to external.db that lets a person's resolve() land just before its lookup."""
    before_lookup = None

    def execute(self, sql, *args):
        if sql.startswith("SELECT id, digest FROM tickets") and self.before_lookup:
            hook, self.before_lookup = self.before_lookup, None
            hook()
        return super().execute(sql, *args)


class ReconcileTest(Case):
    """Beyond 第一篇: unknown is settled from the tool's own records, or once nobody can act."""

    def test_one_matching_ticket_makes_the_row_done_with_it_and_creates_none(self):
        with workspace() as ws:
            unknown_external(ws)
            ticket = reliability.external_create_ticket(ws.external, "agent", "k1", PAYLOAD)  # the tool did act
            self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", "k1", 0),  # even inside the lease
                             {"status": "done", "response": ticket})
            self.assertEqual((state(ws), outbox(ws)["response"], counts(ws)["external"]), (("done", 1), ticket, 1))
            self.assertIsNone(reliability.claim(ws.sender, 1000))

    def test_absent_while_the_lease_runs_stays_unknown_and_at_its_end_goes_back_to_pending(self):
        with workspace() as ws:
            unknown_external(ws)
            before = sender_rows(ws)
            self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", "k1", 9)["status"], "unknown")
            self.assertEqual(sender_rows(ws), before)
            self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", "k1", 10)["status"], "pending")
            self.assertEqual((state(ws), pids(ws), audit(ws)), (("pending", 1), (None, None), []))
            ws.close("external")
            retry = reliability.dispatch(ws.sender, ws.root, 11, start=launcher())
            self.assertEqual((retry["attempt"], retry["acknowledged"]), (2, True))
            self.assertEqual((state(ws), counts(ws)["external"]), (("done", 2), 1))

    def test_absent_but_a_live_owner_or_tool_process_keeps_it_unknown_until_that_process_is_gone(self):
        with workspace() as ws:
            for column in ("owner_pid", "tool_pid"):
                unknown_external(ws, key=column)
            for column in ("owner_pid", "tool_pid"):
                with self.subTest(alive=column):
                    child = LiveChild(self)
                    set_pids(ws, *((child.pid, None) if column == "owner_pid" else (None, child.pid)), key=column)
                    before = sender_rows(ws)
                    self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", column, 1000)["status"],
                                     "unknown")
                    self.assertEqual(sender_rows(ws), before)
                    child.end()  # the same pid, now gone
                    self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", column, 1000)["status"],
                                     "pending")

    def test_its_own_process_as_owner_counts_as_gone_unless_it_is_delivering_that_attempt(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            reliability.claim(ws.sender, 0)
            self.assertIsNone(reliability.claim(ws.sender, 10))  # the lease ended: unknown, owner still this process
            self.assertEqual((state(ws), pids(ws)), (("unknown", 1), (os.getpid(), None)))
            reliability._DELIVERING.add(("agent", "k1", 1))
            try:  # while this process delivers attempt 1 it can still act
                self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", "k1", 1000)["status"],
                                 "unknown")
            finally:
                reliability._DELIVERING.discard(("agent", "k1", 1))
            self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", "k1", 1000)["status"], "pending")
            self.assertEqual((state(ws), pids(ws)), (("pending", 1), (None, None)))


    def test_deliver_counts_itself_as_able_to_act_while_it_delivers(self):
        # While deliver() runs its attempt, this process's own reconcile() must not take absence as proof.
        with workspace() as ws:
            enqueue(ws, mode="external")
            row = reliability.claim(ws.sender, 0)
            seen = []

            def start(argv):  # as the tool child starts: the lease ends, a claim makes the row unknown
                self.assertIsNone(reliability.claim(ws.sender, 10))
                seen.append(reliability.reconcile(ws.sender, ws.external, "agent", "k1", 1000)["status"])
                ws.close("external")  # the tool child opens it
                return launcher()(argv)
            reliability.deliver(ws.sender, ws.root, row, start=start)
            self.assertEqual(seen, ["unknown"])
            self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", "k1", 1000)["status"], "pending")

    def test_reconcile_settles_only_the_unknown_attempt_it_looked_at(self):
        with workspace() as ws:
            unknown_external(ws)  # attempt 1 unknown; nobody can act for it any more
            with contextlib.closing(sqlite3.connect(ws.path("external"), factory=ReconcilingConnection)) as tool:
                # meanwhile: retried by a person, claimed again, and attempt 2 is unknown too
                tool.before_lookup = lambda: (set_state(ws, "unknown"), ws.sender.execute(
                    "UPDATE outbox SET attempts = 2, owner_pid = NULL"))
                result = reliability.reconcile(ws.sender, tool, "agent", "k1", 1000)
            self.assertEqual((result["status"], state(ws)), ("unknown", ("unknown", 2)))  # attempt 2 not touched

    def test_reconcile_decides_who_may_still_act_before_it_looks_the_ticket_up(self):
        # Absence proves nothing if a process could still act after the look-up: so who can act is
        # decided first.  Here the tool child ends during the look-up; decided later, it would look gone.
        with workspace() as ws:
            unknown_external(ws)
            tool_child = LiveChild(self)
            set_pids(ws, None, tool_child.pid)
            with contextlib.closing(sqlite3.connect(ws.path("external"), factory=ReconcilingConnection)) as tool:
                tool.before_lookup = tool_child.end
                self.assertEqual(reliability.reconcile(ws.sender, tool, "agent", "k1", 1000)["status"], "unknown")
            self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", "k1", 1000)["status"], "pending")

    def test_tickets_that_do_not_settle_it_leave_the_row_unknown_even_when_nobody_can_act(self):
        with workspace() as ws:
            for label, payloads in {"two tickets": [PAYLOAD, PAYLOAD], "other digest": [OTHER_PAYLOAD]}.items():
                with self.subTest(label):
                    unknown_external(ws, key=label)
                    for payload in payloads:
                        reliability.external_create_ticket(ws.external, "agent", label, payload)
                    before = sender_rows(ws)
                    self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", label, 1000)["status"],
                                     "unknown")
                    self.assertEqual(sender_rows(ws), before)

    def test_lookup_is_by_reference_so_another_key_or_caller_is_no_evidence(self):
        with workspace() as ws:
            unknown_external(ws)
            reliability.external_create_ticket(ws.external, "agent", "k2", PAYLOAD)
            reliability.external_create_ticket(ws.external, "other", "k1", PAYLOAD)
            self.assertEqual(reliability.lookup_external(ws.external, "agent", "k1"), [])
            self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", "k1", 1000)["status"], "pending")
            first = reliability.external_create_ticket(ws.external, "agent", "k3", PAYLOAD)
            second = reliability.external_create_ticket(ws.external, "agent", "k3", OTHER_PAYLOAD)
            self.assertEqual(reliability.lookup_external(ws.external, "agent", "k3"), [first, second])  # oldest first

    def test_a_row_that_is_not_unknown_is_returned_as_is_and_a_bad_request_raises(self):
        with workspace() as ws:
            with self.assertRaises(ValueError):
                reliability.reconcile(ws.sender, ws.external, "agent", "missing", 1000)
            enqueue(ws, mode="external")
            reliability.external_create_ticket(ws.external, "agent", "k1", PAYLOAD)  # would settle an unknown row
            for row_state in ("pending", "inflight", "done", "blocked", "abandoned"):
                with self.subTest(state=row_state):
                    set_state(ws, row_state)
                    before = sender_rows(ws)
                    self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", "k1", 1000)["status"],
                                     row_state)
                    self.assertEqual(sender_rows(ws), before)
            set_state(ws, "unknown")
            for now in (-1, True, 1.5, "9", None, reliability.MAX_TICK + 1):
                with self.subTest(now=now), self.assertRaises(ValueError):
                    reliability.reconcile(ws.sender, ws.external, "agent", "k1", now)

    def test_a_persons_decision_landing_first_wins_and_reconcile_reports_it(self):
        with workspace() as ws:
            unknown_external(ws)
            reliability.external_create_ticket(ws.external, "agent", "k1", PAYLOAD)
            with contextlib.closing(sqlite3.connect(ws.path("external"), factory=ReconcilingConnection)) as tool:
                tool.before_lookup = lambda: reliability.resolve(ws.sender, "agent", "k1", "abandon", by="alice",
                                                                 why="closed by hand")
                result = reliability.reconcile(ws.sender, tool, "agent", "k1", 1000)
            self.assertEqual((result["status"], state(ws)), ("abandoned", ("abandoned", 1)))

    def test_a_row_that_leaves_unknown_before_the_lookup_is_never_settled_by_it(self):
        for landed in ("pending", "inflight"):  # a person's retry, or in flight again under that attempt
            with self.subTest(landed), workspace() as ws:
                unknown_external(ws)
                reliability.external_create_ticket(ws.external, "agent", "k1", PAYLOAD)  # would settle it
                with contextlib.closing(sqlite3.connect(ws.path("external"), factory=ReconcilingConnection)) as tool:
                    tool.before_lookup = lambda: set_state(ws, landed)
                    result = reliability.reconcile(ws.sender, tool, "agent", "k1", 1000)
                self.assertEqual((result, state(ws)), ({"status": landed, "reason": "settled by someone else meanwhile"},
                                                       (landed, 1)))

    def test_alive_counts_this_process_and_only_a_missing_pid_as_gone(self):
        self.assertTrue(reliability._alive(os.getpid()))
        self.assertFalse(reliability._alive(4194304))  # above Linux's pid_max



    @unittest.skipUnless(hasattr(os, "fork"), "asks from a forked child of another user")
    def test_alive_counts_a_process_of_another_user_as_alive(self):
        # kill(pid, 0) on another user's process raises PermissionError: it exists, so it may act.
        self.assertIs(run_experiment.run_forked(_alive_as_nobody, os.getpid()), True)

class ResolveTest(Case):
    """Beyond 第一篇: a person's decision on unknown or blocked, with an audit row never rewritten."""

    def evidence(self, ws):
        reliability.external_create_ticket(ws.external, "agent", "k1", PAYLOAD)
        return reliability.lookup_external(ws.external, "agent", "k1")[0]

    def test_done_with_the_tools_response_stores_it_with_one_audit_row(self):
        with workspace() as ws:
            unknown_external(ws)
            evidence = self.evidence(ws)
            self.assertEqual(reliability.resolve(ws.sender, "agent", "k1", "done", by="alice", why="seen in the UI",
                                                 evidence=evidence), {"status": "done", "resolution": 1})
            self.assertEqual((outbox(ws)["state"], outbox(ws)["response"]), ("done", evidence))
            self.assertEqual(audit(ws), [(1, "agent", "k1", 1, "done", "alice", "seen in the UI",
                                          reliability._dumps(evidence))])
            self.assertIsNone(reliability.claim(ws.sender, 1000))

    def test_retry_returns_the_row_to_pending_under_the_same_key(self):
        with workspace() as ws:
            unknown_external(ws)
            set_pids(ws, os.getpid(), os.getpid())  # a person may decide while a process lives
            self.assertEqual(reliability.resolve(ws.sender, "agent", "k1", "retry", by="bob", why="tool shows nothing"),
                             {"status": "pending", "resolution": 1})
            self.assertEqual((outbox(ws)["state"], outbox(ws)["response"], pids(ws)), ("pending", None, (None, None)))
            self.assertEqual(audit(ws), [(1, "agent", "k1", 1, "retry", "bob", "tool shows nothing", None)])
            self.assertEqual(reliability.claim(ws.sender, 0)["attempt"], 2)

    def test_a_row_blocked_after_max_attempts_gets_real_attempts_again_after_retry(self):
        self.assertEqual(MAX_ATTEMPTS, 10)
        with workspace() as ws:
            enqueue(ws)
            for attempt in range(1, MAX_ATTEMPTS + 1):
                self.assertEqual(reliability.claim(ws.sender, (attempt - 1) * LEASE_TICKS)["attempt"], attempt)
            self.assertIsNone(reliability.claim(ws.sender, MAX_ATTEMPTS * LEASE_TICKS))
            self.assertEqual(state(ws), ("blocked", MAX_ATTEMPTS))
            reliability.resolve(ws.sender, "agent", "k1", "retry", by="bob", why="the receiver is back")
            result = reliability.dispatch(ws.sender, ws.root, MAX_ATTEMPTS * LEASE_TICKS, start=launcher())
            self.assertEqual((result["attempt"], result["acknowledged"]), (MAX_ATTEMPTS + 1, True))
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("done", MAX_ATTEMPTS + 1), 1))

    def test_abandon_parks_an_unknown_or_blocked_row_for_good(self):
        with workspace() as ws:
            unknown_external(ws)
            self.assertEqual(reliability.resolve(ws.sender, "agent", "k1", "abandon", by="carol", why="not needed"),
                             {"status": "abandoned", "resolution": 1})
            self.assertIsNone(reliability.claim(ws.sender, 1000))
            enqueue(ws, "k2")
            set_state(ws, "blocked", key="k2")
            self.assertEqual(reliability.resolve(ws.sender, "agent", "k2", "abandon", by="dan", why="expired"),
                             {"status": "abandoned", "resolution": 2})
            self.assertEqual((outbox(ws)["state"], outbox(ws, "k2")["state"]), ("abandoned", "abandoned"))

    def test_invalid_decisions_are_refused_with_nothing_changed(self):
        with workspace() as ws:
            unknown_external(ws)
            evidence = self.evidence(ws)
            refused = {
                "done without evidence": dict(decision="done"),
                "retry with evidence": dict(decision="retry", evidence=evidence),
                "abandon with evidence": dict(decision="abandon", evidence=evidence),
                "unknown decision": dict(decision="close"), "decision in capitals": dict(decision="DONE", evidence=evidence),
                "no decision": dict(decision=None), "empty by": dict(decision="abandon", by=""),
                "blank by": dict(decision="abandon", by="   "), "by not a str": dict(decision="abandon", by=7),
                "by too long": dict(decision="abandon", by="x" * 1001), "empty why": dict(decision="abandon", why=""),
                "why None": dict(decision="abandon", why=None),
                "evidence for another key": dict(decision="done", evidence=dict(evidence, key="k2")),
                "evidence for another caller": dict(decision="done", evidence=dict(evidence, caller="other")),
                "evidence for another payload": dict(decision="done", evidence=dict(
                    evidence, digest=reliability.canonical(OTHER_PAYLOAD)[1])),
                "bool ticket id": dict(decision="done", evidence=dict(evidence, ticket_id=True)),
                "evidence with an extra field": dict(decision="done", evidence=dict(evidence, status="ok")),
            }
            before = sender_rows(ws)
            for label, arguments in refused.items():
                arguments = dict({"by": "alice", "why": "because"}, **arguments)
                with self.subTest(label), self.assertRaises(ValueError):
                    reliability.resolve(ws.sender, "agent", "k1", arguments.pop("decision"), **arguments)
                self.assertEqual(sender_rows(ws), before)
                self.assertFalse(ws.sender.in_transaction)
            with self.assertRaises(ValueError):
                reliability.resolve(ws.sender, "agent", "missing", "abandon", by="alice", why="because")
            for row_state in ("pending", "inflight", "done", "abandoned"):  # only unknown or blocked rows
                with self.subTest(state=row_state), self.assertRaises(ValueError):
                    set_state(ws, row_state)
                    reliability.resolve(ws.sender, "agent", "k1", "abandon", by="alice", why="because")
            self.assertEqual(audit(ws), [])

    def test_the_audit_row_cannot_be_updated_deleted_or_replaced_even_through_a_raw_connection(self):
        # INSERT OR REPLACE deletes the conflicting row without firing DELETE triggers
        # (recursive_triggers is off), so only the BEFORE INSERT trigger on a taken id stops it.
        with workspace() as ws:
            unknown_external(ws)
            reliability.resolve(ws.sender, "agent", "k1", "abandon", by="carol", why="no longer needed")
            recorded = audit(ws)
            with raw(ws.path("sender")) as tamper:
                for sql in ("UPDATE resolutions SET reason = 'rewritten'", "UPDATE resolutions SET decision = 'retry'",
                            "DELETE FROM resolutions",
                            "INSERT OR REPLACE INTO resolutions (id, caller, key, attempt, decision, decided_by, reason)"
                            " VALUES (1, 'agent', 'k1', 1, 'retry', 'mallory', 'rewritten')"):
                    with self.subTest(sql), self.assertRaises(sqlite3.IntegrityError):
                        tamper.execute(sql)
            self.assertEqual(audit(ws), recorded)

    def test_the_command_line_prints_one_json_line_and_a_refusal_exits_1_with_one_line(self):
        with workspace() as ws:
            for key, tick in (("old", 10), ("new", 60)):
                receive(ws, key, now=tick)
            unknown_external(ws)
            ws.close()
            self.assertEqual(cli("purge", ws.root, "--now", 100, "--window", 50),
                             (0, '{"deleted":1,"low_water":50,"status":"purged"}\n', ""))
            self.assertEqual(cli("resolve", ws.root, "agent", "k1", "abandon", "--by", "x", "--why", "y"),
                             (0, '{"resolution":1,"status":"abandoned"}\n', ""))
            code, out, err = cli("resolve", ws.root, "agent", "k1", "retry", "--by", "x", "--why", "y")
            self.assertEqual((code, out, len(err.splitlines())), (1, "", 1))
            self.assertTrue(err.startswith("reliability.py resolve: "), err)
            self.assertEqual((outbox(ws)["state"], len(audit(ws))), ("abandoned", 1))


class RetentionTest(Case):
    """Beyond 第一篇 §7: receipts are purged under a low-water mark; a late replay is refused as Expired."""

    def receipts(self, ws):
        return ws.receiver.execute("SELECT key, tick FROM receipts ORDER BY key").fetchall()

    def low_water(self, ws):
        return ws.receiver.execute("SELECT low_water FROM retention").fetchone()[0]

    def test_purge_deletes_exactly_the_receipts_older_than_the_window_and_sets_the_mark(self):
        with workspace() as ws:
            for key, tick in (("old", 49), ("edge", 50), ("new", 60)):
                receive(ws, key, issued_at=40, now=tick)
            self.assertEqual(reliability.purge(ws.receiver, 100, 50), {"deleted": 1, "low_water": 50})
            self.assertEqual((self.receipts(ws), self.low_water(ws)), ([("edge", 50), ("new", 60)], 50))
            self.assertEqual(counts(ws)["tickets"], 3)  # tickets are the effect: never purged
            self.assertEqual(reliability.purge(ws.receiver, 150, 100), {"deleted": 0, "low_water": 50})

    def test_purge_refuses_bad_arguments_and_a_mark_that_would_move_backwards(self):
        with workspace() as ws:
            receive(ws, now=10)
            for window in (0, -1, True, 1.5, "50", None):
                with self.subTest(window=window), self.assertRaises(ValueError):
                    reliability.purge(ws.receiver, 100, window)
            for now in (-1, True, 1.5, "100", None, 2 ** 64):
                with self.subTest(now=now), self.assertRaises(ValueError):
                    reliability.purge(ws.receiver, now, 50)
            reliability.purge(ws.receiver, 60, 50)
            self.assertEqual((self.receipts(ws), self.low_water(ws)), ([("k1", 10)], 10))
            for now, window in ((100, 95), (19, 10), (5, 50)):
                with self.subTest(now=now, window=window), self.assertRaises(ValueError):
                    reliability.purge(ws.receiver, now, window)
            self.assertEqual((self.receipts(ws), self.low_water(ws)), ([("k1", 10)], 10))
            self.assertFalse(ws.receiver.in_transaction)

    def test_a_late_request_issued_before_the_mark_without_receipt_is_expired_and_stores_nothing(self):
        with workspace() as ws:
            receive(ws)
            reliability.purge(ws.receiver, 100, 50)
            before = rows(ws.receiver, "tickets"), rows(ws.receiver, "receipts")
            for key, issued_at in (("k1", 0), ("k1", 49), ("k2", 49)):
                with self.subTest(key=key, issued_at=issued_at), self.assertRaises(Expired):
                    receive(ws, key, issued_at=issued_at, now=100)
            self.assertEqual((rows(ws.receiver, "tickets"), rows(ws.receiver, "receipts")), before)
            response = receive(ws, "k3", issued_at=50, now=100)  # at or after the mark: a new ticket
            self.assertEqual(receive(ws, "k3", issued_at=50, now=101), response)

    def test_a_surviving_receipt_still_replays_and_still_tells_another_intent_apart(self):
        with workspace() as ws:
            first = receive(ws, issued_at=40, now=60)
            reliability.purge(ws.receiver, 100, 50)
            self.assertEqual(receive(ws, issued_at=40, now=100), first)
            with self.assertRaises(Conflict):
                receive(ws, payload=OTHER_PAYLOAD, issued_at=40, now=100)
            self.assertEqual(counts(ws), dict(EMPTY, tickets=1, receipts=1))

    def test_without_the_policy_deleting_receipts_lets_a_late_replay_create_a_second_ticket(self):
        with workspace() as ws:
            first = receive(ws)
            self.assertEqual(reliability.unsafe_delete_receipts(ws.receiver, 50), 1)
            self.assertNotEqual(receive(ws, now=100)["ticket_id"], first["ticket_id"])
            self.assertEqual(counts(ws), dict(EMPTY, tickets=2, receipts=1))

    def test_dispatch_refused_as_expired_blocks_the_row_and_creates_no_ticket(self):
        with workspace() as ws:
            enqueue(ws)
            reliability.purge(ws.receiver, 100, 50)
            ws.close("receiver")
            result = reliability.dispatch(ws.sender, ws.root, 100, start=launcher())
            self.assertEqual((result["exit_code"], result["acknowledged"]), (0, False))
            row = outbox(ws)
            self.assertEqual((row["state"], row["attempts"], set(row["response"]), row["response"]["error"]),
                             ("blocked", 1, {"error", "message"}, "expired"))
            self.assertEqual(result["response"], row["response"])
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))


class TickTest(Case):
    """Beyond 第一篇: logical ticks are required, bounded ints that never go backwards."""

    def test_missing_ticks_are_a_type_error_and_store_nothing(self):
        with workspace() as ws:
            calls = {"enqueue": lambda: reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD),
                     "receive without issued_at": lambda: reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, now=0),
                     "receive without now": lambda: reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, issued_at=0),
                     "claim": lambda: reliability.claim(ws.sender),
                     "dispatch": lambda: reliability.dispatch(ws.sender, ws.root),
                     "reconcile": lambda: reliability.reconcile(ws.sender, ws.external, "agent", "k1"),
                     "purge": lambda: reliability.purge(ws.receiver, 100)}
            for label, call in calls.items():
                with self.subTest(label), self.assertRaises(TypeError):
                    call()
            self.assertEqual(counts(ws), EMPTY)

    def test_bad_or_backwards_ticks_are_a_value_error_and_store_nothing(self):
        with workspace() as ws:
            receive(ws, "kept", issued_at=5, now=5)
            before = counts(ws), rows(ws.receiver, "receipts")
            with self.assertRaises(ValueError) as caught:
                reliability.check_ticks(6, 5)
            self.assertIn("backwards", str(caught.exception))
            bad = {"issued after now": (6, 5), "negative": (-1, 5), "bool": (True, 5), "float": (1.0, 5),
                   "str now": (0, "5"), "None now": (0, None), "past MAX_TICK": (0, reliability.MAX_TICK + 1)}
            for label, (issued_at, now) in bad.items():
                for key in ("kept", "new"):  # neither replayed nor stored first
                    with self.subTest(label, key=key), self.assertRaises(ValueError):
                        receive(ws, key, issued_at=issued_at, now=now)
            for now in (-1, True, 1.5, "3", None, 2 ** 63):
                with self.subTest(now=now), self.assertRaises(ValueError):
                    enqueue(ws, "new", now=now)
                with self.subTest(now=now), self.assertRaises(ValueError):
                    reliability.claim(ws.sender, now)
            self.assertEqual((counts(ws), rows(ws.receiver, "receipts")), before)
            for issued_at, now in ((0, 0), (5, 5), (4, 5), (0, reliability.MAX_TICK)):
                self.assertIsNone(reliability.check_ticks(issued_at, now))

    def test_claim_leaves_a_row_issued_after_now_alone_without_spending_an_attempt(self):
        with workspace() as ws:
            enqueue(ws, now=50)
            for now in (0, 10, 49):
                self.assertIsNone(reliability.claim(ws.sender, now))
            self.assertEqual(state(ws), ("pending", 0))
            self.assertEqual(reliability.claim(ws.sender, 50)["attempt"], 1)


class SchemaVersionTest(Case):
    """Beyond 第一篇: a file of another schema version is refused, naming the path and both versions."""

    def test_a_schema_1_file_is_refused_naming_path_and_versions_and_left_byte_for_byte(self):
        with workspace() as ws:
            path = ws.path("receiver")
            with raw(path) as old:  # schema 1 kept the kind in user_version and no application_id
                old.execute("PRAGMA application_id = 0")
                old.execute("PRAGMA user_version = 7302")
            content = file_bytes(path)
            with self.assertRaises(sqlite3.DatabaseError) as caught:
                reliability.connect(path)
            message = str(caught.exception)
            self.assertIn(path, message)
            self.assertRegex(message, r"schema version 1\b.*\b2\b")
            self.assertEqual(file_bytes(path), content)
            self.assertEqual(sorted(os.listdir(ws.root)), sorted(KINDS))  # no -wal or -shm made either

    def test_another_kind_or_version_is_refused_too(self):
        for pragma in ("application_id = 4242", "user_version = 3"):
            with self.subTest(pragma), workspace() as ws:
                with raw(ws.path("sender")) as tamper:
                    tamper.execute(f"PRAGMA {pragma}")
                with self.assertRaises(sqlite3.DatabaseError) as caught:
                    reliability.connect(ws.path("sender"))
                self.assertIn(ws.path("sender"), str(caught.exception))


def connect_error_as_another_user(path):
    """The text of what connect(path) raises in a forked child that is not root (uid/gid 65534 if we are)."""
    return run_experiment.run_forked(_connect_as_nobody, path)


def _become_nobody():
    if os.geteuid() == 0:  # root may signal anyone and passes every permission check
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)


def _alive_as_nobody(pid):
    _become_nobody()
    return reliability._alive(pid)


def _connect_as_nobody(path):
    _become_nobody()
    try:
        reliability.connect(path).close()
        return "opened"
    except Exception as error:
        return f"{type(error).__name__}: {error}"


@unittest.skipUnless(hasattr(os, "fork") and hasattr(os, "geteuid"), "drops privileges in a forked child")
class PermissionTest(Case):
    """Beyond 第一篇: an unreadable or read-only file or directory is refused, naming the path."""

    def test_unreadable_or_read_only_file_wal_shm_or_directory_raises_permission_error_naming_it(self):
        # label: (directory mode, {"", "-wal" or "-shm": file mode}, the one named); -wal and -shm are
        # empty files, as SQLite leaves them, that this user may read but not write.
        cases = {"unreadable file": (0o777, {"": 0o000}, ""), "read-only file": (0o777, {"": 0o444}, ""),
                 "read-only -wal": (0o777, {"": 0o666, "-wal": 0o444}, "-wal"),
                 "read-only -shm": (0o777, {"": 0o666, "-shm": 0o444}, "-shm"),
                 "read-only directory": (0o555, {"": 0o666}, None),
                 "read-only -wal, through a symlink": (0o777, {"": 0o666, "-wal": 0o444}, "-wal")}
        with tempfile.TemporaryDirectory() as top:
            os.chmod(top, 0o755)  # another user may pass through
            for label, (folder_mode, modes, named) in cases.items():
                folder = os.path.join(top, label.replace(" ", "-") + fs_name("-数据", "-data"))
                reliability.init(folder)
                path = os.path.join(folder, RECEIVER)
                content = file_bytes(path)
                for suffix, mode in modes.items():
                    if suffix:
                        write_file(path + suffix, b"")
                    os.chmod(path + suffix, mode)
                os.chmod(folder, folder_mode)
                opened = path
                if "symlink" in label:  # opened by another name: the checks must follow it to the file
                    opened = os.path.join(top, "link-" + label.split(",")[0].replace(" ", "-"))
                    os.symlink(path, opened)
                try:
                    text = connect_error_as_another_user(opened)
                finally:  # before the directory is removed, even as a user who is not root
                    os.chmod(folder, 0o755)
                    for suffix in modes:
                        os.chmod(path + suffix, 0o644)
                with self.subTest(label):
                    self.assertTrue(text.startswith("PermissionError: "), text)
                    self.assertIn(path + named + "'" if named is not None else folder, text)
                    self.assertEqual(file_bytes(path), content)


STRACE = shutil.which("strace")


def strace_flags():
    """None where strace is missing or may not trace (ptrace is often forbidden in containers); else
    ["--seccomp-bpf"] where that works cleanly (strace 5.3+: the child stops only at the traced
    calls, not at every call), or [] where it does not."""
    for flags in (["--seccomp-bpf"], []) if STRACE else ():
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            done = subprocess.run([STRACE, "-f", *flags, "-e", "trace=getpid", "-o", os.devnull, "true"],
                                  capture_output=True, timeout=WATCHDOG)
            if (done.returncode, done.stderr) == (0, b""):
                return flags
    return None


STRACE_FLAGS = strace_flags()


@unittest.skipUnless(STRACE_FLAGS is not None, "needs a working strace to make system calls fail for real")
class FailedSyscallTest(Case):
    """Beyond 第一篇: a COMMIT whose fsync fails is an unknown outcome; an unopenable WAL is one line."""

    def strace(self, inject, path, *argv):
        # With --seccomp-bpf strace 6.1 sends no injected signal, so that one child stops at every call.
        fast = [] if "signal=" in inject else STRACE_FLAGS
        return [STRACE, "-f", *fast, "-o", os.devnull, "-e", f"trace={inject.split(':')[0]}", "-e", f"inject={inject}",
                "-P", path, sys.executable, "-I", "-S", SCRIPT, *argv]

    def test_a_failed_commit_may_or_may_not_survive_and_a_replay_by_key_ends_with_one_ticket(self):
        # The first fdatasync of a fresh WAL syncs its header; the second is the commit.
        variants = {"error survives": "error=EIO:when=2", "then SIGKILL": "error=EIO:signal=SIGKILL:when=2",
                    "disk full": "error=ENOSPC:when=2"}
        request = json.dumps({"caller": "agent", "key": "k1", "payload": PAYLOAD, "issued_at": 0, "now": 0},
                             ensure_ascii=False).encode("utf-8") + b"\n"
        with contextlib.ExitStack() as stack:
            commands, roots = [], {}
            for name, inject in variants.items():  # three children at once, each on its own copy
                roots[name] = stack.enter_context(tempfile.TemporaryDirectory(prefix=fs_name("提交-", "commit-")))
                for kind in KINDS:
                    shutil.copyfile(os.path.join(TEMPLATE["dir"].name, kind), os.path.join(roots[name], kind))
                database = os.path.join(roots[name], RECEIVER)
                commands.append(self.strace(f"fdatasync:{inject}", database + "-wal", "serve", "receive", database))
            outcomes = {name: (out.decode("utf-8"), err.decode("utf-8"), code) for name, (code, out, err)
                        in zip(variants, run_experiment.run_together(commands, request))}
            for name in ("error survives", "disk full"):
                out, err, code = outcomes[name]
                self.assertEqual((out, code), ("", 1))
                self.assertIn("disk I/O error", err)
            self.assertEqual(outcomes["then SIGKILL"][2], -signal.SIGKILL)
            # The same error for the caller, yet one outcome kept the commit: the process that lived
            # rolled back; the one killed left WAL frames that recovery keeps.
            kept = {}
            for name, root in roots.items():
                with contextlib.closing(reliability.connect(os.path.join(root, RECEIVER))) as receiver:
                    kept[name] = reliability.snapshot(receiver)["tickets"]
                    self.assertEqual(reliability.receive(receiver, "agent", "k1", PAYLOAD, issued_at=0, now=1)
                                     ["ticket_id"], 1)
                    self.assertEqual(counts(receiver), (1, 1))
                    self.assertEqual(receiver.execute("PRAGMA integrity_check").fetchone()[0], "ok")
            self.assertEqual(kept, {"error survives": 0, "then SIGKILL": 1, "disk full": 0})

    def test_an_unopenable_wal_is_a_one_line_error_naming_the_file_and_changes_nothing(self):
        with workspace() as ws:
            before = counts(ws)
            database = ws.path("receiver")
            done = subprocess.run(self.strace("openat:error=EROFS", database + "-wal", "purge", ws.root, "--now", "100",
                                              "--window", "50"), capture_output=True, timeout=WATCHDOG)
            err = done.stderr.decode("utf-8")
            self.assertEqual((done.returncode, done.stdout), (1, b""))
            self.assertEqual(len(err.splitlines()), 1, err)
            self.assertIn(database, err)
            self.assertNotIn("Traceback", err)
            self.assertEqual(counts(ws), before)


class VersionGuardTest(unittest.TestCase):
    """Beyond 第一篇: the SQLite versions with the WAL-reset race are known."""

    def test_wal_reset_bug_knows_the_affected_ranges_and_backports(self):
        expected = {(3, 6, 23): False, (3, 7, 0): True, (3, 40, 1): True, (3, 44, 5): True, (3, 44, 6): False,
                    (3, 44, 9): False, (3, 45, 0): True, (3, 50, 6): True, (3, 50, 7): False, (3, 51, 0): True,
                    (3, 51, 2): True, (3, 51, 3): False, (3, 52, 0): False}
        for version, affected in expected.items():
            with self.subTest(version=version):
                self.assertIs(reliability.wal_reset_bug(version), affected)
        self.assertIs(reliability.wal_reset_bug(), reliability.wal_reset_bug(sqlite3.sqlite_version_info))


# === beyond 第一篇: the PostgreSQL edition in README.md, against a real server ===
# The README's ```sql blocks for article 1, loaded as printed into a throw-away cluster
# (run_experiment.pg_start: Unix socket only, as nobody when run as root, stopped and removed at
# exit); each race releases 16 psql clients together at an advisory-lock barrier the test sees
# in pg_locks, for 10 rounds; assertions are counts and statuses.  Without PostgreSQL they skip.

PG_CLIENTS, PG_ROUNDS, PG_FILLER = run_experiment.PG_CLIENTS, run_experiment.PG_ROUNDS, run_experiment.PG_FILLER
PG_CALLER = "agent"


class PostgresArticle1Test(run_experiment.pg_case(1)):
    """第一篇 in PostgreSQL: receive, purge, enqueue, claim and acknowledge under 16 racing clients."""

    def test_16_copies_of_one_request_make_one_ticket_and_another_payload_is_conflict(self):
        scripts = [[] for _ in range(PG_CLIENTS)]
        for r in range(PG_ROUNDS):
            key, payload, other = f"copy-{r}", {"title": f"ticket {r}"}, {"title": f"other {r}"}
            for i in range(PG_CLIENTS):
                scripts[i].append(run_experiment.pg_call("receive", PG_CALLER, key, payload, r, r))
                scripts[i].append(run_experiment.pg_call("receive", PG_CALLER, key, payload if i < 8 else other, r, r + 1))
        outputs = run_experiment.pg_race(self.session, scripts)
        for r in range(PG_ROUNDS):
            first = run_experiment.pg_answers(outputs, 2 * r)
            self.assertEqual(len({json.dumps(a, sort_keys=True) for a in first}), 1, f"round {r}: {first}")
            self.assertEqual(sorted(first[0]), ["caller", "digest", "key", "ticket_id"])
            self.assertEqual(run_experiment.pg_answers(outputs, 2 * r + 1), first[:8] + [{"error": "conflict"}] * 8)
            stored = self.session.query(f"SELECT t.id, t.payload, r.digest FROM tickets t JOIN receipts r ON r.ticket_id = t.id"
                                        f" WHERE t.key = 'copy-{r}'")
            self.assertEqual(stored, [[str(first[0]["ticket_id"]), json.dumps({"title": f"ticket {r}"}),
                                       first[0]["digest"]]])
        self.assertEqual(self.session.query("SELECT (SELECT count(*) FROM tickets), (SELECT count(*) FROM receipts)"),
                         [[str(PG_ROUNDS), str(PG_ROUNDS)]])

    def test_late_replays_racing_purges_never_make_a_second_ticket_and_the_mark_never_moves_back(self):
        ticks = [1000 * (r + 1) for r in range(PG_ROUNDS)]
        payload = {"title": "late"}
        self.session.query("\n".join(run_experiment.pg_call("receive", PG_CALLER, f"late-{r}", payload, t, t) for r, t in enumerate(ticks)))
        self.session.query(f"INSERT INTO tickets (caller, key, digest, payload) SELECT 'filler', n::text, 'd', '{{}}'"
                           f" FROM generate_series(1, {PG_FILLER * PG_ROUNDS}) n;"
                           f" INSERT INTO receipts SELECT caller, key, digest, id, 1000 * (1 + (id - 1) % {PG_ROUNDS})"
                           f" FROM tickets WHERE caller = 'filler'")
        first = {r: json.loads(self.session.value(run_experiment.pg_call("receive", PG_CALLER, f"late-{r}", payload, t, t)))
                 for r, t in enumerate(ticks)}
        scripts = [[] for _ in range(PG_CLIENTS)]
        for r, t in enumerate(ticks):
            for i in range(PG_CLIENTS):
                if i < 8:  # purges to marks t + 1 .. t + 8, all past the receipt written at t
                    scripts[i].append(run_experiment.pg_call("purge", t + 500 + i + 1, 500))
                else:
                    scripts[i].append(run_experiment.pg_call("receive", PG_CALLER, f"late-{r}", payload, t, t + 600))
                key = f"late-{r}" if i < 12 else f"new-{r}-{i}"  # then: late replays, new keys issued before the mark
                scripts[i].append(run_experiment.pg_call("receive", PG_CALLER, key, payload, t, t + 700))

        def after(phase):
            r, t = phase // 2, ticks[phase // 2]
            self.assertEqual(self.session.value("SELECT low_water FROM retention"), str(t + 8), "the highest mark")
            self.assertEqual(self.session.query(f"SELECT count(*) FROM tickets WHERE key = 'late-{r}'"), [["1"]])
            self.assertEqual(self.session.query(f"SELECT count(*) FROM receipts WHERE tick <= {t}"), [["0"]])
            self.assertEqual(self.session.query(f"SELECT count(*) FROM receipts WHERE key = 'late-{r}'"), [["0"]])
            self.assertEqual(self.session.query(f"SELECT count(*) FROM tickets WHERE key LIKE 'new-{r}-%'"), [["0"]])
        outputs = run_experiment.pg_race(self.session, scripts, after=after)
        for r, t in enumerate(ticks):
            racing = run_experiment.pg_answers(outputs, 2 * r)
            purged = [a for a in racing[:8] if a["status"] == "purged"]
            self.assertEqual(sum(a["deleted"] for a in purged), 1 + PG_FILLER, f"round {r}: each receipt deleted once")
            for i, a in enumerate(racing[:8]):
                mark = t + i + 1
                self.assertIn(a, ({"status": "purged", "deleted": a.get("deleted"), "low_water": mark},
                                  {"status": "backwards", "low_water": a["low_water"]}))
                if a["status"] == "backwards":
                    self.assertGreater(a["low_water"], mark)
            for a in racing[8:]:
                if "error" in a:
                    self.assertEqual(a["error"], "expired")
                    self.assertGreater(a["low_water"], t)
                else:
                    self.assertEqual(a, first[r], "a replay before the purge is the stored answer")
            self.assertEqual(run_experiment.pg_answers(outputs, 2 * r + 1), [{"error": "expired", "low_water": t + 8}] * PG_CLIENTS)
        self.assertEqual(self.session.query("SELECT count(*), count(DISTINCT key) FROM tickets WHERE caller = 'agent'"),
                         [[str(PG_ROUNDS)] * 2])

    def test_16_claimers_one_winner_per_attempt_unknown_never_reclaimed_late_acks_change_nothing(self):
        # Per round r at tick t, rows in every state; later rounds' rows are not due yet.
        def response(key):
            return ("jsonb_build_object('caller', 'agent', 'key', " + run_experiment.pg_literal(key) + ", 'digest',"
                    f" (SELECT digest FROM requests WHERE key = {run_experiment.pg_literal(key)}), 'ticket_id', 7)")
        fixture, expected = [], {}
        for r in range(PG_ROUNDS):
            t = 100 * (r + 1)
            rows = {  # key: (mode, state, attempts, lease_until, issued_at, response, final state)
                "X": ("idempotent", "inflight", 12, t, t - 50, None, ("done", 13)),  # a person said retry at 3
                "E": ("external", "inflight", 2, t - 1, t - 50, None, ("unknown", 2)),
                "M": ("idempotent", "inflight", 10, t, t - 50, None, ("blocked", 10)),  # 10 unanswered
                "D": ("idempotent", "pending", 0, None, t - 50, None, ("blocked", 0)),  # payload tampered
                "U": ("external", "unknown", 1, t - 20, t - 50, None, ("unknown", 1)),
                "B": ("idempotent", "blocked", 4, t - 20, t - 50, {"error": "fixture"}, ("blocked", 4)),
                "A": ("idempotent", "abandoned", 2, t - 20, t - 50, None, ("abandoned", 2)),
                "F": ("idempotent", "pending", 0, None, 10 ** 12 + r, None, ("pending", 0)),  # issued later
            }
            for name, (mode, state, attempts, lease, issued, resp, final) in rows.items():
                key = f"{name}-{r}"
                payload = run_experiment.pg_literal({"n": key})
                stored = run_experiment.pg_literal({"n": key, "tampered": True}) if name == "D" else payload
                fixture.append(f"INSERT INTO requests VALUES ('agent', {run_experiment.pg_literal(key)}, {run_experiment.pg_literal(mode)},"
                               f" digest_of({payload}), {stored}, {issued});"
                               f" INSERT INTO outbox (caller, key, mode, state, attempts, lease_until, response)"
                               f" VALUES ('agent', {run_experiment.pg_literal(key)}, {run_experiment.pg_literal(mode)}, {run_experiment.pg_literal(state)}, {attempts},"
                               f" {run_experiment.pg_literal(lease)}, {run_experiment.pg_literal(resp)});")
                expected[key] = final
            fixture.append(f"INSERT INTO resolutions (caller, key, attempt, decision, decided_by, reason)"
                           f" VALUES ('agent', 'X-{r}', 3, 'retry', 'tester', 'fixture');")
            expected[f"Y-{r}"] = ("done", 1)
        self.session.query("\n".join(fixture))
        acks = [("X", 12), ("X", 3), ("X", 13), ("X", 13), ("Y", 1), ("Y", 0), ("E", 2), ("U", 1),
                ("B", 4), ("A", 2), ("F", 0), ("M", 10), ("D", 0), ("X", 14), ("E", 3), ("Y", 2)]
        scripts = [[] for _ in range(PG_CLIENTS)]
        for r in range(PG_ROUNDS):
            t = 100 * (r + 1)
            for i in range(PG_CLIENTS):
                scripts[i].append(run_experiment.pg_call("enqueue", PG_CALLER, f"Y-{r}", {"n": f"Y-{r}"}, t))
                scripts[i].append(run_experiment.pg_call("claim", t, 5000 + i))
                name, attempt = acks[i]
                scripts[i].append(f"SELECT acknowledge('agent', '{name}-{r}', {attempt}, {response(f'{name}-{r}')});")
        outputs = run_experiment.pg_race(self.session, scripts)
        for r in range(PG_ROUNDS):
            t = 100 * (r + 1)
            self.assertEqual(sorted(a["status"] for a in run_experiment.pg_answers(outputs, 3 * r)), ["accepted"] + ["duplicate"] * 15)
            claimed = run_experiment.pg_answers(outputs, 3 * r + 1)
            winners = {i: a for i, a in enumerate(claimed) if a != ""}
            self.assertEqual(sorted((a["key"], a["attempt"]) for a in winners.values()),
                             [(f"X-{r}", 13), (f"Y-{r}", 1)], f"round {r}: one winner per due row and attempt")
            for a in winners.values():
                self.assertEqual((a["now"], a["mode"], a["payload"]), (t, "idempotent", {"n": a["key"]}))
            owner = next(5000 + i for i, a in winners.items() if a["key"] == f"X-{r}")
            acked = run_experiment.pg_answers(outputs, 3 * r + 2)
            self.assertEqual(sorted(acked[2:4]), ["f", "t"], "one of two copies of the current attempt's ack")
            self.assertEqual(acked[:2] + acked[4:], ["f", "f", "t"] + ["f"] * 11, "late acks change nothing")
            self.assertEqual(self.session.query(f"SELECT lease_until, owner_pid FROM outbox WHERE key = 'X-{r}'"),
                             [[str(t + 10), str(owner)]])
        state = {key: (s, int(a), json.loads(resp) if resp else None) for key, s, a, resp in
                 self.session.query("SELECT key, state, attempts, response FROM outbox")}
        for key, final in expected.items():
            self.assertEqual(state[key][:2], final, key)
            name = key.split("-")[0]
            if name in ("X", "Y"):
                self.assertEqual(state[key][2]["ticket_id"], 7)
            elif name in ("M", "D", "B"):
                self.assertEqual(state[key][2], {"M": {"error": "no valid answer after 10 attempts"},
                                                 "D": {"error": "corrupt intent: not the text, payload and"
                                                                " digest enqueue() stores"},
                                                 "B": {"error": "fixture"}}[name])
            else:
                self.assertIsNone(state[key][2], key)

    def test_the_sql_answers_as_reliability_py_does_step_by_step(self):
        stack = contextlib.ExitStack()
        self.addCleanup(stack.close)
        ws = stack.enter_context(workspace())
        sender, receiver = ws.sender, ws.receiver
        tickets = {"python": {}, "sql": {}}

        def ticket(side, number):  # ticket ids in order of first appearance: sequences may skip
            return "t%d" % tickets[side].setdefault(number, len(tickets[side]) + 1)

        def python(step):
            kind, args = step[0], step[1:]
            try:
                if kind == "receive":
                    key, payload, issued_at, now = args
                    answer = reliability.receive(receiver, PG_CALLER, key, payload, issued_at=issued_at, now=now)
                    return ("ticket", ticket("python", answer["ticket_id"]),
                            answer["digest"] == reliability.canonical(payload)[1])
                if kind == "purge":
                    return ("purged", reliability.purge(receiver, *args))
                if kind == "enqueue":
                    key, payload, now, mode = args
                    return reliability.enqueue(sender, PG_CALLER, key, payload, now=now, mode=mode)
                if kind == "claim":
                    row = reliability.claim(sender, args[0])
                    return row and (row["key"], row["attempt"], row["mode"], row["payload"], row["issued_at"])
                if kind == "tamper":
                    sender.execute("UPDATE requests SET payload = ? WHERE key = ?", ('{"tampered":1}', args[0]))
                    return None
                if kind == "tamper ticket":
                    receiver.execute("UPDATE tickets SET payload = ? WHERE key = ?", ('{"tampered":1}', args[0]))
                    return None
                key, attempt, fault = args
                digest = sender.execute("SELECT digest FROM requests WHERE key = ?", (key,)).fetchone()[0]
                return reliability.acknowledge(sender, PG_CALLER, key, attempt, pg_faulty(key, digest, fault))
            except reliability.Conflict:
                return "conflict"
            except reliability.Expired:
                return "expired"
            except reliability.CorruptRecord:
                return "corrupt"
            except ValueError as error:
                return "backwards" if "move it backwards" in str(error) else "invalid"
            except TypeError:
                return "invalid"

        def sql(step):
            kind, args = step[0], step[1:]
            if kind in ("tamper", "tamper ticket"):
                table = "requests" if kind == "tamper" else "tickets"
                self.session.query(f"UPDATE {table} SET payload = '{{\"tampered\": 1}}' WHERE key = {run_experiment.pg_literal(args[0])}")
                return None
            if kind == "acknowledge":
                key, attempt, fault = args
                digest = self.session.value(f"SELECT digest FROM requests WHERE key = {run_experiment.pg_literal(key)}")
                statement = run_experiment.pg_call("acknowledge", PG_CALLER, key, attempt, pg_faulty(key, digest, fault))
            elif kind == "claim":
                statement = run_experiment.pg_call("claim", args[0], os.getpid())
            else:
                statement = run_experiment.pg_call(kind, *((PG_CALLER,) if kind in ("receive", "enqueue") else ()), *args)
            if run_experiment.pg_sqlstate(self.session, statement) == "22023":
                return "invalid"
            value = self.session.value(statement)
            answer = json.loads(value) if value[:1] == "{" else value
            if kind == "receive":
                if "error" in answer:
                    return answer["error"]
                return ("ticket", ticket("sql", answer["ticket_id"]),
                        answer["digest"] == self.session.value(f"SELECT digest_of({run_experiment.pg_literal(args[1])})"))
            if kind == "purge":
                if answer["status"] == "backwards":
                    return "backwards"
                return ("purged", {"deleted": answer["deleted"], "low_water": answer["low_water"]})
            if kind == "enqueue":
                return answer["status"]
            if kind == "claim":
                return answer and (answer["key"], answer["attempt"], answer["mode"], answer["payload"],
                                   answer["issued_at"]) or None
            return {"t": True, "f": False}[answer]

        one, other = {"title": "one"}, {"title": "other"}
        deep = 1
        for _ in range(31):  # 32 levels, the leaf included: the deepest accepted
            deep = {"a": deep}
        steps = [
            ("receive", "k1", one, 1, 1), ("receive", "k1", one, 1, 2), ("receive", "k1", other, 1, 2),
            ("receive", "k2", one, 3, 3), ("receive", "", one, 1, 1), ("receive", "k9", [1], 1, 1),
            ("receive", "k9", one, 5, 4), ("receive", "k" * 201, one, 1, 1),
            ("purge", 10, 7), ("purge", 9, 7), ("purge", 5, 7), ("purge", 10, 0),
            ("receive", "k1", one, 1, 11), ("receive", "k2", one, 3, 11), ("receive", "k3", one, 2, 11),
            ("receive", "k4", one, 3, 11), ("receive", "k4", one, 3, 12), ("purge", 20, 10),
            ("receive", "k4", one, 3, 21), ("receive", "k5", other, 10, 21),
            ("receive", "k6", deep, 10, 21), ("receive", "k7", {"a": deep}, 10, 21),
            ("tamper ticket", "k5"), ("receive", "k5", other, 10, 22), ("receive", "k4", one, 3, 22),
            ("enqueue", "e1", one, 1, "idempotent"), ("enqueue", "e1", one, 1, "idempotent"),
            ("enqueue", "e1", other, 1, "idempotent"), ("enqueue", "e1", one, 1, "external"),
            ("enqueue", "e2", one, 2, "external"), ("enqueue", "e3", one, 50, "idempotent"),
            ("enqueue", "e4", other, 3, "idempotent"), ("enqueue", "e5", one, 3, "nonsense"),
            ("claim", 0), ("claim", 1), ("claim", 2), ("claim", 3), ("claim", 3),
            ("acknowledge", "e1", 1, "other key"), ("acknowledge", "e1", 1, "other digest"),
            ("acknowledge", "e1", 1, "ticket 0"), ("acknowledge", "e1", 1, "ticket text"),
            ("acknowledge", "e1", 1, "extra field"), ("acknowledge", "e1", 2, None),
            ("acknowledge", "e1", 1, None), ("acknowledge", "e1", 1, None),
            ("claim", 12), ("claim", 13), ("acknowledge", "e2", 1, None),
            ("tamper", "e4"), ("claim", 22), ("claim", 23),
        ] + [("claim", 50 + 10 * n) for n in range(11)] + [  # attempts 1..10 of e3, then blocked
            ("claim", 200), ("acknowledge", "e3", 10, None), ("acknowledge", "e3", 9, None),
        ]
        for step in steps:
            self.assertEqual(sql(step), python(step), step)
        python_rows = sender.execute("SELECT o.key, o.state, o.attempts, o.lease_until, o.response FROM outbox o"
                                     " ORDER BY o.id").fetchall()
        sql_rows = self.session.query("SELECT key, state, attempts, lease_until, response FROM outbox ORDER BY id")
        self.assertEqual([(k, s, str(a), "" if l is None else str(l), pg_normal(r)) for k, s, a, l, r in python_rows],
                         [(k, s, a, l, pg_normal(r)) for k, s, a, l, r in sql_rows])
        self.assertEqual(list(counts(receiver)),
                         [int(n[0]) for n in self.session.query("SELECT count(*) FROM tickets UNION ALL"
                                                                " SELECT count(*) FROM receipts")])

    def test_bad_input_a_corrupt_receipt_and_rewritten_decisions_change_nothing(self):
        one = {"title": "one"}
        answer = json.loads(self.session.value(run_experiment.pg_call("receive", PG_CALLER, "k", one, 1, 1)))
        for statement in (run_experiment.pg_call("receive", PG_CALLER, "", one, 1, 1), run_experiment.pg_call("receive", PG_CALLER, "k2", one, 2, 1),
                          run_experiment.pg_call("receive", PG_CALLER, "k2", [1], 1, 1), run_experiment.pg_call("receive", PG_CALLER, "k2", one, -1, 1),
                          run_experiment.pg_call("receive", PG_CALLER, "k2", {"x": "y" * 65536}, 1, 1),
                          run_experiment.pg_call("purge", 5, 6), run_experiment.pg_call("purge", 5, 0), run_experiment.pg_call("enqueue", PG_CALLER, "e", one, 1, "other"),
                          run_experiment.pg_call("claim", -1, 1), run_experiment.pg_call("acknowledge", PG_CALLER, "nothing", 1, answer)):
            self.assertEqual(run_experiment.pg_sqlstate(self.session, statement), "22023", statement)
        self.assertEqual(run_experiment.pg_sqlstate(self.session, "INSERT INTO requests VALUES ('agent', 'x', 'idempotent', 'd',"
                                                " '[1]', 1)"), "23514", "a stored payload is a JSON object")
        self.session.query("UPDATE tickets SET digest = 'x'")
        self.assertEqual(self.session.value(run_experiment.pg_call("receive", PG_CALLER, "k", one, 1, 2)), '{"error": "corrupt"}')
        self.session.query(run_experiment.pg_call("enqueue", PG_CALLER, "e", one, 1, "idempotent") +
                           "INSERT INTO resolutions (caller, key, attempt, decision, decided_by, reason)"
                           " VALUES ('agent', 'e', 0, 'retry', 'tester', 'why');")
        for statement in ("UPDATE resolutions SET reason = 'other'", "DELETE FROM resolutions",
                          "TRUNCATE resolutions"):
            self.assertEqual(run_experiment.pg_sqlstate(self.session, statement), "P0001", statement)
        self.assertEqual(self.session.query("SELECT (SELECT count(*) FROM tickets), (SELECT count(*) FROM receipts),"
                                            " (SELECT count(*) FROM requests), (SELECT count(*) FROM resolutions)"),
                         [["1", "1", "1", "1"]])


def pg_faulty(key, digest, fault):
    """A response for ``key``, or one that does not answer it."""
    response = {"caller": PG_CALLER, "key": key, "digest": digest, "ticket_id": 5}
    if fault == "other key":
        response["key"] = key + "x"
    elif fault == "other digest":
        response["digest"] = "0" * 64
    elif fault == "ticket 0":
        response["ticket_id"] = 0
    elif fault == "ticket text":
        response["ticket_id"] = "5"
    elif fault == "extra field":
        response["url"] = "https://example.invalid/5"
    return response


def pg_normal(response):
    """An outbox response with its digest (which differs between the editions) left out."""
    if response in (None, ""):
        return None
    value = json.loads(response)
    value.pop("digest", None)
    return value


# === the copy kits and the public names the README lists ===

with open(SCRIPT, encoding="utf-8") as _handle:
    SOURCE = _handle.read()
TREE = ast.parse(SOURCE)
DEFINITIONS = {}  # module-level name -> its definition node, in source order
for _node in TREE.body:
    if isinstance(_node, (ast.FunctionDef, ast.ClassDef)):
        DEFINITIONS[_node.name] = _node
    elif isinstance(_node, ast.Assign):
        for _target in _node.targets:
            if isinstance(_target, ast.Name):
                DEFINITIONS[_target.id] = _node
KIT_IMPORTS = "import hashlib\nimport json\nimport os\nimport sqlite3\nfrom contextlib import contextmanager\n"
RECEIVE_KIT = ["receive", "_replayed", "transaction", "canonical", "_least_bytes", "check_identity",
               "check_ticks", "crash_point", "CRASH_AT", "CRASH_EXIT", "Conflict", "Expired",
               "CorruptRecord", "MAX_IDENTITY_LENGTH", "MAX_PAYLOAD_BYTES", "MAX_PAYLOAD_DEPTH",
               "MAX_TICK", "_dumps"]
OUTBOX_KIT = ["enqueue", "claim", "_oldest_due", "acknowledge", "check_response", "transaction",
              "canonical", "_least_bytes", "check_identity", "check_ticks", "crash_point", "CRASH_AT",
              "CRASH_EXIT", "Conflict", "MODES", "LEASE_TICKS", "MAX_ATTEMPTS", "MAX_IDENTITY_LENGTH",
              "MAX_PAYLOAD_BYTES", "MAX_PAYLOAD_DEPTH", "MAX_TICK", "_dumps"]


def segment(node):
    """The source lines of a definition, its decorators included."""
    first = min([node.lineno] + [decorator.lineno for decorator in getattr(node, "decorator_list", [])])
    return SOURCE.splitlines()[first - 1:node.end_lineno]


def needs(node):
    """The module-level definitions a definition refers to (names it binds itself excluded)."""
    loaded = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    bound = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    bound |= {n.arg for n in ast.walk(node) if isinstance(n, ast.arg)}
    bound -= {name for n in ast.walk(node) if isinstance(n, ast.Global) for name in n.names}
    return (loaded - bound) & set(DEFINITIONS)


def closure(roots):
    found, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo.extend(needs(DEFINITIONS[name]) - found)
    return found


# What a copier does with a kit, run in a fresh interpreter: open the connection as README.md's
# open_database() does, create the tables from SCHEMAS' statements, run the article's scenario.
KIT_CHECKS = {
    "receive": """
connection = open_database(os.path.join(folder, "receiver.db"))
for statement in SCHEMAS["receiver.db"]:
    connection.execute(statement)
first = kit.receive(connection, "agent", "k1", PAYLOAD, issued_at=0, now=0)
assert first["ticket_id"] == 1, first
assert kit.receive(connection, "agent", "k1", PAYLOAD, issued_at=0, now=1) == first  # the replay
try:
    kit.receive(connection, "agent", "k1", OTHER_PAYLOAD, issued_at=0, now=2)
    raise AssertionError("the same key with another payload was accepted")
except kit.Conflict:
    pass
assert connection.execute("SELECT count(*) FROM tickets").fetchone()[0] == 1
connection.close()
""",
    "outbox": """
connection = open_database(os.path.join(folder, "sender.db"))
for statement in SCHEMAS["sender.db"]:
    connection.execute(statement)
assert kit.enqueue(connection, "agent", "k1", PAYLOAD, now=0) == "accepted"
assert kit.claim(connection, 0)["attempt"] == 1
assert kit.claim(connection, 9) is None  # the lease runs to tick 10
assert kit.claim(connection, 11)["attempt"] == 2
response = {"caller": "agent", "key": "k1", "digest": kit.canonical(PAYLOAD)[1], "ticket_id": 1}
assert kit.acknowledge(connection, "agent", "k1", 1, response) is False  # the stale attempt
assert kit.acknowledge(connection, "agent", "k1", 2, response) is True
assert connection.execute("SELECT state, attempts FROM outbox").fetchall() == [("done", 2)]
connection.close()
""",
}


class CopyKitTest(unittest.TestCase):
    """第一篇 §3 and §5, copied out: each kit is exactly what its functions need, and runs alone on a
    connection opened as README.md tells the copier (on Python 3.12+ too, where one is found)."""

    def kit(self, names, directory, module):
        nodes = sorted({id(DEFINITIONS[name]): DEFINITIONS[name] for name in names}.values(),
                       key=lambda node: node.lineno)
        lines = [line for node in nodes for line in segment(node) + [""]]
        with open(os.path.join(directory, module + ".py"), "w", encoding="utf-8") as handle:
            handle.write(KIT_IMPORTS + "\n" + "\n".join(lines))

    def run_kit(self, names, check):
        recipe = run_experiment.readme_blocks("python", os.path.join(HERE, "README.md"))
        self.assertEqual(len(recipe), 1, "README.md has one python block: how to open the kits' connection")
        interpreters = [sys.executable] + [newer for newer in [run_experiment.newer_python()] if newer]
        with tempfile.TemporaryDirectory() as directory:
            self.kit(names, directory, "kit")
            script = "\n".join([
                "import os, sys", f"folder = {directory!r}", "sys.path.insert(0, folder)", "import kit",
                # each interpreter its own databases: they run at the same time
                "folder = os.path.join(folder, sys.implementation.cache_tag)", "os.mkdir(folder)",
                f"SCHEMAS = {reliability.SCHEMAS!r}", f"PAYLOAD, OTHER_PAYLOAD = {PAYLOAD!r}, {OTHER_PAYLOAD!r}",
                recipe[0], check,
                "assert kit.Conflict.__module__ == 'kit' and not os.path.exists(os.path.join(folder, 'reliability.py'))",
                "print('ok', sys.version_info >= (3, 12))"])
            done = run_experiment.run_together([[python, "-I", "-S", *SAME_FLAGS, "-c", script] for python in interpreters])
        for python, (code, out, err) in zip(interpreters, done):
            with self.subTest(python=python):
                self.assertEqual((code, err.decode("utf-8")), (0, ""))
                self.assertTrue(out.startswith(b"ok"), out)

    def test_each_kit_is_the_transitive_closure_of_what_its_functions_need(self):
        self.assertEqual(closure(["receive"]), set(RECEIVE_KIT))
        self.assertEqual(closure(["enqueue", "claim", "acknowledge"]), set(OUTBOX_KIT))
        # What a copier pastes, in lines: it may not grow unnoticed.
        self.assertLessEqual(sum(len(segment(DEFINITIONS[name])) for name in RECEIVE_KIT), 114)
        self.assertLessEqual(sum(len(segment(DEFINITIONS[name]))
                                 for name in closure(["claim", "acknowledge"])), 137)

    def test_the_receive_kit_runs_the_articles_replay_alone(self):
        self.run_kit(RECEIVE_KIT, KIT_CHECKS["receive"])

    def test_the_outbox_kit_runs_the_articles_lease_and_stale_acknowledgement_alone(self):
        self.run_kit(OUTBOX_KIT, KIT_CHECKS["outbox"])

    def test_the_kits_fail_loudly_on_a_connection_made_another_way(self):
        # What the README warns about, shown: 3.12's autocommit=False opens a transaction of its own.
        if sys.version_info < (3, 12):
            self.skipTest("sqlite3's autocommit setting exists from Python 3.12")
        with tempfile.TemporaryDirectory() as directory:
            connection = sqlite3.connect(os.path.join(directory, "r.db"), autocommit=False)
            try:
                with self.assertRaisesRegex(sqlite3.OperationalError, "within a transaction"):
                    reliability.transaction(connection).__enter__()
            finally:
                connection.close()


class PublicNamesTest(unittest.TestCase):
    """README.md lists reliability.__all__ on one line; it must not go stale."""

    def test_the_readme_lists_exactly_reliability_all(self):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as handle:
            lines = [line for line in handle.read().splitlines() if line.startswith("`reliability.__all__`:")]
        self.assertTrue(lines, "README.md has no line starting with `reliability.__all__`:")
        for line in lines:
            listed = re.findall(r"`([^`]+)`", line.split(":", 1)[1])
            self.assertEqual(sorted(listed), sorted(reliability.__all__))
        self.assertEqual(len(reliability.__all__), len(set(reliability.__all__)))
        self.assertTrue(all(hasattr(reliability, name) for name in reliability.__all__))


# === driver tests: results.json as committed (--check reruns every scenario against it), and the driver ===

ARTICLE_1 = ["naive_lost_ack", "mark_before_send_loses_task", "idempotent_lost_ack", "before_intent_commit",
             "after_intent_commit", "after_claim", "before_receiver_commit", "after_response_write",
             "after_response_before_ack", "after_ack", "mismatched_payload", "concurrent_claim",
             "concurrent_receiver", "before_external_effect", "after_external_effect", "unsafe_external_retry"]
MATRIX = [f"reliability/{boundary}" for boundary in reliability.BOUNDARIES]


with open(run_experiment.RESULTS, encoding="utf-8") as _handle:
    RESULTS = json.load(_handle)


def stage(name, which, *keys):
    observed = RESULTS[run_experiment.SCENARIOS[name][0]][name][which]
    return tuple(observed[key] for key in keys)


class ResultsTest(unittest.TestCase):
    """第一篇 §4–§6 as results.json records the driver's run; ``run_experiment.py --check`` reruns
    every scenario and fails unless the run equals it, so these figures are the live ones."""

    def test_the_driver_names_exactly_the_articles_16_scenarios(self):
        self.assertEqual([name for name, (article, _, _) in run_experiment.SCENARIOS.items()
                          if article == "article_1"], ARTICLE_1)

    def test_results_json_holds_every_scenario_the_driver_registers_and_nothing_else(self):
        for group in ("article_1", "open_ends"):
            with self.subTest(group):
                self.assertEqual(set(RESULTS[group]), {name for name, (article, _, _)
                                                       in run_experiment.SCENARIOS.items() if article == group})
        self.assertEqual({name for name in RESULTS["crash_matrix"] if name.startswith("reliability/")}, set(MATRIX))

    def test_the_articles_figures(self):
        self.assertEqual((stage("naive_lost_ack", "after_lost_ack", "receiver_tickets")
                          + stage("naive_lost_ack", "after_recovery", "receiver_tickets")), (1, 2))
        self.assertEqual((stage("idempotent_lost_ack", "after_lost_ack", "receiver_tickets")
                          + stage("idempotent_lost_ack", "after_recovery", "receiver_tickets")), (1, 1))
        self.assertEqual(stage("mark_before_send_loses_task", "after_restart", "sender_state", "receiver_tickets"),
                         ("done", 0))
        self.assertEqual(stage("after_response_write", "after_crash", "sender_state", "attempts", "exit_codes"),
                         ("done", 1, [CRASH_EXIT]))
        self.assertEqual(stage("before_external_effect", "after_restart", "sender_state", "external_tickets"),
                         ("unknown", 0))
        self.assertEqual(stage("after_external_effect", "after_restart", "sender_state", "external_tickets"),
                         ("unknown", 1))
        self.assertEqual(stage("concurrent_claim", "after_race", "claim_winners", "released_together"), (1, 8))
        self.assertEqual(stage("concurrent_receiver", "after_race", "released_together"), (8,))
        self.assertEqual(stage("concurrent_claim", "after_stale_ack", "stale_ack"), ("refused",))
        self.assertEqual(stage("concurrent_receiver", "after_race", "receiver_tickets", "receiver_receipts",
                               "distinct_responses"), (1, 1, 1))
        self.assertEqual(stage("mismatched_payload", "after_mismatch", "refusal", "receiver_tickets"), ("conflict", 1))
        self.assertEqual(stage("unsafe_external_retry", "after_unsafe_retry", "external_tickets"), (2,))

    def test_the_crash_matrix_crashed_every_boundary_and_only_the_naive_receiver_duplicates(self):
        twice = set()
        for name in MATRIX:
            boundary = name.split("/", 1)[1]
            cells = RESULTS["crash_matrix"][name]
            with self.subTest(boundary):
                self.assertEqual(sorted(cells), sorted(run_experiment.matrix_modes(boundary)))
                self.assertEqual({cell["exit_code"] for cell in cells.values()}, {CRASH_EXIT})
                if "idempotent" in cells:
                    self.assertEqual((cells["idempotent"]["sender_state"], cells["idempotent"]["tickets"]), ("done", 1))
                if "external" in cells:
                    self.assertEqual(cells["external"]["attempts"], 1)
                    self.assertIn((cells["external"]["sender_state"], cells["external"]["tickets"]),
                                  {("unknown", 0), ("unknown", 1), ("done", 1)})
                if cells.get("naive", {}).get("tickets") == 2:
                    twice.add(boundary)
        self.assertEqual(twice, {"after_receiver_commit"})


class DriverTest(unittest.TestCase):
    """run_experiment.py itself: exit codes, Ctrl-C, a dead worker, the five files alone."""

    def run_main(self, *argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = run_experiment.main(list(argv))
            except SystemExit as stop:
                code = stop.code
        return code, out.getvalue(), err.getvalue()

    @unittest.skipUnless(os.path.isdir("/proc/self/fd"), "the check reads /proc/self/fd")
    def test_fork_start_refuses_to_fork_while_this_process_holds_a_database_the_child_opens(self):
        with workspace() as ws:
            ws.receiver.execute("SELECT 1")  # an open connection, as a test or the driver might hold
            for argv in (["serve", "receive", ws.path("receiver")], ["snapshot", ws.root]):
                with self.subTest(argv=argv), self.assertRaisesRegex(RuntimeError, r"receiver\.db(-wal|-shm)? open"):
                    run_experiment.fork_start(reliability, argv)
            ws.close()
            alias = os.path.join(ws.root, "alias")
            os.link(ws.path("receiver"), alias)  # another name for the same inode: SQLite's lock records are per inode
            # (connect() refuses a file with two names; a plain connection through the other one is still held)
            with contextlib.closing(sqlite3.connect(alias)), self.assertRaisesRegex(RuntimeError, "receiver.db open"):
                run_experiment.fork_start(reliability, ["serve", "receive", ws.path("receiver")])
            os.remove(alias)
            with open(os.path.join(ws.root, "notes.txt"), "w"):  # not a database: no reason to refuse
                self.assertEqual(cli("snapshot", ws.root)[0], 0)
            self.assertEqual(cli("snapshot", "\ud800")[0], 1)  # not even a path: the child, not the guard, says so

    def test_a_forked_child_exits_as_sys_exit_of_main_would(self):
        def module(outcome):  # a stand-in module whose main() returns or raises ``outcome``
            def main(argv):
                if isinstance(outcome, BaseException):
                    raise outcome
                return outcome
            stand_in = types.ModuleType("stand_in")
            stand_in.main = main
            return stand_in
        cases = [(None, 0, ""), (3, 3, ""), ("text", 1, "text\n"), (SystemExit(2), 2, ""),
                 (SystemExit("bye"), 1, "bye\n"), (ValueError("boom"), 1, "ValueError: boom\n")]
        for outcome, code, tail in cases:
            with self.subTest(outcome=outcome), tempfile.TemporaryFile() as stderr:
                child = run_experiment.fork_start(module(outcome), [], stderr=stderr.fileno())
                child.communicate(b"", timeout=WATCHDOG)
                stderr.seek(0)
                self.assertEqual(child.returncode, code)
                self.assertTrue(stderr.read().decode("utf-8").endswith(tail))

    def test_an_unusable_output_or_check_file_exits_2_with_one_line_before_any_scenario(self):
        with tempfile.TemporaryDirectory() as directory:
            for argv in (["--output", directory], ["--output", os.path.join(directory, "missing", "out.json")],
                         ["--check", os.path.join(directory, "missing.json")]):
                with self.subTest(argv=argv):
                    code, out, err = self.run_main(*argv)
                    self.assertEqual((code, out, len(err.splitlines())), (2, "", 1))
                    self.assertIn("run_experiment.py: error:", err)

    @unittest.skipUnless(hasattr(os, "mkfifo"), "a FIFO holds the driver still")
    def test_ctrl_c_exits_130_with_one_line_and_no_traceback(self):
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # a background job: its children ignore it too
            self.skipTest("SIGINT is ignored in this process, so no child of it can be interrupted")
        # --check opens a FIFO that nobody writes: the driver waits there until the interrupt.
        with tempfile.TemporaryDirectory() as directory:
            fifo = os.path.join(directory, "results.json")
            os.mkfifo(fifo)
            child = subprocess.Popen([sys.executable, "-S", os.path.join(HERE, "run_experiment.py"), "--check", fifo],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            writer = None
            try:
                deadline = time.monotonic() + WATCHDOG
                while writer is None:  # opened for writing once the driver has it open for reading
                    try:
                        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                    except OSError as error:  # ENXIO: no reader yet
                        self.assertEqual(error.errno, errno.ENXIO)
                        self.assertLess(time.monotonic(), deadline, "the driver never opened the FIFO")
                        time.sleep(0.005)
                child.send_signal(signal.SIGINT)
                out, err = child.communicate(timeout=WATCHDOG)
            finally:
                if writer is not None:
                    os.close(writer)
                if child.returncode is None:
                    child.kill()
                    child.communicate()
            self.assertEqual((child.returncode, out, err.decode("utf-8")), (130, b"", "run_experiment.py: interrupted\n"))

    @unittest.skipUnless(hasattr(os, "fork"), "the driver's workers are forked")
    def test_a_worker_that_dies_fails_the_scenario_it_held_and_the_others_still_run(self):
        def kills_its_worker(run):
            os._exit(9)  # the worker process itself, not a child: it reports nothing

        def observes(run):
            run.stages["seen"] = {"pid_differs": os.getpid() != parent}
        parent = os.getpid()
        added = {"kills_its_worker": kills_its_worker, "observes": observes, "observes_too": observes}
        for name, function in added.items():
            run_experiment.SCENARIOS[name] = ("article_7", name, function)
        try:
            runs = run_experiment.run_all(list(added), jobs=2)
        finally:
            for name in added:
                del run_experiment.SCENARIOS[name]
        self.assertEqual({run.name: (run.failures, run.stages) for run in runs}, {
            "kills_its_worker": (["its worker died or failed before reporting (a traceback, if any, is above)"], {}),
            "observes": ([], {"seen": {"pid_differs": True}}), "observes_too": ([], {"seen": {"pid_differs": True}})})

    @unittest.skipUnless(hasattr(os, "fork"), "the driver forks its children")
    def test_a_batch_that_fails_half_way_kills_and_reaps_every_child_before_its_folder_goes(self):
        # Real children that would wait for ever (serve --wait with no request), then a failure: a child at
        # the watchdog, or a start that fails half way (the only simulated part: fork refusing a fourth child).
        real, started = run_experiment.fork_start, []

        def fourth_fails(*args, **kwargs):
            if len(started) == 3:
                raise OSError("no more processes")
            started.append(real(*args, **kwargs))
            return started[-1]
        with workspace() as ws:
            ws.close()
            run = run_experiment.Run("batch", ws.root)
            command = ("reliability.py", "serve", "receive", ws.path("receiver"), "--wait")
            with self.assertRaises(RuntimeError), run_experiment.batch(run, [command] * 8) as children:
                raise RuntimeError("one child hung at the watchdog")
            with mock.patch.object(run_experiment, "fork_start", fourth_fails), self.assertRaises(OSError):
                with run_experiment.batch(run, [command] * 8):
                    pass
            for child in children + started:
                self.assertEqual(child.returncode, -signal.SIGKILL)
                with self.assertRaises(ChildProcessError):  # reaped: no zombie either
                    os.waitpid(child.pid, os.WNOHANG)
            self.assertEqual((len(children), len(started)), (8, 3))

    @unittest.skipUnless(hasattr(os, "fork"), "the driver forks its children")
    def test_a_racer_that_never_reaches_the_barrier_fails_the_race(self):
        request = json.dumps({"caller": "agent", "key": "k1", "payload": PAYLOAD, "issued_at": 0, "now": 0})
        with workspace() as ws:
            ws.close()
            run = run_experiment.Run("race", ws.root)
            serve = ("reliability.py", "serve", "receive", ws.path("receiver"))
            with run_experiment.batch(run, [serve + ("--wait",)] * 2) as children:
                self.assertEqual(run_experiment.race(children, request)[0], 2)
            with self.assertRaisesRegex(RuntimeError, "did not all reach the barrier"):
                with run_experiment.batch(run, [serve + ("--wait",), serve]) as children:  # one answers at once
                    run_experiment.race(children, request)

    def test_check_exits_1_and_names_each_difference_a_changed_value_and_a_key_on_one_side_only(self):
        with tempfile.TemporaryDirectory() as directory:
            for label, tamper in (("changed", lambda stage: stage.update(receiver_tickets=2)),
                                  ("missing", lambda stage: stage.pop("receiver_tickets")),
                                  ("extra", lambda stage: stage.update(surplus=0))):
                with self.subTest(label):
                    expected = json.loads(json.dumps(RESULTS))
                    tamper(expected["article_1"]["idempotent_lost_ack"]["after_recovery"])
                    path = os.path.join(directory, label + ".json")
                    with open(path, "w", encoding="utf-8") as handle:
                        json.dump(expected, handle)
                    code, out, _ = self.run_main("--check", path, "--only", "idempotent_lost_ack")
                    self.assertEqual(code, 1, out)
                    key = "surplus" if label == "extra" else "receiver_tickets"
                    self.assertIn(f"differs: article_1.idempotent_lost_ack.after_recovery.{key}", out)
                    self.assertIn("0/1 scenarios match", out)
        self.assertEqual(run_experiment.differences({"x": {"a": 1, "b": 2}}, {"x": {"a": 1}}), [("x.b", 2, "<absent>")])
        # A scenario in results.json that the driver no longer runs is compared, so it differs.
        expected = dict(RESULTS, article_1=dict(RESULTS["article_1"], ghost={"seen": {"tickets": 1}}))
        self.assertIn("ghost", run_experiment.compared(expected)["article_1"])
        self.assertEqual(set(run_experiment.compared(expected, ["ghost"])), {"article_1"})
        self.assertNotIn("ghost", run_experiment.compared(expected, ["idempotent_lost_ack"])["article_1"])
        self.assertEqual(run_experiment.differences({"x": {"a": 1}}, {"x": {"a": 1, "b": 2}}), [("x.b", "<absent>", 2)])

    def test_a_failed_invariant_fails_the_run_and_is_counted(self):
        def breaks_its_invariant(run):
            run.expect("the figure", 1, 2)
        run_experiment.SCENARIOS["breaks_its_invariant"] = ("article_1", "a scenario that fails", breaks_its_invariant)
        try:
            code, out, _ = self.run_main("--only", "breaks_its_invariant")
        finally:
            del run_experiment.SCENARIOS["breaks_its_invariant"]
        self.assertEqual(code, 1)
        self.assertIn("invariant failed: the figure: expected 2, observed 1", out)
        self.assertIn("0/1 scenarios hold their invariants", out)

    def test_the_integrity_check_after_each_scenario_can_fail(self):
        with tempfile.TemporaryDirectory() as directory:
            with raw(os.path.join(directory, "keys.db")) as broken:  # a receipt whose ticket does not exist
                for statement in reliability.SCHEMAS[RECEIVER]:
                    broken.execute(statement)
                broken.execute("INSERT INTO receipts VALUES ('a', 'k', 'd', 99, 0)")
            pages = os.path.join(directory, "pages.db")
            with raw(pages) as broken:
                broken.execute("CREATE TABLE t (x TEXT)")
                broken.execute("CREATE INDEX t_x ON t (x)")
                broken.executemany("INSERT INTO t VALUES (?)", [(f"row {i}" * 20,) for i in range(200)])
            with open(pages, "r+b") as handle:  # the last page overwritten: SQLite's own check must see it
                handle.seek(-4096, os.SEEK_END)
                handle.write(GARBAGE[:4096])
            run = run_experiment.Run("integrity", directory)
            run_experiment.check_integrity(run)
        self.assertEqual(sorted(name for name, verdict in run.integrity.items() if verdict != "ok"),
                         ["keys.db", "pages.db"])
        self.assertEqual(len(run.failures), 2)

    def test_check_compares_json_types_so_one_is_not_true(self):
        self.assertEqual(run_experiment.differences({"a": 0, "b": 2, "c": [1]}, {"a": False, "b": 2.0, "c": [True]}),
                         [("a", 0, False), ("b", 2, 2.0), ("c", [1], [True])])
        self.assertEqual(run_experiment.differences({"a": {"b": 1}}, {"a": {"b": 1}}), [])

    def test_the_five_downloaded_files_alone_reproduce_results_json_and_import_the_tests(self):
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        with tempfile.TemporaryDirectory() as directory:
            for name in DOWNLOAD:
                shutil.copyfile(os.path.join(HERE, name), os.path.join(directory, name))
            # The article's command, on one scenario of each group: the same imports, registration and
            # comparison as the whole run (which the README's --check already does), at a fraction of the time;
            # meanwhile another process imports the tests and counts what the driver registered.
            only = ["--only", "idempotent_lost_ack", "manual_resolution", "reliability/after_claim"]
            commands = [["run_experiment.py", "--check", "results.json", "--output", "reproduced.json", *only],
                        ["-c", "import json, sys, test_reliability, run_experiment as r; print(len(r.SCENARIOS),"
                               " 'preconditions' in sys.modules, sorted(n for group in r.compared(json.load("
                               "open('results.json'))).values() for n in group) == sorted(r.SCENARIOS))"]]
            (code, check, _), imported = run_experiment.run_together(
                [[sys.executable, "-S", *SAME_FLAGS, *command] for command in commands], cwd=directory, env=env)
            self.assertEqual(code, 0, check.decode("utf-8"))
            self.assertIn(b"4/4 scenarios match results.json", check)  # + after_claim, a matrix cell
            with open(os.path.join(directory, "reproduced.json"), encoding="utf-8") as handle:
                self.assertEqual(set(json.load(handle)), {"article_1", "open_ends", "crash_matrix"})
            # 16 + 5 + 11 cells registered, and exactly these are what a whole --check compares
            self.assertEqual(imported, (0, b"32 False True\n", b""))
            self.assertEqual(sorted(os.listdir(directory)), sorted(DOWNLOAD + ("reproduced.json",)))


@functools.lru_cache(maxsize=None)
def parsed(path):
    """A file's syntax tree, read as text (the other module may be absent), parsed once."""
    with open(path, encoding="utf-8") as handle:
        return ast.parse(handle.read())


@functools.lru_cache(maxsize=None)
def module_definitions(path):
    """Module-level names defined in a file."""
    tree = parsed(path)
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))} | {
        target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets
        if isinstance(target, ast.Name)}


# README.md's first table: each article 1 scenario's figures, as paths into results.json, in the order
# the "ours" cell gives them; the list beyond article 1 likewise.
TABLE_FIGURES = {
    "naive_lost_ack": [("after_lost_ack", "receiver_tickets"), ("after_recovery", "receiver_tickets")],
    "mark_before_send_loses_task": [("after_restart", "sender_state"), ("after_restart", "receiver_tickets")],
    "idempotent_lost_ack": [("after_lost_ack", "receiver_tickets"), ("after_recovery", "receiver_tickets"),
                            ("after_recovery", "response", "ticket_id")],
    "before_intent_commit": [("after_recovery", "retry"), ("after_recovery", "receiver_tickets")],
    "after_intent_commit": [("after_recovery", "retry"), ("after_recovery", "receiver_tickets")],
    "after_claim": [("before_lease_expiry", "attempts"), ("after_recovery", "attempts"),
                    ("after_recovery", "receiver_tickets")],
    "before_receiver_commit": [("after_crash", "receiver_tickets"), ("after_recovery", "receiver_tickets")],
    "after_response_write": [("after_crash", "sender_state"), ("after_crash", "attempts")],
    "after_response_before_ack": [("after_recovery", "attempts"), ("after_recovery", "response", "ticket_id")],
    "after_ack": [("after_restart", "attempts"), ("after_restart", "receiver_tickets")],
    "mismatched_payload": [("after_mismatch", "refusal"), ("after_mismatch", "receiver_tickets")],
    "concurrent_claim": [("after_race", "claim_winners"), ("after_race", "released_together"),
                         ("after_stale_ack", "stale_ack")],
    "concurrent_receiver": [("after_race", "receiver_tickets"), ("after_race", "receiver_receipts"),
                            ("after_race", "distinct_responses")],
    "before_external_effect": [("after_restart", "sender_state"), ("after_restart", "external_tickets")],
    "after_external_effect": [("after_restart", "sender_state"), ("after_restart", "external_tickets")],
    "unsafe_external_retry": [("after_unsafe_retry", "external_tickets")],
    "reconcile_found": [("after_restart", "external_tickets")],
    "reconcile_absent": [("after_retry", "external_tickets")],
    "manual_resolution": [("after_resolution", "audit_rewrite")],
    "late_replay_after_purge": [("after_late_replay", "response", "error"), ("after_late_replay", "receiver_tickets")],
    "late_replay_without_policy": [("after_late_replay", "receiver_tickets")],
}


def figure(name, path):
    value = RESULTS[run_experiment.SCENARIOS[name][0]][name]
    for key in path:
        value = value[key]
    return value


class ReadmeTest(unittest.TestCase):
    """README.md stays true for the reader: its limits, its headline lines and tables are the driver's and
    results.json's, its walk-through runs as printed, its map and kits name what exists."""

    @classmethod
    def setUpClass(cls):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as handle:
            cls.text = handle.read()
        cls.lines = cls.text.splitlines()

    def assert_figures(self, cell, values):
        """``values`` appear in ``cell`` in order, and it holds no other number."""
        self.assertTrue(run_experiment.holds_figures(cell, values), f"{cell!r} does not give {values!r}")

    def test_it_keeps_its_limits_and_gives_the_two_commands_ci_runs(self):
        outside = re.sub(r"^```sql[^\n]*\n.*?^```", "", self.text, flags=re.S | re.M)
        self.assertLessEqual(len(outside), 14000)
        prose = re.sub(r"^```.*?^```", "", self.text, flags=re.S | re.M)
        units = [unit.strip() for paragraph in re.split(r"\n\s*\n", prose)
                 for unit in re.split(r"\n(?=\s*(?:[-*]|\d+\.)\s)", paragraph) if unit.strip()]
        self.assertLessEqual(max(len(unit) for unit in units if not unit.startswith("|")), 600)
        self.assertIn("python3 -m unittest\npython3 run_experiment.py --check\n", self.text)
        ci = os.path.join(HERE, ".ci", "run")
        if os.path.exists(ci):  # not in an article's five-file download
            with open(ci, encoding="utf-8") as handle:
                self.assertIn('"$real" -m unittest && "$real" run_experiment.py --check', handle.read())

    def test_its_headline_lines_are_the_consoles_within_the_first_60_lines(self):
        names = ["naive_lost_ack", "mark_before_send_loses_task", "idempotent_lost_ack"]
        top = self.lines[:60]
        for run in run_experiment.run_all(names):
            self.assertEqual(run.failures, [])
            self.assertIn(run_experiment.console_line(run), top)
        total = sum(len(group) for group in RESULTS.values())
        self.assertIn(f"{total}/{total} scenarios match results.json", top)

    def test_the_counts_it_gives_are_the_drivers_and_the_test_files(self):
        groups = {group: len(RESULTS[group]) for group in ("article_1", "open_ends")}
        cells = len(MATRIX)
        self.assertEqual((groups["article_1"], groups["open_ends"], cells), (16, 5, 11))
        ours = sum(groups.values()) + cells
        for said in (f"第一篇 {ours}（16 个文章场景 + 5 个超出文章 + 11 格崩溃矩阵）",
                     f"article 1's {ours} (16 scenarios + 5 beyond + 11 crash-matrix cells)"):
            self.assertTrue(said in self.text, f"README.md does not say {said!r}")

    def test_the_scenario_table_and_the_list_beyond_give_results_jsons_figures(self):
        rows = {re.match(r"`(\w+)`", row[0]).group(1): row for row in run_experiment.readme_table("| 场景 scenario")}
        self.assertEqual(list(rows), ARTICLE_1)
        for name, row in rows.items():
            with self.subTest(name):
                self.assert_figures(row[2], [figure(name, path) for path in TABLE_FIGURES[name]])
        beyond = {re.match(r"- `(\w+)`", line).group(1): line for line in self.lines if re.match(r"- `\w+` ", line)}
        self.assertEqual(list(beyond), [name for name, (group, _, _) in run_experiment.SCENARIOS.items()
                                        if group == "open_ends"])
        for name, line in beyond.items():
            with self.subTest(name):
                self.assert_figures(line[line.rindex("（"):], [figure(name, path) for path in TABLE_FIGURES[name]])

    def test_the_walk_through_runs_as_printed_in_a_copy_of_the_download_and_shows_what_it_says(self):
        [block] = [block for block in run_experiment.readme_blocks("sh") if "python3 reliability.py init" in block]
        self.assertGreaterEqual(len([line for line in block.splitlines() if line.startswith("python3")]), 10)
        code, out, unseen = run_experiment.walk_through(block, DOWNLOAD, SAME_FLAGS)
        self.assertIsNone(unseen, out)  # each output where the reader is told to look, in the block's order
        self.assertEqual(code, 0, out)
        self.assertNotIn("Traceback", out)

    def test_the_map_names_only_code_scenarios_and_tests_that_exist(self):
        rows = run_experiment.readme_table("| 章节")
        self.assertTrue(rows)
        for section, code, scenario, test in rows:
            article_7 = section.startswith("七")
            module, tests = ("preconditions.py", "test_preconditions.py") if article_7 else ("reliability.py", "test_reliability.py")
            if not os.path.exists(os.path.join(HERE, module)):
                continue  # the other article's five-file download
            for name in re.findall(r"`([^`]+)`", code):
                self.assertIn(name, module_definitions(os.path.join(HERE, module)), section)
            for name in re.findall(r"`([^`]+)`", scenario):
                self.assertIn(name, run_experiment.SCENARIOS, section)
                self.assertEqual(run_experiment.SCENARIOS[name][0].startswith("article_7"), article_7, section)
            if os.path.exists(os.path.join(HERE, tests)):
                for name in re.findall(r"`([^`]+)`", test):
                    self.assertIn(name, module_definitions(os.path.join(HERE, tests)), section)

    def test_each_kit_row_lists_its_closure_and_counts_its_lines(self):
        rows = {row[0]: row for row in run_experiment.readme_table("| 要用的")}
        for use in ("`reliability.receive`", "`reliability.enqueue` + `claim` + `acknowledge`"):
            with self.subTest(use):
                roots = re.findall(r"`(?:reliability\.)?([^`]+)`", use)
                self.assertEqual(set(re.findall(r"`([^`]+)`", rows[use][1])) | set(roots), closure(roots))
                self.assertEqual(rows[use][2], str(sum(len(segment(DEFINITIONS[name])) for name in closure(roots))))


if __name__ == "__main__":  # keep last: classes defined below it would not run under `python3 test_reliability.py`
    unittest.main()
