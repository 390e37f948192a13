"""Kill -9 torture: forked workers do random mixed work on both modules in one folder and are
SIGKILLed at random moments, restarted, and then every invariant is checked from the databases.

  python3 beyond/torture.py SECONDS [--seed N]    kill workers at random for SECONDS
  python3 beyond/torture.py --operations N [--seed N]
                                                  N seeded operations per worker, each worker
                                                  SIGKILLing itself at seeded points

Workers enqueue and dispatch through the outbox (tool children included), receive directly,
transfer on fresh and on stale plans, change quantities, and look at a database now and then,
opening and closing it as agents do.  A restarted worker redoes the operation its journal
names, with the same keys and plan: the protocols must make that harmless.  Timing makes every
timed run different, so nothing of it goes into results.json; with --operations the work and
the kills are fixed by the seed, only the interleaving is not.  It needs both reliability.py
and preconditions.py, and os.fork (POSIX).  Exit status: 0 every invariant holds, 1 a
violation, 2 bad usage, 130 interrupted (Ctrl-C, SIGTERM or SIGHUP: one line on stderr, and no
process or folder of the run left behind).
"""
import argparse
import contextlib
import json
import os
import random
import select
import shutil
import signal
import sqlite3
import sys
import tempfile
import time

# Run as python3 beyond/torture.py, it finds beyond/ on its path: the modules are one folder up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import preconditions
import reliability
import run_experiment

WORKERS = 4
# With --operations: the share of operations a worker dies in, by SIGKILL.
SELF_KILL = 0.15
# Seconds: the killer waits uniformly up to this before each kill.
KILL_PAUSE = 0.1
# Logical ticks a second, so a lease (LEASE_TICKS) lasts 0.1 s.
TICKS = 100
# Seconds after the deadline for workers and their tool children to end.
GRACE = 5.0
TRANSFER_DB = "transfer.db"
RESOURCES = {"A": 10 ** 9, "B": 10 ** 9, "C": 10 ** 9, "D": 10 ** 9}
# Each kind of operation, and its weight in a worker's random choice.
WORK = {"enqueue": 3, "dispatch": 5, "receive": 1, "execute_fresh": 2, "execute_stale": 1,
        "change": 1, "look": 8}
# What the workers do not hold open.
LOOKED_AT = (reliability.RECEIVER, reliability.EXTERNAL)
# Times a worker looking opens, reads and closes a database.
LOOKS = 20
# Violations printed; the summary keeps them all.
SHOWN = 20


