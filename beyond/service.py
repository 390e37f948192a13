"""Beyond 第一篇 and 第七篇 over HTTP: the receipt behind Idempotency-Key, the plan behind If-Match.

HTTP/1.1 on 127.0.0.1, with responses really lost on the wire.

  python3 beyond/service.py serve ROOT [--crash BOUNDARY] > OUT &   the service, on 127.0.0.1
  python3 beyond/service.py wait-url OUT $!                     where it listens, once it does
  python3 beyond/service.py dispatch ROOT URL --now T           the outbox's sender, over HTTP
  python3 beyond/service.py request METHOD URL [-H ...] [--json BODY]    a reader's client

The guarantee.  Every request that changes anything names its decision in Idempotency-Key and
is decided by the articles' own functions in one BEGIN IMMEDIATE transaction: a ticket by
reliability.receive() (第一篇 §3), a transfer plan by preconditions.execute() (第七篇 §2-§3),
and a change of one resource by change_if_match(), which checks If-Match (and If-None-Match)
inside that transaction, after the receipt and before the present, in 第七篇 §2's order.  A
request's header section is checked line by line as it is read, before http.server parses it,
so that no field is dropped and no body is read as another request.  The response
is written only once that transaction has ended, so no database lock is held while a request
is read or a response is written; and a response lost on the wire (the service dying after
COMMIT, or after the status line, or the caller dying after it sent) is recovered by sending
the same request again, which gets the same status and body, marked Idempotent-Replayed.
There is no "in progress" state to expire or to answer 409 for: a concurrent duplicate waits
for the first writer's COMMIT and then replays its receipt.

The boundary.  One machine, process crashes as the articles test them (os._exit at the named
BOUNDARIES), storage that honours fsync.  Callers are named in the path and trusted: there is
no authentication and there are no tenants.  Ticks are the callers' logical ticks, as in the
articles.  Keys are what an sf-string holds (printable ASCII); a ticket's key is its
caller's, an op is one for the whole service.  Bodies are framed by Content-Length alone (no
chunked).  Every refusal is a problem body saying whether a retry is safe (retry) and what the
request named (operation).  beyond/README.md has the status table and what each status means,
the conformance table, and a walk-through.  Standard library only.
"""
import argparse
import collections
import contextlib
import errno
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

