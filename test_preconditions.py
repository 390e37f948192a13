"""Tests for preconditions.py (第七篇《没有重复执行，为什么还是办错了？》): real SQLite files and
real processes.

In the article's order: its sections §1 to §7, then the module's contracts beyond it (ticks,
retention, the files and the command line), then the article's code verbatim, then the
article's figures as results.json holds them.  The machinery is in one section at the bottom;
the helpers marked "# twin" are written identically in test_reliability.py, so that each
article's five files run alone.  Children are forked as the driver forks them, or are fresh
interpreters where the command line itself is under test.  Run: python3 test_preconditions.py,
or python3 -X dev -W error -m unittest test_preconditions.  Standard library only;
reliability.py is never imported (article 7's download lacks it).

The companion's self-checks are in beyond/test_companion.py, which no download needs: the copy
kit, README.md's table and walk-through, the public names, the definitions preconditions.py
shares with reliability.py, the five-file download, and the test that the twins are identical.
"""
import os
import sys

# One clear line: unittest would turn a SystemExit into a traceback.
if sys.version_info < (3, 9):
    sys.stderr.write("test_preconditions.py needs Python 3.9 or newer; this is %s\n"
                     % sys.version.split()[0])
    sys.stderr.flush()
    os._exit(2)

import ast
import collections
import contextlib
import errno
import functools
import hashlib
import inspect
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
import threading
import time
import unittest
from unittest import mock

import preconditions as pre
import run_experiment

# The article's start, ({name: (quantity, revision)}, effects, receipts), and its transfer of 3.
START = ({"A": (10, 1), "B": (0, 1)}, 0, 0)
APPLIED = {"status": "applied", "revisions": {"A": 2, "B": 2}, "quantities": {"A": 7, "B": 3}}
AFTER_APPLIED = ({"A": (7, 2), "B": (3, 2)}, 1, 1)


class Case(unittest.TestCase):
    """A test on its own A = 10, B = 0 database.  What it uses beyond unittest (self.db, self.c,
    self.x() ...) is its Fixture's, in the machinery section at the bottom."""

    def setUp(self):
        self.fixture = Fixture(self)

    def __getattr__(self, name):
        if "fixture" not in vars(self):
            raise AttributeError(name)
        return getattr(self.fixture, name)


# === 第七篇 §1–§2: a plan of four checked fields; the receipt before the state ===============

class BadInputRaisesBeforeAnyTransaction(Case):
    """§1–§2: a plan is src, dst, amount and expected, each checked; anything else raises before
    BEGIN and stores nothing, and values exactly at the stated bounds are accepted."""

    def test_malformed_plans_and_changes_raise_before_begin_and_store_nothing(self):
        missing = plan()
        del missing["expected"]
        long_name, long_op = "x" * (pre.MAX_NAME_LENGTH + 1), "x" * (pre.MAX_OP_LENGTH + 1)
        bad_plans = [(ValueError, missing), (ValueError, dict(plan(), note="x")), (ValueError, {}),
                     (TypeError, [("src", "A")]), (ValueError, plan(src="A", dst="A")),
                     (ValueError, plan(src="")), (ValueError, plan(src=long_name)),
                     (ValueError, plan(src="\ud800")), (ValueError, plan(dst="B\ud800")),
                     (TypeError, plan(src=1)), (TypeError, plan(amount=True)),
                     (TypeError, plan(a=True)), (TypeError, plan(b=False)),
                     (TypeError, plan(amount=3.0)), (ValueError, plan(amount=0)),
                     (ValueError, plan(amount=-3)), (ValueError, plan(amount=pre.MAX_AMOUNT + 1)),
                     (ValueError, plan(a=0)), (ValueError, plan(b=-1)),
                     (ValueError, plan(a=pre.MAX_INT64 + 1)),
                     (TypeError, dict(plan(), expected=[["A", 1], ["B", 1]]))]
        bad_plans += [(ValueError, dict(plan(), expected=expected)) for expected in
                      ({"A": 1}, {"A": 1, "C": 1}, {"A": 1, "B": 1, "C": 1}, {})]
        bad_ops = [(TypeError, b"op"), (TypeError, 7), (ValueError, ""), (ValueError, long_op),
                   (ValueError, "job-\ud800")]
        bad_changes = [(TypeError, ("c", "A", True)), (TypeError, ("c", "A", 1.0)),
                       (ValueError, ("c", "A", pre.MAX_INT64 + 1)), (ValueError, ("c", "", 1)),
                       (TypeError, ("c", 1, 1)), (TypeError, (1, "A", 1)),
                       (ValueError, ("", "A", 1)), (ValueError, ("op-\ud800", "A", 1)),
                       (ValueError, ("op-1", "A\ud800", 1))]
        calls = [(error, functools.partial(self.x, "op", command)) for error, command in bad_plans]
        calls += [(error, functools.partial(self.x, op)) for error, op in bad_ops]
        calls += [(error, functools.partial(self.change, *args)) for error, args in bad_changes]
        statements = []
        self.c.set_trace_callback(statements.append)
        for error, call in calls:
            with self.subTest(call=call.args), self.assertRaises(error):
                call()
        self.c.set_trace_callback(None)
        # Not even BEGIN IMMEDIATE.
        self.assertEqual(statements, [])
        self.assertFalse(self.c.in_transaction)
        self.assertEqual(self.figures(), START)

    def test_values_exactly_at_the_stated_bounds_are_accepted(self):
        name = "N" * pre.MAX_NAME_LENGTH
        self.assertEqual(self.x("x" * pre.MAX_OP_LENGTH, plan(amount=pre.MAX_AMOUNT)),
                         {"status": "insufficient", "available": 10})
        self.assertEqual(self.x("op-2", plan(dst=name)),
                         {"status": "missing_resource", "missing": [name]})
        self.assertEqual(self.x("op-3", plan(a=pre.MAX_INT64)),
                         {"status": "stale", "observed": {"A": 1, "B": 1}})


class TheReceiptAnswersBeforeTheState(Case):
    """§2 去重入口里，先查历史，再问现在: a stored receipt answers first (replayed, or conflict for
    another command under its op); its digest is SHA-256 of the command's canonical JSON."""

    def test_the_articles_query_runs_unchanged_on_a_database_made_by_init(self):
        op = "job-1"
        self.assertEqual(self.x(op), APPLIED)
        old = self.c.execute('SELECT digest,result FROM receipt WHERE op=?', (op,)).fetchone()
        self.assertEqual((old[0], json.loads(old[1])), (digest_of(plan()), APPLIED))
        replayed = {"status": "replayed", "result": APPLIED}
        self.assertEqual(pre.history(self.c, op, old[0]), replayed)
        self.assertEqual(pre.history(self.c, op, digest_of(plan(b=2))), {"status": "conflict"})
        self.assertIsNone(pre.history(self.c, "job-2", old[0]))

    def test_a_lost_ack_retry_is_replayed_from_history_not_stale(self):
        # This reply is "lost".
        first = self.x("job-1")
        self.change("other-1", "A", -1)
        self.change("other-2", "B", 5)
        self.assertEqual(self.x("job-1", c=self.open()), {"status": "replayed", "result": first})
        # History, not the present (A = 6, B = 8 now).
        self.assertEqual(first, APPLIED)
        self.assertEqual(self.figures(), ({"A": (6, 3), "B": (8, 3)}, 1, 3))

    def test_another_command_under_the_same_op_is_conflict_and_not_stored(self):
        self.x("job-1")
        for command in (plan(a=2, b=2), plan(amount=2), plan(src="B", dst="A")):
            with self.subTest(command=command):
                self.assertEqual(self.x("job-1", command), {"status": "conflict"})
        self.assertEqual(self.figures(), AFTER_APPLIED)

    def test_the_stored_digest_is_sha256_of_sorted_key_compact_utf8_json(self):
        commands = [plan(), plan(b=2), plan(src="中文", dst="ascii"),
                    plan(src="é\"\\\n", dst="\u2028 Z", a=pre.MAX_INT64, amount=7)]
        for number, command in enumerate(commands):
            with self.subTest(command=command):
                self.x(f"op-{number}", command)
                self.assertEqual(pre._dumps(command), json.dumps(
                    command, sort_keys=True, separators=(",", ":"), ensure_ascii=False))
                [(stored,)] = self.c.execute("SELECT digest FROM receipt WHERE op = ?",
                                             (f"op-{number}",))
                self.assertEqual(stored, digest_of(command))
        self.assertNotEqual(digest_of(plan()), digest_of(plan(b=2)))


# === 第七篇 §3: the check and the write in one transaction ====================================

