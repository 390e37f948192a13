"""Tests of beyond/service.py against real service processes on 127.0.0.1: every status of
beyond/README.md's tables, conditional requests, what each problem body tells its client, the
crash boundaries, the races, the sender over HTTP, malformed HTTP (smuggling included), a
stalled client, each way of stopping a command, and the walk-through as printed.

Run from the project root: ``python3 -m unittest beyond.test_http``.
"""
import collections
import contextlib
import http.client
import io
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import unittest

# Run as python3 beyond/test_http.py, it finds beyond/ on its path: the modules are one up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import preconditions
import reliability
import test_reliability as article1
from beyond import service

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "beyond", "service.py")
README = os.path.join(ROOT, "beyond", "README.md")
# Seconds: only ends a hung wait, never asserted as a measurement.
WATCHDOG = 60.0
# The plans every workspace starts with, each at revision 1.
RESOURCES = {"A": 10, "B": 0, "C": 5}
PAYLOAD = {"title": "打印机卡纸"}
PLAN = {"src": "A", "dst": "B", "amount": 3, "expected": {"A": 1, "B": 1}}
# The four databases made once, copied per test: no fsyncs per test.
TEMPLATE = {}
FILES = (reliability.SENDER, reliability.RECEIVER, reliability.EXTERNAL, service.PLANS)
# What each problem type tells a client to do next, written here and not read from service.py:
# send the same request again, decide anew under a new key, fix the request, or ask a person.
RETRY = {
    "missing-key": "never", "malformed-key": "never", "malformed-if-match": "never",
    "malformed-if-none-match": "never", "bad-length": "never",
    "bad-transfer-encoding": "never", "malformed-field": "never", "malformed-host": "never",
    "malformed-target": "never", "malformed-request-line": "never", "not-utf8": "never",
    "not-json": "never", "invalid": "never", "not-found": "never",
    "method-not-allowed": "never", "timeout": "same-key", "length-required": "never",
    "too-large": "never", "target-too-long": "never", "unsupported-media-type": "never",
    "key-reused": "person", "key-expired": "person", "if-match-required": "never",
    "precondition-failed": "never", "change-stale": "new-key",
    "change-missing-resource": "new-key", "change-insufficient": "new-key",
    "change-overflow": "new-key", "transfer-stale": "new-key",
    "transfer-missing-resource": "new-key", "transfer-insufficient": "new-key",
    "transfer-overflow": "new-key", "fields-too-large": "never", "corrupt-record": "person",
    "storage": "same-key", "unknown-method": "never", "busy": "same-key",
    "version-not-supported": "never",
}


def setUpModule():
    TEMPLATE["dir"] = tempfile.TemporaryDirectory()
    reliability.init(TEMPLATE["dir"].name)
    preconditions.init(os.path.join(TEMPLATE["dir"].name, service.PLANS), RESOURCES)


def tearDownModule():
    TEMPLATE.pop("dir").cleanup()


# === the statuses of tickets (第一篇 over HTTP) ============================================

class TicketsOverHttp(unittest.TestCase):
    def test_a_new_ticket_and_its_replays_get_the_same_status_and_body_and_replays_say_so(self):
        with workspace() as root, served(root) as server:
            first = post_ticket(server, "t1", PAYLOAD, now=0)
            again = [post_ticket(server, "t1", PAYLOAD, now=now) for now in (3, 40)]
            self.assertEqual(first.status, 201)
            self.assertEqual(json.loads(first.body), {
                "caller": "agent", "key": "t1", "ticket_id": 1,
                "digest": reliability.canonical(PAYLOAD)[1]})
            self.assertEqual(first.headers["location"], "/callers/agent/tickets/1")
            self.assertNotIn("idempotent-replayed", first.headers)
            for replay in again:
                self.assertEqual((replay.status, replay.body), (first.status, first.body))
                self.assertEqual(replay.headers["idempotent-replayed"], "true")
                self.assertEqual(replay.headers["location"], first.headers["location"])
            self.assertEqual(stored(root)["tickets"], 1)

    def test_the_location_names_the_ticket_and_only_its_caller_sees_it(self):
        with workspace() as root, served(root) as server:
            made = post_ticket(server, "t1", PAYLOAD, now=0, caller="机器人/1")
            self.assertEqual(made.headers["location"], "/callers/%E6%9C%BA%E5%99%A8%E4%BA%BA"
                             "%2F1/tickets/1")
            shown = call(server, "GET", made.headers["location"])
            self.assertEqual((shown.status, json.loads(shown.body)), (200, dict(
                json.loads(made.body), payload=PAYLOAD)))
            for path in ("/callers/agent/tickets/1", "/callers/agent/tickets/2",
                         "/callers/agent/tickets/99999999999999999999"):
                with self.subTest(path):
                    missing = call(server, "GET", path)
                    self.assertProblem(missing, 404, "/problems/not-found")

    def test_another_payload_under_the_key_is_422_and_changes_nothing(self):
        with workspace() as root, served(root) as server:
            post_ticket(server, "t1", PAYLOAD, now=0)
            other = post_ticket(server, "t1", {"title": "换了"}, now=1)
            self.assertProblem(other, 422, "/problems/key-reused")
            self.assertEqual(stored(root)["tickets"], 1)
            # The same key under another caller is another request.
            self.assertEqual(post_ticket(server, "t1", {"title": "换了"}, now=1,
                                         caller="other").status, 201)

    def test_a_missing_or_malformed_key_is_400_and_stores_nothing(self):
        fields = {
            "missing": [],
            "not an sf-string": [("Idempotency-Key", "t1")],
            "two fields": [("Idempotency-Key", '"t1"'), ("Idempotency-Key", '"t2"')],
            "with a parameter": [("Idempotency-Key", '"t1";a=1')],
            "empty": [("Idempotency-Key", '""')],
            "over 200 characters": [("Idempotency-Key", '"' + "k" * 201 + '"')],
            "a bad escape": [("Idempotency-Key", r'"a\b"')],
            "not ASCII": [("Idempotency-Key", '"\u00e9"')],
        }
        with workspace() as root, served(root) as server:
            for label, headers in fields.items():
                with self.subTest(label):
                    answer = call(server, "POST", "/callers/agent/tickets",
                                  {"payload": PAYLOAD, "now": 0}, headers)
                    self.assertProblem(answer, 400, "/problems/missing-key" if not headers
                                       else "/problems/malformed-key")
            self.assertEqual(stored(root), EMPTY)
            # An escaped quote and backslash are the key's own characters.
            made = post_ticket(server, 'a"b\\c', PAYLOAD, now=0)
            self.assertEqual(json.loads(made.body)["key"], 'a"b\\c')

    def test_a_late_replay_after_purge_is_422_key_expired(self):
        with workspace() as root, served(root) as server:
            post_ticket(server, "t1", PAYLOAD, now=0)
            with opened(root, reliability.RECEIVER) as receiver:
                reliability.purge(receiver, 100, 50)
            late = post_ticket(server, "t1", PAYLOAD, now=100, issued_at=0)
            self.assertProblem(late, 422, "/problems/key-expired")
            self.assertEqual(stored(root)["tickets"], 1)
            # Issued after the mark, a new key is a new ticket.
            self.assertEqual(post_ticket(server, "t2", PAYLOAD, now=100, issued_at=60).status,
                             201)

    def test_a_receipt_that_disagrees_with_its_ticket_is_500_and_nothing_new_is_done(self):
        with workspace() as root, served(root) as server:
            post_ticket(server, "t1", PAYLOAD, now=0)
            with opened(root, reliability.RECEIVER) as receiver:
                receiver.execute("UPDATE tickets SET payload = '{\"title\":\"x\"}'")
            answer = post_ticket(server, "t1", PAYLOAD, now=1)
            self.assertProblem(answer, 500, "/problems/corrupt-record")
            self.assertEqual(stored(root)["tickets"], 1)

    def test_bad_input_is_400_with_the_articles_reason_and_stores_nothing(self):
        bodies = {
            "a payload that is no object": {"payload": [1], "now": 0},
            "no now": {"payload": PAYLOAD},
            "another member": {"payload": PAYLOAD, "now": 0, "tick": 0},
            "a tick that is a bool": {"payload": PAYLOAD, "now": True},
            "issued after now": {"payload": PAYLOAD, "now": 0, "issued_at": 1},
            "nested too deep": {"payload": json.loads('{"a":' * 40 + "1" + "}" * 40),
                                "now": 0},
            "over the canonical limit": {"payload": {"x": "y" * 70000}, "now": 0},
            "a lone surrogate": {"payload": {"x": "\ud800"}, "now": 0},
        }
        with workspace() as root, served(root) as server:
            for label, body in bodies.items():
                with self.subTest(label):
                    answer = call(server, "POST", "/callers/agent/tickets", body,
                                  [("Idempotency-Key", '"t1"')])
                    self.assertProblem(answer, 400, "/problems/invalid")
            long_caller = call(server, "POST", "/callers/" + "c" * 201 + "/tickets",
                               {"payload": PAYLOAD, "now": 0}, [("Idempotency-Key", '"t1"')])
            self.assertProblem(long_caller, 400, "/problems/invalid")
            not_utf8 = call(server, "POST", "/callers/%FF/tickets",
                            {"payload": PAYLOAD, "now": 0}, [("Idempotency-Key", '"t1"')])
            self.assertProblem(not_utf8, 400, "/problems/invalid")
            self.assertEqual(stored(root), EMPTY)

    def test_a_busy_database_is_503_with_retry_after_and_the_same_request_then_succeeds(self):
        with workspace() as root, served(root, "--busy-timeout", "0.2") as server:
            with opened(root, reliability.RECEIVER) as holder:
                holder.execute("BEGIN IMMEDIATE")
                busy = post_ticket(server, "t1", PAYLOAD, now=0)
                holder.execute("ROLLBACK")
            self.assertProblem(busy, 503, "/problems/busy")
            self.assertEqual(busy.headers["retry-after"], "1")
            self.assertEqual(stored(root), EMPTY)
            again = post_ticket(server, "t1", PAYLOAD, now=0)
            self.assertEqual((again.status, again.headers.get("idempotent-replayed")),
                             (201, None))

    def assertProblem(self, answer, status, kind):
        assert_problem(self, answer, status, kind)


