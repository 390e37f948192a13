"""Tests of beyond/torture.py: a short seeded kill -9 run holds every invariant, and the check
that says so reports each invariant broken by hand.

Run from the project root: ``python3 -m unittest beyond.test_torture``.
"""
import contextlib
import glob
import io
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import unittest

# Run as python3 beyond/test_torture.py, it finds beyond/ on its path: the modules are one up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import preconditions
import reliability
import run_experiment
import test_reliability as article1
from beyond import torture

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torture.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Seconds: only ends a hung child, never asserted as a measurement.
WATCHDOG = 60.0
# 4 workers x 40 operations: this seed kills every kind of operation, before its work and after.
SEED, OPERATIONS = 2415, 40


@unittest.skipUnless(hasattr(os, "fork"), "the torture forks its workers")
class SeededRunTest(unittest.TestCase):
    def test_a_seeded_run_does_the_seeded_work_dies_at_the_seeded_points_and_holds(self):
        summary = torture.torture(seed=SEED, operations=OPERATIONS)
        self.assertEqual(summary["violations"], [])
        kinds, killed = dict.fromkeys(torture.WORK, 0), []
        for index in range(torture.WORKERS):
            for n in range(OPERATIONS):
                kind, where = torture._op(SEED, index, n)[0], torture._kill_point(SEED, index, n)
                kinds[kind] += 1
                if where:
                    killed.append((kind, where))
        self.assertEqual((summary["operations"], summary["kills"]), (kinds, len(killed)))
        # What the seed gives, every run: every kind killed, before its work and after it.
        self.assertEqual(({kind for kind, _ in killed}, {where for _, where in killed}),
                         (set(torture.WORK), {"before", "after"}))
        final = summary["final"]
        self.assertEqual(final["outbox"]["done"] + final["outbox"]["blocked"], final["requests"])
        # The next test runs this one again with /proc hidden: nothing here may need it.
        self.assertFalse(os.environ.get("PROC_HIDDEN") and os.path.exists("/proc/self"))

    @unittest.skipUnless(hasattr(os, "geteuid") and os.geteuid() == 0
                         and shutil.which("unshare"),
                         "hides /proc in a mount namespace of its own: needs unshare and root")
    def test_the_same_with_proc_hidden_as_in_a_container_without_it(self):
        # In a mount namespace of its own, so that no other process loses /proc.
        test = (f"beyond.test_torture.{type(self).__name__}.test_a_seeded_run_does_the_seeded_"
                "work_dies_at_the_seeded_points_and_holds")
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               'mount -t tmpfs none /proc && exec "$0" -m unittest "$1"',
                               sys.executable, test], capture_output=True, timeout=WATCHDOG * 4,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              env=dict(os.environ, PROC_HIDDEN="1"))
        self.assertEqual(done.returncode, 0, done.stderr.decode("utf-8", "replace"))
        self.assertIn(b"Ran 1 test", done.stderr)


