"""Tests of article1.sql, 第一篇 in PostgreSQL, against a real server.

Run from the project root: ``python3 -m unittest beyond.postgres.test_article1``.  Each test has a
database of its own on one throw-away server (harness.py); races release 16 psql clients
together at a barrier checked in pg_locks, at each isolation level and at mixed ones, retrying
40001 and 40P01 as README.md says; step tests compare every answer with reliability.py's.
Without PostgreSQL they skip, and the run says so in one line.
"""
import contextlib
import json
import math
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import reliability  # noqa: E402
import run_experiment  # noqa: E402
from beyond.postgres import harness  # noqa: E402
from beyond.postgres.harness import (  # noqa: E402
    CLIENTS, FILLER, LEVELS, MIXED, ROUNDS, SETTINGS, call, isolate, literal, query, race, value)

CALLER = "agent"
# The machine the tests' claimers say they run on, and the start time they give (in clock
# ticks since that machine booted).
HOST = "test-host"
STARTED = 4100


# === 第一篇 §3: one ticket per request ID, at every isolation level ============================

class ReceiveTest(harness.TestCase):
    """receive(): copies racing, late replays racing purges, a replay waiting on a purge."""

    def test_16_copies_make_one_ticket_at_every_level_and_another_payload_conflicts(self):
        racers = self.racers(MIXED)
        for s, (setting, levels) in enumerate(SETTINGS.items()):
            isolate(racers, levels)
            for r in range(ROUNDS):
                key, payload = f"copy-{s}-{r}", {"title": f"工单 {s}-{r}", "n": 1.0}
                first, _ = race(self.session, racers, [receive(key, payload, r, r)] * CLIENTS)
                text, digest = reliability.canonical(payload)
                ticket = first[0]["response"]["ticket_id"]
                response = {"caller": CALLER, "key": key, "digest": digest, "ticket_id": ticket}
                self.assertEqual(first, [{"status": "ticket", "response": response}] * CLIENTS,
                                 setting)
                calls = [receive(key, payload if i < 8 else {"title": "other"}, r, r + 1)
                         for i in range(CLIENTS)]
                second, _ = race(self.session, racers, calls)
                self.assertEqual(second, first[:8] + [{"status": "conflict"}] * 8, setting)
                self.assertEqual(query(self.session, "SELECT t.id, t.payload, r.digest FROM"
                                       " article1.tickets t JOIN article1.receipts r ON"
                                       f" r.ticket_id = t.id WHERE t.key = {literal(key)}"),
                                 [[str(ticket), text, digest]])
        self.assertEqual(query(self.session, "SELECT (SELECT count(*) FROM article1.tickets),"
                               " (SELECT count(*) FROM article1.receipts)"),
                         [[str(len(SETTINGS) * ROUNDS)] * 2])

    def test_late_replays_racing_purges_never_make_a_second_ticket_at_any_level(self):
        # Purges and late replays released together, at each level and mixed: a replay is the
        # stored ticket or expired, never a second ticket, and the mark never moves back.
        racers = self.racers(MIXED)
        payload = {"title": "late"}
        for s, (setting, levels) in enumerate(SETTINGS.items()):
            isolate(racers, levels)
            for r in range(ROUNDS):
                t, key = 10000 * (s + 1) + 1000 * r, f"late-{s}-{r}"
                first = value(self.session, receive(key, payload, t, t))
                query(self.session, filler(t, f"{s}-{r}"))
                calls = [call("article1.purge", t + 500 + i + 1, 500) if i < 8 else
                         receive(key, payload, t, t + 600) for i in range(CLIENTS)]
                racing, _ = race(self.session, racers, calls)
                purged = [a for a in racing[:8] if a["status"] == "purged"]
                self.assertEqual(sum(a["deleted"] for a in purged), 1 + FILLER, setting)
                for i, answer in enumerate(racing[:8]):
                    if answer["status"] == "backwards":
                        self.assertGreater(answer["low_water"], t + i + 1)
                    else:
                        self.assertEqual(answer, dict(answer, status="purged",
                                                      low_water=t + i + 1))
                for answer in racing[8:]:
                    self.assertIn(answer, (first, {"status": "expired", "low_water": answer.get(
                        "low_water")}), setting)
                    self.assertTrue(answer == first or t < answer["low_water"] <= t + 8)
                # Then late replays, and new keys issued before the mark: all expired.
                calls = [receive(key if i < 12 else f"new-{s}-{r}-{i}", payload, t, t + 700)
                         for i in range(CLIENTS)]
                late, _ = race(self.session, racers, calls)
                self.assertEqual(late, [{"status": "expired", "low_water": t + 8}] * CLIENTS)
                self.assertEqual(value(self.session, "SELECT low_water FROM article1.retention"),
                                 str(t + 8), "the highest mark, never moved back")
                self.assertEqual(query(self.session, "SELECT count(*) FROM article1.tickets"
                                       f" WHERE key = {literal(key)}"),
                                 [["1"]], f"{setting}: one ticket, no second one")
                self.assertEqual(query(self.session, "SELECT count(*) FROM article1.receipts"
                                       f" WHERE tick < {t + 8}"), [["0"]])

    def test_a_late_replay_waiting_on_a_purge_is_expired_or_40001_never_a_second_ticket(self):
        # Deterministic: the purge holds the mark's row; the replay is seen waiting on it in
        # pg_stat_activity, then the purge commits.  READ COMMITTED reads the new mark; the
        # other levels took their snapshot before it and raise 40001, and the retry reads it.
        purger = self.client()
        for n, level in enumerate(LEVELS):
            t, key = 100 * (n + 1), f"wait-{n}"
            replayer = self.client(level)
            pid = value(replayer, "SELECT pg_backend_pid()")
            self.assertEqual(value(self.session, receive(key, {"n": n}, t, t))["status"], "ticket")
            query(purger, "BEGIN; " + call("article1.purge", t + 10, 5))
            harness.send(replayer, receive(key, {"n": n}, t, t + 20))
            harness.wait_until(self.session, "SELECT wait_event_type = 'Lock' FROM"
                                             f" pg_stat_activity WHERE pid = {pid}")
            query(purger, "COMMIT")
            answer = harness.reply(replayer)
            if level == "read committed":
                self.assertEqual((answer.state, harness.parsed(answer.rows[0][0])),
                                 ("00000", {"status": "expired", "low_water": t + 5}))
            else:
                self.assertEqual(answer.state, "40001", level)
            self.assertEqual(value(replayer, receive(key, {"n": n}, t, t + 20)),
                             {"status": "expired", "low_water": t + 5}, level)
            # A transaction whose snapshot predates the whole purge: 40001 as well.
            if level != "read committed":
                query(self.session, receive(f"{key}b", {"n": n}, t + 5, t + 5))
                query(replayer, "BEGIN; SELECT 1")
                query(purger, call("article1.purge", t + 16, 5))
                late = receive(f"{key}b", {"n": n}, t + 5, t + 30)
                self.assertEqual(harness.state_of(replayer, late), "40001")
                query(replayer, "ROLLBACK")
                self.assertEqual(value(replayer, late), {"status": "expired", "low_water": t + 11})
        self.assertEqual(query(self.session, "SELECT key, count(*) FROM article1.tickets"
                               " GROUP BY key HAVING count(*) > 1"), [])


    def test_a_purge_called_again_at_the_same_mark_answers_purged_with_nothing_deleted(self):
        # After a lost reply the same purge comes again: the mark does not move back, so it is
        # no refusal.  Python's purge answers the same.
        s = self.session
        value(s, receive("k", {"t": 1}, 3, 3))
        first = value(s, call("article1.purge", 10, 5))
        self.assertEqual(first, {"status": "purged", "deleted": 1, "low_water": 5})
        self.assertEqual(value(s, call("article1.purge", 10, 5)),
                         {"status": "purged", "deleted": 0, "low_water": 5})
        self.assertEqual(value(s, call("article1.purge", 12, 7)),
                         {"status": "purged", "deleted": 0, "low_water": 5})
        with python_workspace() as ws:
            reliability.purge(ws.receiver, 10, 5)
            self.assertEqual(reliability.purge(ws.receiver, 12, 7),
                             {"deleted": 0, "low_water": 5})


# === 第一篇 §2, §5: the sender's outbox, claimed by racing workers =============================

