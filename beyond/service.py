"""Beyond 第一篇 and 第七篇 over HTTP: the receipt behind Idempotency-Key, the plan behind If-Match.

HTTP/1.1 on 127.0.0.1, with responses really lost on the wire.

  python3 beyond/service.py serve ROOT [--crash BOUNDARY] > OUT &   the service, on 127.0.0.1
  python3 beyond/service.py wait-url OUT                        where it listens, once it does
  python3 beyond/service.py dispatch ROOT URL --now T           the outbox's sender, over HTTP
  python3 beyond/service.py request METHOD URL [-H ...] [--json BODY]    a reader's client

The guarantee.  Every request that changes anything names its decision in Idempotency-Key and
is decided by the articles' own functions in one BEGIN IMMEDIATE transaction: a ticket by
reliability.receive() (第一篇 §3), a transfer plan by preconditions.execute() (第七篇 §2-§3),
and a change of one resource by change_if_match(), which checks the If-Match revision inside
that transaction, after the receipt and before the present, in 第七篇 §2's order.  The response
is written only once that transaction has ended, so no database lock is held while a request
is read or a response is written; and a response lost on the wire (the service dying after
COMMIT, or after the status line, or the caller dying after it sent) is recovered by sending
the same request again, which gets the same status and body, marked Idempotent-Replayed.
There is no "in progress" state to expire or to answer 409 for: a concurrent duplicate waits
for the first writer's COMMIT and then replays its receipt.

The boundary.  One machine, process crashes as the articles test them (os._exit at the named
BOUNDARIES), storage that honours fsync.  Callers are named in the path and trusted: there is
no authentication and there are no tenants.  Ticks are the callers' logical ticks, as in the
articles.  Keys are what an sf-string holds (printable ASCII).  Bodies are framed by
Content-Length alone (no chunked).  beyond/README.md has the status table and what each
status means, the conformance table, and a walk-through.  Standard library only.
"""
import argparse
import collections
import http.client
import http.server
import json
import os
import re
import signal
import socket
import sqlite3
import sys
import threading
import time
import types
import urllib.parse

# Run as python3 beyond/service.py, it finds beyond/ on its path: the modules are one folder up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import preconditions
import reliability

__all__ = ["make_server", "change_if_match", "deliver_http", "call_http", "PROBLEMS",
           "BOUNDARIES", "main"]

HOST = "127.0.0.1"
# The plans' database in ROOT, beside reliability.init()'s three files.
PLANS = "plans.db"
# A body as sent, envelope and whitespace included: twice what the payload may hold in
# canonical form (reliability.MAX_PAYLOAD_BYTES), which the module's own check enforces.
MAX_BODY_BYTES = 2 * reliability.MAX_PAYLOAD_BYTES
# Seconds a client may stay silent while the service waits for a request or its body.
READ_TIMEOUT = 30.0
# Seconds a write waits for the database (the service's own writers first, then SQLite's lock
# held by other processes) before it is answered 503 with nothing written.
BUSY_TIMEOUT = reliability.BUSY_TIMEOUT
# Seconds a busy caller is told to wait before it sends the same request again.
RETRY_AFTER = 1
# Seconds the command-line client and the sender wait for an answer.
CLIENT_TIMEOUT = reliability.CHILD_TIMEOUT
# Seconds wait-url waits for the service to say where it listens.
URL_WAIT = 60.0

# The named crash boundaries, and the process that owns each: the service dies with its
# receipt committed and nothing written, or with only the status line written; the sender
# dies with its request sent and nothing read.  At the one its CLI names, a process calls
# os._exit(CRASH_EXIT), as the articles' children do.
CRASH_EXIT = reliability.CRASH_EXIT
BOUNDARIES = {
    "after_commit_before_response": "serve",
    "after_status_line": "serve",
    "after_request_sent": "dispatch",
}