class CheckAndWriteShareOneTransaction(Case):
    """§3 检查通过后再放开锁: the unsafe check-then-act builds on a change made between its check
    and its write; execute() checks and writes in one BEGIN IMMEDIATE transaction."""

    def test_unsafe_check_then_act_builds_on_a_change_the_safe_entry_rejects_as_stale(self):
        # Each in a child of the driver held at READY (the unsafe one between its check and its
        # write) while B changes, then released by GO.
        outcomes = {}
        for name in ("unsafe", "safe"):
            db = self.make_db(name=name + ".db")
            child = run_experiment.spawn(None, run_experiment.answer, run_experiment.executor,
                                         (db, "job-1", plan(), True, name == "unsafe"))
            try:
                self.assertEqual(child.readline(), "READY")
                with contextlib.closing(pre.connect(db)) as other:
                    self.change("other-1", "B", 2, c=other)
                code, lines = run_experiment.finish(child, "GO\n")
            finally:
                run_experiment.reap([child])
            self.assertEqual(code, 0)
            outcomes[name] = (json.loads(lines[-1])["status"], self.figures(db))
        # A = 7, B = 5: the unsafe entry moved 3 on top of B's +2.
        self.assertEqual(outcomes["unsafe"], ("applied", ({"A": (7, 2), "B": (5, 3)}, 1, 2)))
        # A = 10, B = 2: the safe entry saw B's new revision.
        self.assertEqual(outcomes["safe"], ("stale", ({"A": (10, 1), "B": (2, 2)}, 0, 2)))

    def test_the_check_and_the_write_run_under_one_write_lock(self):
        other = self.open()
        other.execute("PRAGMA busy_timeout = 0")
        statements, locked = [], []

        def trace(statement):
            statements.append(" ".join(statement.split()[:2]).upper())
            # The check: another writer must be shut out while it runs.
            if statement.startswith("SELECT name, quantity, revision"):
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
        self.assertEqual(locked, [f"{self.db}: database is locked"])
        self.assertEqual((statements[0], statements[-1]), ("BEGIN IMMEDIATE", "COMMIT"))
        # Both rows, the effect and the receipt: one transaction.
        writes = [s for s in statements if s.startswith(("BEGIN", "COMMIT", "UPDATE", "INSERT"))]
        self.assertEqual(writes, ["BEGIN IMMEDIATE", "UPDATE RESOURCES", "UPDATE RESOURCES",
                                  "INSERT INTO", "INSERT INTO", "COMMIT"])

    def test_a_lock_held_past_busy_timeout_is_database_is_locked_and_stores_nothing(self):
        holder = self.open()
        # Shorter than BUSY_TIMEOUT, so that the test does not wait 10 s.
        self.c.execute("PRAGMA busy_timeout = 1")
        with pre.transaction(holder):
            with self.assertRaisesRegex(sqlite3.OperationalError, "database is locked"):
                self.x("job-1")
            with self.assertRaisesRegex(sqlite3.OperationalError, "database is locked"):
                self.change("other-1", "B", 2)
        self.assertFalse(self.c.in_transaction)
        self.assertEqual(self.figures(), START)
        self.assertEqual(self.x("job-1"), APPLIED)


# === 第七篇 §4: revisions, not values; change(); integers at their bounds ====================

class RevisionsNotQuantitiesDecide(Case):
    """§4 版本不能只是当前值换了个名字: a quantity back where it was is still a new revision, and a
    stale plan is stale before any other check."""

    def test_aba_same_quantity_new_revision_makes_the_old_plan_stale(self):
        self.change("take", "A", -1)
        self.change("give-back", "A", 1)
        self.assertEqual(self.x("job-1"), {"status": "stale", "observed": {"A": 3, "B": 1}})
        # A = 10 again, at revision 3.
        self.assertEqual(self.figures(), ({"A": (10, 3), "B": (0, 1)}, 0, 3))

    def test_a_plan_both_stale_and_too_large_is_stale_first_in_the_articles_order(self):
        self.change("other-1", "B", 2)
        self.assertEqual(self.x("job-1", plan(amount=11)),
                         {"status": "stale", "observed": {"A": 1, "B": 2}})


class ChangeIsAnOperationLikeATransfer(Case):
    """§4 change 入口每次写入都增加 revision: every change bumps the revision and records one row;
    beyond 第七篇, it has an op id and a stored receipt in the same transaction, as execute() has."""

    def test_change_always_bumps_the_revision_and_records_one_row(self):
        for op, delta, quantity, revision in (("c-1", -1, 9, 2), ("c-2", 0, 9, 3),
                                              ("c-3", 1, 10, 4)):
            self.assertEqual(self.change(op, "A", delta), {
                "status": "changed", "name": "A", "quantity": quantity, "revision": revision})
        self.assertEqual(self.sql("SELECT op, name, delta, revision FROM changes ORDER BY op"),
                         [("c-1", "A", -1, 2), ("c-2", "A", 0, 3), ("c-3", "A", 1, 4)])

    def test_a_change_is_replayed_under_its_op_and_another_delta_is_conflict(self):
        first = self.change("op-1", "A", 5)
        self.assertEqual(first, {"status": "changed", "name": "A", "quantity": 15, "revision": 2})
        self.assertEqual(self.change("op-1", "A", 5), {"status": "replayed", "result": first})
        self.assertEqual(self.change("op-1", "A", 6), {"status": "conflict"})
        self.assertEqual(self.change("op-1", "B", 5), {"status": "conflict"})
        # One op namespace for both writes.
        self.assertEqual(self.x("op-1"), {"status": "conflict"})
        self.assertEqual(self.figures(), ({"A": (15, 2), "B": (0, 1)}, 0, 1))

    def test_a_change_planned_on_revisions_the_resource_no_longer_has_is_stale_and_stored(self):
        # Beyond 第七篇: a change that depends on A's revision, as If-Match does over HTTP.
        applied = pre.change(self.c, "c-1", "A", -1, issued_at=0, now=0, expected=[1])
        self.assertEqual(applied["revision"], 2)
        stale = pre.change(self.c, "c-2", "A", 1, issued_at=0, now=0, expected=[1, 7])
        self.assertEqual(stale, {"status": "stale", "observed": {"A": 2}})
        # The receipt answers first, and the revisions are part of the command.
        self.assertEqual(pre.change(self.c, "c-2", "A", 1, issued_at=0, now=0,
                                    expected=[7, 1, 1]), {"status": "replayed", "result": stale})
        self.assertEqual(pre.change(self.c, "c-2", "A", 1, issued_at=0, now=0, expected=[2]),
                         {"status": "conflict"})
        self.assertEqual(pre.change(self.c, "c-2", "A", 1, issued_at=0, now=0),
                         {"status": "conflict"})
        # Matching none, an empty list is always stale; a revision below 1 is bad input.
        self.assertEqual(pre.change(self.c, "c-3", "A", 1, issued_at=0, now=0,
                                    expected=[])["status"], "stale")
        for bad in ([0], [True], ["2"], 2, (revision for revision in [2]), {2: "A"}, "2"):
            with self.subTest(expected=bad), self.assertRaises((TypeError, ValueError)):
                pre.change(self.c, "c-4", "A", 1, issued_at=0, now=0, expected=bad)
        self.assertEqual(self.figures(), ({"A": (9, 2), "B": (0, 1)}, 0, 3))
        # Refused before anything was stored, the op is not spent: with the revisions as a
        # tuple or a set it changes A.
        self.assertEqual(pre.change(self.c, "c-4", "A", 1, issued_at=0, now=0,
                                    expected=(2,))["status"], "changed")
        self.assertEqual(pre.change(self.c, "c-4", "A", 1, issued_at=0, now=0,
                                    expected={2})["status"], "replayed")

    def test_a_change_redone_by_a_new_process_after_the_first_ended_changes_a_once(self):
        outputs = [cli("change", self.db, "op-1", "A", 5, "--now", 0) for _ in range(2)]
        changed = {"status": "changed", "name": "A", "quantity": 15, "revision": 2}
        self.assertEqual([(code, json.loads(out), err) for code, out, err in outputs],
                         [(0, changed, ""), (0, {"status": "replayed", "result": changed}, "")])
        # A = 15 from 10.
        self.assertEqual(self.figures()[0]["A"], (15, 2))
        self.assertEqual(self.sql("SELECT op, name, delta FROM changes"), [("op-1", "A", 5)])

    def test_change_refusals_are_stored_receipts_and_change_nothing(self):
        self.sql("UPDATE resources SET quantity = ? WHERE name = 'B'", (pre.MAX_INT64,))
        refusals = {("c-1", "Z", 1): {"status": "missing_resource", "missing": ["Z"]},
                    ("c-2", "A", -11): {"status": "insufficient", "available": 10},
                    ("c-3", "B", 1): {"status": "overflow", "resource": "B", "column": "quantity"}}
        for (op, name, delta), refusal in refusals.items():
            self.assertEqual(self.change(op, name, delta), refusal)
        self.sql("UPDATE resources SET revision = ? WHERE name = 'A'", (pre.MAX_INT64,))
        self.assertEqual(self.change("c-4", "A", -1),
                         {"status": "overflow", "resource": "A", "column": "revision"})
        self.assertEqual(self.figures(),
                         ({"A": (10, pre.MAX_INT64), "B": (pre.MAX_INT64, 1)}, 0, 4))
        self.assertEqual(self.sql("SELECT count(*) FROM changes"), [(0,)])


