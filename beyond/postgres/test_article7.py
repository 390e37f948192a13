"""Tests of article7.sql, 第七篇 in PostgreSQL, against a real server.

Run from the project root: ``python3 -m unittest beyond.postgres.test_article7``.  Each test has a
database of its own on one throw-away server (harness.py); races release 16 psql clients
together at a barrier checked in pg_locks, at each isolation level and at mixed ones, retrying
40001, 40P01 and (execute, change) 23505 as README.md says; the step test compares every answer
with preconditions.py's.  Without PostgreSQL they skip, and the run says so in one line.
"""
import hashlib
import os
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import preconditions as pre  # noqa: E402
import run_experiment  # noqa: E402
from beyond.postgres import harness  # noqa: E402
from beyond.postgres.harness import (  # noqa: E402
    CLIENTS, FILLER, LEVELS, MIXED, RETRIED, ROUNDS, SETTINGS, call, isolate, literal, query, race,
    value)
# README.md's rule for execute() and change(): a 23505 is retried like a 40001.
RETRIED_7 = RETRIED + ("23505",)


# === 第七篇 §2–§4: one decision per op, and plans racing each other =============================

class ExecuteTest(harness.TestCase):
    """execute() and change() under 16 racing clients, at every isolation level."""

    def test_16_distinct_ops_on_one_snapshot_give_1_applied_and_15_stale_in_both_directions(self):
        racers = self.racers(MIXED)
        names = [(f"A{s}-{r}", f"B{s}-{r}") for s in range(len(SETTINGS)) for r in range(ROUNDS)]
        seed(self.session, {name: 10 if name[0] == "A" else 0 for pair in names for name in pair})
        for s, (setting, levels) in enumerate(SETTINGS.items()):
            isolate(racers, levels)
            for r in range(ROUNDS):
                a, b = names[s * ROUNDS + r]
                calls = [execute(f"d{s}-{r}-{i}", plan(1, 1, 3, a, b), r, r)
                         for i in range(CLIENTS)]
                first, _ = race(self.session, racers, calls)
                self.assertEqual(sorted(x["status"] for x in first), ["applied"] + ["stale"] * 15)
                self.assertIn({"status": "applied", "revisions": {a: 2, b: 2},
                               "quantities": {a: 7, b: 3}}, first)
                self.assertEqual(first.count({"status": "stale", "observed": {a: 2, b: 2}}), 15)
                # A -> B and B -> A at once: locked in name order, so never a deadlock.
                calls = [execute(f"m{s}-{r}-{i}", plan(2, 2, 1, a, b) if i < 8 else
                                 plan(2, 2, 1, b, a), r, r) for i in range(CLIENTS)]
                second, _ = race(self.session, racers, calls)
                self.assertEqual(sorted(x["status"] for x in second), ["applied"] + ["stale"] * 15)
                winner = next(i for i, x in enumerate(second) if x["status"] == "applied")
                self.assertEqual(resources(self.session, a, b),
                                 ((6, 3), (4, 3)) if winner < 8 else ((8, 3), (2, 3)), setting)
        self.assertEqual(query(self.session, "SELECT (SELECT count(*) FROM article7.effects),"
                                             " (SELECT count(*) FROM article7.receipt)"),
                         [[str(2 * len(names)), str(2 * CLIENTS * len(names))]])

    def test_16_copies_of_one_op_give_1_applied_and_15_replayed_and_a_23505_retried_answers(self):
        racers = self.racers(MIXED)
        rows = {}
        for s in range(len(SETTINGS)):
            for r in range(ROUNDS):
                rows.update({f"A{s}-{r}": 10, f"B{s}-{r}": 0})
                rows.update({f"P{s}-{r}-{i}{end}": 10 for i in range(CLIENTS) for end in "ab"})
        seed(self.session, rows)
        for s, (setting, levels) in enumerate(SETTINGS.items()):
            isolate(racers, levels)
            for r in range(ROUNDS):
                a, b, op = f"A{s}-{r}", f"B{s}-{r}", f"same{s}-{r}"
                applied = {"status": "applied", "revisions": {a: 2, b: 2},
                           "quantities": {a: 7, b: 3}}
                copies, _ = race(self.session, racers, [execute(op, plan(1, 1, 3, a, b), r, r)]
                                 * CLIENTS, RETRIED_7)
                self.assertEqual(sorted(copies, key=lambda x: x["status"]),
                                 [applied] + [{"status": "replayed", "result": applied}] * 15)
                other, _ = race(self.session, racers, [execute(op, plan(1, 1, 4, a, b), r, r)]
                                * CLIENTS, RETRIED_7)
                self.assertEqual(other, [{"status": "conflict"}] * CLIENTS)
                # One op sent for 16 pairs of rows: one is decided, and the 15 others raise
                # 23505 (or 40001) at the receipt; retried, they answer conflict.
                calls = [execute(f"pair{s}-{r}", plan(1, 1, 1, f"P{s}-{r}-{i}a", f"P{s}-{r}-{i}b"),
                                 r, r) for i in range(CLIENTS)]
                pairs, _ = race(self.session, racers, calls, RETRIED_7)
                self.assertEqual(sorted(x["status"] for x in pairs),
                                 ["applied"] + ["conflict"] * 15)
                missing = {"status": "missing_resource", "missing": [f"X{s}-{r}", f"Y{s}-{r}"]}
                calls = [execute(f"gone{s}-{r}", plan(1, 1, 1, f"X{s}-{r}", f"Y{s}-{r}"), r, r)]
                gone, _ = race(self.session, racers, calls * CLIENTS, RETRIED_7)
                self.assertEqual(sorted(gone, key=lambda x: x["status"]),
                                 [missing] + [{"status": "replayed", "result": missing}] * 15)
                self.assertEqual(resources(self.session, a, b), ((7, 2), (3, 2)), setting)
        self.assertEqual(query(self.session, "SELECT (SELECT count(*) FROM article7.effects),"
                                             " (SELECT count(*) FROM article7.receipt)"),
                         [[str(2 * len(SETTINGS) * ROUNDS), str(3 * len(SETTINGS) * ROUNDS)]])

    def test_change_loses_no_update_runs_once_per_op_and_a_change_makes_an_older_plan_stale(self):
        racers = self.racers(MIXED)
        rows = {}
        for s in range(len(SETTINGS)):
            for r in range(ROUNDS):
                rows.update({f"A{s}-{r}": 10, f"B{s}-{r}": 0, f"C{s}-{r}": 100, f"D{s}-{r}": 10})
                rows.update({f"R{s}-{r}-{i}": 10 for i in range(CLIENTS)})
        seed(self.session, rows)
        for s, (setting, levels) in enumerate(SETTINGS.items()):
            isolate(racers, levels)
            for r in range(ROUNDS):
                a, b, c, d = (f"{x}{s}-{r}" for x in "ABCD")
                increments, _ = race(self.session, racers, [change(f"inc{s}-{r}-{i}", c, 1, r, r)
                                                            for i in range(CLIENTS)])
                self.assertEqual(sorted((x["status"], x["revision"], x["quantity"])
                                        for x in increments),
                                 [("changed", 2 + n, 101 + n) for n in range(16)],
                                 "no lost update")
                once = {"status": "changed", "name": c, "quantity": 121, "revision": 18}
                copies, _ = race(self.session, racers,
                                 [change(f"once{s}-{r}", c, 5, r, r)] * CLIENTS)
                self.assertEqual(sorted(copies, key=lambda x: x["status"]),
                                 [once] + [{"status": "replayed", "result": once}] * 15)
                # Changes of B race plans made at B's revision 1: at most one plan applies.
                calls = [change(f"b{s}-{r}-{i}", b, 2, r, r) if i < 8 else
                         execute(f"p{s}-{r}-{i}", plan(1, 1, 3, a, b), r, r)
                         for i in range(CLIENTS)]
                racing, _ = race(self.session, racers, calls)
                applied = [x for x in racing[8:] if x["status"] == "applied"]
                self.assertLessEqual(len(applied), 1)
                self.assertEqual([x["status"] for x in racing[:8]], ["changed"] * 8)
                self.assertEqual(sorted(x["status"] for x in racing[8:]),
                                 ["applied"] * len(applied) + ["stale"] * (8 - len(applied)))
                revisions = sorted([x["revision"] for x in racing[:8]]
                                   + [x["revisions"][b] for x in applied])
                self.assertEqual(revisions, list(range(2, 10 + len(applied))), "each made once")
                n = len(applied)
                self.assertEqual(resources(self.session, a, b),
                                 ((10 - 3 * n, 1 + n), (16 + 3 * n, 9 + n)))
                calls = [execute(f"late{s}-{r}-{i}", plan(1, 1, 3, d, b) if i < 8 else
                                 plan(1, 1, 3, b, d), r, r) for i in range(CLIENTS)]
                late, _ = race(self.session, racers, calls)
                self.assertEqual(late, [{"status": "stale", "observed": {
                    d: 1, b: 9 + len(applied)}}] * CLIENTS, setting)
                # One change op sent for 16 rows: one changes, 15 conflict after 23505.
                spread, _ = race(self.session, racers, [change(f"spread{s}-{r}", f"R{s}-{r}-{i}",
                                                              1, r, r) for i in range(CLIENTS)],
                                 RETRIED_7)
                self.assertEqual(sorted(x["status"] for x in spread),
                                 ["changed"] + ["conflict"] * 15)
                self.assertEqual(query(self.session, "SELECT sum(quantity), sum(revision) FROM"
                                       f" article7.resources WHERE name LIKE 'R{s}-{r}-%'"),
                                 [[str(10 * CLIENTS + 1), str(CLIENTS + 1)]])

    def test_a_whole_balance_moves_and_a_change_reaches_exactly_zero(self):
        seed(self.session, {"A": 10, "B": 0, "C": 5})
        self.assertEqual(value(self.session, execute("all", plan(1, 1, 10, "A", "B"), 0, 0)),
                         {"status": "applied", "revisions": {"A": 2, "B": 2},
                          "quantities": {"A": 0, "B": 10}})
        self.assertEqual(value(self.session, change("zero", "C", -5, 0, 0)),
                         {"status": "changed", "name": "C", "quantity": 0, "revision": 2})
        self.assertEqual(value(self.session, execute("more", plan(2, 2, 1, "A", "B"), 0, 0)),
                         {"status": "insufficient", "available": 0})
        self.assertEqual(value(self.session, change("below", "C", -1, 0, 0)),
                         {"status": "insufficient", "available": 0})


    def test_opposite_plans_queued_behind_a_held_row_neither_deadlock_nor_fail(self):
        # Deterministic: a third session holds row A.  A plan A -> B waits for it, then a plan
        # B -> A is sent.  Locking in name order, that one waits for A too, holding nothing.
        # Locking its source first, it would hold B; once A is free the first plan would wait
        # for B: a deadlock, 40P01, which the races' retry would hide.
        seed(self.session, {"A": 10, "B": 10})
        holder, forth, back = self.client(), self.client(), self.client()
        query(holder, "BEGIN; SELECT 1 FROM article7.resources WHERE name = 'A' FOR UPDATE")
        for client, (src, dst) in ((forth, ("A", "B")), (back, ("B", "A"))):
            pid = value(client, "SELECT pg_backend_pid()")
            harness.send(client, execute(src + dst, plan(1, 1, 1, src, dst), 0, 0))
            waiting(self.session, pid)
        query(holder, "COMMIT")
        answers = [harness.reply(client) for client in (forth, back)]
        self.assertEqual([answer.state for answer in answers], ["00000", "00000"])
        self.assertEqual(sorted(harness.parsed(a.rows[0][0])["status"] for a in answers),
                         ["applied", "stale"])

    def test_a_copy_waiting_for_the_rows_of_its_op_in_flight_answers_replayed(self):
        # Deterministic, at READ COMMITTED: a trigger holds op X after it took the rows and read
        # history; a copy of X is seen waiting for the rows, then X commits.  The copy reads
        # history once the rows are its own: replayed.  Read before them, it would find no
        # receipt, decide, and raise 23505 at X's (which the races' retry would hide).
        seed(self.session, {"A": 10, "B": 0})
        query(self.session, "CREATE FUNCTION public.hold() RETURNS trigger LANGUAGE plpgsql AS $$"
                            " BEGIN PERFORM pg_advisory_lock_shared(7401, 2);"
                            " PERFORM pg_advisory_unlock_shared(7401, 2); RETURN NEW; END $$;"
                            " CREATE TRIGGER hold BEFORE INSERT ON article7.effects FOR EACH ROW"
                            " EXECUTE FUNCTION public.hold()")
        held, copy = self.client("read committed"), self.client("read committed")
        pids = [value(c, "SELECT pg_backend_pid()") for c in (held, copy)]
        query(self.session, "SELECT pg_advisory_lock(7401, 2)")
        for client, pid in zip((held, copy), pids):
            harness.send(client, execute("X", plan(1, 1, 3), 0, 0))
            waiting(self.session, pid)
        query(self.session, "SELECT pg_advisory_unlock(7401, 2)")
        applied = {"status": "applied", "revisions": {"A": 2, "B": 2},
                   "quantities": {"A": 7, "B": 3}}
        answers = [harness.reply(client) for client in (held, copy)]
        self.assertEqual([(a.state, harness.parsed(a.rows[0][0]) if a.rows else None)
                          for a in answers],
                         [("00000", applied), ("00000", {"status": "replayed",
                                                         "result": applied})])


