"""Rerun the articles' crash experiments with real processes and compare with results.json.

  python3 run_experiment.py                  run every scenario, one line each, then a verdict
  python3 run_experiment.py --check [PATH]   the same, then compare with PATH (results.json)
  python3 run_experiment.py --list           the scenarios, one line each
  python3 run_experiment.py --only NAME ...  a subset (with --check, only those are compared)
  python3 run_experiment.py --explain NAME   one scenario as a timeline of what each process did
  python3 run_experiment.py --json           the deterministic results on stdout
  python3 run_experiment.py --output FILE    the deterministic results written to FILE
  python3 run_experiment.py --download 1 DIR article 1's five files in DIR (7: article 7's)
  python3 run_experiment.py reliability FUNCTION ARG...  one call by hand (see step())

Every scenario starts in a fresh temporary directory.  Crashes are real: a forked child calls
os._exit at a named boundary, and another process reads back what survived in the SQLite files.
Results hold statuses, exit codes, counts, quantities, revisions, digests and ids, never paths,
pids or timings, so a rerun reproduces them byte for byte.  With only one article's module here
(its download), only its scenarios run and are compared.  Exit status: 0 all good, 1 a mismatch,
a failed invariant or a failed write (one line), 2 bad usage, 130 interrupted: Ctrl-C, SIGTERM or
SIGHUP, one line on stderr, every child killed and its folder removed first.
"""
import sys

# One clear line, not a traceback, on an interpreter too old.
if sys.version_info < (3, 9):
    sys.stderr.write(f"run_experiment.py needs Python 3.9+, not {sys.version.split()[0]}\n")
    sys.exit(2)

import os
import signal

# What stops a run at the command line, as Ctrl-C does (SIGHUP: where the system has it).
STOPS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
              if hasattr(signal, name))


def on_stops(handler):
    """``handler`` for each of STOPS: SIGINT even where a background start ignores it; a SIGTERM
    or SIGHUP that is ignored (nohup) stays ignored."""
    for number in STOPS:
        if number == signal.SIGINT or signal.getsignal(number) is not signal.SIG_IGN:
            signal.signal(number, handler)


def _stopped_early(number, frame):
    os.write(2, b"run_experiment.py: interrupted\n")
    os._exit(130)


# A stop while the modules below load ends at once, in one line: nothing has started yet.
if __name__ == "__main__":
    on_stops(_stopped_early)

import argparse
import contextlib
import functools
import inspect
import json
import random
import select
import shutil
import sqlite3
import tempfile
import threading
import time
import traceback

# The modules beside this script, also where ``python3 -I`` leaves its folder off the path.
# Article 1's download has only reliability.py, article 7's only preconditions.py.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import reliability
except ModuleNotFoundError:
    reliability = None
try:
    import preconditions
except ModuleNotFoundError:
    preconditions = None

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results.json")
# Seconds: only stops a hung child, never paces a scenario.
WATCHDOG = 60.0
# The modules here, by file name; None where this download lacks one.
MODULES = {"reliability.py": reliability, "preconditions.py": preconditions}
# The crash matrix.  Each named boundary of reliability.py (a crash_point line, in the order a
# request meets them): the process that meets it, and the deliveries it is crashed in.  A test
# keeps it equal to the module's crash_point lines.
BOUNDARIES = {
    "before_intent_commit": ("enqueue", ("idempotent", "external")),
    "after_intent_commit": ("enqueue", ("idempotent", "external")),
    "after_claim": ("dispatch", ("idempotent", "external")),
    "before_receiver_commit": ("receiver", ("idempotent", "naive")),
    "after_receiver_commit": ("receiver", ("idempotent", "naive")),
    "after_response_write": ("receiver", ("idempotent", "naive")),
    "after_response_before_ack": ("dispatch", ("idempotent", "external")),
    "after_ack": ("dispatch", ("idempotent", "external")),
    "before_external_effect": ("external", ("external",)),
    "after_external_effect": ("external", ("external",)),
    "after_mark_before_send": ("unsafe_dispatch_mark_before", ("mark_before",)),
}
# preconditions.py's, with the exit code of each (第七篇 §6).
EXIT_CODES = preconditions.EXIT_CODES if preconditions is not None else {}
CALLER, KEY = "agent", "ticket-1"
PAYLOAD = {"title": "Synthetic documentation ticket", "body": "No real service is called."}
PLAN = {"src": "A", "dst": "B", "amount": 3, "expected": {"A": 1, "B": 1}}
# name -> (group, description, function), in article order, for the modules present.
SCENARIOS = {}
HEADINGS = {
    "article_1": "Article 1: the tool did the work but the receipt was lost",
    "open_ends": "Beyond article 1: leaving unknown, and receipts that are not kept forever",
    "article_7": "Article 7: no duplicate execution, yet still wrong",
    "crash_matrix": "Crash matrix: every named boundary of "
                    + " and ".join(name for name, module in MODULES.items() if module)
                    + ", in every mode it applies to"}
# Each article's five files: its module and its tests, with the driver, results.json, README.md.
DOWNLOADS = {"1": ("reliability.py", "test_reliability.py"),
             "7": ("preconditions.py", "test_preconditions.py")}


def module_of(group, name=""):
    """The module a scenario of ``group`` runs, None where this download lacks it: preconditions
    for article 7 and its crash-matrix cells (named preconditions/...), else reliability."""
    return preconditions if article_of(group, name) == "7" else reliability


def article_of(group, name=""):
    """"7" for article 7's scenarios and crash-matrix cells, "1" for the others."""
    return "7" if group == "article_7" or name.startswith("preconditions/") else "1"


def scenario(article, description):
    """Register a scenario if its module is present."""
    def register(function):
        if module_of(article) is not None:
            SCENARIOS[function.__name__] = (article, description, function)
        return function
    return register


# --- article 1: reliability.py --------------------------------------------------------------
# Each scenario crashes a real process at a named boundary, recovers in a new one from what
# was committed, and records what the three databases hold at each stage.  A scenario may
# return its console line's figures; summary() says the rest.

@scenario("article_1", "naive receiver commits, reply lost; the retry at tick 11 issues a"
          " second ticket")
def naive_lost_ack(run):
    final = lost_ack(run, "naive")
    run.expect("tickets", (run.stages["after_lost_ack"]["receiver_tickets"],
                           final["receiver_tickets"]), (1, 2))


@scenario("article_1", "sender records done before sending and dies: the ticket is never"
          " created")
def mark_before_send_loses_task(run):
    enqueue(run, "mark_before")
    observe(run, "after_crash", sender_child(run, "unsafe_dispatch_mark_before", 0,
                                             crash="after_mark_before_send"))
    final = observe(run, "after_restart", dispatch(run, 11, lane="recovery"))
    run.expect("sender state and tickets", pick(final, "sender_state", "receiver_tickets"),
               ("done", 0))


@scenario("article_1", "idempotent receiver commits, reply lost; the replay returns the same"
          " ticket")
def idempotent_lost_ack(run):
    final = lost_ack(run, "idempotent")
    run.expect("tickets", (run.stages["after_lost_ack"]["receiver_tickets"],
                           final["receiver_tickets"]), (1, 1))
    run.expect("replayed ticket id", final["response"]["ticket_id"], 1)


@scenario("article_1", "enqueue dies before COMMIT: nothing was accepted; the upstream retry"
          " delivers once")
def before_intent_commit(run):
    enqueue_crash(run, "before_intent_commit", kept=("absent", 0), retry="accepted")


@scenario("article_1", "enqueue dies after COMMIT, caller never heard 'accepted': the retry"
          " adds no row")
def after_intent_commit(run):
    enqueue_crash(run, "after_intent_commit", kept=("pending", 1), retry="duplicate")


@scenario("article_1", "sender dies after claiming: once the lease ends, attempt 2 delivers")
def after_claim(run):
    enqueue(run)
    first = observe(run, "after_crash", sender_child(run, "dispatch", 0, crash="after_claim"))
    early = observe(run, "before_lease_expiry", dispatch(run, 9, lane="recovery"))
    final = observe(run, "after_recovery", dispatch(run, 11, lane="recovery"))
    run.expect("lease holds until tick 10", (first["attempts"], early["attempts"]), (1, 1))
    run.expect("outcome", pick(final, "sender_state", "attempts", "receiver_tickets"),
               ("done", 2, 1))


@scenario("article_1", "receiver dies before COMMIT: SQLite recovery drops ticket and receipt"
          " together")
def before_receiver_commit(run):
    enqueue(run)
    first = observe(run, "after_crash", dispatch(run, 0, "before_receiver_commit"))
    final = observe(run, "after_recovery", dispatch(run, 11, lane="recovery"))
    run.expect("nothing committed", pick(first, "receiver_tickets", "receiver_receipts"), (0, 0))
    run.expect("outcome", pick(final, "sender_state", "attempts", "receiver_tickets"),
               ("done", 2, 1))


@scenario("article_1", "reply flushed to the pipe, then the receiver exits 73: the reply still"
          " counts")
def after_response_write(run):
    enqueue(run)
    first = observe(run, "after_crash", dispatch(run, 0, "after_response_write"))
    final = observe(run, "after_restart", dispatch(run, 11, lane="recovery"))
    run.expect("done on the first attempt", pick(first, "sender_state", "attempts", "exit_codes"),
               ("done", 1, [reliability.CRASH_EXIT]))
    run.expect("restart sends nothing", pick(final, "attempts", "receiver_tickets"), (1, 1))


@scenario("article_1", "sender read the reply but died before recording it: the replay returns"
          " it again")
