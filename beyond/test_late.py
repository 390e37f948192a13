"""Tests of beyond/late.py: a late result is evidence, kept once and shown, never applied.

Run from the project root: ``python3 -m unittest beyond.test_late``.  Real SQLite files in a
fresh temporary directory each, made by reliability.init() and late.init(); claims, deliveries
and acknowledgements that race or come late are made by real processes of their own, and a
tool child is a real process started through reliability.call_tool().  Where an order matters
it is forced: one process is held inside its transaction (paused by a trace callback on its
own connection) while the test asserts what the other does.  A wait for a sign fails after
SILENCE seconds without it; a child that outlives WATCHDOG seconds is killed.
"""
import contextlib
import json
import os
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import types
import unittest

# The project root, whether this runs as beyond.test_late or as a file.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import reliability
import run_experiment
from beyond import late

# Seconds a wait hears nothing before it fails: each sign follows its cause within
# milliseconds, so a broken order fails in seconds and a loaded machine only makes it later.
SILENCE = 10.0
# Seconds: only ends a hung child, never asserted as a measurement.
WATCHDOG = 60.0
CALLER = "agent"
PAYLOAD = {"title": "打印机卡纸", "priority": 2}
# reliability.reconcile()'s words for a row it sends back to pending.
PROVEN_ABSENT = "proven absent: retry under the same key"
# Racers released together at a barrier.
RACERS = 8