# === beyond 第七篇: receipts that are not kept forever ==========================================

class PurgeTest(harness.TestCase):
    """purge() racing late replays, at every isolation level; the receipt at the mark stays."""

    def test_after_a_purge_an_op_issued_before_the_mark_is_expired_at_every_level(self):
        racers = self.racers(MIXED)
        rounds = [(s, r, 10000 * (s + 1) + 1000 * r) for s in range(len(SETTINGS))
                  for r in range(ROUNDS)]
        seed(self.session, {f"{x}{s}-{r}": 10 if x == "A" else 5 if x == "C" else 0
                        for s, r, _ in rounds for x in "ABC"})
        for (s, r, t), (setting, levels) in zip(rounds, [(k, v) for k, v in SETTINGS.items()
                                                         for _ in range(ROUNDS)]):
            isolate(racers, levels)
            a, b, c = (f"{x}{s}-{r}" for x in "ABC")
            ops = {"x": execute(f"x{s}-{r}", plan(1, 1, 3, a, b), t, t),
                   "s": execute(f"s{s}-{r}", plan(1, 1, 3, a, b), t, t),
                   "c": change(f"c{s}-{r}", c, -1, t, t)}
            decided = {name: value(self.session, statement) for name, statement in ops.items()}
            query(self.session, "INSERT INTO article7.receipt SELECT 'filler-' || n || '-"
                                f"{s}-{r}', 'd', '{{}}', {t} FROM generate_series(1, {FILLER}) n")
            late = {name: statement.replace(f", {t}, {t})", f", {t}, {t + 600})")
                    for name, statement in ops.items()}
            calls = ([call("article7.purge", t + 500 + i + 1, 500) for i in range(8)]
                     + [late["x"]] * 3 + [late["s"]] * 3 + [late["c"]] * 2)
            racing, _ = race(self.session, racers, calls)
            purged = [x for x in racing[:8] if x["status"] == "purged"]
            self.assertEqual(sum(x["deleted"] for x in purged), 3 + FILLER, "each deleted once")
            for i, x in enumerate(racing[:8]):
                if x["status"] == "backwards":
                    self.assertGreater(x["low_water"], t + i + 1)
                else:
                    self.assertEqual(x["low_water"], t + i + 1)
            for name, x in zip("xxxsssc" + "c", racing[8:]):
                self.assertIn(x, ({"status": "replayed", "result": decided[name]},
                                  {"status": "expired", "low_water": x.get("low_water")}))
            self.assertEqual(value(self.session, "SELECT low_water FROM article7.retention"),
                             str(t + 8), "the highest mark, never moved back")
            self.assertEqual(resources(self.session, a, b, c),
                             ((7, 2), (3, 2), (4, 2)), f"{setting}: nothing decided twice")
            # Then: replays, the decided op at a later issued_at (its effect outlives the
            # receipt), new ops issued before the mark: expired.  New ops issued after: decided.
            calls = ([late["x"]] * 3 + [execute(f"x{s}-{r}", plan(1, 1, 3, a, b), t + 9, t + 600)]
                     * 2 + [late["s"]] * 3 + [late["c"]] * 2
                     + [execute(f"n{s}-{r}-{i}", plan(2, 2, 1, a, b), t, t + 600)
                        for i in range(4)]
                     + [execute(f"f{s}-{r}-{i}", plan(2, 2, 1, a, b), t + 9, 10 ** 6)
                        for i in range(2)])
            after, _ = race(self.session, racers, calls)
            self.assertEqual(after[:14], [{"status": "expired", "low_water": t + 8}] * 14)
            self.assertEqual(sorted(x["status"] for x in after[14:]), ["applied", "stale"])
        self.assertEqual(query(self.session, "SELECT (SELECT count(*) FROM article7.effects),"
                                             " (SELECT count(*) FROM article7.changes),"
                                             " (SELECT count(*) FROM article7.receipt)"),
                         [[str(2 * len(rounds)), str(len(rounds)), str(2 * len(rounds))]])

    def test_a_purge_waits_for_an_execute_in_flight_so_an_op_is_never_decided_twice(self):
        # Deterministic: a trigger (the test's, for this fault only) holds an execute of op X
        # after its history read.  Meanwhile X is decided for other rows (stale) and a purge
        # comes.  Had the purge not waited, it would delete that receipt, and the held execute
        # would decide X a second time.
        seed(self.session, {"A": 10, "B": 0, "P": 10, "Q": 0})
        query(self.session, "CREATE FUNCTION public.hold() RETURNS trigger LANGUAGE plpgsql AS $$"
                            " BEGIN PERFORM pg_advisory_lock_shared(7401, 1);"
                            " PERFORM pg_advisory_unlock_shared(7401, 1); RETURN NEW; END $$;"
                            " CREATE TRIGGER hold BEFORE INSERT ON article7.effects FOR EACH ROW"
                            " WHEN (NEW.src = 'A') EXECUTE FUNCTION public.hold()")
        for n, level in enumerate(LEVELS):
            t, op = 100 * (n + 1), f"X{n}"
            held, purger = self.client(level), self.client(level)
            pids = [value(c, "SELECT pg_backend_pid()") for c in (held, purger)]
            query(self.session, "SELECT pg_advisory_lock(7401, 1)")
            harness.send(held, execute(op, plan(1, 1, 1, "A", "B"), t, t))
            waiting(self.session, pids[0])
            stale = value(self.session, execute(op, plan(9, 9, 1, "P", "Q"), t, t))
            self.assertEqual(stale["status"], "stale")
            harness.send(purger, call("article7.purge", t + 10, 5))
            waiting(self.session, pids[1])
            query(self.session, "SELECT pg_advisory_unlock(7401, 1)")
            answer = harness.reply(held)
            self.assertIn(answer.state, ("23505", "40001"), level)
            self.assertEqual(harness.reply(purger).state, "00000")
            self.assertEqual(value(held, execute(op, plan(1, 1, 1, "A", "B"), t, t + 20)),
                             {"status": "expired", "low_water": t + 5})
            self.assertEqual(query(self.session, "SELECT count(*) FROM article7.effects"
                                                 f" WHERE op = '{op}'"), [["0"]], level)
        self.assertEqual(resources(self.session, "A", "B"), ((10, 1), (0, 1)))

    def test_a_purge_waits_for_a_change_in_flight_so_an_op_is_never_decided_twice(self):
        # As for execute: a trigger holds a change of op X after its history read.  Meanwhile X
        # is decided for a missing resource, and a purge comes: it waits for the held change.
        # Had it not, it would delete that receipt, and the held change would decide X again.
        seed(self.session, {"C": 5})
        query(self.session, "CREATE FUNCTION public.hold() RETURNS trigger LANGUAGE plpgsql AS $$"
                            " BEGIN PERFORM pg_advisory_lock_shared(7401, 1);"
                            " PERFORM pg_advisory_unlock_shared(7401, 1); RETURN NEW; END $$;"
                            " CREATE TRIGGER hold BEFORE INSERT ON article7.changes FOR EACH ROW"
                            " WHEN (NEW.name = 'C') EXECUTE FUNCTION public.hold()")
        for n, level in enumerate(LEVELS):
            t, op = 100 * (n + 1), f"X{n}"
            held, purger = self.client(level), self.client(level)
            pids = [value(c, "SELECT pg_backend_pid()") for c in (held, purger)]
            query(self.session, "SELECT pg_advisory_lock(7401, 1)")
            harness.send(held, change(op, "C", -1, t, t))
            waiting(self.session, pids[0])
            missing = value(self.session, change(op, "Z", 1, t, t))
            self.assertEqual(missing["status"], "missing_resource")
            harness.send(purger, call("article7.purge", t + 10, 5))
            waited = harness.waits(self.session, pids[1], "article7.purge(")
            query(self.session, "SELECT pg_advisory_unlock(7401, 1)")
            self.assertTrue(waited, f"{level}: the purge did not wait for the change")
            self.assertIn(harness.reply(held).state, ("23505", "40001"), level)
            self.assertEqual(harness.reply(purger).state, "00000")
            self.assertEqual(value(held, change(op, "C", -1, t, t + 20)),
                             {"status": "expired", "low_water": t + 5})
        self.assertEqual(query(self.session, "SELECT count(*) FROM article7.changes"), [["0"]])
        self.assertEqual(resources(self.session, "C"), ((5, 1),))

    def test_a_purge_called_again_at_the_same_mark_answers_purged_with_nothing_deleted(self):
        seed(self.session, {"C": 5})
        s = self.session
        value(s, change("c", "C", 1, 3, 3))
        self.assertEqual(value(s, call("article7.purge", 10, 5)),
                         {"status": "purged", "deleted": 1, "low_water": 5})
        for now, window in ((10, 5), (12, 7)):
            self.assertEqual(value(s, call("article7.purge", now, window)),
                             {"status": "purged", "deleted": 0, "low_water": 5})

    def test_purge_keeps_the_receipt_written_at_the_mark_and_deletes_the_one_before(self):
        seed(self.session, {"A": 10, "B": 0, "C": 5})
        s = self.session
        first = value(s, execute("at0", plan(1, 1, 1, "A", "B"), 0, 0))
        value(s, change("at1", "C", 1, 1, 1))
        self.assertEqual(value(s, call("article7.purge", 1, 1)),
                         {"status": "purged", "deleted": 0, "low_water": 0})
        self.assertEqual(value(s, execute("at0", plan(1, 1, 1, "A", "B"), 0, 5)),
                         {"status": "replayed", "result": first})
        self.assertEqual(value(s, call("article7.purge", 2, 1)),
                         {"status": "purged", "deleted": 1, "low_water": 1})
        self.assertEqual(value(s, change("at1", "C", 1, 1, 5))["status"], "replayed")
        self.assertEqual(value(s, execute("at0", plan(1, 1, 1, "A", "B"), 0, 5)),
                         {"status": "expired", "low_water": 1})