def after_response_before_ack(run):
    enqueue(run)
    first = observe(run, "after_crash", sender_child(run, "dispatch", 0,
                                                     crash="after_response_before_ack"))
    final = observe(run, "after_recovery", dispatch(run, 11, lane="recovery"))
    run.expect("ticket committed, not recorded", pick(first, "sender_state", "receiver_tickets"),
               ("inflight", 1))
    run.expect("outcome", pick(final, "sender_state", "attempts", "receiver_tickets")
               + (final["response"]["ticket_id"],), ("done", 2, 1, 1))


@scenario("article_1", "sender dies after recording done: the restart sends nothing")
def after_ack(run):
    enqueue(run)
    first = observe(run, "after_crash", sender_child(run, "dispatch", 0, crash="after_ack"))
    final = observe(run, "after_restart", dispatch(run, 11, lane="recovery"))
    run.expect("done before the crash", first["sender_state"], "done")
    run.expect("restart sends nothing", pick(final, "attempts", "receiver_tickets"), (1, 1))


@scenario("article_1", "same key, different payload: the receiver refuses, the ticket is"
          " unchanged")
def mismatched_payload(run):
    enqueue(run)
    observe(run, "after_delivery", dispatch(run, 0))
    changed = dict(PAYLOAD, title="A different ticket")
    launch = tool_launcher(run)
    request = {"caller": CALLER, "key": KEY, "mode": "idempotent", "payload": changed,
               "issued_at": 0, "now": 0}
    answer, code, _ = reliability.call_tool(run.root, request, start=launch)
    heard(launch.started, "child")
    run.log("child", f"receiver child answered {answer.get('error')} and exited {code}")
    run.inject("same key, other payload")
    final = observe(run, "after_mismatch", [code])
    run.stages["after_mismatch"]["refusal"] = answer.get("error")
    run.expect("refusal", answer.get("error"), "conflict")
    run.expect("ticket unchanged", (final["receiver_tickets"], final["response"]["ticket_id"]),
               (1, 1))
    return f"same key, other payload: {answer.get('error')}; {summary(run)}"


@scenario("article_1", "8 processes race to claim; a stale attempt's acknowledgement is refused")
def concurrent_claim(run):
    enqueue(run)
    with watched(run) as children:
        children += [spawn(run, answer, claimer, (run.root, 0)) for _ in range(8)]
        released, claims = race(children)
    winners = [row for row in claims if row is not None]
    run.inject("8 claimer processes released together, a late ack from attempt 1")
    run.log("sender", f"8 claimer processes at tick 0: {len(winners)} won attempt "
            f"{[w['attempt'] for w in winners]}")
    codes = [child.returncode for child in children]
    observe(run, "after_race", codes)["released_together"] = released
    with opened(run, reliability.SENDER) as (connection,):
        current = reliability.claim(connection, 11)
    run.log("recovery", f"tick 11: lease expired, claimed attempt {current['attempt']}")
    stale = delivered(run, reliability.deliver, dict(winners[0], now=11))
    refused = "accepted" if stale["acknowledged"] else "refused"
    run.log("sender", f"old attempt 1 delivers late: receiver answered, acknowledgement"
            f" {refused}")
    observe(run, "after_stale_ack", [stale["exit_code"]])
    result = delivered(run, reliability.deliver, current)
    done = "recorded done" if result["acknowledged"] else "refused"
    run.log("recovery", f"attempt {current['attempt']} delivers: ticket"
            f" {result['response']['ticket_id']}, {done}")
    final = observe(run, "after_recovery", [result["exit_code"]])
    run.stages["after_race"]["claim_winners"] = len(winners)
    run.stages["after_stale_ack"]["stale_ack"] = refused
    run.expect("winners", len(winners), 1)
    run.expect("stale acknowledgement", refused, "refused")
    run.expect("outcome", pick(final, "sender_state", "attempts", "receiver_tickets"),
               ("done", 2, 1))
    return (f"{len(winners)} of 8 claimers won; attempt 1's late acknowledgement {refused};"
            f" {summary(run)}")


@scenario("article_1", "8 receiver processes get the same request: one ticket, one receipt,"
          " one answer")
def concurrent_receiver(run):
    request = json.dumps({"caller": CALLER, "key": KEY, "payload": PAYLOAD, "issued_at": 0,
                          "now": 0})
    database = os.path.join(run.root, reliability.RECEIVER)
    observe(run, "before_race")
    with watched(run) as children:
        children += [spawn(run, racing_receiver, database) for _ in range(8)]
        released, answers = race(children, request)
    responses = {json.dumps(answer, sort_keys=True) for answer in answers}
    run.log("child", f"8 receiver processes answered with {len(responses)} distinct response(s)")
    run.inject("8 receiver processes released together, one request")
    final = observe(run, "after_race", [child.returncode for child in children])
    final.update(distinct_responses=len(responses), released_together=released)
    run.expect("outcome", pick(final, "receiver_tickets", "receiver_receipts",
                               "distinct_responses"), (1, 1, 1))
    return (f"8 receivers, one request: {final['receiver_tickets']} ticket,"
            f" {final['receiver_receipts']} receipt, {len(responses)} distinct answer")


@scenario("article_1", "non-idempotent tool dies before acting: unknown, no automatic retry")
def before_external_effect(run):
    external_crash(run, "before_external_effect")
    final = observe(run, "after_restart", dispatch(run, 11, lane="recovery"))
    run.expect("outcome", pick(final, "sender_state", "attempts", "external_tickets"),
               ("unknown", 1, 0))


@scenario("article_1", "non-idempotent tool dies after acting: unknown too, the sender cannot"
          " tell")
def after_external_effect(run):
    external_crash(run, "after_external_effect")
    final = observe(run, "after_restart", dispatch(run, 11, lane="recovery"))
    run.expect("outcome", pick(final, "sender_state", "attempts", "external_tickets"),
               ("unknown", 1, 1))


@scenario("article_1", "counterexample: retrying an unknown call anyway leaves two external"
          " tickets")
def unsafe_external_retry(run):
    external_crash(run, "after_external_effect")
    answer, code, _ = delivered(run, reliability.unsafe_retry_unknown, CALLER, KEY)
    run.log("recovery", f"UNSAFE: called the external tool again despite unknown: ticket"
            f" {answer['ticket_id']}")
    run.inject("forced retry")
    final = observe(run, "after_unsafe_retry", [code])
    run.expect("duplicate", final["external_tickets"], 2)


# --- what article 1's scenarios call ----------------------------------------------------------

def lost_ack(run, mode):
    enqueue(run, mode)
    observe(run, "after_lost_ack", dispatch(run, 0, "after_receiver_commit"))
    final = observe(run, "after_recovery", dispatch(run, 11, lane="recovery"))
    run.expect("exit code of the receiver", run.stages["after_lost_ack"]["exit_codes"],
               [reliability.CRASH_EXIT])
    run.expect("sender state", pick(final, "sender_state", "attempts"), ("done", 2))
    return final


def enqueue_crash(run, boundary, kept, retry):
    """enqueue dies at ``boundary``; ``kept`` is (sender state, intent rows) after it, ``retry``
    the retry's answer; then a new process retries enqueue with the same key, as the upstream
    caller would, and delivers."""
    first = observe(run, "after_crash", sender_child(run, "enqueue", CALLER, KEY, PAYLOAD, 0,
                                                     "idempotent", crash=boundary))
    run.expect("what the crash kept", pick(first, "sender_state", "intent_rows"), kept)
    status = enqueue(run, lane="recovery")
    final = observe(run, "after_recovery", dispatch(run, 11, lane="recovery"))
    final["retry"] = status
    run.expect("exit code", first["exit_codes"], [reliability.CRASH_EXIT])
    run.expect("outcome", pick(final, "sender_state", "intent_rows", "receiver_tickets"),
               ("done", 1, 1))
    run.expect("retry status", status, retry)


def external_crash(run, boundary):
    enqueue(run, "external")
    first = observe(run, "after_crash", dispatch(run, 0, boundary))
    run.expect("unknown, not retried", first["sender_state"], "unknown")
    return first


def pick(observation, *names):
    """The named figures of an observation, in order, for run.expect()."""
    return tuple(observation[name] for name in names)


def observe(run, stage, exit_codes=()):
    """Record what the three databases hold now for the scenario's request."""
    seen = {}
    for name in reliability.KINDS:
        with reader(os.path.join(run.root, name)) as connection:
            seen[name] = reliability.snapshot(connection)
    rows = [row for row in seen[reliability.SENDER]["outbox"]
            if (row["caller"], row["key"]) == (CALLER, KEY)]
    # No outbox row yet: the request is "absent", as article 1's download records it.
    row = rows[0] if rows else {"state": "absent", "attempts": 0, "response": None}
    observation = {
        "sender_state": row["state"], "attempts": row["attempts"],
        "intent_rows": seen[reliability.SENDER]["intent_rows"],
        "receiver_tickets": seen[reliability.RECEIVER]["tickets"],
        "receiver_receipts": len(seen[reliability.RECEIVER]["receipts"]),
        "external_tickets": len(seen[reliability.EXTERNAL]["tickets"]),
        "response": row["response"], "exit_codes": list(exit_codes),
    }
    run.stages[stage] = observation
    run.log("observer", f"{stage}: sender {row['state']} (attempts {row['attempts']}), receiver"
            f" tickets {observation['receiver_tickets']}, receipts"
            f" {observation['receiver_receipts']}, external tickets"
            f" {observation['external_tickets']}")
    return observation


def enqueue(run, mode="idempotent", lane="sender", payload=PAYLOAD):
    """The intent; modes "naive" and "mark_before" are idempotent intents that an UNSAFE
    receiver or an UNSAFE sender will handle."""
    with opened(run, reliability.SENDER) as (connection,):
        status = reliability.enqueue(connection, CALLER, KEY, payload, now=0,
                                     mode="external" if mode == "external" else "idempotent")
    run.mode = mode
    run.log(lane, f"enqueue {KEY} ({mode}): {status}, intent and outbox row committed together")
    return status