@unittest.skipUnless(hasattr(os, "fork"), "claims and deliveries run in forked processes")
class KeptOnceNeverAppliedTest(unittest.TestCase):
    """A response refused because a later attempt took the row is recorded once, and the row is
    left as reliability leaves it."""

    def test_attempt_1_answered_after_attempt_2_took_the_row_is_refused_kept_once_and_shown(self):
        with workspace() as root, processes() as fork:
            first = outcome(fork(_claim, root, 0))
            # Attempt 1's lease ended at tick 10: another process takes the row.
            second = outcome(fork(_claim, root, 10))
            before = stored(root)
            delivered = outcome(fork(_deliver, root, first, 11))
            response = {"caller": CALLER, "key": "k1", "digest": first["digest"], "ticket_id": 1}
            asked_again = outcome(fork(_acknowledge, root, "k1", 1, response, 14))
            after = stored(root)
            kept = late_rows(root)
            with opened(root) as db:
                shown = late.snapshot(db.sender)
                theirs = reliability.snapshot(db.sender)
                reconciled = late.reconcile(db.sender, db.external, CALLER, "k1", 15)
                tickets = db.receiver.execute("SELECT count(*) FROM tickets").fetchone()[0]
            # Attempt 2 delivers: the receipt answers with the same ticket, the row is done.
            settled = outcome(fork(_deliver, root, second, 16))
            # Attempt 1 again, once the row is settled: still the one record.
            settled_again = outcome(fork(_acknowledge, root, "k1", 1, response, 17))
            kept_after = late_rows(root)
        self.assertEqual((first["attempt"], second["attempt"]), (1, 2))
        self.assertEqual((delivered["status"], delivered["acknowledged"], delivered["response"]),
                         ("stale", False, response))
        self.assertIs(asked_again, False)
        self.assertEqual(after, before)
        self.assertEqual(tickets, 1)
        self.assertEqual(kept, [(1, CALLER, "k1", 1, reliability.canonical(response)[0], 11)])
        entry = {"attempt": 1, "response": response, "arrived_at": 11}
        self.assertEqual(shown, dict(theirs, late=[dict(entry, caller=CALLER, key="k1")]))
        self.assertEqual(reconciled, {"status": "inflight", "reason": late.NOTHING_TO_RECONCILE,
                                      "late": [entry]})
        self.assertEqual((settled["status"], settled["response"]), ("done", response))
        self.assertIs(settled_again, False)
        self.assertEqual(kept_after, kept)

    def test_another_response_for_the_same_attempt_is_another_record(self):
        with workspace() as root:
            with opened(root) as db:
                row = reliability.claim(db.sender, 0)
                reliability.claim(db.sender, 10)
                answers = [answer(row, ticket) for ticket in (1, 7, 1)]
                acknowledged = [late.acknowledge(db.sender, CALLER, "k1", 1, response,
                                                 now=11 + n) for n, response in
                                enumerate(answers)]
            kept = late_rows(root)
        self.assertEqual(acknowledged, [False, False, False])
        self.assertEqual([(attempt, json.loads(text)["ticket_id"], tick)
                          for _, _, _, attempt, text, tick in kept], [(1, 1, 11), (1, 7, 12)])

    def test_an_attempt_never_claimed_records_nothing(self):
        with workspace() as root:
            with opened(root) as db:
                row = reliability.claim(db.sender, 0)
                reliability.claim(db.sender, 10)
                unclaimed = late.acknowledge(db.sender, CALLER, "k1", 3, answer(row), now=11)
                nothing = late_rows(root)
                claimed = late.acknowledge(db.sender, CALLER, "k1", 1, answer(row), now=12)
            kept = late_rows(root)
        self.assertEqual((unclaimed, nothing), (False, []))
        self.assertEqual((claimed, [entry[3:] for entry in kept]),
                         (False, [(1, reliability.canonical(answer(row))[0], 12)]))

    def test_the_attempt_holding_the_row_is_acknowledged_and_a_settled_row_keeps_the_rest(self):
        with workspace() as root:
            with opened(root) as db:
                row = reliability.claim(db.sender, 0)
                held = [late.acknowledge(db.sender, CALLER, "k1", 1, answer(row), now=1)
                        for _ in range(2)]
                nothing = late_rows(root)
                state = db.sender.execute("SELECT state FROM outbox").fetchone()[0]
                # Settled by attempt 1: another answer for that attempt is late.
                again = late.acknowledge(db.sender, CALLER, "k1", 1, answer(row, 9), now=2)
            kept = late_rows(root)
        self.assertEqual((held, nothing, state), ([True, True], [], "done"))
        self.assertIs(again, False)
        self.assertEqual([entry[3:] for entry in kept],
                         [(1, reliability.canonical(answer(row, 9))[0], 2)])

    def test_a_response_not_answering_the_request_is_refused_as_reliability_refuses_it(self):
        with workspace() as root:
            with opened(root) as db:
                row = reliability.claim(db.sender, 0)
                reliability.claim(db.sender, 10)
                good = answer(row)
                for bad in (dict(good, digest="0" * 64), dict(good, ticket_id=0),
                            dict(good, ticket_id=True), dict(good, key="k2"),
                            dict(good, extra=1), [good], None):
                    with self.subTest(bad=bad):
                        with self.assertRaises(ValueError) as ours:
                            late.acknowledge(db.sender, CALLER, "k1", 1, bad, now=11)
                        with self.assertRaises(ValueError) as theirs:
                            reliability.acknowledge(db.sender, CALLER, "k1", 1, bad)
                        self.assertEqual(str(ours.exception), str(theirs.exception))
            self.assertEqual(late_rows(root), [])

    def test_a_refusal_from_the_tool_delivered_late_records_nothing(self):
        with workspace() as root, processes() as fork:
            # The receiver already holds k1 for another payload: it answers "conflict".
            with opened(root) as db:
                reliability.receive(db.receiver, CALLER, "k1", {"other": 1}, issued_at=0, now=0)
            first = outcome(fork(_claim, root, 0))
            outcome(fork(_claim, root, 10))
            before = stored(root)
            delivered = outcome(fork(_deliver, root, first, 11))
            self.assertEqual((delivered["status"], delivered["response"]["error"]),
                             ("stale", "conflict"))
            self.assertEqual(stored(root), before)
            self.assertEqual(late_rows(root), [])