# === preconditions.py step by step; digests; bad input ==========================================

class StepByStepTest(harness.TestCase):
    """Every answer of article7.sql against preconditions.py's, and what it refuses."""

    def test_the_sql_answers_as_preconditions_py_does_step_by_step(self):
        # Removed by its finalizer too, should an interrupt skip the cleanups.
        temporary = tempfile.TemporaryDirectory()
        self.addCleanup(temporary.cleanup)
        folder = temporary.name
        quantities = {"A": 10, "B": 0, "C": 5, "Q": pre.MAX_INT64 - 1, "R": 1, "名额A": 3,
                      'q"\\\n': 2}
        pre.init(os.path.join(folder, "p.db"), quantities)
        twin = pre.connect(os.path.join(folder, "p.db"))
        self.addCleanup(twin.close)
        twin.execute("UPDATE resources SET revision = ? WHERE name = 'R'", (pre.MAX_INT64,))
        seed(self.session, quantities)
        query(self.session, f"UPDATE article7.resources SET revision = {pre.MAX_INT64}"
                            " WHERE name = 'R'")
        amount = '{"src": "A", "dst": "B", "amount": %s, "expected": {"A": 1, "B": 1}}'
        steps = [
            ("execute", "op1", plan(1, 1, 3), 1, 1), ("execute", "op1", plan(1, 1, 3), 1, 2),
            ("execute", "op1", plan(1, 1, 4), 1, 2), ("execute", "op2", plan(1, 1, 3), 2, 2),
            ("execute", "op2", plan(1, 1, 3), 2, 3), ("execute", "op3", plan(2, 2, 100), 3, 3),
            ("execute", "op4", plan(2, 1, 1, "A", "X"), 3, 3),
            ("execute", "op5", plan(1, 1, 1, "Y", "X"), 3, 3),
            ("execute", "op6", plan(2, 1, 3, "A", "Q"), 4, 4),
            ("execute", "op7", plan(2, pre.MAX_INT64, 1, "A", "R"), 4, 4),
            ("execute", "op8", plan(1, 2, 1, "Q", "A"), 4, 4),
            ("execute", "op9", plan(1, 1, 3, "名额A", 'q"\\\n'), 4, 4),
            ("execute", "op9", '{"expected":{"名额A":1,"q\\"\\\\\\n":1},"amount":3,'
                               '"dst":"q\\"\\\\\\u000a","src":"\\u540d\\u989dA"}', 4, 5),
            ("change", "ch1", "C", -1, 5, 5), ("change", "ch1", "C", -1, 5, 6),
            ("change", "ch1", "C", -2, 5, 6), ("change", "ch2", "C", 1, 6, 6),
            ("execute", "op10", plan(1, 3, 1, "C", "A"), 7, 7),
            ("change", "ch3", "C", -100, 7, 7), ("change", "ch4", "Q", 2, 7, 7),
            ("change", "ch4b", "Q", 1, 7, 7), ("change", "ch5", "R", 1, 7, 7),
            ("change", "ch6", "Z", 1, 7, 7), ("change", "op1", "C", 1, 7, 7),
            ("change", "ch7", 'q"\\\n', -1, 7, 7),
            ("execute", "bad", amount % "true", 7, 7), ("execute", "bad", amount % "3.0", 7, 7),
            ("execute", "bad", amount % "1e3", 7, 7), ("execute", "bad", amount % "0", 7, 7),
            ("execute", "bad", amount % (10 ** 15 + 1), 7, 7),
            ("execute", "bad", amount % '"3"', 7, 7), ("execute", "bad", amount % "NaN", 7, 7),
            ("execute", "bad", {"src": "A", "dst": "A", "amount": 1, "expected": {"A": 1}}, 7, 7),
            ("execute", "bad", {"src": "A", "dst": "B", "amount": 1, "expected": {"A": 1}}, 7, 7),
            ("execute", "bad", plan(1, 0, 1), 7, 7), ("execute", "bad", plan(1, 2 ** 63, 1), 7, 7),
            ("execute", "bad", dict(plan(), x=1), 7, 7),
            ("execute", "bad", plan(1, 1, 1, ""), 7, 7),
            ("execute", "bad", plan(1, 1, 1, "A" * 65), 7, 7), ("execute", "bad", [plan()], 7, 7),
            ("execute", "bad", '{"src": "A", "src": "A", "dst": "B", "amount": 1,'
                               ' "expected": {"A": 1, "B": 1}}', 7, 7),
            ("execute", "", plan(1, 1, 1), 7, 7), ("execute", "o" * 129, plan(1, 1, 1), 7, 7),
            ("execute", "bad", plan(1, 1, 1), 8, 7), ("execute", "bad", plan(1, 1, 1), 1.5, 7),
            ("change", "bad", "C", -pre.MAX_INT64 - 1, 7, 7),
            ("change", "bad", "C", pre.MAX_INT64 + 1, 7, 7), ("change", "bad", "C", 1.5, 7, 7),
            ("change", "bad", "", 1, 7, 7), ("change", "bad", "C", 1, -1, 7),
            ("purge", 60, 50), ("purge", 55, 50), ("purge", 60, 61), ("purge", 60, 0),
            ("execute", "op1", plan(1, 1, 3), 1, 61), ("execute", "op1", plan(1, 1, 3), 20, 61),
            ("execute", "op2", plan(1, 1, 3), 2, 61), ("change", "ch2", "C", 1, 6, 61),
            ("change", "ch2", "C", 1, 30, 61), ("execute", "op11", plan(2, 2, 1), 5, 61),
            ("execute", "op11", plan(2, 2, 1), 40, 61), ("execute", "op12", plan(3, 3, 1), 61, 62),
            ("execute", "op11", plan(2, 2, 1), 40, 63),
        ]
        for step in steps:
            self.assertEqual(self.sql(step), python(twin, step), step)
        self.assertEqual(value(self.session, "SELECT jsonb_object_agg(name, jsonb_build_object("
                                             "'quantity', quantity, 'revision', revision))"
                                             " FROM article7.resources"),
                         pre.snapshot(twin)["resources"])
        for table in ("receipt", "effects", "changes"):
            self.assertEqual(value(self.session, f"SELECT jsonb_agg(op ORDER BY op COLLATE \"C\")"
                                                 f" FROM article7.{table}"),
                             [op for op, in twin.execute(f"SELECT op FROM {table} ORDER BY op")],
                             table)

    def test_the_receipts_digests_are_preconditions_digests_of_the_same_commands(self):
        names = ["A", "名额 B", 'q"uote', "back\\slash", "tab\tnew\nline\x01", "😀", "\u2028"]
        seed(self.session, {name: 10 for name in names})
        expected = {}
        for i, (src, dst) in enumerate(zip(names, names[1:] + names[:1])):
            command = plan(1, 1, 1, src, dst)
            query(self.session, execute(f"e{i}", command, 0, 0))
            expected[f"e{i}"] = digest(command)
            query(self.session, change(f"c{i}", src, -(i + 1), 0, 0))
            expected[f"c{i}"] = digest({"change": src, "delta": -(i + 1)})
        self.assertEqual(dict(query(self.session, "SELECT op, digest FROM article7.receipt")),
                         expected)

    def sql(self, step):
        kind, args = step[0], step[1:]
        state, answer = harness.outcome(self.session, call("article7." + kind, *args))
        if state == "22023":
            return "invalid"
        self.assertEqual(state, "00000", step)
        return "backwards" if answer["status"] == "backwards" else answer