# === the statuses of resources and plans (第七篇 over HTTP) ================================

class ResourcesAndPlansOverHttp(unittest.TestCase):
    def test_each_resources_revision_is_its_strong_etag(self):
        with workspace() as root, served(root) as server:
            shown = call(server, "GET", "/resources/A")
            self.assertEqual((shown.status, shown.headers["etag"], json.loads(shown.body)),
                             (200, '"1"', {"name": "A", "quantity": 10, "revision": 1}))
            change(server, "c1", "A", -1, '"1"', now=1)
            self.assertEqual(call(server, "GET", "/resources/A").headers["etag"], '"2"')
            assert_problem(self, call(server, "GET", "/resources/Z"), 404,
                           "/problems/not-found")

    def test_a_change_without_if_match_is_428_and_with_star_too(self):
        with workspace() as root, served(root) as server:
            for if_match in (None, "*"):
                with self.subTest(if_match=if_match):
                    answer = change(server, "c1", "A", -1, if_match, now=1)
                    assert_problem(self, answer, 428, "/problems/if-match-required")
            self.assertEqual(stored(root)["plan_receipts"], 0)

    def test_a_malformed_if_match_is_400(self):
        with workspace() as root, served(root) as server:
            for if_match in ("1", '"1', 'W/1', '"1" "2"', '*, "1"', ","):
                with self.subTest(if_match=if_match):
                    answer = change(server, "c1", "A", -1, if_match, now=1)
                    assert_problem(self, answer, 400, "/problems/malformed-if-match")
            self.assertEqual(stored(root)["plan_receipts"], 0)

    def test_a_stale_if_match_is_412_stored_and_answered_again_unchanged(self):
        with workspace() as root, served(root) as server:
            change(server, "c1", "A", -1, '"1"', now=1)
            stale = change(server, "c2", "A", 1, '"1"', now=2)
            assert_problem(self, stale, 412, "/problems/change-stale")
            self.assertEqual(json.loads(stale.body)["result"],
                             {"status": "stale", "observed": {"A": 2}})
            # Even where the revision it named came back (by hand, as a restored backup
            # would), the receipt answers first: the stored refusal, unchanged.
            with opened(root, service.PLANS) as plans:
                plans.execute("UPDATE resources SET revision = 1 WHERE name = 'A'")
            again = change(server, "c2", "A", 1, '"1"', now=4)
            self.assertEqual((again.status, again.body), (stale.status, stale.body))
            self.assertEqual(again.headers["idempotent-replayed"], "true")

    def test_a_weak_or_foreign_tag_never_matches_but_a_list_may(self):
        with workspace() as root, served(root) as server:
            for op, if_match in (("w", 'W/"1"'), ("x", '"x1"'), ("two", '"7", W/"1"')):
                with self.subTest(if_match=if_match):
                    assert_problem(self, change(server, op, "A", -1, if_match, now=1), 412,
                                   "/problems/change-stale")
            listed = change(server, "l", "A", -1, '"7", "1"', now=1)
            self.assertEqual((listed.status, json.loads(listed.body)["revision"]), (200, 2))

    def test_a_change_whose_response_was_lost_is_2xx_again_though_its_if_match_is_now_stale(
            self):
        with workspace() as root, served(root) as server:
            first = change(server, "c1", "A", -1, '"1"', now=1)
            self.assertEqual((first.status, json.loads(first.body)), (200, {
                "status": "changed", "name": "A", "quantity": 9, "revision": 2}))
            again = change(server, "c1", "A", -1, '"1"', now=2)
            self.assertEqual((again.status, again.body), (first.status, first.body))
            self.assertEqual(again.headers["idempotent-replayed"], "true")
            self.assertEqual(stored(root)["resources"]["A"], (9, 2))

    def test_the_same_op_with_another_if_match_or_delta_is_422(self):
        with workspace() as root, served(root) as server:
            change(server, "c1", "A", -1, '"1"', now=1)
            for if_match, delta in (('"2"', -1), ('"1"', -2)):
                with self.subTest(if_match=if_match, delta=delta):
                    assert_problem(self, change(server, "c1", "A", delta, if_match, now=2),
                                   422, "/problems/key-reused")
            self.assertEqual(stored(root)["resources"]["A"], (9, 2))

    def test_a_change_of_a_missing_resource_is_404_and_below_zero_or_overflowing_409(self):
        with workspace() as root, served(root) as server:
            missing = change(server, "m", "Z", 1, '"1"', now=1)
            assert_problem(self, missing, 404, "/problems/change-missing-resource")
            below = change(server, "b", "B", -1, '"1"', now=1)
            assert_problem(self, below, 409, "/problems/change-insufficient")
            self.assertEqual(json.loads(below.body)["result"],
                             {"status": "insufficient", "available": 0})
            over = change(server, "o", "A", preconditions.MAX_INT64, '"1"', now=1)
            assert_problem(self, over, 409, "/problems/change-overflow")
            for op, name, delta, answer in (("m", "Z", 1, missing), ("b", "B", -1, below)):
                again = change(server, op, name, delta, '"1"', now=2)
                self.assertEqual((again.status, again.body), (answer.status, answer.body))
            self.assertEqual(stored(root)["plan_receipts"], 3)

    def test_a_transfer_is_200_and_its_replay_200_with_the_same_body_marked_replayed(self):
        with workspace() as root, served(root) as server:
            first = post_transfer(server, "job-1", PLAN, now=0)
            self.assertEqual((first.status, json.loads(first.body)), (200, {
                "status": "applied", "revisions": {"A": 2, "B": 2},
                "quantities": {"A": 7, "B": 3}}))
            again = post_transfer(server, "job-1", PLAN, now=5)
            self.assertEqual((again.status, again.body), (first.status, first.body))
            self.assertEqual(again.headers["idempotent-replayed"], "true")
            self.assertEqual(stored(root)["effects"], 1)

    def test_stale_missing_resource_and_insufficient_plans_are_409_stored_and_answered_again(
            self):
        plans = {
            "stale": ({"src": "A", "dst": "B", "amount": 1, "expected": {"A": 1, "B": 2}},
                      "/problems/transfer-stale", {"status": "stale",
                                                   "observed": {"A": 1, "B": 1}}),
            "missing": ({"src": "A", "dst": "Z", "amount": 1, "expected": {"A": 1, "Z": 1}},
                        "/problems/transfer-missing-resource",
                        {"status": "missing_resource", "missing": ["Z"]}),
            "insufficient": ({"src": "A", "dst": "B", "amount": 11,
                              "expected": {"A": 1, "B": 1}},
                             "/problems/transfer-insufficient",
                             {"status": "insufficient", "available": 10}),
        }
        with workspace() as root, served(root) as server:
            first = {op: post_transfer(server, op, plan, now=0) for op, (plan, _, _) in
                     plans.items()}
            # The present moves on (A has plenty now, at another revision); no refusal does.
            with opened(root, service.PLANS) as db:
                preconditions.change(db, "more", "A", 100, issued_at=1, now=1)
            for op, (plan, kind, result) in plans.items():
                with self.subTest(op):
                    assert_problem(self, first[op], 409, kind)
                    self.assertEqual(json.loads(first[op].body)["result"], result)
                    again = post_transfer(server, op, plan, now=2)
                    self.assertEqual((again.status, again.body),
                                     (first[op].status, first[op].body))
                    self.assertEqual(again.headers["idempotent-replayed"], "true")
            self.assertEqual(stored(root)["effects"], 0)

    def test_an_overflowing_transfer_is_409(self):
        with workspace() as root, served(root) as server:
            with opened(root, service.PLANS) as db:
                db.execute("UPDATE resources SET quantity = ? WHERE name = 'B'",
                           (preconditions.MAX_INT64,))
            answer = post_transfer(server, "o", PLAN, now=0)
            assert_problem(self, answer, 409, "/problems/transfer-overflow")

    def test_the_same_op_with_another_plan_is_422_and_one_issued_before_the_mark_422_expired(
            self):
        with workspace() as root, served(root) as server:
            post_transfer(server, "job-1", PLAN, now=0)
            replanned = dict(PLAN, expected={"A": 2, "B": 2})
            assert_problem(self, post_transfer(server, "job-1", replanned, now=1), 422,
                           "/problems/key-reused")
            with opened(root, service.PLANS) as db:
                preconditions.purge(db, 100, 50)
            late = post_transfer(server, "job-2", replanned, now=100, issued_at=10)
            assert_problem(self, late, 422, "/problems/key-expired")
            late_change = change(server, "c9", "A", 1, '"2"', now=100, issued_at=10)
            assert_problem(self, late_change, 422, "/problems/key-expired")
            self.assertEqual(stored(root)["effects"], 1)

    def test_ops_are_one_namespace_for_every_caller_and_route(self):
        with workspace() as root, served(root) as server:
            self.assertEqual(change(server, "x", "A", -1, '"1"', now=1).status, 200)
            # The same op as a transfer is another command under that op: 422, nothing done.
            assert_problem(self, post_transfer(server, "x", dict(PLAN, expected={
                "A": 2, "B": 1}), now=2), 422, "/problems/key-reused", operation={"op": "x"})
            self.assertEqual(stored(root)["effects"], 0)

    def test_a_plan_the_article_refuses_is_400_before_anything_is_decided(self):
        with workspace() as root, served(root) as server:
            for label, plan in (("src is dst", dict(PLAN, dst="A", expected={"A": 1})),
                                ("amount 0", dict(PLAN, amount=0)),
                                ("a bool", dict(PLAN, amount=True)),
                                ("another key", dict(PLAN, note="x"))):
                with self.subTest(label):
                    assert_problem(self, post_transfer(server, "job-1", plan, now=0), 400,
                                   "/problems/invalid")
            over = post_transfer(server, "o" * 129, PLAN, now=0)
            assert_problem(self, over, 400, "/problems/malformed-key")
            self.assertEqual(stored(root)["plan_receipts"], 0)