class ClaimTest(harness.TestCase):
    """enqueue(), claim() and acknowledge() racing, and claim()'s boundaries."""

    def test_16_claimers_one_winner_per_attempt_unknown_never_reclaimed_late_acks_refused(self):
        fixture, expected = [], {}
        for r in range(ROUNDS):
            t = 100 * (r + 1)
            rows = {  # name: (mode, state, attempts, lease_until, issued_at, response, final)
                "X": ("idempotent", "inflight", 12, t, t - 50, None, ("done", 13)),
                "E": ("external", "inflight", 2, t - 1, t - 50, None, ("unknown", 2)),
                "M": ("idempotent", "inflight", 10, t, t - 50, None, ("blocked", 10)),
                "D": ("idempotent", "pending", 0, None, t - 50, None, ("blocked", 0)),
                "U": ("external", "unknown", 1, t - 20, t - 50, None, ("unknown", 1)),
                "B": ("idempotent", "blocked", 4, t - 20, t - 50, {"error": "fixture"},
                      ("blocked", 4)),
                "A": ("idempotent", "abandoned", 2, t - 20, t - 50, None, ("abandoned", 2)),
                "F": ("idempotent", "pending", 0, None, 10 ** 12 + r, None, ("pending", 0)),
            }
            for name, (mode, state, attempts, lease, issued, response, final) in rows.items():
                key = f"{name}-{r}"
                text, digest = reliability.canonical({"n": key})
                stored = '{"n":"tampered"}' if name == "D" else text
                fixture.append(
                    "INSERT INTO article1.requests VALUES"
                    f" ('agent', {literal(key)}, {literal(mode)}, {literal(digest)},"
                    f" {literal(stored)}, {issued}); INSERT INTO article1.outbox (caller, key,"
                    " mode, state, attempts, lease_until, response) VALUES ('agent',"
                    f" {literal(key)}, {literal(mode)}, {literal(state)}, {attempts},"
                    f" {literal(lease)}, {literal(response)}::jsonb);")
                expected[key] = final
            # A person said retry at attempt 3, so X has 9 of its 10 attempts used.
            fixture.append("INSERT INTO article1.resolutions (caller, key, attempt, decision,"
                           f" decided_by, reason) VALUES ('agent', 'X-{r}', 3, 'retry', 'tester',"
                           " 'fixture');")
            expected[f"Y-{r}"] = ("done", 1)
        query(self.session, "\n".join(fixture))
        acks = [("X", 12), ("X", 3), ("X", 13), ("X", 13), ("Y", 1), ("Y", 5), ("E", 2), ("U", 1),
                ("B", 4), ("A", 2), ("F", 1), ("M", 10), ("D", 1), ("X", 14), ("E", 3), ("Y", 2)]
        racers = self.racers(MIXED)
        for r in range(ROUNDS):
            t = 100 * (r + 1)
            calls = [call("article1.enqueue", CALLER, f"Y-{r}", {"n": f"Y-{r}"}, t)] * CLIENTS
            enqueued, _ = race(self.session, racers, calls)
            self.assertEqual(sorted(a["status"] for a in enqueued),
                             ["accepted"] + ["duplicate"] * 15)
            # Each claimer a process of its own machine.
            claimed, _ = race(self.session, racers, [call("article1.claim", t, 5000 + i,
                                                          f"host-{i}", STARTED)
                                                     for i in range(CLIENTS)])
            winners = {i: a for i, a in enumerate(claimed) if a["status"] == "claimed"}
            self.assertEqual(sorted((a["key"], a["attempt"]) for a in winners.values()),
                             [(f"X-{r}", 13), (f"Y-{r}", 1)], "one winner per due row")
            self.assertEqual([a for a in claimed if a["status"] != "claimed"],
                             [{"status": "nothing due", "now": t}] * 14)
            for a in winners.values():
                self.assertEqual((a["now"], a["mode"], json.loads(a["payload"])),
                                 (t, "idempotent", {"n": a["key"]}))
            calls = [call("article1.acknowledge", CALLER, f"{name}-{r}", attempt,
                          response_of(self.session, f"{name}-{r}")) for name, attempt in acks]
            acked, _ = race(self.session, racers, calls)
            statuses = [a["status"] for a in acked]
            # Both copies of the current attempt's acknowledgement are acknowledged: the second
            # is a replay of the first; every other one changes nothing.
            self.assertEqual(statuses, ["refused"] * 2 + ["acknowledged"] * 3 + ["refused"] * 11)
            winner = next(i for i, a in winners.items() if a["key"] == f"X-{r}")
            self.assertEqual(query(self.session, "SELECT lease_until, owner_pid, owner_host FROM"
                                   f" article1.outbox WHERE key = 'X-{r}'"),
                             [[str(t + 10), str(5000 + winner), f"host-{winner}"]])
        rows = {key: (state, int(attempts)) for key, state, attempts in
                query(self.session, "SELECT key, state, attempts FROM article1.outbox")}
        self.assertEqual({key: rows[key] for key in expected}, expected)

    def test_only_external_rows_before_the_claimed_one_become_unknown_at_their_lease_end(self):
        # As reliability.claim: rows are parked on the way to the one claimed, in id order.
        # The external row is unknown at its lease end exactly, never inside it, never later.
        s = self.session
        for key, mode in (("a", "idempotent"), ("b", "external"), ("c", "external")):
            value(s, call("article1.enqueue", CALLER, key, {"k": key}, 0, mode))
        self.assertEqual([value(s, call("article1.claim", 0, 1, HOST, STARTED))["key"]
                          for _ in "abc"], ["a", "b", "c"])
        self.assertEqual(value(s, call("article1.claim", 9, 1, HOST, STARTED)),
                         {"status": "nothing due", "now": 9})
        self.assertEqual(states(s), {"a": ("inflight", 1), "b": ("inflight", 1),
                                     "c": ("inflight", 1)}, "inside the lease")
        claimed = value(s, call("article1.claim", 10, 1, HOST, STARTED))
        self.assertEqual((claimed["key"], claimed["attempt"]), ("a", 2))
        self.assertEqual(states(s), {"a": ("inflight", 2), "b": ("inflight", 1),
                                     "c": ("inflight", 1)}, "b and c lie after the claimed row")
        self.assertEqual(value(s, call("article1.claim", 10, 1, HOST, STARTED)),
                         {"status": "nothing due", "now": 10})
        self.assertEqual(states(s), {"a": ("inflight", 2), "b": ("unknown", 1),
                                     "c": ("unknown", 1)}, "at the lease end, not a tick later")

    def test_an_acknowledgement_replayed_after_a_lost_reply_answers_acknowledged_again(self):
        s = self.session
        value(s, call("article1.enqueue", CALLER, "k", {"t": 1}, 0))
        value(s, call("article1.claim", 0, 1, HOST, STARTED))
        good = response_of(s, "k")
        other = dict(json.loads(good), ticket_id=8)
        self.assertEqual(value(s, call("article1.acknowledge", CALLER, "k", 1, good)),
                         {"status": "acknowledged"})
        self.assertEqual(value(s, call("article1.acknowledge", CALLER, "k", 1, good)),
                         {"status": "acknowledged"}, "the same attempt and response again")
        for attempt, response in ((1, other), (2, good), (2 ** 62, good)):
            late = call("article1.acknowledge", CALLER, "k", attempt, response)
            self.assertEqual(value(s, late), {"status": "refused", "state": "done", "attempts": 1})
        self.assertEqual(query(s, "SELECT state, response->>'ticket_id' FROM article1.outbox"),
                         [["done", "7"]])


    def test_an_attempt_out_of_range_raises_22023_as_reliability_acknowledge_raises(self):
        # Attempts count from 1 to 2^62: 0, -1 and 1e400 are bad input, not late attempts.
        s = self.session
        value(s, call("article1.enqueue", CALLER, "k", {"t": 1}, 0))
        value(s, call("article1.claim", 0, 1, HOST, STARTED))
        good = response_of(s, "k")
        with python_workspace() as ws:
            # SQL's text of each attempt, and what Python's json reads it as.
            for attempt, read in (("0", 0), ("-1", -1), ("-0", 0), ("1e400", math.inf),
                                  (str(2 ** 62 + 1), 2 ** 62 + 1), ("NULL", None)):
                statement = (f"SELECT article1.acknowledge('agent', 'k', {attempt},"
                             f" {literal(good)})")
                self.assertEqual(harness.state_of(s, statement), "22023", attempt)
                with self.assertRaises(ValueError, msg=attempt):
                    reliability.acknowledge(ws.sender, CALLER, "k", read, json.loads(good))
        self.assertEqual(query(s, "SELECT state, attempts FROM article1.outbox"),
                         [["inflight", "1"]])
        self.assertEqual(value(s, call("article1.acknowledge", CALLER, "k", 1, good)),
                         {"status": "acknowledged"})


    def test_a_claim_skips_a_row_another_claim_holds_and_takes_the_next_without_waiting(self):
        # Deterministic: the first claim's transaction stays open on row a; the second claim
        # neither waits for it nor takes a: it takes b at once.
        s, first, second = self.session, self.client(), self.client()
        for key in "abc":
            value(s, call("article1.enqueue", CALLER, key, {"k": key}, 0))
        claimed = value(first, "BEGIN; " + call("article1.claim", 0, 1, HOST, STARTED))
        self.assertEqual(claimed["key"], "a")
        pid = value(second, "SELECT pg_backend_pid()")
        harness.send(second, call("article1.claim", 0, 2, HOST, STARTED))
        waited = harness.waits(s, pid, "article1.claim(")
        query(first, "COMMIT")
        answer = harness.reply(second)
        self.assertFalse(waited, "the second claim waited for the first")
        self.assertEqual((harness.parsed(answer.rows[0][0])["key"], states(s)),
                         ("b", {"a": ("inflight", 1), "b": ("inflight", 1),
                                "c": ("pending", 0)}))

    def test_a_stored_payload_respaced_is_not_sent_but_blocked_as_corrupt(self):
        # Its digest is still the canonical text's, but what a claim hands out is sent as it
        # is: only the canonical text itself may go.
        s = self.session
        value(s, call("article1.enqueue", CALLER, "k", {"t": 1}, 0))
        query(s, "UPDATE article1.requests SET payload = '{\"t\": 1}'")
        self.assertEqual(value(s, call("article1.claim", 0, 1, HOST, STARTED)),
                         {"status": "nothing due", "now": 0})
        self.assertEqual(query(s, "SELECT state, attempts, response->>'error' FROM"
                                  " article1.outbox"),
                         [["blocked", "0", "corrupt intent: not the text, payload and digest"
                                           " enqueue() stores"]])

    def test_a_second_response_racing_the_first_for_one_attempt_is_refused(self):
        # Deterministic: the first acknowledgement holds the row, uncommitted; a second one,
        # for the same attempt with another ticket, is seen waiting, then the first commits.
        # The second then finds the row done with the first response: refused.
        s, first, second = self.session, self.client(), self.client()
        value(s, call("article1.enqueue", CALLER, "k", {"t": 1}, 0))
        value(s, call("article1.claim", 0, 1, HOST, STARTED))
        good = json.loads(response_of(s, "k"))
        query(first, "BEGIN; " + call("article1.acknowledge", CALLER, "k", 1, good))
        pid = value(second, "SELECT pg_backend_pid()")
        harness.send(second, call("article1.acknowledge", CALLER, "k", 1,
                                  dict(good, ticket_id=8)))
        self.assertTrue(harness.waits(s, pid, "article1.acknowledge("))
        query(first, "COMMIT")
        answer = harness.reply(second)
        self.assertEqual((answer.state, harness.parsed(answer.rows[0][0])),
                         ("00000", {"status": "refused", "state": "done", "attempts": 1}))
        self.assertEqual(query(s, "SELECT state, response->>'ticket_id' FROM article1.outbox"),
                         [["done", "7"]])
        self.assertEqual(late_results(s), [["k", "1", dict(good, ticket_id=8)]])


# === beyond 第一篇: leaving unknown, with claimers on several machines ========================

class ReconcileTest(harness.TestCase):
    """reconcile() takes gone as evidence only about the claimer the row records, on its
    machine, once its lease is over."""

    def test_gone_counts_only_for_the_claimer_and_machine_the_row_records(self):
        # Claimers run on several machines, where pids repeat.  A person retries attempt 1;
        # a claim on another machine sends attempt 2.  Evidence gathered about attempt 1's
        # claimer is then about a process that may not act, not about the one that may.
        s = self.session
        value(s, call("article1.enqueue", CALLER, "x", {"t": 1}, 0, "external"))
        self.assertEqual(value(s, call("article1.claim", 0, 7, "host-a", STARTED))["attempt"], 1)
        self.assertEqual(value(s, call("article1.claim", 10, 9, "host-c", STARTED))["status"],
                         "nothing due")
        self.assertEqual(owner(s, "x"), ["unknown", "1", "7", "host-a", "4100"])
        for pid, host in ((7, "host-b"), (8, "host-a")):
            self.assertEqual(reconcile(s, "x", 10, True, pid, host), {
                "status": "unknown", "reason": "gone is about another claimer: this attempt's"
                " is pid 7 on host-a, started at 4100"}, (pid, host))
        value(s, call("article1.resolve", CALLER, "x", "retry", 1, "ops", "tool down"))
        self.assertEqual(value(s, call("article1.claim", 10, 7, "host-b", STARTED))["attempt"], 2)
        self.assertEqual(value(s, call("article1.claim", 20, 9, "host-c", STARTED))["status"],
                         "nothing due")
        self.assertEqual(owner(s, "x"), ["unknown", "2", "7", "host-b", "4100"])
        self.assertEqual(reconcile(s, "x", 20, True, 7, "host-a")["status"], "unknown")
        self.assertEqual(reconcile(s, "x", 20, True, 7, "host-b"), {
            "status": "pending", "reason": "proven absent: retry under the same key"})
        self.assertEqual(owner(s, "x"), ["pending", "2", "", "", ""])


    def test_gone_counts_only_for_the_process_the_row_records_not_one_a_restart_gave_its_pid(
            self):
        # A restarted container keeps its name and its host's boot id, and its agent, at PID 1
        # again, keeps its pid: only the start time tells the new process from the old.  The
        # old one claims attempt 1 and dies; a person retries; the new one claims attempt 2.
        # Evidence that one of them is gone says nothing about the other.
        s = self.session
        host = "container-3f2a 9c41e0d2-boot"
        value(s, call("article1.enqueue", CALLER, "x", {"t": 1}, 0, "external"))
        self.assertEqual(value(s, call("article1.claim", 0, 1, host, 500))["attempt"], 1)
        self.assertEqual(value(s, call("article1.claim", 10, 9, "host-c", STARTED))["status"],
                         "nothing due")
        self.assertEqual(owner(s, "x"), ["unknown", "1", "1", host, "500"])
        self.assertEqual(reconcile(s, "x", 10, True, 1, host, started=900), {
            "status": "unknown", "reason": "gone is about another claimer: this attempt's is"
            f" pid 1 on {host}, started at 500"}, "the new process's absence, the old one's row")
        value(s, call("article1.resolve", CALLER, "x", "retry", 1, "ops", "old agent died"))
        self.assertEqual(value(s, call("article1.claim", 10, 1, host, 900))["attempt"], 2)
        self.assertEqual(value(s, call("article1.claim", 20, 9, "host-c", STARTED))["status"],
                         "nothing due")
        self.assertEqual(owner(s, "x"), ["unknown", "2", "1", host, "900"])
        self.assertEqual(reconcile(s, "x", 20, True, 1, host, started=500), {
            "status": "unknown", "reason": "gone is about another claimer: this attempt's is"
            f" pid 1 on {host}, started at 900"}, "the old process's absence, the new one's row")
        self.assertEqual(reconcile(s, "x", 20, True, 1, host, started=900), {
            "status": "pending", "reason": "proven absent: retry under the same key"})
        self.assertEqual(owner(s, "x"), ["pending", "2", "", "", ""])

    def test_an_external_row_in_flight_inside_its_lease_with_no_ticket_answers_inflight(self):
        # Its claimer may still act, and the row is its own: reconcile changes nothing and
        # answers the row's state, whatever gone says, as reliability.reconcile does.  Past the
        # lease, no claim has parked it yet: still in flight, not unknown.
        s = self.session
        with python_workspace() as ws:
            editions = Editions(s, ws)
            steps = [("enqueue", "x", {"t": 1}, 0, "external"), ("claim", 0),
                     ("reconcile", "x", 5), ("reconcile", "x", 9), ("reconcile", "x", 30),
                     ("state", "x")]
            answers = [editions.sql(step) for step in steps]
            self.assertEqual(answers, [editions.python(step) for step in steps])
        inflight = {"status": "inflight", "reason": "not unknown: nothing to reconcile"}
        self.assertEqual(answers[2:], [inflight] * 3 + [["inflight", 1, 10]])
        for now, gone in ((5, False), (9, True)):
            self.assertEqual(reconcile(s, "x", now, gone, os.getpid(), HOST), inflight)
        self.assertEqual(owner(s, "x"), ["inflight", "1", str(os.getpid()), HOST, "4100"])

    def test_absence_is_proof_only_from_the_lease_end_on_and_only_with_the_claimer_gone(self):
        # The lease runs to tick 10: at tick 9 the claimer may still act, from tick 10 on it may
        # not, and then only if it is gone.
        s = self.session
        unknown_row(s, "x")
        self.assertEqual(owner(s, "x"), ["unknown", "1", "7", "host-a", "4100"])
        may_act = {"status": "unknown",
                   "reason": "no ticket yet, but the unanswered attempt may still act"}
        self.assertEqual(reconcile(s, "x", 9, True, 7, "host-a"), may_act, "inside the lease")
        self.assertEqual(reconcile(s, "x", 10, False, 7, "host-a"), may_act, "not gone")
        self.assertEqual(reconcile(s, "x", 10 ** 6, False, None, None), may_act, "not gone")
        self.assertEqual(reconcile(s, "x", 10, True, 7, "host-a"), {
            "status": "pending", "reason": "proven absent: retry under the same key"})

    def test_a_ticket_settles_the_row_only_when_it_is_the_one_ticket_of_this_payload(self):
        s = self.session
        unknown_row(s, "x")
        digest = value(s, "SELECT digest FROM article1.requests WHERE key = 'x'")
        mine = {"caller": CALLER, "key": "x", "digest": digest, "ticket_id": 3}
        other = dict(mine, digest=reliability.canonical({"t": 2})[1], ticket_id=4)
        for found in ([other], [mine, dict(mine, ticket_id=5)], [other, mine]):
            self.assertEqual(reconcile(s, "x", 10, True, 7, "host-a", found), {
                "status": "unknown", "reason": f"the tool holds {len(found)} ticket(s) that do"
                " not settle it"}, found)
        self.assertEqual(reconcile(s, "x", 0, False, None, None, [mine]),
                         {"status": "done", "response": mine})
        self.assertEqual(query(s, "SELECT state, response->>'ticket_id' FROM article1.outbox"),
                         [["done", "3"]])

    def test_a_persons_decision_racing_reconcile_stands_and_reconcile_answers_what_it_made(self):
        # Deterministic: the person's done holds the row, uncommitted; reconcile, with absence
        # proven, is seen waiting; then the decision commits.  reconcile then finds the row
        # done, and leaves it so: not pending under the person's audit row.
        s, person, reconciler = self.session, self.client(), self.client()
        unknown_row(s, "x")
        digest = value(s, "SELECT digest FROM article1.requests WHERE key = 'x'")
        seen = {"caller": CALLER, "key": "x", "digest": digest, "ticket_id": 3}
        query(person, "BEGIN; " + call("article1.resolve", CALLER, "x", "done", 1, "ops",
                                       "seen in the tool", seen))
        pid = value(reconciler, "SELECT pg_backend_pid()")
        harness.send(reconciler, call("article1.reconcile", CALLER, "x", [], 10, True, 7,
                                      "host-a", STARTED))
        self.assertTrue(harness.waits(s, pid, "article1.reconcile("), "reconcile waits")
        query(person, "COMMIT")
        answer = harness.reply(reconciler)
        self.assertEqual((answer.state, harness.parsed(answer.rows[0][0])),
                         ("00000", {"status": "done", "reason": "not unknown: nothing to"
                                                                " reconcile"}))
        self.assertEqual(query(s, "SELECT state, response->>'ticket_id' FROM article1.outbox"),
                         [["done", "3"]])