# === loading: beside article 1, whatever the caller's search_path ===============================

class LoadTest(harness.TestCase):
    """article7.sql beside article1.sql: a temporary table or article1 first on the path changes
    nothing."""

    def test_a_temporary_retention_and_article1_first_on_the_path_change_nothing(self):
        seed(self.session, {"A": 10, "B": 0})
        s = self.session
        decided = value(s, execute("late", plan(1, 1, 3), 5, 5))
        query(s, "INSERT INTO article7.receipt VALUES ('other', 'd', '{}', 5)")
        value(s, call("article7.purge", 20, 10))
        query(s, "CREATE TEMPORARY TABLE retention (id integer, low_water bigint);"
                 " INSERT INTO retention VALUES (1, 0);"
                 " CREATE TEMPORARY TABLE receipt (LIKE article7.receipt);"
                 " SET search_path = article1, public")
        for path in ("article1, public", "pg_temp, article1, article7"):
            query(s, f"SET search_path = {path}")
            self.assertEqual(value(s, execute("late", plan(1, 1, 3), 5, 30)),
                             {"status": "expired", "low_water": 10}, path)
            self.assertEqual(value(s, execute("new", plan(1, 1, 3), 6, 30)),
                             {"status": "expired", "low_water": 10}, path)
        self.assertEqual(decided["status"], "applied")
        self.assertEqual(resources(self.session, "A", "B"), ((7, 2), (3, 2)))