# === conditional requests: If-Match, then If-None-Match (RFC 9110 §13.2.2) ================

class ConditionalRequests(unittest.TestCase):
    def test_a_get_whose_if_match_names_no_current_revision_is_412_and_one_that_does_200(self):
        with workspace() as root, served(root) as server:
            for if_match in ('"99"', 'W/"1"', '"x1"'):
                with self.subTest(if_match=if_match):
                    answer = call(server, "GET", "/resources/A",
                                  headers=[("If-Match", if_match)])
                    assert_problem(self, answer, 412, "/problems/precondition-failed")
            for if_match in ('"7", "1"', "*"):
                with self.subTest(if_match=if_match):
                    answer = call(server, "GET", "/resources/A",
                                  headers=[("If-Match", if_match)])
                    self.assertEqual((answer.status, answer.headers["etag"]), (200, '"1"'))
            # Without its conditions it would be 404, and so it is (RFC 9110 §13.2.1).
            missing = call(server, "GET", "/resources/Z", headers=[("If-Match", '"1"')])
            assert_problem(self, missing, 404, "/problems/not-found")
            # No modification date is kept: the date conditions are ignored (§13.1.3-§13.1.4).
            dates = [("If-Unmodified-Since", "Thu, 01 Jan 1970 00:00:00 GMT"),
                     ("If-Modified-Since", "Fri, 31 Dec 9999 23:59:59 GMT")]
            self.assertEqual(call(server, "GET", "/resources/A", headers=dates).status, 200)

    def test_a_get_whose_if_none_match_names_the_current_revision_is_304_without_a_body(self):
        with workspace() as root, served(root) as server:
            # The weak comparison: W/"1" names revision 1 too.
            for if_none_match in ('"1"', 'W/"1"', '"5", "1"', "*"):
                with self.subTest(if_none_match=if_none_match):
                    answer = call(server, "GET", "/resources/A",
                                  headers=[("If-None-Match", if_none_match)])
                    self.assertEqual((answer.status, answer.headers["etag"], answer.body),
                                     (304, '"1"', b""))
                    self.assertNotIn("content-length", answer.headers)
            moved = call(server, "GET", "/resources/A", headers=[("If-None-Match", '"2"')])
            self.assertEqual((moved.status, json.loads(moved.body)["revision"]), (200, 1))
            # If-Match first: false, it is 412 whatever If-None-Match says; true, If-None-Match
            # decides.
            both = [("If-Match", '"99"'), ("If-None-Match", '"1"')]
            assert_problem(self, call(server, "GET", "/resources/A", headers=both), 412,
                           "/problems/precondition-failed")
            both = [("If-Match", '"1"'), ("If-None-Match", '"1"')]
            self.assertEqual(call(server, "GET", "/resources/A", headers=both).status, 304)

    def test_a_change_with_if_none_match_star_or_the_current_revision_is_412_stored(self):
        with workspace() as root, served(root) as server:
            star = change(server, "n1", "A", -1, None, now=1, if_none_match="*")
            assert_problem(self, star, 412, "/problems/change-stale")
            self.assertEqual(json.loads(star.body)["result"],
                             {"status": "stale", "observed": {"A": 1}})
            again = change(server, "n1", "A", -1, None, now=2, if_none_match="*")
            self.assertEqual((again.status, again.body), (star.status, star.body))
            self.assertEqual(again.headers["idempotent-replayed"], "true")
            for op, if_none_match in (("n2", "*"), ("n3", 'W/"1"'), ("n4", '"3", "1"')):
                with self.subTest(if_none_match=if_none_match):
                    answer = change(server, op, "A", -1, '"1"', now=1,
                                    if_none_match=if_none_match)
                    assert_problem(self, answer, 412, "/problems/change-stale")
            self.assertEqual(stored(root)["resources"]["A"], (10, 1))
            # Without a resource it is 404, as it would be without the condition.
            missing = change(server, "n5", "Z", 1, None, now=1, if_none_match="*")
            assert_problem(self, missing, 404, "/problems/change-missing-resource")
            # If-None-Match naming another revision leaves If-Match to decide.
            done = change(server, "n6", "A", -1, '"1"', now=1, if_none_match='"2"')
            self.assertEqual((done.status, json.loads(done.body)["revision"]), (200, 2))
            # A tag alone names no revision the change was planned on.
            alone = change(server, "n7", "A", -1, None, now=1, if_none_match='"5"')
            assert_problem(self, alone, 428, "/problems/if-match-required")
            self.assertEqual(stored(root)["resources"]["A"], (9, 2))

    def test_a_target_without_an_etag_matches_no_tag_and_star_only_where_it_exists(self):
        with workspace() as root, served(root) as server:
            # /transfers and /callers/C/tickets have no representation (GET is 405).
            for field, value in (("If-Match", '"1"'), ("If-Match", "*")):
                with self.subTest(field=field, value=value):
                    answer = call(server, "POST", "/transfers", {"plan": PLAN, "now": 0},
                                  [("Idempotency-Key", '"job-1"'), (field, value)])
                    assert_problem(self, answer, 412, "/problems/precondition-failed")
                    ticket = call(server, "POST", "/callers/agent/tickets",
                                  {"payload": PAYLOAD, "now": 0},
                                  [("Idempotency-Key", '"t1"'), (field, value)])
                    assert_problem(self, ticket, 412, "/problems/precondition-failed")
            self.assertEqual(stored(root), EMPTY)
            applied = call(server, "POST", "/transfers", {"plan": PLAN, "now": 0},
                           [("Idempotency-Key", '"job-1"'), ("If-None-Match", "*")])
            self.assertEqual(applied.status, 200)
            made = call(server, "POST", "/callers/agent/tickets", {"payload": PAYLOAD, "now": 0},
                        [("Idempotency-Key", '"t1"'), ("If-None-Match", '"1"')])
            self.assertEqual(made.status, 201)
            # A ticket is a representation without an entity tag.
            ticket = made.headers["location"]
            assert_problem(self, call(server, "GET", ticket, headers=[("If-Match", '"1"')]),
                           412, "/problems/precondition-failed")
            self.assertEqual(call(server, "GET", ticket, headers=[("If-Match", "*")]).status,
                             200)
            self.assertEqual(call(server, "GET", ticket,
                                  headers=[("If-None-Match", "*")]).status, 304)
            self.assertEqual(call(server, "GET", ticket,
                                  headers=[("If-None-Match", '"1"')]).status, 200)

    def test_conditions_are_evaluated_after_every_other_check_and_never_before_a_404(self):
        with workspace() as root, served(root) as server:
            # A false condition on a request that is refused anyway: its refusal comes first.
            for label, answer, status, kind in (
                    ("a plan the article refuses", call(
                        server, "POST", "/transfers", {"plan": dict(PLAN, amount=0), "now": 0},
                        [("Idempotency-Key", '"job-1"'), ("If-Match", '"1"')]), 400, "invalid"),
                    ("a body that is no JSON", call(
                        server, "POST", "/callers/agent/tickets", None,
                        [("Idempotency-Key", '"t1"'), ("If-Match", '"1"'),
                         ("Content-Type", "application/json")], b"{"), 400, "not-json"),
                    ("a change whose delta is no int", call(
                        server, "PATCH", "/resources/A", {"delta": "1", "now": 1},
                        [("Idempotency-Key", '"c2"'), ("If-Match", '"99"')]), 400, "invalid"),
                    ("a missing resource, on a GET", call(
                        server, "GET", "/resources/Z", headers=[("If-None-Match", "*")]),
                     404, "not-found"),
                    ("a missing ticket", call(server, "GET", "/callers/agent/tickets/1",
                                              headers=[("If-Match", '"1"')]),
                     404, "not-found")):
                with self.subTest(label):
                    assert_problem(self, answer, status, f"/problems/{kind}")
            self.assertEqual(stored(root)["resources"], EMPTY["resources"])

    def test_a_malformed_if_none_match_is_400(self):
        with workspace() as root, served(root) as server:
            for value in ("1", '"1', '*, "1"', ","):
                with self.subTest(value=value):
                    shown = call(server, "GET", "/resources/A",
                                 headers=[("If-None-Match", value)])
                    assert_problem(self, shown, 400, "/problems/malformed-if-none-match")
                    changed = change(server, "c1", "A", -1, '"1"', now=1, if_none_match=value)
                    assert_problem(self, changed, 400, "/problems/malformed-if-none-match")
            self.assertEqual(stored(root)["plan_receipts"], 0)


# === what a problem tells its client: retry and operation (RFC 9457 §3.2) ================

class WhatAProblemSays(unittest.TestCase):
    def test_each_problem_type_says_what_the_client_may_do_next(self):
        self.assertEqual(set(service.PROBLEMS), set(RETRY))
        with workspace() as root, served(root) as server:
            for name in RETRY:
                with self.subTest(name):
                    shown = json.loads(call(server, "GET", f"/problems/{name}").body)
                    self.assertEqual(shown["retry"], RETRY[name])
            # And the bodies say it: fix the request, decide anew, ask a person.
            plan = dict(PLAN, expected={"A": 1, "B": 2})
            for answer, status, name in (
                    (call(server, "POST", "/transfers", {"plan": PLAN, "now": 0}), 400,
                     "missing-key"),
                    (post_transfer(server, "job-1", plan, now=0), 409, "transfer-stale"),
                    (post_transfer(server, "job-1", PLAN, now=0), 422, "key-reused")):
                with self.subTest(body=name):
                    self.assertEqual((answer.status, json.loads(answer.body)["retry"]),
                                     (status, RETRY[name]))
        # What the sender blocks for a person is what the service says a person must decide.
        self.assertEqual({name for name, retry in RETRY.items() if retry == "person"},
                         {"key-reused", "key-expired", "corrupt-record"})

    def test_a_problem_names_the_operation_its_request_named(self):
        with workspace() as root, served(root) as server:
            post_ticket(server, "t1", PAYLOAD, now=0, caller="机器人")
            reused = post_ticket(server, "t1", {"title": "换了"}, now=1, caller="机器人")
            assert_problem(self, reused, 422, "/problems/key-reused",
                           operation={"caller": "机器人", "key": "t1"})
            change(server, "c1", "A", -1, '"1"', now=1)
            stale = change(server, "c2", "A", 1, '"1"', now=2)
            assert_problem(self, stale, 412, "/problems/change-stale", operation={"op": "c2"})
            plan = dict(PLAN, expected={"A": 1, "B": 2})
            refused = post_transfer(server, "job-1", plan, now=0)
            assert_problem(self, refused, 409, "/problems/transfer-stale",
                           operation={"op": "job-1"})
            self.assertEqual(post_transfer(server, "job-1", plan, now=1).body, refused.body)
            # Named before the body was read: an unsupported body still names its operation.
            text = call(server, "POST", "/callers/agent/tickets", None,
                        [("Idempotency-Key", '"t2"'), ("Content-Type", "text/plain")], b"{}")
            assert_problem(self, text, 415, "/problems/unsupported-media-type",
                           operation={"caller": "agent", "key": "t2"})
            # Where the request named none, or none that can be read, there is none.
            for answer, status, kind in (
                    (call(server, "POST", "/transfers", {"plan": PLAN, "now": 0}), 400,
                     "/problems/missing-key"),
                    (call(server, "POST", "/transfers", {"plan": PLAN, "now": 0},
                          [("Idempotency-Key", "job-2")]), 400, "/problems/malformed-key"),
                    (call(server, "GET", "/resources/Z"), 404, "/problems/not-found")):
                with self.subTest(kind):
                    assert_problem(self, answer, status, kind, operation=None)


