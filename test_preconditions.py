"""Tests for preconditions.py: real SQLite files, real child processes.

Run: python3 -m unittest test_preconditions   (also under -X dev -W error)
"""
import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from unittest import mock

import preconditions as pre
import run_experiment

MODULE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preconditions.py")
WATCHDOG = 15  # seconds; only prevents a hung test, never a measurement
START = {"A": {"quantity": 10, "revision": 1}, "B": {"quantity": 0, "revision": 1}}
APPLIED = {"status": "applied", "revisions": {"A": 2, "B": 2}, "quantities": {"A": 7, "B": 3}}


def plan(a=1, b=1, amount=3, src="A", dst="B"):
    return {"src": src, "dst": dst, "amount": amount, "expected": {src: a, dst: b}}


def child(*args):
    """argv for a child exactly as the experiment driver starts it."""
    return [sys.executable, "-I", "-S", MODULE, *args]


def snapshot_of(path):
    """Snapshot from a fresh connection: what a recovering reader sees."""
    connection = pre.connect(path)
    try:
        return pre.snapshot(connection)
    finally:
        connection.close()


TEMPLATE = {}  # the A = 10, B = 0 database made once by init(), copied per test


def setUpModule():
    run_experiment.start_shared()  # the experiment runs in its own processes while unit tests run
    tmp = tempfile.TemporaryDirectory()
    TEMPLATE["dir"] = tmp
    TEMPLATE["path"] = os.path.join(tmp.name, "template.db")
    pre.init(TEMPLATE["path"], {"A": 10, "B": 0})


def tearDownModule():
    run_experiment.shared_runs()  # waits for it and reaps it, even if no test asked
    TEMPLATE.pop("dir").cleanup()


def load_tests(loader, tests, pattern):
    """The tests that read the shared experiment run go last, so it runs while the others do."""
    late = (Scenarios, CrashMatrix)
    return unittest.TestSuite(sorted(tests, key=lambda suite: any(isinstance(test, late) for test in suite)))


class Case(unittest.TestCase):
    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.dir = tmp.name
        self.db = self.make_db()
        self.c = self.open()

    def make_db(self, name="t.db", resources=None):
        path = os.path.join(self.dir, name)
        if resources is None:  # a byte copy of a closed database: no fsync per test
            shutil.copyfile(TEMPLATE["path"], path)
        else:
            pre.init(path, resources)
        return path

    def open(self, path=None):
        connection = pre.connect(path or self.db)
        self.addCleanup(connection.close)
        return connection

    def state(self, path=None):
        return snapshot_of(path or self.db)

    def assert_state(self, resources, effects, receipts, path=None):
        self.assertEqual(self.state(path),
                         {"resources": resources, "effects": effects, "receipts": receipts})

    def sql(self, statement, parameters=(), path=None):
        """Direct SQL behind the protocol's back: test set-up only."""
        connection = sqlite3.connect(path or self.db, isolation_level=None)
        try:
            connection.execute(statement, parameters)
        finally:
            connection.close()