# Every problem this service answers, by name: its status, its title, its retry, and what the
# caller should do.  Its type is /problems/NAME, which GET answers with this entry (RFC 9457
# §3.1.1).  Each body adds two extension members (§3.2): "operation", what the request named
# in Idempotency-Key, and "retry", what the client may do next: "same-key", send the same
# request again (nothing was decided, or what was decided is replayed); "new-key", decide
# anew under a new key (this one holds a stored refusal); "never", fix the request (as sent,
# it is never taken); "person", leave it to a person (no automatic step is known to be safe).
# The standard library's own refusals (a malformed request line, one too long, header fields
# too large, a method no resource has, HTTP/2) have names here too, so that their bodies can
# carry "retry" (about:blank could carry no members).
PROBLEMS = {
    "malformed-request-line": (400, "The request line is not METHOD TARGET HTTP/1.x",
                               "never", "The standard library refused it; the connection is"
                               " closed."),
    "malformed-field": (400, "A header field line is not NAME: VALUE", "never",
                        "No white space before the colon, no folded lines, no control"
                        " characters (RFC 9112 §5.1, §5.2): nothing after the line can be"
                        " trusted, so the connection is closed."),
    "malformed-host": (400, "Host is missing, repeated or not a host", "never",
                       "An HTTP/1.1 request has exactly one Host field holding host[:port]"
                       " (RFC 9112 §3.2); the connection is closed."),
    "malformed-target": (400, "The request target is not ASCII", "never",
                         "Percent-encode every byte outside printable ASCII (a caller is"
                         " percent-encoded UTF-8); the connection is closed."),
    "bad-transfer-encoding": (400, "Transfer-Encoding does not end in chunked", "never",
                              "The body's length cannot be known (RFC 9112 §6.3): the"
                              " connection is closed.  Send the body with Content-Length."),
    "bad-length": (400, "Content-Length is not one decimal number", "never",
                   "The body cannot be framed; the connection is closed.  Send one"
                   " Content-Length of decimal digits."),
    "missing-key": (400, "Idempotency-Key is missing", "never",
                    "Every request that changes something carries its request ID (op ID) as"
                    ' Idempotency-Key: "ID", the same on every retry.'),
    "malformed-key": (400, "Idempotency-Key is not one quoted string this resource takes",
                      "never", "Send exactly one Idempotency-Key field holding one sf-string of"
                      " printable ASCII, without parameters, of the length the resource"
                      " allows (200 for tickets, 128 for ops)."),
    "malformed-if-match": (400, "If-Match is not * or a list of entity tags", "never",
                           'Send If-Match: "REVISION" with the ETag that GET gave.'),
    "malformed-if-none-match": (400, "If-None-Match is not * or a list of entity tags",
                                "never", 'Send If-None-Match: * or "REVISION", ...'),
    "not-utf8": (400, "The body is not UTF-8", "never", "A JSON body is UTF-8 (RFC 8259 §8.1)."),
    "not-json": (400, "The body is not JSON", "never",
                 "Send one JSON value, without repeated member names, NaN or Infinity."),
    "invalid": (400, "The request is not one this resource takes", "never",
                "The detail says what the articles' own checks refused; nothing was stored."),
    "not-found": (404, "Not Found", "never",
                  "No such path, ticket, resource or problem type: nothing was done."),
    "change-missing-resource": (404, "No such resource", "new-key",
                                "Decided and stored for this op: the resource does not exist."),
    "method-not-allowed": (405, "Method Not Allowed", "never",
                           "The path takes other methods; Allow says which."),
    "timeout": (408, "The request did not arrive in time", "same-key",
                "The body stopped arriving; nothing was stored and the connection is closed."
                "  Send the whole request again."),
    "transfer-stale": (409, "The plan's revisions are no longer current", "new-key",
                       "Decided and stored for this op: result.observed has the revisions now."
                       "  Plan again and send the new plan under a new op."),
    "transfer-missing-resource": (409, "A resource the plan names does not exist", "new-key",
                                  "Decided and stored for this op: result.missing names it."),
    "transfer-insufficient": (409, "The source holds less than the plan moves", "new-key",
                              "Decided and stored for this op: result.available says what"
                              " there is."),
    "transfer-overflow": (409, "The transfer would overflow a 64-bit integer", "new-key",
                          "Decided and stored for this op; nothing moved."),
    "change-insufficient": (409, "The quantity would go below zero", "new-key",
                            "Decided and stored for this op; result.available says what there"
                            " is."),
    "change-overflow": (409, "The change would overflow a 64-bit integer", "new-key",
                        "Decided and stored for this op; nothing changed."),
    "length-required": (411, "Content-Length is required", "never",
                        "Bodies are framed by Content-Length alone (not chunked); the"
                        " connection is closed if a body was coming."),
    "precondition-failed": (412, "A precondition is false", "never",
                            "If-Match names no entity tag of the target (or * where it has no"
                            " representation), or If-None-Match names the one it has (or *"
                            " where it has one).  Nothing was done or stored."),
    "change-stale": (412, "If-Match or If-None-Match excludes the current revision", "new-key",
                     "Decided and stored for this op: the resource is at a revision If-Match"
                     " does not name, or at one If-None-Match names (* names any).  GET it,"
                     " plan again, and send the new change under a new op."),
    "too-large": (413, "The body is over the limit", "never",
                  f"Bodies hold at most {MAX_BODY_BYTES} bytes; nothing was read or stored, and"
                  " the connection is closed."),
    "target-too-long": (414, "URI Too Long", "never",
                        "The request line is over 64 KiB; the connection is closed."),
    "unsupported-media-type": (415, "The body must be application/json", "never",
                               "Send Content-Type: application/json (charset, if given,"
                               " utf-8)."),
    "key-reused": (422, "Idempotency-Key was used for another request", "person",
                   "The receipt of this key holds another payload (plan, change): nothing was"
                   " done.  Whether this is a new decision, which takes a new key, or a"
                   " retry gone wrong is for a person to say."),
    "key-expired": (422, "Idempotency-Key may have expired", "person",
                    "The request was issued before the low-water mark of purged receipts and"
                    " has none: it may be a late replay of a decision made, so it is refused."
                    "  Whether to decide it again is for a person to say."),
    "if-match-required": (428, "This change requires If-Match", "never",
                          'GET the resource and send its ETag as If-Match: "REVISION"; If-Match:'
                          " * names no revision and is refused too (If-None-Match: * is"
                          " taken, and refused with 412 where the resource exists)."),
    "fields-too-large": (431, "Request Header Fields Too Large", "never",
                         "A field line over 64 KiB, or over 100 fields; the connection is"
                         " closed."),
    "corrupt-record": (500, "A stored record cannot be trusted", "person",
                       "The receipt disagrees with its ticket: nothing new was done on its"
                       " strength.  A person must look at the database."),
    "storage": (500, "The database failed", "same-key",
                "Nothing is known to be stored; the detail says what SQLite said.  The same"
                " request is safe to send again, and replays whatever was stored."),
    "unknown-method": (501, "Not Implemented", "never",
                       "No resource here takes this method; the connection is closed."),
    "busy": (503, "The database is busy", "same-key",
             "Nothing was written.  Send the same request again after Retry-After seconds."),
    "version-not-supported": (505, "HTTP Version Not Supported", "never",
                              "This service speaks HTTP/1.x; the connection is closed."),
}
# The standard library's refusals (BaseHTTPRequestHandler.send_error), by status.
STANDARD_REFUSALS = {400: "malformed-request-line", 414: "target-too-long",
                     431: "fields-too-large", 501: "unknown-method",
                     505: "version-not-supported"}
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
# An entity tag that names a revision: strong, the revision's decimal digits; weak or strong.
STRONG_REVISION = re.compile(r'"[1-9][0-9]{0,18}"')
REVISION = re.compile(r'(?:W/)?"([1-9][0-9]{0,18})"')
# RFC 9110 §8.8.3 and §5.6.1: one element of an entity-tag list, and the comma after it.
LIST_ELEMENT = re.compile(r'[ \t]*(?:(W/)?"[\x21\x23-\x7e\x80-\xff]*")?[ \t]*(,|$)')
# RFC 9112 §5.1 and RFC 9110 §5.5: a field line as it arrives, NAME: VALUE and its end; the
# value holds no control character but tab (so no bare CR, no NUL, no folded line).
FIELD_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*\r?\n")
# The longest line http.server takes; a longer one is its 431.
MAX_LINE = 65536
# RFC 9112 §3.2, RFC 3986 §3.2.2-§3.2.3: a Host field value, host [":" port].
HOST_FIELD = re.compile(r"(?:\[[0-9A-Za-z:._~!$&'()*+,;=-]+\]|[0-9A-Za-z._~!$&'()*+,;=%-]*)"
                        r"(?::[0-9]*)?")

