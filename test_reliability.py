"""Boundary tests for reliability.py (Agent 可靠执行实战（一）).

Run with ``python3 test_reliability.py`` or ``python3 -X dev -W error -m unittest test_reliability``.
Everything below uses real SQLite files in a fresh temporary directory and, where a
test says so, real child processes.  Only the child *timeout* is simulated with
unittest.mock, because a real one would have to wait for a clock.
"""
import contextlib
import gc
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
import time
import unittest
from unittest import mock

import reliability
import run_experiment
from reliability import (CRASH_EXIT, EXTERNAL, KINDS, LEASE_TICKS, MAX_PAYLOAD_BYTES, RECEIVER, SENDER,
                         Busy, Conflict, CorruptRecord)

HERE = os.path.dirname(os.path.abspath(__file__))
PAYLOAD = {"title": "打印机卡纸", "priority": 2, "tags": ["office", "hardware"]}
OTHER_PAYLOAD = {"title": "打印机卡纸", "priority": 3, "tags": ["office", "hardware"]}


# --- helpers ----------------------------------------------------------------------

TEMPLATE = {}  # the three databases made once by init(), copied per test (no fsyncs per test)


def setUpModule():
    run_experiment.start_shared()  # the experiment runs in its own processes while unit tests run
    TEMPLATE["dir"] = tempfile.TemporaryDirectory()
    reliability.init(TEMPLATE["dir"].name)


def tearDownModule():
    run_experiment.shared_runs()  # waits for it and reaps it, even if no test asked
    TEMPLATE.pop("dir").cleanup()


def load_tests(loader, tests, pattern):
    """The tests that read the shared experiment run go last, so it runs while the others do."""
    late = (ScenarioTest, CrashMatrixTest, ReadmeTest)
    return unittest.TestSuite(sorted(tests, key=lambda suite: any(isinstance(test, late) for test in suite)))


@contextlib.contextmanager
def workspace():
    """A fresh root with the three databases initialised; ws.sender, ws.receiver and ws.external
    are connections opened on first use and closed on exit."""
    with tempfile.TemporaryDirectory() as root, contextlib.ExitStack() as stack:
        for name in KINDS:
            shutil.copyfile(os.path.join(TEMPLATE["dir"].name, name), os.path.join(root, name))
        yield Workspace(root, stack)


class Workspace:
    FILES = {"sender": SENDER, "receiver": RECEIVER, "external": EXTERNAL}

    def __init__(self, root, stack):
        self.root, self._stack = root, stack

    def __getattr__(self, name):  # only called for a connection not opened yet
        if name not in self.FILES:
            raise AttributeError(name)
        connection = reliability.connect(os.path.join(self.root, self.FILES[name]))
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


def counts(ws):
    one = lambda connection, sql: connection.execute(sql).fetchone()[0]
    return {"requests": one(ws.sender, "SELECT count(*) FROM requests"),
            "outbox": one(ws.sender, "SELECT count(*) FROM outbox"),
            "tickets": one(ws.receiver, "SELECT count(*) FROM tickets"),
            "receipts": one(ws.receiver, "SELECT count(*) FROM receipts"),
            "external": one(ws.external, "SELECT count(*) FROM tickets")}


EMPTY = {"requests": 0, "outbox": 0, "tickets": 0, "receipts": 0, "external": 0}


def outbox(ws, caller="agent", key="k1"):
    rows = [row for row in reliability.snapshot(ws.sender)["outbox"] if (row["caller"], row["key"]) == (caller, key)]
    assert len(rows) == 1, rows
    return rows[0]


def rows(connection, table):
    return connection.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()


def file_bytes(path):
    with open(path, "rb") as handle:
        return handle.read()


def write_file(path, data):
    with open(path, "wb") as handle:
        handle.write(data)


GARBAGE = bytes(range(256)) * 16  # deterministic, and not an SQLite header


class Case(unittest.TestCase):
    def assert_integrity(self, ws):
        for name, connection in (("sender", ws.sender), ("receiver", ws.receiver), ("external", ws.external)):
            with self.subTest(database=name):
                self.assertEqual(connection.execute("PRAGMA quick_check").fetchall(), [("ok",)])
                self.assertEqual(connection.execute("PRAGMA foreign_key_check").fetchall(), [])

    def ticket_id_in_receiver(self, ws, caller="agent", key="k1"):
        found = ws.receiver.execute("SELECT ticket_id FROM receipts WHERE caller = ? AND key = ?",
                                    (caller, key)).fetchall()
        self.assertEqual(len(found), 1)
        return found[0][0]


# --- the idempotent receiver ---------------------------------------------------------

class ReceiverTest(Case):
    def test_same_key_same_payload_replays_identical_response_and_creates_no_ticket(self):
        with workspace() as ws:
            first = reliability.receive(ws.receiver, "agent", "k1", PAYLOAD)
            self.assertEqual(first, {"caller": "agent", "key": "k1", "digest": reliability.canonical(PAYLOAD)[1],
                                     "ticket_id": 1})
            self.assertEqual(reliability.receive(ws.receiver, "agent", "k1", PAYLOAD), first)
            # A replay through another connection (as a restarted process would) answers the same.
            with contextlib.closing(reliability.connect(os.path.join(ws.root, RECEIVER))) as again:
                self.assertEqual(reliability.receive(again, "agent", "k1", dict(PAYLOAD)), first)
            self.assertEqual(counts(ws), dict(EMPTY, tickets=1, receipts=1))

    def test_same_key_different_payload_is_rejected_and_ticket_unchanged(self):
        with workspace() as ws:
            first = reliability.receive(ws.receiver, "agent", "k1", {"n": 1})
            tickets, receipts = rows(ws.receiver, "tickets"), rows(ws.receiver, "receipts")
            # {"n": True} and {"n": 1.0} equal {"n": 1} in Python but are other JSON intents.
            for changed in ({"n": 2}, {"n": True}, {"n": 1.0}, {"n": 1, "extra": None}, {}):
                with self.subTest(payload=changed), self.assertRaises(Conflict):
                    reliability.receive(ws.receiver, "agent", "k1", changed)
            self.assertEqual(counts(ws), dict(EMPTY, tickets=1, receipts=1))
            self.assertEqual(rows(ws.receiver, "tickets"), tickets)
            self.assertEqual(rows(ws.receiver, "receipts"), receipts)
            self.assertEqual(reliability.receive(ws.receiver, "agent", "k1", {"n": 1}), first)

    def test_key_is_scoped_by_caller(self):
        with workspace() as ws:
            alice = reliability.receive(ws.receiver, "alice", "k1", PAYLOAD)
            bob = reliability.receive(ws.receiver, "bob", "k1", PAYLOAD)
            self.assertNotEqual(alice["ticket_id"], bob["ticket_id"])
            self.assertEqual(reliability.receive(ws.receiver, "alice", "k1", PAYLOAD), alice)
            self.assertEqual(reliability.receive(ws.receiver, "bob", "k1", PAYLOAD), bob)
            # Scoping also means bob may use the key for another payload without touching alice's.
            self.assertEqual(reliability.receive(ws.receiver, "carol", "k1", OTHER_PAYLOAD)["ticket_id"], 3)
            self.assertEqual(counts(ws), dict(EMPTY, tickets=3, receipts=3))

    def test_same_content_under_new_key_creates_new_ticket(self):
        with workspace() as ws:
            first = reliability.receive(ws.receiver, "agent", "k1", PAYLOAD)
            second = reliability.receive(ws.receiver, "agent", "k2", PAYLOAD)
            self.assertEqual(first["digest"], second["digest"])
            self.assertNotEqual(first["ticket_id"], second["ticket_id"])
            self.assertEqual(counts(ws), dict(EMPTY, tickets=2, receipts=2))

    def test_payload_key_order_does_not_change_digest_or_identity(self):
        one = {"b": [1, {"d": 1, "c": "é"}], "a": 1}
        two = {"a": 1, "b": [1, {"c": "é", "d": 1}]}
        text, digest = reliability.canonical(one)
        self.assertEqual(text, '{"a":1,"b":[1,{"c":"é","d":1}]}')  # sorted, compact, not \u-escaped
        self.assertEqual(digest, hashlib.sha256(text.encode("utf-8")).hexdigest())
        self.assertEqual(reliability.canonical(two), (text, digest))
        self.assertNotEqual(reliability.canonical({"a": 1, "b": [{"c": "é", "d": 1}, 1]})[1], digest)  # list order counts
        with workspace() as ws:
            response = reliability.receive(ws.receiver, "agent", "k1", one)
            self.assertEqual(reliability.receive(ws.receiver, "agent", "k1", two), response)
            self.assertEqual(reliability.enqueue(ws.sender, "agent", "k1", one), "accepted")
            self.assertEqual(reliability.enqueue(ws.sender, "agent", "k1", two), "duplicate")
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1, tickets=1, receipts=1))

    def test_deleting_a_receipt_lets_a_late_replay_create_a_second_ticket(self):
        # The article's retention counterexample: idempotency lasts only as long as the receipt.
        with workspace() as ws:
            first = reliability.receive(ws.receiver, "agent", "k1", PAYLOAD)
            ws.receiver.execute("DELETE FROM receipts WHERE caller = 'agent' AND key = 'k1'")
            late = reliability.receive(ws.receiver, "agent", "k1", PAYLOAD)
            self.assertNotEqual(late["ticket_id"], first["ticket_id"])
            self.assertEqual(counts(ws), dict(EMPTY, tickets=2, receipts=1))


# --- validation before any transaction ----------------------------------------------