def dispatch(run, now, crash=None, lane="sender"):
    """The driver as the sender: claim, call the tool child (dying at ``crash``), record;
    returns the child's exit codes."""
    launch, result = tool_launcher(run, crash, naive=run.mode == "naive"), None
    try:
        with opened(run, reliability.SENDER) as (connection,):
            result = reliability.dispatch(connection, run.root, now, start=launch)
    finally:
        if result is not None:
            run.log(lane, f"tick {now}: claimed attempt {result['attempt']} and called the tool")
        # What the tool child said, a crash included.
        heard(launch.started, "child")
    if result is None:
        run.log(lane, f"tick {now}: nothing due, nothing sent")
        return []
    if crash:
        run.inject(f"{crash} (exit {result['exit_code']})")
    run.log("child", f"tool child exited {result['exit_code']}")
    response = result["response"]
    if not response:
        answer = "no valid response"
    else:
        answer = (f"a refusal ({response['error']})" if "error" in response
                  else f"ticket {response['ticket_id']}")
    done = "recorded done" if result["acknowledged"] else "nothing recorded as done"
    run.log(lane, f"got {answer}, {done}")
    return [result["exit_code"]]


@contextlib.contextmanager
def opened(run, *names):
    """The named databases of the scenario's folder, open for the with block."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(contextlib.closing(
            reliability.connect(os.path.join(run.root, name)))) for name in names]


def delivered(run, act, *args):
    """reliability's ``act`` on sender.db in this process, with the run's tool children; what
    they said goes into its timeline."""
    launch = tool_launcher(run)
    try:
        with opened(run, reliability.SENDER) as (connection,):
            return act(connection, run.root, *args, start=launch)
    finally:
        heard(launch.started, "child")


def sender_child(run, act, *args, crash):
    """A sender that dies for real: reliability's ``act`` in a child process armed at
    ``crash``."""
    code, _ = run_child(run, send, run.root, act, *args, crash=crash)
    run.log("sender", f"sender process ran {act} to {crash} and exited {code}")
    run.inject(f"{crash} (exit {code})")
    return [code]


# --- beyond article 1: leaving unknown, and receipts that are not kept forever --------------

@scenario("open_ends", "unknown after the tool acted: the tool's own records settle it as done,"
          " no second call")
def reconcile_found(run):
    external_crash(run, "after_external_effect")
    with opened(run, reliability.SENDER, reliability.EXTERNAL) as (sender, tool):
        result = reliability.reconcile(sender, tool, CALLER, KEY, 11)
    run.log("recovery", f"tick 11: reconcile looks the key up in the tool: {result['status']}")
    run.inject("reconcile")
    observe(run, "after_reconcile")
    final = observe(run, "after_restart", dispatch(run, 12, lane="recovery"))
    run.expect("settled from the tool's records",
               pick(final, "sender_state", "attempts", "external_tickets")
               + (final["response"]["ticket_id"],), ("done", 1, 1, 1))


@scenario("open_ends", "unknown before the tool acted: absence proven once nobody can act,"
          " retried once")
def reconcile_absent(run):
    external_crash(run, "before_external_effect")
    with opened(run, reliability.SENDER, reliability.EXTERNAL) as (sender, tool):
        early = reliability.reconcile(sender, tool, CALLER, KEY, 5)
        late = reliability.reconcile(sender, tool, CALLER, KEY, 11)
    run.log("recovery", f"tick 5: reconcile says {early['status']} (the lease runs to tick 10)")
    run.log("recovery", f"tick 11: reconcile says {late['status']} (lease over, processes gone,"
            " no ticket)")
    run.inject("reconcile")
    observe(run, "after_reconcile")["reconciled"] = [early["status"], late["status"]]
    final = observe(run, "after_retry", dispatch(run, 11, lane="recovery"))
    run.expect("reconcile", [early["status"], late["status"]], ["unknown", "pending"])
    run.expect("one retry, one ticket",
               pick(final, "sender_state", "attempts", "external_tickets"), ("done", 2, 1))


@scenario("open_ends", "a person settles an unknown row: decision and audit row in one"
          " transaction, never rewritten")
def manual_resolution(run):
    external_crash(run, "after_external_effect")
    with opened(run, reliability.SENDER, reliability.EXTERNAL) as (sender, tool):
        evidence = reliability.lookup_external(tool, CALLER, KEY)[0]
        # The attempt the operator looks at: the decision is about that one.
        attempt = next(row["attempts"] for row in reliability.snapshot(sender)["outbox"]
                       if (row["caller"], row["key"]) == (CALLER, KEY))
        result = reliability.resolve(sender, CALLER, KEY, "done", attempt=attempt,
                                     by="operator", why="ticket seen in the tool's own interface",
                                     evidence=evidence)
        try:
            with reliability.transaction(sender):
                sender.execute("UPDATE resolutions SET reason = 'edited later'")
            rewrite = "accepted"
        except sqlite3.IntegrityError:
            rewrite = "refused"
        audit = sender.execute("SELECT decision, decided_by, attempt FROM resolutions").fetchall()
    run.log("recovery", f"operator resolves as done with ticket {evidence['ticket_id']};"
            f" rewriting the audit row: {rewrite}")
    run.inject("resolve by hand")
    final = observe(run, "after_resolution")
    final.update(decisions=[list(row) for row in audit], audit_rewrite=rewrite)
    run.expect("resolved", (result["status"],) + pick(final, "sender_state", "external_tickets"),
               ("done", "done", 1))
    run.expect("audit", (len(audit), rewrite), (1, "refused"))


@scenario("open_ends", "receipts purged with a low-water mark: the late replay is refused as"
          " expired, 1 ticket")
def late_replay_after_purge(run):
    final = late_replay(run, lambda receiver: reliability.purge(receiver, 100, 50))
    run.expect("refused, not repeated", (final["sender_state"], final["response"]["error"],
                                         final["receiver_tickets"]), ("blocked", "expired", 1))


@scenario("open_ends", "counterexample: receipts deleted without the mark, the late replay"
          " issues a second ticket")
def late_replay_without_policy(run):
    final = late_replay(run, lambda receiver: {
        "deleted": reliability.unsafe_delete_receipts(receiver, 50)})
    run.expect("duplicated", pick(final, "sender_state", "receiver_tickets"), ("done", 2))


def late_replay(run, purge):
    enqueue(run)
    observe(run, "after_lost_ack", dispatch(run, 0, "after_receiver_commit"))
    with opened(run, reliability.RECEIVER) as (receiver,):
        purged = purge(receiver)
    run.log("receiver", f"tick 100: receipts older than tick 50 deleted: {purged}")
    run.inject("purge" if "low_water" in purged else "receipts deleted")
    observe(run, "after_purge")
    return observe(run, "after_late_replay", dispatch(run, 100, lane="recovery"))


# --- article 7: preconditions.py ------------------------------------------------------------
# The article's initial state, A = 10 and B = 0 at revision 1, and its plan: 3 from A to B.

@scenario("article_7", "unsafe check-then-act: the plan is checked, B changes, the old plan is"
          " applied")
def unsafe_check_then_act(run):
    transfer_start(run)
    ready, code, result = paused_child(run, unsafe=True)
    final = transfer_state(run, "after_go", status=result["status"], exit_code=code)
    run.expect("handshake", ready, "READY")
    run.expect("the bug", (final["quantities"], final["effects"]), ({"A": 7, "B": 5}, 1))


@scenario("article_7", "the same interleaving against the safe entry: stale, nothing moved")
def safe_stale_rejected(run):
    transfer_start(run)
    ready, code, result = paused_child(run)
    final = transfer_state(run, "after_go", status=result["status"],
                           observed=result.get("observed"), exit_code=code)
    run.expect("handshake", ready, "READY")
    run.expect("stale", (result["status"], result.get("observed")), ("stale", {"A": 1, "B": 2}))
    run.expect("nothing moved", (final["quantities"], final["effects"]), ({"A": 10, "B": 2}, 0))


@scenario("article_7", "applied, reply lost: the identical retry is replayed, not stale")
def lost_ack_replay(run):
    transfer_start(run)
    first = execute(run, "job-1")
    transfer_state(run, "after_first", status=first["status"])
    run.inject("first reply discarded")
    retry = execute(run, "job-1", lane="retry")
    final = transfer_state(run, "after_retry", status=retry["status"], result=retry.get("result"))
    run.expect("statuses", (first["status"], retry["status"]), ("applied", "replayed"))
    run.expect("history returned", retry.get("result"), first)
    run.expect("one effect", (final["revisions"], final["effects"]), ({"A": 2, "B": 2}, 1))
    return f"{first['status']}, then the same op {retry['status']}: {summary(run)}"


@scenario("article_7", "after stale, a refreshed plan under the old ID is conflict; under a new"
          " ID it applies")
def replan_new_id(run):
    transfer_start(run)
    change(run, "B", 2)
    first = execute(run, "job-1")
    transfer_state(run, "after_stale", status=first["status"], observed=first.get("observed"))
    replanned = dict(PLAN, expected=first["observed"])
    same_id = execute(run, "job-1", replanned, lane="planner")
    transfer_state(run, "after_same_id", status=same_id["status"])
    new_id = execute(run, "job-2", replanned, lane="planner")
    final = transfer_state(run, "after_new_id", status=new_id["status"])
    run.expect("statuses", (first["status"], same_id["status"], new_id["status"]),
               ("stale", "conflict", "applied"))
    run.expect("one effect", (final["quantities"], final["effects"]), ({"A": 7, "B": 5}, 1))
    return (f"{first['status']}; the new plan under job-1 {same_id['status']}, under job-2"
            f" {new_id['status']}: {summary(run)}")


@scenario("article_7", "ABA: A goes 10 -> 9 -> 10, its revision is 3, the old plan is stale")
def aba_revision(run):
    transfer_start(run)
    change(run, "A", -1)
    change(run, "A", 1)
    result = execute(run, "job-1")
    final = transfer_state(run, "after_execute", status=result["status"],
                           observed=result.get("observed"))
    run.expect("A looks unchanged", (final["quantities"]["A"], final["revisions"]["A"]), (10, 3))
    run.expect("stale", (result["status"], final["effects"]), ("stale", 0))
    return (f"A = {final['quantities']['A']} again but at revision {final['revisions']['A']}:"
            f" {summary(run)}")


@scenario("article_7", "os._exit at three boundaries (71, 72, 73); each retry from a new process")
def crash_points(run):
    for boundary in preconditions.EXIT_CODES:
        # A fresh database per boundary.
        run.db = os.path.join(run.dir, boundary + ".db")
        transfer_start(run)
        code, _ = run_child(run, executor, run.db, "job-1", PLAN, crash=boundary)
        run.log("executor", f"child ran to {boundary} and exited {code}")
        run.inject(f"{boundary} (exit {code})")
        crashed = transfer_state(run, f"{boundary}.after_crash", exit_code=code)
        retry_code, retry = run_child(run, executor, run.db, "job-1", PLAN)
        run.log("retry", f"new process retries job-1: {retry['status']}")
        final = transfer_state(run, f"{boundary}.after_retry", status=retry["status"],
                               exit_code=retry_code)
        run.expect(f"{boundary} exit code", code, preconditions.EXIT_CODES[boundary])
        committed = boundary == "after_commit"
        run.expect(f"{boundary} survivors", pick(crashed, "quantities", "effects", "receipts"),
                   ({"A": 7, "B": 3}, 1, 1) if committed else ({"A": 10, "B": 0}, 0, 0))
        run.expect(f"{boundary} retry", (retry["status"], final["effects"]),
                   ("replayed" if committed else "applied", 1))
    retries = [run.stages[f"{b}.after_retry"]["status"] for b in preconditions.EXIT_CODES]
    return f"retries after 71, 72, 73: {', '.join(retries)}; {summary(run)}"


@scenario("article_7", "a stale rejection is committed, then the child exits; the retry reads it"
          " back")
def stale_rejection_durable(run):
    transfer_start(run)
    change(run, "B", 2)
    code, _ = run_child(run, executor, run.db, "job-1", PLAN, crash="after_commit")
    run.log("executor", f"child stored its stale rejection and exited {code}")
    run.inject(f"after_commit (exit {code})")
    transfer_state(run, "after_crash", exit_code=code)
    retry_code, retry = run_child(run, executor, run.db, "job-1", PLAN)
    stored = retry.get("result", {}).get("status")
    run.log("retry", f"new process retries job-1: {retry['status']} {stored}")
    final = transfer_state(run, "after_retry", status=retry["status"], stored_status=stored,
                           exit_code=retry_code)
    run.expect("exit code", code, preconditions.EXIT_CODES["after_commit"])
    run.expect("replayed rejection", (retry["status"], stored, final["effects"]),
               ("replayed", "stale", 0))
    return (f"{stored} stored, then exit {code}; the retry: {retry['status']} {stored};"
            f" {summary(run)}")


@scenario("article_7", "test-only triggers abort the destination update, then the receipt:"
          " nothing half-applied")
def trigger_faults(run):
    transfer_start(run)
    triggers = {
        "destination_update": "CREATE TRIGGER fault BEFORE UPDATE ON resources"
                              " WHEN NEW.name = 'B'"
                              " BEGIN SELECT RAISE(ABORT, 'injected destination fault'); END",
        "receipt_insert": "CREATE TRIGGER fault BEFORE INSERT ON receipt"
                          " BEGIN SELECT RAISE(ABORT, 'injected receipt fault'); END",
    }
    for where, sql in triggers.items():
        with contextlib.closing(preconditions.connect(run.db)) as connection:
            connection.execute(sql)
            try:
                preconditions.execute(connection, "job-1", PLAN, issued_at=0, now=0)
                error = None
            except sqlite3.DatabaseError as caught:
                error = type(caught).__name__
            connection.execute("DROP TRIGGER fault")
        run.log("parent", f"trigger on {where}: execute raised {error}")
        run.inject(f"trigger on {where}")
        final = transfer_state(run, f"{where}_fault", error=error)
        run.expect(f"{where} raised", error is not None, True)
        run.expect(f"{where} nothing half-applied",
                   pick(final, "quantities", "revisions", "effects", "receipts"),
                   ({"A": 10, "B": 0}, {"A": 1, "B": 1}, 0, 0))
    errors = [run.stages[f"{where}_fault"]["error"] for where in triggers]
    return (f"both faults raised {', '.join(map(str, errors))}, nothing half-applied:"
            f" {summary(run)}")


@scenario("article_7", "16 different IDs with the same snapshot from 8 threads: 1 applied,"
          " 15 stale")
def concurrent_distinct_ops(run):
    transfer_start(run)
    race = threaded(run, [f"job-{i}" for i in range(16)])
    final = transfer_state(run, "after_race", **race)
    run.expect("statuses", race["statuses"], {"applied": 1, "stale": 15})
    run.expect("one effect", final["effects"], 1)


@scenario("article_7", "16 submissions of one ID from 8 threads: 1 applied, 15 replayed")
def concurrent_same_op(run):
    transfer_start(run)
    race = threaded(run, ["job-1"] * 16)
    final = transfer_state(run, "after_race", **race)
    run.expect("statuses", race["statuses"], {"applied": 1, "replayed": 15})
    run.expect("one effect", final["effects"], 1)


@scenario("article_7", "counterexample: C changes but the plan declared only A and B, so it"
          " applies")
def undeclared_dependency(run):
    transfer_start(run, A=10, B=0, C=5)
    change(run, "C", -1)
    result = execute(run, "job-1")
    final = transfer_state(run, "after_execute", status=result["status"])
    run.expect("applies", (result["status"], final["quantities"]),
               ("applied", {"A": 7, "B": 3, "C": 4}))


# --- what article 7's scenarios call ----------------------------------------------------------

def transfer_state(run, stage, **extra):
    """Record quantities, revisions, effects and receipts of the transfer database now."""
    with reader(run.db) as connection:
        seen = preconditions.snapshot(connection)
    resources = seen["resources"]
    observation = {"quantities": {n: r["quantity"] for n, r in resources.items()},
                   "revisions": {n: r["revision"] for n, r in resources.items()},
                   "effects": seen["effects"], "receipts": seen["receipts"], **extra}
    run.stages[stage] = observation
    held = ", ".join(f"{n} = {r['quantity']}@{r['revision']}" for n, r in resources.items())
    run.log("observer", f"{stage}: {held}, effects {seen['effects']}, receipts"
            f" {seen['receipts']}")
    return observation


def transfer_start(run, **resources):
    resources = resources or {"A": 10, "B": 0}
    preconditions.init(run.db, resources)
    run.log("parent", "start: " + ", ".join(f"{n} = {q}@1" for n, q in resources.items()))


def execute(run, op, command=PLAN, lane="parent"):
    with contextlib.closing(preconditions.connect(run.db)) as connection:
        result = preconditions.execute(connection, op, command, issued_at=0, now=0)
    run.log(lane, f"execute {op} expecting {command['expected']}: {result['status']}")
    return result


def change(run, name, delta, lane="parent", inject=True):
    """Another business write, under an op id of its own."""
    run.changes = getattr(run, "changes", 0) + 1
    with contextlib.closing(preconditions.connect(run.db)) as connection:
        result = preconditions.change(connection, f"change-{run.changes}", name, delta,
                                      issued_at=0, now=0)
    run.log(lane, f"another write: {name} {delta:+d}")
    if inject:
        run.inject(f"{name} {delta:+d}")
    return result


def paused_child(run, unsafe=False):
    """READY/GO over pipes: the child stops where it says READY until the parent has written."""
    with watched(run) as children:
        children.append(spawn(run, answer, executor, (run.db, "job-1", PLAN, True, unsafe)))
        child = children[0]
        ready = child.readline().strip()
        run.log("executor", f"child says {ready}")
        run.inject("B +2 between READY and GO")
        change(run, "B", 2, inject=False)
        code, lines = finish(child, "GO\n")
    result = json.loads(lines[-1])
    run.log("executor", f"GO: child finished with {result['status']} and exited {code}")
    return ready, code, result


def race_in_threads(db, ops):
    """8 threads, each with its own connection, submit ``ops`` with the same snapshot's plan,
    started together at a barrier once all 8 have connected: the statuses counted, and how
    many threads the barrier released together.
    """
    statuses, released, lock = [], [], threading.Lock()
    # The time-out only stops a hung run.
    barrier = threading.Barrier(8, timeout=WATCHDOG)

    def worker(mine):
        with contextlib.closing(preconditions.connect(db)) as connection:
            # Each thread gets its own index, 0 to 7.
            released.append(barrier.wait())
            for op in mine:
                status = preconditions.execute(connection, op, PLAN, issued_at=0, now=0)["status"]
                with lock:
                    statuses.append(status)

    threads = [threading.Thread(target=worker, args=(ops[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"statuses": {status: statuses.count(status) for status in sorted(set(statuses))},
            "released_together": len(set(released))}


def threaded(run, ops):
    """The race in threads, run in a process of its own where fork is used: a process that has
    had threads must not fork again (Python 3.12 warns, and rightly)."""
    race = run_forked(race_in_threads, run.db, ops)
    run.log("parent", f"8 threads released together ({race['released_together']} at the"
            f" barrier), {len(ops)} submissions: {race['statuses']}")
    run.inject(f"8 threads released together, {len(ops)} submissions")
    run.expect("threads released together by the barrier", race["released_together"], 8)
    return race


# --- the crash matrix: every boundary of both modules, every mode it applies to ---------------

def delivery_cell(boundary, modes, run):
    """Per mode: crash at ``boundary`` in a real process, recover from this one at tick 11."""
    owner = BOUNDARIES[boundary][0]
    for mode in modes:
        fresh_root(run, os.path.join(run.dir, mode))
        if owner == "enqueue":
            codes = sender_child(run, "enqueue", CALLER, KEY, PAYLOAD, 0, mode, crash=boundary)
            # The upstream caller retries with the same key.
            enqueue(run, mode, lane="recovery")
        else:
            enqueue(run, mode)
            if owner in ("receiver", "external"):
                codes = dispatch(run, 0, boundary)
            else:
                codes = sender_child(run, owner, 0, crash=boundary)
        dispatch(run, 11, lane="recovery")
        final = observe(run, mode, codes)
        # The cell: the crash's exit code and what the recovery left.
        run.stages[mode] = {"exit_code": codes[0], "sender_state": final["sender_state"],
                            "attempts": final["attempts"], "tickets": final[
                                "external_tickets" if mode == "external" else "receiver_tickets"]}
        expect_cell(run, mode, run.stages[mode])


def expect_cell(run, mode, cell):
    """The invariant of a delivery mode after a crash at any boundary and a recovery."""
    state, tickets = cell["sender_state"], cell["tickets"]
    run.expect(f"{mode}: the crash happened", cell["exit_code"], reliability.CRASH_EXIT)
    if mode == "idempotent":
        run.expect(f"{mode}: exactly once", (state, tickets), ("done", 1))
    elif mode == "naive":
        run.expect(f"{mode}: delivered, perhaps twice", (state, tickets in (1, 2)), ("done", True))
    elif mode == "external":
        run.expect(f"{mode}: never retried automatically", (cell["attempts"], tickets <= 1),
                   (1, True))
        run.expect(f"{mode}: done only with its ticket, else unknown",
                   state == "unknown" or (state, tickets) == ("done", 1), True)
    else:
        run.expect(f"{mode}: the task is lost", (state, tickets), ("done", 0))


def transfer_cell(boundary, kinds, run):
    """Per kind: a fresh or a stale plan crashes at ``boundary``; a new process retries it."""
    committed = boundary == "after_commit"
    for kind in kinds:
        run.db = os.path.join(run.dir, f"{kind}.db")
        transfer_start(run)
        if kind == "stale":
            change(run, "B", 2)
        code, _ = run_child(run, executor, run.db, "job-1", PLAN, crash=boundary)
        crashed = transfer_state(run, f"{kind}.crashed")
        retry_code, retry = run_child(run, executor, run.db, "job-1", PLAN)
        stored = retry.get("result", retry)["status"]
        final = transfer_state(run, f"{kind}.retried")
        del run.stages[f"{kind}.crashed"], run.stages[f"{kind}.retried"]
        run.stages[kind] = {"exit_code": code, "effects_after_crash": crashed["effects"],
                            "retry": retry["status"], "outcome": stored,
                            "effects": final["effects"]}
        run.expect(f"{kind}: the crash happened", code, preconditions.EXIT_CODES[boundary])
        fresh = kind == "fresh"
        # The change that made a plan stale left a receipt of its own.
        run.expect(f"{kind}: all or nothing", (crashed["effects"], crashed["receipts"]),
                   (int(committed and fresh), int(committed) + (not fresh)))
        run.expect(f"{kind}: the retry answers", (retry_code, retry["status"], stored),
                   (0, "replayed" if committed else stored, "applied" if fresh else "stale"))


for _boundary, (_, _modes) in (BOUNDARIES.items() if reliability is not None else ()):
    SCENARIOS[f"reliability/{_boundary}"] = (
        "crash_matrix", f"crash at {_boundary}: " + ", ".join(_modes),
        functools.partial(delivery_cell, _boundary, _modes))
for _boundary in EXIT_CODES:
    # Only the commit of a stored rejection passes after_commit on the stale path.
    _kinds = ("fresh", "stale") if _boundary == "after_commit" else ("fresh",)
    SCENARIOS[f"preconditions/{_boundary}"] = (
        "crash_matrix", f"crash at {_boundary}: " + ", ".join(f"{k} plan" for k in _kinds),
        functools.partial(transfer_cell, _boundary, _kinds))


# --- the runner: each scenario in a folder of its own, one after another ---------------------

class Run:
    """A scenario's directory, its observed stages, its invariant failures and its timeline."""

    def __init__(self, name, directory):
        self.name, self.dir = name, directory
        # Reliability's three databases live here.
        self.root = directory
        # Preconditions' database.
        self.db = os.path.join(directory, "transfer.db")
        self.stages, self.failures, self.events, self.integrity, self.injected = {}, [], [], {}, []
        # The delivery mode of the scenario's request, for its summary.
        self.mode = None
        # What the scenario says on its console line, if it says more than summary().
        self.headline = None
        # Children started, for the names of the files their stderr goes to.
        self.spawned = 0

    def log(self, lane, text):
        self.events.append((lane, text))

    def inject(self, text):
        """Name a fault or an interleaving this run really caused, for its one-line summary."""
        if text not in self.injected:
            self.injected.append(text)

    def expect(self, label, observed, expected):
        if observed != expected:
            self.failures.append(f"{label}: expected {expected!r}, observed {observed!r}")