# === malformed HTTP, on a raw socket ========================================================

class MalformedHttp(unittest.TestCase):
    def test_each_malformed_request_gets_its_one_documented_status_and_stores_nothing(self):
        body = b'{"payload": {"title": "x"}, "now": 0}'
        key = b'Idempotency-Key: "t1"\r\n'
        json_type = b"Content-Type: application/json\r\n"
        cases = {
            "no Content-Length": (key + json_type, b"", 411, "/problems/length-required",
                                  False),
            "chunked": (key + json_type + b"Transfer-Encoding: chunked\r\n",
                        b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body), 411,
                        "/problems/length-required", True),
            "gzip, then chunked": (key + json_type + b"Transfer-Encoding: gzip, chunked\r\n",
                                   b"0\r\n\r\n", 411, "/problems/length-required", True),
            "gzip": (key + json_type + b"Transfer-Encoding: gzip\r\nContent-Length: %d\r\n"
                     % len(body), body, 400, "/problems/bad-transfer-encoding", True),
            "chunked, then gzip": (key + json_type + b"Transfer-Encoding: chunked\r\n"
                                   b"Transfer-Encoding: gzip\r\n", body, 400,
                                   "/problems/bad-transfer-encoding", True),
            "a Content-Length that is no number": (
                key + json_type + b"Content-Length: 3x\r\n", body, 400,
                "/problems/bad-length", True),
            "a negative Content-Length": (key + json_type + b"Content-Length: -1\r\n", body,
                                          400, "/problems/bad-length", True),
            "two Content-Lengths": (
                key + json_type + b"Content-Length: %d\r\nContent-Length: %d\r\n"
                % (len(body), len(body)), body, 400, "/problems/bad-length", True),
            "a Content-Length of 5000 digits": (
                key + json_type + b"Content-Length: " + b"9" * 5000 + b"\r\n", b"", 413,
                "/problems/too-large", True),
            "a body over the limit": (
                key + json_type + b"Content-Length: %d\r\n" % (service.MAX_BODY_BYTES + 1),
                b"", 413, "/problems/too-large", True),
            "no content type": (key + b"Content-Length: %d\r\n" % len(body), body, 415,
                                "/problems/unsupported-media-type", False),
            "text/plain": (key + b"Content-Type: text/plain\r\nContent-Length: %d\r\n"
                           % len(body), body, 415, "/problems/unsupported-media-type", False),
            "latin-1": (key + b"Content-Type: application/json; charset=latin-1\r\n"
                        b"Content-Length: %d\r\n" % len(body), body, 415,
                        "/problems/unsupported-media-type", False),
        }
        for label, content, kind in (
                ("not UTF-8", b'{"payload": {"x": "\xff"}, "now": 0}', "not-utf8"),
                ("not JSON", b"{payload: 1}", "not-json"),
                ("a repeated member", b'{"payload": {}, "now": 0, "now": 0}', "not-json"),
                ("NaN", b'{"payload": {"x": NaN}, "now": 0}', "not-json"),
                ("not an object", b"[]", "invalid")):
            cases[label] = (key + json_type + b"Content-Length: %d\r\n" % len(content),
                            content, 400, f"/problems/{kind}", False)
        with workspace() as root, served(root) as server:
            for label, (fields, content, status, kind, closes) in cases.items():
                with self.subTest(label):
                    answer, closed = raw(server, b"POST /callers/agent/tickets HTTP/1.1\r\n"
                                         b"Host: x\r\n" + fields + b"\r\n" + content)
                    assert_problem(self, answer, status, kind)
                    self.assertEqual(answer.headers.get("connection") == "close", closes)
                    self.assertEqual(closed, closes)
            self.assertEqual(stored(root), EMPTY)

    def test_white_space_before_a_colon_is_400_and_closes_so_no_body_is_read_as_a_request(
            self):
        smuggled = json.dumps({"payload": PAYLOAD, "now": 0}).encode("utf-8")
        inner = (b"POST /callers/agent/tickets HTTP/1.1\r\nHost: x\r\n"
                 b'Idempotency-Key: "smuggled"\r\nContent-Type: application/json\r\n'
                 b"Content-Length: %d\r\n\r\n%s" % (len(smuggled), smuggled))
        outer = (b"POST /callers/agent/tickets HTTP/1.1\r\nHost: x\r\nX-Pad : 1\r\n"
                 b'Idempotency-Key: "t1"\r\nContent-Type: application/json\r\n'
                 b"Content-Length: %d\r\n\r\n%s" % (len(inner), inner))
        with workspace() as root, served(root) as server:
            answers = exchange(server, outer)
            self.assertEqual([answer.status for answer in answers], [400])
            assert_problem(self, answers[0], 400, "/problems/malformed-field")
            self.assertEqual(answers[0].headers["connection"], "close")
            self.assertEqual(stored(root), EMPTY)

    def test_a_field_line_that_is_not_name_colon_value_is_400_and_closes(self):
        lines = {
            "white space before the colon": b"Content-Type : application/json\r\n",
            "a tab before the colon": b"X-Pad\t: 1\r\n",
            "a folded line": b"X-Pad: 1\r\n 2\r\n",
            "no colon": b"X-Pad\r\n",
            "an empty name": b": 1\r\n",
            "a name that is no token": b"X(Pad): 1\r\n",
            "a bare CR": b"X-Pad: 1\r2\r\n",
            "a NUL": b"X-Pad: 1\x002\r\n",
        }
        with workspace() as root, served(root) as server:
            for label, line in lines.items():
                with self.subTest(label):
                    answer, closed = raw(server, b"GET /resources/A HTTP/1.1\r\nHost: x\r\n"
                                         + line + b"\r\n")
                    assert_problem(self, answer, 400, "/problems/malformed-field")
                    self.assertTrue(closed)
            first = b"GET /resources/A HTTP/1.1\r\n Host: x\r\nHost: x\r\n\r\n"
            answer, closed = raw(server, first)
            assert_problem(self, answer, 400, "/problems/malformed-field")
            # Obsolete text in a value is a value still (RFC 9110 §5.5).
            shown, _ = raw(server, b"GET /resources/A HTTP/1.1\r\nHost: x\r\nX: \xe9\r\n\r\n")
            self.assertEqual(shown.status, 200)

    def test_no_host_two_hosts_or_an_invalid_host_is_400_and_closes(self):
        requests = {
            "no Host": b"GET /resources/A HTTP/1.1\r\n\r\n",
            "two Host lines": b"GET /resources/A HTTP/1.1\r\nHost: x\r\nHost: x\r\n\r\n",
            "a Host that is no host": b"GET /resources/A HTTP/1.1\r\nHost: a b\r\n\r\n",
            "a Host with a path": b"GET /resources/A HTTP/1.1\r\nHost: x/y\r\n\r\n",
        }
        with workspace() as root, served(root) as server:
            for label, data in requests.items():
                with self.subTest(label):
                    answer, closed = raw(server, data)
                    assert_problem(self, answer, 400, "/problems/malformed-host")
                    self.assertTrue(closed)
            for label, data in (("HTTP/1.0 needs none", b"GET /resources/A HTTP/1.0\r\n\r\n"),
                                ("a port and an IPv6 literal", b"GET /resources/A HTTP/1.1\r\n"
                                 b"Host: [::1]:8080\r\n\r\n"),
                                ("an empty Host", b"GET /resources/A HTTP/1.1\r\nHost:\r\n\r\n")):
                with self.subTest(label):
                    self.assertEqual(raw(server, data)[0].status, 200)

    def test_raw_non_ascii_in_the_target_is_400_and_percent_encoded_utf8_names_the_caller(
            self):
        body = json.dumps({"payload": PAYLOAD, "now": 0}).encode("utf-8")
        fields = (b'Host: x\r\nIdempotency-Key: "t1"\r\nContent-Type: application/json\r\n'
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        with workspace() as root, served(root) as server:
            for label, target in (("raw UTF-8", "/callers/é/tickets".encode("utf-8")),
                                  ("a raw 0xFF", b"/callers/\xff/tickets"),
                                  ("a raw control", b"/callers/a\x01/tickets")):
                with self.subTest(label):
                    answer, closed = raw(server, b"POST " + target + b" HTTP/1.1\r\n" + fields)
                    assert_problem(self, answer, 400, "/problems/malformed-target")
                    self.assertTrue(closed)
            self.assertEqual(stored(root), EMPTY)
            encoded, _ = raw(server, b"POST /callers/%C3%A9/tickets HTTP/1.1\r\n" + fields)
            self.assertEqual((encoded.status, json.loads(encoded.body)["caller"]), (201, "é"))

    def test_a_body_that_stops_coming_is_408_after_the_read_timeout_and_stores_nothing(self):
        with workspace() as root, served(root, "--read-timeout", "0.3") as server:
            answer, closed = raw(server, b"POST /callers/agent/tickets HTTP/1.1\r\nHost: x\r\n"
                                 b'Idempotency-Key: "t1"\r\nContent-Type: application/json'
                                 b"\r\nContent-Length: 100\r\n\r\n{\"payload\"")
            assert_problem(self, answer, 408, "/problems/timeout")
            self.assertTrue(closed)
            self.assertEqual(stored(root), EMPTY)

    def test_unknown_paths_are_404_other_methods_405_with_allow_and_unknown_methods_501(self):
        with workspace() as root, served(root) as server:
            assert_problem(self, call(server, "GET", "/nowhere"), 404, "/problems/not-found")
            for method, path, allow in (("POST", "/resources/A", "GET, PATCH"),
                                        ("GET", "/transfers", "POST"),
                                        ("PATCH", "/callers/agent/tickets", "POST")):
                with self.subTest(method=method, path=path):
                    answer = call(server, method, path, {"now": 0})
                    assert_problem(self, answer, 405, "/problems/method-not-allowed")
                    self.assertEqual(answer.headers["allow"], allow)
            unknown = call(server, "PUT", "/transfers", {"now": 0})
            assert_problem(self, unknown, 501, "/problems/unknown-method")
            self.assertEqual(stored(root), EMPTY)

    def test_what_the_standard_library_refuses_is_a_problem_too_and_ends_the_connection(self):
        lines = {
            "a request line without a version": (b"POST /transfers HTTX/1.1\r\n\r\n", 400,
                                                 "malformed-request-line"),
            "a request line over 64 KiB": (b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\n\r\n",
                                           414, "target-too-long"),
            "a header line over 64 KiB": (b"GET / HTTP/1.1\r\nX: " + b"a" * 65536
                                          + b"\r\n\r\n", 431, "fields-too-large"),
            "over 100 header fields": (b"GET / HTTP/1.1\r\n" + b"X: a\r\n" * 101 + b"\r\n",
                                       431, "fields-too-large"),
            "a method no resource takes": (b"PUT /transfers HTTP/1.1\r\nHost: x\r\n\r\n",
                                           501, "unknown-method"),
            "HTTP/2.0": (b"GET / HTTP/2.0\r\n\r\n", 505, "version-not-supported"),
        }
        with workspace() as root, served(root) as server:
            for label, (data, status, name) in lines.items():
                with self.subTest(label):
                    answer, closed = raw(server, data)
                    assert_problem(self, answer, status, f"/problems/{name}")
                    self.assertTrue(closed)
            self.assertEqual(stored(root), EMPTY)

    def test_a_database_that_fails_is_500_storage_with_nothing_done(self):
        with workspace() as root:
            with opened(root, service.PLANS) as db:
                db.execute("DROP TABLE effects")
            with served(root) as server:
                answer = post_transfer(server, "job-1", PLAN, now=0)
            assert_problem(self, answer, 500, "/problems/storage")
            self.assertEqual(read(root, service.PLANS, "SELECT count(*) FROM receipt"), [(0,)])

    def test_every_problem_type_is_served_at_its_uri_with_its_status_and_title(self):
        with workspace() as root, served(root) as server:
            for name, (status, title, retry, description) in service.PROBLEMS.items():
                with self.subTest(name):
                    shown = call(server, "GET", f"/problems/{name}")
                    self.assertEqual(json.loads(shown.body), {
                        "type": f"/problems/{name}", "status": status, "title": title,
                        "retry": retry, "description": description})
            assert_problem(self, call(server, "GET", "/problems/nothing"), 404,
                           "/problems/not-found")


# === many at once, and a client that stalls ===============================================

class ManyAtOnce(unittest.TestCase):
    def test_16_clients_released_together_with_one_key_make_one_ticket_and_16_equal_answers(
            self):
        with workspace() as root, served(root) as server:
            answers, barrier = together(server, 16, lambda connection, i: send(
                connection, "POST", "/callers/agent/tickets", {"payload": PAYLOAD, "now": i},
                [("Idempotency-Key", '"t1"')]))
            self.assertFalse(barrier.broken)
            self.assertEqual({(answer.status, answer.body) for answer in answers},
                             {(answers[0].status, answers[0].body)})
            self.assertEqual(answers[0].status, 201)
            marks = [answer.headers.get("idempotent-replayed") for answer in answers]
            self.assertEqual((marks.count(None), marks.count("true")), (1, 15))
            self.assertEqual((stored(root)["tickets"], stored(root)["receipts"]), (1, 1))

    def test_16_distinct_plans_on_one_snapshot_give_1_applied_and_15_stale(self):
        plan = dict(PLAN, amount=1)
        with workspace() as root, served(root) as server:
            answers, barrier = together(server, 16, lambda connection, i: send(
                connection, "POST", "/transfers", {"plan": plan, "now": 0},
                [("Idempotency-Key", f'"job-{i}"')]))
            self.assertFalse(barrier.broken)
            self.assertEqual(sorted(answer.status for answer in answers), [200] + [409] * 15)
            for answer in answers:
                if answer.status == 409:
                    self.assertEqual(json.loads(answer.body)["result"],
                                     {"status": "stale", "observed": {"A": 2, "B": 2}})
            self.assertEqual((stored(root)["effects"], stored(root)["plan_receipts"]), (1, 16))

    def test_two_services_on_one_database_still_make_one_ticket_per_key(self):
        with workspace() as root, served(root) as one, served(root) as two:
            answers, barrier = together(one, 16, lambda connection, i: send(
                connection, "POST", "/callers/agent/tickets", {"payload": PAYLOAD, "now": 0},
                [("Idempotency-Key", '"t1"')]), other=two)
            self.assertFalse(barrier.broken)
            self.assertEqual(len({answer.body for answer in answers}), 1)
            self.assertEqual(stored(root)["tickets"], 1)

    def test_a_client_that_sends_half_a_request_and_stalls_holds_up_nobody(self):
        halves = {"half the header fields": b'POST /callers/agent/tickets HTTP/1.1\r\n'
                  b'Idempotency-Key: "s1"\r\nContent-Ty',
                  "half the body": b'POST /callers/agent/tickets HTTP/1.1\r\nIdempotency-Key:'
                  b' "s1"\r\nContent-Type: application/json\r\nContent-Length: 60\r\n\r\n'
                  b'{"payload": {"ti'}
        with workspace() as root, served(root) as server:
            for label, half in halves.items():
                with self.subTest(label), socket.create_connection(
                        ("127.0.0.1", server.port), timeout=WATCHDOG) as stalled:
                    stalled.sendall(half)
                    # Nobody else waits for it: a writer, and a request on the same key.  The
                    # writer waits at most its busy time-out (10 s), far less than the stall
                    # lasts (the read time-out, 30 s): a lock held while the service reads
                    # would fail it.  It may wait for a checkpoint as a connection closes.
                    with opened(root, reliability.RECEIVER) as writer:
                        writer.execute("BEGIN IMMEDIATE")
                        writer.execute("ROLLBACK")
                    other = post_ticket(server, f"o-{len(half)}", PAYLOAD, now=0)
                    same = post_ticket(server, "s1", PAYLOAD, now=0)
                    self.assertEqual((other.status, same.status), (201, 201))
            stalled_keys = [key for key, in read(root, reliability.RECEIVER,
                                                 "SELECT key FROM receipts")]
            self.assertEqual(sorted(stalled_keys), sorted(
                ["s1"] + [f"o-{len(half)}" for half in halves.values()]))


# === real crashes at the named boundaries, and a restart mid-run ===========================

class CrashesAtTheNamedBoundaries(unittest.TestCase):
    def test_the_service_dies_after_commit_before_the_response_and_the_retry_gets_the_ticket(
            self):
        with workspace() as root:
            with served(root, "--crash", "after_commit_before_response") as server:
                with self.assertRaises(http.client.RemoteDisconnected):
                    post_ticket(server, "t1", PAYLOAD, now=0)
                self.assertEqual(ended(server), (service.CRASH_EXIT, "service.py: died at"
                                                 " after_commit_before_response (exit 73)\n"))
            self.assertEqual(stored(root)["receipts"], 1)
            with served(root) as server:
                again = post_ticket(server, "t1", PAYLOAD, now=11)
            self.assertEqual((again.status, json.loads(again.body)["ticket_id"],
                              again.headers["idempotent-replayed"]), (201, 1, "true"))
            self.assertEqual(stored(root)["tickets"], 1)

    def test_the_service_dies_after_the_status_line_and_a_201_without_its_body_is_no_receipt(
            self):
        with workspace() as root:
            with served(root, "--crash", "after_status_line") as server:
                cut = post_ticket(server, "t1", PAYLOAD, now=0)
                self.assertEqual((cut.status, cut.body, cut.headers), (201, b"", {}))
                self.assertEqual(ended(server)[0], service.CRASH_EXIT)
            with served(root) as server:
                again = post_ticket(server, "t1", PAYLOAD, now=11)
            self.assertEqual((again.status, json.loads(again.body)["ticket_id"]), (201, 1))
            self.assertEqual(stored(root)["tickets"], 1)

    def test_a_change_and_a_transfer_whose_service_died_after_commit_are_replayed_not_redone(
            self):
        changes = (("after_commit_before_response", '"1"'), ("after_status_line", '"2"'))
        with workspace() as root:
            for boundary, if_match in changes:
                with served(root, "--crash", boundary) as server:
                    with contextlib.suppress(http.client.RemoteDisconnected):
                        change(server, f"c-{boundary}", "C", 1, if_match, now=1)
                    self.assertEqual(ended(server)[0], service.CRASH_EXIT)
            with served(root, "--crash", "after_commit_before_response") as server:
                with self.assertRaises(http.client.RemoteDisconnected):
                    post_transfer(server, "job-1", PLAN, now=2)
                ended(server)
            with served(root) as server:
                for boundary, if_match in changes:
                    again = change(server, f"c-{boundary}", "C", 1, if_match, now=3)
                    self.assertEqual((again.status, again.headers["idempotent-replayed"]),
                                     (200, "true"))
                again = post_transfer(server, "job-1", PLAN, now=3)
                self.assertEqual((again.status, again.headers["idempotent-replayed"]),
                                 (200, "true"))
            state = stored(root)
            self.assertEqual((state["resources"]["C"], state["effects"]), ((7, 3), 1))

    def test_a_service_killed_mid_run_and_restarted_loses_nothing_acknowledged(self):
        clients, keys, kill_after = 4, 30, 40
        with workspace() as root:
            current = {"server": start(root)}
            lock, acknowledged = threading.Condition(), []
            restarted = threading.Event()
            answers = {}

            def client(i):
                for n in range(keys):
                    key = f"c{i}-{n}"
                    while True:
                        try:
                            answer = post_ticket(current["server"], key, PAYLOAD, now=n)
                        except (OSError, http.client.HTTPException):
                            # Killed under it: sent again, same key, once it is back.
                            if not restarted.wait(WATCHDOG):
                                raise AssertionError("the service never came back") from None
                            continue
                        break
                    answers.setdefault(key, []).append(answer)
                    with lock:
                        acknowledged.append(key)
                        lock.notify_all()
            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            try:
                for thread in threads:
                    thread.start()
                with lock:
                    if not lock.wait_for(lambda: len(acknowledged) >= kill_after, WATCHDOG):
                        raise AssertionError("the clients never got going")
                    before = {key: answers[key][0] for key in acknowledged}
                # kill -9 mid-run: whatever was acknowledged must survive.
                current["server"].child.kill()
                ended(current["server"])
                current["server"] = start(root)
            finally:
                restarted.set()
                for thread in threads:
                    thread.join(WATCHDOG)
                server = current["server"]
                try:
                    self.assertFalse(any(thread.is_alive() for thread in threads))
                    self.assertEqual(len(answers), clients * keys)
                    replays = {key: post_ticket(server, key, PAYLOAD, now=99)
                               for key in answers}
                finally:
                    server.child.kill()
                    ended(server)
            for key, answer in before.items():
                self.assertEqual((replays[key].status, replays[key].body),
                                 (answer.status, answer.body))
            self.assertEqual({answer.headers.get("idempotent-replayed")
                              for answer in replays.values()}, {"true"})
            per_key = read(root, reliability.RECEIVER,
                           "SELECT count(*), count(DISTINCT key) FROM tickets")
            self.assertEqual(per_key, [(clients * keys, clients * keys)])

    @unittest.skipUnless(os.path.isdir("/proc"), "sees the job's process group (Linux /proc)")
    def test_each_way_of_stopping_the_service_ends_it_in_one_line_130_and_leaves_nothing(self):
        for label, (stop, background) in article1.STOPS.items():
            with self.subTest(label), workspace() as root:
                urls = []

                def ready(pid, screen):
                    # Once it said where it listens, and answered there.
                    if not urls and screen.startswith("http://") and "\n" in screen:
                        urls.append(screen.split("\n")[0])
                        port = int(urls[0].rsplit(":", 1)[1])
                        made = post_ticket(types.SimpleNamespace(port=port), "t1", PAYLOAD,
                                           now=0)
                        self.assertEqual(made.status, 201)
                    return bool(urls)
                done = article1.at_a_terminal([sys.executable, "-I", "-S", SCRIPT, "serve",
                                               root], ready, stop, background)
                self.assertEqual(done, (130, f"{urls[0]}\nservice.py serve: interrupted\n", []))
                self.assertEqual(stored(root)["tickets"], 1)
                left = {name for name in os.listdir(root)
                        if not re.fullmatch(r".*\.db(-wal|-shm)?", name)}
                self.assertEqual(left, set())


# === the sender over HTTP (第一篇 §4-§6) ===================================================

class TheSenderOverHttp(unittest.TestCase):
    def test_a_response_lost_on_the_wire_leaves_the_row_in_flight_and_the_retry_gets_the_ticket(
            self):
        for boundary in ("after_commit_before_response", "after_status_line"):
            with self.subTest(boundary), workspace() as root:
                enqueue(root, "t1", PAYLOAD, now=0)
                with served(root, "--crash", boundary) as server:
                    lost = dispatch(root, server, 0)
                    ended(server)
                self.assertEqual((lost["status"], lost["attempt"], lost["acknowledged"]),
                                 ("inflight", 1, False))
                self.assertEqual(outbox(root), ("inflight", 1))
                with served(root) as server:
                    self.assertEqual(dispatch(root, server, 5)["status"], "nothing due")
                    retry = dispatch(root, server, 11)
                self.assertEqual((retry["status"], retry["attempt"], retry["http_status"],
                                  retry["response"]["ticket_id"]), ("done", 2, 201, 1))
                self.assertEqual((outbox(root), stored(root)["tickets"]), (("done", 2), 1))

    def test_the_sender_dies_after_it_sent_and_the_retry_after_the_lease_gets_the_ticket(self):
        with workspace() as root:
            enqueue(root, "t1", PAYLOAD, now=0)
            with served(root) as server:
                done = cli("dispatch", root, server.url, "--now", "0", "--crash",
                           "after_request_sent")
                self.assertEqual((done.returncode, done.stdout, done.stderr), (
                    service.CRASH_EXIT, b"",
                    b"service.py: died at after_request_sent (exit 73)\n"))
                self.assertEqual(outbox(root), ("inflight", 1))
                # The request had left whole: the service decides it with nobody to answer,
                # and holds its receipt before any retry.
                self.assertTrue(until(lambda: stored(root)["receipts"] == 1))
                self.assertEqual(stored(root)["tickets"], 1)
                retry = dispatch(root, server, 11)
            self.assertEqual((retry["status"], retry["attempt"], retry["response"]["ticket_id"]),
                             ("done", 2, 1))
            self.assertEqual(stored(root)["tickets"], 1)

    def test_a_tool_without_idempotency_over_http_leaves_unknown_and_is_never_resent(self):
        with workspace() as root:
            enqueue(root, "x1", PAYLOAD, now=0, mode="external")
            with served(root, "--crash", "after_commit_before_response") as server:
                lost = dispatch(root, server, 0)
                ended(server)
            self.assertEqual(lost["status"], "unknown")
            with served(root) as server:
                for now in (11, 40, 1000):
                    self.assertEqual(dispatch(root, server, now)["status"], "nothing due")
            self.assertEqual((outbox(root), stored(root)["external"]), (("unknown", 1), 1))

    def test_a_tool_without_idempotency_that_answers_is_done(self):
        with workspace() as root, served(root) as server:
            enqueue(root, "x1", PAYLOAD, now=0, mode="external")
            done = dispatch(root, server, 0)
            self.assertEqual((done["status"], done["http_status"]), ("done", 200))
            self.assertEqual(stored(root)["external"], 1)

    def test_the_receivers_refusals_for_good_block_the_row_with_their_reason(self):
        with workspace() as root, served(root) as server:
            # Another payload already holds the key at the receiver: 422, blocked at once.
            post_ticket(server, "t1", {"title": "other"}, now=0)
            enqueue(root, "t1", PAYLOAD, now=0)
            blocked = dispatch(root, server, 0)
            self.assertEqual((blocked["status"], blocked["http_status"]), ("blocked", 422))
            self.assertEqual(outbox(root), ("blocked", 1))
            with opened(root, reliability.SENDER) as sender:
                [parked] = reliability.snapshot(sender)["parked"]
            self.assertTrue(parked["reason"].startswith("conflict key 't1'"), parked)

    def test_a_key_expired_refusal_blocks_the_row_for_a_person(self):
        with workspace() as root, served(root) as server:
            enqueue(root, "t1", PAYLOAD, now=0)
            # The receiver forgot receipts before tick 50: a request issued at 0 without one
            # may be a late replay of a decision made and purged.
            with opened(root, reliability.RECEIVER) as receiver:
                reliability.purge(receiver, 100, 50)
            blocked = dispatch(root, server, 100)
            self.assertEqual((blocked["status"], blocked["http_status"]), ("blocked", 422))
            self.assertEqual(outbox(root), ("blocked", 1))
            with opened(root, reliability.SENDER) as sender:
                [parked] = reliability.snapshot(sender)["parked"]
            self.assertTrue(parked["reason"].startswith("expired "), parked)
            self.assertEqual(stored(root)["tickets"], 0)

    def test_a_problem_whose_retry_is_never_blocks_the_row_with_its_reason(self):
        with workspace() as root, served(root) as server:
            enqueue(root, "t1", PAYLOAD, now=0)
            # A sender pointed at a path the service does not have: 404 not-found, "never".
            server.url += "/v2"
            blocked = dispatch(root, server, 0)
            self.assertEqual((blocked["status"], blocked["http_status"]), ("blocked", 404))
            self.assertEqual(outbox(root), ("blocked", 1))
            with opened(root, reliability.SENDER) as sender:
                [parked] = reliability.snapshot(sender)["parked"]
                self.assertIsNone(reliability.claim(sender, 100))
            self.assertTrue(parked["reason"].startswith("not-found "), parked)
            self.assertEqual(stored(root)["tickets"], 0)

    def test_a_busy_or_absent_service_leaves_the_row_in_flight(self):
        with workspace() as root:
            enqueue(root, "t1", PAYLOAD, now=0)
            with served(root, "--busy-timeout", "0.2") as server:
                with opened(root, reliability.RECEIVER) as holder:
                    holder.execute("BEGIN IMMEDIATE")
                    busy = dispatch(root, server, 0)
                    holder.execute("ROLLBACK")
                url = server.url
            self.assertEqual((busy["status"], busy["http_status"]), ("inflight", 503))
            # Nobody listens there any more: nothing was sent.
            absent = json.loads(cli("dispatch", root, url, "--now", "11").stdout)
            self.assertEqual((absent["status"], absent["attempt"]), ("not sent", 2))
            self.assertEqual(outbox(root), ("inflight", 2))

    def test_a_key_no_idempotency_key_can_carry_is_blocked_unsent(self):
        with workspace() as root, served(root) as server:
            enqueue(root, "钥匙", PAYLOAD, now=0)
            blocked = dispatch(root, server, 0)
            self.assertEqual((blocked["status"], blocked["http_status"]), ("blocked", None))
            self.assertEqual(stored(root)["receipts"], 0)


# === the command line =====================================================================

class CommandLine(unittest.TestCase):
    def test_bad_usage_exits_2(self):
        for argv in ([], ["serve"], ["serve", "x", "--crash", "after_request_sent"],
                     ["dispatch", "x", "http://127.0.0.1:1", "--now", "0", "--crash",
                      "after_status_line"], ["serve", "x", "--busy-timeout", "0"],
                     ["serve", "x", "--read-timeout", "nan"]):
            with self.subTest(argv=argv):
                self.assertEqual(cli(*argv).returncode, 2)

    def test_a_folder_without_the_databases_exits_1_in_one_line_saying_to_run_init(self):
        with tempfile.TemporaryDirectory() as empty:
            for missing in (reliability.RECEIVER, service.PLANS):
                with self.subTest(missing):
                    # Then article 1's databases are made, and the plans' are still missing.
                    if missing == service.PLANS:
                        reliability.init(empty)
                    done = cli("serve", empty)
                    self.assertEqual(done.returncode, 1)
                    self.assertEqual(len(done.stderr.splitlines()), 1, done.stderr)
                    self.assertRegex(done.stderr, rb"^service.py serve: FileNotFoundError: .*"
                                     rb"run init.*/" + re.escape(missing.encode()) + rb"'\n$")
            # Nothing was made by the service.
            self.assertEqual(sorted(os.listdir(empty)), sorted(reliability.KINDS))

    def test_wait_url_prints_the_first_line_once_whole_and_refuses_anything_else(self):
        # This process is the service waited for: it is alive.
        alive = str(os.getpid())
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "out")
            with open(path, "w", encoding="utf-8") as handle:
                handle.write("http://127.0.0.1:1\nmore\n")
            self.assertEqual(cli("wait-url", path, alive).stdout, b"http://127.0.0.1:1\n")
            with open(path, "w", encoding="utf-8") as handle:
                handle.write("Traceback\n")
            refused = cli("wait-url", path, alive)
            self.assertEqual(refused.returncode, 1)
            self.assertIn(b"not where it listens", refused.stderr)

    @unittest.skipUnless(hasattr(os, "waitid"), "waits for an exit without reaping it")
    def test_wait_url_stops_waiting_once_the_service_it_waits_for_has_exited(self):
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "url")
            with open(out, "wb") as handle:
                # A service that fails to start says nothing on its output, and exits.
                child = subprocess.Popen([sys.executable, "-I", "-S", SCRIPT, "serve",
                                          os.path.join(folder, "nowhere")], stdout=handle,
                                         stderr=subprocess.PIPE)
            try:
                # Ended and not yet reaped, as a shell that has not waited for it sees it.
                os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
                unreaped = cli("wait-url", out, str(child.pid))
            finally:
                _, err = child.communicate(timeout=WATCHDOG)
            reaped = cli("wait-url", out, str(child.pid))
        for waited in (unreaped, reaped):
            self.assertEqual((waited.returncode, waited.stdout), (1, b""))
            self.assertEqual(waited.stderr, b"service.py wait-url: ProcessLookupError: the"
                             b" service (pid %d) exited without saying where it listens\n"
                             % child.pid)
        self.assertEqual(child.returncode, 1)
        self.assertIn(b"run init", err)

    @unittest.skipUnless(os.path.isdir("/proc"), "sees the job's process group (Linux /proc)")
    def test_dispatch_request_and_wait_url_stop_in_one_line_130_each_way_of_stopping(self):
        for command in ("dispatch", "request", "wait-url"):
            for label, (stop, background) in article1.STOPS.items():
                with self.subTest(command=command, stop=label), workspace() as root, \
                        silent_listener() as listener:
                    enqueue(root, "t1", PAYLOAD, now=0)
                    url_file = os.path.join(root, "url")
                    open(url_file, "wb").close()
                    argv = {"dispatch": ["dispatch", root, listener.url, "--now", "0"],
                            "request": ["request", "POST", listener.url + "/transfers",
                                        "--json", "{}"],
                            "wait-url": ["wait-url", url_file, str(os.getpid())]}[command]
                    # Waiting: for an answer that never comes, or for a line never written
                    # (its handlers for every stop in place).
                    ready = ((lambda pid, screen: catches(pid))
                             if command == "wait-url" else
                             (lambda pid, screen: listener.heard.is_set()))
                    done = article1.at_a_terminal([sys.executable, "-I", "-S", SCRIPT, *argv],
                                                  ready, stop, background)
                    self.assertEqual(done, (130, f"service.py {command}: interrupted\n", []))
                    # The row claimed stays in flight, for the retry after its lease.
                    if command == "dispatch":
                        self.assertEqual(outbox(root), ("inflight", 1))

    def test_request_prints_the_answer_or_says_there_was_none(self):
        with workspace() as root:
            with served(root) as server:
                shown = cli("request", "GET", server.url + "/resources/A")
                url = server.url
            self.assertEqual(shown.stdout.decode().splitlines()[0], "HTTP/1.1 200 OK")
            self.assertIn('ETag: "1"', shown.stdout.decode())
            nobody = cli("request", "GET", url + "/resources/A")
            self.assertEqual(nobody.returncode, 1)
            self.assertTrue(nobody.stdout.startswith(b"no response: "), nobody.stdout)