class IntegersStopAtInt64(Case):
    """§4 整数也需要边界: a revision at SQLite's int64 maximum, or a destination quantity that
    would pass it, is refused as overflow; exactly 0 and exactly the maximum fit."""

    def test_revisions_at_int64_max_are_refused_as_overflow_and_stored(self):
        for full in ("A", "B"):
            with self.subTest(full=full):
                self.sql("UPDATE resources SET revision = 1")
                self.sql("UPDATE resources SET revision = ? WHERE name = ?", (pre.MAX_INT64, full))
                command = plan(**{full.lower(): pre.MAX_INT64})
                self.assertEqual(self.x("job-" + full, command),
                                 {"status": "overflow", "resource": full, "column": "revision"})
                # No effect, and the refusal's receipt stored.
                self.assertEqual(self.figures()[1:], (0, "AB".index(full) + 1))

    def test_destination_quantity_overflow_is_refused_and_the_exact_maximum_fits(self):
        self.sql("UPDATE resources SET quantity = ? WHERE name = 'B'", (pre.MAX_INT64 - 2,))
        self.assertEqual(self.x("job-1", plan(amount=3)),
                         {"status": "overflow", "resource": "B", "column": "quantity"})
        self.assertEqual(self.figures(), ({"A": (10, 1), "B": (pre.MAX_INT64 - 2, 1)}, 0, 1))
        self.assertEqual(self.x("job-2", plan(amount=2))["status"], "applied")
        self.assertEqual(self.sql("SELECT quantity, typeof(quantity) FROM resources"
                                  " WHERE name = 'B'"), [(pre.MAX_INT64, "integer")])

    def test_a_plan_may_move_everything_and_a_change_may_reach_exactly_0_or_the_maximum(self):
        self.assertEqual(self.x("job-1", plan(amount=10)), {
            "status": "applied", "revisions": {"A": 2, "B": 2}, "quantities": {"A": 0, "B": 10}})
        self.assertEqual(self.change("c-1", "B", -10)["quantity"], 0)
        self.assertEqual(self.change("c-2", "B", pre.MAX_INT64)["quantity"], pre.MAX_INT64)
        self.assertEqual(self.figures(), ({"A": (0, 2), "B": (pre.MAX_INT64, 4)}, 1, 3))


# === 第七篇 §5: rejections are remembered ===================================================