class Validation(Case):
    """Malformed input raises before any transaction and stores nothing."""

    def assert_refused(self, error, op, command):
        with self.assertRaises(error):
            pre.execute(self.c, op, command)
        self.assert_state(START, 0, 0)

    def test_missing_or_extra_command_keys_store_nothing(self):
        missing = plan()
        del missing["expected"]
        extra = dict(plan(), note="x")
        for command in (missing, extra, {}):
            with self.subTest(command=command):
                self.assert_refused(ValueError, "op-1", command)
        self.assert_refused(TypeError, "op-1", [("src", "A")])

    def test_same_source_and_destination_is_refused(self):
        self.assert_refused(ValueError, "op-1",
                            {"src": "A", "dst": "A", "amount": 3, "expected": {"A": 1}})

    def test_empty_overlong_or_non_text_names_are_refused(self):
        long_name = "x" * (pre.MAX_NAME_LENGTH + 1)
        for src, error in (("", ValueError), (long_name, ValueError),
                           ("\ud800", ValueError), (1, TypeError)):
            with self.subTest(src=src):
                self.assert_refused(error, "op-1", plan(src=src))

    def test_bool_amount_or_revision_is_a_type_error(self):
        self.assert_refused(TypeError, "op-1", plan(amount=True))
        self.assert_refused(TypeError, "op-1", plan(a=True))
        self.assert_refused(TypeError, "op-1", plan(b=False))
        self.assert_refused(TypeError, "op-1", plan(amount=3.0))

    def test_zero_negative_or_over_bound_integers_are_refused(self):
        for command in (plan(amount=0), plan(amount=-3), plan(amount=pre.MAX_AMOUNT + 1),
                        plan(a=0), plan(b=-1), plan(a=pre.MAX_INT64 + 1)):
            with self.subTest(command=command):
                self.assert_refused(ValueError, "op-1", command)

    def test_expected_naming_the_wrong_resources_is_refused(self):
        for expected in ({"A": 1}, {"A": 1, "C": 1}, {"A": 1, "B": 1, "C": 1}, {}):
            with self.subTest(expected=expected):
                self.assert_refused(ValueError, "op-1", dict(plan(), expected=expected))
        self.assert_refused(TypeError, "op-1", dict(plan(), expected=[["A", 1], ["B", 1]]))

    def test_op_must_be_a_bounded_non_empty_string(self):
        self.assert_refused(TypeError, "op-1".encode(), plan())
        self.assert_refused(TypeError, 7, plan())
        self.assert_refused(ValueError, "", plan())
        self.assert_refused(ValueError, "x" * (pre.MAX_OP_LENGTH + 1), plan())

    def test_unknown_crash_boundary_is_refused_before_any_transaction(self):
        with self.assertRaises(ValueError):
            pre.execute(self.c, "op-1", plan(), fault="after_everything")
        self.assert_state(START, 0, 0)

    def test_values_exactly_at_the_stated_bounds_are_accepted(self):
        name = "N" * pre.MAX_NAME_LENGTH
        self.assertEqual(pre.execute(self.c, "x" * pre.MAX_OP_LENGTH, plan(amount=pre.MAX_AMOUNT)),
                         {"status": "insufficient", "available": 10})
        self.assertEqual(pre.execute(self.c, "op-2", plan(dst=name)),
                         {"status": "missing_resource", "missing": [name]})

    def test_digest_is_sha256_of_sorted_key_compact_json(self):
        commands = [plan(), plan(src="é\"\\\n", dst="\u2028 Z", a=pre.MAX_INT64, amount=7),
                    plan(src="b", dst="B"), plan(src="中文", dst="ascii")]
        for command in commands:
            text = json.dumps(command, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            with self.subTest(command=command):
                self.assertEqual(pre.command_json(command), text)
                self.assertEqual(pre.digest(command),
                                 hashlib.sha256(text.encode("utf-8")).hexdigest())
        self.assertNotEqual(pre.digest(plan()), pre.digest(plan(b=2)))


class Protocol(Case):
    def test_fresh_plan_applies_both_rows_with_revision_bump(self):
        result = pre.execute(self.c, "job-1", plan())
        self.assertEqual(result, {"status": "applied", "revisions": {"A": 2, "B": 2},
                                  "quantities": {"A": 7, "B": 3}})
        self.assert_state({"A": {"quantity": 7, "revision": 2},
                           "B": {"quantity": 3, "revision": 2}}, 1, 1)

    def test_stale_plan_reports_observed_revisions_and_changes_nothing(self):
        pre.change(self.c, "B", 2)
        self.assertEqual(pre.execute(self.c, "job-1", plan()),
                         {"status": "stale", "observed": {"A": 1, "B": 2}})
        self.assert_state({"A": {"quantity": 10, "revision": 1},
                           "B": {"quantity": 2, "revision": 2}}, 0, 1)

    def test_stale_on_the_source_alone_is_detected_too(self):
        pre.change(self.c, "A", 5)
        self.assertEqual(pre.execute(self.c, "job-1", plan()),
                         {"status": "stale", "observed": {"A": 2, "B": 1}})
        self.assertEqual(self.state()["effects"], 0)

    def test_replay_returns_original_result_after_later_changes(self):
        first = pre.execute(self.c, "job-1", plan())
        pre.change(self.c, "A", -1)
        pre.change(self.c, "B", 5)
        self.assertEqual(pre.execute(self.c, "job-1", plan()),
                         {"status": "replayed", "result": first})
        self.assert_state({"A": {"quantity": 6, "revision": 3},
                           "B": {"quantity": 8, "revision": 3}}, 1, 1)

    def test_lost_ack_retry_is_replayed_not_stale(self):
        first = pre.execute(self.c, "job-1", plan())  # this reply is "lost"
        retry = pre.execute(self.open(), "job-1", plan())
        self.assertEqual(retry, {"status": "replayed", "result": first})
        self.assert_state({"A": {"quantity": 7, "revision": 2},
                           "B": {"quantity": 3, "revision": 2}}, 1, 1)

    def test_same_op_with_refreshed_plan_is_conflict_and_a_new_op_applies(self):
        pre.change(self.c, "B", 2)
        self.assertEqual(pre.execute(self.c, "job-1", plan())["status"], "stale")
        observed = self.state()["resources"]
        refreshed = plan(a=observed["A"]["revision"], b=observed["B"]["revision"])
        self.assertEqual(pre.execute(self.c, "job-1", refreshed), {"status": "conflict"})
        self.assert_state({"A": {"quantity": 10, "revision": 1},
                           "B": {"quantity": 2, "revision": 2}}, 0, 1)  # conflict not stored
        self.assertEqual(pre.execute(self.c, "job-2", refreshed)["status"], "applied")
        self.assert_state({"A": {"quantity": 7, "revision": 2},
                           "B": {"quantity": 5, "revision": 3}}, 1, 2)

    def test_stale_rejection_is_memoised_even_if_revisions_match_again(self):
        pre.change(self.c, "B", 2)
        stale = pre.execute(self.c, "job-1", plan())
        self.sql("UPDATE resources SET revision = 1 WHERE name = 'B'")  # a restored backup
        self.assertEqual(pre.execute(self.c, "job-1", plan()),
                         {"status": "replayed", "result": stale})
        self.assertEqual(self.state()["effects"], 0)

    def test_insufficient_is_memoised_even_when_a_refill_would_let_it_apply(self):
        self.assertEqual(pre.execute(self.c, "job-1", plan(amount=11)),
                         {"status": "insufficient", "available": 10})
        self.sql("UPDATE resources SET quantity = 20 WHERE name = 'A'")
        self.assertEqual(pre.execute(self.c, "job-1", plan(amount=11)),
                         {"status": "replayed",
                          "result": {"status": "insufficient", "available": 10}})
        self.assertEqual(pre.execute(self.c, "job-2", plan(amount=11))["status"], "applied")
        self.assertEqual(self.state()["effects"], 1)

    def test_missing_resource_is_memoised_even_after_the_resource_appears(self):
        self.assertEqual(pre.execute(self.c, "job-1", plan(dst="Z")),
                         {"status": "missing_resource", "missing": ["Z"]})
        self.sql("INSERT INTO resources (name, quantity, revision) VALUES ('Z', 0, 1)")
        self.assertEqual(pre.execute(self.c, "job-1", plan(dst="Z")),
                         {"status": "replayed",
                          "result": {"status": "missing_resource", "missing": ["Z"]}})
        self.assertEqual(pre.execute(self.c, "job-2", plan(dst="Z"))["status"], "applied")

    def test_revision_at_int64_max_is_refused_as_overflow_without_change(self):
        self.sql("UPDATE resources SET revision = ? WHERE name = 'B'", (pre.MAX_INT64,))
        self.assertEqual(pre.execute(self.c, "job-1", plan(b=pre.MAX_INT64)),
                         {"status": "overflow", "resource": "B", "column": "revision"})
        self.assert_state({"A": {"quantity": 10, "revision": 1},
                           "B": {"quantity": 0, "revision": pre.MAX_INT64}}, 0, 1)

    def test_destination_quantity_overflow_is_refused_and_the_exact_maximum_fits(self):
        self.sql("UPDATE resources SET quantity = ? WHERE name = 'B'", (pre.MAX_INT64 - 2,))
        self.assertEqual(pre.execute(self.c, "job-1", plan(amount=3)),
                         {"status": "overflow", "resource": "B", "column": "quantity"})
        self.assertEqual(self.state()["resources"]["B"],
                         {"quantity": pre.MAX_INT64 - 2, "revision": 1})
        self.assertEqual(pre.execute(self.c, "job-2", plan(amount=2))["status"], "applied")
        self.assertEqual(self.c.execute(
            "SELECT quantity, typeof(quantity) FROM resources WHERE name = 'B'").fetchall(),
            [(pre.MAX_INT64, "integer")])

    def test_lock_timeout_raises_busy_and_records_nothing(self):
        holder = self.open()
        with pre.transaction(holder):  # another writer holds the queue and the lock
            with mock.patch.object(pre, "BUSY_DEADLINE", 0.02):
                started = time.monotonic()
                with self.assertRaises(pre.Busy) as caught:
                    pre.execute(self.c, "job-1", plan())
                waited = time.monotonic() - started
                with self.assertRaises(sqlite3.OperationalError):  # Busy is one
                    pre.change(self.c, "B", 2)
        self.assertGreaterEqual(waited, 0.02)  # it waited for the deadline...
        self.assertLess(waited, 0.5)  # ...and no longer
        self.assertIn("busy", str(caught.exception))
        self.assert_state(START, 0, 0)
        self.assertEqual(pre.execute(self.c, "job-1", plan())["status"], "applied")

    def test_writer_outside_the_queue_past_the_busy_timeout_raises_busy(self):
        foreign = sqlite3.connect(self.db, isolation_level=None)
        self.addCleanup(foreign.close)
        foreign.execute("BEGIN IMMEDIATE")
        self.c.execute("PRAGMA busy_timeout = 20")
        with self.assertRaises(pre.Busy):
            pre.execute(self.c, "job-1", plan())
        foreign.execute("ROLLBACK")
        self.assertFalse(self.c.in_transaction)
        self.assert_state(START, 0, 0)

    def test_replay_and_conflict_are_answered_while_another_writer_holds_the_lock(self):
        first = pre.execute(self.c, "job-1", plan())
        holder = self.open()
        with pre.transaction(holder), mock.patch.object(pre, "BUSY_DEADLINE", 0.02):
            self.assertEqual(pre.execute(self.c, "job-1", plan()),
                             {"status": "replayed", "result": first})
            self.assertEqual(pre.execute(self.c, "job-1", plan(a=2, b=2)), {"status": "conflict"})
            with self.assertRaises(pre.Busy):  # a new op does need the lock
                pre.execute(self.c, "job-2", plan(a=2, b=2))
        self.assertFalse(self.c.in_transaction)

    def test_change_always_bumps_the_revision(self):
        self.assertEqual(pre.change(self.c, "A", -1),
                         {"status": "changed", "name": "A", "quantity": 9, "revision": 2})
        self.assertEqual(pre.change(self.c, "A", 0)["revision"], 3)
        self.assertEqual(pre.change(self.c, "A", 1),
                         {"status": "changed", "name": "A", "quantity": 10, "revision": 4})

    def test_change_refuses_negative_overflow_missing_and_non_int_without_change(self):
        for name, delta, error in (("A", -11, ValueError), ("Z", 1, ValueError),
                                   ("A", True, TypeError), ("A", 1.0, TypeError),
                                   ("A", pre.MAX_INT64 + 1, ValueError)):
            with self.subTest(name=name, delta=delta):
                with self.assertRaises(error):
                    pre.change(self.c, name, delta)
        self.assert_state(START, 0, 0)
        self.sql("UPDATE resources SET quantity = ? WHERE name = 'A'", (pre.MAX_INT64,))
        with self.assertRaises(ValueError):
            pre.change(self.c, "A", 1)
        self.sql("UPDATE resources SET quantity = 0, revision = ? WHERE name = 'B'",
                 (pre.MAX_INT64,))
        with self.assertRaises(ValueError):
            pre.change(self.c, "B", 1)
        self.assert_state({"A": {"quantity": pre.MAX_INT64, "revision": 1},
                           "B": {"quantity": 0, "revision": pre.MAX_INT64}}, 0, 0)

    def test_aba_same_quantity_new_revision_makes_the_old_plan_stale(self):
        pre.change(self.c, "A", -1)
        pre.change(self.c, "A", 1)
        self.assertEqual(self.state()["resources"]["A"], {"quantity": 10, "revision": 3})
        self.assertEqual(pre.execute(self.c, "job-1", plan()),
                         {"status": "stale", "observed": {"A": 3, "B": 1}})
        self.assertEqual(self.state()["effects"], 0)

    def test_undeclared_dependency_change_does_not_block_the_plan(self):
        db = self.make_db("abc.db", {"A": 10, "B": 0, "C": 5})
        c = self.open(db)
        pre.change(c, "C", -1)
        self.assertEqual(pre.execute(c, "job-1", plan())["status"], "applied")
        self.assert_state({"A": {"quantity": 7, "revision": 2}, "B": {"quantity": 3, "revision": 2},
                           "C": {"quantity": 4, "revision": 2}}, 1, 1, db)

    def test_trigger_abort_on_destination_update_leaves_nothing_half_applied(self):
        self.sql("CREATE TRIGGER fault BEFORE UPDATE ON resources WHEN NEW.name = 'B' "
                 "BEGIN SELECT RAISE(ABORT, 'injected fault'); END")
        with self.assertRaisesRegex(sqlite3.DatabaseError, "injected fault"):
            pre.execute(self.c, "job-1", plan())
        self.assertFalse(self.c.in_transaction)
        self.assert_state(START, 0, 0)
        self.sql("DROP TRIGGER fault")
        self.assertEqual(pre.execute(self.c, "job-1", plan())["status"], "applied")

    def test_trigger_abort_on_receipt_insert_leaves_nothing_half_applied(self):
        self.sql("CREATE TRIGGER fault BEFORE INSERT ON receipts "
                 "BEGIN SELECT RAISE(ABORT, 'injected fault'); END")
        with self.assertRaisesRegex(sqlite3.DatabaseError, "injected fault"):
            pre.execute(self.c, "job-1", plan())
        self.assertFalse(self.c.in_transaction)
        self.assert_state(START, 0, 0)


class Retention(Case):
    """purge() with a low-water mark: a late retry of a purged op is refused, never decided again."""

    def receipts(self):
        return self.c.execute("SELECT op, tick FROM receipts ORDER BY op").fetchall()

    def mark(self):
        return self.c.execute("SELECT low_water FROM retention").fetchone()[0]

    def test_receipts_record_the_tick_they_were_written_at(self):
        pre.execute(self.c, "job-1", plan(), issued_at=3, now=5)
        pre.execute(self.c, "job-2", plan(), now=9)  # stale, stored at tick 9
        self.assertEqual(self.receipts(), [("job-1", 5), ("job-2", 9)])

    def test_purge_deletes_receipts_older_than_the_window_and_raises_the_mark(self):
        pre.execute(self.c, "job-1", plan(), now=10)
        pre.execute(self.c, "job-2", plan(), now=60)
        self.assertEqual(pre.purge(self.c, 100, 50), {"deleted": 1, "low_water": 50})
        self.assertEqual((self.receipts(), self.mark()), ([("job-2", 60)], 50))

    def test_purge_refuses_a_window_that_is_not_a_positive_int_and_changes_nothing(self):
        pre.execute(self.c, "job-1", plan(), now=10)
        for window, error in ((0, ValueError), (-5, ValueError), (True, TypeError), (2.0, TypeError)):
            with self.subTest(window=window), self.assertRaises(error):
                pre.purge(self.c, 100, window)
        self.assertEqual((self.receipts(), self.mark()), ([("job-1", 10)], 0))

    def test_a_low_water_mark_never_moves_backwards(self):
        pre.purge(self.c, 100, 50)
        pre.execute(self.c, "job-1", plan(), issued_at=60, now=60)
        with self.assertRaises(ValueError):
            pre.purge(self.c, 80, 50)  # would set the mark to 30
        self.assertEqual((self.receipts(), self.mark()), ([("job-1", 60)], 50))

    def test_an_op_issued_before_the_mark_without_receipt_is_expired_and_nothing_is_stored(self):
        pre.execute(self.c, "job-1", plan(), issued_at=0, now=0)  # applied, receipt at tick 0
        pre.purge(self.c, 100, 50)
        for issued_at in (0, 49, None):
            with self.subTest(issued_at=issued_at):
                self.assertEqual(pre.execute(self.c, "job-2", plan(a=2, b=2), issued_at=issued_at, now=100),
                                 {"status": "expired", "low_water": 50})
        after_first = {"A": {"quantity": 7, "revision": 2}, "B": {"quantity": 3, "revision": 2}}
        self.assert_state(after_first, 1, 0)

    def test_an_op_issued_at_or_after_the_mark_is_decided_as_usual(self):
        pre.purge(self.c, 100, 50)
        self.assertEqual(pre.execute(self.c, "job-1", plan(), issued_at=50, now=100), APPLIED)
        self.assertEqual(self.receipts(), [("job-1", 100)])

    def test_a_receipt_that_survived_the_purge_still_replays(self):
        first = pre.execute(self.c, "job-1", plan(), issued_at=0, now=80)
        pre.purge(self.c, 100, 50)
        self.assertEqual(pre.execute(self.c, "job-1", plan(), issued_at=0, now=100),
                         {"status": "replayed", "result": first})

    def test_ticks_must_be_non_negative_ints_and_issued_no_later_than_now(self):
        for issued_at, now, error in ((5, 4, ValueError), (None, -1, ValueError), (True, 3, TypeError),
                                      (1, 2.0, TypeError)):
            with self.subTest(issued_at=issued_at, now=now), self.assertRaises(error):
                pre.execute(self.c, "job-1", plan(), issued_at=issued_at, now=now)
        self.assert_state(START, 0, 0)

    def test_wal_reset_bug_names_exactly_the_affected_sqlite_versions(self):
        affected = [(3, 7, 0), (3, 40, 1), (3, 44, 5), (3, 45, 0), (3, 50, 6), (3, 51, 0), (3, 51, 2)]
        fixed = [(3, 6, 23), (3, 44, 6), (3, 44, 9), (3, 50, 7), (3, 51, 3), (3, 52, 0)]
        self.assertEqual([version for version in affected + fixed if pre.wal_reset_bug(version)], affected)
        self.assertEqual(pre.wal_reset_bug(), pre.wal_reset_bug(sqlite3.sqlite_version_info))


class ReviewFindings(Case):
    """Guards added after an independent review."""

    def test_an_applied_op_whose_receipt_was_purged_is_expired_not_an_integrity_error(self):
        pre.execute(self.c, "job-1", plan(), issued_at=0, now=0)
        pre.purge(self.c, 100, 50)
        self.assertEqual(pre.execute(self.c, "job-1", plan(a=2, b=2), issued_at=60, now=100),
                         {"status": "expired", "low_water": 50})
        self.assert_state({"A": {"quantity": 7, "revision": 2}, "B": {"quantity": 3, "revision": 2}}, 1, 0)

    def test_a_corrupt_receipt_is_a_named_error_and_decides_nothing(self):
        pre.execute(self.c, "job-1", plan())
        self.sql("UPDATE receipts SET result = 'not json' WHERE op = 'job-1'")
        with self.assertRaises(pre.CorruptRecord):
            pre.execute(self.c, "job-1", plan())

    def test_transaction_does_not_nest_and_snapshot_reads_inside_one(self):
        with pre.transaction(self.c):
            with self.assertRaises(sqlite3.ProgrammingError):
                with pre.transaction(self.c):
                    pass
            self.assertEqual(pre.snapshot(self.c)["resources"], START)
        self.assertFalse(self.c.in_transaction)


class Concurrency(Case):
    def submit_from_threads(self, ops):
        """8 threads, each with its own connection, submit ops together."""
        results, errors, lock = [], [], threading.Lock()
        barrier = threading.Barrier(8)

        def worker(mine):
            try:
                connection = pre.connect(self.db)
                try:
                    barrier.wait(timeout=WATCHDOG)
                    for op in mine:
                        result = pre.execute(connection, op, plan())
                        with lock:
                            results.append(result)
                finally:
                    connection.close()
            except BaseException as error:  # reported below, not lost in the thread
                with lock:
                    errors.append(error)

        threads = [threading.Thread(target=worker, args=(ops[k::8],), daemon=True)
                   for k in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WATCHDOG)
        self.assertEqual(errors, [])
        self.assertEqual(len(results), len(ops))
        return results

    def test_distinct_ops_racing_on_one_snapshot_apply_exactly_once(self):
        results = self.submit_from_threads([f"job-{k}" for k in range(16)])
        statuses = sorted(result["status"] for result in results)
        self.assertEqual(statuses, ["applied"] + ["stale"] * 15)
        self.assert_state({"A": {"quantity": 7, "revision": 2},
                           "B": {"quantity": 3, "revision": 2}}, 1, 16)

    def test_one_op_submitted_16_times_applies_once_and_replays_15(self):
        results = self.submit_from_threads(["job-1"] * 16)
        applied = [result for result in results if result["status"] == "applied"]
        replayed = [result for result in results if result["status"] == "replayed"]
        self.assertEqual((len(applied), len(replayed)), (1, 15))
        self.assertTrue(all(result["result"] == applied[0] for result in replayed))
        self.assert_state({"A": {"quantity": 7, "revision": 2},
                           "B": {"quantity": 3, "revision": 2}}, 1, 1)

    def test_processes_contending_for_the_lock_all_finish_without_busy_errors(self):
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import preconditions as p\n"
                "c = p.connect(sys.argv[2]); print('READY', flush=True); sys.stdin.readline()\n"
                "for _ in range(int(sys.argv[3])): p.change(c, 'B', 1)\n"
                "c.close()")
        argv = [sys.executable, "-I", "-S", "-c", code, os.path.dirname(MODULE), self.db, "20"]
        procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outcomes = []
        watchdog = threading.Timer(WATCHDOG, lambda: [proc.kill() for proc in procs])
        watchdog.start()
        try:
            ready = [proc.stdout.readline() for proc in procs]  # all three start together
            for proc in procs:
                proc.stdin.write("GO\n")
                proc.stdin.flush()
            for _ in range(20):  # this process is the third contender
                pre.change(self.c, "B", 1)
        finally:
            for proc in procs:
                with proc:
                    outcomes.append((proc.communicate(timeout=WATCHDOG), proc.returncode))
            watchdog.cancel()
        self.assertEqual(ready, ["READY\n"] * 2)
        self.assertEqual(outcomes, [(("", ""), 0)] * 2)
        self.assertEqual(self.state()["resources"]["B"], {"quantity": 60, "revision": 61})


