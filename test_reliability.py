"""Boundary tests for reliability.py, in the order of 第一篇「工具干完了，回执丢了怎么办？」.

Run with ``python3 test_reliability.py`` or ``python3 -X dev -W error -m unittest
test_reliability``.  Every test works on real SQLite files in a fresh temporary directory;
crashes are real child processes that exit 73 at a named boundary.

The tests come in the article's sections (§1 files, §2 outbox, §3 receipt, §4 crashes and the
command line, §5 claims, §6 unknown), then the module's contracts beyond the article (leaving
unknown, retention, ticks, files and failed system calls), then the article's figures as
results.json holds them.  The machinery they share (workspaces, children, one barrier) is in
one section at the bottom; the helpers marked "# twin" are written identically in
test_preconditions.py, so that each article's five files run alone.

The companion's self-checks are in beyond/test_companion.py, which no download needs: the copy
kits, README.md's tables and walk-through, the public names, the driver's own failures, the
five-file download, and the test that the twins are identical.

How the suite runs its children: most are forked, as the driver forks them
(run_experiment.fork_child): the module's tool child (tool_child), or the driver's step by hand
(run_experiment.main); a fork costs a few milliseconds where a fresh interpreter costs about 30.
The rule that buys it: the parent holds no SQLite connection to a file the child opens
(SQLite's lock records would be copied into the child), so tests close theirs first
(ws.close()).  Fresh interpreters run only where the interpreter itself is under test: the real
entry points once per exit code, and the locale, terminal and strace tests.

Races are forced, not hoped for: race() releases its forked racers together at barriers the
test checks, its watchdog measures silence rather than work, and racers retry "database is
locked" (which wrote nothing), so a loaded machine makes a race slower, never failed.  Crashes
and races are never simulated.  unittest.mock stands in only where the real event cannot be
forced: a tool child that times out (as the article says), a file that vanishes between
connect()'s check and its open, the loser of two inits, and two observers: a trace of init's
statements, and canonical() never reaching json.
"""
import os
import sys

# One clear line: unittest would turn SystemExit into a traceback.
if sys.version_info < (3, 9):
    sys.stderr.write("test_reliability.py needs Python 3.9 or newer; this is %s\n"
                     % sys.version.split()[0])
    sys.stderr.flush()
    os._exit(2)

import ast
import contextlib
import errno
import functools
import hashlib
import itertools
import json
import random
import select
import shutil
import signal
import sqlite3
import stat
import struct
import subprocess
import tempfile
import time
import types
import unittest
from unittest import mock

import reliability
import run_experiment
from reliability import (CRASH_EXIT, EXTERNAL, KINDS, LEASE_TICKS, MAX_ATTEMPTS,
                         MAX_PAYLOAD_BYTES, RECEIVER, SENDER, Conflict, CorruptRecord, Expired)

PAYLOAD = {"title": "打印机卡纸", "priority": 2, "tags": ["office", "hardware"]}
OTHER_PAYLOAD = {"title": "打印机卡纸", "priority": 3, "tags": ["office", "hardware"]}
# Deterministic, and not an SQLite header.
GARBAGE = bytes(range(256)) * 16


# === 第一篇 §1: WAL and synchronous=FULL on every connection; files are never recreated ===

class OnlyAnExistingDatabaseOfOursOpens(unittest.TestCase):
    """§1 先说清楚这次到底运行了什么: every connection runs WAL with synchronous=FULL, and a
    file is opened, never created; what is not whole and ours is refused naming its path, and
    left unchanged."""

    def test_every_connection_runs_wal_full_synchronous_with_foreign_keys_in_autocommit(self):
        with workspace() as ws:
            for name in Workspace.FILES:
                connection = getattr(ws, name)
                with self.subTest(database=name):
                    pragma = lambda setting: connection.execute(f"PRAGMA {setting}").fetchone()[0]
                    self.assertEqual((pragma("journal_mode"), pragma("synchronous"),
                                      pragma("foreign_keys")), ("wal", 2, 1),
                                     "synchronous 2 is FULL")
                    self.assertIsNone(connection.isolation_level)
            receive(ws)
            with self.assertRaises(sqlite3.IntegrityError, msg="foreign keys are enforced"):
                ws.receiver.execute("DELETE FROM tickets")
            self.assertEqual(counts(ws)["tickets"], 1)

    def test_a_missing_database_or_folder_is_refused_naming_it_and_never_created(self):
        with tempfile.TemporaryDirectory() as root:
            for path in (os.path.join(root, RECEIVER), os.path.join(root, "missing", RECEIVER),
                         root):
                with self.subTest(path=path), \
                        self.assertRaises(sqlite3.OperationalError) as caught:
                    reliability.connect(path)
                self.assertIn(path, str(caught.exception))
            self.assertEqual(os.listdir(root), [])

    def test_garbage_empty_foreign_and_fifo_files_are_refused_naming_the_path_unchanged(self):
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
                    self.assertEqual(os.listdir(os.path.dirname(path)), [os.path.basename(path)],
                                     "no -wal, no -shm")
            # A reader of a FIFO would wait for ever for a writer: so in a child, watched.
            fifo = os.path.join(root, "fifo", SENDER)
            os.mkdir(os.path.dirname(fifo))
            os.mkfifo(fifo)
            code, out, err = cli("snapshot", fifo)
            self.assertEqual((code, out, len(err.splitlines())), (1, "", 1), err)
            self.assertIn(fifo, err)

    def test_a_database_with_a_second_name_is_refused_naming_the_path(self):
        with workspace() as ws:
            ws.close()
            alias = os.path.join(ws.root, "alias.db")
            # Two names make two -wal files: commits could be lost.
            os.link(ws.path("receiver"), alias)
            for path in (ws.path("receiver"), alias):
                with self.subTest(path=path), self.assertRaises(OSError) as caught:
                    reliability.connect(path)
                self.assertIn(path, str(caught.exception))
                self.assertIn("more than one name", str(caught.exception))
            self.assertEqual(sorted(os.listdir(ws.root)), sorted([*KINDS, "alias.db"]),
                             "no -wal, no -shm")
            os.remove(alias)
            self.assertEqual(counts(ws)["tickets"], 0, "one name again: opened as before")

    def test_paths_with_uri_special_characters_or_two_leading_slashes_open_the_named_file(self):
        with tempfile.TemporaryDirectory() as parent:
            root = os.path.join(parent, "a?mode=ro#b%41 c")
            reliability.init(root)
            with contextlib.closing(reliability.connect(os.path.join(root, RECEIVER))) as opened:
                receive_on(opened)
            with raw(os.path.join(root, RECEIVER)) as check:
                self.assertEqual(check.execute("SELECT count(*) FROM tickets").fetchone()[0], 1)
            self.assertEqual(os.listdir(parent), [os.path.basename(root)])
        # //tmp/... is a path, not a URI authority: POSIX lets it mean the same file.
        with tempfile.TemporaryDirectory() as top:
            root = "/" + os.path.join(top, "root")
            reliability.init(root)
            with contextlib.closing(reliability.connect(os.path.join(root, RECEIVER))) as opened:
                self.assertEqual(receive_on(opened)["ticket_id"], 1)
            self.assertEqual(cli("purge", os.path.join(root, RECEIVER), "--now", 100, "--window",
                                 50)[0], 0)
            self.assertEqual(sorted(os.listdir(os.path.join(top, "root"))), sorted(KINDS))


class InitMakesAWholeDatabaseOrNothing(unittest.TestCase):
    """§1: init() makes the three databases with their kind and schema version, committed with
    the schema, and never overwrites or removes a file, not even when it loses a race."""

    def test_init_creates_the_three_databases_with_their_kind_and_schema_version(self):
        with tempfile.TemporaryDirectory() as root:
            reliability.init(root)
            self.assertEqual(sorted(os.listdir(root)), sorted(KINDS))
            for name, kind in KINDS.items():
                path = os.path.join(root, name)
                with contextlib.closing(reliability.connect(path)) as connection:
                    pragma = lambda setting: connection.execute(f"PRAGMA {setting}").fetchone()[0]
                    self.assertEqual((pragma("application_id"), pragma("user_version")), (kind, 2))
        self.assertEqual(KINDS, {SENDER: 7301, RECEIVER: 7302, EXTERNAL: 7303})
        self.assertEqual(reliability.SCHEMA_VERSION, 2)

    def test_the_kind_and_schema_version_commit_in_the_schemas_own_transaction(self):
        statements, connect = [], sqlite3.connect

        # Every connection init opens, its statements recorded.
        def traced(*args, **kwargs):
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
                self.assertEqual(statements[marker + 1],
                                 f"PRAGMA user_version = {reliability.SCHEMA_VERSION}")
                self.assertLess(marker + 1, commit)
                self.assertTrue(all(s.startswith(("CREATE", "INSERT"))
                                    for s in statements[begin + 1:marker]))

    def test_init_never_overwrites_or_removes_a_file_even_when_it_loses_the_race_to_create(self):
        for existing in (*KINDS, RECEIVER + "-wal", SENDER + "-journal"):
            with self.subTest(existing=existing), tempfile.TemporaryDirectory() as root:
                write_file(os.path.join(root, existing), GARBAGE)
                with self.assertRaises(FileExistsError):
                    reliability.init(root)
                self.assertEqual(os.listdir(root), [existing], "nothing else was created")
                self.assertEqual(file_bytes(os.path.join(root, existing)), GARBAGE)
        # A real root, used; the loser of two inits looked before the winner created the files.
        lost = mock.patch("os.path.lexists", return_value=False)
        for label, looked in (("used", contextlib.nullcontext()), ("lost the race", lost)):
            with self.subTest(label), tempfile.TemporaryDirectory() as root:
                reliability.init(root)
                with contextlib.closing(reliability.connect(os.path.join(root, SENDER))) as used:
                    reliability.enqueue(used, "agent", "k1", PAYLOAD, now=0)
                with contextlib.closing(reliability.connect(os.path.join(root, RECEIVER))) as used:
                    receive_on(used)
                before = folder_bytes(root)
                with looked, self.assertRaises(FileExistsError):
                    reliability.init(root)
                self.assertEqual(folder_bytes(root), before)
                self.assertEqual(sorted(before), sorted(KINDS))

    @unittest.skipUnless(hasattr(os, "fork"), "the half-built file is left by a forked child")
    def test_a_database_whose_creation_died_half_way_is_refused_by_connect(self):
        # The kind and schema markers commit with the schema: a file left mid-creation has none.
        with tempfile.TemporaryDirectory() as root:
            path = os.path.join(root, RECEIVER)

            # The schema is written, nothing committed.
            def dies_half_way(connection):
                os._exit(9)
            pid = os.fork()
            if pid == 0:
                try:
                    reliability._create(path, KINDS[RECEIVER], reliability.SCHEMAS[RECEIVER],
                                        dies_half_way)
                finally:
                    os._exit(1)
            self.assertEqual(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), 9)
            with self.assertRaisesRegex(sqlite3.DatabaseError, "not a database of this module"):
                reliability.connect(path)
            # Nor does init take it over: it stays, for a person to remove.
            with self.assertRaises(FileExistsError):
                reliability.init(root)
            self.assertEqual(os.listdir(root), [RECEIVER])


class SnapshotReadsOneState(unittest.TestCase):
    """§1: what a reader or a test sees of a database is one committed state."""

    def test_snapshot_reads_one_state_even_while_another_process_writes(self):
        with workspace() as ws:
            # Another writer commits between snapshot's two reads.
            class Between(sqlite3.Connection):
                def execute(self, sql, *args):
                    if "FROM outbox" in sql:
                        enqueue(ws, "k2")
                    return super().execute(sql, *args)
            enqueue(ws)
            with contextlib.closing(sqlite3.connect(ws.path("sender"), factory=Between,
                                                    isolation_level=None)) as connection:
                seen = reliability.snapshot(connection)
            self.assertEqual((seen["intent_rows"], len(seen["outbox"])), (1, 1))
            self.assertEqual(counts(ws)["requests"], 2)


# === 第一篇 §2: the durable outbox ===

class TheIntentIsStoredOnceBeforeAnythingIsSent(unittest.TestCase):
    """§2 两本账之间，没有一个共同的提交按钮: the intent is written once, before anything is
    sent; an enqueue that dies before its COMMIT leaves nothing, after it the intent stays."""

    def test_enqueue_stores_intent_and_outbox_row_once_and_a_duplicate_adds_nothing(self):
        with workspace() as ws:
            self.assertEqual(enqueue(ws, now=7), "accepted")
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))
            self.assertEqual(ws.sender.execute("SELECT issued_at FROM requests").fetchall(),
                             [(7,)])
            before = rows(ws.sender, "requests"), rows(ws.sender, "outbox")
            self.assertEqual(enqueue(ws, payload=dict(PAYLOAD), now=9), "duplicate")
            self.assertEqual((rows(ws.sender, "requests"), rows(ws.sender, "outbox")), before)
            # A duplicate of a claimed intent neither resets nor re-queues it.
            row = reliability.claim(ws.sender, 9)
            self.assertEqual((row["issued_at"], row["now"]), (7, 9))
            self.assertEqual(enqueue(ws, now=9), "duplicate")
            self.assertEqual(state(ws), ("inflight", 1))

    def test_same_key_with_another_payload_or_mode_is_a_conflict_and_changes_nothing(self):
        with workspace() as ws:
            enqueue(ws)
            before = rows(ws.sender, "requests"), rows(ws.sender, "outbox")
            for label, payload, mode in (("payload", OTHER_PAYLOAD, "idempotent"),
                                         ("mode", PAYLOAD, "external"),
                                         ("both", OTHER_PAYLOAD, "external")):
                with self.subTest(differs=label), self.assertRaises(Conflict):
                    enqueue(ws, payload=payload, mode=mode)
            self.assertEqual((rows(ws.sender, "requests"), rows(ws.sender, "outbox")), before)
            self.assertEqual(enqueue(ws, payload=OTHER_PAYLOAD, caller="other"), "accepted",
                             "the same key is another caller's own")
            self.assertEqual(counts(ws), dict(EMPTY, requests=2, outbox=2))

    def test_only_the_two_modes_exist_in_code_and_in_the_schema(self):
        self.assertEqual(reliability.MODES, ("idempotent", "external"))
        with workspace() as ws:
            for mode in ("naive", "mark_before", "unsafe", "", "IDEMPOTENT", None, ["idempotent"]):
                with self.subTest(mode=mode), self.assertRaises(ValueError):
                    enqueue(ws, mode=mode)
            self.assertEqual(counts(ws), EMPTY)
            # The CHECK constraint refuses them as well.
            with raw(ws.path("sender")) as tamper:
                sql = "INSERT INTO requests VALUES ('agent', ?, ?, 'd', '{}', 0)"
                for n, mode in enumerate(("naive", "mark_before", "idempotent", "external")):
                    insert = lambda: tamper.execute(sql, (f"k{n}", mode))
                    if mode in reliability.MODES:
                        insert()
                    else:
                        with self.subTest(mode=mode), self.assertRaises(sqlite3.IntegrityError):
                            insert()
                self.assertEqual(tamper.execute("SELECT count(*) FROM requests").fetchone()[0], 2)

    def test_enqueue_dying_before_its_commit_leaves_nothing_and_the_retry_is_accepted(self):
        with workspace() as ws:
            code, out, _ = cli("enqueue", ws.path("sender"), "agent", "k1", json.dumps(PAYLOAD),
                               "--now", 0, "--crash", "before_intent_commit")
            self.assertEqual((code, out), (CRASH_EXIT, ""))
            self.assertEqual(counts(ws), EMPTY)
            self.assertEqual(enqueue(ws), "accepted")
            self.assertEqual(state(ws), ("pending", 0))

    def test_enqueue_dying_after_its_commit_keeps_the_intent_and_the_retry_is_a_duplicate(self):
        with workspace() as ws:
            code, out, _ = cli("enqueue", ws.path("sender"), "agent", "k1", json.dumps(PAYLOAD),
                               "--now", 0, "--crash", "after_intent_commit")
            self.assertEqual((code, out), (CRASH_EXIT, ""), 'the caller never heard "accepted"')
            self.assertEqual(state(ws), ("pending", 0))
            self.assertEqual(enqueue(ws), "duplicate")
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))


# === 第一篇 §3: the receipt and the ticket in one transaction; the canonical payload ===

class OneTicketPerKeyReplayedFromItsReceipt(unittest.TestCase):
    """§3 把幂等记录和业务动作放进同一个事务: one ticket per (caller, key), replayed from its
    receipt; the same key with another payload is a conflict."""

    def test_a_replay_returns_the_identical_response_and_creates_no_ticket(self):
        with workspace() as ws:
            first = receive(ws)
            self.assertEqual(first, {"caller": "agent", "key": "k1",
                                     "digest": reliability.canonical(PAYLOAD)[1], "ticket_id": 1})
            self.assertEqual(receive(ws, now=5), first)
            # As a restarted process would ask.
            with contextlib.closing(reliability.connect(ws.path("receiver"))) as again:
                self.assertEqual(receive_on(again, payload=dict(PAYLOAD), now=9), first)
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
            self.assertEqual((receive(ws, caller="alice"), receive(ws, caller="bob")),
                             (alice, bob))
            again = receive(ws, "k2", caller="alice")
            self.assertEqual((again["digest"], again["ticket_id"]), (alice["digest"], 4))
            self.assertEqual(counts(ws), dict(EMPTY, tickets=4, receipts=4))


class TheTransactionIsTheArticlesWrapper(unittest.TestCase):
    """§3: transaction() is the article's wrapper: BEGIN IMMEDIATE, COMMIT on success, ROLLBACK
    and re-raise on any exception; a writer kept out past its busy timeout writes nothing."""

    def test_transaction_is_the_articles_wrapper_line_for_line(self):
        printed = ('@contextmanager\n'
                   'def transaction(connection):\n'
                   '    connection.execute("BEGIN IMMEDIATE")\n'
                   '    try:\n'
                   '        yield\n'
                   '        connection.execute("COMMIT")\n'
                   '    except BaseException:\n'
                   '        if connection.in_transaction:\n'
                   '            connection.execute("ROLLBACK")\n'
                   '        raise\n')
        self.assertEqual("\n".join(segment(DEFINITIONS["transaction"])) + "\n", printed)
        # The article itself sits beside the project, not in the download.
        article = os.path.join(HERE, "..", "shared", "seeds", "000_672431c61ad6d6f5.txt")
        if os.path.exists(article):
            with open(article, encoding="utf-8") as handle:
                self.assertIn(printed, handle.read())

    def test_transaction_commits_on_success_and_rolls_back_and_reraises_on_any_exception(self):
        class Boom(Exception):
            pass
        insert = "INSERT INTO tickets (caller, key, digest, payload) VALUES ('a', 'b', 'c', '{}')"
        with workspace() as ws:
            # BaseException, as the article prints it: a Ctrl-C must not leave a transaction open.
            for error in (Boom, KeyboardInterrupt):
                with self.subTest(error.__name__), self.assertRaises(error):
                    with reliability.transaction(ws.external):
                        ws.external.execute(insert)
                        raise error
                self.assertFalse(ws.external.in_transaction)
                self.assertEqual(counts(ws)["external"], 0)
            with reliability.transaction(ws.external):
                self.assertTrue(ws.external.in_transaction)
                ws.external.execute(insert)
            with raw(ws.path("external")) as other:
                self.assertEqual(other.execute("SELECT count(*) FROM tickets").fetchone()[0], 1)

    def test_transaction_does_not_nest_and_the_failed_inner_begin_rolls_the_outer_one_back(self):
        with workspace() as ws:
            with self.assertRaises(sqlite3.OperationalError):
                with reliability.transaction(ws.receiver):
                    ws.receiver.execute("INSERT INTO tickets (caller, key, digest, payload)"
                                        " VALUES ('a', 'b', 'c', '{}')")
                    with reliability.transaction(ws.receiver):
                        pass
            self.assertFalse(ws.receiver.in_transaction)
            self.assertEqual(counts(ws)["tickets"], 0)

    def test_a_writer_kept_past_its_busy_timeout_gets_database_is_locked_and_writes_nothing(self):
        self.assertEqual(reliability.BUSY_TIMEOUT, 10.0)
        with workspace() as ws, raw(ws.path("receiver")) as other_writer:
            other_writer.execute("BEGIN IMMEDIATE")
            # Not the 10 s default: the outcome is the same.
            ws.receiver.execute("PRAGMA busy_timeout = 20")
            with self.assertRaises(sqlite3.OperationalError) as caught:
                receive(ws)
            self.assertIn("database is locked", str(caught.exception))
            other_writer.execute("ROLLBACK")
            self.assertFalse(ws.receiver.in_transaction)
            self.assertEqual(counts(ws)["tickets"], 0)
            self.assertEqual(receive(ws)["ticket_id"], 1, "the lock is free again")