class RejectionsReplayAndAReplanNeedsANewId(Case):
    """§5 拒绝也要有记忆，重规划不能伪装成重试: a stored rejection replays even once the state would
    allow the plan; a replan under the old id is conflict, under a new id it applies."""

    def test_stale_insufficient_and_missing_replay_after_the_state_would_allow_them(self):
        self.change("other-1", "B", 2)
        # Each rejection, then what would let the plan through (for stale: a restored backup).
        cases = [("stale", plan(), {"status": "stale", "observed": {"A": 1, "B": 2}},
                  "UPDATE resources SET revision = 1 WHERE name = 'B'"),
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
        # A conflict is not stored.
        self.assertEqual(self.figures(), ({"A": (10, 1), "B": (2, 2)}, 0, 2))
        self.assertEqual(self.x("job-2", replanned)["status"], "applied")
        self.assertEqual(self.figures(), ({"A": (7, 2), "B": (5, 3)}, 1, 3))


# === 第七篇 §6: crashes, races and many processes ============================================

class CrashesLeaveAllOrNothing(Case):
    """§6 扣完 A 就崩溃: a real exit at each boundary (71, 72, 73) and a trigger aborting the
    transaction leave all or nothing, and a new process's retry answers right."""

    def test_the_exit_codes_are_the_articles(self):
        self.assertEqual(pre.EXIT_CODES,
                         {"after_source_update": 71, "before_commit": 72, "after_commit": 73})

    def test_a_crash_at_each_boundary_is_all_or_nothing_and_a_new_process_retries_right(self):
        command = json.dumps(plan())
        for boundary, code in pre.EXIT_CODES.items():
            with self.subTest(boundary):
                db = self.make_db(name=boundary + ".db")
                # The child says where it died, and nothing more.
                said = f"preconditions.py: died at {boundary} (exit {code})\n"
                self.assertEqual(cli("execute", db, "job-1", command, "--now", 0,
                                     "--crash", boundary), (code, "", said))
                committed = boundary == "after_commit"
                self.assertEqual(self.figures(db), AFTER_APPLIED if committed else START)
                retry_code, out, _ = cli("execute", db, "job-1", command, "--now", 0)
                expected = {"status": "replayed", "result": APPLIED} if committed else APPLIED
                self.assertEqual((retry_code, json.loads(out)), (0, expected))
                self.assertEqual(self.figures(db), AFTER_APPLIED)

    def test_a_stale_rejection_committed_before_the_exit_is_replayed(self):
        self.change("other-1", "B", 2)
        self.release()
        command = json.dumps(plan())
        crashed = cli("execute", self.db, "job-1", command, "--now", 0, "--crash", "after_commit")
        self.assertEqual(crashed[0], 73)
        code, out, _ = cli("execute", self.db, "job-1", command, "--now", 0)
        self.assertEqual((code, json.loads(out)), (0, {
            "status": "replayed", "result": {"status": "stale", "observed": {"A": 1, "B": 2}}}))
        self.assertEqual(self.figures(), ({"A": (10, 1), "B": (2, 2)}, 0, 2))

    def test_every_crash_point_is_an_exit_code_key_once_and_there_are_no_fault_parameters(self):
        with open(MODULE, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        points = collections.Counter(
            node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "crash_point" and node.args
            and isinstance(node.args[0], ast.Constant))
        self.assertEqual(points, collections.Counter(list(pre.EXIT_CODES)))
        for name in pre.__all__:
            function = getattr(pre, name)
            with self.subTest(name):
                self.assertFalse({"fault", "crash"} & set(inspect.signature(function).parameters))
        self.assertEqual(cli("execute", self.db, "job-1", json.dumps(plan()), "--now", 0,
                             "--crash", "after_everything")[0], 2)
        self.assertEqual(self.figures(), START)

    def test_a_trigger_aborting_the_destination_update_or_the_receipt_leaves_nothing(self):
        for table, event in (("resources", "UPDATE ON resources WHEN NEW.name = 'B'"),
                             ("receipt", "INSERT ON receipt")):
            with self.subTest(table):
                self.sql(f"CREATE TRIGGER fault BEFORE {event}"
                         " BEGIN SELECT RAISE(ABORT, 'injected fault'); END")
                with self.assertRaisesRegex(sqlite3.IntegrityError, "injected fault"):
                    self.x("job-1")
                self.assertFalse(self.c.in_transaction)
                self.assertEqual(self.figures(), START)
                self.sql("DROP TRIGGER fault")
        self.assertEqual(self.x("job-1"), APPLIED)


class RacersOnOneSnapshotDecideOnce(Case):
    """§6 并发部分: 8 threads with their own connections, released together, submit 16 ops: on one
    snapshot one applies; 16 copies of one op apply once; the unsafe entry applies every one."""

    def test_16_distinct_ops_on_one_snapshot_give_1_applied_and_15_stale(self):
        self.assertEqual(thread_race(self.db, transfer, [f"job-{k}" for k in range(16)]),
                         {"applied": 1, "stale": 15})
        self.assertEqual(self.figures(), ({"A": (7, 2), "B": (3, 2)}, 1, 16))

    def test_16_copies_of_one_op_give_1_applied_and_15_replayed(self):
        self.assertEqual(thread_race(self.db, transfer, ["job-1"] * 16),
                         {"applied": 1, "replayed": 15})
        self.assertEqual(self.figures(), AFTER_APPLIED)

    def test_the_barrier_catches_a_non_atomic_check_then_write_every_time(self):
        # Room for every transfer: only the race decides.
        db = self.make_db({"A": 100, "B": 0}, "unsafe.db")
        # All four have checked before any of them writes.
        in_between = threading.Barrier(4)

        def unsafe(connection, op):
            return pre.unsafe_check_then_act(connection, op, plan(),
                                             pause=lambda: in_between.wait(timeout=WATCHDOG))

        # Four transfers built on one snapshot's revisions.
        self.assertEqual(thread_race(db, unsafe, [f"job-{k}" for k in range(4)], threads=4),
                         {"applied": 4})
        self.assertEqual(self.figures(db)[1], 4)


class ManyAgentsKilledAtOnceLoseNothing(Case):
    """§6, with many agents on one machine: processes open, transfer, change, replay, checkpoint
    and close one file at once while some are SIGKILLed; every open succeeds, nothing is lost."""

    def test_agents_opening_writing_closing_and_killed_at_once_lose_nothing_and_all_connect(self):
        # The next test runs this one again with /proc hidden: nothing here may need it.
        self.assertFalse(os.environ.get("PROC_HIDDEN") and os.path.exists("/proc/self"))
        db = self.make_db(MANY_RESOURCES, "many.db")
        results = race(functools.partial(many_agents, agent_transfers, db, self.dir), MANY_AGENTS,
                       may_die=True)
        self.assertEqual([r for r in results if r not in ("done", None)], [])
        # The seed kills some agents, and each kill is a SIGKILL.
        self.assertIn(None, results)
        connection = self.open(db)
        stored = {op: json.loads(result)
                  for op, result in connection.execute("SELECT op, result FROM receipt")}
        effects = connection.execute("SELECT op, src, dst, amount FROM effects").fetchall()
        changes = connection.execute("SELECT op, name, delta FROM changes").fetchall()
        for index in range(MANY_AGENTS):
            for line in file_bytes(os.path.join(self.dir, f"agent-{index}")).splitlines():
                op, answer = json.loads(line)
                # Every answer given is the decision committed.
                with self.subTest(op=op):
                    self.assertEqual(answer.get("result", answer), stored[op])
        for rows, status in ((effects, "applied"), (changes, "changed")):
            self.assertEqual(sorted(op for op, *_ in rows),
                             sorted(op for op, result in stored.items()
                                    if result["status"] == status))
        for name, (quantity, revision) in self.figures(db)[0].items():
            # Each write moved a revision once, and no unit is lost.
            with self.subTest(name=name):
                flows = ([amount * ((dst == name) - (src == name))
                          for _, src, dst, amount in effects if name in (src, dst)]
                         + [delta for _, n, delta in changes if n == name])
                self.assertEqual((quantity, revision),
                                 (MANY_RESOURCES[name] + sum(flows), 1 + len(flows)))
        self.assertEqual(connection.execute("PRAGMA integrity_check").fetchall(), [("ok",)])

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


# === 第七篇 §7: an undeclared dependency =====================================================

class AnUndeclaredDependencyIsNotChecked(Case):
    """§7 依赖没写进契约: C changes, the plan declared only A and B, so it applies."""

    def test_a_change_to_c_does_not_block_a_plan_that_declared_only_a_and_b(self):
        db = self.make_db({"A": 10, "B": 0, "C": 5}, "abc.db")
        c = self.open(db)
        self.change("other-1", "C", -1, c=c)
        self.assertEqual(self.x("job-1", c=c), APPLIED)
        # C = 4 from 5, and nothing looked at it.
        self.assertEqual(self.figures(db), ({"A": (7, 2), "B": (3, 2), "C": (4, 2)}, 1, 2))


# === beyond 第七篇: ticks, retention, the files and the command line ========================

class TicksAreRequiredBoundedAndNeverBackwards(Case):
    """Beyond 第七篇: logical ticks are required keyword ints; nothing is acted on before it was
    issued."""

    def test_missing_ticks_are_a_type_error(self):
        for call in (lambda: pre.execute(self.c, "job-1", plan()),
                     lambda: pre.execute(self.c, "job-1", plan(), now=0),
                     lambda: pre.change(self.c, "op-1", "A", 1), lambda: pre.purge(self.c)):
            with self.assertRaises(TypeError):
                call()
        self.assertEqual(self.figures(), START)

    def test_ticks_that_go_backwards_or_are_not_bounded_ints_raise_and_store_nothing(self):
        for write in (self.x, lambda op, **ticks: self.change(op, "A", 1, **ticks)):
            with self.assertRaisesRegex(ValueError, "backwards"):
                write("job-1", issued_at=5, now=4)
            for issued_at, now in ((-1, 0), (0, -1), (True, 3), (1, 2.0), (None, 0),
                                   (0, pre.MAX_TICK + 1)):
                with self.subTest(issued_at=issued_at, now=now), self.assertRaises(ValueError):
                    write("job-1", issued_at=issued_at, now=now)
        self.assertEqual(self.figures(), START)
        self.assertEqual(self.x("job-1", issued_at=pre.MAX_TICK, now=pre.MAX_TICK), APPLIED)


class PurgedOpsAnswerExpired(Case):
    """Beyond 第七篇 (§5: "本例没有实现回执清理"): purge() deletes receipts before a low-water mark;
    a late retry of an op issued before it is "expired", never decided again."""

    def test_purge_deletes_the_receipts_written_before_now_minus_window_and_keeps_the_mark(self):
        # job-2, stale, is stored at tick 50 (its now, not its issue tick 0): exactly the mark.
        self.x("job-1", issued_at=3, now=49)
        self.x("job-2", now=50)
        self.assertEqual(pre.purge(self.c, 100, 50), {"deleted": 1, "low_water": 50})
        self.assertEqual(self.receipts(), ([("job-2", 50)], 50))

    def test_purge_refuses_a_bad_window_or_a_mark_moving_backwards_and_changes_nothing(self):
        pre.purge(self.c, 100, 50)
        self.x("job-1", issued_at=60, now=60)
        for now, window in ((100, 0), (100, -5), (100, True), (100, 2.0), (80, 50), (-1, 5)):
            with self.subTest(now=now, window=window), self.assertRaises(ValueError):
                pre.purge(self.c, now, window)
        self.assertEqual(self.receipts(), ([("job-1", 60)], 50))

    def test_an_op_issued_before_the_mark_or_whose_receipt_was_purged_is_expired(self):
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
        late = self.x("job-2", plan(a=2, b=2), issued_at=50, now=100)
        self.assertEqual(late["status"], "applied")

    def test_a_change_whose_receipt_was_purged_is_expired_like_a_transfer(self):
        # Its row in changes remembers it, as an effect row does a transfer: an IntegrityError
        # from changes.op would be no answer.
        self.change("op-1", "A", 5, issued_at=0, now=0)
        pre.purge(self.c, 100, 50)
        self.assertEqual(self.change("op-1", "A", 5, issued_at=60, now=100),
                         {"status": "expired", "low_water": 50})
        self.assertEqual(self.figures()[0]["A"], (15, 2))

    def test_a_cli_retry_at_its_original_issue_tick_after_purge_is_expired(self):
        stale = json.dumps(plan(a=2))
        code, out, _ = cli("execute", self.db, "job-1", stale, "--now", 1)
        self.assertEqual((code, json.loads(out)["status"]), (0, "stale"))
        pre.purge(self.c, 50, 10)
        self.release()
        code, out, _ = cli("execute", self.db, "job-1", stale, "--now", 50, "--issued-at", 1)
        self.assertEqual((code, json.loads(out)), (0, {"status": "expired", "low_water": 40}))
        # Decided once, never again.
        self.assertEqual(self.figures(), ({"A": (10, 1), "B": (0, 1)}, 0, 0))


class OnlyAnExistingDatabaseOfOursOpens(Case):
    """Beyond 第七篇: connect() lets SQLite decide and opens only an existing database of this
    module and schema, as WAL with synchronous=FULL; every refusal names the path, before
    anything is written."""

    def test_missing_directory_garbage_empty_and_foreign_files_are_refused_naming_the_path(self):
        self.assert_refused(os.path.join(self.dir, "missing.db"), sqlite3.OperationalError)
        self.assert_refused(os.path.join(self.dir, "missing", "q.db"), sqlite3.OperationalError)
        self.assert_refused(self.dir, sqlite3.OperationalError)
        for name, content in (("garbage.db", b"not a database, just bytes\n" * 200),
                              ("empty.db", b"")):
            with open(os.path.join(self.dir, name), "wb") as handle:
                handle.write(content)
        foreign = sqlite3.connect(os.path.join(self.dir, "foreign.db"))
        foreign.execute("CREATE TABLE resources (name TEXT)")
        foreign.close()
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
        before = file_bytes(old)
        self.assertEqual(pre.SCHEMA_VERSION, 2)
        self.assert_refused(old, sqlite3.DatabaseError, "schema version 1")
        with self.assertRaisesRegex(sqlite3.DatabaseError, r"schema version 1\b.*\b2\b"):
            pre.connect(old)
        self.assertEqual(file_bytes(old), before)

    def test_a_database_with_a_second_name_is_refused_naming_the_path(self):
        alias = os.path.join(self.dir, "alias.db")
        # Each name would keep its own -wal.
        os.link(self.db, alias)
        for path in (self.db, alias):
            with self.subTest(path=path):
                self.assert_refused(path, OSError, "more than one name")
        os.remove(alias)
        self.assertEqual(self.figures(), START)

    def test_an_unreadable_or_read_only_file_or_directory_is_refused_naming_it(self):
        folder = os.path.join(self.dir, "shared")
        os.mkdir(folder)
        # Nobody may look inside; and the temporary directory can go whatever the test did.
        os.chmod(self.dir, 0o755)
        self.addCleanup(os.chmod, folder, 0o755)
        # Another user must pass through every folder above (TMPDIR may be private).
        if not run_experiment.run_forked(lambda: _become_nobody() or os.path.exists(folder)):
            self.skipTest(f"another user cannot reach {folder}: TMPDIR is private")
        for name, file_mode, folder_mode in (("unreadable.db", 0o000, 0o755),
                                             ("read-only.db", 0o444, 0o755),
                                             ("in-read-only-dir.db", 0o666, 0o555),
                                             ("in-unsearchable-dir.db", 0o666, 0o666)):
            with self.subTest(name):
                path = os.path.join(folder, name)
                os.chmod(folder, 0o755)
                pre.init(path, {"A": 1})
                os.chmod(path, file_mode)
                os.chmod(folder, folder_mode)
                text = run_experiment.run_forked(connect_as_nobody, path)
                os.chmod(folder, 0o755)
                self.assertTrue(text.startswith(("PermissionError: ", "OperationalError: ")),
                                text)
                self.assertIn(path, text)
                # Nothing made.
                self.assertEqual([n for n in os.listdir(folder)
                                  if n.endswith(("-wal", "-shm"))], [])
        # The control: the same user opens a file it may read and write.
        os.chmod(folder, 0o777)
        os.chmod(path, 0o666)
        self.assertEqual(run_experiment.run_forked(connect_as_nobody, path), "opened")

    def test_a_wal_or_shm_it_may_not_use_is_one_error_naming_a_path_and_nothing_is_removed(self):
        # Whatever stands where SQLite keeps the -wal or -shm, the write fails in one line that
        # names the database or that file; nothing is stored, and nothing of the user's goes.
        for number, (label, (suffix, kind)) in enumerate(COMPANIONS.items()):
            with self.subTest(label):
                path = self.make_db(name=f"{number}.db")
                open_to_nobody(self, self.dir, path)
                left_open(path)
                if not spoiled(path + suffix, kind):
                    self.skipTest(f"{label}: needs root")
                before = file_bytes(path), kind_of(path + "-wal"), kind_of(path + suffix)
                text = run_experiment.run_forked(write_as_nobody, path, write_the_plan)
                self.assertEqual(len(text.splitlines()), 1, text)
                self.assertTrue(text.startswith(("OSError: ", "OperationalError: ")), text)
                self.assertIn(path, text)
                self.assertEqual((file_bytes(path), kind_of(path + "-wal"),
                                  kind_of(path + suffix)), before)

    def test_a_read_only_copy_renamed_over_the_file_after_the_check_fails_its_first_write(self):
        # Between connect()'s own check and SQLite's open: SQLite opens the copy read-only and
        # says so at the first write, which names the path.
        copy = os.path.join(self.dir, "copy.db")
        shutil.copyfile(self.db, copy)
        os.chmod(copy, 0o444)
        open_to_nobody(self, self.dir, self.db)
        text = run_experiment.run_forked(write_as_nobody, self.db, write_the_plan,
                                         lambda: os.rename(copy, self.db))
        self.assertEqual(text, f"OperationalError: {self.db}: attempt to write a readonly"
                               " database")
        self.assertEqual(file_bytes(self.db), file_bytes(TEMPLATE["path"]))

    def test_a_symlink_to_a_hard_linked_or_read_only_database_is_refused_like_the_file(self):
        link = os.path.join(self.dir, "link.db")
        os.symlink(self.db, link)
        open_to_nobody(self, self.dir, self.db)
        os.link(self.db, self.db + ".second")
        refused = [run_experiment.run_forked(connect_as_nobody, name) for name in (self.db, link)]
        self.assertIn("more than one name", refused[0])
        self.assertEqual(refused[1], refused[0].replace(self.db, link))
        os.remove(self.db + ".second")
        os.chmod(self.db, 0o444)
        refused = [run_experiment.run_forked(connect_as_nobody, name) for name in (self.db, link)]
        self.assertIn("not writable", refused[0])
        self.assertEqual(refused[1], refused[0].replace(self.db, link))

    def test_each_spelling_of_a_name_is_checked_as_the_very_file_sqlite_opens(self):
        os.link(self.db, self.db + ".second")
        # A trailing / and a .. after a folder that is not there: both spell self.db.
        for name in (self.db + "/", os.path.join(self.dir, "nowhere", "..", "t.db")):
            with self.subTest(name=name), self.assertRaises(OSError) as refused:
                pre.connect(name).close()
            self.assertEqual(refused.exception.errno, errno.EMLINK)
        # A .. after a link to a folder elsewhere: the file beside that folder, not self.db.
        elsewhere = os.path.join(self.dir, "elsewhere")
        os.makedirs(os.path.join(elsewhere, "deep"))
        os.symlink(os.path.join(elsewhere, "deep"), os.path.join(self.dir, "lnk"))
        pre.init(os.path.join(elsewhere, "t.db"), {"C": 3})
        with contextlib.closing(pre.connect(os.path.join(self.dir, "lnk", "..", "t.db"))) as c:
            self.assertEqual(c.execute("SELECT name FROM resources").fetchall(), [("C",)])

    def test_paths_with_uri_special_characters_open_exactly_the_file_named(self):
        folder = os.path.join(self.dir, "odd %41 #dir?")
        os.mkdir(folder)
        path = os.path.join(folder, "odd ?name#%41.db")
        pre.init(path, {"A": 1, "B": 2})
        self.assertEqual(self.figures(path)[0], {"A": (1, 1), "B": (2, 1)})
        with self.assertRaises(sqlite3.OperationalError):
            pre.connect(os.path.join(folder, "odd ?other.db"))
        self.assertEqual(sorted(os.listdir(folder)), ["odd ?name#%41.db"])

    def test_every_connection_reports_wal_synchronous_full_foreign_keys_and_the_busy_timeout(self):
        for connection in (self.c, self.open()):
            self.assertIsNone(connection.isolation_level)
            self.assertEqual([connection.execute(f"PRAGMA {name}").fetchone()[0] for name in
                              ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")],
                             ["wal", 2, 1, pre.BUSY_TIMEOUT * 1000])

    def test_wal_reset_bug_names_exactly_the_affected_sqlite_versions(self):
        affected = [(3, 7, 0), (3, 40, 1), (3, 44, 5), (3, 45, 0), (3, 50, 6), (3, 51, 0),
                    (3, 51, 2)]
        fixed = [(3, 6, 23), (3, 44, 6), (3, 44, 9), (3, 50, 7), (3, 51, 3), (3, 52, 0)]
        bug = run_experiment.wal_reset_bug
        self.assertEqual([version for version in affected + fixed if bug(version)], affected)
        self.assertEqual(bug(), bug(sqlite3.sqlite_version_info))


class InitMakesAWholeDatabaseOrNothing(Case):
    """Beyond 第七篇: init() creates a new file or refuses before touching any; its kind and
    schema version commit with the schema."""

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
        self.assertEqual(file_bytes(notes), b"keep me")
        self.assertFalse(os.path.exists(reused))
        path = os.path.join(self.dir, "new.db")
        for resources, error in (({"A": True}, TypeError), ({"A": -1}, ValueError),
                                 ({"A": pre.MAX_INT64 + 1}, ValueError), ({}, ValueError),
                                 ({"": 1}, ValueError), ({"A\ud800": 1}, ValueError),
                                 ([("A", 1)], TypeError)):
            with self.subTest(resources=resources), self.assertRaises(error):
                pre.init(path, resources)
            self.assertFalse(os.path.exists(path))

    def test_a_path_starting_with_two_slashes_is_a_path_and_init_leaves_nothing_half_made(self):
        # //tmp/...: the same file to POSIX.
        path = "/" + os.path.join(self.dir, "p.db")
        self.assertIsNone(pre.init(path, {"A": 10, "B": 0}))
        self.assertEqual(self.figures(path), START)
        self.assertEqual(cli("purge", path, "--now", 100, "--window", 50)[0], 0)

    def test_the_kind_and_schema_version_commit_in_the_schemas_own_transaction(self):
        statements, connect = [], sqlite3.connect

        # Every connection init opens, its statements recorded.
        def traced(*args, **kwargs):
            connection = connect(*args, **kwargs)
            connection.set_trace_callback(statements.append)
            return connection
        with mock.patch("sqlite3.connect", traced):
            pre.init(os.path.join(self.dir, "traced.db"), {"A": 1})
        marker = statements.index(f"PRAGMA application_id = {pre.APPLICATION_ID}")
        self.assertEqual(statements[marker + 1], f"PRAGMA user_version = {pre.SCHEMA_VERSION}")
        self.assertEqual(statements[marker + 2], "COMMIT")
        self.assertEqual(statements[:3],
                         ["PRAGMA journal_mode=WAL", "BEGIN IMMEDIATE", pre.SCHEMA[0]])


class SnapshotReadsOneState(Case):
    """Beyond 第七篇: snapshot() is sorted, counts effects and receipts, and reads them in one read
    transaction, or inside the caller's."""

    def test_snapshot_is_sorted_counts_and_reads_inside_a_callers_transaction(self):
        c = self.open(self.make_db({"b": 1, "C": 2, "a": 3}, "many.db"))
        for op in ("job-1", "job-2"):
            self.x(op, plan(src="a", dst="b", amount=1), c=c)
        with pre.transaction(c):
            seen = pre.snapshot(c)
            self.assertTrue(c.in_transaction)
        self.assertEqual((list(seen["resources"]), seen["effects"], seen["receipts"]),
                         (["C", "a", "b"], 1, 2))

    def test_snapshot_reads_resources_and_counts_in_one_read_transaction(self):
        # A writer commits between snapshot's first read and its counts: they must not mix two
        # states.
        writer = self.open()

        class Between(sqlite3.Connection):
            def execute(self, sql, *args):
                if sql.startswith("SELECT count(*) FROM effects"):
                    pre.execute(writer, "job-1", plan(), issued_at=0, now=0)
                return super().execute(sql, *args)
        reader = sqlite3.connect(self.db, factory=Between, isolation_level=None)
        with contextlib.closing(reader):
            seen = pre.snapshot(reader)
        self.assertEqual((seen["resources"]["A"]["quantity"], seen["effects"], seen["receipts"]),
                         (10, 0, 0))
        # The write did land, after the snapshot's view.
        self.assertEqual(self.figures(), AFTER_APPLIED)


class TheCommandLineAnswersInOneUtf8Line(Case):
    """Beyond 第七篇: a reader stepping by hand (the driver's step): one JSON line of UTF-8 bytes
    whatever the locale, one line on stderr for a refusal; exit 0, 1, 2 or 71-73."""

    def test_a_step_lists_the_functions_and_takes_only_the_modules_own_boundaries(self):
        # Through sys.stdout: flushed before the exit.
        code, out, _ = cli("--help")
        self.assertEqual(code, 0)
        for function in ("init", "execute", "change", "purge", "snapshot", "history"):
            self.assertIn(function, out)
        for other in (["connect", self.db], ["transaction", self.db]):
            with self.subTest(other[0]):
                code, out, err = cli(*other)
                self.assertEqual((code, out, err.splitlines()[0]), (2, "", "usage: run_experiment"
                                 ".py preconditions FUNCTION ARG... [--NAME VALUE]..."))
                self.assertNotIn(other[0], err.splitlines()[1])
        for boundary in ("after_everything", "after_claim"):
            with self.subTest(boundary):
                code, out, err = cli("execute", self.db, "job-1", json.dumps(plan()), "--now", 0,
                                     "--crash", boundary)
                self.assertEqual((code, out, len(err.splitlines())), (2, "", 1), err)
        self.assertEqual(self.figures(), START)

    def test_the_driver_run_by_a_fresh_interpreter_exits_0_1_2_and_73(self):
        # The real entry point, `python3 -I -S run_experiment.py preconditions ...`, once per exit
        # code, side by side; the other tests fork main(argv) as the driver does.  The crash has
        # its own file: the snapshot beside it must not race it.
        crash = self.make_db(name="crash.db")
        commands = {0: ["snapshot", self.db],
                    1: ["snapshot", os.path.join(self.dir, "missing.db")], 2: ["bogus"],
                    73: ["execute", crash, "job-1", json.dumps(plan()), "--now", "0",
                         "--crash", "after_commit"]}
        done = run_together([[sys.executable, "-I", "-S", DRIVER, "preconditions", *argv]
                             for argv in commands.values()])
        self.assertEqual([code for code, _, _ in done], list(commands))
        self.assertEqual(json.loads(done[0][1])["receipts"], 0)
        self.assertTrue(done[1][2].startswith(b"run_experiment.py preconditions snapshot: "),
                        done[1][2])
        self.assertTrue(done[2][2].startswith(b"usage: "), done[2][2])
        # The crash came after COMMIT.
        self.assertEqual(self.figures(crash), AFTER_APPLIED)

    def test_exit_codes_and_utf8_output_whatever_the_locale(self):
        # Text streams that are not UTF-8, as an 8-bit locale makes them: the C locale with UTF-8
        # mode off and latin-1 streams (by default C means UTF-8; -I would ignore
        # PYTHONIOENCODING).
        legacy = without_python_variables(LC_ALL="C", LANG="C", PYTHONIOENCODING="latin-1")

        def in_legacy(*args):
            [done] = run_together([[sys.executable, "-S", "-X", "utf8=0", DRIVER, "preconditions",
                                    *map(str, args)]], env=legacy)
            return done
        db = os.path.join(self.dir, "cli.db")
        code, out, err = cli("init", db, '{"名额A": 10, "B": 0}')
        self.assertEqual((code, err), (0, ""))
        state = {"resources": {"B": {"quantity": 0, "revision": 1},
                               "名额A": {"quantity": 10, "revision": 1}},
                 "effects": 0, "receipts": 0}
        self.assertEqual((json.loads(out), json.loads(cli("snapshot", db)[1])), (None, state))
        # The child's text streams really are not UTF-8; the answer is UTF-8 bytes all the same.
        [probe] = run_together([[sys.executable, "-S", "-X", "utf8=0", "-c",
                                 "import sys; print(sys.stdout.encoding)"]], env=legacy)
        self.assertEqual(probe, (0, b"iso8859-1\n", b""))
        self.assertEqual(in_legacy("snapshot", db),
                         (0, pre._dumps(state).encode("utf-8") + b"\n", b""))
        for argv in [("execute", db), ("execute", db, "job-1", "{}"), ("init", db + "2"),
                     ("bogus",)]:
            with self.subTest(argv=argv):
                self.assertEqual(cli(*argv)[0], 2)
        refused = [("execute", db, "job-1", json.dumps(plan(src="名额A", amount=True)), "--now", 0),
                   ("execute", db, "job-1", '{"src": "A", "src": "B"}', "--now", 0),
                   ("execute", db, "job-1", json.dumps(plan()), "--now", -1),
                   ("snapshot", os.path.join(self.dir, "missing.db")), ("init", db, '{"A": 1}'),
                   ("init", db + "3", '{"A": 1, "A": 2}')]
        for argv in refused:
            with self.subTest(argv=argv):
                code, out, err = cli(*argv)
                self.assertEqual((code, out, len(err.splitlines())), (1, "", 1))
                self.assertTrue(err.startswith(f"run_experiment.py preconditions {argv[0]}: "),
                                err)
        self.assertFalse(os.path.exists(db + "3"))
        # json.dumps escapes 名额A, so the argument is ASCII; the answer names it in UTF-8.
        code, out, _ = in_legacy("execute", db, "job-1", json.dumps(plan(src="名额A")), "--now", 0)
        self.assertEqual((code, out.decode("utf-8")), (0, '{"quantities":{"B":3,"名额A":7},'
                                                          '"revisions":{"B":2,"名额A":2},'
                                                          '"status":"applied"}\n'))
        self.assertEqual(json.loads(cli("snapshot", db)[1])["receipts"], 1)
        # Non-ASCII arguments typed in that locale are read as the UTF-8 typed, not refused.
        code, out, err = in_legacy("change", db, "操作-1", "名额A", 1, "--now", 0)
        self.assertEqual((code, err), (0, b""))
        self.assertEqual(json.loads(out.decode("utf-8"))["name"], "名额A")
        # And init's resources typed in that locale: the resource is named as typed.
        code, out, err = in_legacy("init", db + ".typed", '{"名额B": 5}')
        self.assertEqual((code, err), (0, b""))
        self.assertEqual(list(json.loads(cli("snapshot", db + ".typed")[1])["resources"]),
                         ["名额B"])

    def test_the_command_line_refuses_a_repeated_key_in_one_line(self):
        # The last "src" would make this a valid plan; a repeated key is refused before it could.
        repeated = ('{"src": "B", "src": "A", "dst": "B", "amount": 3,'
                    ' "expected": {"A": 1, "B": 1}}')
        code, out, err = cli("execute", self.db, "job-1", repeated, "--now", 0)
        self.assertEqual((code, out, len(err.splitlines())), (1, "", 1))
        self.assertIn("repeats a key", err)
        self.assertEqual(self.figures(), START)

    def test_a_stored_result_nested_too_deeply_is_a_one_line_refusal_of_a_replay(self):
        # What another program could store.
        deep = "[" * 100000 + "]" * 100000
        self.x("job-1")
        self.change("change-1", "A", 1)
        self.sql("UPDATE receipt SET result = ?", (deep,))
        self.release()
        for argv in (("execute", self.db, "job-1", json.dumps(plan()), "--now", 0),
                     ("change", self.db, "change-1", "A", 1, "--now", 0)):
            with self.subTest(argv[0]):
                code, out, err = cli(*argv)
                self.assertEqual((code, out, len(err.splitlines())), (1, "", 1), err)
                self.assertTrue(err.startswith(f"run_experiment.py preconditions {argv[0]}:"
                                               " RecursionError: "), err)
        self.assertEqual(self.figures(), ({"A": (8, 3), "B": (3, 2)}, 1, 2))


# === the source itself: the article's code verbatim ==========================================

class TheSourceHoldsTheArticlesCode(unittest.TestCase):
    """The article's receipt query and article 1's transaction wrapper, verbatim."""

    def test_history_holds_the_articles_code_verbatim(self):
        # 第七篇 §2, as printed.
        article = ("old = c.execute(\n"
                   "    'SELECT digest,result FROM receipt WHERE op=?', (op,)\n"
                   ").fetchone()\n"
                   "if old:\n"
                   "    if old[0] != digest:\n"
                   "        return {'status': 'conflict'}\n"
                   "    return {'status': 'replayed', 'result': json.loads(old[1])}")
        indented = "\n".join("    " + line for line in article.splitlines())
        self.assertIn(indented, inspect.getsource(pre.history))

    def test_transaction_is_the_articles_wrapper_line_for_line(self):
        # 第一篇's wrapper, which both modules use.
        self.assertEqual(definitions(MODULE)["transaction"][1].splitlines(), [
            "@contextmanager",
            "def transaction(connection):",
            '    connection.execute("BEGIN IMMEDIATE")',
            "    try:",
            "        yield",
            '        connection.execute("COMMIT")',
            "    except BaseException:",
            "        if connection.in_transaction:",
            '            connection.execute("ROLLBACK")',
            "        raise"])


# === results.json as committed (--check reruns every scenario against it) ====================

class ResultsJsonHoldsTheArticlesFigures(unittest.TestCase):
    """第七篇's 11 scenario groups and the crash matrix's rows as results.json records them;
    ``run_experiment.py --check`` reruns every scenario and fails unless the run equals it, so
    these figures are the live ones."""

    def test_the_driver_names_exactly_the_articles_11_scenario_groups(self):
        self.assertEqual(ARTICLE_7, [
            "unsafe_check_then_act", "safe_stale_rejected", "lost_ack_replay", "replan_new_id",
            "aba_revision", "crash_points", "stale_rejection_durable", "trigger_faults",
            "concurrent_distinct_ops", "concurrent_same_op", "undeclared_dependency"])

    def test_results_json_holds_every_scenario_the_driver_registers_and_nothing_else(self):
        self.assertEqual(set(committed_results()["article_7"]), set(ARTICLE_7))
        self.assertEqual({name for name in committed_results()["crash_matrix"]
                          if name.startswith("preconditions/")}, set(MATRIX))

    def test_the_articles_figures(self):
        seven = committed_results()["article_7"]
        for name, quantities in (("unsafe_check_then_act", {"A": 7, "B": 5}),
                                 ("safe_stale_rejected", {"A": 10, "B": 2})):
            self.assertEqual(seven[name]["after_go"]["quantities"], quantities)
        for name, statuses in (("concurrent_distinct_ops", {"applied": 1, "stale": 15}),
                               ("concurrent_same_op", {"applied": 1, "replayed": 15})):
            after = seven[name]["after_race"]
            self.assertEqual((after["statuses"], after["effects"], after["released_together"]),
                             (statuses, 1, 8))
        self.assertEqual(seven["aba_revision"]["after_execute"]["revisions"]["A"], 3)
        self.assertEqual(seven["undeclared_dependency"]["after_execute"]["quantities"]["C"], 4)
        self.assertEqual({key.split(".")[0]: row["exit_code"]
                          for key, row in seven["crash_points"].items()
                          if key.endswith("after_crash")}, pre.EXIT_CODES)

    def test_every_boundary_has_a_crash_matrix_row_that_is_all_or_nothing(self):
        rows = committed_results()["crash_matrix"]
        self.assertEqual(MATRIX, [f"preconditions/{boundary}" for boundary in pre.EXIT_CODES])
        for boundary, code in pre.EXIT_CODES.items():
            committed = boundary == "after_commit"
            with self.subTest(boundary):
                self.assertEqual(rows[f"preconditions/{boundary}"]["fresh"], {
                    "exit_code": code, "effects_after_crash": int(committed),
                    "retry": "replayed" if committed else "applied", "outcome": "applied",
                    "effects": 1})
        self.assertEqual(rows["preconditions/after_commit"]["stale"], {
            "exit_code": 73, "effects_after_crash": 0, "retry": "replayed", "outcome": "stale",
            "effects": 0})


# === machinery ===============================================================================

HERE = os.path.dirname(os.path.abspath(__file__))
MODULE = os.path.join(HERE, "preconditions.py")
DRIVER = os.path.abspath(run_experiment.__file__)
# The module the twins below run: test_reliability.py's twins run reliability.py.
UNDER_TEST = pre
# Seconds: only ends a hung child, never asserted as a measurement.
# twin: identical in test_reliability.py
WATCHDOG = 60.0
ARTICLE_7 = [name for name, (article, _, _) in run_experiment.SCENARIOS.items()
             if article == "article_7"]
MATRIX = [name for name in run_experiment.SCENARIOS if name.startswith("preconditions/")]
# Agents, connections opened by each, and the seed of their choices.
# twin: identical in test_reliability.py
MANY_AGENTS, MANY_OPERATIONS, MANY_SEED = 3, 400, 7
MANY_RESOURCES = {"A": 1000, "B": 1000, "C": 1000, "D": 1000}
# An A = 10, B = 0 database made once by init(), byte-copied per test.
TEMPLATE = {}


def setUpModule():
    TEMPLATE["dir"] = tempfile.TemporaryDirectory()
    TEMPLATE["path"] = os.path.join(TEMPLATE["dir"].name, "template.db")
    pre.init(TEMPLATE["path"], {"A": 10, "B": 0})


# twin: identical in test_reliability.py
def tearDownModule():
    TEMPLATE.pop("dir").cleanup()


class Fixture:
    """A test's fresh temporary folder (dir) with an A = 10, B = 0 database (db) made by init(),
    and c, a connection to it opened on first use; release() closes it before a child opens the
    file.  Every connection opened here closes when the test ends."""

    def __init__(self, test):
        folder = tempfile.TemporaryDirectory()
        test.addCleanup(folder.cleanup)
        self.test, self.dir, self._c = test, folder.name, None
        self.db = self.make_db()

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
            # A byte copy of a closed database: no fsync per test.
            shutil.copyfile(TEMPLATE["path"], path)
        else:
            pre.init(path, resources)
        return path

    def open(self, path=None):
        connection = pre.connect(path or self.db)
        self.test.addCleanup(connection.close)
        return connection

    def x(self, op, command=None, *, c=None, issued_at=0, now=0):
        return pre.execute(c or self.c, op, plan() if command is None else command,
                           issued_at=issued_at, now=now)

    def change(self, op, name, delta, *, c=None, issued_at=0, now=0):
        return pre.change(c or self.c, op, name, delta, issued_at=issued_at, now=now)

    def figures(self, path=None):
        """({name: (quantity, revision)}, effects, receipts) from a fresh connection: what a
        recovering reader sees."""
        with contextlib.closing(pre.connect(path or self.db)) as connection:
            seen = pre.snapshot(connection)
        return ({name: (row["quantity"], row["revision"])
                 for name, row in seen["resources"].items()}, seen["effects"], seen["receipts"])

    def sql(self, statement, parameters=()):
        """Direct SQL behind the protocol's back: test set-up only."""
        with contextlib.closing(sqlite3.connect(self.db, isolation_level=None)) as connection:
            return connection.execute(statement, parameters).fetchall()

    def receipts(self):
        """([(op, tick)] of the stored receipts, the low-water mark)."""
        return (self.sql("SELECT op, tick FROM receipt ORDER BY op"),
                self.sql("SELECT low_water FROM retention")[0][0])

    def assert_refused(self, path, error, *fragments):
        """connect(path) raises ``error`` naming the path and ``fragments``, and every file in
        the folder keeps its size."""
        def sizes():
            return {name: os.path.getsize(os.path.join(self.dir, name))
                    for name in os.listdir(self.dir)}
        before = sizes()
        with self.test.assertRaises(error) as caught:
            pre.connect(path)
        for fragment in (path,) + fragments:
            self.test.assertIn(fragment, str(caught.exception))
        self.test.assertEqual(sizes(), before)


def plan(a=1, b=1, amount=3, src="A", dst="B"):
    return {"src": src, "dst": dst, "amount": amount, "expected": {src: a, dst: b}}


def transfer(connection, op):
    """The article's plan under ``op``, at tick 0."""
    return pre.execute(connection, op, plan(), issued_at=0, now=0)


def digest_of(command):
    """The digest as the article defines it, computed here independently of the module."""
    text = json.dumps(command, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# twin: identical in test_reliability.py
def file_bytes(path):
    with open(path, "rb") as handle:
        return handle.read()


def committed_results():
    with open(run_experiment.RESULTS, encoding="utf-8") as handle:
        return json.load(handle)


def without_python_variables(**extra):
    """This environment without PYTHON* variables, plus ``extra``."""
    return dict({key: value for key, value in os.environ.items() if not key.startswith("PYTHON")},
                **extra)


# --- children: the command line, fresh interpreters, racers and agents ----------------------

# twin: identical in test_reliability.py
def cli(*argv, stdin=b""):
    """A step by hand of UNDER_TEST (``run_experiment.py MODULE FUNCTION ARG...``), in a child
    forked as the driver forks its children: forked(run_experiment.main, ...)."""
    return forked(run_experiment.main, [UNDER_TEST.__name__, *map(str, argv)], stdin=stdin)


# twin: identical in test_reliability.py
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


# twin: identical in test_reliability.py
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
# twin: identical in test_reliability.py
STOPS = {"Ctrl-C": (None, False),
         "SIGINT to a background start": (lambda pid: os.killpg(pid, signal.SIGINT), True),
         "SIGTERM": (lambda pid: os.kill(pid, signal.SIGTERM), False),
         "SIGHUP to its group": (lambda pid: os.killpg(pid, signal.SIGHUP), False)}

# A shell for at_a_terminal(): it leads the session with the pty as its controlling terminal,
# starts the command as its foreground job, reports the job's pid and then its exit code on
# the descriptor named first, and waits to be killed.
# twin: identical in test_reliability.py
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


# twin: identical in test_reliability.py
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


# twin: identical in test_reliability.py
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


# twin: identical in test_reliability.py
def sleeps_in_read(pid, fd=0):
    """Whether process ``pid`` sleeps in read() on descriptor ``fd`` (Linux /proc: the system
    call it is in, numbered as this process's own read of that file shows)."""
    with open("/proc/self/syscall", encoding="ascii") as mine:
        read = mine.read().split()[0]
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/syscall", encoding="ascii") as its:
            return its.read().split()[:2] == [read, hex(fd)]
    return False


# twin: identical in test_reliability.py
def _become_nobody():
    # Root may signal anyone and passes every permission check.
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)


# twin: identical in test_reliability.py
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
# twin: identical in test_reliability.py
COMPANIONS = {"another user's read-only -shm": ("-shm", "read-only"),
              "another user's read-only -wal": ("-wal", "read-only"),
              "a -shm an ACL lets this user only read": ("-shm", "acl"),
              "a folder at -shm": ("-shm", "folder"), "a FIFO at -wal": ("-wal", "fifo"),
              "a FIFO at -shm": ("-shm", "fifo"), "a device at -wal": ("-wal", "device")}


# twin: identical in test_reliability.py
def left_open(database):
    """-wal and -shm beside ``database``, as a process that died with it open leaves them."""
    pid = os.fork()
    if pid == 0:
        connection = sqlite3.connect(database)
        connection.execute("SELECT count(*) FROM sqlite_master").fetchall()
        os._exit(0)
    os.waitpid(pid, 0)


# twin: identical in test_reliability.py
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


# twin: identical in test_reliability.py
def kind_of(path):
    """The kind of file at ``path`` and its bytes if it is a regular one: what must not change."""
    mode = os.lstat(path).st_mode
    return stat.S_IFMT(mode), file_bytes(path) if stat.S_ISREG(mode) else None


# twin: identical in test_reliability.py
def posix_acl(uid, perms):
    """The system.posix_acl_access value granting ``uid`` ``perms`` (rwx bits) on top of the
    owner's rwx and nothing for group and others: version 2, then sorted entries of tag,
    permissions and id (linux/posix_acl_xattr.h)."""
    undefined = 0xFFFFFFFF
    entries = [(0x01, 0o7, undefined), (0x02, perms, uid), (0x04, 0, undefined),
               (0x10, perms, undefined), (0x20, 0, undefined)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)


def write_the_plan(connection):
    """What write_as_nobody() writes here: the article's plan."""
    pre.execute(connection, "job-1", plan(), issued_at=0, now=0)


# twin: identical in test_reliability.py
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


# twin: identical in test_reliability.py
def open_to_nobody(test, folder, *files):
    """Let uid 65534 write ``files`` and make files in ``folder``, or skip ``test`` where that
    user cannot reach the folder (a private TMPDIR)."""
    os.chmod(folder, 0o777)
    for path in files:
        os.chmod(path, 0o666)
    if not run_experiment.run_forked(lambda: _become_nobody() or os.access(folder, os.W_OK)):
        test.skipTest(f"another user cannot reach {folder}: TMPDIR is private")


def thread_race(db, entry, ops, threads=8):
    """``threads`` threads (the article's 8), each with its own connection to ``db``, released
    together by a barrier, submit ``ops`` between them through entry(connection, op); the
    statuses, counted.  They run in a forked process, as the driver's race does: a process that
    has had threads forks no more children."""
    def run():
        barrier = threading.Barrier(threads)
        outcomes, lock = [], threading.Lock()

        def racer(share):
            try:
                connection = pre.connect(db)
                try:
                    barrier.wait(timeout=WATCHDOG)
                    found = [entry(connection, op)["status"] for op in share]
                finally:
                    connection.close()
            # Reported in the outcomes, not lost in the thread.
            except BaseException as error:
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


# twin: identical in test_reliability.py
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


# twin: identical in test_reliability.py
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


def agent_transfers(connection, rng, op, must_write, arm, mine):
    """A many_agents() operation on a database of MANY_RESOURCES: it transfers on revisions it
    has just read (1 in 10, and whenever it must write), changes a quantity (1 in 20), replays
    one of its own transfers (1 in 20), or checkpoints (1 in 20) or only reads; each answer is
    noted with its op."""
    work = rng.random()
    arm()
    if work < 0.1 or must_write:
        src, dst = rng.sample(sorted(MANY_RESOURCES), 2)
        seen = dict(connection.execute("SELECT name, revision FROM resources"))
        command = {"src": src, "dst": dst, "amount": rng.randint(1, 9),
                   "expected": {src: seen[src], dst: seen[dst]}}
        answer = pre.execute(connection, op, command, issued_at=0, now=0)
        mine.append((op, command))
    elif work < 0.15:
        name = rng.choice(sorted(MANY_RESOURCES))
        delta = rng.choice((-1, 1)) * rng.randint(1, 9)
        answer = pre.change(connection, op, name, delta, issued_at=0, now=0)
    elif work < 0.2 and mine:
        op, command = rng.choice(mine)
        answer = pre.execute(connection, op, command, issued_at=0, now=0)
    else:
        if work < 0.25:
            connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        connection.execute("SELECT count(*) FROM receipt").fetchone()
        return None
    return [op, answer]


# twin: identical in test_reliability.py
def numbered(folder, name):
    """(i, a descriptor of the journal folder/name-i that this process created): racers number
    themselves 0, 1, ... in the order they come, each journal appended to by one process only."""
    for index in itertools.count():
        try:
            return index, os.open(os.path.join(folder, f"{name}-{index}"),
                                  os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        except FileExistsError:
            continue


# --- the source -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def definitions(path):
    """{name: (node, source lines incl. decorators)} of a module's top-level definitions, in
    source order; each name of ``A, B = ...`` too.  beyond/test_companion.py reads both modules
    and both test files with it."""
    with open(path, encoding="utf-8") as handle:
        source = handle.read()
    lines, found = source.splitlines(True), {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [name.id for target in node.targets for name in ast.walk(target)
                     if isinstance(name, ast.Name)]
        else:
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        segment = "".join(lines[first - 1:node.end_lineno]).rstrip("\n")
        for name in names:
            found[name] = (node, segment)
    return found


# twin: identical in test_reliability.py
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


if __name__ == "__main__":
    main()