BAD_PAYLOADS = {
    "NaN": {"a": float("nan")},
    "Infinity": {"a": float("inf")},
    "-Infinity": {"a": float("-inf")},
    "int dict key": {1: "a"},
    "nested int dict key": {"a": {2: "b"}},
    "bool dict key": {True: "a"},
    "tuple value": {"a": (1, 2)},
    "nested tuple": {"a": [(1,)]},
    "bytes": {"a": b"x"},
    "set": {"a": {1}},
    "list payload": [1, 2],
    "JSON text payload": '{"a": 1}',
    "None payload": None,
    "over-size payload": {"a": "x" * MAX_PAYLOAD_BYTES},
    "over-size in UTF-8 bytes only": {"a": "é" * (MAX_PAYLOAD_BYTES // 2)},
    "lone surrogate value": {"a": "\ud800"},
    "lone surrogate key": {"\udc00": 1},
}
BAD_IDENTITIES = {"empty": "", "over-long": "k" * (reliability.MAX_IDENTITY_LENGTH + 1), "int": 7,
                  "bytes": b"k1", "None": None, "lone surrogate": "k\ud800"}


def writers(ws):
    """Every public function that would store an (identity, payload) pair, one per database."""
    return {"receive": lambda c, k, p: reliability.receive(ws.receiver, c, k, p),
            "enqueue": lambda c, k, p: reliability.enqueue(ws.sender, c, k, p),
            "external_create_ticket": lambda c, k, p: reliability.external_create_ticket(ws.external, c, k, p)}


class ValidationTest(Case):
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

    def test_payload_size_limit_is_inclusive_and_counted_in_utf8_bytes(self):
        filler = MAX_PAYLOAD_BYTES - len('{"a":""}')
        self.assertEqual(len(reliability.canonical({"a": "x" * filler})[0].encode()), MAX_PAYLOAD_BYTES)
        with self.assertRaises(ValueError):
            reliability.canonical({"a": "x" * (filler + 1)})
        with workspace() as ws:
            reliability.receive(ws.receiver, "agent", "k1", {"a": "x" * filler})
            self.assertEqual(counts(ws)["tickets"], 1)

    def test_invalid_identities_are_rejected_with_nothing_stored(self):
        with workspace() as ws:
            for label, bad in BAD_IDENTITIES.items():
                for name, write in writers(ws).items():
                    for position, (caller, key) in (("caller", (bad, "k1")), ("key", ("agent", bad))):
                        with self.subTest(identity=label, position=position, function=name):
                            with self.assertRaises((TypeError, ValueError)):
                                write(caller, key, PAYLOAD)
                            self.assertEqual(counts(ws), EMPTY)

    def test_identity_length_is_counted_in_characters_up_to_the_limit(self):
        longest = "𝄞" * reliability.MAX_IDENTITY_LENGTH  # 4 UTF-8 bytes each, still allowed
        with workspace() as ws:
            reliability.receive(ws.receiver, longest, longest, PAYLOAD)
            self.assertEqual(reliability.enqueue(ws.sender, longest, longest, PAYLOAD), "accepted")
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1, tickets=1, receipts=1))

    def test_unknown_fault_name_raises_value_error_before_anything_is_stored(self):
        with workspace() as ws:
            with self.assertRaises(ValueError):
                reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, fault="after_receiver_comit")
            with self.assertRaises(ValueError):  # a real boundary, but not one that enqueue owns
                reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, fault="after_claim")
            self.assertEqual(counts(ws), EMPTY)
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            with self.assertRaises(ValueError):
                reliability.dispatch(ws.sender, ws.root, 0, fault="no_such_boundary")
            self.assertEqual(outbox(ws)["state"], "pending")  # nothing was claimed
            self.assertEqual(outbox(ws)["attempts"], 0)
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))

    def test_external_tool_and_deliver_reject_unknown_fault_name(self):
        # A misspelt fault must not silently turn a crash experiment into a successful call.
        with workspace() as ws:
            for name, function in (("external_create_ticket", reliability.external_create_ticket),
                                   ("unsafe_receive_without_receipt", reliability.unsafe_receive_without_receipt)):
                database = ws.external if name.startswith("external") else ws.receiver
                with self.subTest(function=name):
                    before = counts(ws)
                    with self.assertRaises(ValueError):
                        function(database, "agent", name, PAYLOAD, fault="after_external_efect")
                    self.assertEqual(counts(ws), before)
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            row = reliability.claim(ws.sender, 0)
            with self.subTest(function="deliver"):
                before = counts(ws)
                with self.assertRaises(ValueError):
                    reliability.deliver(ws.sender, ws.root, row, fault="after_receiver_comit")
                self.assertEqual(outbox(ws)["state"], "inflight")
                self.assertEqual(counts(ws), before)


# --- the durable outbox: enqueue ------------------------------------------------------

class EnqueueTest(Case):
    def test_duplicate_enqueue_adds_nothing(self):
        with workspace() as ws:
            self.assertEqual(reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD), "accepted")
            before = rows(ws.sender, "requests"), rows(ws.sender, "outbox")
            self.assertEqual(reliability.enqueue(ws.sender, "agent", "k1", dict(PAYLOAD)), "duplicate")
            self.assertEqual((rows(ws.sender, "requests"), rows(ws.sender, "outbox")), before)
            # A duplicate of a claimed intent neither resets nor re-queues it.
            reliability.claim(ws.sender, 0)
            self.assertEqual(reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD), "duplicate")
            self.assertEqual((outbox(ws)["state"], outbox(ws)["attempts"]), ("inflight", 1))
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))

    def test_producer_conflict_raises_and_changes_nothing(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            before = rows(ws.sender, "requests"), rows(ws.sender, "outbox")
            for label, payload, mode in (("payload", OTHER_PAYLOAD, "idempotent"), ("mode", PAYLOAD, "external"),
                                         ("both", OTHER_PAYLOAD, "naive")):
                with self.subTest(differs=label), self.assertRaises(Conflict):
                    reliability.enqueue(ws.sender, "agent", "k1", payload, mode=mode)
            self.assertEqual((rows(ws.sender, "requests"), rows(ws.sender, "outbox")), before)
            # The same key under another caller is another intent.
            self.assertEqual(reliability.enqueue(ws.sender, "other", "k1", OTHER_PAYLOAD), "accepted")
            self.assertEqual(counts(ws), dict(EMPTY, requests=2, outbox=2))

    def test_invalid_mode_is_rejected_with_nothing_stored(self):
        with workspace() as ws:
            for mode in ("unsafe", "", "IDEMPOTENT", None, ["idempotent"]):
                with self.subTest(mode=mode), self.assertRaises(ValueError):
                    reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, mode=mode)
            self.assertEqual(counts(ws), EMPTY)


# --- claims, leases and acknowledgements ----------------------------------------------