class CheckTest(unittest.TestCase):
    """check() reads only the databases and the workers' files: each broken invariant is a line."""

    def test_an_honest_folder_has_no_violation(self):
        with folder() as base:
            violations = []
            final = torture.check(base, violations)
            self.assertEqual(violations, [])
            self.assertEqual((final["tickets"], final["effects"], final["changes"]), (2, 1, 1))

    def test_each_invariant_broken_by_hand_is_reported(self):
        sender, receiver, transfer = reliability.SENDER, reliability.RECEIVER, torture.TRANSFER_DB
        breaks = {
            "a key with two tickets": (
                receiver, "INSERT INTO tickets (caller, key, digest, payload)"
                " SELECT caller, key, digest, payload FROM tickets WHERE id = 1",
                "worker-0/op-0 has tickets [1, 3], its receipt names 1"),
            "a revision not 1 + its writes": (
                transfer, "UPDATE resources SET revision = revision + 1 WHERE name = 'A'",
                "revision of A is 4, not 1 + 2 writes"),
            "a quantity off": (
                transfer, "UPDATE resources SET quantity = quantity + 1 WHERE name = 'B'",
                f"quantity of B is {torture.RESOURCES['B'] + 4}, not {torture.RESOURCES['B']} +3"),
            "an effect without its receipt": (
                transfer, "DELETE FROM receipt WHERE op = 'worker-0/t'",
                "worker-0/t: a row, no receipt"),
            "a receipt for another ticket": (
                receiver, "UPDATE receipts SET ticket_id = 2 WHERE key = 'op-0'",
                "worker-0/op-0 has tickets [1], its receipt names 2"),
            "a done row whose ticket is not its receipt's": (
                sender, "UPDATE outbox SET response = json_set(response, '$.ticket_id', 2)",
                "outbox worker-0/op-0 done with ticket 2, its receipt names 1"),
            "a pending row with neither ticket nor receipt": (
                sender, "INSERT INTO requests SELECT caller, 'op-2', mode, digest, payload,"
                " issued_at FROM requests; INSERT INTO outbox (caller, key, state)"
                " VALUES ('worker-0', 'op-2', 'pending')",
                "outbox worker-0/op-2 ends pending, an accepted intent never answered: the"
                " receiver has no receipt for it"),
            "a row left in flight whose receipt names a ticket": (
                sender, "UPDATE outbox SET state = 'inflight', response = NULL",
                "outbox worker-0/op-0 ends inflight, an accepted intent never answered: the"
                " receiver's receipt names ticket 1"),
            "requests and outbox rows that differ in number": (
                sender, "DELETE FROM outbox", "1 requests but 0 outbox rows"),
            "a reported answer that is not the stored decision": (
                transfer, "UPDATE receipt SET result = json_set(result, '$.quantities.A', 6)"
                " WHERE op = 'worker-0/t'", "reported worker-0/t applied, stored "),
            "a done row with no response": (
                sender, "UPDATE outbox SET response = NULL",
                "outbox worker-0/op-0 done without a ticket: None"),
            "a done row whose response is not JSON": (
                sender, "UPDATE outbox SET response = 'x'",
                "outbox worker-0/op-0 done without a ticket: x"),
            "a blocked row with no response": (
                sender, "UPDATE outbox SET state = 'blocked', response = NULL",
                "outbox worker-0/op-0 blocked, not given up after 10 attempts: None"),
            "a blocked row that was not given up after MAX_ATTEMPTS": (
                sender, "UPDATE outbox SET state = 'blocked', response = '{\"error\": \"x\"}'",
                "outbox worker-0/op-0 blocked, not given up after 10 attempts: "),
            "a row blocked as given up after MAX_ATTEMPTS that had fewer": (
                sender, "UPDATE outbox SET state = 'blocked', response = json_object('error',"
                " 'no valid answer after 10 attempts')",
                "outbox worker-0/op-0 blocked as given up after 10 attempts, but had 1"),
            "the receipt of a reported stale outcome deleted": (
                transfer, "DELETE FROM receipt WHERE op = 'worker-0/s'",
                "reported worker-0/s stale, but its receipt is gone"),
            "an applied receipt without its effect": (
                transfer, "DELETE FROM effects WHERE op = 'worker-0/t'",
                "worker-0/t: applied receipt, no row"),
            "a resource row deleted": (
                transfer, "DELETE FROM resources WHERE name = 'C'",
                "resource C is gone: init made it, and nothing deletes one"),
            "a resource init never made": (
                transfer, "INSERT INTO resources VALUES ('E', 1, 1)",
                "resource E was never made by init"),
            "a foreign key broken": (
                sender, "UPDATE outbox SET caller = 'nobody'", "integrity of sender.db: "),
            "a reported ticket that is another key's": (
                receiver, "UPDATE tickets SET key = 'op-9' WHERE id = 2",
                "reported worker-0/op-1 ticket 2: that ticket is ('worker-0', 'op-9')"),
        }
        for label, (name, sql, said) in breaks.items():
            with self.subTest(label), folder() as base:
                tamper(base, name, sql)
                violations = []
                torture.check(base, violations)
                self.assertTrue(any(line.startswith(said) for line in violations), violations)

    def test_a_transfer_reported_applied_that_the_database_says_never_happened_is_reported(self):
        # Its receipt made stale, its effect deleted and both resources put back by hand: the
        # database alone is consistent, and only what the worker was told says otherwise.
        with folder() as base:
            tamper(base, torture.TRANSFER_DB, """
                UPDATE receipt SET result = json_object('status', 'stale', 'observed',
                    json_object('A', 2, 'B', 1)) WHERE op = 'worker-0/t';
                DELETE FROM effects WHERE op = 'worker-0/t';
                UPDATE resources SET quantity = quantity + 3, revision = revision - 1
                    WHERE name = 'A';
                UPDATE resources SET quantity = quantity - 3, revision = revision - 1
                    WHERE name = 'B';""")
            violations = []
            torture.check(base, violations)
            self.assertEqual(violations, ["reported worker-0/t applied, stored {'status': "
                                          "'stale', 'observed': {'A': 2, 'B': 1}}"])

    def test_a_plan_made_stale_that_was_applied_all_the_same_is_reported(self):
        # A's revision put back by hand to the one the stale plan names: execute() finds the plan
        # current and applies it, and the worker is told so.
        with folder(before_stale="UPDATE resources SET revision = revision - 1"
                                 " WHERE name = 'A'") as base:
            violations = []
            torture.check(base, violations)
            self.assertIn("stale plan worker-0/s reported applied, not stale", violations)

    def test_a_row_given_up_after_max_attempts_for_real_is_no_violation(self):
        # A receiver that reads each request and dies before it answers: with nothing written,
        # or once its ticket and receipt are committed.
        for commits in (False, True):
            with self.subTest(commits=commits), folder() as base:
                start = never_answers(os.path.join(base, reliability.RECEIVER), commits)
                sender_db = os.path.join(base, reliability.SENDER)
                with contextlib.closing(reliability.connect(sender_db)) as sender:
                    reliability.enqueue(sender, "worker-1", "op-0", {"worker": 1, "op": 0},
                                        now=0)
                    # Each attempt's lease ends before the next: the row is due again.
                    tries = 0
                    while reliability.dispatch(sender, base, tries * reliability.LEASE_TICKS,
                                               start=start) is not None:
                        tries += 1
                    state, attempts, response = sender.execute(
                        "SELECT state, attempts, response FROM outbox WHERE caller = 'worker-1'"
                    ).fetchone()
                given_up = {"error": "no valid answer after 10 attempts"}
                self.assertEqual((tries, state, attempts, json.loads(response)),
                                 (reliability.MAX_ATTEMPTS, "blocked", reliability.MAX_ATTEMPTS,
                                  given_up))
                violations = []
                final = torture.check(base, violations)
                self.assertEqual(violations, [])
                self.assertEqual((final["outbox"]["blocked"], final["tickets"]),
                                 (1, 3 if commits else 2))