# === beyond/bench.py's row: it runs (its figures belong to the machine, not to a test) =====

class TheBenchRow(unittest.TestCase):
    def test_one_run_measures_both_servers_and_gives_a_ratio(self):
        from beyond import bench
        saved = bench.QUICK_HTTP_ROUNDS, bench.QUICK_HTTP_RECEIVES
        bench.QUICK_HTTP_ROUNDS, bench.QUICK_HTTP_RECEIVES = 1, 2
        try:
            with tempfile.TemporaryDirectory() as root:
                clients, rounds, through, bare, ratio = bench.http_cost(root, True)
        finally:
            bench.QUICK_HTTP_ROUNDS, bench.QUICK_HTTP_RECEIVES = saved
        self.assertEqual((clients, rounds), (8, 1))
        self.assertGreater(min(through, bare, ratio), 0)
        self.assertIn("ratio", bench.http_row(clients, rounds, through, bare, ratio))


# === beyond/README.md: its tables and its walk-throughs, as printed ========================

class TheReadme(unittest.TestCase):
    def test_every_problem_and_outcome_has_its_row_in_the_status_table(self):
        rows = readme_table("| status |")
        named = {row[1].strip("`"): (int(row[0]), row[2]) for row in rows if row[1]}
        self.assertEqual(named, {name: (status, retry) for name, (status, _, retry, _)
                                 in service.PROBLEMS.items()})
        self.assertEqual({int(row[0]) for row in rows if not row[1]}, {200, 201, 304})

    def test_each_conformance_row_names_a_test_that_exists(self):
        rows = readme_table("| requirement |")
        self.assertGreaterEqual(len(rows), 20)
        tests = {name for case in unittest.defaultTestLoader.loadTestsFromModule(
            sys.modules[__name__]) for test in case for name in [test.id().split(".")[-1]]}
        for row in rows:
            with self.subTest(row[0]):
                named = re.findall(r"`(test_[a-z0-9_]+)`", row[-1])
                self.assertTrue(named, row)
                self.assertLessEqual(set(named), tests)

    def test_the_walk_through_runs_as_printed_and_shows_what_it_says(self):
        [block] = [block for block in readme_blocks() if "beyond/service.py serve" in block
                   and "curl" not in block]
        code, out, unseen = walk_through(block)
        self.assertIsNone(unseen, out)
        self.assertEqual(code, 0, out)
        self.assertNotIn("Traceback", out)

    @unittest.skipUnless(shutil.which("curl"), "curl is not on this machine")
    def test_the_curl_block_runs_as_printed_where_curl_is_present(self):
        [block] = [block for block in readme_blocks() if "curl" in block]
        code, out, unseen = walk_through(block)
        self.assertIsNone(unseen, out)
        self.assertEqual(code, 0, out)