@unittest.skipUnless(hasattr(os, "fork"), "claims and acknowledgements run in forked processes")
class ReconcileTest(unittest.TestCase):
    """A late result keeps an unknown row from being proven absent, and never settles one."""

    def test_a_late_result_keeps_an_unknown_external_row_from_going_back_to_pending(self):
        with workspace(keys=("k1", "k2"), mode="external") as root, processes() as fork:
            first = unknown_rows(fork, root)["k1"]
            before = stored(root)
            outcome(fork(_acknowledge, root, "k1", 1, answer(first), 11))
            kept = stored(root)
            with opened(root) as db:
                held = late.reconcile(db.sender, db.external, CALLER, "k1", 12)
                unheld = stored(root)
                # k2 has no late result: as reliability decides.
                proven = late.reconcile(db.sender, db.external, CALLER, "k2", 12)
                # reliability alone sends k1 back to pending: the difference is the late result.
                alone = reliability.reconcile(db.sender, db.external, CALLER, "k1", 13)
        self.assertEqual(kept, before)
        self.assertEqual(held, {"status": "unknown", "reason": late.REACHED,
                                "late": [late_entry(first, 11)]})
        self.assertEqual(unheld, before)
        self.assertEqual(proven, {"status": "pending", "reason": PROVEN_ABSENT})
        self.assertEqual(alone, {"status": "pending", "reason": PROVEN_ABSENT})

    def test_a_late_result_never_settles_a_row_but_the_tools_own_ticket_still_does(self):
        with workspace(keys=("k1", "k2"), mode="external") as root, processes() as fork:
            rows = unknown_rows(fork, root)
            for key in rows:
                outcome(fork(_acknowledge, root, key, 1, answer(rows[key]), 11))
            with opened(root) as db:
                # The tool's own records: one ticket for k1, two for k2.
                for key in ("k1", "k2", "k2"):
                    reliability.external_create_ticket(db.external, CALLER, key, PAYLOAD)
                one = late.reconcile(db.sender, db.external, CALLER, "k1", 12)
                two = late.reconcile(db.sender, db.external, CALLER, "k2", 12)
                states = dict(db.sender.execute("SELECT key, state FROM outbox"))
        self.assertEqual(one, {"status": "done", "response": answer(rows["k1"]),
                               "late": [late_entry(rows["k1"], 11)]})
        self.assertEqual(two, {"status": "unknown",
                               "reason": "the tool holds 2 ticket(s) that do not settle it",
                               "late": [late_entry(rows["k2"], 11)]})
        self.assertEqual(states, {"k1": "done", "k2": "unknown"})

    def test_while_the_late_attempt_may_still_act_reconcile_says_so(self):
        with workspace(mode="external") as root, processes() as fork, pipes(2) as (said, go):
            # Attempt 1's claimer stays alive after its lease, until told to end.
            claimer = fork(_claim_and_hold, root, 0, said[1], go[0])
            heard(said[0], b"C")
            outcome(fork(_claim, root, 10))
            row = answer_row(root, "k1")
            outcome(fork(_acknowledge, root, "k1", 1, answer(row), 11))
            with opened(root) as db:
                alive = late.reconcile(db.sender, db.external, CALLER, "k1", 20)
            os.write(go[1], b"!")
            outcome(claimer)
            with opened(root) as db:
                # The claimer is gone: only the lease, at tick 5, says it may still act.
                in_lease = late.reconcile(db.sender, db.external, CALLER, "k1", 5)
                gone = late.reconcile(db.sender, db.external, CALLER, "k1", 20)
        self.assertEqual([reconciled["reason"] for reconciled in (alive, in_lease, gone)],
                         [late.MAY_STILL_ACT, late.MAY_STILL_ACT, late.REACHED])
        self.assertEqual({reconciled["status"] for reconciled in (alive, in_lease, gone)},
                         {"unknown"})

    def test_a_person_may_settle_it_with_the_late_response_as_evidence(self):
        with workspace(mode="external") as root, processes() as fork:
            first = unknown_rows(fork, root)["k1"]
            outcome(fork(_acknowledge, root, "k1", 1, answer(first), 11))
            with opened(root) as db:
                entry = late.snapshot(db.sender)["late"][0]
                decided = reliability.resolve(db.sender, CALLER, "k1", "done", attempt=1,
                                              by="operator", why="the tool answered attempt 1"
                                              " late", evidence=entry["response"])
                after = late.reconcile(db.sender, db.external, CALLER, "k1", 12)
        self.assertEqual(decided["status"], "done")
        self.assertEqual(after, {"status": "done", "reason": late.NOTHING_TO_RECONCILE,
                                 "late": [late_entry(first, 11)]})