# Every problem this service answers, by name: its status, its title, and what the caller
# should do.  Its type is /problems/NAME, which GET answers with this entry (RFC 9457 §3.1.1);
# the standard library's own refusals (a malformed request line, headers too long, a method
# no resource has) use about:blank with the status phrase as title (RFC 9457 §4.2.1).
PROBLEMS = {
    "missing-key": (400, "Idempotency-Key is missing",
                    "Every request that changes something carries its request ID (op ID) as"
                    ' Idempotency-Key: "ID", the same on every retry.'),
    "malformed-key": (400, "Idempotency-Key is not one quoted string this resource takes",
                      "Send exactly one Idempotency-Key field holding one sf-string of"
                      " printable ASCII, without parameters, of the length the resource"
                      " allows (200 for tickets, 128 for ops)."),
    "malformed-if-match": (400, "If-Match is not a list of entity tags",
                           'Send If-Match: "REVISION" with the ETag that GET gave.'),
    "bad-length": (400, "Content-Length is not one decimal number",
                   "The body cannot be framed; the connection is closed.  Send one"
                   " Content-Length of decimal digits."),
    "not-utf8": (400, "The body is not UTF-8", "A JSON body is UTF-8 (RFC 8259 §8.1)."),
    "not-json": (400, "The body is not JSON",
                 "Send one JSON value, without repeated member names, NaN or Infinity."),
    "invalid": (400, "The request is not one this resource takes",
                "The detail says what the articles' own checks refused; nothing was stored."),
    "timeout": (408, "The request did not arrive in time",
                "The body stopped arriving; nothing was stored and the connection is closed."
                "  Send the whole request again."),
    "length-required": (411, "Content-Length is required",
                        "Bodies are framed by Content-Length alone (no Transfer-Encoding such"
                        " as chunked); the connection is closed if a body was coming."),
    "too-large": (413, "The body is over the limit",
                  f"Bodies hold at most {MAX_BODY_BYTES} bytes; nothing was read or stored, and"
                  " the connection is closed."),
    "unsupported-media-type": (415, "The body must be application/json",
                               "Send Content-Type: application/json (charset, if given,"
                               " utf-8)."),
    "key-reused": (422, "Idempotency-Key was used for another request",
                   "The receipt of this key holds another payload (plan, change): nothing was"
                   " done.  A new decision takes a new key."),
    "key-expired": (422, "Idempotency-Key may have expired",
                    "The request was issued before the low-water mark of purged receipts and"
                    " has none: it may be a late replay, so it is refused.  A new decision"
                    " takes a new key."),
    "if-match-required": (428, "This change requires If-Match",
                          'GET the resource and send its ETag as If-Match: "REVISION"; If-Match:'
                          " * names no revision and is refused too."),
    "change-stale": (412, "If-Match names no current revision",
                     "Decided and stored for this op: the resource has moved on.  GET it, plan"
                     " again, and send the new change under a new op."),
    "change-missing-resource": (404, "No such resource",
                                "Decided and stored for this op: the resource does not exist."),
    "change-insufficient": (409, "The quantity would go below zero",
                            "Decided and stored for this op; result.available says what there"
                            " is."),
    "change-overflow": (409, "The change would overflow a 64-bit integer",
                        "Decided and stored for this op; nothing changed."),
    "transfer-stale": (409, "The plan's revisions are no longer current",
                       "Decided and stored for this op: result.observed has the revisions now."
                       "  Plan again and send the new plan under a new op."),
    "transfer-missing-resource": (409, "A resource the plan names does not exist",
                                  "Decided and stored for this op: result.missing names it."),
    "transfer-insufficient": (409, "The source holds less than the plan moves",
                              "Decided and stored for this op: result.available says what"
                              " there is."),
    "transfer-overflow": (409, "The transfer would overflow a 64-bit integer",
                          "Decided and stored for this op; nothing moved."),
    "corrupt-record": (500, "A stored record cannot be trusted",
                       "The receipt disagrees with its ticket: nothing new was done on its"
                       " strength.  A person must look at the database."),
    "storage": (500, "The database failed", "Nothing is known to be stored; the detail says"
                " what SQLite said."),
    "busy": (503, "The database is busy",
             "Nothing was written.  Send the same request again after Retry-After seconds."),
}
# An article 7 outcome, by route: the status it is answered with, and its problem name (None:
# the outcome itself is the body).
TRANSFER = {"applied": (200, None), "stale": (409, "transfer-stale"),
            "missing_resource": (409, "transfer-missing-resource"),
            "insufficient": (409, "transfer-insufficient"),
            "overflow": (409, "transfer-overflow")}
CHANGE = {"changed": (200, None), "stale": (412, "change-stale"),
          "missing_resource": (404, "change-missing-resource"),
          "insufficient": (409, "change-insufficient"), "overflow": (409, "change-overflow")}

# RFC 8941 §3.3.3: an sf-string, and what it holds.
SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
# An entity tag that names a revision: strong, the revision's decimal digits.
STRONG_REVISION = re.compile(r'"[1-9][0-9]{0,18}"')
# RFC 9110 §8.8.3 and §5.6.1: one element of an If-Match list, and the comma after it.
LIST_ELEMENT = re.compile(r'[ \t]*(?:(W/)?"[\x21\x23-\x7e\x80-\xff]*")?[ \t]*(,|$)')

# A response: status, [(field, value)], body bytes, whether it follows a transaction the
# service ran (the crash boundaries are met only then), whether the connection ends after it.
Answer = collections.namedtuple("Answer", "status headers body committed close")


class Problem(Exception):
    """A refusal, answered as application/problem+json (RFC 9457)."""

    def __init__(self, name, detail, close=False, **members):
        super().__init__(name, detail)
        self.name, self.detail, self.close, self.members = name, detail, close, members


class Gone(Exception):
    """The client went away in the middle of its request: nobody to answer."""


# --- 第七篇 §4 as a conditional request: the revision checked in the change's transaction ----

def change_if_match(c, op, name, delta, tags, *, issued_at, now):
    """preconditions.change() on a resource whose ETag must be one of ``tags``: If-Match.

    ``tags`` are the entity tags If-Match lists, each as sent ('"3"', 'W/"3"'); a tag matches
    only by strong comparison, so only '"REVISION"' can, and the others name no revision.  The
    revisions are part of the op's command (the same op with another If-Match is a conflict),
    checked in change()'s transaction after the receipt: a stale one is a stored refusal.
    """
    if type(tags) is not list or not tags or any(type(tag) is not str for tag in tags):
        raise TypeError("tags must be a non-empty list of entity tags as str")
    revisions = [int(tag[1:-1]) for tag in tags if STRONG_REVISION.fullmatch(tag)]
    return preconditions.change(c, op, name, delta, issued_at=issued_at, now=now,
                                expected=[r for r in revisions
                                          if 1 <= r <= preconditions.MAX_INT64])


# --- the service: one request, from its bytes to its answer -------------------------------