# === machinery: workspaces, services, requests, the databases, README.md ==================

EMPTY = {"tickets": 0, "receipts": 0, "external": 0, "plan_receipts": 0, "effects": 0,
         "resources": {name: (quantity, 1) for name, quantity in RESOURCES.items()}}
# One answer: its status, its header fields (names lower-cased), its body.
Answer = collections.namedtuple("Answer", "status headers body")


@contextlib.contextmanager
def workspace():
    """A fresh ROOT holding the four databases, removed with all it holds."""
    with tempfile.TemporaryDirectory(prefix="http-") as root:
        for name in FILES:
            shutil.copyfile(os.path.join(TEMPLATE["dir"].name, name), os.path.join(root, name))
        yield root


def start(root, *options):
    """A service process on ``root``, once it has said where it listens: .child, .url,
    .port.  The caller ends it (see served())."""
    child = subprocess.Popen([sys.executable, "-I", "-S", SCRIPT, "serve", root, *options],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if not select.select([child.stdout], [], [], WATCHDOG)[0]:
            raise AssertionError(f"the service said nothing for {WATCHDOG:g} s")
        line = child.stdout.readline().decode("utf-8").strip()
        if not line.startswith("http://"):
            raise AssertionError(f"the service said {line!r}: {child.stderr.read()!r}")
    except BaseException:
        child.kill()
        child.communicate()
        raise
    return types.SimpleNamespace(child=child, url=line, port=int(line.rsplit(":", 1)[1]),
                                 ended=None)


@contextlib.contextmanager
def served(root, *options):
    """start(); at the end the service is killed if it still runs, and reaped."""
    server = start(root, *options)
    try:
        yield server
    finally:
        if server.child.returncode is None:
            server.child.kill()
        ended(server)


def ended(server):
    """(exit code, stderr) of a service that ends by itself or was killed."""
    if server.ended is None:
        _, err = server.child.communicate(timeout=WATCHDOG)
        server.ended = (server.child.returncode, err.decode("utf-8"))
    return server.ended


def send(connection, method, path, value=None, headers=(), body=None):
    """One request on ``connection``: its Answer."""
    fields = list(headers)
    if value is not None:
        body = json.dumps(value).encode("utf-8")
        fields.append(("Content-Type", "application/json"))
    connection.putrequest(method, path, skip_accept_encoding=True)
    for name, field in fields:
        connection.putheader(name, field.encode("utf-8"))
    if body is not None:
        connection.putheader("Content-Length", str(len(body)))
    connection.endheaders(body)
    response = connection.getresponse()
    return Answer(response.status, {name.lower(): field for name, field in
                                    response.getheaders()}, response.read())


def call(server, method, path, value=None, headers=(), body=None):
    """One request on a new connection: its Answer."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WATCHDOG)
    try:
        return send(connection, method, path, value, headers, body)
    finally:
        connection.close()


def post_ticket(server, key, payload, *, now, issued_at=None, caller="agent"):
    body = {"payload": payload, "now": now}
    if issued_at is not None:
        body["issued_at"] = issued_at
    escaped = key.replace("\\", "\\\\").replace('"', '\\"')
    return call(server, "POST", f"/callers/{service.quote(caller)}/tickets", body,
                [("Idempotency-Key", f'"{escaped}"')])


def post_transfer(server, op, plan, *, now, issued_at=None):
    body = {"plan": plan, "now": now}
    if issued_at is not None:
        body["issued_at"] = issued_at
    return call(server, "POST", "/transfers", body, [("Idempotency-Key", f'"{op}"')])


def change(server, op, name, delta, if_match, *, now, issued_at=None, if_none_match=None):
    body = {"delta": delta, "now": now}
    if issued_at is not None:
        body["issued_at"] = issued_at
    headers = [("Idempotency-Key", f'"{op}"')]
    if if_match is not None:
        headers.append(("If-Match", if_match))
    if if_none_match is not None:
        headers.append(("If-None-Match", if_none_match))
    return call(server, "PATCH", f"/resources/{name}", body, headers)


def raw(server, data):
    """Send ``data`` as it is on a new connection: (the Answer, whether the service then closed
    the connection, read only where the answer says Connection: close)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=WATCHDOG) as sock:
        sock.sendall(data)
        response = http.client.HTTPResponse(sock)
        try:
            response.begin()
            answer = Answer(response.status, {name.lower(): field for name, field in
                                              response.getheaders()}, response.read())
        finally:
            response.close()
        closed = answer.headers.get("connection") == "close" and sock.recv(1) == b""
    return answer, closed