def run_scenario(name, base):
    article, _, function = SCENARIOS[name]
    directory = tempfile.mkdtemp(prefix=name.replace("/", "-") + "-", dir=base)
    run = Run(name, directory)
    run.template = os.path.join(base, "template")
    try:
        if article in ("article_1", "open_ends"):
            # A copy of databases that reliability.init created (and closed) moments ago.
            fresh_root(run, run.root)
        run.headline = function(run)
        check_integrity(run)
    # An invariant of the harness itself broke: report, never hide.
    except Exception as error:
        run.failures.append(f"{type(error).__name__}: {error}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return run


def fresh_root(run, root):
    """A copy of the three databases that reliability.init created (and closed) moments ago."""
    os.makedirs(root, exist_ok=True)
    for database in reliability.KINDS:
        shutil.copyfile(os.path.join(run.template, database), os.path.join(root, database))
    run.root = root


def check_integrity(run):
    """After the scenario's crashes, every database it left must pass SQLite's own checks."""
    for folder, _, files in sorted(os.walk(run.dir)):
        for path in sorted(os.path.join(folder, name) for name in files if name.endswith(".db")):
            # Read-only: the directory goes next, so no checkpoint.
            with reader(path) as connection:
                quick = connection.execute("PRAGMA quick_check").fetchall()
                keys = connection.execute("PRAGMA foreign_key_check").fetchall()
            name = os.path.relpath(path, run.dir)
            run.integrity[name] = "ok" if quick == [("ok",)] and not keys else f"{quick} {keys}"
            run.expect(f"integrity of {name}", run.integrity[name], "ok")


def reader(path):
    """A read-only connection for the observer, closed on leaving ``with``: it sees what was
    committed, and its close never checkpoints, so observing does not change how the next
    process finds the files."""
    escaped = os.path.abspath(path).replace("%", "%25").replace("?", "%3f").replace("#", "%23")
    uri = "file://" + escaped
    return contextlib.closing(sqlite3.connect(uri + "?mode=ro", uri=True, isolation_level=None))


def run_all(names):
    """Run scenarios one after another, each in a folder of its own under one temporary folder,
    which goes once they have; their Runs, in the order of ``names``."""
    base = tempfile.mkdtemp(prefix="reliability-experiment-")
    # This run's children only: the pid of one reaped earlier may name another process by now.
    FORKED.clear()
    try:
        if reliability is not None:
            reliability.init(os.path.join(base, "template"))
        return [run_scenario(name, base) for name in names]
    finally:
        end_forked()
        shutil.rmtree(base, ignore_errors=True)


# --- processes -------------------------------------------------------------------------------
# Every child is a real process forked from this (single-threaded) driver, a few milliseconds
# instead of a fresh interpreter's 30 or so: one of the driver's functions below, or the
# module's own tool child (reliability.tool_child), armed at a boundary or not.

def spawn(run, main, *args):
    """Fork a child that runs ``main(*args)`` and exits with what it returns; with ``run``, what
    it says on stderr goes to a file of that run, for heard(), else where this process's goes."""
    if run is None:
        return fork_child(main, args)
    run.spawned += 1
    said = os.path.join(run.dir, f"stderr-{run.spawned}")
    stderr = os.open(said, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        child = fork_child(main, args, stderr=stderr, group=True)
    finally:
        # The child has its own copy.
        os.close(stderr)
    child.run, child.said = run, said
    return child


def answer(function, args, crash=None):
    """In a child: arm the module that holds ``crash``, run ``function(*args)``, print its JSON."""
    for module, boundaries in ((reliability, BOUNDARIES), (preconditions, EXIT_CODES)):
        if module is not None and crash in boundaries:
            module.CRASH_AT = crash
    print(json.dumps(function(*args), ensure_ascii=False), flush=True)
    return 0


def ready_go():
    """READY/GO, the child's side of race(): say READY, then wait for GO on stdin."""
    sys.stdout.buffer.write(b"READY\n")
    sys.stdout.buffer.flush()
    line = sys.stdin.buffer.readline().decode("utf-8").strip()
    if line != "GO":
        raise ValueError(f"expected GO on stdin, got {line!r}")


def tool_launcher(run, crash=None, naive=False):
    """A launcher for reliability.call_tool: its tool child (reliability.tool_child) dies at
    ``crash``, or is the UNSAFE receiver without receipts: the sender's protocol is the same
    either way.  The children it started are in its ``started``, for heard()."""
    def launch(argv):
        argv = list(argv) + ([crash] if crash else [])
        launch.started.append(spawn(run, naive_tool_child if naive else reliability.tool_child,
                                    argv))
        return launch.started[-1]
    launch.started = []
    return launch


def naive_tool_child(argv):
    """The UNSAFE receiver without receipts, served as reliability.tool_child serves its tools."""
    reliability.CRASH_AT = argv[2] if len(argv) == 3 else None
    return reliability.serve(lambda c, r: reliability.unsafe_receive_without_receipt(
        c, r["caller"], r["key"], r["payload"]), argv[1])


# The experiment's children.  Each opens its own connections: none is inherited over a fork.

def send(root, act, *args):
    """A sender: reliability's ``act`` (enqueue, dispatch, unsafe_dispatch_mark_before) on
    sender.db; a boundary it is armed at goes on to its tool child, as the module passes it."""
    with contextlib.closing(reliability.connect(os.path.join(root, reliability.SENDER))) as c:
        if act == "enqueue":
            return reliability.enqueue(c, *args[:3], now=args[3], mode=args[4])
        return getattr(reliability, act)(c, root, *args, start=start_tool)


def start_tool(argv):
    """call_tool's ``start``: the module's tool child, forked; it says on stderr what it says
    where this process's stderr goes."""
    return spawn(None, reliability.tool_child, list(argv))


def claimer(root, now):
    """A claimer that claims once released by GO: the row, or None."""
    with contextlib.closing(reliability.connect(os.path.join(root, reliability.SENDER))) as c:
        ready_go()
        return reliability.claim(c, now)


def racing_receiver(database):
    """A receiver's tool child that, once it has read its request, waits for GO to receive."""
    return reliability.serve(lambda c, request: ready_go() or reliability.TOOLS["receive"](
        c, request), database)


def executor(db, op, command, pause=False, unsafe=False):
    """execute() of ``command`` as ``op``, held at READY/GO before its transaction where
    ``pause``; or the UNSAFE check-then-act, held between its check and its write."""
    with contextlib.closing(preconditions.connect(db)) as c:
        if unsafe:
            return preconditions.unsafe_check_then_act(c, op, command, pause=ready_go)
        if pause:
            ready_go()
        return preconditions.execute(c, op, command, issued_at=0, now=0)


def heard(children, lane="child"):
    """Put what finished children of a run said on stderr (a crash, an error) into its timeline."""
    for child in children:
        if child.run is not None and os.path.exists(child.said):
            with open(child.said, encoding="utf-8", errors="replace") as handle:
                for line in handle.read().splitlines():
                    child.run.log(lane, line)


def reap(children):
    """Kill any of ``children`` still running and reap every one: none is left behind."""
    for child in children:
        if child.returncode is None:
            child.kill()
            child.communicate()


@contextlib.contextmanager
def watched(run):
    """A list for the children of ``run`` started in the block: on leaving, whatever happened,
    any still running is killed, every one is reaped, and what each said is logged."""
    children = []
    try:
        yield children
    finally:
        reap(children)
        heard(children)


def race(children, request=None):
    """Release racing children together: each, given ``request`` (one line), says READY where it
    stands just before the protocol call, and none gets GO before every one has said it.
    Returns (how many stood at the barrier, each child's last line as JSON)."""
    for child in children:
        if request is not None:
            child.send(request + "\n")
    # Each readline() waits for that child's READY: it stands at the barrier.
    ready = [child.readline() for child in children]
    if ready != ["READY"] * len(children):
        raise RuntimeError(f"the racers did not all reach the barrier: {ready}")
    for child in children:
        child.send("GO\n")
    return len(ready), [json.loads(finish(child)[1][-1]) for child in children]


def finish(child, stdin_text=None):
    """Wait for a child (killing it at the watchdog); return (exit code, stdout lines)."""
    try:
        output, _ = child.communicate(stdin_text and stdin_text.encode("utf-8"), timeout=WATCHDOG)
    except TimeoutError:
        reap([child])
        raise RuntimeError(f"child {child.args} hung for {WATCHDOG} s and was killed")
    return child.wait(), output.decode("utf-8").splitlines()


def run_child(run, function, *args, crash=None):
    """Run one child of ``run`` to its end; (exit code, its JSON line or None)."""
    with watched(run) as children:
        children.append(spawn(run, answer, function, args, crash))
        code, lines = finish(children[0])
    return code, json.loads(lines[-1]) if lines else None


class ForkedChild:
    """Just enough of subprocess.Popen for a forked child: readline, send, communicate, kill,
    wait; with ``group``, kill() ends the process group it leads."""

    def __init__(self, pid, stdin_fd, stdout_fd, args, group):
        self.pid, self.args, self.group, self.returncode = pid, args, group, None
        self._stdin, self._stdout, self._buffer = stdin_fd, stdout_fd, b""
        self.run = self.said = None

    def _read(self, deadline):
        """More of its stdout into the buffer; at its end, stdout is closed (None)."""
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([self._stdout], [], [], remaining)[0]:
            raise TimeoutError(f"{self.args} said nothing for {WATCHDOG} s")
        data = os.read(self._stdout, 65536)
        self._buffer += data
        if not data:
            os.close(self._stdout)
            self._stdout = None

    def readline(self, timeout=WATCHDOG):
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer and self._stdout is not None:
            self._read(deadline)
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode("utf-8")

    def send(self, text):
        os.write(self._stdin, text.encode("utf-8"))

    def communicate(self, input=None, timeout=None):
        """Bytes in (far below a pipe's buffer), bytes out; (output, exit code)."""
        if self._stdin is not None:
            # The child may have died before reading: its exit code tells.
            with contextlib.suppress(BrokenPipeError):
                os.write(self._stdin, input or b"")
            os.close(self._stdin)
            self._stdin = None
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._stdout is not None:
            self._read(deadline)
        output, self._buffer = self._buffer, b""
        return output, self.wait()

    def kill(self):
        # Not reaped yet, so its pid still names it and the group it leads.
        if self.returncode is None:
            (os.killpg if self.group else os.kill)(self.pid, signal.SIGKILL)

    def wait(self):
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def fork_child(main, args, keep=(), stderr=None, group=False):
    """Fork a child that runs ``main(*args)`` on piped stdin and stdout, ``stderr`` (a
    descriptor) its stderr; with ``group`` it leads a process group that kill() ends whole.
    Never while this process holds a connection to a file the child opens: SQLite's lock
    records must not be copied into a child."""
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()

    def child():
        if group:
            os.setpgid(0, 0)
        os.dup2(stdin_r, 0)
        os.dup2(stdout_w, 1)
        if stderr is not None:
            os.dup2(stderr, 2)
        # Nothing of the parent's stays open here but ``keep``: not the pipes of its other
        # children (their EOF would wait for this one), nor a writer queue a dead parent held.
        low = 3
        for fd in sorted(keep):
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, os.sysconf("SC_OPEN_MAX"))
        sys.stdin = open(0, encoding="utf-8", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        return main(*args)
    pid = fork(child)
    if group:
        # Set here too, so that a kill at once finds the group: the child may not have run yet.
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
    os.close(stdin_r)
    os.close(stdout_w)
    return ForkedChild(pid, stdin_w, stdout_r, [main.__name__, *args], group)


def stop_on_signals():
    """At the command line only: each of STOPS (see on_stops) raises KeyboardInterrupt once, the
    next ones ignored, so the cleanup runs to its end and main() says one line."""
    def stop(number, frame):
        for each in STOPS:
            signal.signal(each, signal.SIG_IGN)
        raise KeyboardInterrupt
    on_stops(stop)


@contextlib.contextmanager
def stops_held():
    """STOPS held back for the block (where the system can), and delivered as it ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


# The children fork() has made: a stop that comes before a caller records one still finds it
# (end_forked).
FORKED = set()


def end_forked():
    """Kill and reap every child fork() made that is still this process's, and its group."""
    for pid in FORKED:
        try:
            # Not reaped yet, running or not: its pid, and the group it may lead, are still its.
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            continue
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError):
                kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    FORKED.clear()


def fork(child):
    """Fork a child that runs ``child()`` and exits as sys.exit(child()) would, never returning
    into the caller; 1 and its traceback if it raises.  Stops end it quietly (the driver
    reports; nohup's stay ignored), and its random numbers are its own."""
    # Or the child would print what is buffered again.
    sys.stdout.flush()
    sys.stderr.flush()
    # Held from the fork until the child is recorded here, or in the child until its own
    # handlers are set: a stop can neither lose a child nor run this process's handler in one.
    with stops_held():
        pid = os.fork()
        if pid:
            FORKED.add(pid)
            return pid
        code = 1
        # Where a new process writes (fd 2), not into the parent's sys.stderr (unittest -b's).
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        try:
            on_stops(signal.SIG_DFL)
            # Held back around a fork (stops_held()): here they are the child's own.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
            random.seed()
            code = child()
        # As sys.exit() would take it.
        except SystemExit as stop:
            code = stop.code
        except BaseException:
            traceback.print_exc()
        finally:
            # What the child wrote: os._exit flushes nothing.
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code if isinstance(code, int) else int(code is not None))