# A response: status, [(field, value)], body bytes, whether it follows a transaction the
# service ran (the crash boundaries are met only then), whether the connection ends after it.
Answer = collections.namedtuple("Answer", "status headers body committed close")


class Problem(Exception):
    """A refusal, answered as application/problem+json (RFC 9457).  ``operation`` is what the
    request named in Idempotency-Key, where it named one; ``allow`` and ``retry_after`` become
    header fields, ``result`` a member."""

    def __init__(self, name, detail, close=False, operation=None, **members):
        super().__init__(name, detail)
        self.name, self.detail, self.close = name, detail, close
        self.operation, self.members = operation, members


class Gone(Exception):
    """The client went away in the middle of its request: nobody to answer."""


# --- 第七篇 §4 as a conditional request: the revision checked in the change's transaction ----

def change_if_match(c, op, name, delta, tags, *, issued_at, now, none_match=None):
    """preconditions.change() on a resource whose ETag must be one of ``tags`` (If-Match) and
    none of ``none_match`` (If-None-Match).

    ``tags`` are the entity tags If-Match lists, each as sent ('"3"', 'W/"3"'); a tag matches
    only by strong comparison, so only '"REVISION"' can, and the others name no revision.
    ``none_match`` is None (no If-None-Match), "*" (matched by any revision: with the resource
    there, the change is refused, whatever ``tags`` says, which may then be None), or the tags
    If-None-Match lists, compared weakly (W/"3" names revision 3 too).  What is left, the
    revisions the change may apply on, is part of the op's command (the same op with other
    conditions is a conflict), checked in change()'s transaction after the receipt: a stale
    one is a stored refusal.
    """
    if none_match == "*":
        expected = []
    else:
        if type(tags) is not list or not tags or any(type(tag) is not str for tag in tags):
            raise TypeError("tags must be a non-empty list of entity tags as str, unless"
                            " none_match is '*'")
        if none_match is not None and (type(none_match) is not list or not none_match or any(
                type(tag) is not str for tag in none_match)):
            raise TypeError("none_match must be None, '*' or a non-empty list of entity tags")
        named = [int(tag[1:-1]) for tag in tags if STRONG_REVISION.fullmatch(tag)]
        excluded = {int(found.group(1)) for found in map(REVISION.fullmatch, none_match or [])
                    if found}
        expected = [revision for revision in named
                    if 1 <= revision <= preconditions.MAX_INT64 and revision not in excluded]
    return preconditions.change(c, op, name, delta, issued_at=issued_at, now=now,
                                expected=expected)


# --- the service: one request, from its bytes to its answer -------------------------------