class OnlyExactJsonIsAcceptedBeforeAnyTransaction(unittest.TestCase):
    """§3 参数的规范化同样是协议: one canonical text and digest per JSON object, whatever its key
    order; what JSON cannot carry exactly is refused before any transaction, nothing stored."""

    def test_key_order_does_not_change_the_canonical_form_or_the_digest(self):
        one = {"b": [1, {"d": 1, "c": "é"}], "a": 1}
        two = {"a": 1, "b": [1, {"c": "é", "d": 1}]}
        text, digest = reliability.canonical(one)
        self.assertEqual(text, '{"a":1,"b":[1,{"c":"é","d":1}]}', "sorted, compact, not escaped")
        self.assertEqual(digest, hashlib.sha256(text.encode("utf-8")).hexdigest())
        self.assertEqual(reliability.canonical(two), (text, digest))
        self.assertNotEqual(reliability.canonical({"a": 1, "b": [{"c": "é", "d": 1}, 1]})[1],
                            digest, "list order is kept")
        with workspace() as ws:
            self.assertEqual(receive(ws, payload=two), receive(ws, payload=one))
            self.assertEqual((enqueue(ws, payload=one), enqueue(ws, payload=two)),
                             ("accepted", "duplicate"))
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1, tickets=1, receipts=1))

    def test_invalid_payloads_are_rejected_with_nothing_stored(self):
        text, number = type("Text", (str,), {}), type("Number", (int,), {})
        bad = {
            "NaN": {"a": float("nan")}, "Infinity": {"a": float("inf")},
            "-Infinity": {"a": float("-inf")}, "int dict key": {1: "a"},
            "nested int dict key": {"a": {2: "b"}}, "bool dict key": {True: "a"},
            "None dict key": {None: "a"}, "float dict key": {1.5: "a"},
            "int key beside str keys": {"a": 1, 2: "b"}, "tuple value": {"a": (1, 2)},
            "nested tuple": {"a": [(1,)]}, "bytes": {"a": b"x"}, "set": {"a": {1}},
            "list payload": [1, 2], "JSON text payload": '{"a": 1}', "None payload": None,
            "over-size payload": {"a": "x" * MAX_PAYLOAD_BYTES},
            "over-size in UTF-8 bytes only": {"a": "é" * (MAX_PAYLOAD_BYTES // 2)},
            "lone surrogate value": {"a": "\ud800"}, "lone surrogate key": {"\udc00": 1},
            "list subclass hiding a tuple": {"a": HidingList([(1, 2)])},
            "dict subclass hiding one": {"a": HidingDict(b=(1,))},
            "str subclass": {"a": text("x")}, "int subclass": {"a": number(1)},
        }
        with workspace() as ws:
            for label, payload in bad.items():
                for name, write in writers(ws).items():
                    with self.subTest(payload=label, function=name):
                        with self.assertRaises((TypeError, ValueError)):
                            write("agent", "k1", payload)
                        self.assertEqual(counts(ws), EMPTY)
                        self.assertFalse(ws.sender.in_transaction or ws.receiver.in_transaction
                                         or ws.external.in_transaction)

    def test_invalid_identities_are_rejected_with_nothing_stored(self):
        bad = {"empty": "", "over-long": "k" * (reliability.MAX_IDENTITY_LENGTH + 1), "int": 7,
               "bytes": b"k1", "None": None, "lone surrogate": "k\ud800"}
        with workspace() as ws:
            for label, identity in bad.items():
                for name, write in writers(ws).items():
                    for position, (caller, key) in (("caller", (identity, "k1")),
                                                    ("key", ("agent", identity))):
                        with self.subTest(identity=label, position=position, function=name):
                            with self.assertRaises((TypeError, ValueError)):
                                write(caller, key, PAYLOAD)
                            self.assertEqual(counts(ws), EMPTY)

    def test_a_mode_not_exactly_one_of_modes_is_refused_with_nothing_stored(self):
        # A str subclass could compare equal to anything and reach the table's CHECK.
        anything = type("Anything", (str,), {"__eq__": lambda self, other: True,
                                             "__hash__": str.__hash__})
        with workspace() as ws:
            for mode in ("other", None, anything("idempotent"), anything("x")):
                with self.subTest(mode=mode), self.assertRaises(ValueError):
                    reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, now=0, mode=mode)
                self.assertEqual(counts(ws), EMPTY)

    def test_size_limits_are_inclusive_payload_in_utf8_bytes_identity_in_characters(self):
        filler = MAX_PAYLOAD_BYTES - len('{"a":""}')
        self.assertEqual(len(reliability.canonical({"a": "x" * filler})[0].encode()),
                         MAX_PAYLOAD_BYTES)
        with self.assertRaises(ValueError):
            reliability.canonical({"a": "x" * (filler + 1)})
        # 4 UTF-8 bytes each, still allowed.
        longest = "𝄞" * reliability.MAX_IDENTITY_LENGTH
        with workspace() as ws:
            receive(ws, payload={"a": "x" * filler})
            receive(ws, longest, caller=longest)
            self.assertEqual(enqueue(ws, longest, caller=longest), "accepted")
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1, tickets=2, receipts=2))

    def test_large_ints_are_charged_no_more_than_their_digits_so_a_payload_that_fits_passes(self):
        # 10**18 is 19 digits: 3,270 of them with their commas take 65,400 of the 65,536 bytes.
        payload = {"n": [10 ** 18] * 3270}
        text, _ = reliability.canonical(payload)
        self.assertEqual(len(text.encode()), 65407)
        with workspace() as ws:
            self.assertEqual(receive(ws, payload=payload)["ticket_id"], 1)

    def test_an_int_that_a_default_cpython_cannot_read_back_is_refused_with_nothing_stored(self):
        # As on Python 3.9 and 3.10, or in a process that lifted the limit of int digits.
        if hasattr(sys, "set_int_max_str_digits"):
            self.addCleanup(sys.set_int_max_str_digits, sys.get_int_max_str_digits())
            sys.set_int_max_str_digits(0)
        # 4300 digits, CPython 3.11+'s default limit, pass.
        for number in (10 ** 4300 - 1, -(10 ** 4300 - 1), 2 ** 14284):
            self.assertLessEqual(len(reliability.canonical({"n": number})[0]), 4307)
        with workspace() as ws:
            for number in (10 ** 4300, -(10 ** 4300), 10 ** 5000):
                with self.subTest(bits=number.bit_length()), self.assertRaises(ValueError):
                    enqueue(ws, payload={"n": number})
            self.assertEqual(counts(ws), EMPTY)

    def test_a_payload_nested_too_deeply_is_a_value_error_before_any_transaction(self):
        self.assertEqual(reliability.MAX_PAYLOAD_DEPTH, 32)

        # A payload of exactly ``levels`` nested objects and lists.
        def nested(levels):
            value = []
            for _ in range(levels - 2):
                value = [value]
            return {"x": value}
        with workspace() as ws:
            for levels in (33, 991, 100000):
                # Built once: 100,000 levels take a while.
                payload = nested(levels)
                for name, write in writers(ws).items():
                    with self.subTest(levels=levels, function=name), self.assertRaises(ValueError):
                        write("agent", "k1", payload)
            self.assertEqual(counts(ws), EMPTY)
            # A cycle is endless nesting.
            looped = {"x": []}
            looped["x"].append(looped)
            with self.assertRaises(ValueError):
                reliability.canonical(looped)
            # The deepest payload accepted goes all the way: claimed, sent, answered, acknowledged.
            self.assertEqual(enqueue(ws, payload=nested(32)), "accepted")
            ws.close()
            result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher())
            self.assertEqual(result["acknowledged"], True)
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("done", 1), 1))

    def test_a_lone_surrogate_is_refused_before_the_transaction_begins(self):
        with workspace() as ws:
            statements = []
            ws.receiver.set_trace_callback(statements.append)
            for bad in ({"a": "\ud800"}, {"\udc00": 1}):
                with self.subTest(payload=bad), self.assertRaises(ValueError):
                    receive(ws, payload=bad)
            with self.assertRaises(ValueError):
                receive(ws, "k\ud800")
            ws.receiver.set_trace_callback(None)
            self.assertEqual(statements, [], "not even BEGIN IMMEDIATE")

    def test_a_payload_of_many_shared_values_is_refused_before_it_is_encoded(self):
        # 2 ** 25 values to walk, 26 levels deep, each no more than a pointer to the last.
        shared = []
        for _ in range(25):
            shared = [shared, shared]
        # One object each, written 60,000 times.
        text, number = "x" * 20000, 10 ** 4000
        payloads = {"shared lists": {"x": shared}, "a shared string": {"a": [text] * 60000},
                    "a shared int": {"a": [number] * 60000},
                    "a shared long key": {"a": [{"k" * 20000: 0}] * 30000},
                    "one long list": {"a": [0] * (MAX_PAYLOAD_BYTES // 2)},
                    "a few long strings": {"a": ["x" * 20000] * 4},
                    "a few long ints": {"a": [10 ** 4000] * 30},
                    "a few long keys": {"a": [{"k" * 20000: 0}] * 4},
                    "a shared long list": {"a": [[0] * 100000] * 30000}}
        # Counted as walked, each value's fewest bytes each time it is met.
        for label, payload in payloads.items():
            with self.subTest(label), mock.patch.object(reliability, "_dumps",
                                                        side_effect=AssertionError("encoded")):
                with self.assertRaisesRegex(ValueError, "exceeds 65536 bytes"):
                    reliability.canonical(payload)
        self.assertEqual(len(reliability.canonical({"a": [0] * (MAX_PAYLOAD_BYTES // 2 - 4)})[0]),
                         MAX_PAYLOAD_BYTES - 1)


class UntrustedRecordsAreRefusedNeverActedOn(unittest.TestCase):
    """§3: a receipt or an intent that cannot be trusted is refused, never acted on, and does
    not hold back the rows behind it."""

    def test_corrupt_receipt_makes_receive_raise_and_creates_no_ticket(self):
        tampering = {
            "receipt ticket_id not an int": "UPDATE receipts SET ticket_id = 'one'"
                                            " WHERE key = :key",
            "receipt points at another ticket": "UPDATE receipts SET ticket_id ="
                                                " (SELECT id FROM tickets WHERE key = 'other')"
                                                " WHERE key = :key",
            "ticket caller edited": "UPDATE tickets SET caller = 'mallory' WHERE key = :key",
            "ticket key edited": "UPDATE tickets SET key = 'elsewhere' WHERE key = :key",
            "ticket digest edited": "UPDATE tickets SET digest = 'x' WHERE key = :key",
            "ticket payload edited": "UPDATE tickets SET payload = '{}' WHERE key = :key",
            "ticket payload not UTF-8": "UPDATE tickets SET payload = CAST(x'ff' AS TEXT)"
                                        " WHERE key = :key",
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
                    # And again: the refusal does not wear off.  A receipt whose ticket
                    # disagrees with it (caller, key, digest) is corrupt before anything else,
                    # so another payload gets no Conflict from it.
                    agrees = "payload" in label
                    for payload in (PAYLOAD, PAYLOAD) + (() if agrees else (OTHER_PAYLOAD,)):
                        with self.assertRaises(CorruptRecord):
                            receive(ws, key, payload)
                    self.assertEqual(rows(ws.receiver, "tickets"), before)
            # An edited receipt digest no longer matches its ticket: corrupt as well.
            receive(ws, "last")
            ws.receiver.execute("UPDATE receipts SET digest = 'x' WHERE key = 'last'")
            before = rows(ws.receiver, "tickets")
            with self.assertRaises(CorruptRecord):
                receive(ws, "last")
            self.assertEqual(rows(ws.receiver, "tickets"), before)

    def test_a_corrupt_intent_is_blocked_never_sent_and_the_next_row_goes_out(self):
        text, digest = reliability.canonical(PAYLOAD)
        # What another program could write: too deep for any JSON parser.
        deep = "[" * 5000 + "]" * 5000
        # column: value, each as another program might store it ("both": with its own digest).
        tampering = {
            "payload replaced": ("payload", json.dumps(OTHER_PAYLOAD)),
            "invalid JSON": ("payload", '{"title": "打印机'),
            "JSON but not an object": ("payload", "[1, 2]"),
            "NaN literal": ("payload", '{"a": NaN}'), "digest replaced": ("digest", "0" * 64),
            "payload as BLOB": ("payload", text.encode("utf-8")),
            "digest as BLOB": ("digest", digest.encode()), "payload not UTF-8": ("payload", None),
            "payload too deep": ("payload", deep),
            "deep payload with its own digest": ("both", deep),
            "keys out of order": ("both", '{"b":1,"a":2}'), "spaces": ("both", '{"a": 1}'),
            "NaN": ("both", '{"a":NaN}'), "a lone surrogate": ("both", '{"a":"\\ud800"}'),
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
                        ws.sender.execute("UPDATE requests SET payload = CAST(x'ff7b7d' AS TEXT)"
                                          " WHERE key = ?", (key,))
                    elif column == "both":
                        own = hashlib.sha256(value.encode()).hexdigest()
                        ws.sender.execute("UPDATE requests SET payload = ?, digest = ?"
                                          " WHERE key = ?", (value, own, key))
                    elif column == "attempts":
                        ws.sender.execute("UPDATE outbox SET attempts = ? WHERE key = ?",
                                          (value, key))
                    else:
                        ws.sender.execute(f"UPDATE requests SET {column} = ? WHERE key = ?",
                                          (value, key))
                    self.assertEqual(reliability.claim(ws.sender, 0)["key"], key + "/next",
                                     "not held back")
                    self.assertEqual(state(ws, key),
                                     ("blocked", value if column == "attempts" else 0))
                    self.assertIn("corrupt intent", outbox(ws, key)["response"]["error"])
            # None from dispatch: no child was started for the one due row, a corrupt one.
            enqueue(ws, "last")
            ws.sender.execute("UPDATE requests SET payload = 'garbage' WHERE key = 'last'")
            self.assertIsNone(reliability.dispatch(ws.sender, ws.root, 0))
            self.assertEqual(state(ws, "last"), ("blocked", 0))
            self.assertEqual(counts(ws), dict(EMPTY, requests=2 * len(tampering) + 1,
                                              outbox=2 * len(tampering) + 1))

    def test_rows_outside_what_enqueue_stores_are_blocked_at_once_with_their_reason(self):
        # column, value: what another program could leave; the reason claim() gives.
        damaged = {"an empty key": ("key", "", "key must have 1 to 200 characters"),
                   "a key of 201 characters": ("key", "k" * 201, "key must have 1 to 200"),
                   "a caller of 100,000 characters": ("caller", "c" * 100000,
                                                      "caller must have 1 to 200"),
                   "issued at -5": ("issued_at", -5, "issued_at must be an int tick from 0"),
                   "issued at as text": ("issued_at", "five", "issued_at must be an int tick"),
                   "-5 attempts": ("attempts", -5, "attempts must be an int from 0")}
        with workspace() as ws:
            for label, (column, value, reason) in damaged.items():
                with self.subTest(label):
                    key = f"{label}/k"
                    enqueue(ws, key)
                    enqueue(ws, key + "/good")
                    if column in ("key", "caller"):
                        # Both tables, as another program without foreign keys would: the outbox
                        # row keeps its request.
                        ws.sender.execute("PRAGMA foreign_keys=OFF")
                        for table in ("requests", "outbox"):
                            ws.sender.execute(f"UPDATE {table} SET {column} = ? WHERE key = ?",
                                              (value, key))
                        ws.sender.execute("PRAGMA foreign_keys=ON")
                        key = value if column == "key" else key
                    else:
                        table = "requests" if column == "issued_at" else "outbox"
                        ws.sender.execute(f"UPDATE {table} SET {column} = ? WHERE key = ?",
                                          (value, key))
                    self.assertEqual(reliability.claim(ws.sender, 0)["attempt"], 1,
                                     "the good row behind it goes out")
                    parked = ws.sender.execute("SELECT state, attempts, response FROM outbox"
                                               " WHERE key = ?", (key,)).fetchone()
                    self.assertEqual(parked[:2], ("blocked", -5 if column == "attempts" else 0))
                    self.assertIn(f"corrupt intent: {reason}", json.loads(parked[2])["error"])
            while reliability.claim(ws.sender, 1000) is not None:
                pass
            self.assertEqual(ws.sender.execute("SELECT count(*) FROM outbox WHERE state ="
                                               " 'blocked' AND attempts < 1").fetchone()[0],
                             len(damaged), "none of them is ever sent")

    def test_a_re_spaced_payload_unanswered_max_attempts_times_is_blocked_as_corrupt_intent(self):
        # The stronger reason: its request is not what enqueue() stored.
        with workspace() as ws:
            enqueue(ws)
            for attempt in range(MAX_ATTEMPTS):
                reliability.claim(ws.sender, attempt * LEASE_TICKS)
            ws.sender.execute("UPDATE requests SET payload = ?",
                              (json.dumps(PAYLOAD, ensure_ascii=False),))
            self.assertIsNone(reliability.claim(ws.sender, MAX_ATTEMPTS * LEASE_TICKS))
            self.assertEqual(state(ws), ("blocked", MAX_ATTEMPTS))
            self.assertEqual(outbox(ws)["response"]["error"], "corrupt intent: not the text,"
                             " payload and digest enqueue() stores")

    def test_an_external_attempt_past_its_lease_is_unknown_even_with_a_re_spaced_payload(self):
        # It may have reached the tool: unknown, whatever its stored request now looks like.
        with workspace() as ws:
            enqueue(ws, mode="external")
            reliability.claim(ws.sender, 0)
            ws.sender.execute("UPDATE requests SET payload = ?",
                              (json.dumps(PAYLOAD, ensure_ascii=False),))
            self.assertIsNone(reliability.claim(ws.sender, LEASE_TICKS))
            self.assertEqual((state(ws), outbox(ws)["response"]), (("unknown", 1), None))

    def test_a_corrupt_receipt_is_answered_as_such_and_the_sender_blocks_the_row_at_once(self):
        with workspace() as ws:
            enqueue(ws)
            receive(ws)
            # The ticket no longer is what was asked.
            ws.receiver.execute("UPDATE tickets SET payload = '{}'")
            ws.close()
            result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher())
            self.assertEqual((result["exit_code"], result["response"]["error"]), (0, "corrupt"))
            self.assertEqual(state(ws), ("blocked", 1), "at once, not after MAX_ATTEMPTS tries")
            self.assertIn("disagrees with its ticket", outbox(ws)["response"]["message"])
            self.assertIsNone(reliability.claim(ws.sender, 1000))


# === 第一篇 §4: real crashes at the named boundaries, and the command line they run ===

class CrashesAtTheNamedBoundariesAreRecovered(unittest.TestCase):
    """§4 让进程真的死在那道缝里: children exit 73 at a named boundary; what survives is read
    back by a new process, and a replay under the same key ends with one ticket."""

    def test_the_crash_hook_names_exactly_the_boundaries_and_no_function_takes_a_fault(self):
        self.assertEqual(CRASH_EXIT, 73)
        self.assertIsNone(reliability.CRASH_AT)
        called = [node.args[0].value for node in ast.walk(TREE) if isinstance(node, ast.Call)
                  and getattr(node.func, "id", None) == "crash_point"
                  and isinstance(node.args[0], ast.Constant)]
        # The module owns the places; the driver's crash-matrix table names each one once.
        self.assertEqual(set(called), set(run_experiment.BOUNDARIES))
        self.assertEqual({owner for owner, _ in run_experiment.BOUNDARIES.values()},
                         {"enqueue", "dispatch", "receiver", "external",
                          "unsafe_dispatch_mark_before"})
        for name in reliability.__all__:
            function = DEFINITIONS[name]
            if isinstance(function, ast.FunctionDef):
                arguments = function.args
                names = {a.arg for a in arguments.posonlyargs + arguments.args
                         + arguments.kwonlyargs}
                self.assertFalse(names & {"fault", "crash"}, name)

    def test_a_flushed_reply_counts_although_the_receiver_then_exits_73(self):
        with workspace() as ws:
            enqueue(ws)
            result = reliability.dispatch(ws.sender, ws.root, 0,
                                          start=launcher("after_response_write"))
            self.assertEqual((result["exit_code"], result["acknowledged"], result["attempt"]),
                             (CRASH_EXIT, True, 1))
            self.assertEqual(state(ws), ("done", 1))
            self.assertIsNone(reliability.dispatch(ws.sender, ws.root, 11), "done is never resent")
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1, tickets=1, receipts=1))

    def test_a_receiver_dying_before_its_commit_leaves_neither_ticket_nor_receipt(self):
        with workspace() as ws:
            enqueue(ws)
            result = reliability.dispatch(ws.sender, ws.root, 0,
                                          start=launcher("before_receiver_commit"))
            self.assertEqual((result["exit_code"], result["response"]), (CRASH_EXIT, None))
            self.assertEqual((state(ws), counts(ws)["tickets"], counts(ws)["receipts"]),
                             (("inflight", 1), 0, 0))
            ws.close("receiver")
            recovery = reliability.dispatch(ws.sender, ws.root, 11, start=launcher())
            self.assertEqual(recovery["acknowledged"], True)
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("done", 2), 1))

    def test_a_reply_lost_after_the_receivers_commit_is_replayed_with_the_same_ticket(self):
        with workspace() as ws:
            enqueue(ws)
            result = reliability.dispatch(ws.sender, ws.root, 0,
                                          start=launcher("after_receiver_commit"))
            self.assertEqual((result["exit_code"], state(ws), counts(ws)["tickets"]),
                             (CRASH_EXIT, ("inflight", 1), 1))
            ws.close("receiver")
            recovery = reliability.dispatch(ws.sender, ws.root, 11, start=launcher())
            self.assertEqual((recovery["attempt"], recovery["response"]["ticket_id"]), (2, 1))
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("done", 2), 1))

    def test_the_naive_receiver_without_receipts_issues_a_second_ticket_on_the_retry(self):
        with workspace() as ws:
            enqueue(ws)

            first = reliability.dispatch(ws.sender, ws.root, 0,
                                         start=launcher("after_receiver_commit", naive=True))
            self.assertEqual((first["exit_code"], counts(ws)["tickets"]), (CRASH_EXIT, 1))
            ws.close("receiver")
            reliability.dispatch(ws.sender, ws.root, 11, start=launcher(naive=True))
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("done", 2), 2))

    def test_marking_done_before_sending_then_dying_loses_the_task_for_good(self):
        with workspace() as ws:
            enqueue(ws)
            ws.close()
            # The driver's sender child, armed as the driver arms it.
            said = forked(lambda argv: run_experiment.answer(run_experiment.send, argv,
                                                             "after_mark_before_send"),
                          [ws.root, "unsafe_dispatch_mark_before", 0])
            self.assertEqual(said, (CRASH_EXIT, "", "reliability.py: died at"
                                    " after_mark_before_send (exit 73)\n"))
            self.assertIsNone(reliability.dispatch(ws.sender, ws.root, 11))
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("done", 1), 0))

    def test_sender_dying_after_claim_before_ack_or_after_ack_recovers_to_one_ticket(self):
        for boundary, recovered in (("after_claim", ("done", 2)),
                                    ("after_response_before_ack", ("done", 2)),
                                    ("after_ack", ("done", 1))):
            with self.subTest(boundary), workspace() as ws:
                enqueue(ws)
                ws.close()
                code, _, _ = cli("dispatch", ws.path("sender"), ws.root, "--now", 0, "--crash",
                                 boundary)
                self.assertEqual(code, CRASH_EXIT)
                reliability.dispatch(ws.sender, ws.root, 11, start=launcher())
                self.assertEqual((state(ws), counts(ws)["tickets"], counts(ws)["receipts"]),
                                 (recovered, 1, 1))

    def test_a_child_that_times_out_is_killed_and_reaped_and_yields_no_result(self):
        with workspace() as ws:
            enqueue(ws)
            row = reliability.claim(ws.sender, 0)
            child = timed_out_child()
            with mock.patch("subprocess.Popen", return_value=child) as popen:
                self.assertEqual(reliability.call_tool(ws.root, row, timeout=0.5),
                                 (None, None, True))
            self.assertEqual(popen.call_args.args[0][-2:], ["receive", ws.path("receiver")])
            self.assert_killed_and_reaped(child)
        # Through deliver(): an external row becomes unknown, an idempotent one stays in flight.
        for mode, expected in (("external", "unknown"), ("idempotent", "inflight")):
            with self.subTest(mode=mode), workspace() as ws:
                enqueue(ws, mode=mode)
                row = reliability.claim(ws.sender, 0)
                child = timed_out_child()
                with mock.patch("subprocess.Popen", return_value=child):
                    result = reliability.deliver(ws.sender, ws.root, row, timeout=0.5)
                self.assertEqual((result["exit_code"], result["response"], result["acknowledged"]),
                                 (None, None, False))
                self.assert_killed_and_reaped(child)
                self.assertEqual(state(ws), (expected, 1))
                self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))

    def assert_killed_and_reaped(self, child):
        names = [entry[0] for entry in child.mock_calls]
        self.assertEqual(names.count("kill"), 1)
        self.assertEqual(child.communicate.call_args_list[0].kwargs.get("timeout"), 0.5)
        self.assertIn("communicate", names[names.index("kill") + 1:], "reaped after the kill")