class SourceTest(unittest.TestCase):
    """What holds without a server: the twin helpers, and the one line a run without PostgreSQL
    prints."""

    def test_the_twin_functions_are_identical_in_article1_sql_and_article7_sql(self):
        texts = {}
        for name, path in harness.ARTICLES.items():
            with open(path, encoding="utf-8") as f:
                text = f.read()
            twins = text[text.index("-- === twins"):]
            texts[name] = twins.replace("article1", "ARTICLE").replace("article7", "ARTICLE")
        self.assertEqual(texts["article1"], texts["article7"])
        self.assertGreater(texts["article1"].count("CREATE OR REPLACE FUNCTION"), 8)

    def test_without_postgresql_every_test_skips_and_the_run_says_so_in_one_line(self):
        tests = ["beyond.postgres.test_article1"] + [f"beyond.postgres.test_article7.{name}" for
                                                     name in ("ExecuteTest", "PurgeTest")]
        code = ("import sys, unittest; from beyond.postgres import harness;"
                " harness.pg_bindir = lambda: None;"
                f" run = unittest.main(module=None, argv=['unittest', *{tests!r}], exit=False);"
                " sys.exit(not run.result.wasSuccessful() or len(run.result.skipped) < 5)")
        flags = (["-X", "dev"] if sys.flags.dev_mode else []) + [f"-W{w}" for w in sys.warnoptions]
        done = subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, env=dict(
            os.environ, PYTHONPATH=ROOT), stdin=subprocess.DEVNULL, capture_output=True,
            timeout=3 * harness.SILENCE)
        lines = done.stderr.decode("utf-8", "replace").splitlines()
        self.assertEqual((done.returncode, lines.count(harness.SKIP)), (0, 1), lines)
        self.assertEqual([line for line in lines if "PostgreSQL" in line], [harness.SKIP])