def exchange(server, data):
    """Send ``data`` on a new connection and end the sending side: the Answers to every request
    the service read in it, until it closed the connection."""
    received = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=WATCHDOG) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while True:
            try:
                chunk = sock.recv(65536)
            # A service that closes with bytes unread resets the connection.
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                break
            received += chunk
    stream = _Unclosed(received)
    answers = []
    while stream.tell() < len(received):
        response = http.client.HTTPResponse(types.SimpleNamespace(makefile=lambda mode: stream))
        response.begin()
        answers.append(Answer(response.status, {name.lower(): field for name, field in
                                                response.getheaders()}, response.read()))
    return answers


class _Unclosed(io.BytesIO):
    """Bytes received, read one response after another: a response read to its end closes
    its stream, and this one stays open for the next."""

    def close(self):
        pass


@contextlib.contextmanager
def silent_listener():
    """A socket on 127.0.0.1 that takes connections and reads, never answering: .url, and
    .heard, set once a whole request (its header section, and the body its Content-Length
    announces) has arrived on one of them."""
    listening = socket.create_server(("127.0.0.1", 0))
    heard, stop = threading.Event(), threading.Event()

    def listen():
        received = {}
        while not stop.is_set():
            for ready in select.select([listening, *received], [], [], 0.05)[0]:
                if ready is listening:
                    received[listening.accept()[0]] = b""
                    continue
                chunk = ready.recv(65536)
                if not chunk:
                    del received[ready]
                    ready.close()
                    continue
                received[ready] += chunk
                head, end, body = received[ready].partition(b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length: *([0-9]+)", head)
                if end and len(body) >= (int(length.group(1)) if length else 0):
                    heard.set()
        for connection in received:
            connection.close()
    thread = threading.Thread(target=listen)
    thread.start()
    try:
        yield types.SimpleNamespace(url=f"http://127.0.0.1:{listening.getsockname()[1]}",
                                    heard=heard)
    finally:
        stop.set()
        thread.join(WATCHDOG)
        listening.close()


def catches(pid):
    """Whether process ``pid`` has a handler of its own for each of the stops (SIGINT, SIGTERM,
    SIGHUP), by the mask of caught signals Linux shows in /proc/PID/status."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        [mask] = [int(line.split()[1], 16) for line in status if line.startswith("SigCgt:")]
    return all(mask >> (number - 1) & 1 for number in (signal.SIGINT, signal.SIGTERM,
                                                        signal.SIGHUP))


def until(condition):
    """Whether ``condition()`` came true, asked every 10 ms, within the watchdog."""
    deadline = time.monotonic() + WATCHDOG
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def together(server, n, act, other=None):
    """``n`` clients, each on its own connection made first (half of them to ``other`` if
    given), released together at a barrier this checks: (their answers, the barrier)."""
    barrier = threading.Barrier(n, timeout=WATCHDOG)
    answers, errors = [None] * n, []

    def client(i):
        target = other if other is not None and i % 2 else server
        connection = http.client.HTTPConnection("127.0.0.1", target.port, timeout=WATCHDOG)
        try:
            connection.connect()
            barrier.wait()
            answers[i] = act(connection, i)
        except BaseException as error:
            errors.append(error)
            barrier.abort()
        finally:
            connection.close()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WATCHDOG)
    if any(thread.is_alive() for thread in threads):
        raise AssertionError(f"a client hung for {WATCHDOG:g} s")
    if errors:
        raise errors[0]
    return answers, barrier


def assert_problem(case, answer, status, kind, **operation):
    """``answer`` is an RFC 9457 problem of type ``kind`` whose status is the response's, whose
    retry is RETRY's for it, and whose operation, if ``operation=`` is given, is that (None:
    there is none)."""
    case.assertEqual(answer.status, status, answer.body)
    case.assertEqual(answer.headers["content-type"], "application/problem+json")
    problem = json.loads(answer.body)
    case.assertEqual((problem["type"], problem["status"]), (kind, status))
    case.assertTrue(problem["title"] and problem["detail"], problem)
    name = kind.split("/")[-1]
    case.assertEqual((problem["title"], problem["retry"]),
                     (service.PROBLEMS[name][1], RETRY[name]))
    if operation:
        case.assertEqual(problem.get("operation"), operation["operation"])


@contextlib.contextmanager
def opened(root, name):
    """ROOT/name opened with its module's connect(), closed at the end."""
    module = preconditions if name == service.PLANS else reliability
    connection = module.connect(os.path.join(root, name))
    try:
        yield connection
    finally:
        connection.close()