def torture(seconds=None, seed=None, directory=None, operations=None):
    """SIGKILL workers at random for ``seconds``, restart them, recover, check every invariant.

    With ``operations`` instead, each worker does exactly that many seeded operations and
    SIGKILLs itself at the seeded kill points, so the work and the kills are determined by
    the seed; only the interleaving is not.  Returns {"seconds", "seed", "workers", "sqlite",
    "elapsed", "operations" (by kind, each counted once however often it was redone),
    "kills" (each followed by a restart), "final" (counts read from the databases),
    "violations"}: one string per broken invariant, empty when all hold.  Its files live in a
    temporary folder under ``directory``, removed at the end whatever happens.
    """
    seed = random.SystemRandom().randrange(2 ** 32) if seed is None else seed
    rng, violations, pids, kills = random.Random(seed), [], {}, 0
    base, alive_read, alive_write, began = None, None, None, time.monotonic()

    def spawn(index):
        # A stop waits from the fork to the bookkeeping: one in between would leave a worker
        # unknown to the cleanup below.
        with run_experiment.stops_held():
            pids[index] = _spawn(base, index, seed, started, started + (seconds or 0), alive_read,
                                 alive_write, operations)

    def reap(index):
        # Forgotten only once reaped: a stop in between leaves the cleanup a pid already gone,
        # never a live worker it does not know.
        code = _reap(base, index, pids[index], violations)
        del pids[index]
        return code
    try:
        # Inside the try: the folder is removed whatever happens.
        base = tempfile.mkdtemp(prefix="torture-", dir=directory)
        alive_read, alive_write = os.pipe()
        reliability.init(base)
        preconditions.init(os.path.join(base, TRANSFER_DB), RESOURCES)
        started = time.monotonic()
        for index in range(WORKERS):
            spawn(index)
        for index in range(WORKERS) if operations is not None else ():
            # A worker that died at one of its kill points is restarted until it is done.
            while reap(index) == -signal.SIGKILL:
                kills += 1
                spawn(index)
        while operations is None:
            pause, index = rng.uniform(0, KILL_PAUSE), rng.randrange(WORKERS)
            if time.monotonic() + pause >= started + seconds:
                break
            time.sleep(pause)
            if index in pids:
                os.kill(pids[index], signal.SIGKILL)
                if reap(index) == -signal.SIGKILL:
                    kills += 1
                    spawn(index)
        os.close(alive_write)
        alive_write = None
        # Every worker and every tool child it forked holds the write end: EOF means all ended.
        if not select.select([alive_read], [], [], GRACE)[0]:
            violations.append(f"processes still running {GRACE:g} s after the deadline; killed")
            for pid in pids.values():
                os.kill(pid, signal.SIGKILL)
            select.select([alive_read], [], [], reliability.CHILD_TIMEOUT)
        for index in sorted(pids):
            reap(index)
        _recover(base, int((time.monotonic() - started) * TICKS) + reliability.LEASE_TICKS)
        final = check(base, violations)
        done = dict.fromkeys(WORK, 0)
        for index in range(WORKERS):
            for kind in {entry["n"]: entry["kind"] for entry in
                         _lines(_file(base, index, "journal"))}.values():
                done[kind] += 1
    finally:
        # Only after an error or a stop above: nothing may outlive the call, and this cleanup
        # is not stopped in turn.
        with run_experiment.stops_held():
            for pid in pids.values():
                # One reaped just before the stop is gone already.
                with contextlib.suppress(ProcessLookupError, ChildProcessError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            if alive_write is not None:
                os.close(alive_write)
                alive_write = None
                # The tool children of the killed workers end on their closed pipes: EOF here
                # once every one has, before their folder goes.
                select.select([alive_read], [], [], reliability.CHILD_TIMEOUT)
            if alive_read is not None:
                os.close(alive_read)
            if base is not None:
                shutil.rmtree(base, ignore_errors=True)
    return {"seconds": seconds, "seed": seed, "workers": WORKERS, "sqlite": sqlite3.sqlite_version,
            "elapsed": round(time.monotonic() - began, 2), "operations": done, "kills": kills,
            "final": final, "violations": violations}


def check(base, violations):
    """Check every invariant from fresh connections, all writers gone and recovery done (every
    lease over, every due row dispatched); return the final counts.

    reliability: one ticket per key, named by its receipt.  Every outbox row ends done with the
    ticket its receipt names, or blocked with "no valid answer after MAX_ATTEMPTS attempts"
    after that many attempts: killed in flight or never answered validly so often, it is parked
    for a person as the protocol says, whatever the receiver holds, and is no violation.  Any
    other row (pending, in flight) is an accepted intent that recovery left unanswered though
    every row is due by then, whether or not the receiver holds a receipt for it (its line
    says which).  Every ticket a worker was given is committed under its key.

    preconditions: every outcome a worker was given has its receipt (nothing purges in a run)
    and is the stored decision; a plan the worker made stale is given "stale" and nothing
    else; one effect per applied transfer and one change row per change; the resources are
    those init made, none gone and none added; each revision is 1 + the writes to it;
    quantities and their total follow the effects and changes.  Each break is appended to
    ``violations`` as one line.
    """
    opened = {name: reliability.connect(os.path.join(base, name)) for name in reliability.KINDS}
    opened[TRANSFER_DB] = preconditions.connect(os.path.join(base, TRANSFER_DB))
    read = lambda name, sql: opened[name].execute(sql).fetchall()
    try:
        for name in opened:
            health = read(name, "PRAGMA integrity_check") + read(name, "PRAGMA foreign_key_check")
            if health != [("ok",)]:
                violations.append(f"integrity of {name}: {health}")
        tickets = read(reliability.RECEIVER, "SELECT id, caller, key FROM tickets")
        receipts = read(reliability.RECEIVER, "SELECT caller, key, ticket_id FROM receipts")
        outbox = read(reliability.SENDER,
                      "SELECT caller, key, state, attempts, response FROM outbox")
        requests = read(reliability.SENDER, "SELECT count(*) FROM requests")[0][0]
        stored = {op: json.loads(result)
                  for op, result in read(TRANSFER_DB, "SELECT op, result FROM receipt")}
        effects = read(TRANSFER_DB, "SELECT op, src, dst, amount FROM effects")
        changes = read(TRANSFER_DB, "SELECT op, name, delta FROM changes")
        resources = read(TRANSFER_DB, "SELECT name, quantity, revision FROM resources"
                                      " ORDER BY name")
    finally:
        for connection in opened.values():
            connection.close()
    receipts, by_key = {(caller, key): ticket for caller, key, ticket in receipts}, {}
    for ticket, caller, key in tickets:
        by_key.setdefault((caller, key), []).append(ticket)
    # Idempotent mode: one ticket per key, named by its receipt.
    for (caller, key), ids in by_key.items():
        if len(ids) > 1 or receipts.get((caller, key)) != ids[0]:
            violations.append(f"{caller}/{key} has tickets {ids}, its receipt names "
                              f"{receipts.get((caller, key))}")
    states = dict.fromkeys(("pending", "inflight", "done", "unknown", "blocked", "abandoned"), 0)
    given_up = f"no valid answer after {reliability.MAX_ATTEMPTS} attempts"
    for caller, key, state, attempts, response in outbox:
        states[state] += 1
        receipt = receipts.get((caller, key))
        answer = _parsed(response)
        if state == "done":
            ticket = answer.get("ticket_id") if type(answer) is dict else None
            if ticket is None:
                violations.append(f"outbox {caller}/{key} done without a ticket: {response}")
            elif receipt != ticket:
                violations.append(f"outbox {caller}/{key} done with ticket {ticket}, its receipt"
                                  f" names {receipt}")
        elif state == "blocked":
            # Unanswered MAX_ATTEMPTS times: parked for a person, as the protocol says.
            if answer != {"error": given_up}:
                violations.append(f"outbox {caller}/{key} blocked, not given up after"
                                  f" {reliability.MAX_ATTEMPTS} attempts: {response}")
            elif attempts < reliability.MAX_ATTEMPTS:
                violations.append(f"outbox {caller}/{key} blocked as given up after"
                                  f" {reliability.MAX_ATTEMPTS} attempts, but had {attempts}")
        else:
            held = (f"the receiver's receipt names ticket {receipt}" if receipt is not None
                    else "the receiver has no receipt for it")
            violations.append(f"outbox {caller}/{key} ends {state}, an accepted intent never"
                              f" answered: {held}")
    if requests != len(outbox):
        violations.append(f"{requests} requests but {len(outbox)} outbox rows")
    ticket_keys = {ticket: (caller, key) for ticket, caller, key in tickets}
    reported = [entry for index in range(WORKERS)
                for entry in _lines(_file(base, index, "reported"))]
    for entry in reported:
        if "op" not in entry:
            identity, ticket = (entry["caller"], entry["key"]), entry["ticket_id"]
            if ticket_keys.get(ticket) != identity or receipts.get(identity) != ticket:
                violations.append(f"reported {'/'.join(identity)} ticket {ticket}: that ticket is "
                                  f"{ticket_keys.get(ticket)}, the receipt names "
                                  f"{receipts.get(identity)}")
            continue
        op, result = entry["op"], entry["result"]
        result = result["result"] if result["status"] == "replayed" else result
        if op not in stored:
            violations.append(f"reported {op} {result['status']}, but its receipt is gone")
        elif stored[op] != result:
            violations.append(f"reported {op} {result['status']}, stored {stored[op]}")
        # A revision src had, or one it never reaches: never current, whatever was stored.
        if entry["kind"] == "execute_stale" and result["status"] != "stale":
            violations.append(f"stale plan {op} reported {result['status']}, not stale")
    # Exactly once: one row per applied or changed receipt, and no row without one.
    for status, rows in (("applied", effects), ("changed", changes)):
        done = {op for op, result in stored.items() if result["status"] == status}
        for op in sorted(done ^ {row[0] for row in rows}):
            violations.append(f"{op}: " + (f"{status} receipt, no row" if op in done
                                           else "a row, no receipt"))
    changes = [(name, delta) for _, name, delta in changes]
    for name in sorted(set(RESOURCES) - {name for name, _, _ in resources}):
        violations.append(f"resource {name} is gone: init made it, and nothing deletes one")
    for name, quantity, revision in resources:
        if name not in RESOURCES:
            violations.append(f"resource {name} was never made by init")
            continue
        writes = sum(name in (src, dst) for _, src, dst, _ in effects)
        writes += sum(n == name for n, _ in changes)
        flow = sum(amount * ((dst == name) - (src == name)) for _, src, dst, amount in effects)
        flow += sum(delta for n, delta in changes if n == name)
        if revision != 1 + writes:
            violations.append(f"revision of {name} is {revision}, not 1 + {writes} writes")
        if quantity != RESOURCES[name] + flow:
            violations.append(f"quantity of {name} is {quantity}, not {RESOURCES[name]} {flow:+d}")
    total = sum(quantity for _, quantity, _ in resources)
    expected = sum(RESOURCES.values()) + sum(delta for _, delta in changes)
    if total != expected:
        violations.append(f"total quantity {total} is not the initial total + sum(changes.delta)"
                          f" = {expected}")
    statuses = dict.fromkeys(("applied", "stale", "insufficient", "missing_resource", "overflow",
                              "changed"), 0)
    for result in stored.values():
        statuses[result["status"]] = statuses.get(result["status"], 0) + 1
    return {"requests": requests, "outbox": states, "tickets": len(tickets),
            "receipts": len(receipts), "reported_responses": sum("op" not in e for e in reported),
            "transfer_receipts": statuses, "effects": len(effects), "changes": len(changes),
            "total_quantity": total, "reported_outcomes": sum("op" in e for e in reported)}


# --- the workers ---------------------------------------------------------------------------

def _worker(base, index, seed, started, deadline, alive, operations=None):
    """One life of a worker: redo the journal's last operation with its keys and plan, go on.

    The journal line is written before the operation, so a restart cannot tell whether it
    finished and does it again; the protocols must make that harmless.  With ``operations``,
    it stops after that many and SIGKILLs itself at the seeded kill points (not again when it
    redoes an operation after such a death).
    """
    entries = _lines(_file(base, index, "journal"), repair=True)
    _lines(_file(base, index, "reported"), repair=True)
    n, plan, resuming = 0, None, False
    if entries:
        n, plan, resuming = entries[-1]["n"], entries[-1].get("plan"), True
    journal, reported = (os.open(_file(base, index, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                                 0o644) for name in ("journal", "reported"))
    sender = reliability.connect(os.path.join(base, reliability.SENDER))
    transfer = preconditions.connect(os.path.join(base, TRANSFER_DB))
    caller = f"worker-{index}"
    while resuming or (n < operations if operations is not None else time.monotonic() < deadline):
        kind, rng = _op(seed, index, n)
        # One clock for all the processes.
        now = int((time.monotonic() - started) * TICKS)
        kill = None if operations is None or resuming else _kill_point(seed, index, n)
        if not resuming:
            _note(journal, {"n": n, "kind": kind})
        if kill == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "enqueue":
            reliability.enqueue(sender, caller, f"op-{n}", {"worker": index, "op": n}, now=now)
        elif kind == "dispatch":
            result = reliability.dispatch(sender, base, now, start=_tool(alive))
            # A refusal leaves the row blocked: only tickets are reported.
            if result and "ticket_id" in (result["response"] or {}):
                _note(reported, result["response"])
        elif kind == "receive":
            # Often an earlier enqueue's key: a second delivery racing the outbox's own.
            m = rng.randrange(n + 1)
            m = m if _op(seed, index, m)[0] == "enqueue" else n
            receiver = reliability.connect(os.path.join(base, reliability.RECEIVER))
            response = reliability.receive(receiver, caller, f"op-{m}", {"worker": index, "op": m},
                                           issued_at=now, now=now)
            # Closed before a dispatch forks a tool child that opens this file.
            receiver.close()
            _note(reported, response)
        elif kind == "look":
            # An observer comes, reads and goes: opens and closes race the others' last closes.
            for name in rng.choices(LOOKED_AT, k=LOOKS):
                look = reliability.connect(os.path.join(base, name))
                reliability.snapshot(look)
                look.close()
        elif kind == "change":
            name, delta = rng.choice(sorted(RESOURCES)), rng.choice((-1, 1)) * rng.randint(1, 9)
            op = f"{caller}/op-{n}"
            _note(reported, {"op": op, "kind": kind, "result": preconditions.change(
                transfer, op, name, delta, issued_at=now, now=now)})
        else:
            # Journaled before it runs: a retry must send the same command.
            if plan is None:
                src, dst = rng.sample(sorted(RESOURCES), 2)
                seen = dict(transfer.execute("SELECT name, revision FROM resources"
                                             " WHERE name IN (?, ?)", (src, dst)).fetchall())
                # A revision src had, or one it never reaches: never current.
                if kind == "execute_stale":
                    seen[src] = seen[src] - 1 if seen[src] > 1 else preconditions.MAX_INT64
                plan = {"src": src, "dst": dst, "amount": rng.randint(1, 99), "expected": seen}
                _note(journal, {"n": n, "kind": kind, "plan": plan})
            op = f"{caller}/op-{n}"
            _note(reported, {"op": op, "kind": kind, "result": preconditions.execute(
                transfer, op, plan, issued_at=now, now=now)})
        if kill == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        n, plan, resuming = n + 1, None, False
    # After an exception the process just ends, as it would under SIGKILL.
    sender.close()
    transfer.close()
    return 0


def _op(seed, index, n):
    """Operation n of a worker: the same kind and parameters however often it is redone."""
    rng = random.Random(f"{seed}/{index}/{n}")
    return rng.choices(list(WORK), list(WORK.values()))[0], rng


def _kill_point(seed, index, n):
    """Where worker ``index`` SIGKILLs itself in operation ``n`` of a fixed run: None, "before"
    (journaled, not begun) or "after" (done, not yet reported)."""
    rng = random.Random(f"{seed}/{index}/{n}/kill")
    return rng.choice(("before", "after")) if rng.random() < SELF_KILL else None


def _tool(alive):
    # Forked: a forked tool child keeps the liveness pipe (see torture()).
    return lambda argv: run_experiment.fork_child(reliability.tool_child, (list(argv),),
                                                  keep=(alive,))


def _spawn(base, index, seed, started, deadline, alive_read, alive_write, operations=None):
    # It keeps the liveness pipe's write end, and so do its tool children.
    def worker():
        os.close(alive_read)
        try:
            return _worker(base, index, seed, started, deadline, alive_write, operations)
        # For the report; the exit code 1 says it failed.
        except BaseException as error:
            with open(_file(base, index, "error"), "w", encoding="utf-8") as handle:
                handle.write(f"{type(error).__name__}: {error}")
            return 1
    return run_experiment.fork(worker)


def _reap(base, index, pid, violations):
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code not in (0, -signal.SIGKILL):
        reason = "no error recorded"
        if os.path.exists(_file(base, index, "error")):
            with open(_file(base, index, "error"), encoding="utf-8") as handle:
                reason = handle.read()
        violations.append(f"worker {index} exited {code}: {reason}")
    return code


def _recover(base, now):
    """Recovery, as after a machine restart: every lease has ended, every unfinished row is due."""
    sender = reliability.connect(os.path.join(base, reliability.SENDER))
    try:
        while reliability.dispatch(sender, base, now, start=run_experiment.start_tool) is not None:
            pass
    finally:
        sender.close()


def _file(base, index, name):
    return os.path.join(base, f"worker-{index}.{name}")


def _parsed(stored):
    """A stored response as the JSON it holds, or None where it holds none (a broken run's)."""
    try:
        return json.loads(stored)
    except (TypeError, ValueError, RecursionError):
        return None


def _lines(path, repair=False):
    """The complete JSON lines of a worker's file; a last line torn by SIGKILL is dropped."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return []
    complete = data[:data.rfind(b"\n") + 1]
    # Or the next line would be glued to the torn one.
    if repair and len(complete) < len(data):
        os.truncate(path, len(complete))
    return [json.loads(line) for line in complete.splitlines()]


def _note(fd, entry):
    # One write() per line and no fsync: SIGKILL loses nothing the kernel already has.
    os.write(fd, (json.dumps(entry, sort_keys=True) + "\n").encode("utf-8"))


# --- the command line ----------------------------------------------------------------------

def report(summary):
    """A short human summary, then the verdict."""
    ok_mark, bad_mark = run_experiment.marks()[:2]
    final, violations = summary["final"], summary["violations"]
    listed = lambda counts: ", ".join(f"{name} {count}" for name, count in counts.items() if count)
    length = (f"{summary['seconds']:g} s" if summary["seconds"] is not None else
              "seeded operations")
    print(f"torture: {summary['workers']} workers, {length}, seed {summary['seed']}, SQLite "
          f"{summary['sqlite']}: {summary['kills']} kill -9 survived, each restarted")
    print(f"  operations: {listed(summary['operations'])}")
    print(f"  reliability: {final['requests']} requests, outbox {listed(final['outbox'])}; "
          f"{final['tickets']} tickets, {final['receipts']} receipts; "
          f"{final['reported_responses']} reported responses checked")
    print(f"  preconditions: receipts {listed(final['transfer_receipts'])}; {final['effects']} "
          f"effects, {final['changes']} changes, total {final['total_quantity']}; "
          f"{final['reported_outcomes']} reported outcomes checked")
    if not violations:
        print(f"{ok_mark} every invariant holds ({summary['elapsed']:g} s in all)")
        return
    print(f"{bad_mark} {len(violations)} violation(s):")
    for violation in violations[:SHOWN]:
        print(f"    {violation}")
    if len(violations) > SHOWN:
        print(f"    ... and {len(violations) - SHOWN} more")


def main(argv=None):
    """The command line; Ctrl-C, SIGTERM or SIGHUP prints one line and exits 130 (the workers
    and their tool children end quietly first; see run_experiment.stop_on_signals())."""
    parser = argparse.ArgumentParser(prog="beyond/torture.py",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("seconds", type=float, nargs="?", metavar="SECONDS",
                        help="kill workers at random moments for SECONDS")
    parser.add_argument("--operations", type=int, metavar="N",
                        help="instead: N seeded operations per worker, with seeded self-kills")
    parser.add_argument("--seed", type=int, metavar="N", help="fixes the work and the kills")
    args = parser.parse_args(argv)
    if (args.seconds is None) == (args.operations is None):
        parser.error("give SECONDS or --operations N" + ("" if args.seconds is None
                                                          else ", not both"))
    if args.seconds is not None and not 0 < args.seconds < float("inf"):
        parser.error("SECONDS must be a positive number")
    if args.operations is not None and args.operations < 1:
        parser.error("--operations needs a positive count")
    if not hasattr(os, "fork"):
        parser.error("the torture forks its workers: it needs os.fork (POSIX)")
    try:
        run_experiment.versions(sys.stderr)
        summary = torture(args.seconds, args.seed, operations=args.operations)
    except KeyboardInterrupt:
        print("beyond/torture.py: interrupted", file=sys.stderr)
        return 130
    report(summary)
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    run_experiment.stop_on_signals()
    status = main()
    # After the verdict a stop changes nothing.
    for number in run_experiment.STOPS:
        signal.signal(number, signal.SIG_IGN)
    sys.exit(status)