class HarnessTest(harness.TestCase):
    """What the races rely on: race() releases its clients only once all of them wait."""

    def test_race_releases_no_client_until_every_client_waits_at_the_barrier(self):
        # The second client is held before the barrier, on a lock this test holds; the first
        # waits there.  The barrier stays shut: once nothing moves for SILENCE (shortened
        # here), race() fails naming how many arrived (the first, unless a loaded machine kept
        # it from arriving in time), and the first client's call never ran.
        s = self.session
        query(s, "CREATE TABLE public.ran (client integer)")
        first, late = self.client(), self.client()
        pid = value(late, "SELECT pg_backend_pid()")
        query(s, "SELECT pg_advisory_lock(7402, 1)")
        harness.send(late, "SELECT pg_advisory_lock(7402, 1)")
        waiting(s, pid)
        with mock.patch.object(harness, "SILENCE", 1.0), self.assertRaisesRegex(
                AssertionError, "^only [01] of 2 clients reached the barrier$"):
            race(s, [first, late], [f"INSERT INTO public.ran VALUES ({i})" for i in range(2)])
        query(s, "SELECT pg_advisory_unlock_all()")
        self.assertEqual(query(s, "SELECT count(*) FROM public.ran"), [["0"]])


# === machinery ==================================================================================

def plan(a=1, b=1, amount=3, src="A", dst="B"):
    return {"src": src, "dst": dst, "amount": amount, "expected": {src: a, dst: b}}