class ClaimTest(Case):
    def test_unexpired_lease_cannot_be_reclaimed_and_exact_expiry_tick_can(self):
        with workspace() as ws:
            self.assertIsNone(reliability.claim(ws.sender, 0))  # nothing enqueued
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            first = reliability.claim(ws.sender, 0)
            self.assertEqual({k: first[k] for k in ("caller", "key", "attempt", "mode", "payload")},
                             {"caller": "agent", "key": "k1", "attempt": 1, "mode": "idempotent", "payload": PAYLOAD})
            self.assertEqual(outbox(ws)["lease_until"], LEASE_TICKS)
            self.assertIsNone(reliability.claim(ws.sender, LEASE_TICKS - 1))
            self.assertEqual((outbox(ws)["state"], outbox(ws)["attempts"]), ("inflight", 1))
            second = reliability.claim(ws.sender, LEASE_TICKS)
            self.assertEqual(second["attempt"], 2)
            self.assertEqual(outbox(ws)["lease_until"], 2 * LEASE_TICKS)
            self.assertIsNone(reliability.claim(ws.sender, 2 * LEASE_TICKS - 1))

    def test_claim_rejects_a_tick_that_is_not_a_non_negative_int(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            for now in (-1, True, 1.5, "3", None):
                with self.subTest(now=now), self.assertRaises(ValueError):
                    reliability.claim(ws.sender, now)
            self.assertEqual((outbox(ws)["state"], outbox(ws)["attempts"]), ("pending", 0))

    def test_stale_acknowledgement_is_rejected_while_the_current_one_succeeds(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            response = reliability.receive(ws.receiver, "agent", "k1", PAYLOAD)
            self.assertEqual(reliability.claim(ws.sender, 0)["attempt"], 1)
            self.assertEqual(reliability.claim(ws.sender, LEASE_TICKS)["attempt"], 2)
            self.assertIs(reliability.acknowledge(ws.sender, "agent", "k1", 1, response), False)
            self.assertEqual((outbox(ws)["state"], outbox(ws)["response"]), ("inflight", None))
            self.assertIs(reliability.acknowledge(ws.sender, "agent", "k1", 2, response), True)
            self.assertEqual((outbox(ws)["state"], outbox(ws)["attempts"], outbox(ws)["response"]),
                             ("done", 2, response))
            # Once done, not even the current attempt can write again.
            self.assertIs(reliability.acknowledge(ws.sender, "agent", "k1", 2, response), False)

    def test_forged_or_mismatched_responses_raise_and_never_mark_done(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            good = reliability.receive(ws.receiver, "agent", "k1", PAYLOAD)
            attempt = reliability.claim(ws.sender, 0)["attempt"]
            forged = {
                "wrong key": dict(good, key="k2"),
                "wrong caller": dict(good, caller="mallory"),
                "wrong digest": dict(good, digest=reliability.canonical(OTHER_PAYLOAD)[1]),
                "True as ticket_id": dict(good, ticket_id=True),
                "0 as ticket_id": dict(good, ticket_id=0),
                "negative ticket_id": dict(good, ticket_id=-1),
                "float ticket_id": dict(good, ticket_id=1.0),
                "str ticket_id": dict(good, ticket_id="1"),
                "extra field": dict(good, status="ok"),
                "missing field": {k: v for k, v in good.items() if k != "digest"},
                "conflict report": {"error": "conflict", "message": "x"},
                "list": [good],
                "None": None,
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

    def test_expired_inflight_external_row_becomes_unknown_and_is_not_returned(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, mode="external")
            self.assertEqual(reliability.claim(ws.sender, 0)["mode"], "external")
            reliability.enqueue(ws.sender, "agent", "k2", PAYLOAD)  # a safe row queued behind it
            self.assertEqual(reliability.claim(ws.sender, LEASE_TICKS + 1)["key"], "k2")
            external = outbox(ws, key="k1")
            self.assertEqual((external["state"], external["attempts"]), ("unknown", 1))
            # Intent and payload are kept for reconciliation, and it is never handed out again.
            self.assertEqual(ws.sender.execute("SELECT payload FROM requests WHERE key = 'k1'").fetchone()[0],
                             reliability.canonical(PAYLOAD)[0])
            self.assertEqual(reliability.claim(ws.sender, 1000)["key"], "k2")
            self.assertIsNone(reliability.claim(ws.sender, 1000))
            self.assertEqual(outbox(ws, key="k1")["state"], "unknown")


# --- fail closed on corrupt records ----------------------------------------------------

class FailClosedTest(Case):
    def test_corrupted_outbox_payload_is_blocked_and_never_sent(self):
        tampering = {
            "payload replaced": ("payload", json.dumps(OTHER_PAYLOAD)),
            "invalid JSON": ("payload", '{"title": "打印机'),
            "JSON but not an object": ("payload", "[1, 2]"),
            "NaN literal": ("payload", '{"a": NaN}'),
            "digest replaced": ("digest", "0" * 64),
        }
        with workspace() as ws:
            for index, (label, (column, value)) in enumerate(tampering.items()):
                key = f"k{index}"
                with self.subTest(tampering=label):
                    reliability.enqueue(ws.sender, "agent", key, PAYLOAD)
                    ws.sender.execute(f"UPDATE requests SET {column} = ? WHERE key = ?", (value, key))
                    self.assertIsNone(reliability.dispatch(ws.sender, ws.root, 0))  # None: no child was started
                    row = outbox(ws, key=key)
                    self.assertEqual((row["state"], row["attempts"]), ("blocked", 0))
                    self.assertIsNone(reliability.claim(ws.sender, 1000))
            self.assertEqual(counts(ws), dict(EMPTY, requests=5, outbox=5))

    def test_corrupt_row_does_not_hold_back_the_next_healthy_row(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            reliability.enqueue(ws.sender, "agent", "k2", PAYLOAD)
            ws.sender.execute("UPDATE requests SET payload = 'garbage' WHERE key = 'k1'")
            self.assertEqual(reliability.claim(ws.sender, 0)["key"], "k2")
            self.assertEqual(outbox(ws, key="k1")["state"], "blocked")

    def test_corrupt_receipt_makes_receive_raise_and_creates_no_ticket(self):
        # Each variant gets its own key; "other" is a healthy neighbour used as a second ticket.
        tampering = {
            "receipt ticket_id not an int": "UPDATE receipts SET ticket_id = 'one' WHERE key = :key",
            "receipt points at another ticket": "UPDATE receipts SET ticket_id = "
                                                "(SELECT id FROM tickets WHERE key = 'other') WHERE key = :key",
            "ticket caller edited": "UPDATE tickets SET caller = 'mallory' WHERE key = :key",
            "ticket key edited": "UPDATE tickets SET key = 'elsewhere' WHERE key = :key",
            "ticket digest edited": "UPDATE tickets SET digest = 'x' WHERE key = :key",
            "ticket deleted": "DELETE FROM tickets WHERE key = :key",
        }
        with workspace() as ws:
            reliability.receive(ws.receiver, "agent", "other", PAYLOAD)
            for index, (label, sql) in enumerate(tampering.items()):
                key = f"k{index}"
                with self.subTest(tampering=label):
                    reliability.receive(ws.receiver, "agent", key, PAYLOAD)
                    with raw(os.path.join(ws.root, RECEIVER)) as tamper:
                        tamper.execute(sql, {"key": key})
                    before = rows(ws.receiver, "tickets")
                    for _ in range(2):  # and again: the refusal does not wear off
                        with self.assertRaises(CorruptRecord):
                            reliability.receive(ws.receiver, "agent", key, PAYLOAD)
                    self.assertEqual(rows(ws.receiver, "tickets"), before)
            # An edited receipt digest looks like another intent: refused as well, still no ticket.
            reliability.receive(ws.receiver, "agent", "last", PAYLOAD)
            ws.receiver.execute("UPDATE receipts SET digest = 'x' WHERE key = 'last'")
            before = rows(ws.receiver, "tickets")
            with self.assertRaises((Conflict, CorruptRecord)):
                reliability.receive(ws.receiver, "agent", "last", PAYLOAD)
            self.assertEqual(rows(ws.receiver, "tickets"), before)


# --- database files -----------------------------------------------------------------

class DatabaseFileTest(Case):
    def test_connect_on_missing_path_raises_file_not_found_and_creates_nothing(self):
        with tempfile.TemporaryDirectory() as root:
            for path in (os.path.join(root, RECEIVER), os.path.join(root, "missing", RECEIVER)):
                with self.subTest(path=path), self.assertRaises(FileNotFoundError):
                    reliability.connect(path)
            self.assertEqual(os.listdir(root), [])

    def test_garbage_and_empty_files_raise_database_error_and_are_not_modified(self):
        with tempfile.TemporaryDirectory() as root:
            for label, content in (("garbage", GARBAGE), ("0-byte", b"")):
                path = os.path.join(root, label, RECEIVER)
                os.mkdir(os.path.dirname(path))
                write_file(path, content)
                with self.subTest(file=label):
                    with self.assertRaises(sqlite3.DatabaseError):
                        reliability.connect(path)
                    self.assertEqual(file_bytes(path), content)
                    self.assertEqual(os.listdir(os.path.dirname(path)), [RECEIVER])  # no -wal, no -shm

    def test_sqlite_file_that_is_not_ours_is_refused_and_not_modified(self):
        with tempfile.TemporaryDirectory() as root:
            path = os.path.join(root, SENDER)
            with raw(path) as foreign:
                foreign.execute("CREATE TABLE notes (text TEXT)")
                foreign.execute("INSERT INTO notes VALUES ('mine')")
            content = file_bytes(path)
            with self.assertRaises(sqlite3.DatabaseError):
                reliability.connect(path)
            self.assertEqual(file_bytes(path), content)
            self.assertEqual(os.listdir(root), [SENDER])

    def test_init_creates_exactly_three_databases_of_their_own_kind(self):
        with tempfile.TemporaryDirectory() as root:
            reliability.init(root)
            self.assertEqual(sorted(os.listdir(root)), sorted(KINDS))
            for name, kind in KINDS.items():
                with contextlib.closing(reliability.connect(os.path.join(root, name))) as connection:
                    self.assertEqual(connection.execute("PRAGMA user_version").fetchone()[0], kind)

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
                reliability.receive(connection, "agent", "k1", PAYLOAD)
            before = {name: file_bytes(os.path.join(root, name)) for name in sorted(os.listdir(root))}
            with self.assertRaises(FileExistsError):
                reliability.init(root)
            self.assertEqual({name: file_bytes(os.path.join(root, name)) for name in sorted(os.listdir(root))},
                             before)

    def test_every_connection_reports_wal_full_synchronous_and_foreign_keys(self):
        with workspace() as ws:
            for name, connection in ((SENDER, ws.sender), (RECEIVER, ws.receiver), (EXTERNAL, ws.external)):
                with self.subTest(database=name):
                    self.assertEqual(connection.execute("PRAGMA journal_mode").fetchone()[0], "wal")
                    self.assertEqual(connection.execute("PRAGMA synchronous").fetchone()[0], 2)
                    self.assertEqual(connection.execute("PRAGMA foreign_keys").fetchone()[0], 1)
                    self.assertIsNone(connection.isolation_level)
            reliability.receive(ws.receiver, "agent", "k1", PAYLOAD)
            with self.assertRaises(sqlite3.IntegrityError):  # and foreign keys are really enforced
                ws.receiver.execute("DELETE FROM tickets")
            self.assertEqual(counts(ws)["tickets"], 1)

    def test_paths_with_uri_special_characters_open_the_named_file(self):
        with tempfile.TemporaryDirectory() as parent:
            root = os.path.join(parent, "a?mode=ro#b%41 c")
            reliability.init(root)
            with contextlib.closing(reliability.connect(os.path.join(root, RECEIVER))) as connection:
                reliability.receive(connection, "agent", "k1", PAYLOAD)
            with raw(os.path.join(root, RECEIVER)) as check:
                self.assertEqual(check.execute("SELECT count(*) FROM tickets").fetchone()[0], 1)
            self.assertEqual(os.listdir(parent), [os.path.basename(root)])


# --- transactions and contention --------------------------------------------------------

class TransactionTest(Case):
    def test_transaction_commits_on_success(self):
        with workspace() as ws:
            with reliability.transaction(ws.external) as connection:
                self.assertIs(connection, ws.external)
                self.assertTrue(ws.external.in_transaction)
                ws.external.execute("INSERT INTO tickets (caller, key, digest, payload) VALUES ('a', 'b', 'c', '{}')")
            self.assertFalse(ws.external.in_transaction)
            with raw(os.path.join(ws.root, EXTERNAL)) as other:
                self.assertEqual(other.execute("SELECT count(*) FROM tickets").fetchone()[0], 1)

    def test_transaction_rolls_back_on_exception_and_reraises_it(self):
        class Boom(Exception):
            pass
        with workspace() as ws:
            with self.assertRaises(Boom):
                with reliability.transaction(ws.external):
                    ws.external.execute("INSERT INTO tickets (caller, key, digest, payload) VALUES ('a', 'b', 'c', '{}')")
                    raise Boom
            self.assertFalse(ws.external.in_transaction)
            self.assertEqual(counts(ws)["external"], 0)

    def test_writer_queued_past_deadline_raises_busy_and_writes_nothing(self):
        with workspace() as ws, contextlib.closing(reliability.connect(os.path.join(ws.root, RECEIVER))) as holder:
            ran = []
            with reliability.transaction(holder):  # another writer holds the queue, and the lock
                started = time.monotonic()
                with self.assertRaises(Busy) as caught:
                    with reliability.transaction(ws.receiver, deadline=0.02):
                        ran.append(True)
                elapsed = time.monotonic() - started
            self.assertIsInstance(caught.exception, sqlite3.OperationalError)
            self.assertEqual(ran, [])
            self.assertGreaterEqual(elapsed, 0.02)  # it waited for the deadline...
            self.assertLess(elapsed, 2.0)  # ...and not for the default one
            self.assertFalse(ws.receiver.in_transaction)
            # The lock is free again: the same connection writes normally.
            reliability.receive(ws.receiver, "agent", "k1", PAYLOAD)
            self.assertEqual(counts(ws)["tickets"], 1)

    def test_writer_outside_the_queue_past_busy_timeout_raises_busy_and_writes_nothing(self):
        with workspace() as ws, raw(os.path.join(ws.root, RECEIVER)) as foreign:
            foreign.execute("BEGIN IMMEDIATE")
            ws.receiver.execute("PRAGMA busy_timeout = 20")
            with self.assertRaises(Busy):
                reliability.receive(ws.receiver, "agent", "k1", PAYLOAD)
            foreign.execute("ROLLBACK")
            self.assertFalse(ws.receiver.in_transaction)
            self.assertEqual(counts(ws)["tickets"], 0)

    def test_concurrent_processes_store_every_ticket_exactly_once(self):
        with workspace() as ws:
            database = os.path.join(ws.root, RECEIVER)  # not opened here: forked writers must not inherit it
            go_read, go_write = os.pipe()
            workers = []
            try:
                for n in range(4):
                    out_read, out_write = os.pipe()
                    pid = os.fork()
                    if pid == 0:  # a real separate writer process; never returns into the test runner
                        code = 1
                        try:
                            os.close(go_write)
                            os.read(go_read, 1)  # all forked: released together
                            connection = reliability.connect(database)
                            shared = reliability.receive(connection, "agent", "shared", {"n": 0})
                            for i in range(25):
                                reliability.receive(connection, "agent", f"w{n}-{i}", {"i": i})
                            connection.close()
                            os.write(out_write, str(shared["ticket_id"]).encode())
                            code = 0
                        finally:
                            os._exit(code)
                    os.close(out_write)
                    workers.append((pid, out_read))
                started = time.monotonic()
                os.write(go_write, b"gggg")
                results = []
                for pid, out_read in workers:
                    with os.fdopen(out_read) as pipe:
                        output = pipe.read()
                    results.append((output, "", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])))
                workers = []
                elapsed = time.monotonic() - started
            finally:
                os.close(go_read)
                os.close(go_write)
                for pid, out_read in workers:  # only if something above failed
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    os.close(out_read)
            for output, errors, code in results:
                self.assertEqual((code, errors), (0, ""))
            self.assertEqual(len({output for output, _, _ in results}), 1)  # one shared ticket id for all
            self.assertLess(elapsed, 5.0)
            expected = {("agent", "shared")} | {("agent", f"w{n}-{i}") for n in range(4) for i in range(25)}
            for table in ("tickets", "receipts"):
                found = ws.receiver.execute(f"SELECT caller, key FROM {table}").fetchall()
                self.assertEqual(len(found), len(expected))
                self.assertEqual(set(found), expected)
            self.assert_integrity(ws)


# --- dispatch with real child processes ------------------------------------------------

class DispatchTest(Case):
    """The default launcher: a fresh `python3 -I -S reliability.py serve ...` per call.

    Crashes at every boundary are the experiment's job (ScenarioTest, below); these
    prove the path a copied dispatch() takes by default.
    """

    def test_idempotent_happy_path_is_done_after_one_attempt_with_one_ticket(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            result = reliability.dispatch(ws.sender, ws.root, 0)
            self.assertEqual((result["exit_code"], result["acknowledged"], result["attempt"]), (0, True, 1))
            self.assertEqual(result["response"]["ticket_id"], self.ticket_id_in_receiver(ws))
            row = outbox(ws)
            self.assertEqual((row["state"], row["attempts"], row["response"]), ("done", 1, result["response"]))
            self.assertIsNone(reliability.dispatch(ws.sender, ws.root, 1000))  # done is never sent again
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1, tickets=1, receipts=1))

    def test_receiver_conflict_blocks_the_row_and_leaves_the_original_ticket(self):
        with workspace() as ws:
            original = reliability.receive(ws.receiver, "agent", "k1", OTHER_PAYLOAD)
            receipts = rows(ws.receiver, "receipts")
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            result = reliability.dispatch(ws.sender, ws.root, 0)
            self.assertEqual((result["exit_code"], result["acknowledged"]), (0, False))
            self.assertEqual(outbox(ws)["state"], "blocked")
            self.assertIsNone(reliability.claim(ws.sender, 1000))
            self.assertEqual(rows(ws.receiver, "receipts"), receipts)
            self.assertEqual(reliability.receive(ws.receiver, "agent", "k1", OTHER_PAYLOAD), original)
            self.assertEqual(counts(ws)["tickets"], 1)


# --- child timeout (simulated: the only mocked behaviour) ------------------------------

def timed_out_child():
    child = mock.Mock(name="child")
    child.pid = 4194304  # above Linux's pid_max: no process has it
    child.communicate.side_effect = [subprocess.TimeoutExpired(cmd="serve", timeout=0.5), ("", None)]
    return child


class ChildTimeoutTest(Case):
    def assert_killed_and_reaped(self, child):
        names = [entry[0] for entry in child.mock_calls]
        self.assertEqual(names.count("kill"), 1)
        self.assertEqual(child.communicate.call_args_list[0].kwargs.get("timeout"), 0.5)
        self.assertTrue({"communicate", "wait"} & set(names[names.index("kill") + 1:]), names)  # reaped after kill

    def test_child_timeout_is_killed_reaped_and_yields_no_result(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            row = reliability.claim(ws.sender, 0)
            child = timed_out_child()
            with mock.patch("subprocess.Popen", return_value=child) as popen:
                self.assertEqual(reliability.call_tool(ws.root, row, timeout=0.5), (None, None))
            self.assertEqual(popen.call_count, 1)
            self.assertIn("serve", popen.call_args.args[0])
            self.assert_killed_and_reaped(child)

    def test_timeout_through_deliver_makes_external_unknown_and_keeps_idempotent_in_flight(self):
        for mode, state in (("external", "unknown"), ("idempotent", "inflight")):
            with self.subTest(mode=mode), workspace() as ws:
                reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, mode=mode)
                row = reliability.claim(ws.sender, 0)
                child = timed_out_child()
                with mock.patch("subprocess.Popen", return_value=child):
                    result = reliability.deliver(ws.sender, ws.root, row, timeout=0.5)
                self.assertEqual((result["exit_code"], result["response"], result["acknowledged"]),
                                 (None, None, False))
                self.assert_killed_and_reaped(child)
                self.assertEqual((outbox(ws)["state"], outbox(ws)["attempts"]), (state, 1))
                self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))