class TheCommandLineAnswersInOneUtf8Line(unittest.TestCase):
    """§4: the tool child the module starts, and a reader stepping by hand (the driver's step):
    exit 0, 1, 2 or 73, one line on refusal, UTF-8 whatever the locale, a boundary passed on to
    the tool child."""

    def test_a_step_by_hand_lists_the_functions_and_refuses_bad_usage_in_one_line(self):
        # Printed through sys.stdout: the child flushes it before it exits.
        code, out, _ = cli("--help")
        self.assertEqual(code, 0)
        listed = out.split("FUNCTION: ")[1].strip().split(", ")
        for function in ("init", "enqueue", "claim", "dispatch", "deliver", "snapshot",
                         "reconcile", "resolve", "purge"):
            self.assertIn(function, listed)
        # What answers with no JSON, or is no function, is neither listed nor run.
        for other in ("transaction", "connect", "serve", "tool_child", "Conflict", "Expired"):
            self.assertNotIn(other, listed)
        with workspace() as ws:
            ws.close()
            for argv, said in ((["nothing"], "usage"), (["connect", ws.path("sender")], "usage"),
                               (["Conflict"], "usage"), (["transaction", ws.path("sender")],
                                                          "usage"),
                               (["enqueue", ws.path("sender")], "'caller'"),
                               (["dispatch", ws.path("sender"), ws.root, "--now", 0, "--crash",
                                 "after_commit"], "named boundary")):
                with self.subTest(argv=argv[:1]):
                    code, out, err = cli(*argv)
                    self.assertEqual((code, out, len(err.splitlines())), (2, "", 1 + (
                        said == "usage")), err)
                    self.assertIn(said, err)
            self.assertEqual(counts(ws), EMPTY)

    def test_the_scripts_run_by_a_fresh_interpreter_exit_0_1_2_and_73(self):
        # The real entry points, `python3 -I -S reliability.py TOOL DB` and the driver's step,
        # once per exit code, side by side; the other tests fork them as the driver does.
        request = json.dumps({"caller": "agent", "key": "k1", "payload": PAYLOAD, "issued_at": 0,
                              "now": 0}).encode()
        # The snapshot reads the other workspace, so the crash cannot race it.
        with workspace() as ws, workspace() as other:
            commands = {0: [DRIVER, "reliability", "snapshot", other.path("sender")],
                        1: [SCRIPT, "receive", ws.path("missing")], 2: [SCRIPT, "bogus"],
                        CRASH_EXIT: [SCRIPT, "receive", ws.path("receiver"),
                                     "after_receiver_commit"]}
            fresh = [[sys.executable, "-I", "-S", *argv] for argv in commands.values()]
            done = run_together(fresh, request + b"\n")
            self.assertEqual([code for code, _, _ in done], list(commands))
            self.assertEqual(json.loads(done[0][1]),
                             {"intent_rows": 0, "outbox": [], "parked": [], "resolutions": []})
            self.assertTrue(done[1][2].startswith(b"reliability.py receive: "), done[1][2])
            self.assertTrue(done[2][2].startswith(b"usage: "), done[2][2])
            self.assertEqual((done[3][1], counts(ws)["tickets"]), (b"", 1),
                             "committed, then died before replying")

    def test_a_tool_child_given_a_malformed_request_fails_with_one_line_and_stores_nothing(self):
        complete = {"caller": "agent", "key": "k1", "payload": PAYLOAD, "issued_at": 0, "now": 0}
        lines = {"not JSON": b"not json\n", "not UTF-8": b"\xff\n", "a list": b"[]\n",
                 "nested 100,000 deep": b"[" * 100000 + b"]" * 100000 + b"\n"}
        for field in complete:
            without = {name: value for name, value in complete.items() if name != field}
            lines[f"without {field}"] = json.dumps(without).encode() + b"\n"
        with workspace() as ws:
            for label, line in lines.items():
                with self.subTest(label):
                    code, out, err = forked(reliability.tool_child,
                                            ["receive", ws.path("receiver")], stdin=line)
                    self.assertEqual((code, out), (1, ""))
                    self.assertEqual(len(err.splitlines()), 1, err)
                    self.assertTrue(err.startswith("reliability.py receive: "), err)
            self.assertEqual(counts(ws), EMPTY)

    def test_the_command_line_refuses_a_repeated_key_or_json_nested_too_deeply_in_one_line(self):
        with workspace() as ws:
            ws.close()
            for payload, said in (('{"x": 1, "x": 2}', "repeats a key"),
                                  ("[" * 50000 + "]" * 50000, "nests too deeply")):
                with self.subTest(said):
                    code, out, err = cli("enqueue", ws.path("sender"), "agent", "k1", payload,
                                         "--now", 0)
                    self.assertEqual((code, out, len(err.splitlines())), (1, "", 1))
                    self.assertIn(said, err)
            self.assertEqual(counts(ws), EMPTY)

    def test_stored_json_nested_too_deeply_is_blocked_unsent_and_shown_as_text(self):
        # What another program could store.
        deep = "[" * 100000 + "]" * 100000
        with workspace() as ws:
            enqueue(ws)
            reliability.claim(ws.sender, 0)
            ws.close()
            with raw(ws.path("sender")) as tamper:
                tamper.execute("UPDATE requests SET payload = ?", (deep,))
                tamper.execute("UPDATE outbox SET response = ?", (deep,))
            # A reader sees it, as the text it is.
            code, out, err = cli("snapshot", ws.path("sender"))
            self.assertEqual((code, err), (0, ""))
            self.assertEqual(json.loads(out)["outbox"][0]["response"], deep)
            code, out, err = cli("dispatch", ws.path("sender"), ws.root, "--now", 11)
            self.assertEqual((code, out, err), (0, "null\n", ""))
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("blocked", 1), 0))
            self.assertIn("corrupt intent: maximum recursion depth",
                          outbox(ws)["response"]["error"])

    def test_the_tool_childs_command_line_refuses_what_it_does_not_serve(self):
        with workspace() as ws:
            for argv in ([], ["nothing", ws.path("receiver")], ["receive"],
                         ["receive", ws.path("receiver"), "after_claim", "more"]):
                with self.subTest(argv=argv[:1]):
                    code, out, err = forked(reliability.tool_child, argv)
                    self.assertEqual((code, out), (2, ""))
                    self.assertTrue(err.startswith("usage: "), err)
            self.assertEqual(counts(ws), EMPTY)

    def test_a_process_armed_at_a_boundary_passes_it_on_to_its_tool_child(self):
        with workspace() as ws:
            enqueue(ws)
            ws.close()
            dispatch = ("dispatch", ws.path("sender"), ws.root, "--now")
            code, out, err = cli(*dispatch, 0, "--crash", "after_receiver_commit")
            line = json.loads(out)
            self.assertEqual((code, line["exit_code"], line["status"]),
                             (0, CRASH_EXIT, "inflight"))
            self.assertEqual(err, "reliability.py: died at after_receiver_commit (exit 73)\n")
            # An external tool's boundary, passed on to the receiver, which never meets it.
            code, out, err = cli(*dispatch, 11, "--crash", "before_external_effect")
            self.assertEqual((code, json.loads(out)["status"]), (0, "done"))
            self.assertEqual(err, "run_experiment.py reliability dispatch: before_external_effect"
                                  " was not reached\n")
            # The sender's own boundary, never met when nothing is due.
            code, out, err = cli(*dispatch, 12, "--crash", "after_ack")
            self.assertEqual((code, out), (0, "null\n"))
            self.assertIn("after_ack was not reached", err)

    def test_a_row_whose_identity_is_not_text_is_parked_and_snapshot_names_it_and_why(self):
        for label, column, value in (("caller not UTF-8", "caller", "CAST(x'61ff' AS TEXT)"),
                                     ("key as a BLOB", "key", "x'6b31'")):
            with self.subTest(label), workspace() as ws:
                enqueue(ws)
                enqueue(ws, "k2")
                ws.close()
                # Both tables: the outbox row keeps its request.
                with raw(ws.path("sender")) as tamper:
                    tamper.execute(f"UPDATE requests SET {column} = {value} WHERE key = 'k1'")
                    tamper.execute(f"UPDATE outbox SET {column} = {value} WHERE key = 'k1'")
                code, out, err = cli("dispatch", ws.path("sender"), ws.root, "--now", 0)
                line = json.loads(out)
                self.assertEqual((code, err, line["key"], line["status"]), (0, "", "k2", "done"))
                code, out, err = cli("snapshot", ws.path("sender"))
                parked = json.loads(out)["parked"]
                shown = ("a\\xff", "k1") if column == "caller" else ("agent", "k1")
                self.assertEqual((code, err), (0, ""))
                self.assertEqual([(row["caller"], row["key"], row["state"]) for row in parked],
                                 [(*shown, "blocked")])
                self.assertIn("corrupt intent", parked[0]["reason"])
                self.assertEqual(counts(ws)["tickets"], 1)

    def test_snapshot_names_exactly_the_unknown_and_blocked_rows_with_their_reasons(self):
        with workspace() as ws:
            enqueue(ws, "old", mode="external")
            reliability.claim(ws.sender, 0)
            # "old" is unknown: its lease ended.
            reliability.claim(ws.sender, 10)
            enqueue(ws, "ext", mode="external", now=20)
            enqueue(ws, "mine", now=20)
            enqueue(ws, "twice", now=20)
            # Another payload's receipt under "twice": the receiver refuses it for good.
            ws.receiver.execute("INSERT INTO tickets VALUES (99, 'agent', 'twice', 'x', '{}')")
            ws.receiver.execute("INSERT INTO receipts VALUES ('agent', 'twice', 'x', 99, 0)")
            ws.close("receiver", "external")
            for crash in ("before_external_effect", None, None):
                reliability.dispatch(ws.sender, ws.root, 20, start=launcher(crash))
            seen = reliability.snapshot(ws.sender)
            self.assertEqual([(row["key"], row["state"]) for row in seen["outbox"]],
                             [("old", "unknown"), ("ext", "unknown"), ("mine", "done"),
                              ("twice", "blocked")])
            reasons = {row["key"]: (row["state"], row["reason"]) for row in seen["parked"]}
            self.assertEqual(sorted(reasons), ["ext", "old", "twice"])
            self.assertIn("may have acted", reasons["old"][1])
            self.assertEqual(reasons["old"], reasons["ext"])
            self.assertTrue(reasons["twice"][1].startswith("conflict "), reasons["twice"])

    def test_a_locale_without_utf8_does_not_garble_a_chinese_key_in_either_mode(self):
        # Not LC_ALL=C alone: by default C means UTF-8 and would prove nothing (see LEGACY).
        probe = subprocess.run([sys.executable, *LEGACY[0], "-c",
                                "import sys; print(sys.stdin.encoding, sys.stdout.encoding)"],
                               env=LEGACY[1], stdin=subprocess.DEVNULL, capture_output=True,
                               check=True)
        self.assertEqual(probe.stdout.strip(), b"iso8859-1 iso8859-1", "really not UTF-8")
        for mode, database in (("idempotent", "receiver"), ("external", "external")):
            with self.subTest(mode=mode), workspace() as ws:
                payload = {"title": "打印机卡纸", "备注": "三楼"}
                enqueue(ws, "工单-1", payload, mode=mode)
                result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher(legacy=True))
                self.assertEqual((result["exit_code"], result["acknowledged"]), (0, True))
                self.assertEqual(state(ws, "工单-1"), ("done", 1))
                tickets = getattr(ws, database).execute("SELECT key, payload FROM tickets")
                self.assertEqual(tickets.fetchall(), [("工单-1", reliability.canonical(payload)[0])])

    def test_the_command_line_reads_and_prints_utf8_whatever_the_locale(self):
        # Typed in a C locale, non-ASCII arguments reach Python as surrogates: read as the UTF-8
        # typed.
        with workspace() as ws:
            ws.close()
            legacy = lambda *argv: [sys.executable, *LEGACY[0], DRIVER, "reliability",
                                    *map(str, argv)]
            [(code, out, err)] = run_together(
                [legacy("enqueue", ws.path("sender"), "代理", "工单-1", '{"title": "打印机卡纸"}',
                        "--now", 0)], env=LEGACY[1])
            self.assertEqual((code, out, err), (0, b'"accepted"\n', b""))
            [(code, out, err)] = run_together([legacy("dispatch", ws.path("sender"), ws.root,
                                                      "--now", 0)], env=LEGACY[1])
            self.assertEqual((code, err), (0, b""))
            self.assertEqual(json.loads(out.decode("utf-8"))["response"]["caller"], "代理",
                             "the sender read it right")
            self.assertEqual(outbox(ws, "工单-1", caller="代理")["state"], "done")

    @unittest.skipUnless(os.path.exists("/proc/self/syscall"),
                         "sees where a process waits (Linux /proc)")
    def test_a_tool_child_waiting_for_its_request_stops_in_one_line_on_ctrl_c_or_a_signal(self):
        with workspace() as ws:
            ws.close()
            for label, (stop, background) in STOPS.items():
                with self.subTest(label):
                    done = at_a_terminal([sys.executable, SCRIPT, "receive",
                                          ws.path("receiver")],
                                         lambda pid, screen: sleeps_in_read(pid), stop,
                                         background)
                    self.assertEqual(done, (130, "reliability.py receive: interrupted\n", []))
            self.assertEqual(counts(ws), EMPTY)

    @unittest.skipUnless(os.path.isdir("/proc"), "finds the tool child (Linux /proc)")
    def test_dispatch_stops_in_one_line_on_ctrl_c_or_sigterm_and_kills_its_tool_child(self):
        sigterm = lambda pid: os.kill(pid, signal.SIGTERM)
        for label, stop in (("Ctrl-C", None), ("SIGTERM", sigterm)):
            with self.subTest(label), workspace() as ws:
                enqueue(ws)
                ws.close()
                held = []

                def ready(pid, screen):
                    # Its tool child has read the request and opened receiver.db, where the
                    # write lock taken below keeps it waiting; stopped, it waits for good.
                    for child in children_of(pid):
                        if holds_open(child, ws.path("receiver")):
                            os.kill(child, signal.SIGSTOP)
                            held.append((child, started_at(child),
                                         os.getsid(child) != os.getsid(pid)))
                            return True
                    return False
                try:
                    with raw(ws.path("receiver")) as receiver:
                        receiver.execute("BEGIN IMMEDIATE")
                        done = at_a_terminal([sys.executable, DRIVER, "reliability", "dispatch",
                                              ws.path("sender"), ws.root, "--now", "0"], ready,
                                             stop)
                        receiver.execute("ROLLBACK")
                finally:
                    # Should this test end first (an interrupt), the child it stopped goes too.
                    for child, started, _ in held:
                        if started_at(child) == started:
                            os.kill(child, signal.SIGKILL)
                self.assertEqual(done, (130, "run_experiment.py: interrupted\n", []))
                # In a session of its own, out of the terminal's reach: dispatch killed it.
                child, started, apart = held[0]
                self.assertTrue(apart, "the tool child shares the terminal's session")
                self.assertNotEqual(started_at(child), started, "the tool child lives on")
                self.assertEqual((state(ws), counts(ws)["tickets"]), (("inflight", 1), 0))

    def test_a_tool_child_finds_python_without_path_or_dispatch_says_why_not_in_one_line(self):
        # A shell that exports no PATH (env -i bash) runs python3, found by name, with an empty
        # environment: its sys.executable is empty.
        bare = ["import os, sys", "os.execve(sys.executable, ['python3', *sys.argv[1:]], {})"]
        bare = [sys.executable, "-I", "-S", "-c", "; ".join(bare)]
        probe = subprocess.run(bare + ["-S", "-c", "import sys; print(repr(sys.executable))"],
                               capture_output=True, timeout=WATCHDOG)
        self.assertEqual(probe.stdout, b"''\n")
        with workspace() as ws:
            enqueue(ws)
            enqueue(ws, "k2")
            ws.close()
            dispatch = [DRIVER, "reliability", "dispatch", ws.path("sender"), ws.root, "--now",
                        "0"]
            done = subprocess.run(bare + dispatch, capture_output=True, timeout=WATCHDOG)
            self.assertEqual((done.returncode, done.stderr), (0, b""))
            self.assertEqual(json.loads(done.stdout)["status"], "done")
            if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("unshare")):
                self.skipTest("hides /proc in a mount namespace of its own: needs unshare and"
                              " root")
            # Where /proc is hidden too, nothing proves which program runs: one line says why.
            done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                   'mount -t tmpfs none /proc && exec "$@"', "sh", *bare,
                                   *dispatch], capture_output=True, timeout=WATCHDOG)
            self.assertEqual((done.returncode, done.stdout), (1, b""))
            self.assertEqual(done.stderr.decode("utf-8"), "run_experiment.py reliability dispatch:"
                             " FileNotFoundError: [Errno 2] the Python interpreter is unknown"
                             " (sys.executable is empty): run python3 by its full path, or"
                             " export PATH\n")
            self.assertEqual((state(ws, "k2"), counts(ws)["tickets"]), (("inflight", 1), 1),
                             "claimed, never sent")