def execute(op, command, issued_at, now):
    return call("article7.execute", op, command, issued_at, now)


def change(op, name, delta, issued_at, now):
    return call("article7.change", op, name, delta, issued_at, now)


def digest(command):
    return hashlib.sha256(pre._dumps(command).encode("utf-8")).hexdigest()


def waiting(control, pid):
    """Until pg_stat_activity shows the session ``pid`` waiting on a lock (a checked wait)."""
    harness.wait_until(control, "SELECT wait_event_type = 'Lock' FROM pg_stat_activity"
                                f" WHERE pid = {pid}")


def python(twin, step):
    """preconditions.py's answer to a step, in article7.sql's shape."""
    kind, args = step[0], step[1:]
    try:
        if kind == "purge":
            return dict(pre.purge(twin, *args), status="purged")
        *args, issued_at, now = args
        if kind == "execute" and type(args[1]) is str:
            args[1] = run_experiment.json_argument(args[1], "command")
        return getattr(pre, kind)(twin, *args, issued_at=issued_at, now=now)
    except (ValueError, TypeError) as error:
        return "backwards" if "move it backwards" in str(error) else "invalid"


def seed(session, quantities):
    """Resources at revision 1."""
    query(session, "INSERT INTO article7.resources VALUES " + ", ".join(
        f"({literal(name)}, {q}, 1)" for name, q in sorted(quantities.items())))


def resources(session, *names):
    """(quantity, revision) of each resource named."""
    return tuple(tuple(int(n) for n in query(session, "SELECT quantity, revision FROM article7"
                                             f".resources WHERE name = {literal(name)}")[0])
                 for name in names)


if __name__ == "__main__":
    unittest.main()