# --- leaving unknown: reconcile, resolve; receipt retention; version guard; CLI ----------

def unknown_external(ws, key="k1"):
    """A real unknown row: enqueued external at tick 0, claimed at 0 (lease until LEASE_TICKS), and
    delivered through a child that times out, so deliver() itself marks it unknown and clears both pids."""
    reliability.enqueue(ws.sender, "agent", key, PAYLOAD, mode="external")
    row = reliability.claim(ws.sender, 0)
    with mock.patch("subprocess.Popen", return_value=timed_out_child()):
        reliability.deliver(ws.sender, ws.root, row, timeout=0.5)
    assert outbox(ws, key=key)["state"] == "unknown", outbox(ws, key=key)
    return row


def set_pids(ws, owner_pid, tool_pid, key="k1"):
    # Direct UPDATE through raw(): the precise pids a crashed sender and its tool child would leave.
    with raw(os.path.join(ws.root, SENDER)) as tamper:
        tamper.execute("UPDATE outbox SET owner_pid = ?, tool_pid = ? WHERE caller = 'agent' AND key = ?",
                       (owner_pid, tool_pid, key))


def pids(ws, key="k1"):
    return ws.sender.execute("SELECT owner_pid, tool_pid FROM outbox WHERE caller = 'agent' AND key = ?",
                             (key,)).fetchone()


def set_state(ws, state, key="k1"):
    # Direct UPDATE through raw(): a row in exactly this state, however it got there.
    with raw(os.path.join(ws.root, SENDER)) as tamper:
        tamper.execute("UPDATE outbox SET state = ? WHERE caller = 'agent' AND key = ?", (state, key))


def audit(ws):
    return ws.sender.execute("SELECT id, caller, key, attempt, decision, decided_by, reason, evidence"
                             " FROM resolutions ORDER BY id").fetchall()


def sender_rows(ws):
    return rows(ws.sender, "requests"), rows(ws.sender, "outbox"), audit(ws)


class LiveChild:
    """A real child process (`cat`, which reads stdin to its end) that lives until end() closes its
    stdin and reaps it."""

    def __init__(self, test):
        argv = [shutil.which("cat")] if shutil.which("cat") else [sys.executable, "-I", "-S", "-c",
                                                                  "import sys; sys.stdin.read()"]
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        self.pid = self.process.pid
        test.addCleanup(self.end)

    def end(self):
        if self.process.returncode is None:
            self.process.communicate()  # EOF on stdin: it exits, and is reaped (no zombie counts as alive)


class RecordedAttemptTest(Case):
    def test_enqueue_stores_a_valid_issue_tick_refuses_a_bad_one_and_claim_carries_it(self):
        with workspace() as ws:
            for now in (-1, True, 1.5, "3"):
                with self.subTest(now=now), self.assertRaises(ValueError):
                    reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, now=now)
            self.assertEqual(counts(ws), EMPTY)
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, now=7)
            reliability.enqueue(ws.sender, "agent", "k2", PAYLOAD)
            self.assertEqual(ws.sender.execute("SELECT key, issued_at FROM requests ORDER BY key").fetchall(),
                             [("k1", 7), ("k2", 0)])
            row = reliability.claim(ws.sender, 9)
            self.assertEqual((row["key"], row["issued_at"], row["now"]), ("k1", 7, 9))

    def test_deliver_records_tool_pid_before_sending_and_clears_both_when_it_marks_unknown(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, mode="external")
            row = reliability.claim(ws.sender, 0)
            child = timed_out_child()
            seen = []

            def communicate(*args, **kwargs):  # first call: what the database holds while the request is out
                if seen:
                    return "", None  # the reap after kill()
                seen.append(pids(ws))
                raise subprocess.TimeoutExpired(cmd="serve", timeout=0.5)
            child.communicate.side_effect = communicate
            with mock.patch("subprocess.Popen", return_value=child):
                reliability.deliver(ws.sender, ws.root, row, timeout=0.5)
            self.assertEqual(seen, [(os.getpid(), child.pid)])
            self.assertEqual((outbox(ws)["state"], pids(ws)), ("unknown", (None, None)))

    def test_claim_records_its_process_as_owner_and_an_idempotent_delivery_records_no_tool(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            set_pids(ws, 1, 1)  # left over: a claim must replace both
            row = reliability.claim(ws.sender, 0)
            self.assertEqual(pids(ws), (os.getpid(), None))
            with mock.patch("subprocess.Popen", return_value=timed_out_child()):
                reliability.deliver(ws.sender, ws.root, row, timeout=0.5)
            self.assertEqual((outbox(ws)["state"], pids(ws)), ("inflight", (os.getpid(), None)))


class ReconcileTest(Case):
    def test_one_matching_ticket_makes_the_row_done_with_it_and_creates_none(self):
        with workspace() as ws:
            unknown_external(ws)
            ticket = reliability.external_create_ticket(ws.external, "agent", "k1", PAYLOAD)  # the tool did act
            # Settled even inside the lease: the one attempt's effect is already there.
            result = reliability.reconcile(ws.sender, ws.external, "agent", "k1", 0)
            self.assertEqual(result, {"status": "done", "response": ticket})
            self.assertEqual((outbox(ws)["state"], outbox(ws)["response"], outbox(ws)["attempts"]),
                             ("done", ticket, 1))
            self.assertEqual(counts(ws)["external"], 1)
            self.assertIsNone(reliability.claim(ws.sender, 1000))  # done is never sent again

    def test_no_ticket_while_the_lease_has_not_ended_stays_unknown(self):
        with workspace() as ws:
            unknown_external(ws)  # both pids cleared by deliver(): only the lease can still hold it
            before = sender_rows(ws)
            result = reliability.reconcile(ws.sender, ws.external, "agent", "k1", LEASE_TICKS - 1)
            self.assertEqual(result["status"], "unknown")
            self.assertEqual(sender_rows(ws), before)
            # The lease was the only reason: at its last tick the row goes back to pending.
            self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", "k1", LEASE_TICKS)["status"],
                             "pending")

    def test_no_ticket_but_the_claiming_process_still_alive_stays_unknown(self):
        # Built for real: the claim's lease ends and a second claim marks it unknown, keeping the
        # first claimer's pid, this test process, which is still running.
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, mode="external")
            reliability.claim(ws.sender, 0)
            self.assertIsNone(reliability.claim(ws.sender, LEASE_TICKS))
            self.assertEqual((outbox(ws)["state"], pids(ws)), ("unknown", (os.getpid(), None)))
            before = sender_rows(ws)
            result = reliability.reconcile(ws.sender, ws.external, "agent", "k1", 1000)
            self.assertEqual(result["status"], "unknown")
            self.assertEqual(sender_rows(ws), before)
            self.assertEqual(counts(ws)["external"], 0)

    def test_no_ticket_while_a_live_owner_or_tool_process_could_act_stays_unknown_until_it_is_gone(self):
        with workspace() as ws:
            for column in ("owner_pid", "tool_pid"):
                unknown_external(ws, key=column)  # both before any goes back to pending (claim takes the oldest)
            for column in ("owner_pid", "tool_pid"):
                with self.subTest(alive=column):
                    child = LiveChild(self)
                    set_pids(ws, *((child.pid, None) if column == "owner_pid" else (None, child.pid)), key=column)
                    before = sender_rows(ws)
                    self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", column, 1000)["status"],
                                     "unknown")
                    self.assertEqual(sender_rows(ws), before)
                    child.end()  # the same pid, now gone: nothing else changed
                    self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", column, 1000)["status"],
                                     "pending")

    def test_no_ticket_lease_ended_and_processes_gone_returns_to_pending_for_a_retry_under_the_same_key(self):
        with workspace() as ws:
            unknown_external(ws)
            child = LiveChild(self)
            child.end()
            set_pids(ws, child.pid, child.pid)
            result = reliability.reconcile(ws.sender, ws.external, "agent", "k1", LEASE_TICKS)
            self.assertEqual(result["status"], "pending")
            self.assertEqual((outbox(ws)["state"], outbox(ws)["attempts"], pids(ws)), ("pending", 1, (None, None)))
            self.assertEqual(audit(ws), [])
            retry = reliability.claim(ws.sender, LEASE_TICKS)
            self.assertEqual((retry["key"], retry["attempt"], retry["payload"]), ("k1", 2, PAYLOAD))
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))

    def test_tickets_that_do_not_settle_it_leave_the_row_unknown_even_when_nobody_can_act(self):
        cases = {"two tickets": [PAYLOAD, PAYLOAD], "other digest": [OTHER_PAYLOAD]}
        with workspace() as ws:
            for label, payloads in cases.items():
                with self.subTest(label):
                    unknown_external(ws, key=label)  # lease ends at LEASE_TICKS, pids cleared: absence would be proof
                    for payload in payloads:
                        reliability.external_create_ticket(ws.external, "agent", label, payload)
                    before = sender_rows(ws)
                    result = reliability.reconcile(ws.sender, ws.external, "agent", label, 1000)
                    self.assertEqual(result["status"], "unknown")
                    self.assertEqual(sender_rows(ws), before)
            self.assertEqual(counts(ws)["external"], 3)

    def test_lookup_finds_tickets_by_reference_only_so_another_key_or_caller_is_no_evidence(self):
        with workspace() as ws:
            unknown_external(ws)
            reliability.external_create_ticket(ws.external, "agent", "k2", PAYLOAD)
            reliability.external_create_ticket(ws.external, "other", "k1", PAYLOAD)
            self.assertEqual(reliability.lookup_external(ws.external, "agent", "k1"), [])
            self.assertEqual(reliability.reconcile(ws.sender, ws.external, "agent", "k1", 1000)["status"], "pending")
            first = reliability.external_create_ticket(ws.external, "agent", "k3", PAYLOAD)
            second = reliability.external_create_ticket(ws.external, "agent", "k3", OTHER_PAYLOAD)
            self.assertEqual(reliability.lookup_external(ws.external, "agent", "k3"), [first, second])  # oldest first

    def test_a_row_that_is_not_unknown_is_returned_as_is_and_nothing_changes(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, mode="external")
            reliability.external_create_ticket(ws.external, "agent", "k1", PAYLOAD)  # would settle an unknown row
            for state in ("pending", "inflight", "done", "blocked", "abandoned"):
                with self.subTest(state=state):
                    set_state(ws, state)
                    before = sender_rows(ws)
                    result = reliability.reconcile(ws.sender, ws.external, "agent", "k1", 1000)
                    self.assertEqual(result["status"], state)
                    self.assertEqual(sender_rows(ws), before)
            self.assertEqual(counts(ws)["external"], 1)

    def test_unknown_request_or_bad_tick_raises_value_error(self):
        with workspace() as ws:
            with self.assertRaises(ValueError):
                reliability.reconcile(ws.sender, ws.external, "agent", "missing", 1000)
            unknown_external(ws)
            before = sender_rows(ws)
            for now in (-1, True, 1.5, "9"):
                with self.subTest(now=now), self.assertRaises(ValueError):
                    reliability.reconcile(ws.sender, ws.external, "agent", "k1", now)
            self.assertEqual(sender_rows(ws), before)

    def test_alive_counts_a_process_it_may_not_signal_and_only_a_missing_one_as_gone(self):
        self.assertTrue(reliability._alive(os.getpid()))
        self.assertFalse(reliability._alive(4194304))  # above Linux's pid_max
        with mock.patch.object(reliability.os, "kill", side_effect=PermissionError):
            self.assertTrue(reliability._alive(12345))  # another user's process: alive

    def test_reconcile_reports_the_rows_real_state_when_a_person_decided_first(self):
        # reconcile() reads the state before its write transaction: a resolve() landing between
        # the read and the guarded UPDATE must win, and reconcile() must report that state.
        with workspace() as ws:
            unknown_external(ws)
            reliability.external_create_ticket(ws.external, "agent", "k1", PAYLOAD)
            lookup = reliability.lookup_external

            def person_decides_first(tool, caller, key):
                reliability.resolve(ws.sender, caller, key, "abandon", by="alice", why="closed by hand")
                return lookup(tool, caller, key)
            with mock.patch.object(reliability, "lookup_external", person_decides_first):
                result = reliability.reconcile(ws.sender, ws.external, "agent", "k1", 1000)
            self.assertEqual(outbox(ws)["state"], "abandoned")
            self.assertEqual(result["status"], outbox(ws)["state"])