# === beyond 第一篇: a late result is evidence, recorded and shown, never applied ===============

class LateResultTest(harness.TestCase):
    """acknowledge() fenced off from a row records the late result; reconcile() shows it."""

    def test_a_late_acknowledgement_is_refused_recorded_once_shown_and_never_applied(self):
        # Two workers, each a session of its own: the first claims attempt 1, its lease ends,
        # the second claims attempt 2.  The first's acknowledgement arrives late: refused, the
        # row unchanged, the response recorded with the time it arrived; asked again, still
        # one record.  Another response for attempt 1 is another record; an attempt never
        # claimed and a response that answers another request record nothing.
        s, first, second = self.session, self.client(), self.client()
        value(s, call("article1.enqueue", CALLER, "k", {"t": 1}, 0))
        self.assertEqual(value(first, call("article1.claim", 0, 101, "host-1", 1000))["attempt"],
                         1)
        self.assertEqual(value(second, call("article1.claim", 10, 202, "host-2", 2000))[
            "attempt"], 2)
        row = query(s, "SELECT * FROM article1.outbox")
        answer = json.loads(response_of(s, "k"))
        late = call("article1.acknowledge", CALLER, "k", 1, answer)
        refused = {"status": "refused", "state": "inflight", "attempts": 2}
        before = value(s, "SELECT clock_timestamp()")
        self.assertEqual(value(first, late), refused)
        after = value(s, "SELECT clock_timestamp()")
        self.assertEqual(value(first, late), refused, "asked again")
        self.assertEqual(value(first, call("article1.acknowledge", CALLER, "k", 1,
                                           dict(answer, ticket_id=8))), refused)
        self.assertEqual(value(first, call("article1.acknowledge", CALLER, "k", 3, answer)),
                         refused, "attempt 3 was never claimed")
        self.assertEqual(harness.state_of(first, call("article1.acknowledge", CALLER, "k", 1,
                                                      dict(answer, digest="0" * 64))), "22023")
        self.assertEqual(query(s, "SELECT * FROM article1.outbox"), row, "the row changed")
        self.assertEqual(late_results(s), [["k", "1", answer], ["k", "1", dict(answer,
                                                                            ticket_id=8)]])
        self.assertEqual(query(s, "SELECT arrived_at BETWEEN"
                                  f" {literal(before)}::timestamptz AND"
                                  f" {literal(after)}::timestamptz FROM article1.late_results"
                                  " ORDER BY id LIMIT 1"), [["t"]], "the first arrival is kept")
        # The second worker's own attempt settles the row; its replay records nothing, and a
        # second response for the settled attempt 2 is late too.
        done = call("article1.acknowledge", CALLER, "k", 2, dict(answer, ticket_id=9))
        self.assertEqual([value(second, done) for _ in range(2)],
                         [{"status": "acknowledged"}] * 2)
        settled = {"status": "refused", "state": "done", "attempts": 2}
        self.assertEqual(value(first, late), settled)
        self.assertEqual(value(second, call("article1.acknowledge", CALLER, "k", 2,
                                            dict(answer, ticket_id=10))), settled)
        self.assertEqual(late_results(s)[2:], [["k", "2", dict(answer, ticket_id=10)]])
        shown = reconcile(s, "k", 20, False, None, None)
        self.assertEqual(shown, {"status": "done", "reason": "not unknown: nothing to reconcile",
                                 "late": shown.get("late")})
        self.assertEqual([[entry["attempt"], entry["response"], entry["arrived_at"]]
                          for entry in shown["late"]],
                         [[int(attempt), json.loads(response), json.loads(arrived)] for
                          attempt, response, arrived in query(
                              s, "SELECT attempt, response, to_jsonb(arrived_at) FROM"
                                 " article1.late_results ORDER BY id")])
        self.assertEqual(query(s, "SELECT state, attempts, response->>'ticket_id' FROM"
                                  " article1.outbox"), [["done", "2", "9"]])

    def test_a_late_result_keeps_reconcile_from_proving_absence_and_never_settles_a_row(self):
        # An external row's claimer sends attempt 1, its lease ends, a claim parks the row
        # unknown, and then attempt 1's response arrives: the tool acted.  A lookup that finds
        # no ticket is then no proof of absence: reliability.py, which records no late
        # results, sends the row back to pending (to be sent again); the SQL keeps it unknown
        # and shows the late result.  Only the tool's one ticket, found, settles it.
        s = self.session
        with python_workspace() as ws:
            editions = Editions(s, ws)
            steps = [("enqueue", "x", {"t": 1}, 0, "external"), ("claim", 0), ("claim", 10),
                     ("acknowledge", "x", 1, None), ("state", "x")]
            self.assertEqual([editions.sql(step) for step in steps],
                             [editions.python(step) for step in steps])
            self.assertEqual(editions.python(("reconcile", "x", 10)),
                             {"status": "pending",
                              "reason": "proven absent: retry under the same key"})
        row = query(s, "SELECT * FROM article1.outbox")
        response = faulty("x", value(s, "SELECT digest FROM article1.requests"), None)
        answer = reconcile(s, "x", 10, True, os.getpid(), HOST)
        self.assertEqual(answer, {"status": "unknown", "reason": "the tool holds no ticket, yet"
                                  " a late result shows an attempt reached it",
                                  "late": answer.get("late")})
        self.assertEqual([(entry["attempt"], entry["response"]) for entry in answer["late"]],
                         [(1, response)])
        self.assertEqual(query(s, "SELECT * FROM article1.outbox"), row, "the row changed")
        self.assertEqual(reconcile(s, "x", 10, True, os.getpid(), HOST, [response]),
                         {"status": "done", "response": response, "late": answer["late"]})

    def test_a_copy_of_a_late_acknowledgement_waiting_on_the_first_records_nothing_more(self):
        # Deterministic: the first copy holds the row and its record, uncommitted; the second
        # is seen waiting, then the first commits.  READ COMMITTED finds the record; the other
        # levels took their snapshot before it and raise 40001, and the retry finds it.
        s, holder = self.session, self.client()
        for n, level in enumerate(LEVELS):
            key = f"k{n}"
            copy = self.client(level)
            pid = value(copy, "SELECT pg_backend_pid()")
            value(s, call("article1.enqueue", CALLER, key, {"t": n}, 0))
            value(s, call("article1.claim", 0, 1, HOST, STARTED))
            value(s, call("article1.claim", 10, 1, HOST, STARTED))
            late = call("article1.acknowledge", CALLER, key, 1, response_of(s, key))
            refused = {"status": "refused", "state": "inflight", "attempts": 2}
            self.assertEqual(value(holder, "BEGIN; " + late), refused)
            harness.send(copy, late)
            self.assertTrue(harness.waits(s, pid, "article1.acknowledge("), level)
            query(holder, "COMMIT")
            answer = harness.reply(copy)
            if level == "read committed":
                self.assertEqual((answer.state, harness.parsed(answer.rows[0][0])),
                                 ("00000", refused))
            else:
                self.assertEqual(answer.state, "40001", level)
                self.assertEqual(value(copy, late), refused, level)
            self.assertEqual(len([row for row in late_results(s) if row[0] == key]), 1, level)

    def test_copies_of_one_late_acknowledgement_racing_at_every_level_record_it_once(self):
        racers = self.racers(MIXED)
        for s, (setting, levels) in enumerate(SETTINGS.items()):
            isolate(racers, levels)
            for r in range(ROUNDS):
                key, t = f"race-{s}-{r}", 100 * (2 * s + r)
                value(self.session, call("article1.enqueue", CALLER, key, {"t": key}, t))
                claims = [value(self.session, call("article1.claim", now, 1, HOST, STARTED))
                          for now in (t, t + 10)]
                self.assertEqual([(c["key"], c["attempt"]) for c in claims],
                                 [(key, 1), (key, 2)])
                response = response_of(self.session, key)
                late = call("article1.acknowledge", CALLER, key, 1, response)
                answers, _ = race(self.session, racers, [late] * CLIENTS)
                self.assertEqual(answers, [{"status": "refused", "state": "inflight",
                                            "attempts": 2}] * CLIENTS, setting)
                # Attempt 2 settles the row, so that the next round's claims pass it by.
                self.assertEqual(value(self.session, call("article1.acknowledge", CALLER, key,
                                                          2, response))["status"],
                                 "acknowledged")
        self.assertEqual(query(self.session, "SELECT key, count(*) FROM article1.late_results"
                                             " GROUP BY key HAVING count(*) <> 1"), [])
        self.assertEqual(value(self.session, "SELECT count(*) FROM article1.late_results"),
                         str(len(SETTINGS) * ROUNDS))


# === beyond 第一篇: reconcile, resolve and purge, step by step with reliability.py ==============