def answer_request(state, method, target, headers, rfile, database):
    """The Answer to one request whose line and header fields are read and checked (see
    Handler.parse_request): the body is framed and read first, so that the connection can
    carry the next request, then checked in the order beyond/README.md gives, then decided.
    ``database(name)`` is the handler's connection.  A refusal names the operation the request
    named in Idempotency-Key, where it named one."""
    # Each field's values by its lower-cased name, in one pass over the header section.
    fields = {}
    for name, value in headers.items():
        fields.setdefault(name.lower(), []).append(value)
    try:
        body, framed = read_body(fields, rfile)
        path = urllib.parse.urlsplit(target).path
        handler, arguments = route(method, path)
        request = types.SimpleNamespace(method=method, fields=fields, body=body, framed=framed,
                                        database=database)
        return handler(state, request, *arguments)
    except Problem as problem:
        if problem.operation is None:
            problem.operation = named_operation(method, target, fields)
        return problem_answer(problem)


def read_body(fields, rfile):
    """(the body, whether Content-Length framed it): Content-Length alone frames a body."""
    if "transfer-encoding" in fields:
        codings = ",".join(fields["transfer-encoding"]).split(",")
        # RFC 9112 §6.3: unless chunked comes last, the body's end cannot be known at all.
        if codings[-1].strip(" \t").lower() != "chunked":
            raise Problem("bad-transfer-encoding", f"Transfer-Encoding:"
                          f" {', '.join(fields['transfer-encoding'])!r}", close=True)
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
    when = conditions(request)
    payload, issued_at, now = envelope(json_object(request), "payload")
    checked(reliability.check_identity, caller, key)
    checked(reliability.canonical, payload)
    checked(reliability.check_ticks, issued_at, now)
    # The target, a collection, has no representation: If-Match is false, If-None-Match true.
    precondition(request, when, None, exists=False)
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
    """GET /callers/CALLER/tickets/ID: the ticket a 201 named, with its payload (no ETag)."""
    when = conditions(request)
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
    return precondition(request, when, None, exists=True) or json_answer(200, {
        "caller": caller, "key": row[0], "digest": row[1], "ticket_id": int(number),
        "payload": payload})


def external_ticket(state, request, caller):
    """第一篇 §6's tool without idempotency, over HTTP: POST /callers/CALLER/external-tickets
    with {"key": KEY, "payload": {...}}, which makes a new ticket every time: 200 with
    reliability.external_create_ticket()'s answer.  Idempotency-Key means nothing to it."""
    require_json(request)
    when = conditions(request)
    value = json_object(request)
    if set(value) != {"key", "payload"}:
        raise Problem("invalid", "the body is an object with exactly key and payload")
    checked(reliability.check_identity, caller, value["key"])
    checked(reliability.canonical, value["payload"])
    precondition(request, when, None, exists=False)
    connection = request.database(reliability.EXTERNAL)
    made = decide(state, reliability.external_create_ticket, connection, caller, value["key"],
                  value["payload"])
    return committed(json_answer(200, made))


def get_resource(state, request, name):
    """GET /resources/NAME: its quantity and revision; its revision is its strong ETag, which
    If-Match and If-None-Match are evaluated against (RFC 9110 §13.2.2)."""
    when = conditions(request)
    row = request.database(PLANS).execute(
        "SELECT quantity, revision FROM resources WHERE name = ?", (name,)).fetchone()
    if row is None:
        raise Problem("not-found", f"no resource {name!r}")
    etag = f'"{row[1]}"'
    return precondition(request, when, etag, exists=True) or json_answer(
        200, {"name": name, "quantity": row[0], "revision": row[1]}, [("ETag", etag)])


def change_resource(state, request, name):
    """第七篇 §4 as a conditional request: PATCH /resources/NAME, Idempotency-Key the op,
    If-Match the ETag the change was planned on (or If-None-Match: *, which no resource
    there passes), the body {"delta": N, "now": T, "issued_at": T0 (default T)}:
    change_if_match(), answered by CHANGE."""
    require_json(request)
    op = idempotency_key(request, preconditions.MAX_OP_LENGTH)
    tags, none_match = conditions(request)
    # RFC 6585 §3: the change must say which revisions it may apply on.
    if none_match != "*" and type(tags) is not list:
        raise Problem("if-match-required", "If-Match: * names no revision" if tags == "*"
                      else "send the ETag this change was planned on as If-Match")
    delta, issued_at, now = envelope(json_object(request), "delta")
    checked(preconditions._check_text, name, "name", preconditions.MAX_NAME_LENGTH)
    checked(preconditions._check_int, delta, "delta", -preconditions.MAX_INT64,
            preconditions.MAX_INT64)
    checked(preconditions.check_ticks, issued_at, now)
    result = decide(state, change_if_match, request.database(PLANS), op, name, delta, tags,
                    issued_at=issued_at, now=now, none_match=none_match)
    return decided(result, CHANGE, {"op": op})