class ResolveTest(Case):
    def evidence(self, ws):
        reliability.external_create_ticket(ws.external, "agent", "k1", PAYLOAD)
        found = reliability.lookup_external(ws.external, "agent", "k1")
        self.assertEqual(len(found), 1)
        return found[0]

    def test_done_with_the_tools_response_stores_it_with_one_audit_row(self):
        with workspace() as ws:
            unknown_external(ws)
            evidence = self.evidence(ws)
            result = reliability.resolve(ws.sender, "agent", "k1", "done", by="alice", why="ticket seen in the UI",
                                         evidence=evidence)
            self.assertEqual(result, {"status": "done", "resolution": 1})
            self.assertEqual((outbox(ws)["state"], outbox(ws)["response"]), ("done", evidence))
            self.assertEqual(audit(ws), [(1, "agent", "k1", 1, "done", "alice", "ticket seen in the UI",
                                          reliability._dumps(evidence))])
            self.assertIsNone(reliability.claim(ws.sender, 1000))
            self.assertEqual(counts(ws)["external"], 1)

    def test_retry_returns_the_row_to_pending_for_the_same_key(self):
        with workspace() as ws:
            unknown_external(ws)
            set_pids(ws, os.getpid(), os.getpid())  # a person may decide while a process lives
            result = reliability.resolve(ws.sender, "agent", "k1", "retry", by="bob", why="tool shows nothing")
            self.assertEqual(result, {"status": "pending", "resolution": 1})
            self.assertEqual((outbox(ws)["state"], outbox(ws)["response"], pids(ws)), ("pending", None, (None, None)))
            self.assertEqual(audit(ws), [(1, "agent", "k1", 1, "retry", "bob", "tool shows nothing", None)])
            self.assertEqual(reliability.claim(ws.sender, 0)["attempt"], 2)

    def test_abandon_parks_an_unknown_or_blocked_row_for_good(self):
        with workspace() as ws:
            unknown_external(ws)
            result = reliability.resolve(ws.sender, "agent", "k1", "abandon", by="carol", why="no longer needed")
            self.assertEqual(result, {"status": "abandoned", "resolution": 1})
            self.assertEqual(outbox(ws)["state"], "abandoned")
            self.assertEqual(audit(ws), [(1, "agent", "k1", 1, "abandon", "carol", "no longer needed", None)])
            self.assertIsNone(reliability.claim(ws.sender, 1000))
            # A blocked row is a person's to decide as well.
            reliability.enqueue(ws.sender, "agent", "k2", PAYLOAD)
            set_state(ws, "blocked", key="k2")
            self.assertEqual(reliability.resolve(ws.sender, "agent", "k2", "abandon", by="dan", why="expired"),
                             {"status": "abandoned", "resolution": 2})
            self.assertEqual(outbox(ws, key="k2")["state"], "abandoned")

    def test_invalid_decisions_are_refused_with_nothing_changed(self):
        with workspace() as ws:
            unknown_external(ws)
            evidence = self.evidence(ws)
            refused = {
                "done without evidence": dict(decision="done"),
                "retry with evidence": dict(decision="retry", evidence=evidence),
                "abandon with evidence": dict(decision="abandon", evidence=evidence),
                "unknown decision": dict(decision="close"),
                "decision in capitals": dict(decision="DONE", evidence=evidence),
                "no decision": dict(decision=None),
                "empty by": dict(decision="abandon", by=""),
                "blank by": dict(decision="abandon", by="   "),
                "by not a str": dict(decision="abandon", by=7),
                "by too long": dict(decision="abandon", by="x" * 1001),
                "empty why": dict(decision="abandon", why=""),
                "why None": dict(decision="abandon", why=None),
                "evidence for another key": dict(decision="done", evidence=dict(evidence, key="k2")),
                "evidence for another caller": dict(decision="done", evidence=dict(evidence, caller="other")),
                "evidence for another payload": dict(decision="done",
                                                     evidence=dict(evidence, digest=reliability.canonical(OTHER_PAYLOAD)[1])),
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
            self.assertEqual(sender_rows(ws), before)

    def test_only_unknown_or_blocked_rows_are_resolved_by_hand(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, mode="external")
            for state in ("pending", "inflight", "done", "abandoned"):
                for decision in ("retry", "abandon"):
                    with self.subTest(state=state, decision=decision):
                        set_state(ws, state)
                        before = sender_rows(ws)
                        with self.assertRaises(ValueError):
                            reliability.resolve(ws.sender, "agent", "k1", decision, by="alice", why="because")
                        self.assertEqual(sender_rows(ws), before)

    def test_the_audit_row_cannot_be_updated_deleted_or_replaced_even_through_a_raw_connection(self):
        # INSERT OR REPLACE deletes the conflicting row without firing DELETE triggers
        # (recursive_triggers is off), so only the BEFORE INSERT trigger on a taken id stops it.
        with workspace() as ws:
            unknown_external(ws)
            reliability.resolve(ws.sender, "agent", "k1", "abandon", by="carol", why="no longer needed")
            recorded = audit(ws)
            with raw(os.path.join(ws.root, SENDER)) as tamper:
                for sql in ("UPDATE resolutions SET reason = 'rewritten'", "UPDATE resolutions SET decision = 'retry'",
                            "DELETE FROM resolutions",
                            "INSERT OR REPLACE INTO resolutions (id, caller, key, attempt, decision, decided_by, reason)"
                            " VALUES (1, 'agent', 'k1', 1, 'retry', 'mallory', 'rewritten')"):
                    with self.subTest(sql), self.assertRaises(sqlite3.IntegrityError):
                        tamper.execute(sql)
            with self.assertRaises(sqlite3.IntegrityError):
                ws.sender.execute("DELETE FROM resolutions")
            self.assertEqual(audit(ws), recorded)


class RetentionTest(Case):
    def receipts(self, ws):
        return ws.receiver.execute("SELECT key, tick FROM receipts ORDER BY key").fetchall()

    def low_water(self, ws):
        return ws.receiver.execute("SELECT low_water FROM retention").fetchone()[0]

    def test_purge_refuses_a_window_that_is_not_a_positive_int_and_deletes_nothing(self):
        with workspace() as ws:
            reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, now=10)
            for window in (0, -1, -50, True, 1.5, "50", None):
                with self.subTest(window=window), self.assertRaises(ValueError):
                    reliability.purge(ws.receiver, 100, window)
            for now in (-1, True, 1.5, "100"):
                with self.subTest(now=now), self.assertRaises(ValueError):
                    reliability.purge(ws.receiver, now, 50)
            self.assertEqual((self.receipts(ws), self.low_water(ws)), ([("k1", 10)], 0))

    def test_purge_deletes_exactly_the_receipts_older_than_the_window_and_sets_the_mark(self):
        with workspace() as ws:
            for key, tick in (("old", 49), ("edge", 50), ("new", 60)):
                reliability.receive(ws.receiver, "agent", key, PAYLOAD, issued_at=40, now=tick)
            self.assertEqual(self.receipts(ws), [("edge", 50), ("new", 60), ("old", 49)])  # written at `now`
            self.assertEqual(reliability.purge(ws.receiver, 100, 50), {"deleted": 1, "low_water": 50})
            self.assertEqual((self.receipts(ws), self.low_water(ws)), ([("edge", 50), ("new", 60)], 50))
            self.assertEqual(counts(ws)["tickets"], 3)  # tickets are the effect: never purged
            # The same mark again is not backwards: allowed, nothing more to delete.
            self.assertEqual(reliability.purge(ws.receiver, 150, 100), {"deleted": 0, "low_water": 50})

    def test_purge_whose_mark_would_move_backwards_is_refused_and_changes_nothing(self):
        with workspace() as ws:
            reliability.purge(ws.receiver, 100, 50)
            # Planted through raw(): no API writes a receipt below the mark, so a wrongly accepted
            # purge to mark 40 would be seen deleting it.
            with raw(os.path.join(ws.root, RECEIVER)) as tamper:
                tamper.execute("INSERT INTO tickets (id, caller, key, digest, payload) VALUES (1, 'agent', 'k1', 'd', '{}')")
                tamper.execute("INSERT INTO receipts VALUES ('agent', 'k1', 'd', 1, 30)")
            for now, window in ((100, 60), (49, 1), (10, 50)):
                with self.subTest(now=now, window=window), self.assertRaises(ValueError):
                    reliability.purge(ws.receiver, now, window)
            self.assertEqual((self.receipts(ws), self.low_water(ws)), ([("k1", 30)], 50))
            self.assertFalse(ws.receiver.in_transaction)

    def test_a_late_request_issued_before_the_mark_without_receipt_is_expired_and_stores_nothing(self):
        with workspace() as ws:
            reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, issued_at=0, now=0)
            reliability.purge(ws.receiver, 100, 50)
            before = rows(ws.receiver, "tickets"), rows(ws.receiver, "receipts")
            for issued_at in (0, 49):
                with self.subTest(issued_at=issued_at), self.assertRaises(reliability.Expired):
                    reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, issued_at=issued_at, now=100)
            with self.assertRaises(reliability.Expired):  # a first arrival issued before the mark, too
                reliability.receive(ws.receiver, "agent", "k2", PAYLOAD, issued_at=49, now=100)
            self.assertEqual((rows(ws.receiver, "tickets"), rows(ws.receiver, "receipts")), before)
            self.assertEqual(counts(ws), dict(EMPTY, tickets=1))

    def test_a_request_issued_at_or_after_the_mark_without_receipt_gets_a_new_ticket(self):
        with workspace() as ws:
            reliability.purge(ws.receiver, 100, 50)
            response = reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, issued_at=50, now=100)
            self.assertEqual(response["ticket_id"], 1)
            self.assertEqual(reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, issued_at=50, now=101), response)
            self.assertEqual(counts(ws), dict(EMPTY, tickets=1, receipts=1))

    def test_a_request_without_issue_tick_is_expired_once_a_purge_has_run(self):
        with workspace() as ws:
            self.assertEqual(reliability.receive(ws.receiver, "agent", "k0", PAYLOAD)["ticket_id"], 1)  # no purge yet
            reliability.purge(ws.receiver, 100, 50)
            with self.assertRaises(reliability.Expired):
                reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, now=100)
            self.assertEqual(counts(ws), dict(EMPTY, tickets=1))

    def test_a_surviving_receipt_still_replays_for_a_request_issued_before_the_mark(self):
        with workspace() as ws:
            first = reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, issued_at=40, now=60)
            reliability.purge(ws.receiver, 100, 50)
            self.assertEqual(reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, issued_at=40, now=100), first)
            self.assertEqual(reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, now=100), first)
            with self.assertRaises(Conflict):  # and still tells another intent apart
                reliability.receive(ws.receiver, "agent", "k1", OTHER_PAYLOAD, issued_at=40, now=100)
            self.assertEqual(counts(ws), dict(EMPTY, tickets=1, receipts=1))

    def test_bad_ticks_raise_value_error_before_anything_is_stored(self):
        with workspace() as ws:
            reliability.purge(ws.receiver, 100, 50)
            reliability.receive(ws.receiver, "agent", "kept", PAYLOAD, issued_at=60, now=60)
            before = rows(ws.receiver, "tickets"), rows(ws.receiver, "receipts")
            bad = {"issued after now": (61, 60), "negative issued_at": (-1, 60), "negative now": (None, -1),
                   "bool issued_at": (True, 60), "bool now": (None, True), "float issued_at": (1.0, 60),
                   "str now": (None, "60")}
            for label, (issued_at, now) in bad.items():
                for key in ("kept", "new"):  # neither replayed nor refused as expired first
                    with self.subTest(label, key=key), self.assertRaises(ValueError):
                        reliability.receive(ws.receiver, "agent", key, PAYLOAD, issued_at=issued_at, now=now)
            self.assertEqual((rows(ws.receiver, "tickets"), rows(ws.receiver, "receipts")), before)
            for issued_at, now in ((None, 0), (0, 0), (5, 5), (4, 5)):
                self.assertIsNone(reliability.check_ticks(issued_at, now))

    def test_a_missing_now_tick_raises_value_error_before_any_transaction(self):
        # Only issued_at may be None: a missing now must be refused before it reaches arithmetic
        # or a NOT NULL column.
        with workspace() as ws:
            unknown_external(ws, key="u1")
            before = counts(ws), sender_rows(ws), self.low_water(ws)
            calls = {"check_ticks": lambda: reliability.check_ticks(None, None),
                     "enqueue": lambda: reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, now=None),
                     "receive": lambda: reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, now=None),
                     "receive issued_at=0": lambda: reliability.receive(ws.receiver, "agent", "k1", PAYLOAD,
                                                                        issued_at=0, now=None),
                     "purge": lambda: reliability.purge(ws.receiver, None, 50),
                     "reconcile": lambda: reliability.reconcile(ws.sender, ws.external, "agent", "u1", None)}
            for label, call in calls.items():
                with self.subTest(label), self.assertRaises(ValueError):
                    call()
            self.assertEqual((counts(ws), sender_rows(ws), self.low_water(ws)), before)

    def test_without_the_policy_deleting_receipts_lets_a_late_replay_create_a_second_ticket(self):
        with workspace() as ws:
            first = reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, issued_at=0, now=0)
            self.assertEqual(reliability.unsafe_delete_receipts(ws.receiver, 50), 1)
            late = reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, issued_at=0, now=100)
            self.assertNotEqual(late["ticket_id"], first["ticket_id"])
            self.assertEqual(counts(ws), dict(EMPTY, tickets=2, receipts=1))

    def test_dispatch_refused_as_expired_blocks_the_row_and_creates_no_ticket(self):
        # Real child through the default launcher.
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, now=0)
            reliability.purge(ws.receiver, 100, 50)
            result = reliability.dispatch(ws.sender, ws.root, 100)
            self.assertEqual((result["exit_code"], result["acknowledged"]), (0, False))
            row = outbox(ws)
            self.assertEqual((row["state"], row["attempts"], row["response"]["error"]), ("blocked", 1, "expired"))
            self.assertEqual(set(row["response"]), {"error", "message"})
            self.assertEqual(result["response"], row["response"])
            self.assertIsNone(reliability.claim(ws.sender, 1000))
            self.assertEqual(counts(ws), dict(EMPTY, requests=1, outbox=1))