# === 第一篇 §5: atomic claims, attempt numbers and leases, with many processes ===

class OneClaimerWinsAndStaleAttemptsChangeNothing(unittest.TestCase):
    """§5 两个工作进程同时醒来: one claimer wins; lease 10, recovery at 11; a stale attempt's
    acknowledgement or refusal changes nothing; eight receivers make one ticket."""

    def test_eight_claimer_processes_released_together_produce_exactly_one_winner(self):
        with workspace() as ws:
            enqueue(ws)
            ws.close()

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
            enqueue(ws)
            ws.close()

            def non_atomic(wait):
                with contextlib.closing(sqlite3.connect(ws.path("sender"), isolation_level=None,
                                                        timeout=WATCHDOG)) as connection:
                    wait()
                    row = connection.execute("SELECT attempts FROM outbox"
                                             " WHERE key = 'k1' AND state = 'pending'").fetchone()
                    # Every claimer looks before any writes: what a start barrier makes happen.
                    wait()
                    if row is None:
                        return None
                    connection.execute("UPDATE outbox SET state = 'inflight', attempts = ?"
                                       " WHERE key = 'k1'", (row[0] + 1,))
                    return row[0] + 1
            winners = [result for result in race(non_atomic) if result is not None]
            self.assertGreater(len(winners), 1)
            self.assertEqual(winners, [1] * 8)

    def test_lease_is_10_ticks_a_claim_at_0_is_reclaimable_at_10_and_recovery_at_11_delivers(self):
        self.assertEqual(LEASE_TICKS, 10)
        with workspace() as ws:
            self.assertIsNone(reliability.claim(ws.sender, 0), "nothing enqueued")
            enqueue(ws)
            first = reliability.claim(ws.sender, 0)
            expected = {"caller": "agent", "key": "k1", "attempt": 1, "mode": "idempotent",
                        "payload": PAYLOAD}
            self.assertEqual({key: first[key] for key in expected}, expected)
            self.assertEqual(outbox(ws)["lease_until"], 10)
            self.assertIsNone(reliability.claim(ws.sender, 9))
            self.assertEqual(state(ws), ("inflight", 1))
            self.assertEqual(reliability.claim(ws.sender, 10)["attempt"], 2)
        # The article's recovery: a sender that died after its claim at tick 0.  Its tool child
        # is started as in production, by start_child: `python3 -I -S reliability.py receive DB`.
        with workspace() as ws:
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
            # A stale attempt, another answer.
            for attempt, answer in ((1, response), (2, other)):
                self.assertIs(reliability.acknowledge(ws.sender, "agent", "k1", attempt, answer),
                              False)
            self.assertEqual((state(ws), outbox(ws)["response"]), (("done", 2), response))

    def test_delivering_attempt_1_after_a_claim_moved_the_row_to_attempt_2_reports_stale(self):
        with workspace() as ws:
            enqueue(ws)
            first = reliability.claim(ws.sender, 0)
            reliability.claim(ws.sender, LEASE_TICKS + 1)
            late = reliability.deliver(ws.sender, ws.root, first, start=launcher())
            self.assertEqual((late["status"], late["acknowledged"], late["response"]["ticket_id"]),
                             ("stale", False, 1))
            self.assertEqual((state(ws), outbox(ws)["response"]), (("inflight", 2), None))

    def test_giving_up_an_attempt_changes_only_that_attempt_and_only_while_in_flight(self):
        refusal = {"error": "conflict", "message": "another payload"}
        with workspace() as ws:
            enqueue(ws)
            first = reliability.claim(ws.sender, 0)
            # Attempt 2 holds the row now.
            reliability.claim(ws.sender, 11)
            # Attempt 1's late refusal.
            reliability.deliver(ws.sender, ws.root, first, start=answering(refusal))
            self.assertEqual((state(ws), outbox(ws)["response"]), (("inflight", 2), None))
            done = receive(ws)
            ws.close("receiver")
            self.assertIs(reliability.acknowledge(ws.sender, "agent", "k1", 2, done), True)
            reliability.deliver(ws.sender, ws.root, dict(first, attempt=2),
                                start=answering(refusal))
            self.assertEqual((state(ws), outbox(ws)["response"]), (("done", 2), done))

    def test_forged_or_mismatched_responses_raise_and_never_mark_done(self):
        with workspace() as ws:
            enqueue(ws)
            good = receive(ws)
            attempt = reliability.claim(ws.sender, 0)["attempt"]
            forged = {
                "wrong key": dict(good, key="k2"), "wrong caller": dict(good, caller="mallory"),
                "wrong digest": dict(good, digest=reliability.canonical(OTHER_PAYLOAD)[1]),
                "True as ticket_id": dict(good, ticket_id=True),
                "0 as ticket_id": dict(good, ticket_id=0),
                "negative ticket_id": dict(good, ticket_id=-1),
                "float ticket_id": dict(good, ticket_id=1.0),
                "str ticket_id": dict(good, ticket_id="1"), "extra field": dict(good, status="ok"),
                "missing field": {k: v for k, v in good.items() if k != "digest"},
                "conflict report": {"error": "conflict", "message": "x"}, "list": [good],
                "None": None, "JSON text": json.dumps(good),
            }
            for label, response in forged.items():
                with self.subTest(response=label):
                    with self.assertRaises(ValueError):
                        reliability.acknowledge(ws.sender, "agent", "k1", attempt, response)
                    with self.assertRaises(ValueError):
                        reliability.check_response(response, "agent", "k1", good["digest"])
                    self.assertEqual((outbox(ws)["state"], outbox(ws)["response"]),
                                     ("inflight", None))
            with self.assertRaises(ValueError, msg="a request never made"):
                reliability.acknowledge(ws.sender, "agent", "k2", attempt, dict(good, key="k2"))
            # Bad input, and a response that cannot answer the request, raise before BEGIN.
            statements = []
            ws.sender.set_trace_callback(statements.append)
            bad = [("agent", "k1", True, good), ("agent", "k1", "1", good),
                   ("agent", "k1", 1.0, good), ("agent", "k1", 0, good),
                   ("agent\ud800", "k1", attempt, good),
                   ("agent", "k1", attempt, dict(good, caller="mallory"))]
            # A bad caller or key, named by the response too: refused for what it is.
            long = "x" * (reliability.MAX_IDENTITY_LENGTH + 1)
            bad += [(caller, key, attempt, dict(good, caller=caller, key=key))
                    for caller, key in (("", "k1"), (long, "k1"), ("agent", ""),
                                        ("agent", long))]
            for caller, key, number, response in bad:
                with self.subTest(caller=caller, attempt=number), self.assertRaises(ValueError):
                    reliability.acknowledge(ws.sender, caller, key, number, response)
            ws.sender.set_trace_callback(None)
            self.assertEqual(statements, [])
            self.assertIs(reliability.acknowledge(ws.sender, "agent", "k1", attempt, good), True)

    def test_same_key_other_payload_at_the_receiver_blocks_the_row_keeps_the_first_ticket(self):
        with workspace() as ws:
            original = receive(ws, payload=OTHER_PAYLOAD)
            receipts = rows(ws.receiver, "receipts")
            enqueue(ws)
            ws.close("receiver")
            result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher())
            self.assertEqual((result["exit_code"], result["acknowledged"],
                              result["response"]["error"]), (0, False, "conflict"))
            self.assertEqual(state(ws), ("blocked", 1))
            self.assertIsNone(reliability.claim(ws.sender, 1000))
            self.assertEqual(rows(ws.receiver, "receipts"), receipts)
            self.assertEqual(receive(ws, payload=OTHER_PAYLOAD), original)

    def test_eight_receiver_processes_on_one_request_make_one_ticket_one_receipt_one_answer(self):
        with workspace() as ws:
            def receiver(wait):
                with contextlib.closing(reliability.connect(ws.path("receiver"))) as connection:
                    wait()
                    shared = written(lambda: receive_on(connection, "shared"))
                    # And each writes its own keys while the others do.
                    for i in range(10):
                        written(lambda: receive_on(connection, f"{os.getpid()}-{i}", {"i": i}))
                return shared
            answers = race(receiver)
            self.assertEqual(len({json.dumps(answer, sort_keys=True) for answer in answers}), 1)
            self.assertEqual(answers[0]["ticket_id"], ws.receiver.execute(
                "SELECT ticket_id FROM receipts WHERE key = 'shared'").fetchone()[0])
            self.assertEqual(ws.receiver.execute(
                "SELECT count(*) FROM tickets WHERE key = 'shared'").fetchone()[0], 1)
            self.assertEqual(counts(ws), dict(EMPTY, tickets=81, receipts=81))
            self.assertEqual(integrity(ws), INTACT)


class ManyAgentsKilledAtOnceLoseNothing(unittest.TestCase):
    """§5, with many agents on one machine: processes open, write, close and checkpoint one
    receiver.db at once while some are SIGKILLed, and every open succeeds and nothing is lost."""

    def test_agents_opening_writing_closing_and_killed_at_once_lose_nothing_and_all_connect(self):
        # The next test runs this one again with /proc hidden: nothing here may need it.
        self.assertFalse(os.environ.get("PROC_HIDDEN") and os.path.exists("/proc/self"))
        with workspace() as ws:
            database, folder = ws.path("receiver"), ws.root
            ws.close()
            results = race(functools.partial(many_agents, agent_receives, database, folder),
                           MANY_AGENTS, may_die=True)
            self.assertEqual([r for r in results if r not in ("done", None)], [])
            self.assertIn(None, results, "the seed kills some agents, each by SIGKILL")
            answers = {}
            for index in range(MANY_AGENTS):
                with open(os.path.join(folder, f"agent-{index}"), "rb") as journal:
                    for line in journal.read().splitlines():
                        answer = json.loads(line)
                        answers.setdefault(answer["key"], set()).add(answer["ticket_id"])
            receipts = dict(ws.receiver.execute("SELECT key, ticket_id FROM receipts"))
            tickets = dict(ws.receiver.execute("SELECT id, key FROM tickets"))
            # Every answer an agent was given is committed: one ticket per key, named by its
            # receipt.
            self.assertEqual({key: ids for key, ids in answers.items()
                              if ids != {receipts.get(key)}}, {})
            self.assertEqual(sorted(tickets), sorted(receipts.values()))
            self.assertEqual({tickets[ticket] for ticket in receipts.values()}, set(receipts))
            self.assertEqual(integrity(ws), INTACT)

    @unittest.skipUnless(hasattr(os, "geteuid") and os.geteuid() == 0
                         and shutil.which("unshare"),
                         "hides /proc in a mount namespace of its own: needs unshare and root")
    def test_the_same_with_proc_hidden_as_in_a_container_without_it(self):
        # In a mount namespace of its own, so that no other process loses /proc.
        module = os.path.splitext(os.path.basename(__file__))[0]
        test = (f"{module}.{type(self).__name__}.test_agents_opening_writing_closing_and_killed_"
                "at_once_lose_nothing_and_all_connect")
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               'mount -t tmpfs none /proc && exec "$0" -m unittest "$1"',
                               sys.executable, test], cwd=HERE, capture_output=True,
                              env=dict(os.environ, PROC_HIDDEN="1"), timeout=WATCHDOG * 4)
        self.assertEqual(done.returncode, 0, done.stderr.decode("utf-8", "replace"))
        self.assertIn(b"Ran 1 test", done.stderr)


# === 第一篇 §6: a tool without idempotency leaves an honest unknown ===