class StepByStepTest(harness.TestCase):
    """Every answer of article1.sql, step by step, against reliability.py's on its own files."""

    def test_the_sql_answers_as_reliability_py_does_step_by_step(self):
        one, other = {"title": "one"}, {"title": "other"}
        deep = 1
        for _ in range(31):  # 32 levels, the leaf included: the deepest accepted
            deep = {"a": deep}
        steps = [
            ("receive", "k1", one, 1, 1), ("receive", "k1", one, 1, 2),
            ("receive", "k1", other, 1, 2), ("receive", "k2", one, 3, 3),
            ("receive", "", one, 1, 1), ("receive", "k9", [1], 1, 1), ("receive", "k9", one, 5, 4),
            ("receive", "k" * 201, one, 1, 1), ("receive", "k9", one, 1.5, 2),
            ("receive", "k10", '{"n": 1.00, "m": 1e3}', 3, 3),
            ("receive", "k10", '{"m":1000.0,"n":1.0}', 3, 3), ("receive", "k10", '{"n": 1}', 3, 3),
            ("receive", "k11", '{"n": 1, "n": 2}', 3, 3), ("receive", "k11", '{"n": NaN}', 3, 3),
            ("purge", 10, 7), ("purge", 9, 7), ("purge", 5, 7), ("purge", 10, 0),
            ("receive", "k1", one, 1, 11), ("receive", "k2", one, 3, 11),
            ("receive", "k3", one, 2, 11), ("receive", "k4", one, 3, 11),
            ("receive", "k4", one, 3, 12), ("purge", 20, 10), ("receive", "k4", one, 3, 21),
            ("receive", "k5", other, 10, 21), ("receive", "k6", deep, 10, 21),
            ("receive", "k7", {"a": deep}, 10, 21), ("tamper ticket", "k5"),
            ("receive", "k5", other, 10, 22), ("receive", "k5", one, 10, 22),
            ("receive", "k4", one, 3, 22), ("tamper digest", "k4"), ("receive", "k4", one, 3, 22),
            ("receive", "k4", other, 3, 22),
            # The receipt written at the mark stays; the one a tick before goes.
            ("receive", "k8", one, 29, 29), ("receive", "k12", one, 30, 30), ("purge", 40, 10),
            ("receive", "k8", one, 29, 41), ("receive", "k12", one, 30, 41),
            ("enqueue", "e1", one, 1, "idempotent"), ("enqueue", "e1", one, 1, "idempotent"),
            ("enqueue", "e1", other, 1, "idempotent"), ("enqueue", "e1", one, 1, "external"),
            ("enqueue", "e2", one, 2, "external"), ("enqueue", "e3", one, 50, "idempotent"),
            ("enqueue", "e4", other, 3, "idempotent"), ("enqueue", "e5", one, 3, "nonsense"),
            ("claim", 0), ("claim", 1), ("claim", 2), ("claim", 3), ("claim", 3),
            ("acknowledge", "e1", 1, "other key"), ("acknowledge", "e1", 1, "other digest"),
            ("acknowledge", "e1", 1, "ticket 0"), ("acknowledge", "e1", 1, "ticket text"),
            ("acknowledge", "e1", 1, "ticket float"), ("acknowledge", "e1", 1, "extra field"),
            ("acknowledge", "e1", 2, None), ("acknowledge", "e1", 1, None),
            ("acknowledge", "e1", 1, None), ("acknowledge", "e1", 1, "other ticket"),
            ("acknowledge", "nothing", 1, None),
            ("claim", 12), ("claim", 13), ("state", "e2"),
            ("tamper", "e4"), ("claim", 22), ("claim", 23), ("state", "e4"),
            # A retry of the corrupt row is blocked again at the same attempt: the same call
            # again is no replay of a decision the row has left, and no second decision.
            ("resolve", "e4", "retry", 2, "ops", "fixed?", None), ("claim", 24), ("state", "e4"),
            ("resolve", "e4", "retry", 2, "ops", "fixed?", None),
            ("resolve", "e4", "abandon", 2, "ops", "corrupt", None), ("state", "e4"),
        ] + [("claim", 50 + 10 * n) for n in range(11)] + [  # attempts 1..10 of e3, then blocked
            ("claim", 200), ("acknowledge", "e3", 10, None), ("state", "e3"),
            # A person decides on blocked and unknown rows, at the attempt they looked at; the
            # audit row is never rewritten, and a decision asked again is made once.
            ("resolve", "e1", "retry", 1, "ops", "why", None),
            ("resolve", "e3", "retry", 10, "   ", "why", None),
            ("resolve", "e3", "retry", 10, "ops", "\u3000\t", None),
            ("resolve", "e3", "done", 10, "ops", "why", None),
            ("resolve", "e3", "maybe", 10, "ops", "w", None),
            ("resolve", "e3", "retry", 10, "ops", "r" * 1001, None),
            ("resolve", "e3", "retry", 11, "ops", "stuck", None),
            ("resolve", "e3", "retry", -1, "ops", "stuck", None),
            ("resolve", "e3", "retry", 9, "ops", "stuck", None),
            ("resolve", "e3", "retry", 10, "ops", "stuck", None),
            ("resolve", "e3", "retry", 10, "ops", "stuck", None),
            ("resolve", "e3", "abandon", 10, "ops", "stuck", None),
            ("claim", 210), ("state", "e3"), ("resolve", "e3", "retry", 10, "ops", "stuck", None),
            ("acknowledge", "e3", 11, None),
            ("reconcile", "e3", 220), ("reconcile", "e2", 5), ("reconcile", "e2", 30),
            ("claim", 300), ("external", "e2", None), ("claim", 320), ("state", "e2"),
            ("reconcile", "e2", 320), ("state", "e2"),
            ("enqueue", "x1", one, 400, "external"), ("enqueue", "x2", other, 400, "external"),
            # An acknowledgement of an unknown row's attempt: refused in both, and a late result
            # in the SQL, which keeps reconcile from proving absence.  So it is sent for x1,
            # which the tool's own tickets keep unknown in both, not for a row reconcile then
            # sends back to pending in reliability.py (LateResultTest pins that difference).
            ("claim", 400), ("claim", 400), ("claim", 410), ("acknowledge", "x1", 1, None),
            ("state", "x1"), ("external", "x1", None),
            ("external", "x1", None), ("external", "x2", one), ("reconcile", "x1", 410),
            ("reconcile", "x2", 410),
            ("resolve", "x1", "done", 1, "ops", "checked", "other digest"),
            ("resolve", "x1", "done", 1, "ops", "checked", None),
            ("resolve", "x1", "done", 1, "ops", "checked", None),
            ("resolve", "x1", "abandon", 1, "ops", "late", None),
            ("resolve", "x2", "abandon", 1, "ops", "duplicate", None),
            ("resolve", "x2", "done", 1, "ops", "no", "first"),
            ("resolve", "k1", "retry", 0, "o", "w", None),
            # The retry of an unknown external row, asked again after its reply was lost, once
            # a claim has taken the row and it went unknown again: refused, no second call.
            ("enqueue", "x3", one, 500, "external"), ("claim", 500), ("claim", 510),
            ("state", "x3"), ("resolve", "x3", "retry", 1, "ops", "tool down", None),
            ("claim", 510), ("claim", 520), ("claim", 520), ("state", "x3"),
            ("resolve", "x3", "retry", 1, "ops", "tool down", None), ("state", "x3"),
            ("claim", 530), ("state", "x3"),
            ("resolve", "x3", "abandon", 2, "ops", "seen twice", None), ("state", "x3"),
        ]
        with python_workspace() as ws:
            editions = Editions(self.session, ws)
            for step in steps:
                self.assertEqual(editions.sql(step), editions.python(step), step)
            python_rows = ws.sender.execute("SELECT key, state, attempts, lease_until, response"
                                            " FROM outbox ORDER BY id").fetchall()
            sql_rows = query(self.session, "SELECT key, state, attempts, lease_until, response"
                                           " FROM article1.outbox ORDER BY id")
            self.assertEqual([(k, s, a, lease, json.loads(r) if r else None)
                              for k, s, a, lease, r in python_rows],
                             [(k, s, int(a), int(lease) if lease else None,
                               json.loads(r) if r else None) for k, s, a, lease, r in sql_rows])
            self.assertEqual(
                [(k, a, d, b, w, json.loads(e) if e else None) for k, a, d, b, w, e in
                 ws.sender.execute("SELECT key, attempt, decision, decided_by, reason, evidence"
                                   " FROM resolutions ORDER BY id")],
                [(k, int(a), d, b, w, json.loads(e) if e else None) for k, a, d, b, w, e in
                 query(self.session, "SELECT key, attempt, decision, decided_by, reason,"
                                     " evidence FROM article1.resolutions ORDER BY id")])
            self.assertEqual([(k, int(a), json.loads(r)) for k, a, r in query(
                self.session, "SELECT key, attempt, response FROM article1.late_results"
                              " ORDER BY id")], editions.late)
            self.assertGreater(len(editions.late), 2)
            tickets = ws.receiver.execute("SELECT (SELECT count(*) FROM tickets),"
                                          " (SELECT count(*) FROM receipts)").fetchone()
            self.assertEqual(query(self.session, "SELECT (SELECT count(*) FROM article1.tickets),"
                                                 " (SELECT count(*) FROM article1.receipts)"),
                             [[str(n) for n in tickets]])

    def test_a_decision_is_never_rewritten_and_replayed_after_a_lost_reply_answers_the_same(self):
        s = self.session
        value(s, call("article1.enqueue", CALLER, "e", {"t": 1}, 0, "external"))
        value(s, call("article1.claim", 0, 1, HOST, STARTED))
        value(s, call("article1.claim", 10, 1, HOST, STARTED))
        decide = call("article1.resolve", CALLER, "e", "retry", 1, "ops", "the tool was down")
        self.assertEqual(value(s, decide), {"status": "pending", "resolution": 1})
        self.assertEqual(value(s, decide), {"status": "pending", "resolution": 1}, "a replay")
        self.assertEqual(value(s, call("article1.resolve", CALLER, "e", "abandon", 1, "ops",
                                       "no")),
                         {"status": "refused", "state": "pending", "attempts": 1,
                          "reason": "only an unknown or blocked row is resolved by hand"})
        for statement in ("UPDATE article1.resolutions SET reason = 'other'",
                          "DELETE FROM article1.resolutions", "TRUNCATE article1.resolutions"):
            self.assertEqual(harness.state_of(s, statement), "P0001", statement)
        self.assertEqual(query(s, "SELECT attempt, decision, reason FROM article1.resolutions"),
                         [["1", "retry", "the tool was down"]])

    def test_the_same_call_once_the_row_left_that_decisions_state_is_refused_not_answered(self):
        # A retry of a corrupt row: claim() blocks it again at the same attempt.  The same call
        # then answers neither "pending" (the row is blocked) nor makes a second decision.
        s = self.session
        value(s, call("article1.enqueue", CALLER, "k", {"t": 1}, 0))
        query(s, "UPDATE article1.requests SET payload = '{\"tampered\":1}'")
        retry = call("article1.resolve", CALLER, "k", "retry", 0, "ops", "fixed, I think")
        self.assertEqual(value(s, call("article1.claim", 0, 1, HOST, STARTED))["status"],
                         "nothing due")
        self.assertEqual(value(s, retry), {"status": "pending", "resolution": 1})
        self.assertEqual(value(s, call("article1.claim", 0, 1, HOST, STARTED))["status"],
                         "nothing due")
        self.assertEqual(value(s, retry), {"status": "refused", "state": "blocked", "attempts": 0,
                                           "reason": REFUSED[2]})
        self.assertEqual(query(s, "SELECT count(*) FROM article1.resolutions"), [["1"]])

    def test_a_retry_asked_again_after_a_claim_took_the_row_is_refused_in_both_editions(self):
        # The person decides retry on attempt 1 of an unknown external row; the reply is lost;
        # a claim sends attempt 2, and the row is unknown again.  Asked again, the decision on
        # attempt 1 is refused: no second audit row, no call of the tool nobody decided on.
        s = self.session
        with python_workspace() as ws:
            editions = Editions(s, ws)
            steps = [("enqueue", "x", {"t": 1}, 0, "external"), ("claim", 0), ("claim", 10),
                     ("resolve", "x", "retry", 1, "ops", "tool down", None), ("claim", 10),
                     ("claim", 20), ("resolve", "x", "retry", 1, "ops", "tool down", None),
                     ("state", "x"), ("claim", 30)]
            answers = [editions.sql(step) for step in steps]
            self.assertEqual(answers, [editions.python(step) for step in steps])
            self.assertEqual(answers[3], {"status": "pending", "resolution": 1})
            self.assertEqual(answers[6], {"status": "refused", "state": "unknown", "attempts": 2,
                                          "reason": REFUSED[1]})
            self.assertEqual(answers[7:], [["unknown", 2, 20], {"status": "nothing due",
                                                                "now": 30}])
            self.assertEqual(len(ws.sender.execute("SELECT * FROM resolutions").fetchall()), 1)
        self.assertEqual(query(s, "SELECT count(*) FROM article1.resolutions"), [["1"]])


# === the canonical form and its digest, as reliability.canonical computes them ==================