class CommandLineTest(unittest.TestCase):
    def test_bad_usage_exits_2(self):
        usages = ([], ["1", "--operations", "5"], ["0"], ["nan"], ["--operations", "0"],
                  ["--bogus"])
        for argv in usages:
            with self.subTest(argv=argv):
                done = subprocess.run([sys.executable, "-S", SCRIPT, *argv], capture_output=True,
                                      timeout=WATCHDOG)
                self.assertEqual(done.returncode, 2, done.stderr)
                # What is missing, or what is too much, is what the line says.
                said = done.stderr.decode("utf-8").splitlines()[-1]
                if argv in ([], ["1", "--operations", "5"]):
                    self.assertEqual(said.endswith(", not both"), bool(argv), said)
        done = subprocess.run([sys.executable, "-S", SCRIPT, "--help"], capture_output=True,
                              timeout=WATCHDOG)
        # The whole first paragraph of the docstring, not its first line cut mid-sentence.
        self.assertIn(b"invariant is checked from the databases.", b" ".join(done.stdout.split()))

    @unittest.skipUnless(os.path.isdir("/proc"), "the interrupt goes to a process group (Linux)")
    def test_ctrl_c_exits_130_quietly_and_leaves_nothing_behind(self):
        # A background job's children ignore SIGINT too.
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            self.skipTest("SIGINT is ignored in this process, so no child of it can be stopped")
        # A 60 s run is surely still running when the interrupt lands once its four workers
        # have journaled: workers and tool children are interrupted, whatever the timing.
        with tempfile.TemporaryDirectory() as directory:
            env = dict(os.environ, TMPDIR=directory, PYTHONDONTWRITEBYTECODE="1")
            child = subprocess.Popen([sys.executable, "-S", SCRIPT, "60"], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True, env=env)
            try:
                deadline = time.monotonic() + WATCHDOG
                while len(glob.glob(os.path.join(directory, "torture-*", "worker-*.journal"))) < 4:
                    self.assertLess(time.monotonic(), deadline, "the workers never journaled")
                    time.sleep(0.005)
                os.killpg(child.pid, signal.SIGINT)
                _, err = child.communicate(timeout=WATCHDOG)
                # Nothing of the run goes on: every process of its group ends (a zombie that
                # init has not reaped yet has ended).
                while article1.group_running(child.pid):
                    self.assertLess(time.monotonic(), deadline, "a process of the run lives on")
                    time.sleep(0.005)
            finally:
                if child.returncode is None:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.communicate()
            err = err.decode("utf-8")
            self.assertEqual(child.returncode, 130, err)
            self.assertEqual(err.splitlines()[-1], "beyond/torture.py: interrupted")
            self.assertNotIn("Traceback", err)
            # Its temporary folder is gone.
            self.assertEqual(os.listdir(directory), [])

    @unittest.skipUnless(hasattr(os, "fork") and os.path.isdir("/proc"),
                         "forked workers, a pseudo-terminal, Linux /proc")
    def test_ctrl_c_sigterm_or_sighup_at_a_terminal_exit_130_in_one_line_leaving_nothing(self):
        # Typed at a terminal; SIGTERM to it alone (it must stop its workers itself); a hang-up
        # to its group.  A 60 s run is surely still running once its four workers have
        # journaled.
        stops = {"Ctrl-C": None, "SIGTERM to it alone": lambda pid: os.kill(pid, signal.SIGTERM),
                 "SIGHUP to its group": lambda pid: os.killpg(pid, signal.SIGHUP)}
        versions = io.StringIO()
        run_experiment.versions(versions)
        for label, stop in stops.items():
            with self.subTest(label), tempfile.TemporaryDirectory() as directory:
                journals = os.path.join(directory, "torture-*", "worker-*.journal")
                done = article1.at_a_terminal(
                    [shutil.which("env"), f"TMPDIR={directory}", sys.executable, SCRIPT, "60"],
                    lambda pid, screen: len(glob.glob(journals)) == torture.WORKERS, stop)
                self.assertEqual(done, (130, versions.getvalue()
                                        + "beyond/torture.py: interrupted\n", []))
                # Its temporary folder is gone.
                self.assertEqual(os.listdir(directory), [])