def answer_request(state, method, target, headers, rfile, database):
    """The Answer to one request whose line and header fields are read: the body is framed and
    read first, so that the connection can carry the next request, then checked in the order
    beyond/README.md gives, then decided.  ``database(name)`` is the handler's connection."""
    # Each field's values by its lower-cased name, in one pass over the header section.
    fields = {}
    for name, value in headers.items():
        fields.setdefault(name.lower(), []).append(value)
    try:
        body, framed = read_body(fields, rfile)
        path = urllib.parse.urlsplit(target).path
        handler, arguments = route(method, path)
        request = types.SimpleNamespace(fields=fields, body=body, framed=framed,
                                        database=database)
        return handler(state, request, *arguments)
    except Problem as problem:
        return problem_answer(problem)


def read_body(fields, rfile):
    """(the body, whether Content-Length framed it): Content-Length alone frames a body."""
    if "transfer-encoding" in fields:
        # A chunked body could be read, but its size is known only at its end: refused before
        # a byte of it is read, and the connection closed, since its end is unknown.
        raise Problem("length-required", "Transfer-Encoding is not taken: send Content-Length",
                      close=True)
    lengths = fields.get("content-length", [])
    if not lengths:
        return b"", False
    if len(lengths) > 1 or not re.fullmatch(r"[0-9]+", lengths[0].strip(" \t")):
        raise Problem("bad-length", f"Content-Length: {', '.join(lengths)!r}", close=True)
    digits = lengths[0].strip(" \t").lstrip("0") or "0"
    # Compared as text first: int() refuses numbers of thousands of digits.
    length = int(digits) if len(digits) <= len(str(MAX_BODY_BYTES)) else MAX_BODY_BYTES + 1
    if length > MAX_BODY_BYTES:
        raise Problem("too-large", f"Content-Length {digits[:20]} is over {MAX_BODY_BYTES}",
                      close=True)
    try:
        body = rfile.read(length)
    except socket.timeout:
        raise Problem("timeout", f"{length} bytes were announced; they stopped coming",
                      close=True) from None
    except OSError:
        raise Gone() from None
    if len(body) < length:
        raise Gone()
    return body, True


def route(method, path):
    """(the function that answers ``method`` on ``path``, its arguments from the path)."""
    for pattern, methods in ROUTES:
        found = pattern.fullmatch(path)
        if found is None:
            continue
        if method not in methods:
            allowed = ", ".join(methods)
            raise Problem("method-not-allowed", f"{path} takes {allowed}", allow=allowed)
        try:
            arguments = [urllib.parse.unquote(part, errors="strict") for part in found.groups()]
        except UnicodeDecodeError:
            raise Problem("invalid", "a path segment is not percent-encoded UTF-8") from None
        return methods[method], arguments
    raise Problem("not-found", f"no resource at {path}")


def create_ticket(state, request, caller):
    """第一篇 §3 over HTTP: POST /callers/CALLER/tickets, Idempotency-Key the request ID, the body
    {"payload": {...}, "now": T, "issued_at": T0 (default T)}.  A new ticket and every replay
    of it: 201, reliability.receive()'s answer, Location; a replay also Idempotent-Replayed."""
    require_json(request)
    key = idempotency_key(request, reliability.MAX_IDENTITY_LENGTH)
    payload, issued_at, now = envelope(json_object(request), "payload")
    connection = request.database(reliability.RECEIVER)
    # receive() says the same for a new ticket and a replay; only a new one writes rows, and
    # this connection is this thread's alone, so a change in its count tells them apart.
    before = connection.total_changes
    # receive() checks its input before its transaction and decodes nothing stored (see
    # reliability._replayed): a ValueError or TypeError from it is the input's.
    receipt = decide(state, reliability.receive, connection, caller, key, payload,
                     issued_at=issued_at, now=now, checks_input=True)
    location = f"/callers/{quote(caller)}/tickets/{receipt['ticket_id']}"
    return committed(json_answer(201, receipt, [("Location", location)],
                                 replayed=connection.total_changes == before))


def get_ticket(state, request, caller, number):
    """GET /callers/CALLER/tickets/ID: the ticket a 201 named, with its payload."""
    row = None
    if int(number) <= preconditions.MAX_INT64:
        row = request.database(reliability.RECEIVER).execute(
            "SELECT key, digest, payload FROM tickets WHERE id = ? AND caller = ?",
            (int(number), caller)).fetchone()
    if row is None:
        raise Problem("not-found", f"caller {caller!r} has no ticket {number}")
    try:
        payload = json.loads(row[2])
    except (TypeError, ValueError, RecursionError):
        raise Problem("corrupt-record", f"ticket {number} holds no JSON payload") from None
    return json_answer(200, {"caller": caller, "key": row[0], "digest": row[1],
                             "ticket_id": int(number), "payload": payload})


def external_ticket(state, request, caller):
    """第一篇 §6's tool without idempotency, over HTTP: POST /callers/CALLER/external-tickets
    with {"key": KEY, "payload": {...}}, which makes a new ticket every time: 200 with
    reliability.external_create_ticket()'s answer.  Idempotency-Key means nothing to it."""
    require_json(request)
    value = json_object(request)
    if set(value) != {"key", "payload"}:
        raise Problem("invalid", "the body is an object with exactly key and payload")
    checked(reliability.check_identity, caller, value["key"])
    checked(reliability.canonical, value["payload"])
    connection = request.database(reliability.EXTERNAL)
    made = decide(state, reliability.external_create_ticket, connection, caller, value["key"],
                  value["payload"])
    return committed(json_answer(200, made))