# --- experiment scenarios ------------------------------------------------------------
# The article's 11 scenario groups run once per test process through the driver, with
# real children that die by os._exit, and the tests below read what that run observed.

ARTICLE_7 = [name for name, (article, _, _) in run_experiment.SCENARIOS.items() if article == "article_7"]
_RUNS = run_experiment.shared_runs  # one run of every scenario per test process


def scenario(name):
    return _RUNS()[name].stages


class Scenarios(unittest.TestCase):
    def test_the_driver_names_exactly_the_articles_11_scenario_groups(self):
        self.assertEqual(ARTICLE_7, [
            "unsafe_check_then_act", "safe_stale_rejected", "lost_ack_replay", "replan_new_id",
            "aba_revision", "crash_points", "stale_rejection_durable", "trigger_faults",
            "concurrent_distinct_ops", "concurrent_same_op", "undeclared_dependency"])

    def test_every_scenario_holds_its_invariants_and_passes_quick_check(self):
        for name in ARTICLE_7:
            with self.subTest(name):
                self.assertEqual(_RUNS()[name].failures, [])
                self.assertTrue(_RUNS()[name].integrity)
                self.assertEqual(set(_RUNS()[name].integrity.values()), {"ok"})

    def test_rerun_reproduces_the_committed_results_json(self):
        with open(run_experiment.RESULTS, encoding="utf-8") as handle:
            committed = json.load(handle)["article_7"]
        self.assertEqual(run_experiment.differences(committed, run_experiment.results_of(_RUNS().values())["article_7"]), [])

    def test_unsafe_check_then_act_builds_on_a_state_changed_after_its_check(self):
        final = scenario("unsafe_check_then_act")["after_go"]
        self.assertEqual((final["status"], final["exit_code"]), ("applied", 0))
        self.assertEqual((final["quantities"], final["revisions"], final["effects"]),
                         ({"A": 7, "B": 5}, {"A": 2, "B": 3}, 1))

    def test_safe_entry_after_the_same_interleaving_is_stale(self):
        final = scenario("safe_stale_rejected")["after_go"]
        self.assertEqual((final["status"], final["observed"]), ("stale", {"A": 1, "B": 2}))
        self.assertEqual((final["quantities"], final["effects"], final["receipts"]), ({"A": 10, "B": 2}, 0, 1))

    def test_crash_after_source_update_leaves_nothing_and_a_retry_applies(self):
        stages = scenario("crash_points")
        crashed, retried = stages["after_source_update.after_crash"], stages["after_source_update.after_retry"]
        self.assertEqual(crashed["exit_code"], 71)
        self.assertEqual((crashed["quantities"], crashed["effects"], crashed["receipts"]), ({"A": 10, "B": 0}, 0, 0))
        self.assertEqual((retried["status"], retried["quantities"]), ("applied", {"A": 7, "B": 3}))

    def test_crash_before_commit_leaves_nothing_and_a_retry_applies(self):
        stages = scenario("crash_points")
        crashed, retried = stages["before_commit.after_crash"], stages["before_commit.after_retry"]
        self.assertEqual(crashed["exit_code"], 72)
        self.assertEqual((crashed["quantities"], crashed["effects"], crashed["receipts"]), ({"A": 10, "B": 0}, 0, 0))
        self.assertEqual((retried["status"], retried["effects"]), ("applied", 1))

    def test_crash_after_commit_keeps_everything_and_a_retry_is_replayed(self):
        stages = scenario("crash_points")
        crashed, retried = stages["after_commit.after_crash"], stages["after_commit.after_retry"]
        self.assertEqual(crashed["exit_code"], 73)
        self.assertEqual((crashed["quantities"], crashed["revisions"], crashed["effects"], crashed["receipts"]),
                         ({"A": 7, "B": 3}, {"A": 2, "B": 2}, 1, 1))
        self.assertEqual((retried["status"], retried["effects"]), ("replayed", 1))

    def test_committed_stale_rejection_survives_the_exit_and_is_replayed(self):
        stages = scenario("stale_rejection_durable")
        self.assertEqual((stages["after_crash"]["exit_code"], stages["after_crash"]["receipts"]), (73, 1))
        final = stages["after_retry"]
        self.assertEqual((final["status"], final["stored_status"], final["effects"]), ("replayed", "stale", 0))

    def test_lost_ack_replay_and_replan_under_a_new_id(self):
        lost = scenario("lost_ack_replay")
        self.assertEqual((lost["after_first"]["status"], lost["after_retry"]["status"]), ("applied", "replayed"))
        self.assertEqual(lost["after_retry"]["effects"], 1)
        replan = scenario("replan_new_id")
        self.assertEqual([replan[stage]["status"] for stage in ("after_stale", "after_same_id", "after_new_id")],
                         ["stale", "conflict", "applied"])

    def test_aba_and_undeclared_dependency_scenarios(self):
        aba = scenario("aba_revision")["after_execute"]
        self.assertEqual((aba["status"], aba["quantities"]["A"], aba["revisions"]["A"]), ("stale", 10, 3))
        undeclared = scenario("undeclared_dependency")["after_execute"]
        self.assertEqual((undeclared["status"], undeclared["quantities"]["C"]), ("applied", 4))

    def test_trigger_faults_and_races_in_the_experiment(self):
        stages = scenario("trigger_faults")
        for stage in ("destination_update_fault", "receipt_insert_fault"):
            self.assertEqual((stages[stage]["error"], stages[stage]["effects"], stages[stage]["receipts"]),
                             ("IntegrityError", 0, 0))
        self.assertEqual(scenario("concurrent_distinct_ops")["after_race"]["statuses"], {"applied": 1, "stale": 15})
        self.assertEqual(scenario("concurrent_same_op")["after_race"]["statuses"], {"applied": 1, "replayed": 15})