@unittest.skipUnless(hasattr(os, "fork"), "racers are forked processes")
class OrderTest(unittest.TestCase):
    """Copies racing make one record; a reconcile and a recorder are ordered by late.db's lock."""

    def test_copies_of_one_late_acknowledgement_released_together_make_one_record(self):
        with workspace() as root, processes() as fork, pipes(2) as (ready, go):
            first = outcome(fork(_claim, root, 0))
            outcome(fork(_claim, root, 10))
            racers = [fork(_acknowledge_at_barrier, root, answer(first), 20 + n, ready[1], go[0])
                      for n in range(RACERS)]
            waiting = heard(ready[0], b"R" * RACERS)
            os.write(go[1], b"!" * RACERS)
            answers = [outcome(racer) for racer in racers]
            kept = late_rows(root)
        self.assertEqual(waiting, RACERS)
        self.assertEqual(answers, [False] * RACERS)
        self.assertEqual(len(kept), 1)
        self.assertIn(kept[0][5], range(20, 20 + RACERS))

    def test_a_reconcile_meeting_a_record_in_progress_waits_for_it_and_keeps_the_row_unknown(self):
        with workspace(mode="external") as root, processes() as fork, \
                pipes(3) as (recorder_said, recorder_go, reconciler_said):
            first = unknown_rows(fork, root)["k1"]
            before = stored(root)
            # The recorder holds late.db's write lock, its late result not yet written.
            recorder = fork(_acknowledge_held_at_insert, root, answer(first), 11,
                            recorder_said[1], recorder_go[0])
            heard(recorder_said[0], b"I")
            reconciler = fork(_reconcile_saying_begin, root, 12, reconciler_said[1])
            heard(reconciler_said[0], b"B")
            os.write(recorder_go[1], b"!")
            recorded, reconciled = outcome(recorder), outcome(reconciler)
            self.assertIs(recorded, False)
            self.assertEqual(reconciled, {"status": "unknown", "reason": late.REACHED,
                                          "late": [late_entry(first, 11)]})
            self.assertEqual(stored(root), before)

    def test_a_reconcile_holds_late_dbs_lock_until_its_decision_so_a_record_comes_after_it(self):
        with workspace(mode="external") as root, processes() as fork, pipes(2) as (said, go):
            first = unknown_rows(fork, root)["k1"]
            # The reconciler has found no late result and no ticket, and is about to commit.
            reconciler = fork(_reconcile_held_before_its_decision, root, 12, said[1], go[0])
            heard(said[0], b"S")
            with contextlib.closing(sqlite3.connect(os.path.join(root, late.LATE),
                                                    timeout=0)) as recorder:
                with self.assertRaisesRegex(sqlite3.OperationalError, "database is locked"):
                    recorder.execute("BEGIN IMMEDIATE")
            os.write(go[1], b"!")
            decided = outcome(reconciler)
            recorded = outcome(fork(_acknowledge, root, "k1", 1, answer(first), 13))
            with opened(root) as db:
                after = late.reconcile(db.sender, db.external, CALLER, "k1", 14)
        self.assertEqual(decided, {"status": "pending", "reason": PROVEN_ABSENT})
        self.assertIs(recorded, False)
        self.assertEqual(after, {"status": "pending", "reason": late.NOTHING_TO_RECONCILE,
                                 "late": [late_entry(first, 13)]})