def get_resource(state, request, name):
    """GET /resources/NAME: its quantity and revision; its revision is its strong ETag."""
    row = request.database(PLANS).execute(
        "SELECT quantity, revision FROM resources WHERE name = ?", (name,)).fetchone()
    if row is None:
        raise Problem("not-found", f"no resource {name!r}")
    return json_answer(200, {"name": name, "quantity": row[0], "revision": row[1]},
                       [("ETag", f'"{row[1]}"')])


def change_resource(state, request, name):
    """第七篇 §4 as a conditional request: PATCH /resources/NAME, Idempotency-Key the op,
    If-Match the ETag the change was planned on, the body {"delta": N, "now": T, "issued_at":
    T0 (default T)}: change_if_match(), answered by CHANGE."""
    require_json(request)
    op = idempotency_key(request, preconditions.MAX_OP_LENGTH)
    tags = if_match(request)
    delta, issued_at, now = envelope(json_object(request), "delta")
    checked(preconditions._check_text, name, "name", preconditions.MAX_NAME_LENGTH)
    checked(preconditions._check_int, delta, "delta", -preconditions.MAX_INT64,
            preconditions.MAX_INT64)
    checked(preconditions.check_ticks, issued_at, now)
    result = decide(state, change_if_match, request.database(PLANS), op, name, delta, tags,
                    issued_at=issued_at, now=now)
    return decided(result, CHANGE)


def transfer(state, request):
    """第七篇 over HTTP: POST /transfers, Idempotency-Key the op, the body {"plan": {"src",
    "dst", "amount", "expected"}, "now": T, "issued_at": T0 (default T)}: the revisions the
    plan depends on are in the plan, since If-Match speaks only of the target resource.
    preconditions.execute(), answered by TRANSFER."""
    require_json(request)
    op = idempotency_key(request, preconditions.MAX_OP_LENGTH)
    plan, issued_at, now = envelope(json_object(request), "plan")
    checked(preconditions.validate, op, plan)
    checked(preconditions.check_ticks, issued_at, now)
    result = decide(state, preconditions.execute, request.database(PLANS), op, plan,
                    issued_at=issued_at, now=now)
    return decided(result, TRANSFER)


def problem_type(state, request, name):
    """GET /problems/NAME: what a problem type means, the documentation its URI names."""
    if name not in PROBLEMS:
        raise Problem("not-found", f"no problem type {name!r}")
    status, title, description = PROBLEMS[name]
    return json_answer(200, {"type": f"/problems/{name}", "status": status, "title": title,
                             "description": description})


# Each path, and the function that answers each method it takes.
ROUTES = (
    (re.compile(r"/callers/([^/]+)/tickets"), {"POST": create_ticket}),
    (re.compile(r"/callers/([^/]+)/tickets/([1-9][0-9]{0,18})"), {"GET": get_ticket}),
    (re.compile(r"/callers/([^/]+)/external-tickets"), {"POST": external_ticket}),
    (re.compile(r"/resources/([^/]+)"), {"GET": get_resource, "PATCH": change_resource}),
    (re.compile(r"/transfers"), {"POST": transfer}),
    (re.compile(r"/problems/([^/]+)"), {"GET": problem_type}),
)


# --- what a request must carry -------------------------------------------------------------

def idempotency_key(request, limit):
    """The request ID in the one Idempotency-Key field, an sf-string without parameters
    (draft-ietf-httpapi-idempotency-key-header §2.1), of 1 to ``limit`` characters."""
    values = request.fields.get("idempotency-key", [])
    if not values:
        raise Problem("missing-key", "this request changes something: send Idempotency-Key")
    if len(values) > 1:
        raise Problem("malformed-key", f"{len(values)} Idempotency-Key fields; send one")
    found = SF_STRING.fullmatch(values[0].strip(" \t"))
    if found is None:
        raise Problem("malformed-key", f'{values[0]!r} is not one sf-string: send "ID"')
    key = re.sub(r'\\(["\\])', r"\1", found.group(1))
    if not 0 < len(key) <= limit:
        raise Problem("malformed-key", f"the key has {len(key)} characters, not 1 to {limit}")
    return key


def if_match(request):
    """If-Match's entity tags, as sent, in order; none is refused with 428 (RFC 6585 §3), and
    so is *, which names no revision."""
    values = request.fields.get("if-match", [])
    if not values:
        raise Problem("if-match-required", "send the ETag this change was planned on")
    # RFC 9110 §5.3: several fields are one comma-separated list.
    field = ", ".join(value.strip(" \t") for value in values)
    if field == "*":
        raise Problem("if-match-required", "If-Match: * names no revision")
    tags, at = [], 0
    while at < len(field):
        found = LIST_ELEMENT.match(field, at)
        if found is None or found.end() == at:
            raise Problem("malformed-if-match", f"If-Match: {field!r}")
        tag = found.group(0).strip(" \t,")
        if tag:
            tags.append(tag)
        at = found.end()
    if not tags:
        raise Problem("malformed-if-match", f"If-Match: {field!r} lists no entity tag")
    return tags