class CrashMatrix(unittest.TestCase):
    """Every boundary in preconditions.BOUNDARIES, crashed for real, then retried by a new process."""

    def test_every_boundary_is_all_or_nothing_and_its_retry_answers_right(self):
        runs = _RUNS()
        for boundary in pre.BOUNDARIES:
            run = runs[f"preconditions/{boundary}"]
            with self.subTest(boundary):
                self.assertEqual(run.failures, [])
                fresh = run.stages["fresh"]
                self.assertEqual(fresh["exit_code"], pre.EXIT_CODES[boundary])
                committed = boundary == "after_commit"
                self.assertEqual((fresh["effects_after_crash"], fresh["retry"], fresh["outcome"], fresh["effects"]),
                                 (int(committed), "replayed" if committed else "applied", "applied", 1))
        stale = runs["preconditions/after_commit"].stages["stale"]
        self.assertEqual((stale["exit_code"], stale["retry"], stale["outcome"], stale["effects"]),
                         (73, "replayed", "stale", 0))

    def test_the_matrix_reproduces_results_json(self):
        with open(run_experiment.RESULTS, encoding="utf-8") as handle:
            committed = json.load(handle)["crash_matrix"]
        observed = run_experiment.results_of(_RUNS().values())["crash_matrix"]
        self.assertEqual(run_experiment.differences(
            {k: v for k, v in committed.items() if k.startswith("preconditions/")},
            {k: v for k, v in observed.items() if k.startswith("preconditions/")}), [])