def fork_json(function, *args):
    """Run ``function(*args)`` in a forked child; return (pid, fd to read its result as JSON)."""
    reader, writer = os.pipe()

    def child():
        os.close(reader)
        with os.fdopen(writer, "w", encoding="utf-8") as pipe:
            json.dump(function(*args), pipe)
        return 0
    pid = fork(child)
    os.close(writer)
    return pid, reader


def run_forked(function, *args):
    """``function(*args)`` in a forked child, waited for; its JSON result (RuntimeError if it
    failed)."""
    pid, reader = fork_json(function, *args)
    try:
        with os.fdopen(reader, encoding="utf-8") as pipe:
            text = pipe.read()
    except BaseException:
        # Interrupted: it goes too.
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code != 0:
        raise RuntimeError(f"{function.__name__} failed in a forked child (exit {code})")
    return json.loads(text)


# --- results, comparison and the command line ----------------------------------------------

def results_of(runs):
    results = {}
    for run in runs:
        results.setdefault(SCENARIOS[run.name][0], {})[run.name] = run.stages
    return results


def render(results):
    return json.dumps(results, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def flatten(value, prefix=""):
    if isinstance(value, dict) and value:
        items = {}
        for key, inner in value.items():
            items.update(flatten(inner, f"{prefix}.{key}" if prefix else key))
        return items
    return {prefix: value}


def compared(expected, only=None):
    """The part of results.json that --check compares: with ``only`` those scenarios, else every
    one whose module is here (article 1's download has no preconditions.py), so a scenario that
    no longer runs is a difference, never a silence."""
    def here(group, name):
        if only is not None:
            return name in only
        return module_of(group, name) is not None
    kept = {group: {name: stages for name, stages in scenarios.items() if here(group, name)}
            for group, scenarios in expected.items() if isinstance(scenarios, dict)}
    return {group: scenarios for group, scenarios in kept.items() if scenarios}


def differences(expected, observed):
    """Every leaf key whose value differs, as (key, expected, observed); missing is '<absent>'.

    Values are compared as JSON text, so 1 differs from true and 2 from 2.0.
    """
    left, right = flatten(expected), flatten(observed)
    text = lambda leaves, key: json.dumps(leaves.get(key, "<absent>"), sort_keys=True)
    return [(key, left.get(key, "<absent>"), right.get(key, "<absent>"))
            for key in sorted(set(left) | set(right)) if text(left, key) != text(right, key)]


def summary(run):
    """The figures a reader compares with the article's table, from the last observation."""
    stages = list(run.stages.values())
    if not stages:
        return "no observation"
    if SCENARIOS[run.name][0] == "crash_matrix":
        if run.name.startswith("reliability/"):
            return ", ".join(f"{mode} {cell['sender_state']} {cell['tickets']}"
                             for mode, cell in run.stages.items())
        return ", ".join(f"{kind} exit {cell['exit_code']}, retry {cell['retry']}"
                         f" {cell['outcome']}" for kind, cell in run.stages.items())
    first, last = stages[0], stages[-1]
    if "receiver_tickets" in last:
        counted = "external_tickets" if run.mode == "external" else "receiver_tickets"
        which = "external tickets" if counted == "external_tickets" else "tickets"
        return (f"{which} {first[counted]} → {last[counted]}, {last['sender_state']},"
                f" attempts {last['attempts']}")
    quantities = ", ".join(f"{n} = {q}" for n, q in last["quantities"].items())
    status = last.get("statuses") or last.get("status")
    if isinstance(status, dict):
        status = ", ".join(f"{name} {count}" for name, count in status.items())
    return f"{quantities}, effects {last['effects']}" + (f", {status}" if status else "")


def console_line(run, shown=("✓", "✗", "→")):
    """A run's line on the console: its verdict, its name, its figures and what was injected.
    Names are padded to the longest of their group, so the line is the same however many ran."""
    ok_mark, bad_mark, arrow = shown
    group = SCENARIOS[run.name][0]
    width = max(len(name) for name, (other, _, _) in SCENARIOS.items() if other == group)
    figures = (run.headline or summary(run)).replace("→", arrow)
    injected = "" if group == "crash_matrix" else "; ".join(run.injected) or "no fault"
    line = f"  {ok_mark if not run.failures else bad_mark} {run.name:{width}} {figures}"
    return line + (f"  [{injected}]" if injected else "")


def versions(out):
    """Where this ran, for the reader: on stderr only, never in the results."""
    print(f"Python {sys.version.split()[0]}, SQLite {sqlite3.sqlite_version}", file=out)
    if wal_reset_bug():
        print(f"warning: SQLite {sqlite3.sqlite_version} has the WAL-reset race (3.7.0 to 3.51.2;"
              " fixed in 3.51.3, 3.50.7, 3.44.6). These experiments reproduce anyway, but see"
              " README.md before you run many writers on it in production.", file=out)


def marks(stream=None):
    """✓, ✗ and → where the terminal can show them; ASCII elsewhere (a pipe into a C locale)."""
    encoding = (getattr(stream or sys.stdout, "encoding", None) or "ascii").lower()
    try:
        "✓✗→".encode(encoding)
        return "✓", "✗", "→"
    except (LookupError, UnicodeEncodeError):
        return "ok", "FAIL", "->"


def main(argv=None):
    """The command line, or a step by hand (step()); Ctrl-C, SIGTERM or SIGHUP print one line
    and exit 130 (children end quietly)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if not hasattr(os, "fork"):
            refuse("its children are forked, and this system has no os.fork")
        code = step(argv) if argv[:1] in (["reliability"], ["preconditions"]) else _main(argv)
        # Written out here, where a failure is still one line.
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        print("run_experiment.py: interrupted", file=sys.stderr)
        return 130
    # A usage error, or --help: its status, also where main() runs in a forked child.
    except SystemExit as stop:
        return stop.code
    # Its reader went away (| head), quietly, or a disk is full: the exit's flush is quiet too.
    except OSError as error:
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if not isinstance(error, BrokenPipeError):
            print(f"run_experiment.py: {error}", file=sys.stderr)
        return 1


def refuse(message):
    """Bad usage: one line on stderr, and exit status 2."""
    print(f"run_experiment.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _usable(args):
    """Refuse, before any scenario runs, an --output or a --check file that cannot be used."""
    if reliability is None and preconditions is None:
        refuse("neither reliability.py nor preconditions.py is next to this script")
    if args.output:
        folder = os.path.dirname(os.path.abspath(args.output))
        writable = os.path.isdir(folder) and os.access(folder, os.W_OK) and not (
            os.path.exists(args.output) and not os.access(args.output, os.W_OK))
        if os.path.isdir(args.output) or not writable:
            refuse(f"--output {args.output}: not a writable file path")
    if args.check:
        try:
            with open(args.check, encoding="utf-8") as handle:
                args.expected = json.load(handle)
        except (OSError, ValueError) as error:
            refuse(f"--check {args.check}: cannot read it as JSON ({error})")
        if type(args.expected) is not dict:
            refuse(f"--check {args.check}: not a results object")


def _main(argv):
    parser = argparse.ArgumentParser(
        prog="run_experiment.py", description=__doc__.split("\n")[0],
        epilog="exit status: 0 all good, 1 a mismatch, a failed invariant or a failed write,"
        " 2 bad usage, 130 interrupted (Ctrl-C, SIGTERM, SIGHUP)")
    # Bad usage is one line, as everywhere else.
    parser.error = refuse
    parser.add_argument("--check", nargs="?", const=RESULTS, metavar="PATH",
                        help="compare with PATH (default: results.json next to this script)")
    parser.add_argument("--output", metavar="FILE", help="write the deterministic results to FILE")
    parser.add_argument("--json", action="store_true",
                        help="print the deterministic results to stdout")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these scenarios")
    parser.add_argument("--explain", metavar="NAME",
                        help="run one scenario and print its timeline")
    parser.add_argument("--download", nargs=2, metavar=("ARTICLE", "DIR"),
                        help="write article 1's or 7's five files into DIR, its results.json"
                        " holding that article's results alone")
    args = parser.parse_args(argv)
    _usable(args)
    if args.download:
        return download(*args.download)
    names = list(SCENARIOS)
    missing = [name for name, module in MODULES.items() if module is None]
    for name in (args.only or []) + ([args.explain] if args.explain else []):
        if name not in SCENARIOS:
            parser.error(f"unknown scenario {name!r}; see --list" + "".join(
                f" (the scenarios of {module} need it next to this script)" for module in missing))
    if args.list:
        width = max(map(len, SCENARIOS))
        for name, (article, description, _) in SCENARIOS.items():
            print(f"{article:12} {name:{width}} {description}")
        return 0
    if args.explain:
        return explain(run_all([args.explain])[0])
    names = args.only or names
    # In article order, whatever the command line's.
    names = [name for name in SCENARIOS if name in names]
    versions(sys.stderr)
    out = sys.stderr if args.json else sys.stdout
    shown = marks(out)
    runs = run_all(names)
    article = None
    for run in runs:
        if SCENARIOS[run.name][0] != article:
            article = SCENARIOS[run.name][0]
            print(HEADINGS[article], file=out)
        print(console_line(run, shown), file=out)
        for failure in run.failures:
            print(f"      invariant failed: {failure}", file=out)
        if run.failures:
            print(f"      (its timeline: python3 run_experiment.py --explain {run.name})",
                  file=out)
    failed = sum(bool(run.failures) for run in runs)
    print(f"{len(runs) - failed}/{len(runs)} scenarios hold their invariants", file=out)
    results = results_of(runs)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(render(results))
        print(f"wrote {args.output}", file=out)
    if args.json:
        sys.stdout.write(render(results))
    status = 1 if failed else 0
    if args.check:
        diffs = differences(compared(args.expected, names if args.only else None), results)
        for key, want, got in diffs:
            print(f"  differs: {key}: expected {json.dumps(want)}, observed {json.dumps(got)}",
                  file=out)
        mismatched = {key.split(".")[1] for key, _, _ in diffs if "." in key}
        shown = "results.json" if args.check == RESULTS else args.check
        print(f"{len(runs) - len(mismatched)}/{len(runs)} scenarios match {shown}", file=out)
        status = 1 if diffs or failed else status
    if args.check or args.output:
        absent(args.expected if args.check else None, out)
    return status


def absent(expected, out):
    """Say where the results compared with (default: results.json here) hold an article whose
    module is not here, as in one article's files copied by hand beside the project's."""
    if expected is None:
        try:
            with open(RESULTS, encoding="utf-8") as handle:
                expected = json.load(handle)
        except (OSError, ValueError):
            return
    held = {article_of(group, name) for group, scenarios in expected.items()
            if isinstance(scenarios, dict) for name in scenarios}
    for article, (module, _) in DOWNLOADS.items():
        if article in held and MODULES[module] is None:
            mine = "1" if article == "7" else "7"
            print(f"note: the results also hold article {article}'s, which need {module} here:"
                  " they were not run, and an --output file leaves them out, so cmp differs."
                  f" Article {mine}'s own five files: python3 run_experiment.py --download"
                  f" {mine} DIR, in the project.", file=out)


def download(article, folder):
    """Article ``article``'s five files into ``folder``, new or empty, never overwritten: its
    module and tests, this driver, README.md, and results.json of that article alone, written
    beside it and renamed to it at the end, so that a failure (a full disk) leaves nothing to
    block the next.  Refused in one line: exit 2 for a folder it cannot use, 1 unwritten."""
    if article not in DOWNLOADS:
        refuse(f"--download {article}: the articles here are {' and '.join(DOWNLOADS)}")
    names = (DOWNLOADS[article][0], "run_experiment.py", DOWNLOADS[article][1], "README.md")
    for name in names + ("results.json",):
        if not os.path.exists(os.path.join(HERE, name)):
            refuse(f"--download {article}: {name} is not next to this script")
    if not folder:
        refuse("--download: the folder's name is empty")
    with open(RESULTS, encoding="utf-8") as handle:
        results = json.load(handle)
    kept = {group: {name: stages for name, stages in scenarios.items()
                    if article_of(group, name) == article}
            for group, scenarios in results.items()}
    try:
        made = tempfile.mkdtemp(prefix=".download-", dir=os.path.dirname(os.path.abspath(folder)))
    except OSError as error:
        refuse(f"--download: cannot write beside {folder}: {error.strerror}")
    try:
        for name in names:
            shutil.copyfile(os.path.join(HERE, name), os.path.join(made, name))
        with open(os.path.join(made, "results.json"), "w", encoding="utf-8") as handle:
            handle.write(render({group: found for group, found in kept.items() if found}))
        # A folder as os.mkdir() makes it, not mkdtemp()'s private one.
        mask = os.umask(0o022)
        os.umask(mask)
        os.chmod(made, 0o777 & ~mask)
        # The last step, and the only one that touches ``folder``: the kernel refuses anything
        # there but an empty folder (a file, a link, a FIFO, a folder that holds something).
        try:
            os.rename(made, folder)
        except OSError as error:
            refuse(f"--download: {folder} exists and is not an empty folder ({error.strerror});"
                   " it is never overwritten")
    except OSError as error:
        print(f"run_experiment.py: error: --download: could not write {folder}:"
              f" {error.strerror or error}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(made, ignore_errors=True)
    print(f"wrote article {article}'s five files to {folder}")
    return 0


def explain(run):
    """Print one scenario's recorded events in lanes, then its invariant verdict."""
    print(f"{run.name}: {SCENARIOS[run.name][1]}")
    width = max(len(lane) for lane, _ in run.events) if run.events else 0
    for step, (lane, text) in enumerate(run.events, 1):
        print(f"{step:3}  {lane:{width}}  {text}")
    print(console_line(run, marks()).strip())
    for failure in run.failures:
        print(f"    invariant failed: {failure}")
    return 1 if run.failures else 0


# --- stepping by hand: one call of a module's function, as README.md's walk-throughs do ------

# Parameters given as JSON on the command line, and as ints; the rest are text.
JSON_PARAMETERS = {"payload", "command", "evidence", "resources", "expected"}
INT_PARAMETERS = {"now", "issued_at", "attempt", "window", "delta"}
# Parameters that are connections: the command line names the database file to open.
CONNECTIONS = {"connection", "c", "tool"}


def step(argv):
    """``run_experiment.py reliability|preconditions FUNCTION ARG... [--NAME VALUE]...``: one
    call of a public function of the module, its answer one JSON line of UTF-8 on stdout.  A
    connection is named by its database file (the module's connect()); issued_at defaults to
    now; --crash BOUNDARY arms the process, whose tool child gets it too.  Exit 0 done, 1
    refused or failed, 2 bad usage (one line on stderr), or the crash's own exit code."""
    name, module = argv[0], MODULES[argv[0] + ".py"]
    if module is None:
        refuse(f"{name}.py is not next to this script")
    # Not a class, nor what answers with no JSON (a context, a connection) or serves a pipe.
    steps = [each for each in module.__all__ if inspect.isfunction(getattr(module, each))
             and each not in ("transaction", "connect", "serve", "tool_child")]
    if argv[1:2] in ([], ["-h"], ["--help"]) or argv[1] not in steps:
        asked = argv[1:2] in (["-h"], ["--help"])
        print(f"usage: run_experiment.py {name} FUNCTION ARG... [--NAME VALUE]...\nFUNCTION: "
              + ", ".join(steps), file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    function = getattr(module, argv[1])
    parameters = inspect.signature(function).parameters
    given, keywords, words = [], {}, iter(argv[2:])
    for word in words:
        if word.startswith("--") and len(word) > 2:
            keywords[word[2:].replace("-", "_")] = next(words, None)
        else:
            given.append(word)
    crash = keywords.pop("crash", None)
    if "issued_at" in parameters and "now" in keywords:
        keywords.setdefault("issued_at", keywords["now"])
    with contextlib.ExitStack() as stack:
        try:
            bound = inspect.signature(function).bind(*given, **keywords)
            named = BOUNDARIES if module is reliability else EXIT_CODES
            if None in keywords.values() or crash not in (None, *named):
                raise TypeError("each --NAME takes a value, and --crash a named boundary")
        except TypeError as error:
            refuse(f"{name} {argv[1]}{inspect.signature(function)}: {error}")
        try:
            for parameter, value in bound.arguments.items():
                if parameter in CONNECTIONS:
                    value = stack.enter_context(contextlib.closing(module.connect(value)))
                elif parameter in JSON_PARAMETERS:
                    value = json_argument(value, parameter.upper())
                elif parameter in INT_PARAMETERS:
                    value = int(value)
                else:
                    value = text_argument(value)
                bound.arguments[parameter] = value
            module.CRASH_AT = crash
            said = function(*bound.args, **bound.kwargs)
        except (OSError, ValueError, TypeError, KeyError, OverflowError, RecursionError,
                sqlite3.Error, *(getattr(module, error, ValueError)
                                 for error in ("Conflict", "Expired", "CorruptRecord"))) as error:
            message = " ".join(str(error).split()) or type(error).__name__
            print(f"run_experiment.py {name} {argv[1]}: {type(error).__name__}: {message}",
                  file=sys.stderr)
            return 1
    sys.stdout.buffer.write(json.dumps(said, ensure_ascii=False, sort_keys=True,
                                       separators=(",", ":")).encode("utf-8") + b"\n")
    # Still alive: that boundary was never met, here or in the tool child it went on to.
    if crash and not (isinstance(said, dict) and said.get("exit_code") == getattr(
            module, "CRASH_EXIT", None)):
        print(f"run_experiment.py {name} {argv[1]}: {crash} was not reached", file=sys.stderr)
    return 0


def text_argument(value):
    """A command-line argument as the UTF-8 text it was typed in, whatever the locale decoded it
    as (a C locale hands non-ASCII bytes over as surrogates)."""
    try:
        return os.fsencode(value).decode("utf-8")
    except UnicodeError:
        # Not bytes of UTF-8 text: left as it came, and refused where it is checked.
        return value


def json_argument(text, what):
    """A JSON argument; a ValueError where it is not JSON, repeats a key or nests too deeply."""
    def no_repeats(pairs):
        if len({key for key, _ in pairs}) != len(pairs):
            raise ValueError("it repeats a key")
        return dict(pairs)
    try:
        return json.loads(text_argument(text), object_pairs_hook=no_repeats)
    except RecursionError:
        raise ValueError(f"{what} nests too deeply") from None
    except ValueError as error:
        raise ValueError(f"{what} is not JSON ({error}): {text[:60]!r}") from None


def wal_reset_bug(version=None):
    """True if this SQLite (default: the linked one) has the WAL-reset race, from 3.7.0 through
    3.51.2, fixed in 3.51.3 and backported to 3.50.7 and 3.44.6: it can corrupt a WAL database
    or lose commits when several connections write and checkpoint, the use the modules teach."""
    version = tuple(version or sqlite3.sqlite_version_info)
    if not (3, 7, 0) <= version < (3, 51, 3):
        return False
    return not ((3, 44, 6) <= version < (3, 45, 0) or (3, 50, 7) <= version < (3, 51, 0))


if __name__ == "__main__":
    stop_on_signals()
    status = main()
    # After the verdict a stop changes nothing.
    for number in STOPS:
        signal.signal(number, signal.SIG_IGN)
    sys.exit(status)