def require_json(request):
    """A request that takes a body: 411 without Content-Length, 415 unless application/json."""
    if not request.framed:
        raise Problem("length-required", "this request has a body: send Content-Length")
    kinds = request.fields.get("content-type", [])
    media, *parameters = kinds[0].split(";") if len(kinds) == 1 else ["", ""]
    # RFC 8259 defines no parameter; charset=utf-8, which says what JSON is anyway, is let by.
    if media.strip(" \t").lower() != "application/json" or any(
            parameter.strip(" \t").lower().replace('"', "") != "charset=utf-8"
            for parameter in parameters):
        raise Problem("unsupported-media-type", f"Content-Type: {', '.join(kinds)!r}")


def json_object(request):
    """The body as a JSON object: 400 not UTF-8, not JSON, or not an object."""
    try:
        text = request.body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise Problem("not-utf8", f"byte {error.start} is not UTF-8") from None
    try:
        value = json.loads(text, object_pairs_hook=reliability._no_repeats,
                           parse_constant=_no_constant)
    except RecursionError:
        raise Problem("not-json", "it nests too deeply") from None
    except ValueError as error:
        raise Problem("not-json", str(error)) from None
    if type(value) is not dict:
        raise Problem("invalid", f"the body is a JSON {type(value).__name__}, not an object")
    return value


def envelope(value, name):
    """(value[name], issued_at, now) of a body {name: ..., "now": T, "issued_at": T0 (default
    T)}: the article's request line, with caller and key moved into the URL and the header."""
    if not {name, "now"} <= set(value) <= {name, "now", "issued_at"}:
        raise Problem("invalid", f"the body is an object with {name}, now and optionally"
                      f" issued_at, not {sorted(value)}")
    return value[name], value.get("issued_at", value["now"]), value["now"]


def checked(check, *arguments):
    """The articles' own input check, before anything is decided: what it refuses is 400."""
    try:
        check(*arguments)
    except (ValueError, TypeError, OverflowError) as error:
        raise Problem("invalid", " ".join(str(error).split()) or type(error).__name__) from None


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


# --- deciding, and what the decision is answered with ------------------------------------

def decide(state, act, *arguments, checks_input=False, **options):
    """act(*arguments, **options) as the service's only writer: its threads take turns here,
    so that none sleeps in SQLite's busy handler, and other processes meet BEGIN IMMEDIATE.
    Waiting longer than the busy time-out is 503 with nothing written.  With
    ``checks_input``, ``act`` checks its input before its transaction, so that a ValueError or
    TypeError from it is the input's: 400."""
    if not state.writer.acquire(timeout=state.busy_timeout):
        raise Problem("busy", f"the service's writers held the database for over"
                      f" {state.busy_timeout:g} s", retry=True)
    try:
        return act(*arguments, **options)
    except reliability.Conflict as error:
        raise Problem("key-reused", str(error)) from None
    except reliability.Expired as error:
        raise Problem("key-expired", str(error)) from None
    except reliability.CorruptRecord as error:
        raise Problem("corrupt-record", str(error)) from None
    except sqlite3.OperationalError as error:
        if "locked" in str(error) or "busy" in str(error):
            raise Problem("busy", str(error), retry=True) from None
        raise Problem("storage", str(error)) from None
    except (ValueError, TypeError, OverflowError) as error:
        if checks_input:
            raise Problem("invalid", " ".join(str(error).split())) from None
        # The input was checked before: what is refused now is what the database holds.
        raise Problem("storage", f"{type(error).__name__}: {error}") from None
    except sqlite3.Error as error:
        raise Problem("storage", f"{type(error).__name__}: {error}") from None
    finally:
        state.writer.release()


def decided(result, outcomes):
    """The answer to an article 7 outcome: a replay is answered as its stored outcome was, with
    Idempotent-Replayed; conflict and expired, never stored, are the key's problems."""
    replayed = result["status"] == "replayed"
    outcome = result["result"] if replayed else result
    if outcome["status"] == "conflict":
        return committed(problem_answer(Problem(
            "key-reused", "this op's receipt holds another command")))
    if outcome["status"] == "expired":
        return committed(problem_answer(Problem(
            "key-expired", f"the op has no receipt and was issued before the low-water mark"
            f" {outcome['low_water']}")))
    status, name = outcomes[outcome["status"]]
    if name is None:
        return committed(json_answer(status, outcome, replayed=replayed))
    answer = problem_answer(Problem(name, f"this op was decided as {outcome['status']}; its"
                                    " receipt answers every retry the same way",
                                    result=outcome))
    return committed(answer._replace(headers=answer.headers + _replayed(replayed)))


def json_answer(status, value, headers=(), replayed=False):
    """A 2xx answer: the body in the canonical form, so that a replay's bytes are the first
    answer's."""
    return Answer(status, [("Content-Type", "application/json"), *headers,
                           *_replayed(replayed)],
                  reliability._dumps(value).encode("utf-8"), False, False)


def problem_answer(problem):
    """An RFC 9457 problem details object: type, title, status, detail, and extensions."""
    if problem.name in PROBLEMS:
        status, title, _ = PROBLEMS[problem.name]
        kind = f"/problems/{problem.name}"
    else:
        status = {"not-found": 404, "method-not-allowed": 405}[problem.name]
        kind, title = "about:blank", http.HTTPStatus(status).phrase
    members = {"type": kind, "title": title, "status": status, "detail": problem.detail}
    headers = [("Content-Type", "application/problem+json")]
    for name, value in problem.members.items():
        if name == "allow":
            headers.append(("Allow", value))
        elif name == "retry":
            headers.append(("Retry-After", str(RETRY_AFTER)))
        else:
            members[name] = value
    if problem.close:
        headers.append(("Connection", "close"))
    return Answer(status, headers, reliability._dumps(members).encode("utf-8"), False,
                  problem.close)