class VersionGuardTest(unittest.TestCase):
    def test_wal_reset_bug_knows_the_affected_ranges_and_backports(self):
        expected = {(3, 6, 23): False, (3, 7, 0): True, (3, 40, 1): True, (3, 44, 5): True, (3, 44, 6): False,
                    (3, 44, 9): False, (3, 45, 0): True, (3, 50, 6): True, (3, 50, 7): False, (3, 51, 0): True,
                    (3, 51, 2): True, (3, 51, 3): False, (3, 52, 0): False}
        for version, affected in expected.items():
            with self.subTest(version=version):
                self.assertIs(reliability.wal_reset_bug(version), affected)

    def test_wal_reset_bug_defaults_to_the_linked_sqlite(self):
        self.assertIs(reliability.wal_reset_bug(), reliability.wal_reset_bug(sqlite3.sqlite_version_info))
        for version, affected in (((3, 40, 1), True), ((3, 44, 6), False)):
            with self.subTest(version=version), mock.patch.object(sqlite3, "sqlite_version_info", version):
                self.assertIs(reliability.wal_reset_bug(), affected)


class RecoveryCliTest(Case):
    def run_main(self, *argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = reliability.main(list(argv))
        return code, out.getvalue(), err.getvalue()

    def test_purge_and_resolve_print_one_json_line_and_a_refusal_exits_1(self):
        with workspace() as ws:
            for key, tick in (("old", 10), ("new", 60)):
                reliability.receive(ws.receiver, "agent", key, PAYLOAD, now=tick)
            unknown_external(ws)
            self.assertEqual(self.run_main("purge", ws.root, "--now", "100", "--window", "50"),
                             (0, '{"deleted":1,"low_water":50}\n', ""))
            self.assertEqual(ws.receiver.execute("SELECT key FROM receipts").fetchall(), [("new",)])
            self.assertEqual(self.run_main("resolve", ws.root, "agent", "k1", "abandon", "--by", "x", "--why", "y"),
                             (0, '{"resolution":1,"status":"abandoned"}\n', ""))
            self.assertEqual((outbox(ws)["state"], audit(ws)[0][4:7]), ("abandoned", ("abandon", "x", "y")))
            code, out, err = self.run_main("resolve", ws.root, "agent", "k1", "retry", "--by", "x", "--why", "y")
            self.assertEqual((code, out), (1, ""))
            self.assertEqual(len(err.splitlines()), 1)
            self.assertTrue(err.startswith("reliability.py resolve: "), err)
            self.assertEqual((outbox(ws)["state"], len(audit(ws))), ("abandoned", 1))


# --- experiment scenarios (added by the driver's author) ---
# The article's 16 scenarios run once per test process, each with real children that
# die by os._exit, and every test below reads what that one run observed.

ARTICLE_1 = [name for name, (article, _, _) in run_experiment.SCENARIOS.items() if article == "article_1"]
OPEN_ENDS = [name for name, (article, _, _) in run_experiment.SCENARIOS.items() if article == "open_ends"]
_RUNS = run_experiment.shared_runs  # one run of every scenario per test process


def scenario(name):
    return _RUNS()[name].stages


def figures(stage, *keys):
    return tuple(stage[key] for key in keys)


class ScenarioTest(unittest.TestCase):
    def test_the_driver_names_exactly_the_articles_16_scenarios(self):
        self.assertEqual(ARTICLE_1, [
            "naive_lost_ack", "mark_before_send_loses_task", "idempotent_lost_ack", "before_intent_commit",
            "after_intent_commit", "after_claim", "before_receiver_commit", "after_response_write",
            "after_response_before_ack", "after_ack", "mismatched_payload", "concurrent_claim",
            "concurrent_receiver", "before_external_effect", "after_external_effect", "unsafe_external_retry"])

    def test_every_scenario_holds_its_invariants_and_leaves_sound_databases(self):
        for name in ARTICLE_1 + OPEN_ENDS:
            with self.subTest(name):
                self.assertEqual(_RUNS()[name].failures, [])
                self.assertEqual(sorted(_RUNS()[name].integrity), sorted(KINDS))
                self.assertEqual(set(_RUNS()[name].integrity.values()), {"ok"})

    def test_rerun_reproduces_the_committed_results_json(self):
        with open(run_experiment.RESULTS, encoding="utf-8") as handle:
            committed = json.load(handle)
        observed = run_experiment.results_of(_RUNS().values())
        for group in ("article_1", "open_ends"):
            with self.subTest(group):
                self.assertEqual(run_experiment.differences(committed[group], observed[group]), [])

    def test_unknown_is_left_by_the_tools_records_or_a_person_and_purged_receipts_refuse_late_replays(self):
        stages = {name: scenario(name) for name in OPEN_ENDS}
        final = lambda name, *keys: figures(list(stages[name].values())[-1], *keys)
        self.assertEqual(final("reconcile_found", "sender_state", "attempts", "external_tickets"), ("done", 1, 1))
        self.assertEqual(stages["reconcile_absent"]["after_reconcile"]["reconciled"], ["unknown", "pending"])
        self.assertEqual(final("reconcile_absent", "sender_state", "attempts", "external_tickets"), ("done", 2, 1))
        resolution = stages["manual_resolution"]["after_resolution"]
        self.assertEqual((resolution["decisions"], resolution["audit_rewrite"]), ([["done", "operator", 1]], "refused"))
        self.assertEqual(final("late_replay_after_purge", "sender_state", "receiver_tickets"), ("blocked", 1))
        self.assertEqual(stages["late_replay_after_purge"]["after_late_replay"]["response"]["error"], "expired")
        self.assertEqual(final("late_replay_without_policy", "sender_state", "receiver_tickets"), ("done", 2))

    def test_naive_lost_ack_issues_a_second_ticket_on_recovery(self):
        stages = scenario("naive_lost_ack")
        self.assertEqual(stages["after_lost_ack"]["exit_codes"], [CRASH_EXIT])
        self.assertEqual(figures(stages["after_lost_ack"], "receiver_tickets", "sender_state"), (1, "inflight"))
        self.assertEqual(figures(stages["after_recovery"], "receiver_tickets", "sender_state", "attempts"),
                         (2, "done", 2))

    def test_marking_done_before_sending_loses_the_task_for_good(self):
        stages = scenario("mark_before_send_loses_task")
        self.assertEqual(figures(stages["after_crash"], "sender_state", "receiver_tickets", "exit_codes"),
                         ("done", 0, [CRASH_EXIT]))
        self.assertEqual(figures(stages["after_restart"], "sender_state", "receiver_tickets", "exit_codes"),
                         ("done", 0, []))

    def test_idempotent_lost_ack_replays_the_same_ticket(self):
        stages = scenario("idempotent_lost_ack")
        self.assertEqual(figures(stages["after_lost_ack"], "receiver_tickets", "receiver_receipts"), (1, 1))
        final = stages["after_recovery"]
        self.assertEqual(figures(final, "receiver_tickets", "sender_state", "attempts"), (1, "done", 2))
        self.assertEqual(final["response"]["ticket_id"], 1)

    def test_crash_before_intent_commit_stores_nothing_and_the_retry_delivers_once(self):
        stages = scenario("before_intent_commit")
        self.assertEqual(figures(stages["after_crash"], "sender_state", "intent_rows", "exit_codes"),
                         ("absent", 0, [CRASH_EXIT]))
        self.assertEqual(figures(stages["after_recovery"], "sender_state", "intent_rows", "receiver_tickets"),
                         ("done", 1, 1))

    def test_crash_after_intent_commit_keeps_the_intent_and_the_retry_adds_no_row(self):
        stages = scenario("after_intent_commit")
        self.assertEqual(figures(stages["after_crash"], "sender_state", "intent_rows"), ("pending", 1))
        self.assertEqual(figures(stages["after_recovery"], "intent_rows", "receiver_tickets", "attempts"), (1, 1, 1))

    def test_crash_after_claim_is_retried_only_after_the_lease_ends(self):
        stages = scenario("after_claim")
        self.assertEqual(figures(stages["after_crash"], "sender_state", "attempts"), ("inflight", 1))
        self.assertEqual(figures(stages["before_lease_expiry"], "attempts", "receiver_tickets"), (1, 0))
        self.assertEqual(figures(stages["after_recovery"], "sender_state", "attempts", "receiver_tickets"),
                         ("done", 2, 1))

    def test_receiver_crash_before_commit_leaves_neither_ticket_nor_receipt(self):
        stages = scenario("before_receiver_commit")
        self.assertEqual(figures(stages["after_crash"], "receiver_tickets", "receiver_receipts", "exit_codes"),
                         (0, 0, [CRASH_EXIT]))
        self.assertEqual(figures(stages["after_recovery"], "receiver_tickets", "sender_state"), (1, "done"))

    def test_a_flushed_response_counts_although_the_receiver_then_exits_73(self):
        stages = scenario("after_response_write")
        self.assertEqual(figures(stages["after_crash"], "sender_state", "attempts", "exit_codes"),
                         ("done", 1, [CRASH_EXIT]))
        self.assertEqual(stages["after_restart"]["exit_codes"], [])

    def test_sender_crash_before_recording_the_response_is_healed_by_replay(self):
        stages = scenario("after_response_before_ack")
        self.assertEqual(figures(stages["after_crash"], "sender_state", "receiver_tickets"), ("inflight", 1))
        final = stages["after_recovery"]
        self.assertEqual(figures(final, "sender_state", "receiver_tickets", "attempts"), ("done", 1, 2))
        self.assertEqual(final["response"]["ticket_id"], 1)

    def test_crash_after_ack_sends_nothing_on_restart(self):
        stages = scenario("after_ack")
        self.assertEqual(figures(stages["after_crash"], "sender_state", "receiver_tickets"), ("done", 1))
        self.assertEqual(figures(stages["after_restart"], "attempts", "exit_codes"), (1, []))

    def test_mismatched_payload_under_the_same_key_is_refused_and_the_ticket_unchanged(self):
        stages = scenario("mismatched_payload")
        self.assertEqual(stages["after_mismatch"]["refusal"], "conflict")
        self.assertEqual(figures(stages["after_mismatch"], "receiver_tickets", "receiver_receipts"), (1, 1))
        self.assertEqual(stages["after_mismatch"]["response"], stages["after_delivery"]["response"])

    def test_eight_racing_claimers_produce_one_winner_and_a_stale_ack_is_refused(self):
        stages = scenario("concurrent_claim")
        self.assertEqual(stages["after_race"]["claim_winners"], 1)
        self.assertEqual(stages["after_race"]["exit_codes"], [0] * 8)
        self.assertIs(stages["after_stale_ack"]["stale_ack_accepted"], False)
        self.assertEqual(figures(stages["after_recovery"], "sender_state", "attempts", "receiver_tickets"),
                         ("done", 2, 1))

    def test_eight_racing_receivers_create_one_ticket_and_give_one_answer(self):
        final = scenario("concurrent_receiver")["after_race"]
        self.assertEqual(figures(final, "receiver_tickets", "receiver_receipts", "distinct_responses"), (1, 1, 1))
        self.assertEqual(final["exit_codes"], [0] * 8)

    def test_external_crash_before_the_effect_is_unknown_with_no_ticket_and_no_retry(self):
        stages = scenario("before_external_effect")
        for stage in ("after_crash", "after_restart"):
            self.assertEqual(figures(stages[stage], "sender_state", "attempts", "external_tickets"), ("unknown", 1, 0))

    def test_external_crash_after_the_effect_is_unknown_with_one_ticket_and_no_retry(self):
        stages = scenario("after_external_effect")
        for stage in ("after_crash", "after_restart"):
            self.assertEqual(figures(stages[stage], "sender_state", "attempts", "external_tickets"), ("unknown", 1, 1))

    def test_retrying_an_unknown_external_call_anyway_duplicates_the_ticket(self):
        final = scenario("unsafe_external_retry")["after_unsafe_retry"]
        self.assertEqual(figures(final, "sender_state", "external_tickets"), ("unknown", 2))


class CrashMatrixTest(unittest.TestCase):
    """Every boundary in reliability.BOUNDARIES, crashed for real in every mode that reaches it."""

    def cells(self):
        runs = _RUNS()
        return {boundary: runs[f"reliability/{boundary}"] for boundary in reliability.BOUNDARIES}

    def test_every_boundary_has_a_row_whose_cells_all_crashed_for_real(self):
        for boundary, run in self.cells().items():
            with self.subTest(boundary):
                self.assertEqual(run.failures, [])
                self.assertEqual(list(run.stages), list(run_experiment.matrix_modes(boundary)))
                self.assertEqual({cell["exit_code"] for cell in run.stages.values()}, {CRASH_EXIT})

    def test_idempotent_mode_delivers_exactly_once_whatever_the_boundary(self):
        for boundary, run in self.cells().items():
            if "idempotent" in run.stages:
                cell = run.stages["idempotent"]
                self.assertEqual((boundary, cell["sender_state"], cell["tickets"]), (boundary, "done", 1))

    def test_naive_mode_duplicates_exactly_where_a_committed_ticket_went_unrecorded(self):
        twice = {boundary for boundary, run in self.cells().items() if run.stages.get("naive", {}).get("tickets") == 2}
        self.assertEqual(twice, {"after_receiver_commit", "after_response_before_ack"})

    def test_external_mode_is_never_retried_and_unknown_unless_a_response_was_recorded(self):
        for boundary, run in self.cells().items():
            cell = run.stages.get("external")
            if cell:
                self.assertEqual(cell["attempts"], 1)
                self.assertIn((cell["sender_state"], cell["tickets"]), {("unknown", 0), ("unknown", 1), ("done", 1)})
        self.assertEqual(self.cells()["after_claim"].stages["external"]["sender_state"], "unknown")

    def test_the_matrix_reproduces_results_json(self):
        with open(run_experiment.RESULTS, encoding="utf-8") as handle:
            committed = json.load(handle)["crash_matrix"]
        observed = run_experiment.results_of(_RUNS().values())["crash_matrix"]
        self.assertEqual(run_experiment.differences(
            {k: v for k, v in committed.items() if k.startswith("reliability/")},
            {k: v for k, v in observed.items() if k.startswith("reliability/")}), [])


STRACE = shutil.which("strace")


def strace_works():
    """strace must exist and be allowed to trace (ptrace is often forbidden in containers)."""
    if not STRACE:
        return False
    probe = subprocess.run([STRACE, "-o", os.devnull, "true"], capture_output=True)
    return probe.returncode == 0


@unittest.skipUnless(strace_works(), "needs a working strace to make fdatasync fail for real")
class CommitFailureTest(Case):
    """An error from COMMIT is an unknown outcome: strace fails the commit's fdatasync for real."""

    def test_a_failed_commit_may_or_may_not_survive_and_a_replay_by_key_ends_with_one_ticket(self):
        # The first fdatasync of a fresh WAL syncs its header; the second is the commit.
        variants = {"error survives": "error=EIO:when=2", "then SIGKILL": "error=EIO:signal=SIGKILL:when=2",
                    "disk full": "error=ENOSPC:when=2"}
        request = json.dumps({"caller": "agent", "key": "k1", "payload": PAYLOAD, "now": 0}) + "\n"
        with contextlib.ExitStack() as stack:
            roots, children = {}, {}
            for name, inject in variants.items():
                roots[name] = stack.enter_context(tempfile.TemporaryDirectory())
                for kind in KINDS:
                    shutil.copyfile(os.path.join(TEMPLATE["dir"].name, kind), os.path.join(roots[name], kind))
                database = os.path.join(roots[name], RECEIVER)
                children[name] = subprocess.Popen(
                    [STRACE, "-f", "-o", os.devnull, "-e", "trace=fdatasync", "-e", f"inject=fdatasync:{inject}",
                     "-P", database + "-wal", sys.executable, "-I", "-S", os.path.join(HERE, "reliability.py"),
                     "serve", "receive", database], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
            outcomes = {name: child.communicate(request, timeout=15) + (child.returncode,)
                        for name, child in children.items()}
            for name in ("error survives", "disk full"):
                out, err, code = outcomes[name]
                self.assertEqual((out, code), ("", 1))
                self.assertIn("disk I/O error", err)
            self.assertEqual(outcomes["then SIGKILL"][2], -9)
            # Seen as the same error by the caller, yet one outcome kept the commit: the process
            # that lived rolled back and closed; the one killed left WAL frames that recovery keeps.
            kept = {}
            for name, root in roots.items():
                with contextlib.closing(reliability.connect(os.path.join(root, RECEIVER))) as receiver:
                    kept[name] = reliability.snapshot(receiver)["tickets"]
                    response = reliability.receive(receiver, "agent", "k1", PAYLOAD)
                    self.assertEqual(response["ticket_id"], 1)
                    self.assertEqual(reliability.snapshot(receiver), {"tickets": 1, "receipts": 1})
                    self.assertEqual(receiver.execute("PRAGMA integrity_check").fetchone()[0], "ok")
            self.assertEqual(kept, {"error survives": 0, "then SIGKILL": 1, "disk full": 0})


@unittest.skipUnless(strace_works(), "needs a working strace to fail system calls for real")
class BadEnvironmentTest(Case):
    """A read-only file system or an unwritable queue file gives one clear line, not a traceback."""

    def test_unwritable_wal_or_queue_file_is_a_one_line_error_and_changes_nothing(self):
        with workspace() as ws:
            before = counts(ws)
            database = os.path.join(ws.root, RECEIVER)
            cases = (("-wal", "EROFS", "writable directory"), ("-queue", "EACCES", "Permission denied"))
            children = [subprocess.Popen(
                [STRACE, "-f", "-o", os.devnull, "-e", "trace=openat", "-e", f"inject=openat:error={error}",
                 "-P", database + suffix, sys.executable, "-I", "-S", os.path.join(HERE, "reliability.py"),
                 "purge", ws.root, "--now", "100", "--window", "50"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True) for suffix, error, _ in cases]
            for (suffix, _, says), child in zip(cases, children):
                out, err = child.communicate(timeout=15)
                with self.subTest(suffix):
                    self.assertEqual((child.returncode, out), (1, ""))
                    self.assertEqual(len(err.splitlines()), 1, err)
                    self.assertIn(says, err)
                    self.assertNotIn("Traceback", err)
            self.assertEqual(counts(ws), before)


class ReviewFindingsTest(Case):
    """Guards added after an independent review; each reproduces the finding first."""

    def test_a_late_deliver_sends_nothing_for_an_external_row_that_is_no_longer_its_own(self):
        with workspace() as ws:
            row = unknown_external(ws)  # unknown: deliver() itself gave the attempt up
            for attempt in (row["attempt"], 7):
                with self.subTest(attempt=attempt), mock.patch.object(reliability, "start_child") as start:
                    start.return_value = mock.Mock(pid=4194304, **{"communicate.return_value": ("", None)})
                    result = reliability.deliver(ws.sender, ws.root, dict(row, attempt=attempt))
                    self.assertIn("refused", result)
                    start.return_value.kill.assert_called_once_with()  # killed before any request
                    start.return_value.communicate.assert_called_once_with()
            self.assertEqual((outbox(ws)["state"], counts(ws)["external"]), ("unknown", 0))

    def test_a_fault_the_rows_mode_cannot_reach_is_refused_before_the_call(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            row = reliability.claim(ws.sender, 0)
            with self.assertRaises(ValueError):
                reliability.deliver(ws.sender, ws.root, row, fault="before_external_effect")
            self.assertEqual(counts(ws)["tickets"], 0)

    def test_ticks_past_max_tick_are_refused_before_any_transaction(self):
        with workspace() as ws:
            for call in (lambda: reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD, now=2 ** 63),
                         lambda: reliability.receive(ws.receiver, "agent", "k1", PAYLOAD, now=2 ** 63),
                         lambda: reliability.claim(ws.sender, reliability.MAX_TICK + 1),
                         lambda: reliability.purge(ws.receiver, 2 ** 64, 1)):
                with self.assertRaises(ValueError):
                    call()
            self.assertEqual(counts(ws), EMPTY)

    def test_transaction_does_not_nest_and_the_outer_one_keeps_its_place_in_the_queue(self):
        with workspace() as ws, contextlib.closing(reliability.connect(os.path.join(ws.root, RECEIVER))) as other:
            with reliability.transaction(ws.receiver):
                with self.assertRaises(sqlite3.ProgrammingError):
                    with reliability.transaction(ws.receiver):
                        pass
                with self.assertRaises(Busy):  # the queue is still held by the outer transaction
                    with reliability.transaction(other, deadline=0.02):
                        pass

    @unittest.skipUnless(os.path.isdir("/proc/self/fd"), "counts open descriptors through /proc")
    def test_a_connection_dropped_without_close_releases_its_queue_descriptor(self):
        def queues():
            names = []
            for fd in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError):
                    names.append(os.readlink(f"/proc/self/fd/{fd}"))
            return sum(name.endswith("-queue") for name in names)
        with workspace() as ws:
            before = queues()
            for _ in range(20):
                reliability.connect(os.path.join(ws.root, RECEIVER))  # dropped at once, never closed
            gc.collect()
            self.assertEqual(queues(), before)

    def test_a_payload_nested_too_deeply_is_a_value_error(self):
        deep = []
        for _ in range(100000):
            deep = [deep]
        with self.assertRaises(ValueError):
            reliability.canonical({"x": deep})

    def test_an_idempotent_row_unanswered_max_attempts_times_is_blocked(self):
        with workspace() as ws:
            reliability.enqueue(ws.sender, "agent", "k1", PAYLOAD)
            for attempt in range(1, reliability.MAX_ATTEMPTS + 1):
                self.assertEqual(reliability.claim(ws.sender, attempt * LEASE_TICKS)["attempt"], attempt)
            self.assertIsNone(reliability.claim(ws.sender, 1000))
            self.assertEqual((outbox(ws)["state"], outbox(ws)["attempts"]), ("blocked", reliability.MAX_ATTEMPTS))

    def test_check_compares_json_types_so_one_is_not_true(self):
        self.assertEqual(run_experiment.differences({"a": 0, "b": 2, "c": [1]}, {"a": False, "b": 2.0, "c": [True]}),
                         [("a", 0, False), ("b", 2, 2.0), ("c", [1], [True])])
        self.assertEqual(run_experiment.differences({"a": {"b": 1}}, {"a": {"b": 1}}), [])

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


class TortureTest(unittest.TestCase):
    @unittest.skipUnless(hasattr(os, "fork"), "the torture run forks its workers")
    def test_short_seeded_torture_run_survives_kills_with_no_violation(self):
        # Real SIGKILLs at random moments; the run's files live in a folder we inspect afterwards.
        with tempfile.TemporaryDirectory() as scratch:
            summary = run_experiment.torture(0.2, seed=7, directory=scratch)
            self.assertEqual(os.listdir(scratch), [])
        self.assertEqual(summary["violations"], [])
        self.assertGreaterEqual(summary["kills"], 1)
        self.assertEqual(summary["restarts"], summary["kills"])
        self.assertEqual(set(summary["operations"]), set(run_experiment.TORTURE_WORK))
        for kind, count in summary["operations"].items():
            with self.subTest(kind=kind):
                self.assertGreater(count, 0)


class ReadmeTest(unittest.TestCase):
    def test_readme_tables_name_exactly_the_drivers_scenarios_with_the_figures_it_reproduces(self):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as handle:
            chinese, english = handle.read().split('<a id="english"></a>')
        runs = _RUNS()
        for part in (chinese, english):
            rows = [line.split("|") for line in part.splitlines() if line.startswith("| `")]
            # A scenario row starts with a bare lower-case name (functions have parentheses, files dots).
            tabled = {cells[1].strip().strip("`"): cells for cells in rows
                      if re.fullmatch(r"`[a-z][a-z0-9_]*(/[a-z_]+)?`", cells[1].strip())}
            self.assertEqual(set(tabled), set(run_experiment.SCENARIOS))
            for name, cells in tabled.items():  # the figures are what the driver prints for it today
                with self.subTest(name):
                    self.assertIn(run_experiment.summary(runs[name], "→"), [cell.strip() for cell in cells])

    def test_readme_sample_output_and_timeline_are_what_the_driver_prints_today(self):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as handle:
            readme = handle.read()
        runs = _RUNS()
        sample = re.findall(r"^  ✓ (\S+) +(.+?)  \[(.+)\]$", readme, re.MULTILINE)
        self.assertGreater(len(sample), 3)
        for name, figures, injected in sample:
            with self.subTest(name):
                self.assertEqual((figures, injected), (run_experiment.summary(runs[name], "→"),
                                                       "; ".join(runs[name].injected)))
        timeline = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # a terminal that shows ✓ and →
        with contextlib.redirect_stdout(timeline):
            run_experiment.explain(runs["idempotent_lost_ack"])
        timeline.seek(0)
        self.assertIn(timeline.read(), readme)


class ChildStartTest(unittest.TestCase):
    def test_failed_batch_start_kills_and_reaps_the_children_already_started(self):
        started = [mock.Mock(), mock.Mock(), mock.Mock()]
        with mock.patch.object(run_experiment, "start", side_effect=started + [OSError("no more processes")]):
            with self.assertRaises(OSError):
                run_experiment.start_batch([("reliability.py", "claim", "root", "--now", 0)] * 8)
        for child in started:
            child.kill.assert_called_once_with()
            child.communicate.assert_called_once_with()




if __name__ == "__main__":  # keep last: classes defined below it would not run under `python3 test_reliability.py`
    unittest.main()