class FilesTest(unittest.TestCase):
    """late.db is a file of its own: sender.db stays reliability's."""

    @unittest.skipUnless(hasattr(os, "fork"), "the late delivery runs in a forked process")
    def test_sender_db_stays_as_reliability_made_it_and_reliability_refuses_late_db(self):
        with workspace() as root, tempfile.TemporaryDirectory() as fresh, \
                processes() as fork:
            first = outcome(fork(_claim, root, 0))
            outcome(fork(_claim, root, 10))
            outcome(fork(_deliver, root, first, 11))
            self.assertEqual(len(late_rows(root)), 1)
            reliability.init(fresh)
            self.assertEqual(schema(os.path.join(root, reliability.SENDER)),
                             schema(os.path.join(fresh, reliability.SENDER)))
            with contextlib.closing(reliability.connect(os.path.join(root, reliability.SENDER))):
                pass
            with self.assertRaisesRegex(sqlite3.DatabaseError, "not a database of this module"):
                reliability.connect(os.path.join(root, late.LATE))

    def test_init_makes_late_db_once_and_again_keeps_what_it_holds(self):
        with workspace(late_db=False) as root:
            made = late.init(root)
            with opened(root) as db:
                reliability.claim(db.sender, 0)
                reliability.claim(db.sender, 10)
                late.acknowledge(db.sender, CALLER, "k1", 1, answer(answer_row(root, "k1")),
                                 now=11)
            again = late.init(root)
            self.assertEqual((made, again), ("created", "present"))
            self.assertEqual(len(late_rows(root)), 1)
            self.assertEqual(sorted(os.listdir(root)), sorted([*reliability.KINDS, late.LATE]))

    @unittest.skipUnless(hasattr(os, "fork"), "racers are forked processes")
    def test_inits_released_together_make_one_late_db_and_leave_nothing_else(self):
        with workspace(late_db=False) as root, processes() as fork, pipes(2) as (ready, go):
            racers = [fork(_init_at_barrier, root, ready[1], go[0]) for _ in range(4)]
            waiting = heard(ready[0], b"R" * 4)
            os.write(go[1], b"!" * 4)
            said = sorted(outcome(racer) for racer in racers)
            self.assertEqual(waiting, 4)
            self.assertEqual(said, ["created", "present", "present", "present"])
            # Closes at the same moment can each find the other still there and both leave the
            # -wal and -shm files, which SQLite reuses and removes at a later last close.
            left = [name for name in os.listdir(root) if not name.endswith(("-wal", "-shm"))]
            self.assertEqual(sorted(left), sorted([*reliability.KINDS, late.LATE]))
            with contextlib.closing(sqlite3.connect(os.path.join(root, late.LATE))) as made:
                self.assertEqual(made.execute("PRAGMA application_id").fetchone()[0],
                                 late.LATE_KIND)

    def test_init_refuses_a_file_of_another_kind_at_late_db_and_leaves_it_as_it_was(self):
        with workspace(late_db=False) as root:
            path = os.path.join(root, late.LATE)
            for kind, make in (("receiver.db", lambda: shutil.copyfile(
                    os.path.join(root, reliability.RECEIVER), path)),
                               ("text", lambda: write_bytes(path, b"not a database\n" * 64))):
                with self.subTest(kind):
                    make()
                    before = read_bytes(path)
                    with self.assertRaises(sqlite3.DatabaseError) as caught:
                        late.init(root)
                    self.assertTrue(str(caught.exception).startswith(path + ": "),
                                    caught.exception)
                    self.assertEqual(read_bytes(path), before)

    def test_init_without_a_sender_db_makes_nothing(self):
        with tempfile.TemporaryDirectory() as root:
            with self.assertRaises(sqlite3.OperationalError) as caught:
                late.init(root)
            self.assertIn(os.path.join(root, reliability.SENDER), str(caught.exception))
            self.assertEqual(os.listdir(root), [])