def committed(answer):
    """``answer``, following a transaction the service ran: the crash boundaries apply."""
    return answer._replace(committed=True)


def _replayed(replayed):
    return [("Idempotent-Replayed", "true")] if replayed else []


def quote(text):
    return urllib.parse.quote(text, safe="")


# --- the handler: thin, around answer_request ---------------------------------------------

class Handler(http.server.BaseHTTPRequestHandler):
    """One TCP connection, HTTP/1.1 with keep-alive: each request is answered by
    answer_request() on this connection's own SQLite connections, closed when it ends."""

    protocol_version = "HTTP/1.1"
    server_version = "beyond-service/1"
    sys_version = ""
    # Headers and body are two writes: without this, Nagle and delayed ACKs stall each answer.
    disable_nagle_algorithm = True

    def setup(self):
        self.timeout = self.server.state.read_timeout
        self.connections = {}
        super().setup()

    def finish(self):
        try:
            super().finish()
        finally:
            for connection in self.connections.values():
                connection.close()

    def database(self, name):
        """This connection's connection to ROOT/name, opened with the module's connect()."""
        if name not in self.connections:
            try:
                opened = (preconditions if name == PLANS else reliability).connect(
                    os.path.join(self.server.state.root, name))
            except (OSError, sqlite3.Error) as error:
                raise Problem("storage", f"{type(error).__name__}: {error}") from None
            opened.execute(f"PRAGMA busy_timeout = {int(self.server.state.busy_timeout * 1000)}")
            self.connections[name] = opened
        return self.connections[name]

    def do_GET(self):
        self.answer("GET")

    def do_POST(self):
        self.answer("POST")

    def do_PATCH(self):
        self.answer("PATCH")

    def answer(self, method):
        try:
            answer = answer_request(self.server.state, method, self.path, self.headers,
                                    self.rfile, self.database)
        except Gone:
            self.close_connection = True
            return
        respond(self, answer)

    def send_error(self, code, message=None, explain=None):
        """The standard library's own refusals, as problem details; the connection ends."""
        # Refused before its version was read, a request line counts as HTTP/0.9, which would
        # get a body without a status line: it gets both, as an HTTP/1.0 request would.
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        phrase = http.HTTPStatus(code).phrase
        members = {"type": "about:blank", "title": phrase, "status": code,
                   "detail": message or phrase}
        respond(self, Answer(code, [("Content-Type", "application/problem+json"),
                                    ("Connection", "close")],
                             reliability._dumps(members).encode("utf-8"), False, True))

    def log_message(self, format, *arguments):
        # Quiet: a service's stderr is for its one line at the end, and for crash lines.
        pass