def transfer(state, request):
    """第七篇 over HTTP: POST /transfers, Idempotency-Key the op, the body {"plan": {"src",
    "dst", "amount", "expected"}, "now": T, "issued_at": T0 (default T)}: the revisions the
    plan depends on are in the plan, since If-Match speaks only of the target resource.
    preconditions.execute(), answered by TRANSFER."""
    require_json(request)
    op = idempotency_key(request, preconditions.MAX_OP_LENGTH)
    when = conditions(request)
    plan, issued_at, now = envelope(json_object(request), "plan")
    checked(preconditions.validate, op, plan)
    checked(preconditions.check_ticks, issued_at, now)
    # The target, /transfers, has no representation: If-Match is false, If-None-Match true.
    precondition(request, when, None, exists=False)
    result = decide(state, preconditions.execute, request.database(PLANS), op, plan,
                    issued_at=issued_at, now=now)
    return decided(result, TRANSFER, {"op": op})


def problem_type(state, request, name):
    """GET /problems/NAME: what a problem type means, the documentation its URI names."""
    when = conditions(request)
    if name not in PROBLEMS:
        raise Problem("not-found", f"no problem type {name!r}")
    status, title, retry, description = PROBLEMS[name]
    return precondition(request, when, None, exists=True) or json_answer(200, {
        "type": f"/problems/{name}", "status": status, "title": title, "retry": retry,
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
# The functions whose requests name their operation in Idempotency-Key, and its longest key.
KEYED = {create_ticket: reliability.MAX_IDENTITY_LENGTH,
         change_resource: preconditions.MAX_OP_LENGTH, transfer: preconditions.MAX_OP_LENGTH}


def named_operation(method, target, fields):
    """The operation member of a problem: what the request named in Idempotency-Key, on a
    route that takes one: {"caller", "key"} for a ticket (keys are the caller's), {"op"} for a
    change or transfer (ops are one namespace).  None where it named none that can be read."""
    try:
        handler, arguments = route(method, urllib.parse.urlsplit(target).path)
        if handler not in KEYED:
            return None
        key = idempotency_key(types.SimpleNamespace(fields=fields), KEYED[handler])
    except Problem:
        return None
    return {"caller": arguments[0], "key": key} if handler is create_ticket else {"op": key}


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


def conditions(request):
    """(If-Match, If-None-Match): each None (not sent), "*", or its entity tags as sent, in
    order; either malformed is 400.  If-Modified-Since and If-Unmodified-Since are ignored, as
    RFC 9110 §13.1.3-§13.1.4 say where no modification date is kept, and If-Range with them,
    since no Range is served (§13.1.5)."""
    return (entity_tags(request, "if-match", "malformed-if-match"),
            entity_tags(request, "if-none-match", "malformed-if-none-match"))


def entity_tags(request, field, problem):
    """The field's value: None, "*", or its list of entity tags (RFC 9110 §13.1.1-§13.1.2)."""
    values = request.fields.get(field, [])
    if not values:
        return None
    # RFC 9110 §5.3: several fields are one comma-separated list.
    value = ", ".join(part.strip(" \t") for part in values)
    if value == "*":
        return "*"
    tags, at = [], 0
    while at < len(value):
        found = LIST_ELEMENT.match(value, at)
        if found is None or found.end() == at:
            raise Problem(problem, f"{field}: {value!r}")
        tag = found.group(0).strip(" \t,")
        if tag:
            tags.append(tag)
        at = found.end()
    if not tags:
        raise Problem(problem, f"{field}: {value!r} lists no entity tag")
    return tags


def precondition(request, when, etag, *, exists):
    """RFC 9110 §13.2.2 for a request that stores no decision, on a target whose selected
    representation has ``etag`` (None: no entity tag) and ``exists`` or not: If-Match first
    (strong comparison), then If-None-Match (weak).  None: perform the method.  A GET whose
    If-None-Match matched: the 304 Answer.  Otherwise a false condition is 412."""
    if_match, none_match = when
    if if_match is not None and not _matches(if_match, etag, exists, weak=False):
        raise Problem("precondition-failed", f"If-Match: {_shown(if_match)} matches no"
                      " current representation of this target")
    if none_match is not None and _matches(none_match, etag, exists, weak=True):
        if request.method == "GET":
            return Answer(304, [("ETag", etag)] if etag else [], b"", False, False)
        raise Problem("precondition-failed", f"If-None-Match: {_shown(none_match)} matches"
                      " the current representation of this target")
    return None


def _matches(condition, etag, exists, *, weak):
    """RFC 9110 §8.8.3.2: whether a condition ("*" or entity tags) matches ``etag``."""
    if condition == "*":
        return exists
    if etag is None:
        return False
    if weak:
        opaque = lambda tag: tag[2:] if tag.startswith("W/") else tag
        return any(opaque(tag) == opaque(etag) for tag in condition)
    # Both strong and equal: this service's tags are strong, so a W/ tag never matches.
    return etag in condition


def _shown(condition):
    return condition if condition == "*" else ", ".join(condition)


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
        value = json.loads(text, object_pairs_hook=_no_repeats, parse_constant=_no_constant)
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


def _no_repeats(pairs):
    # RFC 8259 §4: names SHOULD be unique; a repeated one would leave which value counts open.
    if len({name for name, _ in pairs}) != len(pairs):
        raise ValueError("a member name is repeated")
    return dict(pairs)


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
                      f" {state.busy_timeout:g} s", retry_after=True)
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
            raise Problem("busy", str(error), retry_after=True) from None
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


def decided(result, outcomes, operation):
    """The answer to an article 7 outcome: a replay is answered as its stored outcome was, with
    Idempotent-Replayed; conflict and expired, never stored, are the key's problems.  A
    stored refusal's body is made again from its stored outcome and ``operation`` alone, so
    that every replay is the first answer byte for byte."""
    replayed = result["status"] == "replayed"
    outcome = result["result"] if replayed else result
    if outcome["status"] == "conflict":
        return committed(problem_answer(Problem(
            "key-reused", "this op's receipt holds another command", operation=operation)))
    if outcome["status"] == "expired":
        return committed(problem_answer(Problem(
            "key-expired", f"the op has no receipt and was issued before the low-water mark"
            f" {outcome['low_water']}", operation=operation)))
    status, name = outcomes[outcome["status"]]
    if name is None:
        return committed(json_answer(status, outcome, replayed=replayed))
    answer = problem_answer(Problem(name, f"this op was decided as {outcome['status']}; its"
                                    " receipt answers every retry the same way",
                                    operation=operation, result=outcome))
    return committed(answer._replace(headers=answer.headers + _replayed(replayed)))


def json_answer(status, value, headers=(), replayed=False):
    """A 2xx answer: the body in the canonical form, so that a replay's bytes are the first
    answer's."""
    return Answer(status, [("Content-Type", "application/json"), *headers,
                           *_replayed(replayed)], _dumps(value).encode("utf-8"), False, False)


def problem_answer(problem):
    """An RFC 9457 problem details object: type, title, status, detail, and the extension
    members retry (what the client may do next), operation (what the request named, if it
    did) and any the problem adds (result)."""
    status, title, retry, _ = PROBLEMS[problem.name]
    members = {"type": f"/problems/{problem.name}", "title": title, "status": status,
               "detail": problem.detail, "retry": retry}
    if problem.operation is not None:
        members["operation"] = problem.operation
    headers = [("Content-Type", "application/problem+json")]
    for name, value in problem.members.items():
        if name == "allow":
            headers.append(("Allow", value))
        elif name == "retry_after":
            headers.append(("Retry-After", str(RETRY_AFTER)))
        else:
            members[name] = value
    if problem.close:
        headers.append(("Connection", "close"))
    return Answer(status, headers, _dumps(members).encode("utf-8"), False, problem.close)


def committed(answer):
    """``answer``, following a transaction the service ran: the crash boundaries apply."""
    return answer._replace(committed=True)


def _replayed(replayed):
    return [("Idempotent-Replayed", "true")] if replayed else []


def quote(text):
    return urllib.parse.quote(text, safe="")


# Sorted keys, compact, UTF-8 text, no NaN or Infinity: the same value is always the same bytes.
_dumps = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode


# --- the handler: thin, around answer_request ---------------------------------------------

class Handler(http.server.BaseHTTPRequestHandler):
    """One TCP connection, HTTP/1.1 with keep-alive: each request's header section is checked
    line by line as it is read (parse_request), then answered by answer_request() on this
    connection's own SQLite connections, closed when it ends."""

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

    def parse_request(self):
        """http.server's parse, reading the header section through FieldLines: a line it would
        misread (and so drop every field after it, Content-Length included) is refused before
        it is parsed, as is a bad Host or target; each refusal closes the connection, since
        the body, unread, cannot be told from a next request."""
        rfile = self.rfile
        self.rfile = FieldLines(rfile, self.header_problem)
        try:
            return super().parse_request()
        except Problem as problem:
            respond(self, problem_answer(problem))
            return False
        except Gone:
            self.close_connection = True
            return False
        finally:
            self.rfile = rfile

    def header_problem(self, lines):
        """The Problem with a whole header section of valid field ``lines``, or None: Host
        (RFC 9112 §3.2) and the request target (ASCII only, RFC 9112 §3.2, RFC 3986 §2)."""
        if re.search(r"[^\x21-\x7e]", self.path):
            return Problem("malformed-target", f"the target {self.path[:60]!r} holds a byte"
                           " outside printable ASCII", close=True)
        hosts = [line.split(b":", 1)[1].strip(b" \t\r\n") for line in lines
                 if line.split(b":", 1)[0].lower() == b"host"]
        version = re.fullmatch(r"HTTP/([0-9]+)\.([0-9]+)", self.request_version)
        if not hosts and version and (int(version.group(1)), int(version.group(2))) >= (1, 1):
            return Problem("malformed-host", "an HTTP/1.1 request carries Host", close=True)
        if len(hosts) > 1:
            return Problem("malformed-host", f"{len(hosts)} Host fields; send one", close=True)
        if hosts and not HOST_FIELD.fullmatch(hosts[0].decode("latin-1")):
            return Problem("malformed-host", f"Host: {hosts[0][:60]!r} is not host[:port]",
                           close=True)
        return None

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
        name = STANDARD_REFUSALS[code]
        respond(self, problem_answer(Problem(name, message or PROBLEMS[name][1], close=True)))

    def log_message(self, format, *arguments):
        # Quiet: a service's stderr is for its one line at the end, and for crash lines.
        pass


class FieldLines:
    """The request's stream as http.server reads its header section: each field line is
    checked before it is handed on (RFC 9112 §5.1-§5.2, RFC 9110 §5.5), and the whole section
    by ``check(lines)`` at its end; the first bad one raises its Problem.  A section cut off
    by the end of the stream raises Gone."""

    def __init__(self, rfile, check):
        self.rfile, self.check, self.lines = rfile, check, []

    def readline(self, limit=-1):
        line = self.rfile.readline(limit)
        # Too long: http.server answers 431 itself.
        if len(line) > MAX_LINE:
            return line
        if line in (b"\r\n", b"\n"):
            problem = self.check(self.lines)
            if problem is not None:
                raise problem
            return line
        if not line.endswith(b"\n"):
            raise Gone()
        if not FIELD_LINE.fullmatch(line):
            raise Problem("malformed-field", f"the field line {line[:60]!r} is not NAME: VALUE",
                          close=True)
        self.lines.append(line)
        return line


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
        # RFC 9110 §8.6: a 304 has no content, and a Content-Length would speak of the 200's.
        if answer.status != 304:
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
    so that a missing or foreign file fails here (FileNotFoundError, saying to run init, for a
    missing one).  Call serve_forever() on it."""
    for name in (reliability.RECEIVER, reliability.EXTERNAL, PLANS):
        path = os.path.join(root, name)
        if not os.path.lexists(path):
            made_by = (f"preconditions.init(ROOT/{PLANS}, RESOURCES)" if name == PLANS
                       else "reliability.init(ROOT)")
            raise FileNotFoundError(errno.ENOENT, f"no such database: run init first"
                                    f" ({made_by})", path)
        connect = preconditions.connect if name == PLANS else reliability.connect
        connect(path).close()
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
    for good (key-reused, key-expired, corrupt-record, or a problem whose retry is "never"):
    blocked.  A 2xx whose body answers the request: acknowledged, "done" ("stale" where
    another attempt holds the row).  No valid answer from a tool without idempotency:
    unknown, never sent again automatically.
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
    body = _dumps(value).encode("utf-8")
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
    """The receiver's refusal for good, as deliver() records it, or None: key-reused, key-expired
    and corrupt-record, and any problem whose retry is "never" (as sent, the request is never
    taken: sent again, it would be refused again, so a person fixes it)."""
    kinds = {"/problems/key-reused": "conflict", "/problems/key-expired": "expired",
             "/problems/corrupt-record": "corrupt"}
    if (reply.content_type != "application/problem+json" or response is None
            or response.get("status") != reply.status):
        return None
    kind = kinds.get(response.get("type"))
    if kind is None and response.get("retry") == "never":
        kind = str(response.get("type")).replace("/problems/", "", 1)
    return None if kind is None else {"error": kind, "message": str(response.get("detail", ""))}


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
    """service.py COMMAND ...: serve (prints the URL it listens on, then serves until it is
    stopped), wait-url, request, dispatch.  Exit 0 done, 1 refused or failed (one line on
    stderr), 2 bad usage, CRASH_EXIT at --crash BOUNDARY, 130 stopped (one line on stderr:
    Ctrl-C, or SIGTERM or SIGHUP at the command line)."""
    global CRASH_AT
    words = sys.argv[1:] if argv is None else list(argv)
    # The command is the first word: named even when a stop comes while the rest is parsed.
    command = words[0] if words and words[0] in COMMANDS else None
    try:
        args = _parser().parse_args(words)
        CRASH_AT = getattr(args, "crash", None)
        try:
            return COMMANDS[command][0](args)
        except (OSError, ValueError, TypeError, sqlite3.Error,
                http.client.HTTPException) as error:
            message = " ".join(str(error).split()) or type(error).__name__
            sys.stderr.write(f"service.py {command}: {type(error).__name__}: {message}\n")
            return 1
    except KeyboardInterrupt:
        # The command's own cleanup has run: connections closed, a claimed row left in flight
        # for the retry after its lease.
        return _interrupted("service.py" + (f" {command}" if command else ""))


def _serve(args):
    def stopped(number, frame):
        # At once: a request inside its transaction is rolled back by SQLite, and one committed
        # but not yet answered is a lost response, which its retry recovers.
        _interrupted("service.py serve")
        os._exit(130)
    _stop_on_signals(stopped)
    server = make_server(args.root, port=args.port, busy_timeout=args.busy_timeout,
                         read_timeout=args.read_timeout)
    host, port = server.server_address[:2]
    sys.stdout.write(f"http://{host}:{port}\n")
    sys.stdout.flush()
    server.serve_forever()
    return 0


def _wait_url(args):
    """The first line of FILE, once it is whole: where the service PID, started with its
    output there, listens.  The service gone first, or a line that is no URL: said on stderr,
    exit 1."""
    deadline = time.monotonic() + URL_WAIT
    while True:
        # Whether it ran before the file was read: a line it wrote before it ended is read.
        running = _running(args.pid)
        with open(args.file, "rb") as handle:
            line = handle.readline()
        if line.endswith(b"\n"):
            break
        if not running:
            raise ProcessLookupError(f"the service (pid {args.pid}) exited without saying where"
                                    " it listens")
        if time.monotonic() > deadline:
            raise OSError(f"{args.file} held no whole line after {URL_WAIT:g} s")
        time.sleep(0.05)
    text = line.decode("utf-8", "replace").strip()
    if not text.startswith("http://"):
        raise ValueError(f"the service said {text!r}, not where it listens")
    print(text)
    return 0


def _running(pid):
    """Whether process ``pid`` exists and has not ended: one that ended but was not yet waited
    for by its parent (a zombie) has ended, where /proc shows it (Linux)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        # Someone else's: it exists.
        pass
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            # pid (name) state ...: the name may hold spaces and parentheses.
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


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
    print(_dumps(answer))
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
    "wait-url": (_wait_url, "print the URL the service PID, started with its output in FILE,"
                 " listens on, once it has said so", ("file", "pid")),
    "request": (_request, "send one request and print the response", ("method", "url",
                                                                       "-H", "--json")),
    "dispatch": (_dispatch, "claim a due row of ROOT/sender.db and deliver it to the service at"
                 " URL (第一篇 §4-§6 over HTTP)", ("root", "url", "--now")),
}
ARGUMENTS = {
    "root": {"metavar": "ROOT", "help": "the folder of receiver.db, external.db"
             " (reliability.init(ROOT)) and plans.db (preconditions.init(ROOT/plans.db, ...))"},
    "file": {"metavar": "FILE", "help": "the service's output"},
    "pid": {"type": int, "metavar": "PID", "help": "the service's process ID ($! after"
            " serve ... &)"},
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


# What stops a command at the command line, as Ctrl-C does (SIGHUP: where the system has it).
STOPS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
              if hasattr(signal, name))


def _stop_on_signals(handler=None):
    """At the command line only: each of STOPS calls ``handler``, by default one that raises
    KeyboardInterrupt once and ignores the next ones, so that the command's cleanup runs to
    its end and main() says one line.  SIGINT stops it even where a background start ignores
    it; a SIGTERM or SIGHUP that is ignored (nohup) stays ignored."""
    def stop(number, frame):
        for each in STOPS:
            signal.signal(each, signal.SIG_IGN)
        raise KeyboardInterrupt
    for number in STOPS:
        if number == signal.SIGINT or signal.getsignal(number) is not signal.SIG_IGN:
            signal.signal(number, handler or stop)


def _interrupted(name):
    """Say ``name: interrupted`` on stderr where it still can be (a terminal that hung up cannot
    take it); the exit status of an interrupt."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"{name}: interrupted\n")
        sys.stderr.flush()
    return 130


if __name__ == "__main__":
    _stop_on_signals()
    status = main()
    # Said and done: a stop now changes nothing.
    for number in STOPS:
        signal.signal(number, signal.SIG_IGN)
    sys.exit(status)