class CanonicalTest(harness.TestCase):
    """The SQL's canonical text and SHA-256 equal reliability.canonical's, or both refuse."""

    def test_the_canonical_text_and_digest_equal_reliability_canonical_for_many_payloads(self):
        texts = payload_texts(random.Random(7))
        rows = canonical_in_sql(self.session, texts)
        accepted = 0
        for text, row in zip(texts, rows):
            expected = python_canonical(text)
            self.assertEqual(row, expected, text[:200])
            accepted += expected is not None
        self.assertEqual(len(rows), len(texts))
        self.assertGreater(accepted, len(texts) // 2)
        self.assertGreater(len(texts) - accepted, 30)

    def test_floats_half_way_between_two_doubles_are_written_as_python_repr_writes_them(self):
        # 1e23 lies half-way between two doubles and reads back as the even one, so repr()
        # writes that double as 1e+23: the shortest text that reads back, not
        # 9.999999999999999e+22.  The sweep, d * 10^j for d below 1000 and j from 18 to 27,
        # holds hundreds more; the neighbours of the named ones are read and written too.
        named = {"1e23": "1e+23", "5e22": "5e+22", "2e23": "2e+23", "7e22": "7e+22",
                 "8e23": "8e+23", "-1e23": "-1e+23", "1E+23": "1e+23", "0.1e24": "1e+23",
                 "100000000000000000000000.0": "1e+23", "9.999999999999999e22": "1e+23",
                 "5.3332e21": "5.3332e+21", "6.4e24": "6.4e+24", "-2.5e22": "-2.5e+22",
                 "1e22": "1e+22", "1e16": "1e+16", "1e-5": "1e-05", "0.0001": "0.0001",
                 "1.5": "1.5", "-0.0": "-0.0", "5e-324": "5e-324",
                 "1.7976931348623157e308": "1.7976931348623157e+308"}
        tokens = list(named) + [f"{d}e{j}" for d in range(1, 1000) for j in range(18, 28)]
        tokens += [repr(math.nextafter(float(t), way)) for t in tokens[:len(named)]
                   for way in (-math.inf, math.inf)]
        texts = ['{"f":%s}' % token for token in tokens]
        rows = canonical_in_sql(self.session, texts)
        self.assertEqual(len(rows), len(texts))
        for text, row in zip(texts, rows):
            self.assertEqual(row, python_canonical(text), text)
        for (token, python_writes), row in zip(named.items(), rows):
            self.assertEqual(row[0], '{"f":%s}' % python_writes, token)

    def test_thousands_of_seeded_payloads_with_floats_near_half_way_equal_reliability_canonical(
            self):
        rng = random.Random(23)
        texts = [written({random_text(rng): seeded_value(rng, 4)
                          for _ in range(rng.randint(1, 4))}, rng) for _ in range(3000)]
        rows = canonical_in_sql(self.session, texts)
        self.assertEqual(len(rows), len(texts))
        for text, row in zip(texts, rows):
            expected = python_canonical(text)
            self.assertIsNotNone(expected, text[:200])
            self.assertEqual(row, expected, text[:200])
        half_way = [repr(float(text)) for text in HALF_WAY]
        self.assertGreater(sum(any(h in row[0] for h in half_way) for row in rows), 500)

    def test_a_payload_that_cannot_fit_is_refused_before_any_value_in_it_is_written(self):
        # Each , : [ ] { } is a byte of any canonical form: more than 65536 of them cannot fit,
        # and the walk, a step per token (a million for these 2 MB), never starts.  PostgreSQL
        # counts the calls of the functions that write each value (track_functions): none.  A
        # longer text that is mostly blanks still fits, as in Python.
        s = self.session
        cannot = ['{"k":[' + "1," * 1000000 + "1]}", '{"k":"' + "," * 70000 + '"}',
                  '{"k":[' + "[]," * 30000 + "{}]}"]
        fits = ['{"k":[' + "1 ,  " * 30000 + "1]}", '{"k" : "' + "," * 65000 + '"' + " " * 999
                + "}"]
        query(s, "BEGIN; SET LOCAL track_functions = 'pl'")
        rows = canonical_in_sql(s, cannot)
        self.assertEqual(query(s, "SELECT funcname, calls FROM pg_stat_xact_user_functions"
                                  " WHERE schemaname = 'article1' AND funcname IN"
                                  " ('canonical_number', 'canonical_string') ORDER BY 1"), [])
        query(s, "COMMIT")
        self.assertEqual(rows, [None] * len(cannot))
        self.assertEqual([python_canonical(text) for text in cannot], [None] * len(cannot))
        rows = canonical_in_sql(s, fits)
        self.assertEqual(rows, [python_canonical(text) for text in fits])
        self.assertNotIn(None, rows)
        self.assertGreater(min(len(text.encode()) for text in fits), 65536)
        for text in cannot:
            self.assertEqual(harness.state_of(s, receive("big", text, 0, 0)), "22023")
        self.assertEqual(query(s, "SELECT count(*) FROM article1.tickets"), [["0"]])

    def test_bad_input_raises_22023_and_stores_nothing(self):
        s = self.session
        one = {"title": "one"}
        value(s, call("article1.enqueue", CALLER, "e", one, 0))
        good = response_of(s, "e")
        bad = [
            call("article1.receive", CALLER, "k", "not json", 0, 0),
            call("article1.receive", CALLER, "k", '{"a": "\\u0000', 0, 0),
            call("article1.receive", CALLER, "k", '[1]', 0, 0),
            call("article1.receive", CALLER, "k", '{"a": "\\ud800"}', 0, 0),
            call("article1.receive", CALLER, "k", '{"a": 1e400}', 0, 0),
            call("article1.receive", CALLER, "k", '{"a": 1, "a": 1}', 0, 0),
            call("article1.receive", CALLER, "k", {"x": "y" * 65529}, 0, 0),
            call("article1.receive", CALLER, "k", "[" * 100000 + "]" * 100000, 0, 0),
            call("article1.receive", CALLER, "k", None, 0, 0),
            call("article1.receive", None, "k", one, 0, 0),
            "SELECT article1.receive('agent', 'k', '{}', 1.5, 2)",
            "SELECT article1.receive('agent', 'k', '{}', 0, 99999999999999999999999)",
            "SELECT article1.receive('agent', 'k', '{}', -1, 0)",
            "SELECT article1.receive('agent', 'k', '{}', 3, 2)",
            "SELECT article1.receive('agent', 'k', '{}', NULL, 2)",
            call("article1.enqueue", CALLER, "k", one, 0, "other"),
            call("article1.enqueue", CALLER, "k", one, 0, None),
            call("article1.claim", -1, 1, HOST, STARTED), "SELECT article1.claim(2.5, 1, 'h', 1)",
            call("article1.claim", 1, 0, HOST, STARTED), "SELECT article1.claim(1, 1.5, 'h', 1)",
            call("article1.claim", 1, 1, None, STARTED), call("article1.claim", 1, 1, "", STARTED),
            call("article1.claim", 1, 1, "h" * 256, STARTED),
            call("article1.purge", 5, 6), call("article1.purge", 5, 0),
            "SELECT article1.purge(5, 1.5)",
            call("article1.acknowledge", CALLER, "nothing", 1, good),
            call("article1.acknowledge", CALLER, "e", 1, "{"),
            call("article1.acknowledge", CALLER, "e", 1, dict(json.loads(good), ticket_id=1.0)),
            call("article1.acknowledge", CALLER, "e", 1, dict(json.loads(good), ticket_id=1e3)),
            "SELECT article1.acknowledge('agent', 'e', 1.5, '{}')",
            call("article1.claim", 1, 1, HOST, None), call("article1.claim", 1, 1, HOST, -1),
            call("article1.claim", 1, 1, HOST, 2 ** 62 + 1),
            "SELECT article1.claim(1, 1, 'h', 1.5)",
            call("article1.reconcile", CALLER, "e", "[]", 0, None, 1, HOST, STARTED),
            call("article1.reconcile", CALLER, "e", "{}", 0, True, 1, HOST, STARTED),
            call("article1.reconcile", CALLER, "e", '[{"caller": "agent"}]', 0, True, 1, HOST,
                 STARTED),
            call("article1.reconcile", CALLER, "e", '[{"\\u0000": 1}]', 0, True, 1, HOST,
                 STARTED),
            call("article1.reconcile", CALLER, "e", "[]", 0, True, None, HOST, STARTED),
            call("article1.reconcile", CALLER, "e", "[]", 0, True, 1, "", STARTED),
            call("article1.reconcile", CALLER, "e", "[]", 0, True, 1, HOST, -1),
            "SELECT article1.reconcile('agent', 'e', '[]', 0, true, 1, 'h', 0.5)",
            call("article1.resolve", CALLER, "e", "retry", 0, "", "why"),
            call("article1.resolve", CALLER, "e", "done", 0, "ops", "why"),
            call("article1.resolve", CALLER, "e", "retry", 0, "ops", "why", good),
            call("article1.resolve", CALLER, "e", "abandon", 1, "ops", "never claimed"),
            call("article1.resolve", CALLER, "e", "abandon", -1, "ops", "why"),
            call("article1.resolve", CALLER, "e", "abandon", None, "ops", "why"),
            "SELECT article1.resolve('agent', 'e', 'abandon', 0.5, 'ops', 'why')",
        ]
        for statement in bad:
            self.assertEqual(harness.state_of(s, statement), "22023", statement[:200])
        self.assertEqual(query(s, "SELECT (SELECT count(*) FROM article1.tickets),"
                                  " (SELECT count(*) FROM article1.requests),"
                                  " (SELECT count(*) FROM article1.resolutions),"
                                  " (SELECT state FROM article1.outbox)"),
                         [["0", "1", "0", "pending"]])


# === loading: twice, beside article 7, whatever the caller's search_path =======================

class LoadTest(harness.TestCase):
    """psql -f loads article1.sql twice, beside article7.sql, and upgrades editions 1 and 2; no
    caller's path changes a read; another role's schema, objects, CREATE or TRIGGER privilege,
    or code run by a trigger on our tables, refuses each file's load."""

    def test_loading_twice_keeps_every_row_and_both_articles_share_one_database(self):
        query(self.session, receive("k", {"t": 1}, 0, 0))
        for path in harness.ARTICLES.values():
            self.assertEqual(harness.load(path, self.database), (0, ""), path)
        self.assertEqual(query(self.session, "SELECT (SELECT count(*) FROM article1.tickets),"
                                             " (SELECT low_water FROM article1.retention),"
                                             " (SELECT count(*) FROM article7.retention)"),
                         [["1", "0", "1"]])
        self.assertEqual(value(self.session, receive("k", {"t": 1}, 0, 1))["status"], "ticket")
        query(self.session, "UPDATE article1.edition SET version = 4")
        code, errors = harness.load(harness.ARTICLES["article1"], self.database)
        self.assertEqual(code, 3)
        self.assertIn("article1 holds edition 4, this file is edition 3", errors)

    def test_a_schema_of_edition_1_is_upgraded_in_place_and_keeps_every_row(self):
        # Edition 1 had no owner_host, and claim() and reconcile() without the machine.  A row
        # claimed under it recorded no machine and no start: its evidence names neither.
        s = self.session
        kept = self.older_edition(1)
        self.assertEqual(harness.load(harness.ARTICLES["article1"], self.database), (0, ""))
        self.assertEqual((self.rows(), *self.edition()), (kept, *EDITION_3))
        self.assertEqual(owner(s, "k"), ["unknown", "1", "7", "", ""])
        self.assertEqual(reconcile(s, "k", 10, True, 7, HOST), {
            "status": "unknown", "reason": "gone is about another claimer: this attempt's is"
            " pid 7 on a machine edition 1 did not record, started at a time editions 1 and 2"
            " did not record"})
        self.assertEqual(reconcile(s, "k", 10, True, 7, None, started=None),
                         {"status": "pending", "reason": "proven absent: retry under the same"
                                                         " key"})

    def test_a_schema_of_edition_2_is_upgraded_in_place_keeps_every_row_and_records_late(self):
        # Edition 2 had no owner_started and no late_results, and claim() and reconcile()
        # without the start time.  Loaded over it, edition 3 keeps every row; a row claimed
        # under it recorded no start, and its evidence names none; late results are recorded.
        s = self.session
        kept = self.older_edition(2)
        self.assertEqual(harness.load(harness.ARTICLES["article1"], self.database), (0, ""))
        self.assertEqual((self.rows(), *self.edition()), (kept, *EDITION_3))
        self.assertEqual(owner(s, "k"), ["unknown", "1", "7", HOST, ""])
        self.assertEqual(reconcile(s, "k", 10, True, 7, HOST)["status"], "unknown")
        self.assertEqual(reconcile(s, "k", 10, True, 7, HOST, started=None)["status"],
                         "pending")
        late = call("article1.acknowledge", CALLER, "k", 1, response_of(s, "k"))
        self.assertEqual(value(s, late), {"status": "refused", "state": "pending",
                                          "attempts": 1})
        self.assertEqual([(entry["attempt"], entry["response"]) for entry in
                          reconcile(s, "k", 10, False, None, None)["late"]],
                         [(1, json.loads(response_of(s, "k")))])

    def older_edition(self, edition):
        """Rows in every table, then the schema taken back to ``edition`` as its file made it
        (functions of the old arguments stand for the old ones); returns rows().  k is
        external, claimed by pid 7 at 0 and unknown since 10; j in flight; b corrupt, blocked
        and abandoned by a person; one receipt."""
        s = self.session
        for key, mode in (("k", "external"), ("j", "idempotent"), ("b", "idempotent")):
            value(s, call("article1.enqueue", CALLER, key, {"t": key}, 0, mode))
        query(s, "UPDATE article1.requests SET payload = '{}' WHERE key = 'b'")
        value(s, call("article1.claim", 0, 7, HOST, STARTED))
        value(s, call("article1.claim", 10, 1, HOST, STARTED))
        value(s, call("article1.claim", 10, 1, HOST, STARTED))
        value(s, call("article1.resolve", CALLER, "b", "abandon", 0, "ops", "corrupt"))
        value(s, receive("k", {"t": "k"}, 0, 0))
        kept = self.rows()
        self.assertEqual([row[4] for row in kept[-1]], ["unknown", "inflight", "abandoned"])
        old = {1: ["claim(numeric, numeric)", "reconcile(text, text, text, numeric, boolean)",
                   "check_owner(numeric, text)"],
               2: ["claim(numeric, numeric, text)", "reconcile(text, text, text, numeric,"
                   " boolean, numeric, text)", "check_owner(numeric, text)"]}[edition]
        query(s, "; ".join(
            ["ALTER TABLE article1.outbox DROP COLUMN owner_started",
             "DROP TABLE article1.late_results",
             "DROP FUNCTION article1.claim(numeric, numeric, text, numeric)",
             "DROP FUNCTION article1.reconcile(text, text, text, numeric, boolean, numeric,"
             " text, numeric)",
             "DROP FUNCTION article1.check_owner(numeric, text, numeric)",
             f"UPDATE article1.edition SET version = {edition}"]
            + [f"CREATE FUNCTION article1.{function} RETURNS jsonb LANGUAGE sql AS"
               " $$ SELECT '{}'::jsonb $$" for function in old]
            + ["ALTER TABLE article1.outbox DROP COLUMN owner_host"] * (edition == 1)))
        return kept

    def rows(self):
        """Every table's rows, the outbox's without the columns editions 2 and 3 added."""
        s = self.session
        return [query(s, f"SELECT * FROM article1.{table} ORDER BY 1, 2") for table in
                ("requests", "resolutions", "tickets", "receipts", "retention")] + [
                query(s, "SELECT id, caller, key, mode, state, attempts, lease_until, response,"
                         " owner_pid FROM article1.outbox ORDER BY id")]

    def edition(self):
        """The edition, the late results' count, and the signatures of claim, reconcile and
        check_owner."""
        s = self.session
        return (value(s, "SELECT version FROM article1.edition"),
                value(s, "SELECT count(*) FROM article1.late_results"),
                query(s, "SELECT oid::regprocedure FROM pg_proc WHERE pronamespace ="
                         " 'article1'::regnamespace AND proname IN ('claim', 'reconcile',"
                         " 'check_owner') ORDER BY oid::regprocedure::text"))

    def test_a_schema_another_role_made_first_refuses_the_load_and_nothing_of_ours_is_made(self):
        # A role with CREATE on the database makes the schema first, with a helper of its own:
        # loaded into it, every function would be that role's to replace, and the loading
        # role's next call would run its code.  Each file refuses, naming the owner.
        s = self.session
        role = intruder(s, self.database)
        for name, path in harness.ARTICLES.items():
            with self.subTest(name):
                query(s, f"DROP SCHEMA {name} CASCADE; SET ROLE {role}; CREATE SCHEMA {name};"
                         f" CREATE FUNCTION {name}.check_identity(text, text) RETURNS void"
                         " LANGUAGE sql AS 'SELECT NULL'; RESET ROLE")
                code, errors = harness.load(path, self.database)
                self.assertEqual(code, 3)
                self.assertIn(f"schema {name} belongs to {role}, not to {harness.SUPERUSER}, who"
                              " loads this file", errors)
                self.assertEqual(objects(s, name), [["function", f"{role}"]])

    def test_a_schema_holding_another_roles_object_or_letting_it_create_refuses_the_load(self):
        s = self.session
        role = intruder(s, self.database)
        for name, path in harness.ARTICLES.items():
            with self.subTest(name):
                query(s, f"ALTER FUNCTION {name}.check_ticks(numeric, numeric) OWNER TO {role}")
                code, errors = harness.load(path, self.database)
                self.assertEqual(code, 3)
                self.assertIn(f"schema {name} holds what another role owns: function"
                              f" {name}.check_ticks(numeric,numeric) of {role}", errors)
                query(s, f"ALTER FUNCTION {name}.check_ticks(numeric, numeric) OWNER TO"
                         f" {harness.SUPERUSER}")
                for grantee in (role, "PUBLIC"):
                    query(s, f"GRANT CREATE ON SCHEMA {name} TO {grantee}")
                    code, errors = harness.load(path, self.database)
                    self.assertEqual(code, 3)
                    self.assertIn(f"schema {name} lets {grantee} create in it", errors)
                    query(s, f"REVOKE CREATE ON SCHEMA {name} FROM {grantee}")
                self.assertEqual(harness.load(path, self.database), (0, ""))

    def test_a_trigger_privilege_of_another_role_or_public_refuses_the_load_naming_both(self):
        # GRANT ALL ON ALL TABLES includes TRIGGER: a role holding it can make a trigger that
        # runs its code with the rights of whoever writes the table.  Each file refuses, naming
        # the roles and the tables, and changes nothing; revoked, it loads.
        s = self.session
        role = intruder(s, self.database)
        for name, path in harness.ARTICLES.items():
            with self.subTest(name):
                tables = ", ".join(f"{name}.{table}" for table in sorted(TABLES[name]))
                query(s, f"GRANT ALL ON ALL TABLES IN SCHEMA {name} TO {role};"
                         f" GRANT TRIGGER ON {name}.retention TO PUBLIC")
                before = fingerprint(s, name)
                code, errors = harness.load(path, self.database)
                self.assertEqual(code, 3)
                self.assertIn(f"{name}'s tables let other roles create triggers on them: PUBLIC"
                              f" on {name}.retention; {role} on {tables}", errors)
                self.assertEqual(fingerprint(s, name), before, "the refused load changed it")
                query(s, f"REVOKE TRIGGER ON ALL TABLES IN SCHEMA {name} FROM {role}")
                code, errors = harness.load(path, self.database)
                self.assertEqual(code, 3)
                self.assertIn(f"create triggers on them: PUBLIC on {name}.retention\n", errors)
                query(s, f"REVOKE TRIGGER ON {name}.retention FROM PUBLIC")
                self.assertEqual(harness.load(path, self.database), (0, ""))

    def test_default_privileges_giving_a_trigger_privilege_refuse_the_first_load_whole(self):
        # ALTER DEFAULT PRIVILEGES ... GRANT ALL ON TABLES gives each table the load makes the
        # TRIGGER privilege too.  The first load refuses once its tables exist, and its one
        # transaction leaves nothing: no schema, so no table for anyone's trigger.
        s = self.session
        role = intruder(s, self.database)
        query(s, f"ALTER DEFAULT PRIVILEGES FOR ROLE {harness.SUPERUSER} GRANT ALL ON TABLES TO"
                 f" {role}")
        for name, path in harness.ARTICLES.items():
            with self.subTest(name):
                query(s, f"DROP SCHEMA {name} CASCADE")
                code, errors = harness.load(path, self.database)
                self.assertEqual(code, 3)
                tables = ", ".join(f"{name}.{table}" for table in sorted(TABLES[name]))
                self.assertIn(f"{name}'s tables let other roles create triggers on them: {role}"
                              f" on {tables}\n", errors)
                self.assertEqual(query(s, "SELECT count(*) FROM pg_namespace WHERE nspname ="
                                          f" {literal(name)}"), [["0"]])
        query(s, f"ALTER DEFAULT PRIVILEGES FOR ROLE {harness.SUPERUSER} REVOKE TRIGGER ON"
                 f" TABLES FROM {role}")
        for path in harness.ARTICLES.values():
            self.assertEqual(harness.load(path, self.database), (0, ""), path)

    def test_another_roles_trigger_refuses_the_load_before_it_writes_a_row_and_runs_nothing(self):
        # The owner grants ALL on its tables; the other role makes BEFORE INSERT triggers that
        # log who runs them, on the edition table (whose row each load inserts, ON CONFLICT DO
        # NOTHING) and on the table a call writes first.  The load refuses before it writes
        # a row, naming the trigger, the table, the function and its owner: the log stays
        # empty.  Revoking the privilege is not enough: the trigger stays, and so does the
        # refusal, until the trigger goes.
        s = self.session
        role = intruder(s, self.database)
        logged_by(s, role)
        calls = {"article1": call("article1.enqueue", CALLER, "k", {"t": 1}, 0),
                 "article7": call("article7.execute", "op", {"src": "A", "dst": "B", "amount": 1,
                                                             "expected": {"A": 1, "B": 1}}, 0, 0)}
        for (name, path), written in zip(harness.ARTICLES.items(), ("outbox", "receipt")):
            with self.subTest(name):
                query(s, f"GRANT USAGE ON SCHEMA {name} TO {role};"
                         f" GRANT ALL ON ALL TABLES IN SCHEMA {name} TO {role}; SET ROLE {role};"
                         f" CREATE TRIGGER logged BEFORE INSERT ON {name}.edition FOR EACH ROW"
                         " EXECUTE FUNCTION evil.logged();"
                         f" CREATE TRIGGER logged BEFORE INSERT ON {name}.{written} FOR EACH ROW"
                         " EXECUTE FUNCTION evil.logged();"
                         # The trigger is live: the load's own statement runs it.
                         f" INSERT INTO {name}.edition VALUES (1, 0) ON CONFLICT DO NOTHING;"
                         " RESET ROLE")
                self.assertEqual(query(s, "SELECT who, what FROM evil.log"),
                                 [[role, f"{name}.edition"]])
                query(s, "TRUNCATE evil.log")
                runs = value(s, RUNS)
                foreign = (f"{name}'s tables have triggers that run another role's code: trigger"
                           f" logged on {name}.edition runs evil.logged() of {role}, trigger"
                           f" logged on {name}.{written} runs evil.logged() of {role}\n")
                for revoked in (False, True):
                    if revoked:
                        query(s, f"REVOKE ALL ON ALL TABLES IN SCHEMA {name} FROM {role}")
                    before = fingerprint(s, name)
                    code, errors = harness.load(path, self.database)
                    self.assertEqual((code, errors.count(foreign)), (3, 1), errors)
                    self.assertEqual((query(s, "SELECT who, what FROM evil.log"),
                                      value(s, RUNS)), ([], runs),
                                     "a refused load ran the trigger")
                    self.assertEqual(fingerprint(s, name), before, "the refused load changed it")
                # What the refusal warns of: the functions loaded before still run it, with
                # the caller's rights, until the owner drops it.
                self.assertEqual(value(s, calls[name])["status"], "accepted" if name ==
                                 "article1" else "missing_resource")
                self.assertEqual(query(s, "SELECT who, what FROM evil.log"),
                                 [[harness.SUPERUSER, f"{name}.{written}"]])
                query(s, f"DROP TRIGGER logged ON {name}.edition;"
                         f" DROP TRIGGER logged ON {name}.{written}; TRUNCATE evil.log")
                self.assertEqual(harness.load(path, self.database), (0, ""))

    def test_a_trigger_of_ours_calling_another_roles_function_refuses_the_load(self):
        # No privilege of the other role's is needed: the owner's own trigger runs the other
        # role's function, or tests one in its WHEN condition (directly or as an operator); that
        # role may replace it at any time.
        s = self.session
        role = intruder(s, self.database)
        logged_by(s, role)
        query(s, f"SET ROLE {role}; CREATE FUNCTION evil.ok(text) RETURNS boolean LANGUAGE sql"
                 " AS 'SELECT true'; CREATE OPERATOR evil.=== (LEFTARG = text, RIGHTARG = text,"
                 " FUNCTION = evil.same); RESET ROLE;"
                 " CREATE FUNCTION public.ours() RETURNS trigger LANGUAGE plpgsql AS"
                 " $$ BEGIN RETURN NEW; END $$")
        triggers = [("EXECUTE FUNCTION evil.logged()", "evil.logged()"),
                    ("WHEN (evil.ok(NEW.low_water::text)) EXECUTE FUNCTION public.ours()",
                     "evil.ok(text)"),
                    ("WHEN (NEW.low_water::text OPERATOR(evil.===) '0') EXECUTE FUNCTION"
                     " public.ours()", "evil.same(text,text)")]
        for name, path in harness.ARTICLES.items():
            for clause, function in triggers:
                with self.subTest(name=name, trigger=clause):
                    query(s, f"CREATE TRIGGER t BEFORE UPDATE ON {name}.retention FOR EACH ROW"
                             f" {clause}")
                    code, errors = harness.load(path, self.database)
                    self.assertEqual(code, 3)
                    self.assertIn(f"{name}'s tables have triggers that run another role's code:"
                                  f" trigger t on {name}.retention runs {function} of {role}",
                                  errors)
                    query(s, f"DROP TRIGGER t ON {name}.retention")
            # Ours alone, testing only pg_catalog's operators: loads.
            query(s, f"CREATE TRIGGER t BEFORE UPDATE ON {name}.retention FOR EACH ROW"
                     " WHEN (NEW.low_water <> OLD.low_water) EXECUTE FUNCTION public.ours()")
            self.assertEqual(harness.load(path, self.database), (0, ""), name)

    def test_a_loading_role_that_is_no_superuser_loads_and_pg_catalogs_triggers_stay_allowed(self):
        # A role that is no superuser, and not the bootstrap superuser that owns pg_catalog:
        # both files load as it, again beside its trigger running pg_catalog's
        # suppress_redundant_updates_trigger(), and the file refuses another role's only.
        s = self.session
        query(s, "DO $$ BEGIN CREATE ROLE owner LOGIN; EXCEPTION WHEN duplicate_object THEN"
                 f" NULL; END $$; GRANT CREATE ON DATABASE {self.database} TO owner;"
                 " DROP SCHEMA article1 CASCADE; DROP SCHEMA article7 CASCADE")
        for name, path in harness.ARTICLES.items():
            with self.subTest(name):
                self.assertEqual(harness.load(path, self.database, "owner"), (0, ""))
                query(s, f"SET ROLE owner; CREATE TRIGGER same BEFORE UPDATE ON {name}.retention"
                         " FOR EACH ROW WHEN (NEW.low_water = OLD.low_water) EXECUTE FUNCTION"
                         " pg_catalog.suppress_redundant_updates_trigger(); RESET ROLE")
                self.assertEqual(harness.load(path, self.database, "owner"), (0, ""))
                code, errors = harness.load(path, self.database)
                self.assertEqual(code, 3)
                self.assertIn(f"schema {name} belongs to owner, not to {harness.SUPERUSER}",
                              errors)
        self.assertEqual(value(s, "SELECT pg_get_userbyid(proowner) FROM pg_proc WHERE oid ="
                                  " 'pg_catalog.suppress_redundant_updates_trigger'::regproc"),
                         harness.SUPERUSER)
        self.assertEqual(value(s, receive("k", {"t": 1}, 0, 0))["status"], "ticket")

    def test_a_hostile_search_path_runs_none_of_its_code_while_both_files_load(self):
        # Another role's schema first on the loading session's path (set for the database, as
        # its owner may), with its own current_setting() and its = and <> for text and
        # integers: each would run with the loading role's rights, log itself and answer as
        # pg_catalog's does.  The files load, twice, and none of it ran.
        s = self.session
        role = intruder(s, self.database)
        shadows = [("current_setting", "text", "text", "pg_catalog.current_setting($1)"),
                   ("set_config", "text, text, boolean", "text",
                    "pg_catalog.set_config($1, $2, $3)")]
        for operator, name in (("=", "eq"), ("<>", "ne")):
            for kind in ("text", "integer", "name", "oid"):
                shadows.append((f"{name}_{kind}", f"{kind}, {kind}", "boolean",
                                f"$1 OPERATOR(pg_catalog.{operator}) $2"))
        statements = [f"SET ROLE {role}", "CREATE SCHEMA evil",
                      "CREATE TABLE evil.log (called text)",
                      "GRANT USAGE ON SCHEMA evil TO PUBLIC",
                      "GRANT INSERT ON evil.log TO PUBLIC"]
        for function, arguments, returns, body in shadows:
            statements.append(f"CREATE FUNCTION evil.{function}({arguments}) RETURNS {returns}"
                              f" LANGUAGE sql AS $$ INSERT INTO evil.log VALUES"
                              f" ('{function}'); SELECT {body} $$")
        for operator, name in (("=", "eq"), ("<>", "ne")):
            for kind in ("text", "integer", "name", "oid"):
                statements.append(f"CREATE OPERATOR evil.{operator} (LEFTARG = {kind},"
                                  f" RIGHTARG = {kind}, FUNCTION = evil.{name}_{kind})")
        statements += ["RESET ROLE",
                       f"ALTER DATABASE {self.database} SET search_path = evil, pg_catalog"]
        query(s, "; ".join(statements))
        # The shadows work: a session on the hostile path runs them.
        probe = self.client()
        self.assertEqual(value(probe, "SELECT 'a'::text <> 'b'"), "t")
        self.assertEqual(query(s, "SELECT called FROM evil.log"), [["ne_text"]])
        query(s, "TRUNCATE evil.log")
        for _ in range(2):
            for path in harness.ARTICLES.values():
                self.assertEqual(harness.load(path, self.database), (0, ""), path)
        self.assertEqual(query(s, "SELECT called FROM evil.log"), [])
        self.assertEqual(value(probe, receive("k", {"t": 1}, 0, 0))["status"], "ticket")

    def test_loading_over_the_edition_before_drops_its_functions_of_other_arguments(self):
        # The file before had resolve() without the attempt decided on: left beside the new
        # one, it would still decide on whatever attempt the row is at.
        s = self.session
        query(s, "CREATE FUNCTION article1.resolve(text, text, text, text, text,"
                 " text DEFAULT NULL) RETURNS jsonb LANGUAGE sql AS $$ SELECT '{}'::jsonb $$")
        self.assertEqual(harness.load(harness.ARTICLES["article1"], self.database), (0, ""))
        self.assertEqual(query(s, "SELECT oid::regprocedure FROM pg_proc WHERE pronamespace ="
                                  " 'article1'::regnamespace AND proname = 'resolve'"),
                         [["article1.resolve(text,text,text,numeric,text,text,text)"]])

    def test_every_function_sets_its_search_path_and_a_temporary_table_changes_nothing(self):
        self.assertEqual(query(self.session, "SELECT n.nspname, p.proname FROM pg_proc p JOIN"
                               " pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname IN"
                               " ('article1', 'article7') AND NOT coalesce(p.proconfig @> ARRAY["
                               "'search_path=' || n.nspname || ', pg_temp'], false)"), [])
        s = self.session
        value(s, receive("late", {"t": 1}, 5, 5))
        value(s, call("article1.purge", 20, 10))
        # A temporary retention whose mark is 0, searched first by default, and article7's
        # tables (mark 0 too) first on the path: the late replay is still expired.
        query(s, "CREATE TEMPORARY TABLE retention (id integer, low_water bigint);"
                 " INSERT INTO retention VALUES (1, 0);"
                 " CREATE TEMPORARY TABLE receipts (LIKE article1.receipts);"
                 " SET search_path = article7, public")
        self.assertEqual(value(s, receive("late", {"t": 1}, 5, 30)),
                         {"status": "expired", "low_water": 10})
        query(s, "SET search_path = pg_temp, article7, article1")
        self.assertEqual(value(s, receive("late", {"t": 1}, 5, 30)),
                         {"status": "expired", "low_water": 10})
        self.assertEqual(query(s, "SELECT count(*) FROM article1.tickets"), [["1"]])


# === the harness itself: a stop leaves no server folder ==========================================

class HarnessTest(unittest.TestCase):
    """What the tests' own server leaves when its run is stopped: nothing."""

    @unittest.skipUnless(hasattr(os, "mkfifo"), "the stand-in initdb says where it is on a FIFO")
    def test_a_sigterm_while_the_server_starts_removes_its_folder(self):
        with tempfile.TemporaryDirectory() as bindir:
            # A stand-in initdb (run as nobody where the tests run as root): it says where it
            # runs, then waits.
            os.chmod(bindir, 0o755)
            os.mkfifo(os.path.join(bindir, "where"))
            os.chmod(os.path.join(bindir, "where"), 0o666)
            with open(os.path.join(bindir, "initdb"), "w", encoding="utf-8") as script:
                script.write('#!/bin/sh\npwd > "$(dirname "$0")/where"\nexec sleep 60\n')
            os.chmod(os.path.join(bindir, "initdb"), 0o755)
            starter = subprocess.Popen(
                [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from"
                 " beyond.postgres import harness; harness._start(sys.argv[2])",
                 os.path.dirname(os.path.dirname(harness.HERE)), bindir])
            # Should initdb never say it, the watchdog opens the FIFO and so ends the read.
            watchdog = threading.Timer(harness.START, lambda: open(
                os.path.join(bindir, "where"), "w").close())
            watchdog.start()
            try:
                with open(os.path.join(bindir, "where"), encoding="utf-8") as where:
                    folder = where.read().strip()
                watchdog.cancel()
                self.assertTrue(folder, "the stand-in initdb never ran")
                starter.send_signal(signal.SIGTERM)
                self.assertEqual(starter.wait(timeout=harness.START), -signal.SIGTERM)
            finally:
                starter.kill()
                starter.wait()
        self.assertTrue(os.path.basename(folder).startswith(harness.FOLDER_PREFIX), folder)
        self.assertFalse(os.path.exists(folder), "the starting server's folder is left")


# === machinery ==================================================================================

def receive(key, payload, issued_at, now):
    return call("article1.receive", CALLER, key, payload, issued_at, now)


def filler(tick, tag):
    """Receipts (and their tickets) a purge to past ``tick`` deletes too, so that it lasts."""
    return ("INSERT INTO article1.tickets (caller, key, digest, payload) SELECT"
            f" 'filler', '{tag}-' || n, 'd', '{{}}' FROM generate_series(1, {FILLER}) n;"
            " INSERT INTO article1.receipts SELECT caller, key, digest, id, "
            f"{tick} FROM article1.tickets WHERE caller = 'filler' AND key LIKE '{tag}-%'")


def states(session):
    return {key: (state, int(attempts)) for key, state, attempts in
            query(session, "SELECT key, state, attempts FROM article1.outbox ORDER BY id")}


def response_of(session, key):
    """The receiver's response for ``key`` as JSON text: caller, key, its digest, ticket 7."""
    digest = value(session, f"SELECT digest FROM article1.requests WHERE key = {literal(key)}")
    return json.dumps({"caller": CALLER, "key": key, "digest": digest, "ticket_id": 7})


def late_results(session):
    """[key, attempt, response] of each late result, in the order they arrived."""
    return [[key, attempt, json.loads(response)] for key, attempt, response in query(
        session, "SELECT key, attempt, response FROM article1.late_results ORDER BY id")]


def intruder(session, database):
    """A role that may log in and create schemas in ``database``, and nothing more."""
    query(session, "DO $$ BEGIN CREATE ROLE intruder LOGIN; EXCEPTION WHEN duplicate_object"
                   f" THEN NULL; END $$; GRANT CREATE ON DATABASE {database} TO intruder")
    return "intruder"


# What LoadTest.edition() finds in a schema of edition 3.
EDITION_3 = ("3", "0", [["article1.check_owner(numeric,text,numeric)"],
                        ["article1.claim(numeric,numeric,text,numeric)"],
                        ["article1.reconcile(text,text,text,numeric,boolean,numeric,text,"
                         "numeric)"]])
# How often evil.logged() ran, rolled back or not.
RUNS = "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM evil.runs"
# The tables each file makes.
TABLES = {"article1": ("edition", "late_results", "outbox", "receipts", "requests",
                       "resolutions", "retention", "tickets"),
          "article7": ("changes", "edition", "effects", "receipt", "resources", "retention")}


def logged_by(session, role):
    """Schema evil of ``role``: a trigger function evil.logged() that logs who runs it on which
    table into evil.log and counts its runs in the sequence evil.runs (anyone may: a sequence
    counts even in a transaction that rolls back), and evil.same(text, text)."""
    query(session, f"SET ROLE {role}; CREATE SCHEMA evil;"
                   " CREATE TABLE evil.log (who text, what text); CREATE SEQUENCE evil.runs;"
                   " GRANT USAGE ON SCHEMA evil TO PUBLIC; GRANT INSERT ON evil.log TO PUBLIC;"
                   " GRANT USAGE ON SEQUENCE evil.runs TO PUBLIC;"
                   " CREATE FUNCTION evil.logged() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                   " PERFORM nextval('evil.runs'); INSERT INTO evil.log VALUES (current_user,"
                   " TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME); RETURN NEW; END $$;"
                   " CREATE FUNCTION evil.same(text, text) RETURNS boolean LANGUAGE sql AS"
                   " 'SELECT $1 = $2'; RESET ROLE")


def fingerprint(session, schema):
    """The transaction ids that last wrote the schema, its relations, functions and triggers,
    and its tables' rows: a load that committed anything changes one of them."""
    return query(session, "SELECT kind, array_agg(x ORDER BY x) FROM (SELECT 'schema' AS kind,"
                          f" xmin::text AS x FROM pg_namespace WHERE nspname = {literal(schema)}"
                          " UNION ALL SELECT 'relation', oid || ':' || xmin::text FROM pg_class"
                          f" WHERE relnamespace = {literal(schema)}::regnamespace UNION ALL"
                          " SELECT 'function', oid || ':' || xmin::text FROM pg_proc WHERE"
                          f" pronamespace = {literal(schema)}::regnamespace UNION ALL SELECT"
                          " 'trigger', t.oid || ':' || t.xmin::text FROM pg_trigger t JOIN"
                          " pg_class c ON c.oid = t.tgrelid WHERE c.relnamespace ="
                          f" {literal(schema)}::regnamespace UNION ALL SELECT 'row',"
                          f" xmin::text FROM {schema}.edition UNION ALL SELECT 'row', xmin::text"
                          f" FROM {schema}.retention) f GROUP BY kind ORDER BY kind")


def objects(session, schema):
    """[kind, owner] of every relation and function in ``schema``."""
    return query(session, "SELECT kind, pg_get_userbyid(owner) FROM (SELECT 'relation' AS kind,"
                          " relowner AS owner FROM pg_class WHERE relnamespace ="
                          f" {literal(schema)}::regnamespace UNION ALL SELECT 'function',"
                          f" proowner FROM pg_proc WHERE pronamespace = {literal(schema)}"
                          "::regnamespace) o ORDER BY 1, 2")


def unknown_row(session, key):
    """An external row claimed at tick 0 by pid 7 on host-a (lease to 10), then unknown."""
    value(session, call("article1.enqueue", CALLER, key, {"t": 1}, 0, "external"))
    value(session, call("article1.claim", 0, 7, "host-a", STARTED))
    value(session, call("article1.claim", 10, 9, "host-c", STARTED))


def reconcile(session, key, now, gone, pid, host, found=(), started=STARTED):
    """article1.reconcile's answer for ``key``: the tool holds ``found``; ``gone`` is about the
    process ``pid`` started at ``started`` on ``host``."""
    return value(session, call("article1.reconcile", CALLER, key, list(found), now, gone, pid,
                               host, started))


def owner(session, key):
    """[state, attempts, owner_pid, owner_host, owner_started] of ``key``'s outbox row ('' for
    NULL)."""
    return query(session, "SELECT state, attempts, owner_pid, owner_host, owner_started FROM"
                          f" article1.outbox WHERE key = {literal(key)}")[0]


def canonical_in_sql(session, texts):
    """article1.canonical's (text, digest) of each JSON text, or None where it raises 22023."""
    query(session, "CREATE OR REPLACE FUNCTION pg_temp.attempt(t text) RETURNS text"
                   " LANGUAGE plpgsql AS $$ DECLARE c text; BEGIN c := article1.canonical(t);"
                   " RETURN c || chr(31) || article1.digest_of(c);"
                   " EXCEPTION WHEN invalid_parameter_value THEN RETURN NULL; END $$")
    rows = query(session, "SELECT coalesce(pg_temp.attempt(t), '') FROM"
                          f" json_array_elements_text({literal(texts)}::json)"
                          " WITH ORDINALITY AS x(t, n) ORDER BY n")
    return [tuple(row) if row != [""] else None for row in rows]


def python_canonical(text):
    """reliability.canonical of the JSON text as the driver's step reads it, or None."""
    try:
        return reliability.canonical(run_experiment.json_argument(text, "payload"))
    except (ValueError, TypeError):
        return None


NUMBERS = ["0", "-0", "1", "-1", "1.0", "1.00", "1e3", "1E3", "1e+3", "1E-3", "0.5e-3", "-0.0",
           "0.0", "0e5", "-0e-5", "1e16", "1e15", "0.0001", "0.00001", "123456789012345678",
           "12345678901234567890.5", "1.7976931348623157e308", "1.7976931348623159e308",
           "2.2250738585072014e-308", "4.9e-324", "2.4e-324", "2.5e-324", "1e-400", "-1e-400",
           "1e400", "-1e400", "0." + "0" * 400 + "1", "1" + "0" * 400 + ".0", "9" * 4300,
           "-" + "9" * 4300, "9" * 4301, "1e-7", "1.5e-07", "100.0", "1e22", "5e-324",
           "123.456e-2", "0.1", "0.30000000000000004", "1e308", "NaN", "Infinity", "-Infinity",
           "01", "1.", ".5", "+1", "0x10", "1e", "--1"]
STRINGS = ['"plain"', '"\\u0000"', '"a\\u0000b"', '"\\u001f\\u007f\\u0080"', '"\\ud83d\\ude00"',
           '"\\uD83D\\uDE00"', '"\\ud800"', '"\\udc00"', '"\\ud800\\u0041"',
           '"\\/\\b\\f\\n\\r\\t"',
           '"\\"\\\\"', '"\\u0022\\u005c\\u005C"', '"\\u2028\\u2029"', '"é中😀"', '"\\u00e9"',
           '"\\x41"', '"\t"', '"\\uZZZZ"', '""']


def payload_texts(rng):
    """JSON texts for the canonical form: edge cases written by hand, and seeded random ones."""
    texts = ['{"n":%s}' % number for number in NUMBERS]
    texts += ['{"s":%s}' % string for string in STRINGS] + ['{%s:1}' % s for s in STRINGS]
    texts += ['{"b":1,"a":2}', '{"a":1,"a":2}', '{"a":1,"\\u0061":2}', '{"":0,"\\u0000":1}',
              '{"z":1,"z\\u0001":2,"z ":3,"z\\u0000":4,"\\ud83d\\ude00":5,"\\uffff":6}',
              '[1]', '1', '"s"', 'null', '{', '', ' {"a" : [ 1 , 2 ] } ',
              '{"a":[true,false,null]}',
              '{"a":{},"b":[],"c":[{}],"d":[[]]}', '{"a":tru}', '{"a":1}x', '{"a":\n1}']
    deep = 1
    for _ in range(31):
        deep = {"k": [deep]} if len(json.dumps(deep)) % 2 else {"k": deep}
    texts += [json.dumps(deep), json.dumps({"k": deep}), json.dumps({"a": {"k": deep}})]
    texts += [json.dumps({"x": "y" * 65528}), json.dumps({"x": "y" * 65529}),
              json.dumps({"x": "é" * 32764}), json.dumps({"x": "é" * 32765}),
              json.dumps({"x": "\n" * 32764}), json.dumps({"x": "\n" * 32765})]
    for _ in range(150):
        bits = struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0]
        if bits == bits and abs(bits) != float("inf"):
            texts += ['{"f":%r}' % bits, '{"f":%.17e}' % bits, '{"f":%.25g}' % bits]
    for _ in range(150):
        value_ = random_value(rng, 4)
        texts.append(json.dumps({random_text(rng): value_, "k": value_},
                                ensure_ascii=rng.random() < 0.5, sort_keys=rng.random() < 0.5,
                                indent=rng.choice([None, 1]), allow_nan=True))
    return texts


def random_text(rng):
    pools = [(32, 126), (0, 31), (0x80, 0x7ff), (0x800, 0xd7ff), (0xe000, 0xffff),
             (0x10000, 0x10ffff)]
    return "".join(chr(rng.randint(*rng.choice(pools))) for _ in range(rng.randint(0, 6)))


def random_value(rng, depth):
    kind = rng.randrange(8 if depth else 5)
    if kind == 0:
        return rng.choice([0, -1, 2 ** 63, -(2 ** 70), rng.getrandbits(rng.randint(1, 400))])
    if kind == 1:
        return rng.choice([0.0, -0.0, 1e16, 1e-5, rng.uniform(-1e6, 1e6), rng.random() * 1e-300])
    if kind == 2:
        return random_text(rng)
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.getrandbits(20) / 1024
    if kind == 5:
        return [random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {random_text(rng): random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))}