def respond(handler, answer):
    """Write ``answer``: after a transaction, the crash boundaries are met on the way."""
    if answer.committed:
        # The decision is durable, and nothing has been written.
        crash_point("after_commit_before_response")
    try:
        handler.send_response_only(answer.status)
        if answer.committed and CRASH_AT == "after_status_line":
            # The status line alone leaves, then the process is gone: a 2xx and no body.
            handler.flush_headers()
            crash_point("after_status_line")
        handler.send_header("Server", handler.version_string())
        handler.send_header("Date", handler.date_time_string())
        for name, value in answer.headers:
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(answer.body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(answer.body)
    except OSError:
        # The caller went away: its answer is lost on the wire, and its retry replays it.
        answer = answer._replace(close=True)
    if answer.close:
        handler.close_connection = True


def make_server(root, *, port=0, busy_timeout=BUSY_TIMEOUT, read_timeout=READ_TIMEOUT):
    """A ThreadingHTTPServer on 127.0.0.1:port (0: an ephemeral one) for the databases in
    ``root``: reliability.init()'s and PLANS (preconditions.init()'s), each opened once first
    so that a missing or foreign file fails here.  Call serve_forever() on it."""
    for name in (reliability.RECEIVER, reliability.EXTERNAL, PLANS):
        connect = preconditions.connect if name == PLANS else reliability.connect
        connect(os.path.join(root, name)).close()
    server = http.server.ThreadingHTTPServer((HOST, port), Handler, bind_and_activate=False)
    try:
        # Many callers may connect at once (the tests release 16 together).
        server.request_queue_size = 128
        server.server_bind()
        server.server_activate()
    except BaseException:
        server.server_close()
        raise
    server.state = types.SimpleNamespace(root=os.path.abspath(root), writer=threading.Lock(),
                                         busy_timeout=busy_timeout, read_timeout=read_timeout)
    server.handle_error = _quiet
    return server


def _quiet(request, client_address):
    """A connection that failed outside answer_request(): a caller that reset it, most often."""
    error = sys.exc_info()[1]
    if not isinstance(error, OSError):
        os.write(2, f"service.py: {type(error).__name__}: {error}\n".encode())


# --- 第一篇 §4-§6 over HTTP: the outbox's sender ------------------------------------------

# What call_http() returns: the status (None: no response), Content-Type, the body read, and
# whether any byte of the request may have left.
Reply = collections.namedtuple("Reply", "status content_type body sent")


def deliver_http(connection, url, row, *, timeout=CLIENT_TIMEOUT):
    """reliability.deliver()'s four rules, the tool being the service at ``url``.

    The row (claimed under ``row["attempt"]``) is POSTed with its request ID as
    Idempotency-Key, or, for a tool without idempotency, to its external-tickets.  Refused
    for good (key-reused, key-expired, corrupt-record): blocked.  A 2xx whose body answers the
    request: acknowledged, "done" ("stale" where another attempt holds the row).  No valid
    answer from a tool without idempotency: unknown, never sent again automatically.
    Otherwise (a response lost on the wire, a 503): in flight until its lease ends, and the
    retry under the same key replays.  A key that no sf-string holds cannot be sent: blocked.
    Returns what happened, in "status", as deliver() does.
    """
    caller, key, attempt = row["caller"], row["key"], row["attempt"]
    external = row["mode"] == "external"
    summary = {"caller": caller, "key": key, "attempt": attempt, "http_status": None,
               "response": None, "acknowledged": False}
    if not external and not re.fullmatch(r"[\x20-\x7e]+", key):
        refusal = {"error": "unsendable", "message": "the key is not printable ASCII, so no"
                   " Idempotency-Key can carry it"}
        return dict(summary, status=reliability._end_attempt(connection, row, "blocked",
                                                              refusal))
    reply = call_http(url, row, timeout=timeout)
    response = _object(reply.body)
    summary.update(http_status=reply.status, response=response)
    if not reply.sent:
        return dict(summary, status="not sent")
    refusal = _refusal(reply, response)
    if refusal is not None:
        return dict(summary, status=reliability._end_attempt(connection, row, "blocked",
                                                              refusal))
    if reply.status is not None and 200 <= reply.status < 300 and reliability._answers(
            response, row):
        if not reliability.acknowledge(connection, caller, key, attempt, response):
            return dict(summary, status="stale")
        return dict(summary, acknowledged=True, status="done")
    if external:
        return dict(summary, status=reliability._end_attempt(connection, row, "unknown"))
    return dict(summary, status="inflight")


def call_http(url, row, *, timeout=CLIENT_TIMEOUT):
    """POST the row's request to the service at ``url``, once, on a new connection: its Reply.
    A connection that cannot be made sent nothing; after that, anything may have left."""
    parts = urllib.parse.urlsplit(url)
    caller = quote(row["caller"])
    if row["mode"] == "external":
        path = f"{parts.path.rstrip('/')}/callers/{caller}/external-tickets"
        value, headers = {"key": row["key"], "payload": row["payload"]}, {}
    else:
        path = f"{parts.path.rstrip('/')}/callers/{caller}/tickets"
        value = {"payload": row["payload"], "issued_at": row["issued_at"], "now": row["now"]}
        escaped = row["key"].replace("\\", "\\\\").replace('"', '\\"')
        headers = {"Idempotency-Key": f'"{escaped}"'}
    headers["Content-Type"] = "application/json"
    body = reliability._dumps(value).encode("utf-8")
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        try:
            connection.connect()
        except OSError:
            return Reply(None, None, None, False)
        try:
            connection.request("POST", path, body, headers)
            # The request is sent; nothing is read.
            crash_point("after_request_sent")
            response = connection.getresponse()
            return Reply(response.status, response.getheader("Content-Type"), response.read(),
                         True)
        except (OSError, http.client.HTTPException):
            return Reply(None, None, None, True)
    finally:
        connection.close()


def _object(body):
    """A body as the JSON object it holds, or None."""
    try:
        value = json.loads(body.decode("utf-8"))
    except (AttributeError, ValueError, RecursionError):
        return None
    return value if type(value) is dict else None


def _refusal(reply, response):
    """The receiver's refusal for good, as deliver() records it, or None."""
    kinds = {"/problems/key-reused": "conflict", "/problems/key-expired": "expired",
             "/problems/corrupt-record": "corrupt"}
    if (reply.content_type != "application/problem+json" or response is None
            or response.get("type") not in kinds or response.get("status") != reply.status):
        return None
    return {"error": kinds[response["type"]], "message": str(response.get("detail", ""))}


# --- crash boundaries ----------------------------------------------------------------------

# The boundary at which this process dies; set only by its CLI (--crash).
CRASH_AT = None


def crash_point(name):
    if name == CRASH_AT:
        # Unbuffered: said, then gone; no finally, no flush, no response, a real process death.
        os.write(2, f"service.py: died at {name} (exit {CRASH_EXIT})\n".encode())
        os._exit(CRASH_EXIT)


# --- command line --------------------------------------------------------------------------

def main(argv=None):
    """service.py COMMAND ...: serve (prints the URL it listens on, then serves until SIGINT,
    exit 130, or SIGTERM, exit 143, each saying so in one line on stderr), wait-url, request,
    dispatch.  Exit 0 done, 1 refused or failed (one line on stderr), 2 bad usage, CRASH_EXIT
    at --crash BOUNDARY."""
    global CRASH_AT
    args = _parser().parse_args(None if argv is None else list(argv))
    CRASH_AT = getattr(args, "crash", None)
    try:
        return COMMANDS[args.command][0](args)
    except (OSError, ValueError, TypeError, sqlite3.Error, http.client.HTTPException) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        sys.stderr.write(f"service.py {args.command}: {type(error).__name__}: {message}\n")
        return 1


def _serve(args):
    stop = {signal.SIGINT: 130, signal.SIGTERM: 143}

    def stopped(number, frame):
        # At once: a request inside its transaction is rolled back by SQLite, and one committed
        # but not yet answered is a lost response, which its retry recovers.
        name = signal.Signals(number).name
        os.write(2, f"service.py: stopped by {name} (exit {stop[number]})\n".encode())
        os._exit(stop[number])
    for number in stop:
        signal.signal(number, stopped)
    server = make_server(args.root, port=args.port, busy_timeout=args.busy_timeout,
                         read_timeout=args.read_timeout)
    host, port = server.server_address[:2]
    sys.stdout.write(f"http://{host}:{port}\n")
    sys.stdout.flush()
    server.serve_forever()
    return 0


def _wait_url(args):
    """The first line of FILE, once it is whole: where a service started with its output
    there listens.  Not a URL: said on stderr, exit 1."""
    deadline = time.monotonic() + URL_WAIT
    while True:
        with open(args.file, "rb") as handle:
            line = handle.readline()
        if line.endswith(b"\n"):
            break
        if time.monotonic() > deadline:
            raise OSError(f"{args.file} held no whole line after {URL_WAIT:g} s")
        time.sleep(0.05)
    text = line.decode("utf-8", "replace").strip()
    if not text.startswith("http://"):
        raise ValueError(f"the service said {text!r}, not where it listens")
    print(text)
    return 0


def _request(args):
    """One request with http.client; prints the status line, the fields but Date and Server,
    and the body.  No response: says so in one line, exit 1."""
    parts = urllib.parse.urlsplit(args.url)
    headers = {}
    for field in args.header:
        name, colon, value = field.partition(":")
        if not colon or not name.strip():
            raise ValueError(f"-H {field!r} is not NAME: VALUE")
        headers[name.strip()] = value.strip()
    body = None
    if args.json is not None:
        headers.setdefault("Content-Type", "application/json")
        body = args.json.encode("utf-8")
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=CLIENT_TIMEOUT)
    try:
        connection.request(args.method, target or "/", body, headers)
        response = connection.getresponse()
        data = response.read()
    except (OSError, http.client.HTTPException) as error:
        print(f"no response: {type(error).__name__}: {error}")
        return 1
    finally:
        connection.close()
    lines = [f"HTTP/1.1 {response.status} {response.reason}"]
    lines += [f"{name}: {value}" for name, value in response.getheaders()
              if name.lower() not in ("date", "server")]
    print("\n".join(lines + [data.decode("utf-8", "replace")]))
    return 0