# --- machinery -------------------------------------------------------------------------------

@contextlib.contextmanager
def folder(before_stale=None):
    """A torture folder as a run leaves it, made through the protocols: worker 0 enqueued op-0
    and a dispatch delivered it (ticket 1), received op-1 directly (ticket 2), transferred 3
    from A to B (op worker-0/t), changed A by -1 (op worker-0/c), and then ran a plan it made
    stale as a worker does (op worker-0/s, A's revision minus 1); its reported file holds those
    answers.  ``before_stale``: SQL run on transfer.db by hand just before the stale plan."""
    with tempfile.TemporaryDirectory() as base:
        reliability.init(base)
        preconditions.init(os.path.join(base, torture.TRANSFER_DB), torture.RESOURCES)
        sender_db = os.path.join(base, reliability.SENDER)
        with contextlib.closing(reliability.connect(sender_db)) as sender:
            reliability.enqueue(sender, "worker-0", "op-0", {"worker": 0, "op": 0}, now=0)
            delivered = reliability.dispatch(sender, base, 0, start=run_experiment.start_tool)
        receiver_db = os.path.join(base, reliability.RECEIVER)
        with contextlib.closing(reliability.connect(receiver_db)) as receiver:
            received = reliability.receive(receiver, "worker-0", "op-1", {"worker": 0, "op": 1},
                                           issued_at=0, now=0)
        path = os.path.join(base, torture.TRANSFER_DB)
        with contextlib.closing(preconditions.connect(path)) as transfer:
            plan = {"src": "A", "dst": "B", "amount": 3, "expected": {"A": 1, "B": 1}}
            applied = preconditions.execute(transfer, "worker-0/t", plan, issued_at=0, now=0)
            changed = preconditions.change(transfer, "worker-0/c", "A", -1, issued_at=0, now=0)
            seen = dict(transfer.execute("SELECT name, revision FROM resources"
                                         " WHERE name IN ('A', 'B')").fetchall())
            stale = {"src": "A", "dst": "B", "amount": 5, "expected": dict(seen, A=seen["A"] - 1)}
            if before_stale is not None:
                transfer.execute(before_stale)
            made_stale = preconditions.execute(transfer, "worker-0/s", stale, issued_at=0, now=0)
        with open(torture._file(base, 0, "reported"), "w", encoding="utf-8") as reported:
            for entry in (delivered["response"], received,
                          {"op": "worker-0/t", "kind": "execute_fresh", "result": applied},
                          {"op": "worker-0/c", "kind": "change", "result": changed},
                          {"op": "worker-0/s", "kind": "execute_stale", "result": made_stale}):
                reported.write(json.dumps(entry) + "\n")
        yield base


def tamper(base, name, script):
    """Run ``script`` on a database of the folder by hand, foreign keys off."""
    with contextlib.closing(sqlite3.connect(os.path.join(base, name))) as database:
        database.execute("PRAGMA foreign_keys = OFF")
        database.executescript(script)


# A receiver that reads the request and dies before it answers: argv is the project root, its
# database, and whether it first commits the ticket and receipt as receive() does.
NEVER_ANSWERS = """
import contextlib, json, os, sys
sys.path.insert(0, sys.argv[1])
import reliability
request = json.loads(sys.stdin.buffer.readline())
if sys.argv[3] == "commits":
    with contextlib.closing(reliability.connect(sys.argv[2])) as receiver:
        reliability.receive(receiver, request["caller"], request["key"], request["payload"],
                            issued_at=request["issued_at"], now=request["now"])
os._exit(reliability.CRASH_EXIT)
"""


def never_answers(database, commits):
    """A launcher for reliability.dispatch whose tool child is NEVER_ANSWERS on ``database``."""
    def start(argv):
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", NEVER_ANSWERS, ROOT, database,
                                 "commits" if commits else "dies"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    return start


if __name__ == "__main__":
    unittest.main()