class AToolWithoutIdempotencyLeavesUnknown(unittest.TestCase):
    """§6 接收端不配合时，要敢于留下 unknown: never retried automatically, whatever the tool did;
    only the unsafe retry duplicates its ticket."""

    def test_external_crash_before_or_after_the_effect_is_unknown_exit_73_and_never_retried(self):
        for boundary, tickets in (("before_external_effect", 0), ("after_external_effect", 1)):
            with self.subTest(boundary), workspace() as ws:
                enqueue(ws, mode="external")
                result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher(boundary))
                self.assertEqual((result["exit_code"], result["acknowledged"]),
                                 (CRASH_EXIT, False))
                for now in (11, 1000):
                    self.assertIsNone(reliability.dispatch(ws.sender, ws.root, now))
                self.assertEqual((state(ws), counts(ws)["external"]), (("unknown", 1), tickets))
                self.assertEqual(ws.sender.execute("SELECT payload FROM requests").fetchone()[0],
                                 reliability.canonical(PAYLOAD)[0], "kept for reconciliation")

    def test_an_external_row_is_left_alone_in_its_lease_then_unknown_and_the_queue_moves_on(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            self.assertEqual(reliability.claim(ws.sender, 0)["mode"], "external")
            # Leased until tick 10.
            for now in (0, 5, 9):
                self.assertIsNone(reliability.claim(ws.sender, now))
                self.assertEqual(state(ws), ("inflight", 1))
            enqueue(ws, "k2")
            # The lease has ended: unknown, not resent, and the next row goes out.
            self.assertEqual(reliability.claim(ws.sender, 10)["key"], "k2")
            self.assertEqual(state(ws), ("unknown", 1))
            self.assertEqual(reliability.claim(ws.sender, 1000)["key"], "k2", "never it again")
            self.assertIsNone(reliability.claim(ws.sender, 1000))
            self.assertEqual(state(ws), ("unknown", 1))

    def test_an_external_reply_that_answers_another_request_makes_the_row_unknown(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            row = reliability.claim(ws.sender, 0)
            other = lambda request: {"caller": "agent", "key": "k2", "digest": row["digest"],
                                     "ticket_id": 1}
            result = reliability.deliver(ws.sender, ws.root, row, start=answering(other))
            self.assertEqual((result["exit_code"], result["acknowledged"], result["response"]),
                             (0, False, None))
            self.assertEqual((state(ws), pids(ws)), (("unknown", 1), (None, None)),
                             "it may have acted: never resent")

    def test_an_external_reply_nested_too_deeply_is_no_answer_and_the_row_unknown(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            row = reliability.claim(ws.sender, 0)
            deep = b"[" * 100000 + b"]" * 100000
            result = reliability.deliver(ws.sender, ws.root, row, start=answering(deep))
            self.assertEqual((result["exit_code"], result["response"]), (0, None))
            self.assertEqual(state(ws), ("unknown", 1))

    def test_retrying_an_unknown_call_anyway_duplicates_the_external_ticket(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            reliability.dispatch(ws.sender, ws.root, 0, start=launcher("after_external_effect"))
            answer, code, sent = reliability.unsafe_retry_unknown(ws.sender, ws.root, "agent",
                                                                  "k1", start=launcher())
            self.assertTrue(sent)
            self.assertEqual((code, answer["ticket_id"]), (0, 2))
            self.assertEqual((state(ws), counts(ws)["external"]), (("unknown", 1), 2))


# === beyond 第一篇: leaving unknown, retention, ticks, files and failed system calls ===

class WhoMayStillActIsRecorded(unittest.TestCase):
    """Beyond 第一篇: who may still act for an attempt (its sender and its tool child) is
    recorded, for reconcile(); a delivery that is no longer the attempt's own sends nothing."""

    def test_deliver_records_the_tool_pid_before_sending_and_clears_both_at_unknown(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            row = reliability.claim(ws.sender, 0)
            seen, started = [], []

            # A real child; the database is looked at as its request leaves.
            def observed(argv):
                child = launcher("before_external_effect", started=started)(argv)
                send = child.communicate

                def communicate(input=None, timeout=None):
                    if input is not None:
                        seen.append(pids(ws))
                    return send(input, timeout)
                child.communicate = communicate
                return child
            result = reliability.deliver(ws.sender, ws.root, row, start=observed)
            self.assertEqual(result["exit_code"], CRASH_EXIT)
            self.assertEqual(seen, [(os.getpid(), started[0].pid)])
            self.assertEqual((state(ws), pids(ws)), (("unknown", 1), (None, None)))

    def test_claim_records_its_process_as_owner_and_an_idempotent_delivery_records_no_tool(self):
        with workspace() as ws:
            enqueue(ws)
            # Left over: a claim must replace both.
            set_pids(ws, 1, 1)
            row = reliability.claim(ws.sender, 0)
            self.assertEqual(pids(ws), (os.getpid(), None))
            reliability.deliver(ws.sender, ws.root, row, start=launcher("before_receiver_commit"))
            self.assertEqual((state(ws), pids(ws)), (("inflight", 1), (os.getpid(), None)))

    def test_a_late_deliver_sends_nothing_for_an_external_row_that_is_no_longer_its_own(self):
        with workspace() as ws:
            unknown_external(ws)
            # What claim() gave attempt 1.
            row = {"caller": "agent", "key": "k1", "attempt": 1, "mode": "external",
                   "digest": reliability.canonical(PAYLOAD)[1], "payload": PAYLOAD,
                   "issued_at": 0, "now": 0}
            for attempt in (1, 7):
                with self.subTest(attempt=attempt):
                    started = []
                    result = reliability.deliver(ws.sender, ws.root, dict(row, attempt=attempt),
                                                 start=launcher(started=started))
                    self.assertEqual(result["status"], "not sent")
                    self.assertEqual(started[0].returncode, -signal.SIGKILL, "before any request")
            self.assertEqual((state(ws), counts(ws)["external"]), (("unknown", 1), 0))

    def test_a_second_delivery_while_the_attempts_tool_runs_sends_nothing_keeps_its_pids(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            row = reliability.claim(ws.sender, 0)
            # The first delivery's tool child, still running.
            tool = LiveChild(self)
            set_pids(ws, os.getpid(), tool.pid)
            started = []
            result = reliability.deliver(ws.sender, ws.root, row,
                                         start=launcher("before_external_effect", started=started))
            self.assertEqual(result["status"], "not sent")
            self.assertEqual(started[0].returncode, -signal.SIGKILL, "killed before any request")
            self.assertEqual((state(ws), pids(ws), counts(ws)["external"]),
                             (("inflight", 1), (os.getpid(), tool.pid), 0))
            # The expired external row becomes unknown.
            self.assertIsNone(reliability.claim(ws.sender, 11))
            self.assertEqual(reconcile(ws, now=11)["status"], "unknown")
            # Only once the tool is gone may absence count.
            tool.end()
            self.assertEqual(reconcile(ws, now=11)["status"], "pending")


class ReconcileSettlesUnknownOnlyOnEvidence(unittest.TestCase):
    """Beyond 第一篇: unknown is settled from the tool's own records, or sent back to pending
    once nobody can act for the attempt any more; anything less certain stays unknown."""

    def test_one_matching_ticket_makes_the_row_done_with_it_and_creates_none(self):
        with workspace() as ws:
            unknown_external(ws)
            # The tool did act.
            ticket = reliability.external_create_ticket(ws.external, "agent", "k1", PAYLOAD)
            # Even inside the lease.
            self.assertEqual(reconcile(ws, now=0), {"status": "done", "response": ticket})
            self.assertEqual((state(ws), outbox(ws)["response"], counts(ws)["external"]),
                             (("done", 1), ticket, 1))
            self.assertIsNone(reliability.claim(ws.sender, 1000))

    def test_absent_while_the_lease_runs_stays_unknown_and_at_its_end_goes_back_to_pending(self):
        with workspace() as ws:
            unknown_external(ws)
            before = sender_rows(ws)
            self.assertEqual(reconcile(ws, now=9)["status"], "unknown")
            self.assertEqual(sender_rows(ws), before)
            self.assertEqual(reconcile(ws, now=10)["status"], "pending")
            self.assertEqual((state(ws), pids(ws), audit(ws)), (("pending", 1), (None, None), []))
            ws.close("external")
            retry = reliability.dispatch(ws.sender, ws.root, 11, start=launcher())
            self.assertEqual((retry["attempt"], retry["acknowledged"]), (2, True))
            self.assertEqual((state(ws), counts(ws)["external"]), (("done", 2), 1))

    def test_absent_but_a_live_owner_or_tool_process_keeps_it_unknown_until_that_one_is_gone(self):
        with workspace() as ws:
            for column in ("owner_pid", "tool_pid"):
                unknown_external(ws, key=column)
            for column in ("owner_pid", "tool_pid"):
                with self.subTest(alive=column):
                    child = LiveChild(self)
                    owner, tool = (child.pid, None) if column == "owner_pid" else (None, child.pid)
                    set_pids(ws, owner, tool, key=column)
                    before = sender_rows(ws)
                    self.assertEqual(reconcile(ws, column)["status"], "unknown")
                    self.assertEqual(sender_rows(ws), before)
                    # The same pid, now gone.
                    child.end()
                    self.assertEqual(reconcile(ws, column)["status"], "pending")

    def test_its_own_process_as_owner_counts_as_gone_and_its_live_tool_child_can_act(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            reliability.claim(ws.sender, 0)
            # The lease ended: unknown, its owner still this process.
            self.assertIsNone(reliability.claim(ws.sender, 10))
            self.assertEqual((state(ws), pids(ws)), (("unknown", 1), (os.getpid(), None)))
            # While a tool child this process started for attempt 1 lives, it can still act.
            tool = LiveChild(self)
            set_pids(ws, os.getpid(), tool.pid)
            self.assertEqual(reconcile(ws)["status"], "unknown")
            tool.end()
            self.assertEqual(reconcile(ws)["status"], "pending")
            self.assertEqual((state(ws), pids(ws)), (("pending", 1), (None, None)))

    def test_absence_proven_during_its_own_delivery_stops_that_delivery_sending(self):
        # This process acts for an attempt only through a tool child recorded before it is asked:
        # absence proven before that is safe, since the delivery then sends nothing.
        with workspace() as ws:
            enqueue(ws, mode="external")
            row = reliability.claim(ws.sender, 0)
            seen, started = [], []

            # As the tool child starts, the lease ends, a claim makes the row unknown, and this
            # process reconciles it.
            def start(argv):
                self.assertIsNone(reliability.claim(ws.sender, 10))
                seen.append(reconcile(ws)["status"])
                ws.close("external")
                return launcher(started=started)(argv)
            result = reliability.deliver(ws.sender, ws.root, row, start=start)
            self.assertEqual((seen, result["status"]), (["pending"], "not sent"))
            self.assertEqual(started[0].returncode, -signal.SIGKILL, "killed before any request")
            self.assertEqual((state(ws), counts(ws)["external"]), (("pending", 1), 0))

    def test_reconcile_decides_who_may_still_act_before_it_looks_the_ticket_up(self):
        # Absence proves nothing if a process could still act after the look-up, so who can act
        # is decided first.  Here the tool child ends during the look-up; decided later, it would
        # look gone.
        with workspace() as ws:
            unknown_external(ws)
            tool_child = LiveChild(self)
            set_pids(ws, None, tool_child.pid)
            with reconciling_tool(ws, tool_child.end) as tool:
                self.assertEqual(reconcile(ws, tool=tool)["status"], "unknown")
            self.assertEqual(reconcile(ws)["status"], "pending")

    def test_a_row_settled_or_claimed_again_before_the_lookup_is_left_as_it_landed(self):
        # Each lands just before reconcile() looks the ticket up, with a ticket that would settle
        # the row or with none: a person's decision, or the row in flight or unknown again.
        retried_and_unknown_again = lambda ws: ws.sender.execute(
            "UPDATE outbox SET attempts = 2, owner_pid = NULL")
        landings = {
            "abandoned by a person": (True, lambda ws: reliability.resolve(
                ws.sender, "agent", "k1", "abandon", attempt=1, by="alice",
                why="closed by hand"),
                ("abandoned", 1)),
            "a person's retry": (True, lambda ws: set_state(ws, "pending"), ("pending", 1)),
            "in flight again": (True, lambda ws: set_state(ws, "inflight"), ("inflight", 1)),
            "attempt 2 unknown too": (False, retried_and_unknown_again, ("unknown", 2)),
        }
        for label, (ticket, landing, landed) in landings.items():
            with self.subTest(label), workspace() as ws:
                unknown_external(ws)
                if ticket:
                    reliability.external_create_ticket(ws.external, "agent", "k1", PAYLOAD)
                with reconciling_tool(ws, lambda: landing(ws)) as tool:
                    result = reconcile(ws, tool=tool)
                self.assertEqual((result, state(ws)), ({"status": landed[0], "reason":
                                                        "settled by someone else meanwhile"},
                                                       landed))

    def test_tickets_that_do_not_settle_it_leave_the_row_unknown_even_when_nobody_can_act(self):
        with workspace() as ws:
            for label, payloads in {"two tickets": [PAYLOAD, PAYLOAD],
                                    "other digest": [OTHER_PAYLOAD]}.items():
                with self.subTest(label):
                    unknown_external(ws, key=label)
                    for payload in payloads:
                        reliability.external_create_ticket(ws.external, "agent", label, payload)
                    before = sender_rows(ws)
                    self.assertEqual(reconcile(ws, label)["status"], "unknown")
                    self.assertEqual(sender_rows(ws), before)

    def test_lookup_is_by_reference_so_another_key_or_caller_is_no_evidence(self):
        with workspace() as ws:
            unknown_external(ws)
            reliability.external_create_ticket(ws.external, "agent", "k2", PAYLOAD)
            reliability.external_create_ticket(ws.external, "other", "k1", PAYLOAD)
            self.assertEqual(reliability.lookup_external(ws.external, "agent", "k1"), [])
            self.assertEqual(reconcile(ws)["status"], "pending")
            first = reliability.external_create_ticket(ws.external, "agent", "k3", PAYLOAD)
            second = reliability.external_create_ticket(ws.external, "agent", "k3", OTHER_PAYLOAD)
            self.assertEqual(reliability.lookup_external(ws.external, "agent", "k3"),
                             [first, second], "oldest first")

    def test_a_row_that_is_not_unknown_is_returned_as_is_and_a_bad_request_raises(self):
        with workspace() as ws:
            with self.assertRaises(ValueError):
                reconcile(ws, "missing")
            enqueue(ws, mode="external")
            # It would settle an unknown row.
            reliability.external_create_ticket(ws.external, "agent", "k1", PAYLOAD)
            for row_state in ("pending", "inflight", "done", "blocked", "abandoned"):
                with self.subTest(state=row_state):
                    set_state(ws, row_state)
                    before = sender_rows(ws)
                    self.assertEqual(reconcile(ws)["status"], row_state)
                    self.assertEqual(sender_rows(ws), before)
            set_state(ws, "unknown")
            for now in (-1, True, 1.5, "9", None, reliability.MAX_TICK + 1):
                with self.subTest(now=now), self.assertRaises(ValueError):
                    reconcile(ws, now=now)

    def test_an_external_row_in_flight_inside_its_lease_with_no_ticket_answers_inflight(self):
        with workspace() as ws:
            enqueue(ws, mode="external")
            reliability.claim(ws.sender, 0)
            before = sender_rows(ws)
            self.assertEqual(reconcile(ws, now=5)["status"], "inflight")
            self.assertEqual(sender_rows(ws), before)

    def test_alive_counts_this_process_and_another_users_and_only_a_missing_pid_as_gone(self):
        self.assertTrue(reliability._alive(os.getpid()))
        self.assertFalse(reliability._alive(4194304), "above Linux's pid_max")
        # kill(pid, 0) on another user's process raises PermissionError: it exists, so it may act.
        with self.subTest("asked by another user"):
            if not hasattr(os, "fork"):
                self.skipTest("asks from a forked child of another user")
            self.assertIs(run_experiment.run_forked(alive_as_nobody, os.getpid()), True)


class APersonsDecisionIsAuditedForGood(unittest.TestCase):
    """Beyond 第一篇: a person's decision on unknown or blocked, with an audit row that is never
    rewritten; the command line prints one JSON line, a refusal one line."""

    def evidence(self, ws):
        reliability.external_create_ticket(ws.external, "agent", "k1", PAYLOAD)
        return reliability.lookup_external(ws.external, "agent", "k1")[0]

    def test_done_with_the_tools_response_stores_it_with_one_audit_row(self):
        with workspace() as ws:
            unknown_external(ws)
            evidence = self.evidence(ws)
            self.assertEqual(reliability.resolve(ws.sender, "agent", "k1", "done", attempt=1,
                                                 by="alice", why="seen in the UI",
                                                 evidence=evidence),
                             {"status": "done", "resolution": 1})
            self.assertEqual((outbox(ws)["state"], outbox(ws)["response"]), ("done", evidence))
            self.assertEqual(audit(ws), [(1, "agent", "k1", 1, "done", "alice", "seen in the UI",
                                          reliability._dumps(evidence))])
            self.assertIsNone(reliability.claim(ws.sender, 1000))

    def test_retry_returns_the_row_to_pending_under_the_same_key(self):
        with workspace() as ws:
            unknown_external(ws)
            # A person may decide while a process lives.
            set_pids(ws, os.getpid(), os.getpid())
            self.assertEqual(reliability.resolve(ws.sender, "agent", "k1", "retry", attempt=1,
                                                 by="bob", why="tool shows nothing"),
                             {"status": "pending", "resolution": 1})
            self.assertEqual((outbox(ws)["state"], outbox(ws)["response"], pids(ws)),
                             ("pending", None, (None, None)))
            self.assertEqual(audit(ws),
                             [(1, "agent", "k1", 1, "retry", "bob", "tool shows nothing", None)])
            self.assertEqual(reliability.claim(ws.sender, 0)["attempt"], 2)

    def test_a_row_blocked_after_max_attempts_gets_real_attempts_again_after_retry(self):
        self.assertEqual(MAX_ATTEMPTS, 10)
        with workspace() as ws:
            enqueue(ws)
            for attempt in range(1, MAX_ATTEMPTS + 1):
                claimed = reliability.claim(ws.sender, (attempt - 1) * LEASE_TICKS)
                self.assertEqual(claimed["attempt"], attempt)
            self.assertIsNone(reliability.claim(ws.sender, MAX_ATTEMPTS * LEASE_TICKS))
            self.assertEqual(state(ws), ("blocked", MAX_ATTEMPTS))
            reliability.resolve(ws.sender, "agent", "k1", "retry", attempt=MAX_ATTEMPTS,
                                by="bob", why="the receiver is back")
            result = reliability.dispatch(ws.sender, ws.root, MAX_ATTEMPTS * LEASE_TICKS,
                                          start=launcher())
            self.assertEqual((result["attempt"], result["acknowledged"]), (MAX_ATTEMPTS + 1, True))
            self.assertEqual((state(ws), counts(ws)["tickets"]), (("done", MAX_ATTEMPTS + 1), 1))

    def test_abandon_parks_an_unknown_or_blocked_row_for_good(self):
        with workspace() as ws:
            unknown_external(ws)
            self.assertEqual(reliability.resolve(ws.sender, "agent", "k1", "abandon", attempt=1,
                                                 by="carol", why="not needed"),
                             {"status": "abandoned", "resolution": 1})
            self.assertIsNone(reliability.claim(ws.sender, 1000))
            enqueue(ws, "k2")
            set_state(ws, "blocked", key="k2")
            self.assertEqual(reliability.resolve(ws.sender, "agent", "k2", "abandon", attempt=0,
                                                 by="dan", why="expired"),
                             {"status": "abandoned", "resolution": 2})
            self.assertEqual((outbox(ws)["state"], outbox(ws, "k2")["state"]),
                             ("abandoned", "abandoned"))

    def test_invalid_decisions_are_refused_with_nothing_changed(self):
        with workspace() as ws:
            unknown_external(ws)
            evidence = self.evidence(ws)
            other_payload = reliability.canonical(OTHER_PAYLOAD)[1]
            refused = {
                "done without evidence": dict(decision="done"),
                "retry with evidence": dict(decision="retry", evidence=evidence),
                "abandon with evidence": dict(decision="abandon", evidence=evidence),
                "unknown decision": dict(decision="close"),
                "decision in capitals": dict(decision="DONE", evidence=evidence),
                "no decision": dict(decision=None), "empty by": dict(decision="abandon", by=""),
                "blank by": dict(decision="abandon", by="   "),
                "by not a str": dict(decision="abandon", by=7),
                "by too long": dict(decision="abandon", by="x" * 1001),
                "empty why": dict(decision="abandon", why=""),
                "why None": dict(decision="abandon", why=None),
                "evidence for another key": dict(decision="done",
                                                 evidence=dict(evidence, key="k2")),
                "evidence for another caller": dict(decision="done",
                                                    evidence=dict(evidence, caller="other")),
                "evidence for another payload": dict(
                    decision="done", evidence=dict(evidence, digest=other_payload)),
                "bool ticket id": dict(decision="done", evidence=dict(evidence, ticket_id=True)),
                "evidence with an extra field": dict(decision="done",
                                                     evidence=dict(evidence, status="ok")),
                "an attempt never claimed": dict(decision="abandon", attempt=2),
                "a negative attempt": dict(decision="abandon", attempt=-1),
                "an attempt that is a bool": dict(decision="abandon", attempt=True),
                "an attempt that is a float": dict(decision="abandon", attempt=1.0),
                "no attempt": dict(decision="abandon", attempt=None),
            }
            before = sender_rows(ws)
            for label, arguments in refused.items():
                arguments = dict({"attempt": 1, "by": "alice", "why": "because"}, **arguments)
                with self.subTest(label), self.assertRaises(ValueError):
                    reliability.resolve(ws.sender, "agent", "k1", arguments.pop("decision"),
                                        **arguments)
                self.assertEqual(sender_rows(ws), before)
                self.assertFalse(ws.sender.in_transaction)
            with self.assertRaises(ValueError):
                reliability.resolve(ws.sender, "agent", "missing", "abandon", attempt=0,
                                    by="alice", why="because")
            # Only unknown or blocked rows.
            for row_state in ("pending", "inflight", "done", "abandoned"):
                with self.subTest(state=row_state), self.assertRaises(ValueError):
                    set_state(ws, row_state)
                    reliability.resolve(ws.sender, "agent", "k1", "abandon", attempt=1,
                                        by="alice", why="because")
            self.assertEqual(audit(ws), [])

    def test_a_decision_asked_again_after_a_lost_reply_answers_the_first_with_one_audit_row(
            self):
        with workspace() as ws:
            unknown_external(ws)
            unknown_external(ws, "k2")
            evidence = self.evidence(ws)
            for _ in range(2):
                self.assertEqual(reliability.resolve(ws.sender, "agent", "k1", "done", attempt=1,
                                                     by="alice", why="seen in the UI",
                                                     evidence=dict(evidence)),
                                 {"status": "done", "resolution": 1})
                self.assertEqual(reliability.resolve(ws.sender, "agent", "k2", "retry", attempt=1,
                                                     by="bob", why="nothing there"),
                                 {"status": "pending", "resolution": 2})
            self.assertEqual([row[:5] for row in audit(ws)],
                             [(1, "agent", "k1", 1, "done"), (2, "agent", "k2", 1, "retry")])
            # Another decision, or the same one by another hand, is no replay.
            for decision, by in (("abandon", "bob"), ("retry", "carol")):
                with self.subTest(decision=decision, by=by), self.assertRaisesRegex(
                        ValueError, "^only an unknown or blocked row is resolved by hand"):
                    reliability.resolve(ws.sender, "agent", "k2", decision, attempt=1, by=by,
                                        why="nothing there")
            self.assertEqual(len(audit(ws)), 2)

    def test_a_retry_asked_again_after_a_claim_took_the_row_is_refused_as_moved_on(self):
        # The reply to a retry of attempt 1 is lost; a claim sends attempt 2, and the row is
        # unknown again.  Asked again, the retry of attempt 1 would send attempt 3 nobody
        # decided on: refused, and the row stays as it is.
        with workspace() as ws:
            unknown_external(ws)
            retry = functools.partial(reliability.resolve, ws.sender, "agent", "k1", "retry",
                                      by="bob", why="tool shows nothing")
            self.assertEqual(retry(attempt=1), {"status": "pending", "resolution": 1})
            self.assertEqual(reliability.claim(ws.sender, LEASE_TICKS)["attempt"], 2)
            self.assertIsNone(reliability.claim(ws.sender, 2 * LEASE_TICKS))
            self.assertEqual(state(ws), ("unknown", 2))
            with self.assertRaisesRegex(ValueError, "^the row moved on: a claim took it since"
                                                    " the attempt decided on"):
                retry(attempt=1)
            self.assertEqual((state(ws), len(audit(ws))), (("unknown", 2), 1))
            self.assertIsNone(reliability.claim(ws.sender, 3 * LEASE_TICKS))
            # A decision on the attempt the row is at now is a new one.
            self.assertEqual(retry(attempt=2), {"status": "pending", "resolution": 2})

    def test_the_same_call_once_the_row_left_that_decisions_state_is_refused_not_made_again(
            self):
        # A retry of a corrupt row: claim() blocks it again at the same attempt.  The same call
        # is then neither a replay (the row is not pending) nor a second decision.
        with workspace() as ws:
            enqueue(ws)
            with raw(ws.path("sender")) as tamper:
                tamper.execute("UPDATE requests SET payload = '{\"tampered\":1}'")
            self.assertIsNone(reliability.claim(ws.sender, 0))
            retry = functools.partial(reliability.resolve, ws.sender, "agent", "k1", "retry",
                                      attempt=0, by="bob", why="fixed, I think")
            self.assertEqual(retry(), {"status": "pending", "resolution": 1})
            self.assertIsNone(reliability.claim(ws.sender, 0))
            self.assertEqual(state(ws), ("blocked", 0))
            with self.assertRaisesRegex(ValueError, "^the row moved on since this decision was"
                                                    " recorded"):
                retry()
            self.assertEqual(reliability.resolve(ws.sender, "agent", "k1", "abandon", attempt=0,
                                                 by="bob", why="corrupt"),
                             {"status": "abandoned", "resolution": 2})

    def test_the_audit_row_cannot_be_updated_deleted_or_replaced_even_by_a_raw_connection(self):
        # INSERT OR REPLACE deletes the conflicting row without firing DELETE triggers
        # (recursive_triggers is off), so only the BEFORE INSERT trigger on a taken id stops it.
        with workspace() as ws:
            unknown_external(ws)
            reliability.resolve(ws.sender, "agent", "k1", "abandon", attempt=1, by="carol",
                                why="no longer needed")
            recorded = audit(ws)
            with raw(ws.path("sender")) as tamper:
                for sql in ("UPDATE resolutions SET reason = 'rewritten'",
                            "UPDATE resolutions SET decision = 'retry'", "DELETE FROM resolutions",
                            "INSERT OR REPLACE INTO resolutions (id, caller, key, attempt,"
                            " decision, decided_by, reason) VALUES (1, 'agent', 'k1', 1, 'retry',"
                            " 'mallory', 'rewritten')"):
                    with self.subTest(sql), self.assertRaises(sqlite3.IntegrityError):
                        tamper.execute(sql)
            self.assertEqual(audit(ws), recorded)

    def test_the_command_line_prints_one_json_line_and_a_refusal_exits_1_with_one_line(self):
        with workspace() as ws:
            for key, tick in (("old", 10), ("new", 60)):
                receive(ws, key, now=tick)
            unknown_external(ws)
            ws.close()
            self.assertEqual(cli("purge", ws.path("receiver"), "--now", 100, "--window", 50),
                             (0, '{"deleted":1,"low_water":50}\n', ""))
            resolve = ("resolve", ws.path("sender"), "agent", "k1")
            self.assertEqual(cli(*resolve, "abandon", "--attempt", 1, "--by", "x", "--why", "y"),
                             (0, '{"resolution":1,"status":"abandoned"}\n', ""))
            code, out, err = cli(*resolve, "retry", "--attempt", 1, "--by", "x", "--why", "y")
            self.assertEqual((code, out, len(err.splitlines())), (1, "", 1))
            self.assertTrue(err.startswith("run_experiment.py reliability resolve: "), err)
            # The attempt decided on is required.
            code, out, err = cli(*resolve, "retry", "--by", "x", "--why", "y")
            self.assertEqual((code, out), (2, ""))
            self.assertIn("'attempt'", err)
            self.assertEqual((outbox(ws)["state"], len(audit(ws))), ("abandoned", 1))


class PurgedReceiptsAnswerExpired(unittest.TestCase):
    """Beyond 第一篇 §7: receipts are purged under a low-water mark that never moves back; a late
    request issued before it that finds no receipt is refused as Expired."""

    def receipts(self, ws):
        return ws.receiver.execute("SELECT key, tick FROM receipts ORDER BY key").fetchall()

    def low_water(self, ws):
        return ws.receiver.execute("SELECT low_water FROM retention").fetchone()[0]

    def test_purge_deletes_exactly_the_receipts_older_than_the_window_and_sets_the_mark(self):
        with workspace() as ws:
            for key, tick in (("old", 49), ("edge", 50), ("new", 60)):
                receive(ws, key, issued_at=40, now=tick)
            self.assertEqual(reliability.purge(ws.receiver, 100, 50),
                             {"deleted": 1, "low_water": 50})
            self.assertEqual((self.receipts(ws), self.low_water(ws)),
                             ([("edge", 50), ("new", 60)], 50))
            self.assertEqual(counts(ws)["tickets"], 3, "tickets are the effect: never purged")
            self.assertEqual(reliability.purge(ws.receiver, 150, 100),
                             {"deleted": 0, "low_water": 50})

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

    def test_a_late_request_from_before_the_mark_without_receipt_is_expired_stores_nothing(self):
        with workspace() as ws:
            receive(ws)
            reliability.purge(ws.receiver, 100, 50)
            before = rows(ws.receiver, "tickets"), rows(ws.receiver, "receipts")
            for key, issued_at in (("k1", 0), ("k1", 49), ("k2", 49)):
                with self.subTest(key=key, issued_at=issued_at), self.assertRaises(Expired):
                    receive(ws, key, issued_at=issued_at, now=100)
            self.assertEqual((rows(ws.receiver, "tickets"), rows(ws.receiver, "receipts")), before)
            # At or after the mark: a new ticket.
            response = receive(ws, "k3", issued_at=50, now=100)
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
            self.assertEqual((row["state"], row["attempts"], set(row["response"]),
                              row["response"]["error"]),
                             ("blocked", 1, {"error", "message"}, "expired"))
            self.assertEqual(result["response"], row["response"])
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))


class TicksAreRequiredBoundedAndNeverBackwards(unittest.TestCase):
    """Beyond 第一篇: logical ticks are required, bounded ints that never go backwards, and a row
    issued later than now is not due yet."""

    def test_missing_ticks_are_a_type_error_and_store_nothing(self):
        with workspace() as ws:
            calls = {"enqueue": lambda: reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD),
                     "receive without issued_at": lambda: reliability.receive(
                         ws.receiver, "agent", "k1", PAYLOAD, now=0),
                     "receive without now": lambda: reliability.receive(
                         ws.receiver, "agent", "k1", PAYLOAD, issued_at=0),
                     "claim": lambda: reliability.claim(ws.sender),
                     "dispatch": lambda: reliability.dispatch(ws.sender, ws.root),
                     "reconcile": lambda: reliability.reconcile(ws.sender, ws.external, "agent",
                                                                "k1"),
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
            bad = {"issued after now": (6, 5), "negative": (-1, 5), "bool": (True, 5),
                   "float": (1.0, 5), "str now": (0, "5"), "None now": (0, None),
                   "past MAX_TICK": (0, reliability.MAX_TICK + 1)}
            for label, (issued_at, now) in bad.items():
                # Neither replayed nor stored first.
                for key in ("kept", "new"):
                    with self.subTest(label, key=key), self.assertRaises(ValueError):
                        receive(ws, key, issued_at=issued_at, now=now)
            for now in (-1, True, 1.5, "3", None, 2 ** 63):
                # The tick it was given is named as given.
                with self.subTest(now=now), self.assertRaisesRegex(ValueError, "^now must be"):
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


class AnotherSchemaVersionOrKindIsRefused(unittest.TestCase):
    """Beyond 第一篇: a file of another schema version or kind is refused, naming the path (and
    both versions), and left byte for byte."""

    def test_a_schema_1_file_or_another_kind_or_version_is_refused_and_left_byte_for_byte(self):
        # Schema 1 kept the kind in user_version and no application_id.
        variants = {"schema 1": ("receiver", "application_id = 0", "user_version = 7302"),
                    "another kind": ("sender", "application_id = 4242"),
                    "another version": ("sender", "user_version = 3")}
        for label, (name, *pragmas) in variants.items():
            with self.subTest(label), workspace() as ws:
                path = ws.path(name)
                with raw(path) as tamper:
                    for pragma in pragmas:
                        tamper.execute(f"PRAGMA {pragma}")
                content = file_bytes(path)
                with self.assertRaises(sqlite3.DatabaseError) as caught:
                    reliability.connect(path)
                self.assertIn(path, str(caught.exception))
                if label == "schema 1":
                    self.assertRegex(str(caught.exception), r"schema version 1\b.*\b2\b")
                self.assertEqual(file_bytes(path), content)
                self.assertEqual(sorted(os.listdir(ws.root)), sorted(KINDS), "no -wal or -shm")


@unittest.skipUnless(hasattr(os, "fork") and hasattr(os, "geteuid"),
                     "drops privileges in a forked child")
class UnreadableOrReadOnlyFilesAreRefused(unittest.TestCase):
    """Beyond 第一篇: an unreadable or read-only file or directory is refused, naming the path,
    before anything is written; the kernel decides who may, ACLs included."""

    def test_an_unreadable_or_read_only_file_or_folder_is_refused_naming_it_unchanged(self):
        # label: (directory mode, file mode).  SQLite itself refuses what it cannot open; a file
        # it could only read it would open read-only, and connect() refuses that itself.
        cases = {"unreadable file": (0o777, 0o000), "read-only file": (0o777, 0o444),
                 "read-only directory": (0o555, 0o666), "unsearchable directory": (0o666, 0o666)}
        with tempfile.TemporaryDirectory() as top:
            # Another user may pass through.
            os.chmod(top, 0o755)
            for label, (folder_mode, mode) in cases.items():
                folder = os.path.join(top, label.replace(" ", "-") + fs_name("-数据", "-data"))
                reliability.init(folder)
                path = os.path.join(folder, RECEIVER)
                content = file_bytes(path)
                os.chmod(path, mode)
                os.chmod(folder, folder_mode)
                try:
                    text = run_experiment.run_forked(connect_as_nobody, path)
                finally:
                    # Before the directory is removed, even as a user who is not root.
                    os.chmod(folder, 0o755)
                    os.chmod(path, 0o644)
                with self.subTest(label):
                    self.assertTrue(text.startswith(("PermissionError: ", "OperationalError: ")),
                                    text)
                    self.assertIn(path, text)
                    self.assertEqual(file_bytes(path), content)
                    self.assertEqual(sorted(os.listdir(folder)), sorted(KINDS), "no -wal, -shm")

    @unittest.skipUnless(os.geteuid() == 0, "the test becomes another user, which needs root")
    def test_the_kernel_decides_who_may_open_an_acl_grant_included(self):
        # Shared through a POSIX ACL with uid 65534, mode bits aside: it opens.  Owned by that
        # uid with no owner bits but "other" ones: the owner bits decide, and it is refused.
        with tempfile.TemporaryDirectory() as top:
            os.chmod(top, 0o755)
            # Another user must pass through every folder above (TMPDIR may be private).
            if not run_experiment.run_forked(lambda: _become_nobody() or os.path.exists(top)):
                self.skipTest(f"another user cannot reach {top}: TMPDIR is private")
            granted, owned = os.path.join(top, "granted"), os.path.join(top, "owned")
            for folder in (granted, owned):
                reliability.init(folder)
            try:
                for path, mode in ((granted, 0o700), (os.path.join(granted, RECEIVER), 0o600)):
                    os.chmod(path, mode)
                    os.setxattr(path, "system.posix_acl_access", posix_acl(65534, 0o7))
            except OSError as error:
                self.skipTest(f"no POSIX ACLs here: {error}")
            os.chmod(owned, 0o777)
            os.chown(os.path.join(owned, RECEIVER), 65534, 65534)
            os.chmod(os.path.join(owned, RECEIVER), 0o066)
            self.assertEqual(run_experiment.run_forked(connect_as_nobody,
                                                       os.path.join(granted, RECEIVER)), "opened")
            refused = run_experiment.run_forked(connect_as_nobody, os.path.join(owned, RECEIVER))
            self.assertTrue(refused.startswith(("PermissionError: ", "OperationalError: ")),
                            refused)
            self.assertIn(os.path.join(owned, RECEIVER), refused)

    def test_a_wal_or_shm_it_may_not_use_is_one_error_naming_a_path_and_nothing_is_removed(self):
        # Whatever stands where SQLite keeps the -wal or -shm, the write fails in one line that
        # names the database or that file; nothing is stored, and nothing of the user's goes.
        for label, (suffix, kind) in COMPANIONS.items():
            with self.subTest(label), workspace() as ws:
                path = ws.path("receiver")
                open_to_nobody(self, ws.root, path)
                left_open(path)
                if not spoiled(path + suffix, kind):
                    self.skipTest(f"{label}: needs root")
                before = file_bytes(path), kind_of(path + "-wal"), kind_of(path + suffix)
                text = run_experiment.run_forked(write_as_nobody, path, write_a_ticket)
                self.assertEqual(len(text.splitlines()), 1, text)
                self.assertTrue(text.startswith(("OSError: ", "OperationalError: ")), text)
                self.assertIn(path, text)
                self.assertEqual((file_bytes(path), kind_of(path + "-wal"),
                                  kind_of(path + suffix)), before)

    def test_a_read_only_copy_renamed_over_the_file_after_the_check_fails_its_first_write(self):
        # Between connect()'s own check and SQLite's open: SQLite opens the copy read-only and
        # says so at the first write, which names the path.
        with workspace() as ws:
            path, copy = ws.path("receiver"), ws.path("copy")
            shutil.copyfile(path, copy)
            os.chmod(copy, 0o444)
            open_to_nobody(self, ws.root, path)
            text = run_experiment.run_forked(write_as_nobody, path, write_a_ticket,
                                             lambda: os.rename(copy, path))
            self.assertEqual(text, f"OperationalError: {path}: attempt to write a readonly"
                                   " database")
            self.assertEqual(file_bytes(path),
                             file_bytes(os.path.join(TEMPLATE["dir"].name, RECEIVER)))

    def test_a_symlink_to_a_hard_linked_or_read_only_database_is_refused_like_the_file(self):
        with workspace() as ws:
            path, link = ws.path("receiver"), ws.path("link.db")
            os.symlink(path, link)
            open_to_nobody(self, ws.root, path)
            os.link(path, path + ".second")
            refused = [run_experiment.run_forked(connect_as_nobody, name) for name in (path, link)]
            self.assertIn("more than one name", refused[0])
            self.assertEqual(refused[1], refused[0].replace(path, link))
            os.remove(path + ".second")
            os.chmod(path, 0o444)
            refused = [run_experiment.run_forked(connect_as_nobody, name) for name in (path, link)]
            self.assertIn("not writable", refused[0])
            self.assertEqual(refused[1], refused[0].replace(path, link))

    def test_each_spelling_of_a_name_is_checked_as_the_very_file_sqlite_opens(self):
        with workspace() as ws, tempfile.TemporaryDirectory() as elsewhere:
            path = ws.path("receiver")
            os.link(path, path + ".second")
            # A trailing / and a .. after a folder that is not there: both spell the file.
            for name in (path + "/", os.path.join(ws.root, "nowhere", "..", reliability.RECEIVER)):
                with self.subTest(name=name), self.assertRaises(OSError) as refused:
                    reliability.connect(name).close()
                self.assertEqual(refused.exception.errno, errno.EMLINK)
            # A .. after a link to a folder elsewhere: the file beside that folder.
            os.mkdir(os.path.join(elsewhere, "deep"))
            os.symlink(os.path.join(elsewhere, "deep"), os.path.join(ws.root, "lnk"))
            reliability.init(elsewhere)
            with contextlib.closing(reliability.connect(
                    os.path.join(ws.root, "lnk", "..", reliability.RECEIVER))) as connection:
                opened = [row[2] for row in connection.execute("PRAGMA database_list")]
            self.assertEqual(opened, [os.path.realpath(os.path.join(elsewhere, "receiver.db"))])


class FailedSystemCallsAreUnknownOrOneLine(unittest.TestCase):
    """Beyond 第一篇: a COMMIT whose fsync fails is an unknown outcome; an unopenable WAL is one
    line.  System calls really fail, injected by strace into a fresh interpreter."""

    @classmethod
    def setUpClass(cls):
        if strace_flags() is None:
            raise unittest.SkipTest("needs a working strace to make system calls fail for real")

    def test_a_failed_commit_may_or_may_not_survive_and_a_replay_by_key_ends_with_one_ticket(self):
        # The first fdatasync of a fresh WAL syncs its header; the second is the commit.
        variants = {"error survives": "error=EIO:when=2",
                    "then SIGKILL": "error=EIO:signal=SIGKILL:when=2",
                    "disk full": "error=ENOSPC:when=2"}
        request = json.dumps({"caller": "agent", "key": "k1", "payload": PAYLOAD, "issued_at": 0,
                              "now": 0}, ensure_ascii=False).encode("utf-8") + b"\n"
        with contextlib.ExitStack() as stack:
            commands, roots = [], {}
            # Three children at once, each on its own copy.
            for name, inject in variants.items():
                ws = stack.enter_context(workspace(fs_name("提交-", "commit-")))
                roots[name] = ws.root
                database = ws.path("receiver")
                commands.append(strace(f"fdatasync:{inject}", database + "-wal",
                                       SCRIPT, "receive", database))
            done = run_together(commands, request)
            outcomes = {name: (out.decode("utf-8"), err.decode("utf-8"), code)
                        for name, (code, out, err) in zip(variants, done)}
            for name in ("error survives", "disk full"):
                out, err, code = outcomes[name]
                self.assertEqual((out, code), ("", 1))
                self.assertIn("disk I/O error", err)
            self.assertEqual(outcomes["then SIGKILL"][2], -signal.SIGKILL)
            # The same error for the caller, yet one outcome kept the commit: the process that
            # lived rolled back; the one killed left WAL frames that recovery keeps.
            kept = {}
            for name, root in roots.items():
                path = os.path.join(root, RECEIVER)
                with contextlib.closing(reliability.connect(path)) as receiver:
                    kept[name] = reliability.snapshot(receiver)["tickets"]
                    self.assertEqual(receive_on(receiver, now=1)["ticket_id"], 1)
                    seen = reliability.snapshot(receiver)
                    self.assertEqual((seen["tickets"], len(seen["receipts"])), (1, 1))
                    self.assertEqual(receiver.execute("PRAGMA integrity_check").fetchall(),
                                     [("ok",)])
            self.assertEqual(kept, {"error survives": 0, "then SIGKILL": 1, "disk full": 0})

    def test_an_unopenable_wal_is_a_one_line_error_naming_the_file_and_changes_nothing(self):
        with workspace() as ws:
            before = counts(ws)
            database = ws.path("receiver")
            done = subprocess.run(strace("openat:error=EROFS", database + "-wal", DRIVER,
                                         "reliability", "purge", database, "--now", "100",
                                         "--window", "50"),
                                  capture_output=True, timeout=WATCHDOG)
            err = done.stderr.decode("utf-8")
            self.assertEqual((done.returncode, done.stdout), (1, b""))
            self.assertEqual(len(err.splitlines()), 1, err)
            self.assertIn(database, err)
            self.assertNotIn("Traceback", err)
            self.assertEqual(counts(ws), before)


class TheWalResetBugVersionsAreKnown(unittest.TestCase):
    """Beyond 第一篇: the SQLite versions with the WAL-reset race are known, backports included."""

    def test_wal_reset_bug_knows_the_affected_ranges_and_backports(self):
        expected = {(3, 6, 23): False, (3, 7, 0): True, (3, 40, 1): True, (3, 44, 5): True,
                    (3, 44, 6): False, (3, 44, 9): False, (3, 45, 0): True, (3, 50, 6): True,
                    (3, 50, 7): False, (3, 51, 0): True, (3, 51, 2): True, (3, 51, 3): False,
                    (3, 52, 0): False}
        for version, affected in expected.items():
            with self.subTest(version=version):
                self.assertIs(run_experiment.wal_reset_bug(version), affected)
        self.assertIs(run_experiment.wal_reset_bug(),
                      run_experiment.wal_reset_bug(sqlite3.sqlite_version_info))


# === results.json as committed (--check reruns every scenario against it) ===

class ResultsJsonHoldsTheArticlesFigures(unittest.TestCase):
    """第一篇 §4–§6 as results.json records the driver's run; ``run_experiment.py --check``
    reruns every scenario and fails unless the run equals it, so these figures are the live
    ones."""

    def test_results_json_holds_exactly_the_scenarios_the_driver_registers_in_order(self):
        self.assertEqual([name for name, (group, _, _) in run_experiment.SCENARIOS.items()
                          if group == "article_1"],
                         ["naive_lost_ack", "mark_before_send_loses_task", "idempotent_lost_ack",
                          "before_intent_commit", "after_intent_commit", "after_claim",
                          "before_receiver_commit", "after_response_write",
                          "after_response_before_ack", "after_ack", "mismatched_payload",
                          "concurrent_claim", "concurrent_receiver", "before_external_effect",
                          "after_external_effect", "unsafe_external_retry"])
        for group in ("article_1", "open_ends"):
            with self.subTest(group):
                self.assertEqual(set(RESULTS[group]), {name for name, (registered, _, _)
                                                       in run_experiment.SCENARIOS.items()
                                                       if registered == group})
        self.assertEqual({name for name in RESULTS["crash_matrix"]
                          if name.startswith("reliability/")}, set(MATRIX))

    def test_the_articles_figures(self):
        # What the article states, as stage.figure in each scenario's results.
        stated = {
            "naive_lost_ack": {"after_lost_ack.receiver_tickets": 1,
                               "after_recovery.receiver_tickets": 2},
            "idempotent_lost_ack": {"after_lost_ack.receiver_tickets": 1,
                                    "after_recovery.receiver_tickets": 1},
            "mark_before_send_loses_task": {"after_restart.sender_state": "done",
                                            "after_restart.receiver_tickets": 0},
            "after_response_write": {"after_crash.sender_state": "done", "after_crash.attempts": 1,
                                     "after_crash.exit_codes": [CRASH_EXIT]},
            "before_external_effect": {"after_restart.sender_state": "unknown",
                                       "after_restart.external_tickets": 0},
            "after_external_effect": {"after_restart.sender_state": "unknown",
                                      "after_restart.external_tickets": 1},
            "concurrent_claim": {"after_race.claim_winners": 1, "after_race.released_together": 8,
                                 "after_stale_ack.stale_ack": "refused"},
            "concurrent_receiver": {"after_race.released_together": 8,
                                    "after_race.receiver_tickets": 1,
                                    "after_race.receiver_receipts": 1,
                                    "after_race.distinct_responses": 1},
            "mismatched_payload": {"after_mismatch.refusal": "conflict",
                                   "after_mismatch.receiver_tickets": 1},
            "unsafe_external_retry": {"after_unsafe_retry.external_tickets": 2}}
        for name, figures in stated.items():
            for path, value in figures.items():
                with self.subTest(name, path=path):
                    self.assertEqual(figure(name, path), value)

    def test_the_crash_matrix_crashed_every_boundary_and_only_the_naive_receiver_duplicates(self):
        twice = set()
        for name in MATRIX:
            boundary = name.split("/", 1)[1]
            cells = RESULTS["crash_matrix"][name]
            with self.subTest(boundary):
                self.assertEqual(sorted(cells), sorted(run_experiment.BOUNDARIES[boundary][1]))
                self.assertEqual({cell["exit_code"] for cell in cells.values()}, {CRASH_EXIT})
                if "idempotent" in cells:
                    self.assertEqual((cells["idempotent"]["sender_state"],
                                      cells["idempotent"]["tickets"]), ("done", 1))
                if "external" in cells:
                    self.assertEqual(cells["external"]["attempts"], 1)
                    external = cells["external"]["sender_state"], cells["external"]["tickets"]
                    self.assertIn(external, {("unknown", 0), ("unknown", 1), ("done", 1)})
                if cells.get("naive", {}).get("tickets") == 2:
                    twice.add(boundary)
        self.assertEqual(twice, {"after_receiver_commit"})


# === machinery: workspaces, children, one barrier, the source and results.json ===

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.abspath(reliability.__file__)
DRIVER = os.path.abspath(run_experiment.__file__)
# The module the twins below run: test_preconditions.py's twins run preconditions.py.
UNDER_TEST = reliability
# Seconds: only ends a hung child, never asserted as a measurement.
# twin: identical in test_preconditions.py
WATCHDOG = 60.0
# A fresh interpreter whose text streams are not UTF-8, as an 8-bit locale makes them: the C
# locale with UTF-8 mode off, and latin-1 streams (-I would ignore PYTHONIOENCODING, so -S alone).
LEGACY = ["-S", "-X", "utf8=0"], dict(
    {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")},
    LC_ALL="C", LANG="C", PYTHONIOENCODING="latin-1")
EMPTY = {"requests": 0, "outbox": 0, "tickets": 0, "receipts": 0, "external": 0}
# What integrity() finds in an intact workspace.
INTACT = dict.fromkeys(("sender", "receiver", "external"), ([("ok",)], []))
# The three databases made once by init(), copied per test: no fsyncs per test.
TEMPLATE = {}


def setUpModule():
    TEMPLATE["dir"] = tempfile.TemporaryDirectory()
    reliability.init(TEMPLATE["dir"].name)


# twin: identical in test_preconditions.py
def tearDownModule():
    TEMPLATE.pop("dir").cleanup()


@contextlib.contextmanager
def workspace(prefix=None):
    """A fresh root with the three databases; ws.sender, ws.receiver and ws.external are
    connections opened on first use and closed on exit; ws.close() before a child opens
    their files."""
    with tempfile.TemporaryDirectory(prefix=prefix) as root, contextlib.ExitStack() as stack:
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

    # Only called for a connection not opened yet.
    def __getattr__(self, name):
        if name not in self.FILES:
            raise AttributeError(name)
        connection = reliability.connect(self.path(name))
        self._stack.callback(connection.close)
        setattr(self, name, connection)
        return connection


@contextlib.contextmanager
def raw(path):
    """A plain sqlite3 connection (foreign keys off, autocommit) for tampering behind the
    module's back."""
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        yield connection
    finally:
        connection.close()


def enqueue(ws, key="k1", payload=PAYLOAD, *, now=0, mode="idempotent", caller="agent"):
    return reliability.enqueue(ws.sender, caller, key, payload, now=now, mode=mode)


def receive(ws, key="k1", payload=PAYLOAD, *, issued_at=0, now=0, caller="agent"):
    return receive_on(ws.receiver, key, payload, issued_at=issued_at, now=now, caller=caller)


def receive_on(connection, key="k1", payload=PAYLOAD, *, issued_at=0, now=0, caller="agent"):
    return reliability.receive(connection, caller, key, payload, issued_at=issued_at, now=now)


def reconcile(ws, key="k1", *, now=1000, tool=None):
    return reliability.reconcile(ws.sender, tool or ws.external, "agent", key, now)


def counts(ws):
    """Rows in every table that matters."""
    one = lambda db, table: db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    return {"requests": one(ws.sender, "requests"), "outbox": one(ws.sender, "outbox"),
            "tickets": one(ws.receiver, "tickets"), "receipts": one(ws.receiver, "receipts"),
            "external": one(ws.external, "tickets")}


def integrity(ws):
    """Each database's quick_check and foreign_key_check rows."""
    check = lambda connection, pragma: connection.execute(f"PRAGMA {pragma}").fetchall()
    return {name: (check(getattr(ws, name), "quick_check"),
                   check(getattr(ws, name), "foreign_key_check")) for name in Workspace.FILES}


def outbox(ws, key="k1", caller="agent"):
    found = [row for row in reliability.snapshot(ws.sender)["outbox"]
             if (row["caller"], row["key"]) == (caller, key)]
    assert len(found) == 1, found
    return found[0]


def state(ws, key="k1"):
    row = outbox(ws, key)
    return row["state"], row["attempts"]


def rows(connection, table):
    """Every row, text that is not UTF-8 included (a tampered one), to compare before/after."""
    factory = connection.text_factory
    connection.text_factory = lambda data: data.decode("utf-8", "surrogateescape")
    try:
        return connection.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
    finally:
        connection.text_factory = factory


def pids(ws, key="k1"):
    return ws.sender.execute("SELECT owner_pid, tool_pid FROM outbox"
                             " WHERE caller = 'agent' AND key = ?", (key,)).fetchone()


def set_pids(ws, owner_pid, tool_pid, key="k1"):
    """Through raw(): the precise pids a crashed sender and its tool child would leave."""
    with raw(ws.path("sender")) as tamper:
        tamper.execute("UPDATE outbox SET owner_pid = ?, tool_pid = ?"
                       " WHERE caller = 'agent' AND key = ?", (owner_pid, tool_pid, key))


def set_state(ws, new_state, key="k1"):
    with raw(ws.path("sender")) as tamper:
        tamper.execute("UPDATE outbox SET state = ? WHERE caller = 'agent' AND key = ?",
                       (new_state, key))


def audit(ws):
    return ws.sender.execute("SELECT id, caller, key, attempt, decision, decided_by, reason,"
                             " evidence FROM resolutions ORDER BY id").fetchall()


def sender_rows(ws):
    return rows(ws.sender, "requests"), rows(ws.sender, "outbox"), audit(ws)


# twin: identical in test_preconditions.py
def file_bytes(path):
    with open(path, "rb") as handle:
        return handle.read()


def folder_bytes(folder):
    """Each file of ``folder`` by name, with its bytes."""
    return {name: file_bytes(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}


def write_file(path, data):
    with open(path, "wb") as handle:
        handle.write(data)


def fs_name(text, fallback):
    """``text`` if this process can name a file with it, else ``fallback`` (an ASCII locale
    without UTF-8 mode)."""
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        return fallback
    return text


def writers(ws):
    """Every public function that would store an (identity, payload) pair, one per database."""
    return {"receive": lambda c, k, p: reliability.receive(ws.receiver, c, k, p, issued_at=0,
                                                           now=0),
            "enqueue": lambda c, k, p: reliability.enqueue(ws.sender, c, k, p, now=0),
            "external_create_ticket": lambda c, k, p: reliability.external_create_ticket(
                ws.external, c, k, p)}


# json reads a list its own way: what iter() shows need not be what it writes.
class HidingList(list):
    def __iter__(self):
        return iter(())


# And a dict through items(), not values().
class HidingDict(dict):
    def values(self):
        return []


# --- children: the module's own command line, tool children, stand-ins, live processes

# twin: identical in test_preconditions.py
def cli(*argv, stdin=b""):
    """A step by hand of UNDER_TEST (``run_experiment.py MODULE FUNCTION ARG...``), in a child
    forked as the driver forks its children: forked(run_experiment.main, ...)."""
    return forked(run_experiment.main, [UNDER_TEST.__name__, *map(str, argv)], stdin=stdin)


# twin: identical in test_preconditions.py
def forked(main, argv, stdin=b""):
    """main(argv) in a child forked by run_experiment.fork_child, ``stdin`` its input, run to its
    end: (exit code, stdout, stderr) as text from UTF-8.  A child still running at the
    watchdog, or when anything here fails, is killed and reaped."""
    with tempfile.TemporaryFile() as stderr:
        child = run_experiment.fork_child(main, (argv,), stderr=stderr.fileno())
        try:
            out, _ = child.communicate(stdin, timeout=WATCHDOG)
        finally:
            run_experiment.reap([child])
        stderr.seek(0)
        return child.returncode, out.decode("utf-8"), stderr.read().decode("utf-8")


# twin: identical in test_preconditions.py
def run_together(commands, stdin=b"", **options):
    """Run every command (an argv list) at once, each to its end with ``stdin`` as input;
    [(exit code, stdout, stderr)] as bytes.  A child still running at the watchdog, or when
    anything fails, is killed and reaped: none is left behind."""
    children, done = [], []
    try:
        for argv in commands:
            children.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, **options))
        for child in children:
            out, err = child.communicate(stdin, timeout=WATCHDOG)
            done.append((child.returncode, out, err))
        return done
    finally:
        run_experiment.reap(children)


# The ways a reader stops a command, each (how, whether it starts in the background, SIGINT
# ignored): typed at a terminal (None: Ctrl-C); an interrupt to the group of a background
# start; SIGTERM to it alone; a hang-up to its group.
# twin: identical in test_preconditions.py
STOPS = {"Ctrl-C": (None, False),
         "SIGINT to a background start": (lambda pid: os.killpg(pid, signal.SIGINT), True),
         "SIGTERM": (lambda pid: os.kill(pid, signal.SIGTERM), False),
         "SIGHUP to its group": (lambda pid: os.killpg(pid, signal.SIGHUP), False)}

# A shell for at_a_terminal(): it leads the session with the pty as its controlling terminal,
# starts the command as its foreground job, reports the job's pid and then its exit code on
# the descriptor named first, and waits to be killed.
# twin: identical in test_preconditions.py
SHELL = """
import fcntl, os, signal, sys, termios
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
report, background, argv = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3:]
pid = os.fork()
if pid == 0:
    try:
        os.setpgid(0, 0)
        # A group not yet in the foreground that takes the terminal would get SIGTTOU.
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        os.tcsetpgrp(0, os.getpid())
        for number in (signal.SIGTTOU, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(number, signal.SIG_DFL)
        # As `cmd &` in a script starts it.
        if background:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.close(report)
        os.execv(argv[0], argv)
    finally:
        os._exit(127)
os.write(report, b"%d\\n" % pid)
os.write(report, b"%d\\n" % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
signal.pause()
"""


# twin: identical in test_preconditions.py
def at_a_terminal(argv, ready, stop=None, background=False):
    """Run ``argv`` as a command typed at a terminal: on a pseudo-terminal, as the foreground
    job of a shell that leads the session (SHELL), with the pty as its stdin, stdout and
    stderr; with ``background``, ignoring SIGINT as ``cmd &`` in a script would.  Once
    ``ready(pid, screen)`` holds, Ctrl-C is typed (the kernel sends SIGINT to the job's whole
    process group), or ``stop(pid)`` is called instead.  The shell outlives the job, so that no
    SIGHUP at the session's end hides a process the job left.  Returns (exit code, the screen
    as text, the pids of the job's process group still running once it ended).  A job never
    ready or never ending fails at the watchdog; nothing of it outlives this call."""
    import termios
    master, slave = os.openpty()
    attributes = termios.tcgetattr(slave)
    # The screen as the job wrote it: no ^C echoed, no \r added before each \n.
    attributes[1] &= ~termios.OPOST
    attributes[3] &= ~termios.ECHO
    termios.tcsetattr(slave, termios.TCSANOW, attributes)
    report, told = os.pipe()
    try:
        shell = subprocess.Popen([sys.executable, "-I", "-S", "-c", SHELL, str(told),
                                  "1" if background else "0", *argv], stdin=slave, stdout=slave,
                                 stderr=slave, pass_fds=(told,), start_new_session=True)
    finally:
        os.close(slave)
        os.close(told)
    got, closed, group, left = {master: b"", report: b""}, set(), None, None
    job = lambda: got[report].split(b"\n")
    screen = lambda: got[master].decode("utf-8", "replace")

    def pump(until, waited_for):
        deadline = time.monotonic() + WATCHDOG
        while not until():
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {WATCHDOG} s for {waited_for}; the screen:"
                                     f" {screen()!r}")
            for fd in select.select([fd for fd in got if fd not in closed], [], [], 0.005)[0]:
                try:
                    data = os.read(fd, 65536)
                # EIO: the pty's last other holder is gone.
                except OSError:
                    data = b""
                got[fd] += data
                if not data:
                    closed.add(fd)
    try:
        pump(lambda: len(job()) > 1, "the job to start")
        group = int(job()[0])
        pump(lambda: len(job()) > 2 or ready(group, screen()), "the job to be ready")
        if len(job()) > 2:
            raise AssertionError(f"the job ended before it was ready: {screen()!r}")
        if stop is None:
            os.write(master, b"\x03")
        else:
            stop(group)
        try:
            pump(lambda: len(job()) > 2, "the job to end")
        except AssertionError:
            # What the job did with the signal: blocked, ignored or pending.
            with open(f"/proc/{group}/status", encoding="utf-8") as status:
                masks = [line.strip() for line in status if line.startswith("Sig")]
            raise AssertionError(f"the job outlived its stop: {masks}") from None
        deadline = time.monotonic() + WATCHDOG
        while group_running(group) and time.monotonic() < deadline:
            time.sleep(0.005)
        left = group_running(group)
    finally:
        # Whatever failed: none of the job's group lives on.
        if group is not None and left != []:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        shell.kill()
        shell.wait()
        os.close(report)
    try:
        # Every holder of the pty gone: the rest of the screen, to its end.
        closed.add(report)
        pump(lambda: master in closed, "the terminal to be let go")
    finally:
        os.close(master)
    return int(job()[1]), screen(), left


# twin: identical in test_preconditions.py
def group_running(group):
    """The pids of the processes of process group ``group`` that have not ended (Linux /proc)."""
    running = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
                # pid (name) state ppid pgrp ...: the name may hold spaces and parentheses.
                fields = handle.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == group and fields[0] != "Z":
                running.append(int(pid))
    return running


# twin: identical in test_preconditions.py
def sleeps_in_read(pid, fd=0):
    """Whether process ``pid`` sleeps in read() on descriptor ``fd`` (Linux /proc: the system
    call it is in, numbered as this process's own read of that file shows)."""
    with open("/proc/self/syscall", encoding="ascii") as mine:
        read = mine.read().split()[0]
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/syscall", encoding="ascii") as its:
            return its.read().split()[:2] == [read, hex(fd)]
    return False


def launcher(crash=None, started=None, legacy=False, naive=False):
    """A start= hook for call_tool: the module's tool child (tool_child), dying at ``crash``, or
    with ``naive`` the driver's UNSAFE receiver without receipts; each child is appended to
    ``started``.  It is forked, as the driver's children are (run_experiment.fork_child), or if
    ``legacy`` a fresh interpreter in the LEGACY locale."""
    def start(argv):
        argv = [*argv, *([crash] if crash else [])]
        # Its crash line ("died at ...") is not this run's output: the cli() tests read it.
        if not legacy:
            with open(os.devnull, "wb") as quiet:
                child = run_experiment.fork_child(
                    run_experiment.naive_tool_child if naive else reliability.tool_child, (argv,),
                    stderr=quiet.fileno())
        else:
            child = subprocess.Popen([sys.executable, *LEGACY[0], SCRIPT, *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=LEGACY[1])
        if started is not None:
            started.append(child)
        return child
    return start


def answering(response):
    """A tool child that is a real forked process but answers ``response`` (a dict, a line of
    bytes, or a function of the request) whatever it is asked: answers a real tool would not
    give."""
    def main(argv):
        request = json.loads(sys.stdin.buffer.readline())
        answer = response(request) if callable(response) else response
        line = answer if isinstance(answer, bytes) else json.dumps(answer).encode("utf-8")
        sys.stdout.buffer.write(line + b"\n")
        return 0

    def start(argv):
        with open(os.devnull, "wb") as quiet:
            return run_experiment.fork_child(main, (argv,), stderr=quiet.fileno())
    return start


def unknown_external(ws, key="k1"):
    """A real unknown row: enqueued external at tick 0, claimed at 0 (lease until LEASE_TICKS),
    its tool child exits 73 before acting, so deliver() marks it unknown and clears both pids."""
    enqueue(ws, key, mode="external")
    # Its tool child opens it.
    ws.close("external")
    result = reliability.dispatch(ws.sender, ws.root, 0, start=launcher("before_external_effect"))
    assert (result["exit_code"], state(ws, key)) == (CRASH_EXIT, ("unknown", 1)), result
    assert pids(ws, key) == (None, None)


def timed_out_child():
    """The only simulated child (the article says so): one that outlives its time-out."""
    child = mock.Mock(name="child")
    # Above Linux's pid_max: no process has it.
    child.pid = 4194304
    child.communicate.side_effect = [subprocess.TimeoutExpired(cmd="receive", timeout=0.5),
                                     (b"", None)]
    return child


def children_of(pid):
    """The pids of process ``pid``'s children (Linux /proc)."""
    children = []
    for child in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{child}/stat", encoding="utf-8", errors="replace") as handle:
                if int(handle.read().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(child))
    return children


def holds_open(pid, path):
    """Whether process ``pid`` has ``path`` open (Linux /proc)."""
    with contextlib.suppress(OSError):
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == os.path.realpath(path)
                   for fd in os.listdir(f"/proc/{pid}/fd"))
    return False


def started_at(pid):
    """When process ``pid`` started, in clock ticks since boot, or None where none runs (Linux
    /proc): with the pid, it names one process, not a later one that reuses the pid."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        # A zombie has ended.
        return None if fields[0] == "Z" else int(fields[19])
    return None


class LiveChild:
    """A real child process that lives until end() closes its stdin and reaps it."""

    def __init__(self, test):
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", "import sys; sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        self.pid = self.process.pid
        test.addCleanup(self.end)

    def end(self):
        # EOF: it exits, and is reaped (no zombie counts as alive).
        if self.process.returncode is None:
            self.process.communicate()


class ReconcilingConnection(sqlite3.Connection):
    """A real connection to external.db that runs ``before_lookup`` once, just before
    reconcile() looks the ticket up: a person's resolve() or a claim can land there."""
    before_lookup = None

    def execute(self, sql, *args):
        if sql.startswith("SELECT id, digest FROM tickets") and self.before_lookup:
            hook, self.before_lookup = self.before_lookup, None
            hook()
        return super().execute(sql, *args)


@contextlib.contextmanager
def reconciling_tool(ws, before_lookup):
    with contextlib.closing(sqlite3.connect(ws.path("external"),
                                            factory=ReconcilingConnection)) as tool:
        tool.before_lookup = before_lookup
        yield tool


# twin: identical in test_preconditions.py
def _become_nobody():
    # Root may signal anyone and passes every permission check.
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)


def alive_as_nobody(pid):
    """reliability._alive(pid) asked by a user that is not root (uid and gid 65534 if we are)."""
    _become_nobody()
    return reliability._alive(pid)


# twin: identical in test_preconditions.py
def connect_as_nobody(path):
    """In a forked child: the text of what UNDER_TEST.connect(path) raises for a user that is
    not root (uid and gid 65534 if we are), or "opened"."""
    _become_nobody()
    try:
        UNDER_TEST.connect(path).close()
        return "opened"
    except Exception as error:
        return f"{type(error).__name__}: {error}"

# What may stand where SQLite keeps a database's -wal or -shm: label: (suffix, kind).
# twin: identical in test_preconditions.py
COMPANIONS = {"another user's read-only -shm": ("-shm", "read-only"),
              "another user's read-only -wal": ("-wal", "read-only"),
              "a -shm an ACL lets this user only read": ("-shm", "acl"),
              "a folder at -shm": ("-shm", "folder"), "a FIFO at -wal": ("-wal", "fifo"),
              "a FIFO at -shm": ("-shm", "fifo"), "a device at -wal": ("-wal", "device")}


# twin: identical in test_preconditions.py
def left_open(database):
    """-wal and -shm beside ``database``, as a process that died with it open leaves them."""
    pid = os.fork()
    if pid == 0:
        connection = sqlite3.connect(database)
        connection.execute("SELECT count(*) FROM sqlite_master").fetchall()
        os._exit(0)
    os.waitpid(pid, 0)


# twin: identical in test_preconditions.py
def spoiled(path, kind):
    """Turn ``path``, a -wal or -shm that left_open() left, into ``kind`` (COMPANIONS); False
    where this user cannot make it (an ACL and a device need root)."""
    if kind == "read-only":
        os.chmod(path, 0o444)
        return True
    if os.geteuid() != 0 and kind in ("acl", "device"):
        return False
    if kind == "acl":
        os.chmod(path, 0o666)
        try:
            os.setxattr(path, "system.posix_acl_access", posix_acl(65534, 0o4))
        except OSError:
            return False
        return True
    os.remove(path)
    if kind == "folder":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return True


# twin: identical in test_preconditions.py
def kind_of(path):
    """The kind of file at ``path`` and its bytes if it is a regular one: what must not change."""
    mode = os.lstat(path).st_mode
    return stat.S_IFMT(mode), file_bytes(path) if stat.S_ISREG(mode) else None


# twin: identical in test_preconditions.py
def posix_acl(uid, perms):
    """The system.posix_acl_access value granting ``uid`` ``perms`` (rwx bits) on top of the
    owner's rwx and nothing for group and others: version 2, then sorted entries of tag,
    permissions and id (linux/posix_acl_xattr.h)."""
    undefined = 0xFFFFFFFF
    entries = [(0x01, 0o7, undefined), (0x02, perms, uid), (0x04, 0, undefined),
               (0x10, perms, undefined), (0x20, 0, undefined)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)


def write_a_ticket(connection):
    """What write_as_nobody() writes here: a ticket."""
    reliability.receive(connection, "agent", "k1", PAYLOAD, issued_at=0, now=0)


# twin: identical in test_preconditions.py
def write_as_nobody(path, write, before_open=None):
    """In a forked child: write(UNDER_TEST.connect(path)) as a user that is not root (uid and gid
    65534 if we are), ``before_open`` run just after connect()'s own checks; the text of what
    it raised, or "written".  A child that hangs (a FIFO opened as its -wal) dies at the
    watchdog, and run_forked() says so."""
    signal.alarm(int(WATCHDOG))
    _become_nobody()
    if before_open is not None:
        checked = UNDER_TEST._check_file
        UNDER_TEST._check_file = lambda *names: checked(*names) or before_open()
    try:
        with contextlib.closing(UNDER_TEST.connect(path)) as connection:
            write(connection)
        return "written"
    except Exception as error:
        return f"{type(error).__name__}: {error}"


# twin: identical in test_preconditions.py
def open_to_nobody(test, folder, *files):
    """Let uid 65534 write ``files`` and make files in ``folder``, or skip ``test`` where that
    user cannot reach the folder (a private TMPDIR)."""
    os.chmod(folder, 0o777)
    for path in files:
        os.chmod(path, 0o666)
    if not run_experiment.run_forked(lambda: _become_nobody() or os.access(folder, os.W_OK)):
        test.skipTest(f"another user cannot reach {folder}: TMPDIR is private")


@functools.lru_cache(maxsize=None)
def strace_flags():
    """None where strace is missing or may not trace (ptrace is often forbidden in containers);
    else ["--seccomp-bpf"] where that works cleanly (strace 5.3+: the child stops only at the
    traced calls, not at every call), or [] where it does not."""
    found = shutil.which("strace")
    for flags in (["--seccomp-bpf"], []) if found else ():
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            done = subprocess.run([found, "-f", *flags, "-e", "trace=getpid", "-o", os.devnull,
                                   "true"], capture_output=True, timeout=WATCHDOG)
            if (done.returncode, done.stderr) == (0, b""):
                return flags
    return None


def strace(inject, path, *argv):
    """`python3 argv...` (a script and its arguments) in a fresh interpreter under strace,
    ``inject`` (a syscall:fault) applied to the calls on ``path``."""
    # With --seccomp-bpf strace 6.1 sends no injected signal, so that one child stops at every
    # call.
    fast = [] if "signal=" in inject else strace_flags()
    return [shutil.which("strace"), "-f", *fast, "-o", os.devnull,
            "-e", f"trace={inject.split(':')[0]}", "-e", f"inject={inject}", "-P", path,
            sys.executable, "-I", "-S", *argv]


# --- one barrier: racers forked together, and many agents at once

# Agents, connections opened by each, and the seed of their choices.
# twin: identical in test_preconditions.py
MANY_AGENTS, MANY_OPERATIONS, MANY_SEED = 3, 400, 7


# twin: identical in test_preconditions.py
def race(body, n=8, may_die=False):
    """Run ``body(wait)`` in ``n`` processes forked by run_experiment.fork_json; each wait() is
    a barrier that all n reach before any goes on, so the interleaving is forced, not hoped
    for.  Returns the n JSON results (None for a racer that SIGKILLed itself, which only
    ``may_die`` allows).  The same in test_reliability.py and test_preconditions.py.

    The watchdog measures silence, not work: every barrier byte and every racer's end resets
    it, so a loaded machine makes a race slower, never failed.  A racer that ends while the
    others stand at a barrier fails the race at once.  The caller must hold no SQLite
    connection to a file the body opens.
    """
    ready_r, ready_w = os.pipe()
    fds, racers = {ready_r, ready_w}, []

    def racer(go_r):
        def wait():
            os.write(ready_w, b"r")
            if os.read(go_r, 1) != b"g":
                raise RuntimeError("barrier broken")
        try:
            return body(wait)
        finally:
            # Done: progress, like a barrier byte.
            os.write(ready_w, b"d")
    try:
        for _ in range(n):
            # Its own: a fast racer cannot take a slow one's turn.
            go_r, go_w = os.pipe()
            fds |= {go_r, go_w}
            pid, out = run_experiment.fork_json(racer, go_r)
            fds.add(out)
            racers.append((pid, out, go_w))
        os.close(ready_w)
        fds.discard(ready_w)
        waiting = ended = 0
        while True:
            if not select.select([ready_r], [], [], WATCHDOG)[0]:
                raise AssertionError(f"no racer moved for {WATCHDOG:g} s: one hangs")
            data = os.read(ready_r, 64)
            # Every racer has ended.
            if not data:
                break
            waiting, ended = waiting + data.count(b"r"), ended + data.count(b"d")
            # All the racers still running stand at the barrier: go, unless one has ended
            # and so never comes to it (its traceback, if any, is above).
            if waiting and waiting == n - ended:
                if ended:
                    raise AssertionError("a racer ended while the others waited at a barrier")
                for _, _, go_w in racers:
                    os.write(go_w, b"g")
                waiting = 0
        results = []
        while racers:
            pid, out, _ = racers.pop(0)
            fds.discard(out)
            with os.fdopen(out, "rb") as pipe:
                output = pipe.read()
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if may_die and code == -signal.SIGKILL:
                results.append(None)
                continue
            # A racer that raised printed its traceback above.
            assert code == 0, f"racer exited {code}"
            results.append(json.loads(output.decode("utf-8")))
        return results
    finally:
        # Only if something above failed.
        for pid, _, _ in racers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for fd in fds:
            os.close(fd)


# twin: identical in test_preconditions.py
def many_agents(act, database, folder, wait):
    """One of MANY_AGENTS agents: MANY_OPERATIONS times it opens ``database``, has
    act(connection, rng, op, must_write, arm, mine) do one seeded operation there, notes in its
    journal what act returns unless that is None, and closes.  Odd agents SIGKILL themselves in
    their second half, at a seeded moment: just opened, inside the transaction, or answered but
    not yet noted.  act writes when ``must_write`` (the agent dies in this operation) and calls
    arm() where its write begins, which sets off a death inside the transaction; ``op`` is
    agent-i/n, and ``mine`` the agent's own list, for act to keep what it did."""
    index, journal = numbered(folder, "agent")
    rng = random.Random(f"{MANY_SEED}/{index}")
    death = (rng.randrange(MANY_OPERATIONS // 2, MANY_OPERATIONS),
             rng.choice(("opened", "writing", "answered"))) if index % 2 else None
    mine = []

    def die():
        os.kill(os.getpid(), signal.SIGKILL)
    with open(journal, "ab", buffering=0) as journal:
        wait()
        for n in range(MANY_OPERATIONS):
            connection = UNDER_TEST.connect(database)
            try:
                if death == (n, "opened"):
                    die()

                def arm():
                    if death == (n, "writing"):
                        connection.set_progress_handler(die, rng.randint(1, 40))
                answer = act(connection, rng, f"agent-{index}/{n}",
                             death is not None and death[0] == n, arm, mine)
                if death == (n, "answered"):
                    die()
                if answer is not None:
                    journal.write(json.dumps(answer).encode("utf-8") + b"\n")
            finally:
                connection.close()
    return "done"


def agent_receives(connection, rng, op, must_write, arm, mine):
    """A many_agents() operation on receiver.db: it receives a key others receive too (1 in 10,
    and whenever it must write) and its answer is noted, or it checkpoints (1 in 20), or only
    reads."""
    work = rng.random()
    if work < 0.1 or must_write:
        key = f"k{rng.randrange(MANY_OPERATIONS // 10)}"
        arm()
        return written(lambda: receive_on(connection, key, {"key": key}))
    if work < 0.15:
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    else:
        connection.execute("SELECT count(*) FROM receipts").fetchone()
    return None


# twin: identical in test_preconditions.py
def numbered(folder, name):
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


# --- the source: reliability.py's module-level definitions, for the article's code

with open(SCRIPT, encoding="utf-8") as _handle:
    SOURCE = _handle.read()
TREE = ast.parse(SOURCE)
# Module-level name -> its definition node, in source order.
DEFINITIONS = {}
for _node in TREE.body:
    if isinstance(_node, (ast.FunctionDef, ast.ClassDef)):
        DEFINITIONS[_node.name] = _node
    elif isinstance(_node, ast.Assign):
        # SENDER, RECEIVER, EXTERNAL = ...: each name of a tuple too.
        for _name in (n for t in _node.targets for n in ast.walk(t) if isinstance(n, ast.Name)):
            DEFINITIONS[_name.id] = _node


def segment(node):
    """The source lines of a definition, its decorators included."""
    first = min([node.lineno] + [decorator.lineno
                                 for decorator in getattr(node, "decorator_list", [])])
    return SOURCE.splitlines()[first - 1:node.end_lineno]


# --- results.json

with open(run_experiment.RESULTS, encoding="utf-8") as _handle:
    RESULTS = json.load(_handle)
MATRIX = [f"reliability/{boundary}" for boundary in run_experiment.BOUNDARIES]


def figure(name, path):
    """The value at ``path`` (keys joined by dots) in scenario ``name``'s results."""
    value = RESULTS[run_experiment.SCENARIOS[name][0]][name]
    for key in path.split("."):
        value = value[key]
    return value


# twin: identical in test_preconditions.py
def main():
    """The file run as a script: unittest's run, which a Ctrl-C, SIGTERM or SIGHUP ends in one
    line with exit 130, every test's folder removed on the way out (as Ctrl-C alone would)."""
    # SIGINT even where a background start ignores it; an ignored SIGTERM or SIGHUP (nohup)
    # stays ignored.
    for number in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGINT)):
        if number == signal.SIGINT or signal.getsignal(number) is not signal.SIG_IGN:
            signal.signal(number, signal.default_int_handler)
    try:
        unittest.main()
    except KeyboardInterrupt:
        print(f"{os.path.basename(__file__)}: interrupted", file=sys.stderr)
        sys.exit(130)


# Keep last: classes defined below it would not run under `python3 test_reliability.py`.
if __name__ == "__main__":
    main()