def _dispatch(args):
    """Claim the oldest due row of ROOT/sender.db and deliver it to the service at URL."""
    path = os.path.join(args.root, reliability.SENDER)
    connection = reliability.connect(path)
    try:
        row = reliability.claim(connection, args.now)
        answer = ({"status": "nothing due", "now": args.now} if row is None
                  else deliver_http(connection, args.url, row))
    finally:
        connection.close()
    print(reliability._dumps(answer))
    return 0


def _seconds(text):
    """A time-out on the command line: seconds, more than 0, finite."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"{text!r} is not seconds above 0 and below 1e6")
    return value


COMMANDS = {
    "serve": (_serve, "serve ROOT's databases over HTTP on 127.0.0.1, printing the URL",
              ("root", "--port", "--busy-timeout", "--read-timeout")),
    "wait-url": (_wait_url, "print the URL a service started with its output in FILE listens"
                 " on, once it has said so", ("file",)),
    "request": (_request, "send one request and print the response", ("method", "url",
                                                                       "-H", "--json")),
    "dispatch": (_dispatch, "claim a due row of ROOT/sender.db and deliver it to the service at"
                 " URL (第一篇 §4-§6 over HTTP)", ("root", "url", "--now")),
}
ARGUMENTS = {
    "root": {"metavar": "ROOT", "help": "the folder of receiver.db, external.db (reliability.py"
             " init ROOT) and plans.db (preconditions.py init ROOT/plans.db ...)"},
    "file": {"metavar": "FILE", "help": "the service's output"},
    "method": {"metavar": "METHOD", "help": "GET, POST, PATCH, ..."},
    "url": {"metavar": "URL", "help": "http://127.0.0.1:PORT[/PATH]"},
    "-H": {"dest": "header", "action": "append", "default": [], "metavar": "'NAME: VALUE'",
           "help": "a header field, as sent"},
    "--json": {"metavar": "BODY", "help": "the body, sent as application/json"},
    "--port": {"type": int, "default": 0, "help": "the port (default 0: an ephemeral one)"},
    "--busy-timeout": {"type": _seconds, "default": BUSY_TIMEOUT, "metavar": "S",
                       "help": f"seconds a write waits for the database before 503 (default"
                       f" {BUSY_TIMEOUT:g})"},
    "--read-timeout": {"type": _seconds, "default": READ_TIMEOUT, "metavar": "S",
                       "help": f"seconds a caller may stay silent (default {READ_TIMEOUT:g})"},
    "--now": {"type": int, "required": True, "metavar": "T",
              "help": "the logical tick it happens at"},
}


def _parser():
    parser = argparse.ArgumentParser(prog="service.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, text, arguments) in COMMANDS.items():
        command = commands.add_parser(name, help=text, description=text)
        for argument in arguments:
            command.add_argument(argument, **ARGUMENTS[argument])
        boundaries = [b for b, owner in BOUNDARIES.items() if owner == name]
        if boundaries:
            command.add_argument("--crash", choices=boundaries, metavar="BOUNDARY",
                                 help=f"exit {CRASH_EXIT} at that boundary:"
                                 f" {', '.join(boundaries)}")
    return parser


if __name__ == "__main__":
    sys.exit(main())