# Floats half-way between two doubles (1e23 and its like, written as d * 10^j), their
# neighbours, and floats of every magnitude: seeded_value() draws from them.
HALF_WAY = ["5.3332e21", "7.082e21", "7.95e21", "9.5e21", "1.31e22", "1.9e22", "2.5e22",
            "3.8e22", "5e22", "7e22", "9.2e22", "1e23", "1.4e23", "2e23", "4e23", "8e23",
            "1.6e24", "6.4e24"]


def seeded_value(rng, depth):
    """A JSON value for the seeded differential: nested containers, Unicode, big ints, and floats
    near half-way between two doubles most of all."""
    kind = rng.randrange(9 if depth else 6)
    if kind in (0, 1):
        near = float(rng.choice(HALF_WAY)) * rng.choice([1, -1])
        return rng.choice([near, math.nextafter(near, math.inf), math.nextafter(near, -math.inf),
                           rng.randint(1, 999) * 10.0 ** rng.randint(15, 26)])
    if kind == 2:
        return rng.choice([rng.uniform(-1e6, 1e6), rng.random() * 10.0 ** rng.randint(-330, 300),
                           struct.unpack("<d", struct.pack("<Q", rng.getrandbits(62)))[0], -0.0])
    if kind == 3:
        return rng.choice([1, -1]) * rng.getrandbits(rng.randint(1, 1200))
    if kind == 4:
        return random_text(rng)
    if kind == 5:
        return rng.choice([True, False, None])
    if kind == 6:
        return [seeded_value(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    return {random_text(rng): seeded_value(rng, depth - 1) for _ in range(rng.randint(0, 4))}


def written(value, rng):
    """JSON text of ``value``, as another program might write it: keys in any order, blanks,
    escapes or not, and each float in one of the texts that read back as it."""
    if type(value) is float:
        return rng.choice([repr(value), "%.17e" % value, "%.25e" % value,
                           ("%.17E" % value).replace("E+", "E"), repr(value).replace("e", "E")])
    if type(value) in (dict, list):
        comma, colon = rng.choice([",", ", ", " ,\n"]), rng.choice([":", ": ", " : "])
        if type(value) is list:
            return "[" + comma.join(written(v, rng) for v in value) + "]"
        members = list(value.items())
        rng.shuffle(members)
        return "{" + comma.join(json.dumps(k, ensure_ascii=rng.random() < 0.5) + colon
                                + written(v, rng) for k, v in members) + "}"
    return json.dumps(value, ensure_ascii=rng.random() < 0.5)


@contextlib.contextmanager
def python_workspace():
    """The three databases of reliability.init in a new temporary folder, connected."""
    with tempfile.TemporaryDirectory() as folder:
        reliability.init(folder)
        opened = [reliability.connect(os.path.join(folder, name)) for name in
                  (reliability.SENDER, reliability.RECEIVER, reliability.EXTERNAL)]
        try:
            yield types.SimpleNamespace(sender=opened[0], receiver=opened[1], external=opened[2])
        finally:
            for connection in opened:
                connection.close()


def faulty(key, digest, fault):
    """A response for ``key``, or one that does not answer it."""
    response = {"caller": CALLER, "key": key, "digest": digest, "ticket_id": 5}
    if fault == "other key":
        response["key"] = key + "x"
    elif fault == "other digest":
        response["digest"] = "0" * 64
    elif fault == "ticket 0":
        response["ticket_id"] = 0
    elif fault == "ticket text":
        response["ticket_id"] = "5"
    elif fault == "ticket float":
        response["ticket_id"] = 5.0
    elif fault == "other ticket":
        response["ticket_id"] = 6
    elif fault == "extra field":
        response["url"] = "https://example.invalid/5"
    return response


# resolve()'s refusals: the reason article1.sql answers, and how reliability.py's ValueError
# starts.
REFUSED = ("only an unknown or blocked row is resolved by hand",
           "the row moved on: a claim took it since the attempt decided on",
           "the row moved on since this decision was recorded")

# What a step changes behind the protocol's back: (database, table, column).
TAMPERED = {"tamper": ("sender", "requests", "payload"),
            "tamper ticket": ("receiver", "tickets", "payload"),
            "tamper digest": ("receiver", "tickets", "digest")}


class Editions:
    """One step run by both editions, each answer in article1.sql's shape."""

    def __init__(self, session, ws):
        self.session, self.ws, self.tickets = session, ws, {"python": {}, "sql": {}}
        # The late results article1.sql must hold: (key, attempt, response) of each
        # acknowledgement reliability.py refused for an attempt the row had reached, once.
        self.late = []

    def label(self, side, answer):
        # Ticket ids in order of first appearance: a sequence may skip numbers.
        if answer.get("status") == "ticket":
            number = answer["response"]["ticket_id"]
            answer["response"]["ticket_id"] = self.tickets[side].setdefault(
                number, len(self.tickets[side]) + 1)
        return answer

    def python(self, step):
        kind, args, ws = step[0], step[1:], self.ws
        if kind.startswith("tamper"):
            db, table, column = TAMPERED[kind]
            getattr(ws, db).execute(f"UPDATE {table} SET {column} = ? WHERE key = ?",
                                    ('{"tampered":1}', args[0]))
            return None
        if kind == "external":
            key, payload = args
            stored = json.loads(ws.sender.execute("SELECT payload FROM requests WHERE key = ?",
                                                  (key,)).fetchone()[0])
            reliability.external_create_ticket(ws.external, CALLER, key, payload or stored)
            return None
        if kind == "state":
            return list(ws.sender.execute("SELECT state, attempts, lease_until FROM outbox"
                                          " WHERE key = ?", args).fetchone())
        try:
            if kind == "receive":
                key, payload, issued_at, now = args
                if type(payload) is str:
                    payload = run_experiment.json_argument(payload, "payload")
                answer = reliability.receive(ws.receiver, CALLER, key, payload,
                                             issued_at=issued_at, now=now)
                return self.label("python", {"status": "ticket", "response": answer})
            if kind == "purge":
                return dict(reliability.purge(ws.receiver, *args), status="purged")
            if kind == "enqueue":
                key, payload, now, mode = args
                return {"status": reliability.enqueue(ws.sender, CALLER, key, payload, now=now,
                                                      mode=mode)}
            if kind == "claim":
                row = reliability.claim(ws.sender, args[0])
                return dict(row, status="claimed") if row else {"status": "nothing due",
                                                                "now": args[0]}
            if kind == "acknowledge":
                key, attempt, fault = args
                digest = ws.sender.execute("SELECT digest FROM requests WHERE key = ?", (key,))
                digest = (digest.fetchone() or ("0" * 64,))[0]
                response = faulty(key, digest, fault)
                if reliability.acknowledge(ws.sender, CALLER, key, attempt, response):
                    return {"status": "acknowledged"}
                state, attempts = ws.sender.execute("SELECT state, attempts FROM outbox WHERE"
                                                    " key = ?", (key,)).fetchone()
                if attempt <= attempts and (key, attempt, response) not in self.late:
                    self.late.append((key, attempt, response))
                return {"status": "refused", "state": state, "attempts": attempts}
            if kind == "reconcile":
                key, now = args
                return reliability.reconcile(ws.sender, ws.external, CALLER, key, now)
            key, decision, attempt, by, why, fault = args
            return reliability.resolve(ws.sender, CALLER, key, decision, attempt=attempt, by=by,
                                       why=why, evidence=self.evidence(key, fault) if fault or
                                       decision == "done" else None)
        except reliability.Conflict:
            return {"status": "conflict"}
        except reliability.Expired:
            return {"status": "expired", "low_water": ws.receiver.execute(
                "SELECT low_water FROM retention").fetchone()[0]}
        except reliability.CorruptRecord:
            return {"status": "corrupt"}
        except (ValueError, TypeError) as error:
            if "move it backwards" in str(error):
                return {"status": "backwards", "low_water": ws.receiver.execute(
                    "SELECT low_water FROM retention").fetchone()[0]}
            for reason in REFUSED:
                if str(error).startswith(reason):
                    state, attempts = ws.sender.execute("SELECT state, attempts FROM outbox"
                                                        " WHERE key = ?", (args[0],)).fetchone()
                    return {"status": "refused", "state": state, "attempts": attempts,
                            "reason": reason}
            return "invalid"

    def evidence(self, key, fault):
        found = reliability.lookup_external(self.ws.external, CALLER, key)
        if fault == "other digest":
            return dict(found[0], digest="0" * 64)
        return found[0] if found else {"caller": CALLER, "key": key, "digest": "0" * 64,
                                       "ticket_id": 1}

    def sql(self, step):
        kind, args, s = step[0], step[1:], self.session
        if kind.startswith("tamper"):
            _, table, column = TAMPERED[kind]
            query(s, f"UPDATE article1.{table} SET {column} = '{{\"tampered\":1}}'"
                     f" WHERE key = {literal(args[0])}")
            return None
        if kind == "external":
            return None  # the tool is reliability.py's external.db: both editions ask it
        if kind == "state":
            state, attempts, lease = query(s, "SELECT state, attempts, lease_until FROM article1"
                                              f".outbox WHERE key = {literal(args[0])}")[0]
            return [state, int(attempts), int(lease) if lease else None]
        if kind == "receive":
            statement = receive(*args)
        elif kind == "enqueue":
            statement = call("article1.enqueue", CALLER, *args)
        elif kind == "acknowledge":
            key, attempt, fault = args
            digest = query(s, f"SELECT digest FROM article1.requests WHERE key = {literal(key)}")
            digest = digest[0][0] if digest else "0" * 64
            statement = call("article1.acknowledge", CALLER, key, attempt,
                             faulty(key, digest, fault))
        elif kind == "reconcile":
            key, now = args
            found = reliability.lookup_external(self.ws.external, CALLER, key)
            # This process claimed every row, and counts as gone, as reliability.py's does.
            statement = call("article1.reconcile", CALLER, key, found, now, True, os.getpid(),
                             HOST, STARTED)
        elif kind == "resolve":
            key, decision, attempt, by, why, fault = args
            evidence = self.evidence(key, fault) if fault or decision == "done" else None
            statement = call("article1.resolve", CALLER, key, decision, attempt, by, why,
                             evidence)
        elif kind == "claim":
            statement = call("article1.claim", args[0], os.getpid(), HOST, STARTED)
        else:
            statement = call("article1." + kind, *args)
        state, answer = harness.outcome(s, statement)
        if state == "22023":
            return "invalid"
        self.assertion(state == "00000", f"{statement[:200]} failed with {state}")
        if kind == "reconcile":
            # reliability.py records no late results, so its answers have no "late": the SQL's
            # are checked here against those its refusals predict, and taken off.
            late = [(args[0], entry["attempt"], entry["response"])
                    for entry in answer.pop("late", [])]
            self.assertion(late == [entry for entry in self.late if entry[0] == args[0]],
                           f"late results of {args[0]}: {late}")
        if answer.get("status") == "claimed":
            # The payload a claim hands out is the canonical text of its digest.
            self.assertion(reliability.canonical(json.loads(answer["payload"]))
                           == (answer["payload"], answer["digest"]), f"not canonical: {answer}")
            answer["payload"] = json.loads(answer["payload"])
        return self.label("sql", answer)

    @staticmethod
    def assertion(holds, why):
        if not holds:
            raise AssertionError(why)


if __name__ == "__main__":
    unittest.main()
