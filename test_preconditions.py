"""Tests for preconditions.py (第七篇《没有重复执行，为什么还是办错了？》): real SQLite files, real processes.

Grouped by the article's sections, in its order, then what goes beyond article 7, then the
driver's: results.json's figures (run_experiment.py --check proves the live run equals it)
and the five files alone.  Children are forked as the driver forks them, or fresh
interpreters where the command line itself is under test.  Run: python3 test_preconditions.py,
or python3 -X dev -W error -m unittest test_preconditions.
Standard library only; reliability.py is never imported (article 7's download lacks it).
"""
import os
import sys

if sys.version_info < (3, 9):  # one clear line (unittest would turn SystemExit into a traceback)
    sys.stderr.write("test_preconditions.py needs Python 3.9 or newer; this is %s\n" % sys.version.split()[0])
    sys.stderr.flush()
    os._exit(2)

import ast
import collections
import contextlib
import functools
import hashlib
import importlib.util
import inspect
import itertools
import json
import random
import re
import select
import shutil
import signal
import sqlite3
import tempfile
import threading
import unittest
from unittest import mock

import preconditions as pre
import run_experiment

HERE = os.path.dirname(os.path.abspath(__file__))
MODULE = os.path.join(HERE, "preconditions.py")
WATCHDOG = 60  # seconds; only prevents a hung test, never a measurement
# This run's interpreter flags (-X dev, -W error), for the fresh interpreters that run the driver.
SAME_FLAGS = (["-X", "dev"] if sys.flags.dev_mode else []) + [f"-W{option}" for option in sys.warnoptions]
# The article's download: these five files alone run it.
DOWNLOAD = ("preconditions.py", "run_experiment.py", "results.json", "test_preconditions.py", "README.md")
START = ({"A": (10, 1), "B": (0, 1)}, 0, 0)  # (name: (quantity, revision)), effects, receipts
APPLIED = {"status": "applied", "revisions": {"A": 2, "B": 2}, "quantities": {"A": 7, "B": 3}}
AFTER_APPLIED = ({"A": (7, 2), "B": (3, 2)}, 1, 1)
# 第七篇 §2, verbatim: the receipt query and what it answers.
ARTICLE_HISTORY = """old = c.execute(
    'SELECT digest,result FROM receipt WHERE op=?', (op,)
).fetchone()
if old:
    if old[0] != digest:
        return {'status': 'conflict'}
    return {'status': 'replayed', 'result': json.loads(old[1])}"""
# 第一篇: the transaction wrapper both modules use, line for line.
ARTICLE_TRANSACTION = """@contextmanager
def transaction(connection):
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield
        connection.execute("COMMIT")
    except BaseException:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        raise"""
KIT = ["execute", "history", "_expired", "validate", "_check_text", "_check_int", "check_ticks", "transaction",
       "crash_point", "CRASH_AT", "EXIT_CODES", "MAX_OP_LENGTH", "MAX_NAME_LENGTH", "MAX_AMOUNT", "MAX_INT64",
       "MAX_TICK", "_dumps"]
KIT_IMPORTS = "import hashlib\nimport json\nimport os\nimport sqlite3\nfrom contextlib import contextmanager\n"
TWINS = ["MAX_TICK", "BUSY_TIMEOUT", "_dumps", "transaction", "check_ticks", "_open", "_usable_file", "_stat",
         "_read_write", "_create", "wal_reset_bug", "_text", "_json_argument", "_no_repeats"]


def plan(a=1, b=1, amount=3, src="A", dst="B"):
    return {"src": src, "dst": dst, "amount": amount, "expected": {src: a, dst: b}}


def file_bytes(path):
    with open(path, "rb") as handle:
        return handle.read()