STRACE = shutil.which("strace")


def strace_works():
    """strace must exist and be allowed to trace (ptrace is often forbidden in containers)."""
    if not STRACE:
        return False
    probe = subprocess.run([STRACE, "-o", os.devnull, "true"], capture_output=True, timeout=WATCHDOG)
    return probe.returncode == 0


@unittest.skipUnless(strace_works(), "needs a working strace to make fdatasync fail for real")
class CommitFailure(Case):
    """An error from COMMIT is an unknown outcome: strace fails the commit's fdatasync for real."""

    def test_a_failed_commit_may_or_may_not_survive_and_a_retry_by_op_ends_with_one_effect(self):
        # The first fdatasync of a fresh WAL syncs its header; the second is the commit.
        variants = {"error survives": "error=EIO:when=2", "then SIGKILL": "error=EIO:signal=SIGKILL:when=2"}
        dbs, children = {}, {}
        for name, inject in variants.items():
            dbs[name] = self.make_db(name.replace(" ", "-") + ".db")
            children[name] = subprocess.Popen(
                [STRACE, "-f", "-o", os.devnull, "-e", "trace=fdatasync", "-e", f"inject=fdatasync:{inject}",
                 "-P", os.path.abspath(dbs[name]) + "-wal", *child("execute", dbs[name], "job-1", json.dumps(plan()))],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        outcomes = {name: (proc.communicate(timeout=WATCHDOG), proc.returncode) for name, proc in children.items()}
        (_, err), code = outcomes["error survives"]
        self.assertEqual(code, 1)
        self.assertIn("disk I/O error", err)
        self.assertEqual(outcomes["then SIGKILL"][1], -9)
        # The process that saw the error rolled back and closed: nothing kept.  The one
        # killed right after the failed fdatasync left its WAL frames: recovery keeps them.
        self.assertEqual(self.state(dbs["error survives"])["effects"], 0)
        self.assertEqual(self.state(dbs["then SIGKILL"])["effects"], 1)
        for name, retry in (("error survives", "applied"), ("then SIGKILL", "replayed")):
            connection = self.open(dbs[name])
            self.assertEqual(pre.execute(connection, "job-1", plan())["status"], retry)
            self.assertEqual(self.state(dbs[name])["effects"], 1)
            self.assertEqual(connection.execute("PRAGMA integrity_check").fetchone()[0], "ok")


class CommandLine(unittest.TestCase):
    """The script itself, started as the experiment's --exec mode starts it: isolated, no site."""

    def test_cli_prints_one_json_line_and_maps_errors_to_exit_codes(self):
        with tempfile.TemporaryDirectory() as folder:
            db = os.path.join(folder, "cli.db")
            made = subprocess.run(child("init", db, "A=10", "B=0"), capture_output=True, text=True, timeout=WATCHDOG)
            self.assertEqual((made.returncode, made.stderr), (0, ""))
            self.assertEqual(made.stdout, json.dumps(snapshot_of(db), sort_keys=True, separators=(",", ":")) + "\n")
            self.assertEqual(self.main("execute", db), (2, "", None))
            code, out, err = self.main("execute", db, "job-1", json.dumps(plan(amount=True)))
            self.assertEqual((code, out), (1, ""))
            self.assertEqual(len(err.splitlines()), 1)
            self.assertIn("TypeError: amount must be an int", err)
            self.assertEqual(snapshot_of(db), {"resources": START, "effects": 0, "receipts": 0})

    @staticmethod
    def main(*argv):
        """main() in this process: (exit code, stdout, stderr or None for argparse's usage text)."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = pre.main(list(argv))
            except SystemExit as usage:
                return usage.code, out.getvalue(), None
        return code, out.getvalue(), err.getvalue()


class Files(Case):
    def test_connect_on_a_missing_file_raises_and_creates_nothing(self):
        before = sorted(os.listdir(self.dir))
        with self.assertRaises(FileNotFoundError):
            pre.connect(os.path.join(self.dir, "missing.db"))
        self.assertEqual(sorted(os.listdir(self.dir)), before)

    def test_garbage_zero_byte_and_foreign_files_are_refused(self):
        garbage = os.path.join(self.dir, "garbage.db")
        with open(garbage, "wb") as handle:
            handle.write(b"not a database, just bytes\n" * 200)
        empty = os.path.join(self.dir, "empty.db")
        open(empty, "wb").close()
        foreign = os.path.join(self.dir, "foreign.db")
        self.sql("CREATE TABLE resources (name TEXT)", path=foreign)
        for path in (garbage, empty, foreign):
            size = os.path.getsize(path)
            with self.subTest(path=os.path.basename(path)):
                with self.assertRaisesRegex(sqlite3.DatabaseError, "^" + re.escape(path)):
                    pre.connect(path)
                self.assertEqual(os.path.getsize(path), size)
                self.assertFalse(os.path.exists(path + "-wal"))

    def test_init_refuses_to_overwrite_anything(self):
        with self.assertRaises(FileExistsError):
            pre.init(self.db, {"A": 1})
        self.assert_state(START, 0, 0)
        other = os.path.join(self.dir, "notes.txt")
        with open(other, "w") as handle:
            handle.write("keep me")
        with self.assertRaises(FileExistsError):
            pre.init(other, {"A": 1})
        with open(other) as handle:
            self.assertEqual(handle.read(), "keep me")

    def test_init_refuses_a_journal_left_by_an_earlier_database_of_that_name(self):
        path = os.path.join(self.dir, "reused.db")
        with open(path + "-wal", "wb") as handle:
            handle.write(b"frames of some other database")
        with self.assertRaises(FileExistsError):
            pre.init(path, {"A": 1})
        self.assertFalse(os.path.exists(path))

    def test_init_validates_resources_and_creates_nothing_when_refused(self):
        path = os.path.join(self.dir, "new.db")
        for resources, error in (({"A": True}, TypeError), ({"A": -1}, ValueError),
                                 ({"A": pre.MAX_INT64 + 1}, ValueError), ({}, ValueError),
                                 ({"": 1}, ValueError), ([("A", 1)], TypeError)):
            with self.subTest(resources=resources):
                with self.assertRaises(error):
                    pre.init(path, resources)
                self.assertFalse(os.path.exists(path))

    def test_paths_with_uri_special_characters_open_the_right_file(self):
        folder = os.path.join(self.dir, "odd %41 #dir?")
        os.mkdir(folder)
        path = os.path.join(folder, "odd ?name#%41.db")
        pre.init(path, {"A": 1, "B": 2})
        self.assertEqual(self.state(path)["resources"]["B"], {"quantity": 2, "revision": 1})
        # The database and its writer queue, both under the exact name given.
        self.assertEqual(sorted(os.listdir(folder)), ["odd ?name#%41.db", "odd ?name#%41.db-queue"])
        with self.assertRaises(FileNotFoundError):
            pre.connect(os.path.join(folder, "odd ?other.db"))
        self.assertEqual(sorted(os.listdir(folder)), ["odd ?name#%41.db", "odd ?name#%41.db-queue"])

    def test_every_connection_reports_wal_full_foreign_keys_and_the_busy_deadline(self):
        for connection in (self.c, self.open()):
            self.assertIsNone(connection.isolation_level)
            self.assertEqual(connection.execute("PRAGMA journal_mode").fetchone()[0], "wal")
            self.assertEqual(connection.execute("PRAGMA synchronous").fetchone()[0], 2)
            self.assertEqual(connection.execute("PRAGMA foreign_keys").fetchone()[0], 1)
            self.assertEqual(connection.execute("PRAGMA busy_timeout").fetchone()[0],
                             pre.BUSY_DEADLINE * 1000)

    def test_snapshot_is_sorted_and_counts_effects_and_receipts(self):
        db = self.make_db("many.db", {"b": 1, "C": 2, "a": 3})
        c = self.open(db)
        pre.execute(c, "job-1", plan(src="a", dst="b", amount=1))
        pre.execute(c, "job-2", plan(src="a", dst="b", amount=1))
        snap = pre.snapshot(c)
        self.assertEqual(list(snap["resources"]), ["C", "a", "b"])
        self.assertEqual((snap["effects"], snap["receipts"]), (1, 2))


if __name__ == "__main__":
    unittest.main()