class BadInputTest(unittest.TestCase):
    """Bad input raises before anything is asked of reliability or stored."""

    def test_a_tick_that_is_not_one_raises_before_the_acknowledgement_is_applied(self):
        with workspace() as root:
            with opened(root) as db:
                row = reliability.claim(db.sender, 0)
                for now in (-1, 1.5, "3", True, None, reliability.MAX_TICK + 1):
                    with self.subTest(now=now):
                        with self.assertRaises(ValueError):
                            late.acknowledge(db.sender, CALLER, "k1", 1, answer(row), now=now)
                        with self.assertRaises(ValueError):
                            late.deliver(db.sender, root, row, now=now, start=tool)
                        with self.assertRaises(ValueError):
                            late.reconcile(db.sender, db.external, CALLER, "k1", now)
                state = db.sender.execute("SELECT state FROM outbox").fetchone()[0]
                tickets = db.receiver.execute("SELECT count(*) FROM tickets").fetchone()[0]
        self.assertEqual((state, tickets), ("inflight", 0))

    def test_no_late_db_or_another_folders_raises_before_the_acknowledgement_is_applied(self):
        with workspace() as root, workspace() as other:
            with opened(root) as db, opened(other) as elsewhere:
                row = reliability.claim(db.sender, 0)
                with self.assertRaisesRegex(ValueError, "not the late.db beside"):
                    late.acknowledge(db.sender, CALLER, "k1", 1, answer(row), now=1,
                                     late=elsewhere.late)
                with self.assertRaisesRegex(ValueError, "not a connection to a sender.db"):
                    late.acknowledge(db.receiver, CALLER, "k1", 1, answer(row), now=1)
                db.late.close()
                os.remove(os.path.join(root, late.LATE))
                with self.assertRaises(FileNotFoundError) as caught:
                    late.acknowledge(db.sender, CALLER, "k1", 1, answer(row), now=1)
                state = db.sender.execute("SELECT state FROM outbox").fetchone()[0]
        self.assertEqual(caught.exception.filename, os.path.join(root, late.LATE))
        self.assertEqual(state, "inflight")


# --- machinery: workspaces, what the files hold, processes -----------------------------------

@contextlib.contextmanager
def workspace(keys=("k1",), mode="idempotent", late_db=True):
    """A fresh folder: reliability.init(), late.init() unless told not to, and an intent per
    key enqueued at tick 0; removed with all it holds."""
    with tempfile.TemporaryDirectory(prefix="late-") as root:
        reliability.init(root)
        if late_db:
            late.init(root)
        with contextlib.closing(reliability.connect(os.path.join(root, reliability.SENDER))) \
                as sender:
            for key in keys:
                reliability.enqueue(sender, CALLER, key, PAYLOAD, now=0, mode=mode)
        yield root


@contextlib.contextmanager
def opened(root):
    """The folder's databases, open for the block: .sender, .receiver, .external, and .late
    where late.db is there.  Close them before forking a child that opens them."""
    with contextlib.ExitStack() as stack:
        db = types.SimpleNamespace(**{
            name[:-3]: stack.enter_context(contextlib.closing(reliability.connect(
                os.path.join(root, name)))) for name in reliability.KINDS})
        db.late = None
        if os.path.exists(os.path.join(root, late.LATE)):
            db.late = stack.enter_context(contextlib.closing(late.connect(db.sender)))
        yield db


def answer(row, ticket=1):
    """The tool's answer to the row's request, naming ``ticket``."""
    return {"caller": row["caller"], "key": row["key"], "digest": row["digest"],
            "ticket_id": ticket}


def late_entry(row, tick, ticket=1):
    """A late result of attempt 1 as reconcile() shows it."""
    return {"attempt": 1, "response": answer(row, ticket), "arrived_at": tick}


def answer_row(root, key):
    """(caller, key, digest) of a request, as a row."""
    with contextlib.closing(reliability.connect(os.path.join(root, reliability.SENDER))) as sender:
        digest = sender.execute("SELECT digest FROM requests WHERE key = ?", (key,)).fetchone()[0]
    return {"caller": CALLER, "key": key, "digest": digest}