def read(root, name, sql):
    with opened(root, name) as connection:
        return connection.execute(sql).fetchall()


def stored(root):
    """What the databases hold, in numbers."""
    one = lambda name, sql: read(root, name, sql)[0][0]
    return {"tickets": one(reliability.RECEIVER, "SELECT count(*) FROM tickets"),
            "receipts": one(reliability.RECEIVER, "SELECT count(*) FROM receipts"),
            "external": one(reliability.EXTERNAL, "SELECT count(*) FROM tickets"),
            "plan_receipts": one(service.PLANS, "SELECT count(*) FROM receipt"),
            "effects": one(service.PLANS, "SELECT count(*) FROM effects"),
            "resources": {name: (quantity, revision) for name, quantity, revision in read(
                root, service.PLANS, "SELECT name, quantity, revision FROM resources")}}


def enqueue(root, key, payload, *, now, mode="idempotent"):
    with opened(root, reliability.SENDER) as sender:
        reliability.enqueue(sender, "agent", key, payload, now=now, mode=mode)


def outbox(root):
    [row] = read(root, reliability.SENDER, "SELECT state, attempts FROM outbox")
    return row


def cli(*argv):
    """service.py's command line in a fresh interpreter: CompletedProcess with bytes."""
    return subprocess.run([sys.executable, "-I", "-S", SCRIPT, *argv], capture_output=True,
                          timeout=WATCHDOG)


def dispatch(root, server, now):
    """service.py dispatch ROOT URL --now T in a fresh process: its summary."""
    done = cli("dispatch", root, server.url, "--now", str(now))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def readme_text():
    with open(README, encoding="utf-8") as handle:
        return handle.read()


def readme_blocks():
    """The ```sh blocks of beyond/README.md."""
    return re.findall(r"^```sh\n(.*?)^```", readme_text(), flags=re.S | re.M)


def readme_table(first):
    """The rows (lists of cells) of the table whose header line starts with ``first``."""
    lines = readme_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first)) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def walk_through(block):
    """Run a README block as printed: bash in the project root, ``python3`` this interpreter,
    its temporary folders in one of its own, in a session of its own that is killed at the end
    so that no service it started outlives it.  (exit code, output, the first of its "# → "
    lines the output did not show, in order, or None)."""
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as bin_dir:
        wrapper = os.path.join(bin_dir, "python3")
        with open(wrapper, "w", encoding="utf-8") as handle:
            handle.write(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
        os.chmod(wrapper, 0o755)
        env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
                   PYTHONDONTWRITEBYTECODE="1", TMPDIR=folder)
        child = subprocess.Popen(["bash"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                 start_new_session=True)
        try:
            out, _ = child.communicate(block.encode("utf-8"), timeout=WATCHDOG * 2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
    text = out.decode("utf-8")
    position, unseen = 0, None
    for line in block.splitlines():
        if line.startswith("# → "):
            found = text.find(line[len("# → "):], position)
            if found < 0:
                unseen = line[len("# → "):]
                break
            position = found + len(line) - len("# → ")
    return child.returncode, text, unseen


if __name__ == "__main__":
    unittest.main()