def digest_of(command):
    text = json.dumps(command, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def cli(*args, between=None, stdin=b""):
    """preconditions.py's command line, main(argv), in a forked child as the driver's children run;
    (exit code, stdout, stderr) as UTF-8.  With ``between``, for a --wait child: at its READY
    line (it has read what it checks) run between(), then write GO."""
    code, out, err = run_experiment.fork_main(pre, args, stdin, at_ready=between)
    return code, out.decode("utf-8"), err.decode("utf-8")


@functools.lru_cache(maxsize=None)
def definitions(path):
    """{name: (node, source lines incl. decorators)} of a module's top-level definitions, in source order."""
    with open(path, encoding="utf-8") as handle:
        source = handle.read()
    lines, found = source.splitlines(True), {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [target.id for target in node.targets if isinstance(target, ast.Name)]
        else:
            continue
        first = min([node.lineno] + [decorator.lineno for decorator in getattr(node, "decorator_list", [])])
        segment = "".join(lines[first - 1:node.end_lineno]).rstrip("\n")
        for name in names:
            found[name] = (node, segment)
    return found



def _connect_as_nobody(path):
    """In a forked child: become nobody if we are root (root passes every permission check), then connect."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    try:
        pre.connect(path).close()
        return "ok"
    except Exception as error:
        return f"{type(error).__name__}: {error}"

MANY_AGENTS, MANY_OPERATIONS, MANY_SEED = 3, 400, 7  # agents, connections by each, their choices
MANY_RESOURCES = {"A": 1000, "B": 1000, "C": 1000, "D": 1000}


def _many_agents(db, folder, wait):
    """One of MANY_AGENTS agents: MANY_OPERATIONS times it opens ``db``, then transfers on
    revisions it has just read (1 in 10), changes a quantity (1 in 20), replays one of its ops
    (1 in 20) or checkpoints (1 in 20), or only reads, and closes; each answer goes to its
    journal.  Odd agents SIGKILL themselves in their second half, at a seeded moment: just
    opened, inside the transaction, or answered but not yet noted."""
    index, journal = _numbered(folder, "agent")
    rng = random.Random(f"{MANY_SEED}/{index}")
    death = (rng.randrange(MANY_OPERATIONS // 2, MANY_OPERATIONS),
             rng.choice(("opened", "writing", "answered"))) if index % 2 else None
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    done = []
    with open(journal, "ab", buffering=0) as journal:
        wait()
        for operation in range(MANY_OPERATIONS):
            connection, work, op = pre.connect(db), rng.random(), f"agent-{index}/{operation}"
            try:
                if death == (operation, "opened"):
                    die()
                if death == (operation, "writing"):
                    connection.set_progress_handler(die, rng.randint(1, 40))
                if work < 0.1 or death and death[0] == operation:
                    src, dst = rng.sample(sorted(MANY_RESOURCES), 2)
                    seen = dict(connection.execute("SELECT name, revision FROM resources"))
                    command = {"src": src, "dst": dst, "amount": rng.randint(1, 9),
                               "expected": {src: seen[src], dst: seen[dst]}}
                    answer = pre.execute(connection, op, command, issued_at=0, now=0)
                    done.append((op, command))
                elif work < 0.15:
                    answer = pre.change(connection, op, rng.choice(sorted(MANY_RESOURCES)),
                                        rng.choice((-1, 1)) * rng.randint(1, 9), issued_at=0, now=0)
                elif work < 0.2 and done:
                    op, command = rng.choice(done)
                    answer = pre.execute(connection, op, command, issued_at=0, now=0)
                else:
                    answer = None
                    if work < 0.25:
                        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    connection.execute("SELECT count(*) FROM receipt").fetchone()
                if death == (operation, "answered"):
                    die()
                if answer is not None:
                    journal.write(json.dumps([op, answer]).encode("utf-8") + b"\n")
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


def crowd(body, n):
    """Run ``body(wait)`` in ``n`` forked processes; wait() returns once all n have called it, a
    barrier checked here.  Returns each one's JSON result, None for one killed by SIGKILL."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()

    def racer():
        def wait():
            os.write(ready_w, b"r")
            if os.read(go_r, 1) != b"g":
                raise RuntimeError("the barrier broke")
        return body(wait)
    workers = []
    try:
        for _ in range(n):
            workers.append(run_experiment.fork_json(racer))
        arrived = b""
        while len(arrived) < n:
            ready = select.select([ready_r], [], [], WATCHDOG)[0]
            assert ready, f"only {len(arrived)} of {n} racers reached the barrier"
            arrived += os.read(ready_r, n)
        os.write(go_w, b"g" * n)
        results = []
        for pid, reader in workers:
            with os.fdopen(reader, encoding="utf-8") as pipe:
                text = pipe.read()
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            assert code in (0, -signal.SIGKILL), f"a racer exited {code}"
            results.append(json.loads(text) if code == 0 else None)
        workers = []
        return results
    finally:
        for pid, reader in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            with contextlib.suppress(OSError):
                os.close(reader)
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)


TEMPLATE = {}  # an A = 10, B = 0 database made once by init(), byte-copied per test


def setUpModule():
    TEMPLATE["dir"] = tempfile.TemporaryDirectory()
    TEMPLATE["path"] = os.path.join(TEMPLATE["dir"].name, "template.db")
    pre.init(TEMPLATE["path"], {"A": 10, "B": 0})


def tearDownModule():
    TEMPLATE.pop("dir").cleanup()


class Case(unittest.TestCase):
    """A fresh temporary directory with an A = 10, B = 0 database made by init(), and self.c, a
    connection to it opened on first use; self.release() closes it before a child opens the file."""

    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.dir = tmp.name
        self.db = self.make_db()
        self._c = None

    @property
    def c(self):
        if self._c is None:
            self._c = self.open()
        return self._c

    def release(self):
        if self._c is not None:
            self._c.close()
            self._c = None

    def make_db(self, resources=None, name="t.db"):
        path = os.path.join(self.dir, name)
        if resources is None:
            shutil.copyfile(TEMPLATE["path"], path)  # a byte copy of a closed database: no fsync per test
        else:
            pre.init(path, resources)
        return path

    def open(self, path=None):
        connection = pre.connect(path or self.db)
        self.addCleanup(connection.close)
        return connection

    def x(self, op, command=None, *, c=None, issued_at=0, now=0):
        return pre.execute(c or self.c, op, plan() if command is None else command, issued_at=issued_at, now=now)

    def change(self, op, name, delta, *, c=None, issued_at=0, now=0):
        return pre.change(c or self.c, op, name, delta, issued_at=issued_at, now=now)

    def figures(self, path=None):
        """({name: (quantity, revision)}, effects, receipts) from a fresh connection: what a recovering reader sees."""
        connection = pre.connect(path or self.db)
        try:
            seen = pre.snapshot(connection)
        finally:
            connection.close()
        return ({name: (row["quantity"], row["revision"]) for name, row in seen["resources"].items()},
                seen["effects"], seen["receipts"])

    def sql(self, statement, parameters=()):
        """Direct SQL behind the protocol's back: test set-up only."""
        connection = sqlite3.connect(self.db, isolation_level=None)
        try:
            return connection.execute(statement, parameters).fetchall()
        finally:
            connection.close()


# === 第七篇: the article's sections, in order ===

class PlanShapeAndDigest(Case):
    """第七篇 §1–§2: a plan is src, dst, amount, expected; malformed input raises and stores nothing; the digest."""

    def test_malformed_plans_raise_before_any_transaction_and_store_nothing(self):
        missing = plan()
        del missing["expected"]
        long_name, long_op = "x" * (pre.MAX_NAME_LENGTH + 1), "x" * (pre.MAX_OP_LENGTH + 1)
        cases = [(ValueError, "op", missing), (ValueError, "op", dict(plan(), note="x")), (ValueError, "op", {}),
                 (TypeError, "op", [("src", "A")]), (ValueError, "op", plan(src="A", dst="A")),
                 (ValueError, "op", plan(src="")), (ValueError, "op", plan(src=long_name)),
                 (ValueError, "op", plan(src="\ud800")), (TypeError, "op", plan(src=1)),
                 (TypeError, "op", plan(amount=True)), (TypeError, "op", plan(a=True)), (TypeError, "op", plan(b=False)),
                 (TypeError, "op", plan(amount=3.0)), (ValueError, "op", plan(amount=0)),
                 (ValueError, "op", plan(amount=-3)), (ValueError, "op", plan(amount=pre.MAX_AMOUNT + 1)),
                 (ValueError, "op", plan(a=0)), (ValueError, "op", plan(b=-1)),
                 (ValueError, "op", plan(a=pre.MAX_INT64 + 1)),
                 (TypeError, "op", dict(plan(), expected=[["A", 1], ["B", 1]])),
                 (TypeError, b"op", plan()), (TypeError, 7, plan()), (ValueError, "", plan()),
                 (ValueError, long_op, plan())]
        cases += [(ValueError, "op", dict(plan(), expected=expected))
                  for expected in ({"A": 1}, {"A": 1, "C": 1}, {"A": 1, "B": 1, "C": 1}, {})]
        for error, op, command in cases:
            with self.subTest(op=op, command=command), self.assertRaises(error):
                self.x(op, command)

    def test_a_lone_surrogate_in_any_text_is_refused_before_the_transaction_begins(self):
        statements = []
        self.c.set_trace_callback(statements.append)
        for call in (lambda: self.x("job-\ud800"), lambda: self.change("op-\ud800", "A", 1),
                     lambda: self.change("op-1", "A\ud800", 1), lambda: self.x("job-1", plan(dst="B\ud800"))):
            with self.subTest(call=call), self.assertRaises(ValueError):
                call()
        self.c.set_trace_callback(None)
        self.assertEqual(statements, [])  # not even BEGIN IMMEDIATE
        with self.assertRaises(ValueError):
            pre.init(os.path.join(self.dir, "s.db"), {"A\ud800": 1})
        self.assertFalse(os.path.exists(os.path.join(self.dir, "s.db")))
        self.assertFalse(self.c.in_transaction)
        self.assertEqual(self.figures(), START)

    def test_values_exactly_at_the_stated_bounds_are_accepted(self):
        name = "N" * pre.MAX_NAME_LENGTH
        self.assertEqual(self.x("x" * pre.MAX_OP_LENGTH, plan(amount=pre.MAX_AMOUNT)),
                         {"status": "insufficient", "available": 10})
        self.assertEqual(self.x("op-2", plan(dst=name)), {"status": "missing_resource", "missing": [name]})
        self.assertEqual(self.x("op-3", plan(a=pre.MAX_INT64)), {"status": "stale", "observed": {"A": 1, "B": 1}})

    def test_the_stored_digest_is_sha256_of_sorted_key_compact_utf8_json(self):
        commands = [plan(), plan(b=2), plan(src="é\"\\\n", dst="\u2028 Z", a=pre.MAX_INT64, amount=7),
                    plan(src="中文", dst="ascii")]
        for number, command in enumerate(commands):
            with self.subTest(command=command):
                self.x(f"op-{number}", command)
                self.assertEqual(pre._dumps(command), json.dumps(command, sort_keys=True, separators=(",", ":"),
                                                                 ensure_ascii=False))
                self.assertEqual(self.c.execute("SELECT digest FROM receipt WHERE op = ?", (f"op-{number}",))
                                 .fetchone()[0], digest_of(command))
        self.assertNotEqual(digest_of(plan()), digest_of(plan(b=2)))


class ReceiptBeforeState(Case):
    """第七篇 §2 去重入口里，先查历史，再问现在: the receipt first (replayed / conflict), then the present."""

    def test_the_articles_query_runs_unchanged_on_a_database_made_by_init(self):
        path = os.path.join(self.dir, "fresh.db")
        pre.init(path, {"A": 10, "B": 0})
        c, op = self.open(path), "job-1"
        self.assertEqual(self.x(op, c=c), APPLIED)
        old = c.execute('SELECT digest,result FROM receipt WHERE op=?', (op,)).fetchone()
        self.assertEqual((old[0], json.loads(old[1])), (digest_of(plan()), APPLIED))
        self.assertEqual(pre.history(c, op, old[0]), {"status": "replayed", "result": APPLIED})
        self.assertEqual(pre.history(c, op, digest_of(plan(b=2))), {"status": "conflict"})
        self.assertIsNone(pre.history(c, "job-2", old[0]))

    def test_history_holds_the_articles_code_verbatim(self):
        indented = "\n".join("    " + line for line in ARTICLE_HISTORY.splitlines())
        self.assertIn(indented, inspect.getsource(pre.history))

    def test_a_lost_ack_retry_is_replayed_from_history_not_stale(self):
        first = self.x("job-1")  # this reply is "lost"
        self.change("other-1", "A", -1)
        self.change("other-2", "B", 5)
        self.assertEqual(self.x("job-1", c=self.open()), {"status": "replayed", "result": first})
        self.assertEqual(first, APPLIED)  # history, not the present (A = 6, B = 8 now)
        self.assertEqual(self.figures(), ({"A": (6, 3), "B": (8, 3)}, 1, 3))

    def test_another_command_under_the_same_op_is_conflict_and_not_stored(self):
        self.x("job-1")
        for command in (plan(a=2, b=2), plan(amount=2), plan(src="B", dst="A")):
            with self.subTest(command=command):
                self.assertEqual(self.x("job-1", command), {"status": "conflict"})
        self.assertEqual(self.figures(), AFTER_APPLIED)


class SameTransaction(Case):
    """第七篇 §3 检查通过后再放开锁: the check and the write in one BEGIN IMMEDIATE transaction."""

    def test_unsafe_check_then_act_builds_on_a_change_the_safe_entry_rejects_as_stale(self):
        outcomes = {}
        for name, args in (("unsafe", ("unsafe-check-then-act",)), ("safe", ("execute",))):
            db = self.make_db(name=name + ".db")
            extra = () if name == "unsafe" else ("--now", 0, "--wait")
            code, out, err = cli(*args, db, "job-1", json.dumps(plan()), *extra,
                                 between=lambda db=db: self.change("other-1", "B", 2, c=self.open(db)))
            self.assertEqual((code, err), (0, ""))
            outcomes[name] = (json.loads(out)["status"], self.figures(db))
        self.assertEqual(outcomes["unsafe"], ("applied", ({"A": (7, 2), "B": (5, 3)}, 1, 2)))  # A = 7, B = 5
        self.assertEqual(outcomes["safe"], ("stale", ({"A": (10, 1), "B": (2, 2)}, 0, 2)))  # A = 10, B = 2


    def test_the_command_line_refuses_a_repeated_key_and_anything_but_go_after_ready(self):
        # The last "src" would make this a valid plan; a repeated key is refused before it could.
        repeated = '{"src": "B", "src": "A", "dst": "B", "amount": 3, "expected": {"A": 1, "B": 1}}'
        code, out, err = cli("execute", self.db, "job-1", repeated, "--now", 0)
        self.assertEqual((code, out), (1, ""))
        self.assertIn("repeats a key", err)
        for answer in (b"NO\n", b""):  # another word, or the parent gone (end of file): never a go
            code, out, err = cli("execute", self.db, "job-1", json.dumps(plan()), "--now", 0, "--wait", stdin=answer)
            self.assertEqual((code, out), (1, "READY\n"))
            self.assertIn("expected GO", err)
        self.assertEqual(self.figures(), START)
        self.assertEqual(cli("init", os.path.join(self.dir, "twice.db"), "A=1", "A=2")[0], 2)  # one name twice
        self.assertFalse(os.path.exists(os.path.join(self.dir, "twice.db")))

    def test_the_check_and_the_write_run_under_one_write_lock(self):
        other = self.open()
        other.execute("PRAGMA busy_timeout = 0")
        statements, locked = [], []

        def trace(statement):
            statements.append(" ".join(statement.split()[:2]).upper())
            if statement.startswith("SELECT name, quantity, revision"):  # the check
                try:
                    other.execute("BEGIN IMMEDIATE")
                    other.execute("ROLLBACK")
                except sqlite3.OperationalError as error:
                    locked.append(str(error))

        self.c.set_trace_callback(trace)
        try:
            self.assertEqual(self.x("job-1"), APPLIED)
        finally:
            self.c.set_trace_callback(None)
        self.assertEqual(locked, ["database is locked"])  # another writer is shut out while the check runs
        self.assertEqual((statements[0], statements[-1]), ("BEGIN IMMEDIATE", "COMMIT"))
        self.assertEqual([s for s in statements if s.startswith(("BEGIN", "COMMIT", "UPDATE", "INSERT"))],
                         ["BEGIN IMMEDIATE", "UPDATE RESOURCES", "UPDATE RESOURCES", "INSERT INTO", "INSERT INTO",
                          "COMMIT"])  # both rows, the effect and the receipt: one transaction

    def test_a_writer_holding_the_lock_past_busy_timeout_gives_database_is_locked_and_nothing_stored(self):
        holder = self.open()
        self.c.execute("PRAGMA busy_timeout = 1")  # shorter than BUSY_TIMEOUT, so the test does not wait 10 s
        with pre.transaction(holder):
            with self.assertRaisesRegex(sqlite3.OperationalError, "database is locked"):
                self.x("job-1")
            with self.assertRaisesRegex(sqlite3.OperationalError, "database is locked"):
                self.change("other-1", "B", 2)
        self.assertFalse(self.c.in_transaction)
        self.assertEqual(self.figures(), START)
        self.assertEqual(self.x("job-1"), APPLIED)


class RevisionsNotValues(Case):
    """第七篇 §4 版本不能只是当前值换了个名字: ABA, every write bumps the revision, 64-bit bounds."""

    def test_aba_same_quantity_new_revision_makes_the_old_plan_stale(self):
        self.change("take", "A", -1)
        self.change("give-back", "A", 1)
        self.assertEqual(self.x("job-1"), {"status": "stale", "observed": {"A": 3, "B": 1}})
        self.assertEqual(self.figures(), ({"A": (10, 3), "B": (0, 1)}, 0, 3))  # A = 10 at revision 3


    def test_a_plan_both_stale_and_too_large_is_stale_first_in_the_articles_order(self):
        self.change("other-1", "B", 2)
        self.assertEqual(self.x("job-1", plan(amount=11)), {"status": "stale", "observed": {"A": 1, "B": 2}})

    def test_change_always_bumps_the_revision_and_records_one_row(self):
        self.assertEqual(self.change("c-1", "A", -1), {"status": "changed", "name": "A", "quantity": 9, "revision": 2})
        self.assertEqual(self.change("c-2", "A", 0), {"status": "changed", "name": "A", "quantity": 9, "revision": 3})
        self.assertEqual(self.change("c-3", "A", 1), {"status": "changed", "name": "A", "quantity": 10, "revision": 4})
        self.assertEqual(self.sql("SELECT op, name, delta, revision FROM changes ORDER BY op"),
                         [("c-1", "A", -1, 2), ("c-2", "A", 0, 3), ("c-3", "A", 1, 4)])

    def test_revisions_at_int64_max_are_refused_as_overflow_and_stored(self):
        for full in ("A", "B"):
            with self.subTest(full=full):
                self.sql("UPDATE resources SET revision = 1")
                self.sql("UPDATE resources SET revision = ? WHERE name = ?", (pre.MAX_INT64, full))
                command = plan(**{full.lower(): pre.MAX_INT64})
                self.assertEqual(self.x("job-" + full, command),
                                 {"status": "overflow", "resource": full, "column": "revision"})
                self.assertEqual(self.figures()[1], 0)

    def test_destination_quantity_overflow_is_refused_and_the_exact_maximum_fits(self):
        self.sql("UPDATE resources SET quantity = ? WHERE name = 'B'", (pre.MAX_INT64 - 2,))
        self.assertEqual(self.x("job-1", plan(amount=3)), {"status": "overflow", "resource": "B", "column": "quantity"})
        self.assertEqual(self.figures(), ({"A": (10, 1), "B": (pre.MAX_INT64 - 2, 1)}, 0, 1))
        self.assertEqual(self.x("job-2", plan(amount=2))["status"], "applied")
        self.assertEqual(self.sql("SELECT quantity, typeof(quantity) FROM resources WHERE name = 'B'"),
                         [(pre.MAX_INT64, "integer")])


    def test_a_plan_may_move_the_whole_quantity_and_a_change_may_reach_exactly_0_or_the_maximum(self):
        self.assertEqual(self.x("job-1", plan(amount=10)),
                         {"status": "applied", "revisions": {"A": 2, "B": 2}, "quantities": {"A": 0, "B": 10}})
        self.assertEqual(self.change("c-1", "B", -10)["quantity"], 0)
        self.assertEqual(self.change("c-2", "B", pre.MAX_INT64)["quantity"], pre.MAX_INT64)
        self.assertEqual(self.figures(), ({"A": (0, 2), "B": (pre.MAX_INT64, 4)}, 1, 3))

    def test_change_refusals_are_stored_receipts_and_change_nothing(self):
        self.sql("UPDATE resources SET quantity = ? WHERE name = 'B'", (pre.MAX_INT64,))
        refusals = {("c-1", "Z", 1): {"status": "missing_resource", "missing": ["Z"]},
                    ("c-2", "A", -11): {"status": "insufficient", "available": 10},
                    ("c-3", "B", 1): {"status": "overflow", "resource": "B", "column": "quantity"}}
        for (op, name, delta), refusal in refusals.items():
            self.assertEqual(self.change(op, name, delta), refusal)
        self.sql("UPDATE resources SET revision = ? WHERE name = 'A'", (pre.MAX_INT64,))
        self.assertEqual(self.change("c-4", "A", -1), {"status": "overflow", "resource": "A", "column": "revision"})
        self.assertEqual(self.figures(), ({"A": (10, pre.MAX_INT64), "B": (pre.MAX_INT64, 1)}, 0, 4))
        self.assertEqual(self.sql("SELECT count(*) FROM changes"), [(0,)])

    def test_malformed_change_arguments_raise_and_store_nothing(self):
        for op, name, delta, error in (("c", "A", True, TypeError), ("c", "A", 1.0, TypeError),
                                       ("c", "A", pre.MAX_INT64 + 1, ValueError), ("c", "", 1, ValueError),
                                       ("c", 1, 1, TypeError), (1, "A", 1, TypeError), ("", "A", 1, ValueError)):
            with self.subTest(op=op, name=name, delta=delta), self.assertRaises(error):
                self.change(op, name, delta)
        self.assertEqual(self.figures(), START)


class RejectionsRemembered(Case):
    """第七篇 §5 拒绝也要有记忆，重规划不能伪装成重试: stored rejections replay; a replan needs a new id."""

    def test_stale_insufficient_and_missing_rejections_replay_after_the_state_would_allow_them(self):
        self.change("other-1", "B", 2)
        cases = [("stale", plan(), {"status": "stale", "observed": {"A": 1, "B": 2}},
                  "UPDATE resources SET revision = 1 WHERE name = 'B'"),  # a restored backup
                 ("insufficient", plan(amount=11), {"status": "insufficient", "available": 10},
                  "UPDATE resources SET quantity = 20 WHERE name = 'A'"),
                 ("missing", plan(dst="Z"), {"status": "missing_resource", "missing": ["Z"]},
                  "INSERT INTO resources VALUES ('Z', 0, 1)")]
        for op, command, rejection, fix in cases:
            with self.subTest(op):
                self.assertEqual(self.x(op, command), rejection)
                self.sql(fix)
                self.assertEqual(self.x(op, command), {"status": "replayed", "result": rejection})
        self.assertEqual(self.figures()[1], 0)
        self.assertEqual(self.x("missing-new-id", plan(dst="Z"))["status"], "applied")

    def test_a_replan_under_the_old_id_is_conflict_and_under_a_new_id_applies(self):
        self.change("other-1", "B", 2)
        stale = self.x("job-1")
        self.assertEqual(stale, {"status": "stale", "observed": {"A": 1, "B": 2}})
        replanned = dict(plan(), expected=stale["observed"])
        self.assertEqual(self.x("job-1", replanned), {"status": "conflict"})
        self.assertEqual(self.figures(), ({"A": (10, 1), "B": (2, 2)}, 0, 2))  # conflict is not stored
        self.assertEqual(self.x("job-2", replanned)["status"], "applied")
        self.assertEqual(self.figures(), ({"A": (7, 2), "B": (5, 3)}, 1, 3))


class CrashesAndRaces(Case):
    """第七篇 §6 扣完 A 就崩溃: real exits at 71/72/73, triggers abort mid-transaction, 16 racers."""

    def test_the_exit_codes_are_the_articles(self):
        self.assertEqual(pre.EXIT_CODES, {"after_source_update": 71, "before_commit": 72, "after_commit": 73})

    def test_a_crash_at_each_boundary_is_all_or_nothing_and_a_new_process_retry_answers_right(self):
        command = json.dumps(plan())
        for boundary, code in pre.EXIT_CODES.items():
            with self.subTest(boundary):
                db = self.make_db(name=boundary + ".db")
                self.assertEqual(cli("execute", db, "job-1", command, "--now", 0, "--crash", boundary),
                                 (code, "", f"preconditions.py: died at {boundary} (exit {code})\n"))  # said so, no more
                committed = boundary == "after_commit"
                self.assertEqual(self.figures(db), AFTER_APPLIED if committed else START)
                retry_code, out, _ = cli("execute", db, "job-1", command, "--now", 0)
                expected = {"status": "replayed", "result": APPLIED} if committed else APPLIED
                self.assertEqual((retry_code, json.loads(out)), (0, expected))
                self.assertEqual(self.figures(db), AFTER_APPLIED)

    def test_a_stale_rejection_committed_before_the_exit_is_replayed(self):
        self.change("other-1", "B", 2)
        self.release()  # the child opens the file
        command = json.dumps(plan())
        self.assertEqual(cli("execute", self.db, "job-1", command, "--now", 0, "--crash", "after_commit")[0],
                         73)
        code, out, _ = cli("execute", self.db, "job-1", command, "--now", 0)
        self.assertEqual((code, json.loads(out)),
                         (0, {"status": "replayed", "result": {"status": "stale", "observed": {"A": 1, "B": 2}}}))
        self.assertEqual(self.figures(), ({"A": (10, 1), "B": (2, 2)}, 0, 2))

    def test_every_crash_point_is_an_exit_code_key_once_and_there_are_no_fault_parameters(self):
        with open(MODULE, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        points = collections.Counter(
            node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "crash_point"
            and node.args and isinstance(node.args[0], ast.Constant))
        self.assertEqual(points, collections.Counter(list(pre.EXIT_CODES)))
        for name in pre.__all__:
            function = getattr(pre, name)
            with self.subTest(name):
                self.assertFalse({"fault", "crash"} & set(inspect.signature(function).parameters))
        self.assertEqual(cli("execute", self.db, "job-1", json.dumps(plan()), "--now", 0, "--crash",
                             "after_everything")[0], 2)
        self.assertEqual(self.figures(), START)

    def test_a_trigger_aborting_the_destination_update_or_the_receipt_leaves_nothing_half_applied(self):
        for table, event in (("resources", "UPDATE ON resources WHEN NEW.name = 'B'"), ("receipt", "INSERT ON receipt")):
            with self.subTest(table):
                self.sql(f"CREATE TRIGGER fault BEFORE {event} BEGIN SELECT RAISE(ABORT, 'injected fault'); END")
                with self.assertRaisesRegex(sqlite3.IntegrityError, "injected fault"):
                    self.x("job-1")
                self.assertFalse(self.c.in_transaction)
                self.assertEqual(self.figures(), START)
                self.sql("DROP TRIGGER fault")
        self.assertEqual(self.x("job-1"), APPLIED)

    def race(self, entry, ops, path=None, threads=8):
        """``threads`` threads (the article's 8), each with its own connection, released together by
        a barrier, submit ``ops`` between them; the outcomes, counted.  They run in a forked process,
        as the driver's race does: a process that has had threads forks no more children."""
        def run():
            barrier = threading.Barrier(threads)
            outcomes, lock = [], threading.Lock()

            def racer(share):
                try:
                    connection = pre.connect(path or self.db)
                    try:
                        barrier.wait(timeout=WATCHDOG)
                        found = [entry(connection, op)["status"] for op in share]
                    finally:
                        connection.close()
                except BaseException as error:  # reported below, not lost in the thread
                    barrier.abort()
                    found = [f"{type(error).__name__}: {error}"]
                with lock:
                    outcomes.extend(found)

            started = [threading.Thread(target=racer, args=(ops[k::threads],)) for k in range(threads)]
            for thread in started:
                thread.start()
            for thread in started:
                thread.join()
            return collections.Counter(outcomes)
        return collections.Counter(run_experiment.run_forked(run))

    def safe(self, connection, op):
        return pre.execute(connection, op, plan(), issued_at=0, now=0)

    def test_16_distinct_ops_on_one_snapshot_give_1_applied_and_15_stale(self):
        self.assertEqual(self.race(self.safe, [f"job-{k}" for k in range(16)]), {"applied": 1, "stale": 15})
        self.assertEqual(self.figures(), ({"A": (7, 2), "B": (3, 2)}, 1, 16))

    def test_16_copies_of_one_op_give_1_applied_and_15_replayed(self):
        self.assertEqual(self.race(self.safe, ["job-1"] * 16), {"applied": 1, "replayed": 15})
        self.assertEqual(self.figures(), AFTER_APPLIED)

    def test_the_barrier_catches_a_non_atomic_check_then_write_every_time(self):
        db = self.make_db({"A": 100, "B": 0}, "unsafe.db")  # room for every transfer: only the race decides
        in_between = threading.Barrier(4)  # all four have checked before any of them writes

        def unsafe(connection, op):
            return pre.unsafe_check_then_act(connection, op, plan(), pause=lambda: in_between.wait(timeout=WATCHDOG))

        outcomes = self.race(unsafe, [f"job-{k}" for k in range(4)], db, threads=4)
        self.assertEqual(outcomes, {"applied": 4})  # four transfers built on one snapshot's revisions
        self.assertEqual(self.figures(db)[1], 4)


class ManyAgents(Case):
    """§6, with many agents on one machine: processes open, transfer, change, replay, close and
    checkpoint one file at once while some are SIGKILLed; every open succeeds, nothing is lost."""

    def test_agents_opening_writing_closing_and_killed_at_once_lose_nothing_and_all_connect(self):
        db = self.make_db(MANY_RESOURCES, "many.db")
        results = crowd(functools.partial(_many_agents, db, self.dir), MANY_AGENTS)
        self.assertEqual([r for r in results if r not in ("done", None)], [])
        self.assertIn(None, results)  # the seed kills some agents, and each kill is a SIGKILL
        connection = self.open(db)
        stored = {op: json.loads(result) for op, result in connection.execute("SELECT op, result FROM receipt")}
        effects = connection.execute("SELECT op, src, dst, amount FROM effects").fetchall()
        changes = connection.execute("SELECT op, name, delta FROM changes").fetchall()
        for index in range(MANY_AGENTS):
            with open(os.path.join(self.dir, f"agent-{index}"), "rb") as journal:
                for line in journal.read().splitlines():
                    op, answer = json.loads(line)
                    with self.subTest(op=op):  # every answer given is the decision committed
                        self.assertEqual(answer.get("result", answer), stored[op])
        self.assertEqual(sorted(op for op, *_ in effects),
                         sorted(op for op, result in stored.items() if result["status"] == "applied"))
        self.assertEqual(sorted(op for op, *_ in changes),
                         sorted(op for op, result in stored.items() if result["status"] == "changed"))
        for name, (quantity, revision) in self.figures(db)[0].items():
            with self.subTest(name=name):  # each write moved a revision once, and no unit is lost
                flows = [amount * ((dst == name) - (src == name)) for _, src, dst, amount in effects
                         if name in (src, dst)] + [delta for _, n, delta in changes if n == name]
                self.assertEqual((quantity, revision), (MANY_RESOURCES[name] + sum(flows), 1 + len(flows)))
        self.assertEqual(connection.execute("PRAGMA integrity_check").fetchall(), [("ok",)])


class UndeclaredDependency(Case):
    """第七篇 §7 依赖没写进契约: C changes, the plan declared only A and B, so it applies."""

    def test_a_change_to_c_does_not_block_a_plan_that_declared_only_a_and_b(self):
        db = self.make_db({"A": 10, "B": 0, "C": 5}, "abc.db")
        c = self.open(db)
        self.change("other-1", "C", -1, c=c)
        self.assertEqual(self.x("job-1", c=c), APPLIED)
        self.assertEqual(self.figures(db), ({"A": (7, 2), "B": (3, 2), "C": (4, 2)}, 1, 2))  # C = 4


# === beyond article 7 ===

class ChangeExactlyOnce(Case):
    """Beyond 第七篇: change() has an op id and a receipt in the same transaction, like execute()."""

    def test_a_change_is_replayed_under_its_op_and_another_delta_is_conflict(self):
        first = self.change("op-1", "A", 5)
        self.assertEqual(first, {"status": "changed", "name": "A", "quantity": 15, "revision": 2})
        self.assertEqual(self.change("op-1", "A", 5), {"status": "replayed", "result": first})
        self.assertEqual(self.change("op-1", "A", 6), {"status": "conflict"})
        self.assertEqual(self.change("op-1", "B", 5), {"status": "conflict"})
        self.assertEqual(self.x("op-1"), {"status": "conflict"})  # one op namespace for both writes
        self.assertEqual(self.figures(), ({"A": (15, 2), "B": (0, 1)}, 0, 1))

    def test_a_change_redone_by_a_new_process_after_the_first_ended_changes_a_once(self):
        outputs = [cli("change", self.db, "op-1", "A", 5, "--now", 0) for _ in range(2)]
        changed = {"status": "changed", "name": "A", "quantity": 15, "revision": 2}
        self.assertEqual([(code, json.loads(out), err) for code, out, err in outputs],
                         [(0, changed, ""), (0, {"status": "replayed", "result": changed}, "")])
        self.assertEqual(self.figures()[0]["A"], (15, 2))  # A = 15 from 10
        self.assertEqual(self.sql("SELECT op, name, delta FROM changes"), [("op-1", "A", 5)])

    def test_a_change_whose_receipt_was_purged_is_expired_like_a_transfer(self):
        # An execute() retried after its receipt was purged answers "expired" (its effect row
        # remembers it); a change() must too, not raise IntegrityError from changes.op.
        self.change("op-1", "A", 5, issued_at=0, now=0)
        pre.purge(self.c, 100, 50)
        self.assertEqual(self.change("op-1", "A", 5, issued_at=60, now=100), {"status": "expired", "low_water": 50})
        self.assertEqual(self.figures()[0]["A"], (15, 2))


class RequiredTicks(Case):
    """Beyond 第七篇: logical ticks are required keyword ints; nothing is acted on before it was issued."""

    def test_missing_ticks_are_a_type_error(self):
        for call in (lambda: pre.execute(self.c, "job-1", plan()), lambda: pre.execute(self.c, "job-1", plan(), now=0),
                     lambda: pre.change(self.c, "op-1", "A", 1), lambda: pre.purge(self.c)):
            with self.assertRaises(TypeError):
                call()
        self.assertEqual(self.figures(), START)

    def test_ticks_that_go_backwards_or_are_not_bounded_ints_raise_and_store_nothing(self):
        for write in (self.x, lambda op, **ticks: self.change(op, "A", 1, **ticks)):
            with self.assertRaisesRegex(ValueError, "backwards"):
                write("job-1", issued_at=5, now=4)
            for issued_at, now in ((-1, 0), (0, -1), (True, 3), (1, 2.0), (None, 0), (0, pre.MAX_TICK + 1)):
                with self.subTest(issued_at=issued_at, now=now), self.assertRaises(ValueError):
                    write("job-1", issued_at=issued_at, now=now)
        self.assertEqual(self.figures(), START)
        self.assertEqual(self.x("job-1", issued_at=pre.MAX_TICK, now=pre.MAX_TICK), APPLIED)


class Retention(Case):
    """Beyond 第七篇 (§5: "本例没有实现回执清理"): purge() with a low-water mark; late retries are "expired"."""

    def receipts(self):
        return self.sql("SELECT op, tick FROM receipt ORDER BY op"), self.sql("SELECT low_water FROM retention")[0][0]

    def test_receipts_record_their_tick_and_purge_deletes_those_before_now_minus_window(self):
        self.x("job-1", issued_at=3, now=10)
        self.x("job-2", now=60)  # stale, stored at tick 60
        self.assertEqual(pre.purge(self.c, 100, 50), {"deleted": 1, "low_water": 50})
        self.assertEqual(self.receipts(), ([("job-2", 60)], 50))


    def test_purge_keeps_a_receipt_written_exactly_at_the_mark(self):
        self.x("job-1", now=49)
        self.x("job-2", now=50)
        self.assertEqual(pre.purge(self.c, 100, 50), {"deleted": 1, "low_water": 50})
        self.assertEqual(self.receipts(), ([("job-2", 50)], 50))

    def test_a_cli_retry_with_the_ops_original_issue_tick_after_purge_is_expired_not_decided_again(self):
        stale = json.dumps(plan(a=2))
        self.assertEqual(json.loads(cli("execute", self.db, "job-1", stale, "--now", 1)[1])["status"],
                         "stale")
        pre.purge(self.c, 50, 10)
        self.release()  # the child opens the file
        code, out, _ = cli("execute", self.db, "job-1", stale, "--now", 50, "--issued-at", 1)
        self.assertEqual((code, json.loads(out)), (0, {"status": "expired", "low_water": 40}))
        self.assertEqual(self.figures(), ({"A": (10, 1), "B": (0, 1)}, 0, 0))  # decided once, never again

    def test_purge_refuses_a_bad_window_or_a_mark_moving_backwards_and_changes_nothing(self):
        pre.purge(self.c, 100, 50)
        self.x("job-1", issued_at=60, now=60)
        for now, window, error in ((100, 0, ValueError), (100, -5, ValueError), (100, True, ValueError),
                                   (100, 2.0, ValueError), (80, 50, ValueError), (-1, 5, ValueError)):
            with self.subTest(now=now, window=window), self.assertRaises(error):
                pre.purge(self.c, now, window)
        self.assertEqual(self.receipts(), ([("job-1", 60)], 50))

    def test_an_op_issued_before_the_mark_or_whose_effect_outlived_its_receipt_is_expired_and_not_stored(self):
        self.x("job-1", issued_at=0, now=0)
        pre.purge(self.c, 100, 50)
        for op, issued_at in (("job-2", 0), ("job-2", 49), ("job-1", 60)):
            with self.subTest(op=op, issued_at=issued_at):
                self.assertEqual(self.x(op, plan(a=2, b=2), issued_at=issued_at, now=100),
                                 {"status": "expired", "low_water": 50})
        self.assertEqual(self.figures(), ({"A": (7, 2), "B": (3, 2)}, 1, 0))

    def test_an_op_issued_at_the_mark_is_decided_and_a_surviving_receipt_still_replays(self):
        first = self.x("job-1", now=80)
        pre.purge(self.c, 100, 50)
        self.assertEqual(self.x("job-1", now=100), {"status": "replayed", "result": first})
        self.assertEqual(self.x("job-2", plan(a=2, b=2), issued_at=50, now=100)["status"], "applied")


class FilesAndSchema(Case):
    """Beyond 第七篇: connect() opens only an existing database of ours and names the path in every refusal."""

    def assert_refused(self, path, error, *fragments):
        before = {name: os.path.getsize(os.path.join(self.dir, name)) for name in os.listdir(self.dir)}
        with self.assertRaises(error) as caught:
            pre.connect(path)
        for fragment in (path,) + fragments:
            self.assertIn(fragment, str(caught.exception))
        self.assertEqual({name: os.path.getsize(os.path.join(self.dir, name)) for name in os.listdir(self.dir)},
                         before)

    def test_missing_directory_garbage_empty_and_foreign_files_are_refused_naming_the_path(self):
        self.assert_refused(os.path.join(self.dir, "missing.db"), FileNotFoundError)
        self.assert_refused(self.dir, IsADirectoryError)
        for name, content in (("garbage.db", b"not a database, just bytes\n" * 200), ("empty.db", b"")):
            with open(os.path.join(self.dir, name), "wb") as handle:
                handle.write(content)
        foreign = os.path.join(self.dir, "foreign.db")
        connection = sqlite3.connect(foreign)
        connection.execute("CREATE TABLE resources (name TEXT)")
        connection.close()
        for name in ("garbage.db", "empty.db", "foreign.db"):
            with self.subTest(name):
                self.assert_refused(os.path.join(self.dir, name), sqlite3.DatabaseError)

    def test_an_old_schema_file_is_refused_naming_both_versions_and_left_byte_for_byte(self):
        old = os.path.join(self.dir, "old.db")
        connection = sqlite3.connect(old)
        connection.execute("CREATE TABLE receipts (op TEXT PRIMARY KEY, digest TEXT, result TEXT)")
        connection.execute(f"PRAGMA application_id = {0x50524543}")
        connection.execute("PRAGMA user_version = 1")
        connection.close()
        with open(old, "rb") as handle:
            before = handle.read()
        self.assertEqual(pre.SCHEMA_VERSION, 2)
        self.assert_refused(old, sqlite3.DatabaseError, "schema version 1")
        with self.assertRaisesRegex(sqlite3.DatabaseError, r"schema version 1\b.*\b2\b"):
            pre.connect(old)
        with open(old, "rb") as handle:
            self.assertEqual(handle.read(), before)

    def test_a_refused_open_leaves_the_database_and_a_foreign_wal_byte_for_byte(self):
        self.x("job-1")
        self.release()
        foreign = os.path.join(self.dir, "notes.db")
        notes = sqlite3.connect(foreign, isolation_level=None)
        try:
            notes.execute("PRAGMA journal_mode=WAL")
            notes.execute("PRAGMA wal_autocheckpoint=0")
            notes.execute("PRAGMA application_id = 4242")
            notes.execute("CREATE TABLE notes (text TEXT)")
            shutil.copyfile(foreign + "-wal", self.db + "-wal")  # its frames, unapplied, beside our file
        finally:
            notes.close()
        before = [file_bytes(name) for name in (self.db, self.db + "-wal")]
        with self.assertRaisesRegex(sqlite3.DatabaseError, "not a database of this module"):
            pre.connect(self.db)
        self.assertEqual([file_bytes(name) for name in (self.db, self.db + "-wal")], before)
        os.remove(self.db + "-wal")
        self.assertEqual(self.figures(), AFTER_APPLIED)  # still itself

    def test_a_database_with_a_second_name_is_refused_naming_the_path(self):
        alias = os.path.join(self.dir, "alias.db")
        os.link(self.db, alias)  # each name would keep its own -wal
        for path in (self.db, alias):
            with self.subTest(path=path):
                self.assert_refused(path, OSError, "more than one name")
        os.remove(alias)
        self.assertEqual(self.figures(), START)

    def test_a_path_starting_with_two_slashes_is_a_path_and_init_leaves_nothing_half_made(self):
        path = "/" + os.path.join(self.dir, "p.db")  # //tmp/...: the same file to POSIX
        self.assertEqual(pre.init(path, {"A": 10, "B": 0})["resources"]["A"], {"quantity": 10, "revision": 1})
        self.assertEqual(self.figures(path), START)
        self.assertEqual(cli("purge", path, "--now", 100, "--window", 50)[0], 0)

    def test_the_kind_and_schema_version_commit_in_the_schemas_own_transaction(self):
        statements, connect = [], sqlite3.connect

        def traced(*args, **kwargs):  # every connection init opens, its statements recorded
            connection = connect(*args, **kwargs)
            connection.set_trace_callback(statements.append)
            return connection
        with mock.patch("sqlite3.connect", traced):
            pre.init(os.path.join(self.dir, "traced.db"), {"A": 1})
        marker = statements.index(f"PRAGMA application_id = {pre.APPLICATION_ID}")
        self.assertEqual(statements[marker + 1], f"PRAGMA user_version = {pre.SCHEMA_VERSION}")
        self.assertEqual(statements[marker + 2], "COMMIT")
        self.assertEqual(statements[:3], ["PRAGMA journal_mode=WAL", "BEGIN IMMEDIATE", pre.SCHEMA[0]])

    def connect_as_nobody(self, path):
        """pre.connect(path) in a forked child, as nobody (uid/gid 65534) if we are root: 'ok' or 'Type: message'."""
        return run_experiment.run_forked(_connect_as_nobody, path)

    def test_unreadable_read_only_file_or_read_only_directory_is_a_permission_error_naming_it(self):
        folder = os.path.join(self.dir, "shared")
        os.mkdir(folder)
        os.chmod(self.dir, 0o755)  # nobody may look inside
        self.addCleanup(os.chmod, folder, 0o755)  # so that the temporary directory can go
        for name, file_mode, folder_mode, named in (("unreadable.db", 0o000, 0o755, ""),
                                                    ("read-only.db", 0o444, 0o755, ""),
                                                    ("read-only-wal.db", 0o666, 0o755, "-wal"),
                                                    ("read-only-shm.db", 0o666, 0o755, "-shm"),
                                                    ("in-read-only-dir.db", 0o666, 0o555, None)):
            with self.subTest(name):
                path = os.path.join(folder, name)
                os.chmod(folder, 0o755)
                pre.init(path, {"A": 1})
                os.chmod(path, file_mode)
                if named:  # an empty -wal or -shm, as SQLite leaves them, that nobody may read but not write
                    with open(path + named, "wb"):
                        pass
                    os.chmod(path + named, 0o444)
                os.chmod(folder, folder_mode)
                text = self.connect_as_nobody(path)
                self.assertTrue(text.startswith("PermissionError: "), text)
                self.assertIn(path + named + "'" if named is not None else folder, text)
                if named:
                    os.remove(path + named)
                self.assertEqual([n for n in os.listdir(folder) if n.endswith(("-wal", "-shm"))], [])  # nothing made
        os.chmod(folder, 0o777)  # the control: the same user opens a file it may read and write
        os.chmod(path, 0o666)
        self.assertEqual(self.connect_as_nobody(path), "ok")

    def test_init_refuses_to_overwrite_a_file_or_a_leftover_journal_and_validates_resources(self):
        notes = os.path.join(self.dir, "notes.txt")
        with open(notes, "w", encoding="utf-8") as handle:
            handle.write("keep me")
        reused = os.path.join(self.dir, "reused.db")
        with open(reused + "-wal", "wb") as handle:
            handle.write(b"frames of some other database")
        for path in (self.db, notes, reused):
            with self.subTest(path), self.assertRaises(FileExistsError):
                pre.init(path, {"A": 1})
        self.assertEqual(self.figures(), START)
        with open(notes, encoding="utf-8") as handle:
            self.assertEqual(handle.read(), "keep me")
        self.assertFalse(os.path.exists(reused))
        path = os.path.join(self.dir, "new.db")
        for resources, error in (({"A": True}, TypeError), ({"A": -1}, ValueError), ({"A": pre.MAX_INT64 + 1},
                                 ValueError), ({}, ValueError), ({"": 1}, ValueError), ([("A", 1)], TypeError)):
            with self.subTest(resources=resources), self.assertRaises(error):
                pre.init(path, resources)
            self.assertFalse(os.path.exists(path))

    def test_paths_with_uri_special_characters_open_exactly_the_file_named(self):
        folder = os.path.join(self.dir, "odd %41 #dir?")
        os.mkdir(folder)
        path = os.path.join(folder, "odd ?name#%41.db")
        pre.init(path, {"A": 1, "B": 2})
        self.assertEqual(self.figures(path)[0], {"A": (1, 1), "B": (2, 1)})
        with self.assertRaises(FileNotFoundError):
            pre.connect(os.path.join(folder, "odd ?other.db"))
        self.assertEqual(sorted(os.listdir(folder)), ["odd ?name#%41.db"])

    def test_every_connection_reports_wal_synchronous_full_foreign_keys_and_the_busy_timeout(self):
        for connection in (self.c, self.open()):
            self.assertIsNone(connection.isolation_level)
            self.assertEqual([connection.execute(f"PRAGMA {name}").fetchone()[0] for name in
                              ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")],
                             ["wal", 2, 1, pre.BUSY_TIMEOUT * 1000])

    def test_wal_reset_bug_names_exactly_the_affected_sqlite_versions(self):
        affected = [(3, 7, 0), (3, 40, 1), (3, 44, 5), (3, 45, 0), (3, 50, 6), (3, 51, 0), (3, 51, 2)]
        fixed = [(3, 6, 23), (3, 44, 6), (3, 44, 9), (3, 50, 7), (3, 51, 3), (3, 52, 0)]
        self.assertEqual([version for version in affected + fixed if pre.wal_reset_bug(version)], affected)
        self.assertEqual(pre.wal_reset_bug(), pre.wal_reset_bug(sqlite3.sqlite_version_info))

    def test_snapshot_is_sorted_counts_effects_and_receipts_and_reads_inside_a_callers_transaction(self):
        c = self.open(self.make_db({"b": 1, "C": 2, "a": 3}, "many.db"))
        for op in ("job-1", "job-2"):
            self.x(op, plan(src="a", dst="b", amount=1), c=c)
        with pre.transaction(c):
            seen = pre.snapshot(c)
            self.assertTrue(c.in_transaction)
        self.assertEqual((list(seen["resources"]), seen["effects"], seen["receipts"]), (["C", "a", "b"], 1, 2))



    def test_snapshot_reads_resources_and_counts_in_one_read_transaction(self):
        # A writer commits between snapshot's first read and its counts: they must not mix two states.
        writer = self.open()

        class Between(sqlite3.Connection):
            def execute(self, sql, *args):
                if sql.startswith("SELECT count(*) FROM effects"):
                    pre.execute(writer, "job-1", plan(), issued_at=0, now=0)
                return super().execute(sql, *args)
        with contextlib.closing(sqlite3.connect(self.db, factory=Between, isolation_level=None)) as reader:
            seen = pre.snapshot(reader)
        self.assertEqual((seen["resources"]["A"]["quantity"], seen["effects"], seen["receipts"]), (10, 0, 0))
        self.assertEqual(self.figures(), AFTER_APPLIED)  # the write did land, after the snapshot's view

class CommandLine(Case):
    """Beyond 第七篇: the script as the experiment's children run it; one JSON line of UTF-8 bytes; exit 0/1/2/73."""

    def test_help_lists_every_command_and_execute_its_boundaries_with_their_exit_codes(self):
        code, out, _ = cli("--help")  # through sys.stdout: flushed before the exit
        self.assertEqual(code, 0)
        for command in ("init", "execute", "change", "purge", "snapshot", "unsafe-check-then-act"):
            self.assertIn(command, out)
        code, out, _ = cli("execute", "--help")
        self.assertEqual(code, 0)
        self.assertIn(", ".join(f"{b} {n}" for b, n in pre.EXIT_CODES.items()), " ".join(out.split()))
        self.assertEqual(sorted(pre.EXIT_CODES.values()), [71, 72, 73])

    def test_the_script_run_by_a_fresh_interpreter_exits_0_1_2_and_73(self):
        # The real entry point, `python3 -I -S preconditions.py ...` and its sys.exit(main()), once per
        # exit code, side by side; the other tests fork main(argv) as the driver does.
        crash = self.make_db(name="crash.db")  # its own file: the snapshot beside it must not race it
        commands = {0: ["snapshot", self.db], 1: ["snapshot", os.path.join(self.dir, "missing.db")], 2: ["bogus"],
                    73: ["execute", crash, "job-1", json.dumps(plan()), "--now", "0", "--crash", "after_commit"]}
        done = run_experiment.run_together([[sys.executable, "-I", "-S", MODULE, *argv] for argv in commands.values()])
        self.assertEqual([code for code, _, _ in done], list(commands))
        self.assertEqual(json.loads(done[0][1])["receipts"], 0)
        self.assertTrue(done[1][2].startswith(b"preconditions.py snapshot: "), done[1][2])
        self.assertIn(b"invalid choice", done[2][2])
        self.assertEqual(self.figures(crash), AFTER_APPLIED)  # the crash came after COMMIT

    def test_exit_codes_and_utf8_output_whatever_the_locale(self):
        # Text streams that are not UTF-8, as an 8-bit locale makes them: the C locale with UTF-8 mode
        # off and latin-1 streams (by default C means UTF-8; -I would ignore PYTHONIOENCODING).
        legacy = dict({key: value for key, value in os.environ.items() if not key.startswith("PYTHON")},
                      LC_ALL="C", LANG="C", PYTHONIOENCODING="latin-1")

        def in_legacy(*args):
            return [sys.executable, "-S", "-X", "utf8=0", *map(str, args)]
        db = os.path.join(self.dir, "cli.db")
        code, out, err = cli("init", db, "名额A=10", "B=0")
        self.assertEqual((code, err), (0, ""))
        state = {"resources": {"B": {"quantity": 0, "revision": 1}, "名额A": {"quantity": 10, "revision": 1}},
                 "effects": 0, "receipts": 0}
        self.assertEqual(json.loads(out), dict(state, status="initialised"))
        probe, snapshot = run_experiment.run_together(
            [in_legacy("-c", "import sys; print(sys.stdout.encoding)"), in_legacy(MODULE, "snapshot", db)], env=legacy)
        self.assertEqual(probe, (0, b"iso8859-1\n", b""))  # the child's text streams really are not UTF-8
        self.assertEqual(snapshot, (0, pre._dumps(state).encode("utf-8") + b"\n", b""))  # UTF-8 bytes all the same
        usage = [("execute", db), ("execute", db, "job-1", "{}"), ("init", db + "2", "A"), ("bogus",)]
        for argv in usage:
            with self.subTest(argv=argv):
                self.assertEqual(cli(*argv)[0], 2)
        refused = [("execute", db, "job-1", json.dumps(plan(src="名额A", amount=True)), "--now", 0),
                   ("execute", db, "job-1", '{"src": "A", "src": "B"}', "--now", 0),
                   ("execute", db, "job-1", json.dumps(plan()), "--now", -1),
                   ("snapshot", os.path.join(self.dir, "missing.db")), ("init", db, "A=1")]
        for argv in refused:
            with self.subTest(argv=argv):
                code, out, err = cli(*argv)
                self.assertEqual((code, out, len(err.splitlines())), (1, "", 1))
                self.assertTrue(err.startswith(f"preconditions.py {argv[0]}: "), err)
        # json.dumps escapes 名额A, so the argument is ASCII; the answer names it in UTF-8.
        [(code, out, _)] = run_experiment.run_together(
            [in_legacy(MODULE, "execute", db, "job-1", json.dumps(plan(src="名额A")), "--now", 0)], env=legacy)
        self.assertEqual((code, out.decode("utf-8")),
                         (0, '{"quantities":{"B":3,"名额A":7},"revisions":{"B":2,"名额A":2},"status":"applied"}\n'))
        self.assertEqual(json.loads(cli("snapshot", db)[1])["receipts"], 1)
        # Non-ASCII arguments typed in that locale are read as the UTF-8 typed, not refused.
        [(code, out, err)] = run_experiment.run_together(
            [in_legacy(MODULE, "change", db, "操作-1", "名额A", 1, "--now", 0)], env=legacy)
        self.assertEqual((code, err), (0, b""))
        self.assertEqual(json.loads(out.decode("utf-8"))["name"], "名额A")

        # And init's NAME=QTY arguments typed in that locale: the resource is named as typed.
        [(code, out, err)] = run_experiment.run_together(
            [in_legacy(MODULE, "init", db + ".typed", "名额B=5")], env=legacy)
        self.assertEqual((code, err), (0, b""))
        self.assertEqual(list(json.loads(out.decode("utf-8"))["resources"]), ["名额B"])

    def test_a_stored_result_nested_too_deeply_is_a_one_line_refusal_of_a_replay(self):
        deep = "[" * 100000 + "]" * 100000  # what another program could store
        self.x("job-1")
        self.change("change-1", "A", 1)
        self.sql("UPDATE receipt SET result = ?", (deep,))
        self.release()
        for argv in (("execute", self.db, "job-1", json.dumps(plan()), "--now", 0),
                     ("change", self.db, "change-1", "A", 1, "--now", 0)):
            with self.subTest(argv[0]):
                code, out, err = cli(*argv)
                self.assertEqual((code, out, len(err.splitlines())), (1, "", 1), err)
                self.assertTrue(err.startswith(f"preconditions.py {argv[0]}: RecursionError: "), err)
        self.assertEqual(self.figures(), ({"A": (8, 3), "B": (3, 2)}, 1, 2))


# === beyond 第七篇: the PostgreSQL edition in README.md, against a real server ===
# The README's ```sql blocks for article 7, loaded as printed into a throw-away cluster
# (run_experiment.pg_start: Unix socket only, as nobody when run as root, stopped and removed at
# exit); each race releases 16 psql clients together at an advisory-lock barrier the test sees
# in pg_locks, for 10 rounds; assertions are counts and statuses.  Without PostgreSQL they skip.

PG_CLIENTS, PG_ROUNDS, PG_FILLER = run_experiment.PG_CLIENTS, run_experiment.PG_ROUNDS, run_experiment.PG_FILLER


class PostgresArticle7Test(run_experiment.pg_case(7)):
    """第七篇 in PostgreSQL: execute, change and purge under 16 racing clients."""

    def resources(self, **quantities):
        self.session.query("INSERT INTO resources VALUES " +
                           ", ".join(f"({run_experiment.pg_literal(name)}, {q}, 1)" for name, q in sorted(quantities.items())))

    def resource(self, name):
        return tuple(map(int, self.session.query(f"SELECT quantity, revision FROM resources WHERE name = {run_experiment.pg_literal(name)}")[0]))

    def test_16_distinct_ops_on_one_snapshot_give_1_applied_and_15_stale_in_both_directions(self):
        self.resources(**{f"A{r}": 10 for r in range(PG_ROUNDS)}, **{f"B{r}": 0 for r in range(PG_ROUNDS)})
        scripts = [[] for _ in range(PG_CLIENTS)]
        for r in range(PG_ROUNDS):
            a, b = f"A{r}", f"B{r}"
            for i in range(PG_CLIENTS):
                scripts[i].append(run_experiment.pg_call("execute", f"d{r}-{i}", plan(1, 1, 3, a, b), r, r))
                mixed = plan(2, 2, 1, a, b) if i < 8 else plan(2, 2, 1, b, a)  # A->B and B->A at once
                scripts[i].append(run_experiment.pg_call("execute", f"m{r}-{i}", mixed, r, r))
        outputs = run_experiment.pg_race(self.session, scripts)
        for r in range(PG_ROUNDS):
            a, b = f"A{r}", f"B{r}"
            first = run_experiment.pg_answers(outputs, 2 * r)
            self.assertEqual(run_experiment.pg_statuses(first), ["applied"] + ["stale"] * 15)
            self.assertIn({"status": "applied", "revisions": {a: 2, b: 2}, "quantities": {a: 7, b: 3}}, first)
            self.assertEqual(first.count({"status": "stale", "observed": {a: 2, b: 2}}), 15)
            second = run_experiment.pg_answers(outputs, 2 * r + 1)
            self.assertEqual(run_experiment.pg_statuses(second), ["applied"] + ["stale"] * 15)
            winner = next(i for i, x in enumerate(second) if x["status"] == "applied")
            self.assertEqual(self.resource(a), (6, 3) if winner < 8 else (8, 3))
            self.assertEqual(self.resource(b), (4, 3) if winner < 8 else (2, 3))
            self.assertEqual(self.session.query(f"SELECT count(*) FROM effects WHERE src IN ('{a}', '{b}')"), [["2"]])
        self.assertEqual(self.session.query("SELECT count(*) FROM receipt"), [[str(2 * PG_CLIENTS * PG_ROUNDS)]])

    def test_16_copies_of_one_op_give_1_applied_and_15_replayed_and_a_23505_retried_answers_right(self):
        self.resources(**{f"A{r}": 10 for r in range(PG_ROUNDS)}, **{f"B{r}": 0 for r in range(PG_ROUNDS)},
                       **{f"P{r}-{n}-{i}{end}": 10 for r in range(PG_ROUNDS) for n in range(3) for i in range(PG_CLIENTS)
                          for end in "ab"})
        pairs = 3  # phases of one op on 16 pairs of rows per round: each catches a history read in two statements
        self.session.query(run_experiment.PG_RETRY_23505)
        scripts = [[] for _ in range(PG_CLIENTS)]
        for r in range(PG_ROUNDS):
            for i in range(PG_CLIENTS):
                scripts[i].append(run_experiment.pg_call("execute", f"same{r}", plan(1, 1, 3, f"A{r}", f"B{r}"), r, r))
                scripts[i].append(run_experiment.pg_call("execute", f"same{r}", plan(1, 1, 4, f"A{r}", f"B{r}"), r, r))
                # One op on 16 pairs of rows, then on missing rows: 23505, retried as the README says.
                for n in range(pairs):
                    pair = plan(1, 1, 1, f"P{r}-{n}-{i}a", f"P{r}-{n}-{i}b")
                    scripts[i].append(run_experiment.pg_retrying("execute", f"pair{r}-{n}", pair, r, r))
                scripts[i].append(run_experiment.pg_retrying("execute", f"gone{r}", plan(1, 1, 1, f"X{r}", f"Y{r}"), r, r))
        outputs = run_experiment.pg_race(self.session, scripts)
        phases = 3 + pairs
        for r in range(PG_ROUNDS):
            a, b = f"A{r}", f"B{r}"
            applied = {"status": "applied", "revisions": {a: 2, b: 2}, "quantities": {a: 7, b: 3}}
            self.assertEqual(sorted(run_experiment.pg_answers(outputs, phases * r), key=lambda a: a["status"]),
                             [applied] + [{"status": "replayed", "result": applied}] * 15)
            self.assertEqual(run_experiment.pg_answers(outputs, phases * r + 1), [{"status": "conflict"}] * PG_CLIENTS)
            self.assertEqual((self.resource(a), self.resource(b)), ((7, 2), (3, 2)))
            for n in range(pairs):
                decided = run_experiment.pg_answers(outputs, phases * r + 2 + n)
                self.assertEqual(run_experiment.pg_statuses(decided), ["applied"] + ["conflict"] * 15, f"round {r}, pair phase {n}")
            missing = {"status": "missing_resource", "missing": [f"X{r}", f"Y{r}"]}
            self.assertEqual(sorted(run_experiment.pg_answers(outputs, phases * r + 2 + pairs), key=lambda a: a["status"]),
                             [missing] + [{"status": "replayed", "result": missing}] * 15)
        self.assertEqual(self.session.query("SELECT (SELECT count(*) FROM effects), (SELECT count(*) FROM receipt)"),
                         [[str((1 + pairs) * PG_ROUNDS), str((2 + pairs) * PG_ROUNDS)]])

    def test_change_loses_no_update_runs_once_per_op_and_a_change_between_plan_and_execute_makes_it_stale(self):
        self.resources(**{f"A{r}": 10 for r in range(PG_ROUNDS)}, **{f"B{r}": 0 for r in range(PG_ROUNDS)},
                       **{f"C{r}": 100 for r in range(PG_ROUNDS)}, **{f"D{r}": 10 for r in range(PG_ROUNDS)},
                       **{f"R{r}-{n}-{i}": 10 for r in range(PG_ROUNDS) for n in range(3) for i in range(PG_CLIENTS)})
        self.session.query(run_experiment.PG_RETRY_23505)
        spreads = 3  # phases of one change op sent for 16 rows per round
        scripts = [[] for _ in range(PG_CLIENTS)]
        for r in range(PG_ROUNDS):
            a, b, c, d = f"A{r}", f"B{r}", f"C{r}", f"D{r}"
            for i in range(PG_CLIENTS):
                scripts[i].append(run_experiment.pg_call("change", f"inc{r}-{i}", c, 1, r, r))  # 16 distinct changes of one row
                scripts[i].append(run_experiment.pg_call("change", f"once{r}", c, 5, r, r))      # 16 copies of one change
                scripts[i].append(run_experiment.pg_call("change", f"b{r}-{i}", b, 2, r, r) if i < 8 else  # changes race plans
                                  run_experiment.pg_call("execute", f"p{r}-{i}", plan(1, 1, 3, a, b), r, r))
                late = plan(1, 1, 3, d, b) if i < 8 else plan(1, 1, 3, b, d)  # planned before B changed
                scripts[i].append(run_experiment.pg_call("execute", f"late{r}-{i}", late, r, r))
                # One change op sent for 16 rows: one is changed, the 15 others conflict (after 23505).
                for n in range(spreads):
                    scripts[i].append(run_experiment.pg_retrying("change", f"spread{r}-{n}", f"R{r}-{n}-{i}", 1, r, r))
        outputs = run_experiment.pg_race(self.session, scripts)
        for r in range(PG_ROUNDS):
            a, b, c, d = f"A{r}", f"B{r}", f"C{r}", f"D{r}"
            increments = run_experiment.pg_answers(outputs, (4 + spreads) * r)
            self.assertEqual(sorted((x["status"], x["revision"], x["quantity"]) for x in increments),
                             [("changed", 2 + n, 101 + n) for n in range(16)], "no lost update")
            once = {"status": "changed", "name": c, "quantity": 121, "revision": 18}
            self.assertEqual(sorted(run_experiment.pg_answers(outputs, (4 + spreads) * r + 1), key=lambda a: a["status"]),
                             [once] + [{"status": "replayed", "result": once}] * 15)
            racing = run_experiment.pg_answers(outputs, (4 + spreads) * r + 2)
            changes, plans = racing[:8], racing[8:]
            applied = [x for x in plans if x["status"] == "applied"]
            self.assertLessEqual(len(applied), 1)
            self.assertEqual(run_experiment.pg_statuses(changes), ["changed"] * 8)
            self.assertEqual(run_experiment.pg_statuses(plans), sorted(["applied"] * len(applied) + ["stale"] * (8 - len(applied))))
            revisions = sorted([x["revision"] for x in changes] + [x["revisions"][b] for x in applied])
            self.assertEqual(revisions, list(range(2, 10 + len(applied))), "every revision of B made once")
            self.assertEqual(self.resource(b), (16 + 3 * len(applied), 9 + len(applied)))
            self.assertEqual(self.resource(a), (10 - 3 * len(applied), 1 + len(applied)))
            self.assertEqual(self.resource(c), (121, 18))
            late = run_experiment.pg_answers(outputs, (4 + spreads) * r + 3)
            self.assertEqual(late, [{"status": "stale", "observed": {d: 1, b: 9 + len(applied)}}] * PG_CLIENTS)
            self.assertEqual(self.resource(d), (10, 1))
            self.assertEqual(self.session.query(f"SELECT count(*) FROM effects WHERE dst = '{b}'"), [[str(len(applied))]])
            for n in range(spreads):
                self.assertEqual(run_experiment.pg_statuses(run_experiment.pg_answers(outputs, (4 + spreads) * r + 4 + n)), ["changed"] + ["conflict"] * 15)
                self.assertEqual(self.session.query(f"SELECT sum(quantity), sum(revision) FROM resources"
                                                    f" WHERE name LIKE 'R{r}-{n}-%'"), [[str(10 * PG_CLIENTS + 1), str(PG_CLIENTS + 1)]])
        self.assertEqual(self.session.query("SELECT count(*) FROM changes"), [[str(PG_ROUNDS * (16 + 1 + 8 + spreads))]])

    def test_after_a_purge_an_op_issued_before_the_mark_is_expired_and_purges_never_move_it_back(self):
        ticks = [1000 * (r + 1) for r in range(PG_ROUNDS)]
        self.resources(**{f"A{r}": 10 for r in range(PG_ROUNDS)}, **{f"B{r}": 0 for r in range(PG_ROUNDS)},
                       **{f"C{r}": 5 for r in range(PG_ROUNDS)})
        decided = {}
        for r, t in enumerate(ticks):
            for op, statement in ((f"x{r}", run_experiment.pg_call("execute", f"x{r}", plan(1, 1, 3, f"A{r}", f"B{r}"), t, t)),
                                  (f"s{r}", run_experiment.pg_call("execute", f"s{r}", plan(1, 1, 3, f"A{r}", f"B{r}"), t, t)),
                                  (f"c{r}", run_experiment.pg_call("change", f"c{r}", f"C{r}", -1, t, t))):
                decided[op] = json.loads(self.session.value(statement))
        self.session.query(f"INSERT INTO receipt SELECT 'filler-' || n, 'd', '{{}}', 1000 * (1 + n % {PG_ROUNDS})"
                           f" FROM generate_series(1, {PG_FILLER * PG_ROUNDS}) n")
        scripts = [[] for _ in range(PG_CLIENTS)]
        for r, t in enumerate(ticks):
            x, s, c = (run_experiment.pg_call("execute", f"x{r}", plan(1, 1, 3, f"A{r}", f"B{r}"), t, t + 600),
                       run_experiment.pg_call("execute", f"s{r}", plan(1, 1, 3, f"A{r}", f"B{r}"), t, t + 600),
                       run_experiment.pg_call("change", f"c{r}", f"C{r}", -1, t, t + 600))
            racing = [run_experiment.pg_call("purge", t + 500 + i + 1, 500) for i in range(8)] + [x] * 3 + [s] * 3 + [c] * 2
            after = ([x] * 3 + [run_experiment.pg_call("execute", f"x{r}", plan(1, 1, 3, f"A{r}", f"B{r}"), t + 9, t + 600)] * 2
                     + [s] * 3 + [c] * 2
                     + [run_experiment.pg_call("execute", f"n{r}-{i}", plan(2, 2, 1, f"A{r}", f"B{r}"), t, t + 600) for i in range(4)]
                     + [run_experiment.pg_call("execute", f"f{r}-{i}", plan(2, 2, 1, f"A{r}", f"B{r}"), t + 9, 10 ** 6)
                        for i in range(2)])  # written at a tick no later purge reaches
            for i in range(PG_CLIENTS):
                scripts[i] += [racing[i], after[i]]

        def check(phase):
            r, t = phase // 2, ticks[phase // 2]
            if phase % 2 == 0:
                self.assertEqual(self.session.value("SELECT low_water FROM retention"), str(t + 8), "the highest mark")
                self.assertEqual((self.resource(f"A{r}"), self.resource(f"B{r}"), self.resource(f"C{r}")),
                                 ((7, 2), (3, 2), (4, 2)), "nothing decided twice")
        outputs = run_experiment.pg_race(self.session, scripts, after=check)
        for r, t in enumerate(ticks):
            racing = run_experiment.pg_answers(outputs, 2 * r)
            purged = [a for a in racing[:8] if a["status"] == "purged"]
            self.assertEqual(sum(a["deleted"] for a in purged), 3 + PG_FILLER, "each receipt deleted once")
            for i, a in enumerate(racing[:8]):
                if a["status"] == "backwards":
                    self.assertGreater(a["low_water"], t + i + 1)
                else:
                    self.assertEqual(a["low_water"], t + i + 1)
            for op, a in zip([f"x{r}"] * 3 + [f"s{r}"] * 3 + [f"c{r}"] * 2, racing[8:]):
                self.assertIn(a, ({"status": "replayed", "result": decided[op]},
                                  {"status": "expired", "low_water": a.get("low_water")}))
            late = run_experiment.pg_answers(outputs, 2 * r + 1)
            self.assertEqual(late[:14], [{"status": "expired", "low_water": t + 8}] * 14)
            self.assertEqual(run_experiment.pg_statuses(late[14:]), ["applied", "stale"])
            self.assertEqual(self.session.query(f"SELECT count(*) FROM receipt WHERE op IN ('x{r}', 's{r}', 'c{r}')"
                                                f" OR op LIKE 'n{r}-%'"), [["0"]])
        self.assertEqual(self.session.query("SELECT (SELECT count(*) FROM effects), (SELECT count(*) FROM changes),"
                                            " (SELECT count(*) FROM receipt)"), [[str(2 * PG_ROUNDS), str(PG_ROUNDS), str(2 * PG_ROUNDS)]])

    def test_the_sql_answers_as_preconditions_py_does_step_by_step(self):
        folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, folder)
        quantities = {"A": 10, "B": 0, "C": 5, "Q": pre.MAX_INT64 - 1, "R": 1}
        pre.init(os.path.join(folder, "p.db"), quantities)
        twin = pre.connect(os.path.join(folder, "p.db"))
        self.addCleanup(twin.close)
        twin.execute("UPDATE resources SET revision = ? WHERE name = 'R'", (pre.MAX_INT64,))
        self.resources(**quantities)
        self.session.query(f"UPDATE resources SET revision = {pre.MAX_INT64} WHERE name = 'R'")

        def python(step):
            kind, args = step[0], step[1:]
            try:
                if kind == "purge":
                    return pre.purge(twin, *args)
                *args, issued_at, now = args
                return getattr(pre, kind)(twin, *args, issued_at=issued_at, now=now)
            except (ValueError, TypeError) as error:
                return "backwards" if "move it backwards" in str(error) else "invalid"

        def sql(step):
            statement = run_experiment.pg_call(*step)
            if run_experiment.pg_sqlstate(self.session, statement) == "22023":
                return "invalid"
            answer = json.loads(self.session.value(statement))
            if step[0] == "purge":
                return "backwards" if answer.pop("status") == "backwards" else answer
            return answer

        steps = [
            ("execute", "op1", plan(1, 1, 3, "A", "B"), 1, 1), ("execute", "op1", plan(1, 1, 3, "A", "B"), 1, 2),
            ("execute", "op1", plan(1, 1, 4, "A", "B"), 1, 2), ("execute", "op2", plan(1, 1, 3, "A", "B"), 2, 2),
            ("execute", "op2", plan(1, 1, 3, "A", "B"), 2, 3), ("execute", "op3", plan(2, 2, 100, "A", "B"), 3, 3),
            ("execute", "op4", plan(2, 1, 1, "A", "X"), 3, 3), ("execute", "op5", plan(1, 1, 1, "Y", "X"), 3, 3),
            ("execute", "op6", plan(2, 1, 3, "A", "Q"), 4, 4), ("execute", "op7", plan(2, pre.MAX_INT64, 1, "A", "R"), 4, 4),
            ("execute", "op8", plan(1, 2, 1, "Q", "A"), 4, 4),
            ("change", "ch1", "C", -1, 5, 5), ("change", "ch1", "C", -1, 5, 6), ("change", "ch1", "C", -2, 5, 6),
            ("change", "ch2", "C", 1, 6, 6), ("execute", "op9", plan(1, 3, 1, "C", "A"), 7, 7),
            ("change", "ch3", "C", -100, 7, 7), ("change", "ch4", "Q", 2, 7, 7), ("change", "ch4b", "Q", 1, 7, 7),
            ("change", "ch5", "R", 1, 7, 7), ("change", "ch6", "Z", 1, 7, 7), ("change", "op1", "C", 1, 7, 7),
            ("execute", "bad", {"src": "A", "dst": "B", "amount": True, "expected": {"A": 1, "B": 1}}, 7, 7),
            ("execute", "bad", {"src": "A", "dst": "B", "amount": 3.0, "expected": {"A": 1, "B": 1}}, 7, 7),
            ("execute", "bad", {"src": "A", "dst": "B", "amount": 0, "expected": {"A": 1, "B": 1}}, 7, 7),
            ("execute", "bad", {"src": "A", "dst": "B", "amount": 10 ** 15 + 1, "expected": {"A": 1, "B": 1}}, 7, 7),
            ("execute", "bad", {"src": "A", "dst": "B", "amount": "3", "expected": {"A": 1, "B": 1}}, 7, 7),
            ("execute", "bad", {"src": "A", "dst": "A", "amount": 1, "expected": {"A": 1}}, 7, 7),
            ("execute", "bad", {"src": "A", "dst": "B", "amount": 1, "expected": {"A": 1}}, 7, 7),
            ("execute", "bad", {"src": "A", "dst": "B", "amount": 1, "expected": {"A": 1, "B": 0}}, 7, 7),
            ("execute", "bad", {"src": "A", "dst": "B", "amount": 1, "expected": {"A": 1, "B": 1}, "x": 1}, 7, 7),
            ("execute", "bad", {"src": "", "dst": "B", "amount": 1, "expected": {"": 1, "B": 1}}, 7, 7),
            ("execute", "", plan(1, 1, 1, "A", "B"), 7, 7), ("execute", "o" * 129, plan(1, 1, 1, "A", "B"), 7, 7),
            ("execute", "bad", plan(1, 1, 1, "A", "B"), 8, 7), ("change", "bad", "C", -pre.MAX_INT64 - 1, 7, 7),
            ("change", "bad", "", 1, 7, 7), ("change", "bad", "C", 1, -1, 7),
            ("purge", 60, 50), ("purge", 55, 50), ("purge", 60, 61), ("purge", 60, 0),
            ("execute", "op1", plan(1, 1, 3, "A", "B"), 1, 61), ("execute", "op1", plan(1, 1, 3, "A", "B"), 20, 61),
            ("execute", "op2", plan(1, 1, 3, "A", "B"), 2, 61), ("change", "ch2", "C", 1, 6, 61),
            ("change", "ch2", "C", 1, 30, 61), ("execute", "op10", plan(2, 2, 1, "A", "B"), 5, 61),
            ("execute", "op10", plan(2, 2, 1, "A", "B"), 40, 61), ("execute", "op11", plan(3, 3, 1, "A", "B"), 61, 62),
            ("execute", "op10", plan(2, 2, 1, "A", "B"), 40, 63),
        ]
        for step in steps:
            self.assertEqual(sql(step), python(step), step)
        snapshot = pre.snapshot(twin)
        self.assertEqual({name: {"quantity": int(q), "revision": int(v)}
                          for name, q, v in self.session.query("SELECT name, quantity, revision FROM resources")},
                         snapshot["resources"])
        self.assertEqual(self.session.query("SELECT (SELECT count(*) FROM effects), (SELECT count(*) FROM receipt)"),
                         [[str(snapshot["effects"]), str(snapshot["receipts"])]])
        self.assertEqual(self.session.query("SELECT count(*) FROM changes"),
                         [[str(twin.execute("SELECT count(*) FROM changes").fetchone()[0])]])


class TheSourceItself(unittest.TestCase):
    """Beyond 第七篇: what the README promises about the source: the copy kit, the twins, __all__."""

    def test_the_execute_kit_alone_runs_the_articles_scenario_on_the_readmes_connection(self):
        # As a copier would: the kit in a fresh module, the connection opened as README.md's open_database()
        # does, the tables from SCHEMA, in a fresh interpreter (and in Python 3.12+ too, where one is found).
        found = definitions(MODULE)
        kit = [name for name in found if name in KIT]  # source order
        self.assertEqual(sorted(kit), sorted(KIT))
        self.assertLess(sum(len(found[name][1].splitlines()) for name in kit), 150)  # lines of definitions
        [recipe] = run_experiment.readme_blocks("python", os.path.join(HERE, "README.md"))
        check = f"""
connection = open_database(os.path.join(folder, "t.db"))
for statement in {pre.SCHEMA!r}:
    connection.execute(statement)
connection.execute("INSERT INTO resources VALUES ('A', 10, 1), ('B', 0, 1)")
plan = {plan()!r}
assert kit.execute(connection, "job-1", plan, issued_at=0, now=0) == {APPLIED!r}
assert kit.execute(connection, "job-1", plan, issued_at=0, now=0) == {{"status": "replayed", "result": {APPLIED!r}}}
connection.execute("UPDATE resources SET quantity = 5, revision = 3 WHERE name = 'B'")  # another write
assert kit.execute(connection, "job-2", plan, issued_at=0, now=0) == {{"status": "stale", "observed": {{"A": 2, "B": 3}}}}
assert not os.path.exists(os.path.join(folder, "preconditions.py"))
connection.close()
"""
        interpreters = [sys.executable] + [newer for newer in [run_experiment.newer_python()] if newer]
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "kit.py"), "w", encoding="utf-8") as handle:
                handle.write(KIT_IMPORTS + "\n\n" + "\n\n\n".join(found[name][1] for name in kit) + "\n")
            script = "\n".join(["import os, sys", f"folder = {folder!r}", "sys.path.insert(0, folder)", "import kit",
                                # each interpreter its own database: they run at the same time
                                "folder = os.path.join(folder, sys.implementation.cache_tag)", "os.mkdir(folder)",
                                recipe, check, "print('ok')"])
            done = run_experiment.run_together([[python, "-I", "-S", *SAME_FLAGS, "-c", script] for python in interpreters])
        for python, (code, out, err) in zip(interpreters, done):
            with self.subTest(python=python):
                self.assertEqual((code, out, err.decode("utf-8")), (0, b"ok\n", ""))

    def test_the_kit_list_is_exactly_what_execute_needs(self):
        found = definitions(MODULE)
        needed, todo = set(), ["execute"]
        while todo:
            name = todo.pop()
            if name not in needed:
                needed.add(name)
                todo += [node.id for node in ast.walk(found[name][0])
                         if isinstance(node, ast.Name) and node.id in found and node.id != name]
        self.assertEqual(needed, set(KIT))
        with open(MODULE, encoding="utf-8") as handle:
            body = ast.parse(handle.read()).body
        imported = {alias.asname or alias.name for node in body
                    if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        used = {node.id for name in needed for node in ast.walk(found[name][0])
                if isinstance(node, ast.Name) and node.id in imported}
        self.assertLessEqual(used, {"hashlib", "json", "os", "sqlite3", "contextmanager"})

    def test_the_twin_definitions_are_identical_in_reliability_py(self):
        twin = os.path.join(HERE, "reliability.py")
        if not os.path.exists(twin):
            self.skipTest("reliability.py is not next to this file (article 7's download has only preconditions.py)")
        mine, theirs = definitions(MODULE), definitions(twin)
        for name in TWINS:
            with self.subTest(name):
                self.assertIn(name, theirs)
                self.assertEqual(mine[name][1], theirs[name][1])

    def test_transaction_is_the_articles_wrapper_line_for_line(self):
        self.assertEqual(definitions(MODULE)["transaction"][1].splitlines(), ARTICLE_TRANSACTION.splitlines())

    def test_all_equals_the_readmes_public_list(self):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as handle:
            lines = [line for line in handle if line.startswith("`preconditions.__all__`:")]
        self.assertEqual(len(lines), 1, "README.md needs exactly one line starting with `preconditions.__all__`:")
        self.assertEqual(set(pre.__all__), set(re.findall(r"`([^`]+)`", lines[0].split(":", 1)[1])))


# README.md's article 7 table: each scenario's figures, as paths into results.json, in the "ours" cell's order.
TABLE_FIGURES = {
    "unsafe_check_then_act": [("after_go", "quantities", "A"), ("after_go", "quantities", "B"), ("after_go", "effects")],
    "safe_stale_rejected": [("after_go", "status"), ("after_go", "quantities", "A"), ("after_go", "quantities", "B"),
                            ("after_go", "effects")],
    "lost_ack_replay": [("after_first", "status"), ("after_retry", "status"), ("after_retry", "effects")],
    "replan_new_id": [("after_stale", "status"), ("after_same_id", "status"), ("after_new_id", "status")],
    "aba_revision": [("after_execute", "quantities", "A"), ("after_execute", "revisions", "A"),
                     ("after_execute", "status")],
    "crash_points": [(f"{boundary}.{stage}", key) for boundary in pre.EXIT_CODES
                     for stage, key in (("after_crash", "exit_code"), ("after_retry", "status"))],
    "stale_rejection_durable": [("after_retry", "status"), ("after_retry", "stored_status"), ("after_retry", "effects")],
    "trigger_faults": [("receipt_insert_fault", "quantities", "A"), ("receipt_insert_fault", "quantities", "B"),
                       ("receipt_insert_fault", "effects")],
    "concurrent_distinct_ops": [("after_race", "statuses", "applied"), ("after_race", "statuses", "stale"),
                                ("after_race", "effects")],
    "concurrent_same_op": [("after_race", "statuses", "applied"), ("after_race", "statuses", "replayed")],
    "undeclared_dependency": [("after_execute", "status"), ("after_execute", "quantities", "C")],
}


class ReadmeForArticle7(unittest.TestCase):
    """README.md stays true for article 7's reader: its headline lines are the console's, its table
    holds results.json's figures, its walk-through runs as printed, its counts and kit are the files'."""

    @classmethod
    def setUpClass(cls):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as handle:
            cls.text = handle.read()
        cls.lines = cls.text.splitlines()

    def test_its_headline_lines_are_the_consoles_within_the_first_60_lines(self):
        for run in run_experiment.run_all(["unsafe_check_then_act", "safe_stale_rejected"]):
            self.assertEqual(run.failures, [])
            self.assertIn(run_experiment.console_line(run), self.lines[:60])

    def test_the_counts_it_gives_are_the_drivers_and_this_files(self):
        ours = len(ARTICLE_7) + len(MATRIX)
        for said in (f"第七篇 {ours}（11 组 + 3 格）",
                     f"article 7's {ours} (11 groups + 3 cells)"):
            self.assertTrue(said in self.text, f"README.md does not say {said!r}")

    def test_the_scenario_table_gives_results_jsons_figures(self):
        rows = {re.match(r"`(\w+)`", cells[0]).group(1): cells[2]
                for cells in run_experiment.readme_table("| `unsafe_check_then_act`")}
        self.assertEqual(list(rows), ARTICLE_7)
        seven = committed_results()["article_7"]
        for name, cell in rows.items():
            values = []
            for path in TABLE_FIGURES[name]:
                value = seven[name]
                for key in path:
                    value = value[key]
                values.append(value)
            with self.subTest(name):  # the values in order, and no other number
                self.assertTrue(run_experiment.holds_figures(cell, values), f"{cell!r} does not give {values!r}")

    def test_the_walk_through_runs_as_printed_in_a_copy_of_the_download_and_shows_what_it_says(self):
        [block] = [block for block in run_experiment.readme_blocks("sh") if "python3 preconditions.py init" in block]
        self.assertGreaterEqual(len([line for line in block.splitlines() if line.startswith("python3")]), 10)
        code, out, unseen = run_experiment.walk_through(block, DOWNLOAD, SAME_FLAGS)
        self.assertIsNone(unseen, out)  # each output where the reader is told to look, in the block's order
        self.assertEqual(code, 0, out)
        self.assertNotIn("Traceback", out)

    def test_the_kit_row_lists_executes_closure_and_counts_its_lines(self):
        found = definitions(MODULE)
        [row] = [line for line in self.lines if line.startswith("| `preconditions.execute` |")]
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        self.assertEqual(set(re.findall(r"`([^`]+)`", cells[1])) | {"execute"}, set(KIT))
        self.assertEqual(cells[2], str(sum(len(found[name][1].splitlines()) for name in KIT)))


# === driver tests: results.json as committed (--check reruns every scenario against it), and the driver ===

ARTICLE_7 = [name for name, (article, _, _) in run_experiment.SCENARIOS.items() if article == "article_7"]
MATRIX = [name for name in run_experiment.SCENARIOS if name.startswith("preconditions/")]


def committed_results():
    with open(run_experiment.RESULTS, encoding="utf-8") as handle:
        return json.load(handle)


class DriverScenarios(unittest.TestCase):
    """第七篇's 11 scenario groups as results.json records them; ``run_experiment.py --check`` reruns
    every scenario and fails unless the run equals it, so these figures are the live ones."""

    def test_the_driver_names_exactly_the_articles_11_scenario_groups(self):
        self.assertEqual(ARTICLE_7, [
            "unsafe_check_then_act", "safe_stale_rejected", "lost_ack_replay", "replan_new_id", "aba_revision",
            "crash_points", "stale_rejection_durable", "trigger_faults", "concurrent_distinct_ops",
            "concurrent_same_op", "undeclared_dependency"])

    def test_results_json_holds_every_scenario_the_driver_registers_and_nothing_else(self):
        self.assertEqual(set(committed_results()["article_7"]), set(ARTICLE_7))
        self.assertEqual({name for name in committed_results()["crash_matrix"] if name.startswith("preconditions/")},
                         set(MATRIX))

    def test_the_articles_figures(self):
        seven = committed_results()["article_7"]
        self.assertEqual(seven["unsafe_check_then_act"]["after_go"]["quantities"], {"A": 7, "B": 5})
        self.assertEqual(seven["safe_stale_rejected"]["after_go"]["quantities"], {"A": 10, "B": 2})
        for name, statuses in (("concurrent_distinct_ops", {"applied": 1, "stale": 15}),
                               ("concurrent_same_op", {"applied": 1, "replayed": 15})):
            self.assertEqual((seven[name]["after_race"]["statuses"], seven[name]["after_race"]["effects"],
                              seven[name]["after_race"]["released_together"]), (statuses, 1, 8))
        self.assertEqual(seven["aba_revision"]["after_execute"]["revisions"]["A"], 3)
        self.assertEqual(seven["undeclared_dependency"]["after_execute"]["quantities"]["C"], 4)
        self.assertEqual({key.split(".")[0]: row["exit_code"] for key, row in seven["crash_points"].items()
                          if key.endswith("after_crash")}, pre.EXIT_CODES)

    def test_the_five_files_alone_pass_the_check_and_the_tests_import_without_reliability(self):
        with tempfile.TemporaryDirectory() as folder:
            for name in DOWNLOAD:
                shutil.copyfile(os.path.join(HERE, name), os.path.join(folder, name))
            env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
            env["PYTHONDONTWRITEBYTECODE"] = "1"
            # The article's command, on one scenario of each group: the same imports, registration and
            # comparison as the whole run (which the README's --check already does), at a fraction of the
            # time; meanwhile another process imports the tests and counts what the driver registered.
            # Both run with this run's interpreter flags (-X dev, -W error), without site-packages (-S).
            commands = [["run_experiment.py", "--check", "--only", "safe_stale_rejected", "preconditions/after_commit"],
                        ["-c", "import json, sys, test_preconditions, run_experiment as r; print(len(r.SCENARIOS),"
                               " 'reliability' in sys.modules, sorted(n for group in r.compared(json.load("
                               "open('results.json'))).values() for n in group) == sorted(r.SCENARIOS))"]]
            (code, check, _), imported = run_experiment.run_together(
                [[sys.executable, "-S", *SAME_FLAGS, *command] for command in commands], cwd=folder, env=env)
            self.assertEqual(code, 0, check.decode("utf-8"))
            self.assertIn(b"2/2 scenarios match results.json", check)
            # registered, and exactly these are what a whole --check compares
            self.assertEqual(imported, (0, f"{len(ARTICLE_7) + len(MATRIX)} False True\n".encode(), b""))
            self.assertEqual(sorted(os.listdir(folder)), ["README.md", "preconditions.py", "results.json",
                                                          "run_experiment.py", "test_preconditions.py"])


class DriverCrashMatrix(unittest.TestCase):
    """第七篇 §6: every boundary in EXIT_CODES crashed for real by the driver, then retried by a new process."""

    def test_every_boundary_has_a_row_that_is_all_or_nothing(self):
        rows = committed_results()["crash_matrix"]
        self.assertEqual(MATRIX, [f"preconditions/{boundary}" for boundary in pre.EXIT_CODES])
        for boundary, code in pre.EXIT_CODES.items():
            fresh = rows[f"preconditions/{boundary}"]["fresh"]
            committed = boundary == "after_commit"
            with self.subTest(boundary):
                self.assertEqual(fresh, {"exit_code": code, "effects_after_crash": int(committed),
                                         "retry": "replayed" if committed else "applied", "outcome": "applied",
                                         "effects": 1})
        self.assertEqual(rows["preconditions/after_commit"]["stale"],
                         {"exit_code": 73, "effects_after_crash": 0, "retry": "replayed", "outcome": "stale",
                          "effects": 0})


if __name__ == "__main__":
    unittest.main()