def unknown_rows(fork, root):
    """Every external row of the folder claimed as attempt 1 by a process that has ended, then
    parked unknown by another's claim after the lease: each row as its claim gave it."""
    rows = {}
    while True:
        row = outcome(fork(_claim, root, 0))
        if row is None:
            break
        rows[row["key"]] = row
    assert outcome(fork(_claim, root, 10)) is None
    with contextlib.closing(reliability.connect(os.path.join(root, reliability.SENDER))) as sender:
        assert {state for (state,) in sender.execute("SELECT state FROM outbox")} == {"unknown"}
    return rows


def stored(root):
    """Every row of sender.db, each value as SQLite quotes what it stores: byte for byte."""
    with contextlib.closing(reliability.connect(os.path.join(root, reliability.SENDER))) as sender:
        tables = [name for (name,) in sender.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        rows = {}
        for table in tables:
            columns = [row[1] for row in sender.execute(f'PRAGMA table_info("{table}")')]
            quoted = ", ".join(f'quote("{column}")' for column in columns)
            rows[table] = sorted(sender.execute(f'SELECT {quoted} FROM "{table}"').fetchall())
    return rows


def late_rows(root):
    """late_results as stored: (id, caller, key, attempt, response text, arrived_at)."""
    with contextlib.closing(late._open(os.path.join(root, late.LATE))) as database:
        return database.execute("SELECT * FROM late_results ORDER BY id").fetchall()


def schema(path):
    """What makes a file the kind of database it is: its markers and its schema."""
    with contextlib.closing(sqlite3.connect(path)) as database:
        return ([database.execute(f"PRAGMA {name}").fetchone()[0]
                 for name in ("application_id", "user_version")],
                database.execute("SELECT type, name, sql FROM sqlite_master"
                                 " ORDER BY name").fetchall())


def read_bytes(path):
    with open(path, "rb") as handle:
        return handle.read()


def write_bytes(path, data):
    with open(path, "wb") as handle:
        handle.write(data)


@contextlib.contextmanager
def pipes(count):
    """``count`` pipes, each (read end, write end), closed at the end of the block."""
    made = []
    try:
        for _ in range(count):
            made.append(os.pipe())
        yield made
    finally:
        for descriptor in (end for pair in made for end in pair):
            os.close(descriptor)


def heard(descriptor, sign):
    """Wait for ``sign`` (bytes) on a pipe, failing after SILENCE seconds without a byte;
    how many bytes came."""
    got = b""
    while len(got) < len(sign):
        assert select.select([descriptor], [], [], SILENCE)[0], f"heard {got!r}, not {sign!r}"
        got += os.read(descriptor, len(sign) - len(got))
    assert got == sign, f"heard {got!r}, not {sign!r}"
    return len(got)


@contextlib.contextmanager
def processes():
    """fork(function, *args) for the block: ``function(*args)`` in a forked child, whose JSON
    result outcome() returns.  At the end any child still running is killed, and every one is
    reaped.  Fork only while no SQLite connection of this process is open."""
    children = []

    def fork(function, *args):
        pid, reader = run_experiment.fork_json(function, *args)
        children.append(types.SimpleNamespace(pid=pid, reader=reader, code=None))
        return children[-1]
    try:
        yield fork
    finally:
        for child in children:
            if child.code is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
                os.waitpid(child.pid, 0)
            if child.reader is not None:
                os.close(child.reader)


def outcome(child):
    """A forked child's JSON result, once it has ended (killed after WATCHDOG seconds)."""
    assert select.select([child.reader], [], [], WATCHDOG)[0], f"child {child.pid} hung"
    with os.fdopen(child.reader, encoding="utf-8") as pipe:
        child.reader = None
        text = pipe.read()
    child.code = os.waitstatus_to_exitcode(os.waitpid(child.pid, 0)[1])
    assert child.code == 0, f"child {child.pid} failed with exit {child.code}"
    return json.loads(text)


# A tool child: it reads the request line, answers it as the receiver (receive()) or the
# external tool (external_create_ticket()) does, a Conflict as the refusal deliver() blocks on,
# and prints its answer.  argv: the project root, the tool, its database.
TOOL = """
import contextlib, json, sys
sys.path.insert(0, sys.argv[1])
import reliability
request = json.loads(sys.stdin.buffer.readline())
with contextlib.closing(reliability.connect(sys.argv[3])) as database:
    try:
        if sys.argv[2] == "external":
            reply = reliability.external_create_ticket(database, request["caller"],
                                                       request["key"], request["payload"])
        else:
            reply = reliability.receive(database, request["caller"], request["key"],
                                        request["payload"], issued_at=request["issued_at"],
                                        now=request["now"])
    except reliability.Conflict as error:
        reply = {"error": "conflict", "message": str(error)}
sys.stdout.buffer.write(json.dumps(reply).encode("utf-8") + b"\\n")
"""


def tool(argv):
    """call_tool()'s launcher: TOOL for ``argv`` = [tool, database], on piped stdin and
    stdout."""
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", TOOL, ROOT, argv[0], argv[1]],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _sender(root):
    return contextlib.closing(reliability.connect(os.path.join(root, reliability.SENDER)))


def _claim(root, now):
    with _sender(root) as sender:
        return reliability.claim(sender, now)


def _claim_and_hold(root, now, said, go):
    """Claims, says C, and lives on until told to end."""
    with _sender(root) as sender:
        row = reliability.claim(sender, now)
    os.write(said, b"C")
    os.read(go, 1)
    return row


def _deliver(root, row, now):
    with _sender(root) as sender:
        return late.deliver(sender, root, row, now=now, start=tool)


def _acknowledge(root, key, attempt, response, now):
    with _sender(root) as sender:
        return late.acknowledge(sender, CALLER, key, attempt, response, now=now)


def _acknowledge_at_barrier(root, response, now, ready, go):
    """Opens its files, says R, and acknowledges attempt 1 once told."""
    with _sender(root) as sender, contextlib.closing(late.connect(sender)) as held:
        os.write(ready, b"R")
        os.read(go, 1)
        return late.acknowledge(sender, CALLER, response["key"], 1, response, now=now,
                                late=held)


def _acknowledge_held_at_insert(root, response, now, said, go):
    """Acknowledges attempt 1 late, and inside its record's transaction, just before the
    INSERT, says I and waits until told."""
    def hold(sql):
        if sql.lstrip().upper().startswith("INSERT"):
            os.write(said, b"I")
            os.read(go, 1)
    with _sender(root) as sender, contextlib.closing(late.connect(sender)) as held:
        held.set_trace_callback(hold)
        return late.acknowledge(sender, CALLER, response["key"], 1, response, now=now,
                                late=held)


def _reconcile_saying_begin(root, now, said):
    """Reconciles k1, saying B as it begins a transaction on late.db."""
    def begins(sql):
        if sql.lstrip().upper().startswith("BEGIN"):
            os.write(said, b"B")
    with _sender(root) as sender, contextlib.closing(late.connect(sender)) as held, \
            contextlib.closing(reliability.connect(os.path.join(root, reliability.EXTERNAL))) \
            as external:
        held.set_trace_callback(begins)
        return late.reconcile(sender, external, CALLER, "k1", now, late=held)


def _reconcile_held_before_its_decision(root, now, said, go):
    """Reconciles k1; as reliability begins to commit its decision in sender.db, says S and
    waits until told."""
    def hold(sql):
        if sql.lstrip().upper().startswith("BEGIN"):
            os.write(said, b"S")
            os.read(go, 1)
    with _sender(root) as sender, \
            contextlib.closing(reliability.connect(os.path.join(root, reliability.EXTERNAL))) \
            as external:
        sender.set_trace_callback(hold)
        return late.reconcile(sender, external, CALLER, "k1", now)


def _init_at_barrier(root, ready, go):
    os.write(ready, b"R")
    os.read(go, 1)
    return late.init(root)


if __name__ == "__main__":
    unittest.main()
