"""Tests of beyond/queued.py: writers in line take turns in the order they came.

Run from the project root: ``python3 -m unittest beyond.test_queued``.  Every writer is a real
process on a real receiver.db in a fresh temporary directory; the order writers come in is
forced (each is forked once the one before holds its place), never hoped for.
"""
import contextlib
import json
import os
import select
import shutil
import signal
import sqlite3
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project root

import reliability  # noqa: E402
import run_experiment  # noqa: E402
from beyond import queued as line_mod  # noqa: E402

WATCHDOG = 60.0  # seconds: only ends a hung child, never asserted as a measurement
PAYLOAD = {"title": "打印机卡纸", "priority": 2}
TEMPLATE = {}


def setUpModule():
    TEMPLATE["dir"] = tempfile.TemporaryDirectory()
    reliability.init(TEMPLATE["dir"].name)


def tearDownModule():
    TEMPLATE.pop("dir").cleanup()


class Workspace:
    def __init__(self, root, stack):
        self.root, self._stack = root, stack

    def path(self, name):
        return os.path.join(self.root, {"receiver": reliability.RECEIVER}.get(name, name))

    @property
    def receiver(self):
        if "_receiver" not in vars(self):
            self._receiver = reliability.connect(self.path("receiver"))
            self._stack.callback(self._receiver.close)
        return self._receiver


@contextlib.contextmanager
def workspace():
    with tempfile.TemporaryDirectory() as root, contextlib.ExitStack() as stack:
        for name in reliability.KINDS:
            shutil.copyfile(os.path.join(TEMPLATE["dir"].name, name), os.path.join(root, name))
        yield Workspace(root, stack)


def receive(ws, key="k1"):
    return reliability.receive(ws.receiver, "agent", key, PAYLOAD, issued_at=0, now=0)


def counts(ws):
    return {"tickets": ws.receiver.execute("SELECT count(*) FROM tickets").fetchone()[0]}


class Case(unittest.TestCase):
    pass


def _write_in_turn(database, name, log):
    """A writer in its own process: in its turn, it adds its name to ``log``."""
    with contextlib.closing(reliability.connect(database)) as connection:
        with line_mod.queued(connection, deadline=WATCHDOG):
            with open(log, "a", encoding="utf-8") as handle:
                handle.write(name + "\n")
    return name


def _give_up(database, times=1, deadline=0.01):
    """Waits in line ``deadline`` seconds ``times`` times: "busy" each time the turn is held."""
    with contextlib.closing(reliability.connect(database)) as connection:
        said = set()
        for _ in range(times):
            try:
                with line_mod.queued(connection, deadline=deadline):
                    said.add("had the turn")
            except line_mod.Busy:
                said.add("busy")
        return " ".join(sorted(said))


def _give_up_and_stay(database, said, leave):
    """Gives up in line, says it is out, and stays alive until told to leave."""
    outcome = _give_up(database)
    os.write(said, b"in")
    os.read(leave, 1)
    return outcome


def _only_woken(database, said, leave):
    """Stands in line like queued() does but never looks for itself: it only learns that its
    turn may have come from a wake-up on its bell, and says what it heard (None: nothing)."""
    line = os.open(database + "-queue", os.O_RDWR)
    line_mod.fcntl.lockf(line, line_mod.fcntl.LOCK_EX, 1, line_mod.QUEUE_COUNTER)
    ticket = line_mod._read(line, line_mod.QUEUE_TICKETS)
    os.pwrite(line, (ticket + 1).to_bytes(8, "big"), line_mod.QUEUE_TICKETS)
    line_mod.fcntl.lockf(line, line_mod.fcntl.LOCK_EX, 1, line_mod.QUEUE_PLACES + ticket)
    line_mod.fcntl.lockf(line, line_mod.fcntl.LOCK_UN, 1, line_mod.QUEUE_COUNTER)
    with line_mod._bell(line, ticket) as bell:
        os.write(said, b"in")
        bell.settimeout(WATCHDOG)  # only ends a hang
        try:
            return bell.recv(1).decode()
        except OSError:
            return None


def _look_and_stay(database, said, leave):
    """Holds the shared lock a writer takes for a moment to look at the line, as one stopped
    while it looks would, until told to leave."""
    line = os.open(database + "-queue", os.O_RDWR)
    line_mod.fcntl.lockf(line, line_mod.fcntl.LOCK_SH, 0, line_mod.QUEUE_PLACES)
    os.write(said, b"in")
    return os.read(leave, 1).decode()


def _hold_turn(database, said, leave, deadline=0):
    """Takes the turn (alone, with deadline 0: no wait), says so, and keeps it until told."""
    with contextlib.closing(reliability.connect(database)) as connection:
        with line_mod.queued(connection, deadline=deadline):
            os.write(said, b"in")
            return os.read(leave, 1).decode()


class _ToldToLeave(Exception):
    pass


def _leave_when_told(database):
    """Waits in line until SIGUSR1, which makes it leave as any exception would."""
    def told(*_):
        raise _ToldToLeave
    signal.signal(signal.SIGUSR1, told)
    try:
        with contextlib.closing(reliability.connect(database)) as connection:
            with line_mod.queued(connection, deadline=WATCHDOG):
                return "had the turn"
    except _ToldToLeave:
        return "left the line"


def tickets_drawn(database):
    """How many tickets writers have drawn from ``<db>-queue``: its first 8 bytes."""
    with open(database + "-queue", "rb") as handle:
        return int.from_bytes(handle.read(8).ljust(8, b"\0"), "big")


def locked_by_another(database, byte):
    """Whether another process holds a lock on ``byte`` of ``<db>-queue``.  Never call it from a
    process in its turn: closing any descriptor of a file drops all the process's locks on it."""
    with open(database + "-queue", "rb") as handle:
        try:
            line_mod.fcntl.lockf(handle.fileno(), line_mod.fcntl.LOCK_SH | line_mod.fcntl.LOCK_NB, 1, byte)
        except OSError:
            return True
        line_mod.fcntl.lockf(handle.fileno(), line_mod.fcntl.LOCK_UN, 1, byte)
        return False


def queue_descriptors():
    """What this process holds open of the queue: its lock file or a socket."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor, closed meanwhile
            target = os.readlink(f"/proc/self/fd/{fd}")
            held += [target] if target.endswith("-queue") or target.startswith("socket:") else []
    return held


def bell_bound(database, ticket):
    """Whether the writer holding ``ticket`` listens on its bell (Linux lists abstract names as @...)."""
    with open(database + "-queue", "rb") as handle:
        name = line_mod._bell_name(os.fstat(handle.fileno()), ticket)
    with open("/proc/net/unix", encoding="utf-8", errors="replace") as sockets:
        return any(row.split()[-1] == "@" + name[1:] for row in sockets if len(row.split()) > 7)


class Line:
    """Writers forked one at a time, each once the one before holds its place in line and
    listens on its bell, so the order they came in is forced.  The turn is held first by a
    process of its own, since the test's own opening of ``<db>-queue`` would drop it.  A
    child that talks, ``writer(database, said, leave, *args)``, writes b"in" to ``said``
    once it is where it should be and ends when told on ``leave``.  On leaving, every
    child is reaped."""

    def __init__(self, database, log):
        self.database, self.log, self.writers, self.pipes = database, log, {}, {}

    def __enter__(self):
        self.talk("the holder", _hold_turn)
        self.heard("the holder")
        return self

    def release(self):
        """The first holder leaves its turn."""
        self.tell("the holder")
        self.finish("the holder")

    def join(self, name, writer=None, *args):
        """Fork ``writer(database, *args)`` (by default one that logs its name in its turn);
        return once it holds its place and listens."""
        ticket = tickets_drawn(self.database)
        self.fork(name, writer or _write_in_turn, *(args if writer else (name, self.log)))
        watchdog = time.monotonic() + WATCHDOG  # only ends a hang: its place in line is what is awaited
        while not locked_by_another(self.database, line_mod.QUEUE_PLACES + ticket) or \
                locked_by_another(self.database, line_mod.QUEUE_COUNTER) or not bell_bound(self.database, ticket):
            assert time.monotonic() < watchdog, f"{name} never took its place in line"
            time.sleep(0.001)

    def talk(self, name, writer, *args, joins=False):
        """Fork a child that talks; with ``joins``, return once it holds its place."""
        said, told = os.pipe()
        leave, go = os.pipe()
        self.pipes[name] = said, go
        try:
            (self.join if joins else self.fork)(name, writer, told, leave, *args)
        finally:
            os.close(told)
            os.close(leave)

    def heard(self, name):
        said = self.pipes[name][0]
        assert select.select([said], [], [], WATCHDOG)[0] and os.read(said, 2) == b"in", f"{name} said nothing"

    def tell(self, name):
        os.write(self.pipes[name][1], b"!")

    def fork(self, name, writer, *args):
        self.writers[name] = run_experiment.fork_json(writer, self.database, *args)

    def finish(self, name):
        pid, reader = self.writers.pop(name)
        with os.fdopen(reader, encoding="utf-8") as pipe:
            assert select.select([pipe], [], [], WATCHDOG)[0], f"{name} never ended"
            said = pipe.read()
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), said

    def kill(self, name):
        pid, reader = self.writers.pop(name)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(reader)

    def granted(self):
        if not os.path.exists(self.log):
            return []
        with open(self.log, encoding="utf-8") as handle:
            return handle.read().split()

    def __exit__(self, *exc):
        for name in list(self.writers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.writers[name][0], signal.SIGCONT)
            self.kill(name)
        for fd in (fd for pipes in self.pipes.values() for fd in pipes):
            os.close(fd)


@unittest.skipUnless(line_mod.fcntl is not None and sys.platform.startswith("linux"),
                     "POSIX record locks, and prctl to reap an orphaned grandchild")
class QueueTest(Case):
    """Beyond 第一篇: queued() is opt-in; its record lock dies with its holder, even one that forked."""

    def test_transactions_alone_never_queue_and_queued_creates_its_lock_file(self):
        with workspace() as ws:
            receive(ws)
            self.assertFalse(os.path.exists(ws.path("receiver") + "-queue"))
            with line_mod.queued(ws.receiver, deadline=0) as connection:
                self.assertIs(connection, ws.receiver)
                receive(ws, "k2")
            self.assertTrue(os.path.exists(ws.path("receiver") + "-queue"))
            self.assertEqual(counts(ws)["tickets"], 2)

    def test_a_deadline_that_is_not_a_finite_number_of_seconds_raises_at_once(self):
        with workspace() as ws:
            for deadline in (float("nan"), float("inf"), -1, None, "1", [1], True):
                with self.subTest(deadline=deadline), self.assertRaises(ValueError):
                    with line_mod.queued(ws.receiver, deadline=deadline):
                        receive(ws)
            self.assertEqual(counts(ws)["tickets"], 0)
            self.assertFalse(os.path.exists(ws.path("receiver") + "-queue"))  # refused before the lock file

    def test_a_connection_to_no_file_is_refused_before_any_lock_file(self):
        with contextlib.closing(sqlite3.connect(":memory:")) as memory:
            before = os.listdir(os.getcwd())
            with self.assertRaises(ValueError), line_mod.queued(memory):
                pass
            self.assertEqual(os.listdir(os.getcwd()), before)

    def test_a_writer_alone_takes_the_turn_without_a_ticket(self):
        with workspace() as ws:
            for key in ("k1", "k2"):
                with line_mod.queued(ws.receiver):
                    receive(ws, key)
            self.assertEqual(tickets_drawn(ws.path("receiver")), 0)
            self.assertEqual(counts(ws)["tickets"], 2)

    @unittest.skipUnless(hasattr(os, "fork"), "writers in line are other processes")
    def test_writers_in_line_get_the_turn_in_the_order_they_came(self):
        names = ["first", "second", "third", "fourth"]
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            for name in names:
                line.join(name)
            self.assertEqual(line.granted(), [])
            line.release()
            self.assertEqual([line.finish(name) for name in names], [(0, json.dumps(name)) for name in names])
            self.assertEqual(line.granted(), names)
            self.assertEqual(tickets_drawn(ws.path("receiver")), 4)

    @unittest.skipUnless(hasattr(os, "fork"), "writers in line are other processes")
    def test_the_writer_leaving_the_turn_wakes_the_first_in_line(self):
        for came in ("at once", "through the line"):  # whoever has the turn, however it got it
            with self.subTest(came), workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
                if came == "through the line":
                    line.join("first")  # woken by the holder, it has the turn next
                line.talk("only woken", _only_woken, joins=True)  # never looks: only a wake-up lets it go
                line.release()
                if came == "through the line":
                    self.assertEqual(line.finish("first")[0], 0)
                self.assertEqual(line.finish("only woken"), (0, json.dumps("!")))
                self.assertEqual(line.granted(), ["first"] if came == "through the line" else [])

    @unittest.skipUnless(hasattr(os, "fork"), "writers in line are other processes")
    def test_a_wake_up_starts_from_the_writer_served_last(self):
        with workspace() as ws:
            abandoned = line_mod.QUEUE_SCAN + 5  # tickets of writers who left: no place, no bell
            with open(ws.path("receiver") + "-queue", "wb") as queue:
                queue.write(abandoned.to_bytes(8, "big"))
            with Line(ws.path("receiver"), ws.path("granted")) as line:
                line.join("first")  # nobody wakes it past so many: it looks for itself
                line.talk("only woken", _only_woken, joins=True)
                line.release()
                self.assertEqual(line.finish("first")[0], 0)  # served, it wakes from the ticket after its own
                self.assertEqual(line.finish("only woken"), (0, json.dumps("!")))
                self.assertEqual(tickets_drawn(ws.path("receiver")), abandoned + 2)

    @unittest.skipUnless(hasattr(os, "fork"), "writers in line are other processes")
    def test_a_writer_waits_no_longer_than_its_deadline_even_to_take_its_place(self):
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            line.talk("looks", _look_and_stay)
            line.heard("looks")
            line.fork("gives up", _give_up)
            self.assertEqual(line.finish("gives up"), (0, json.dumps("busy")))  # while the other looks
            line.tell("looks")
            self.assertEqual(line.finish("looks"), (0, json.dumps("!")))

    @unittest.skipUnless(hasattr(os, "fork"), "writers in line are other processes")
    def test_a_wake_up_never_waits_to_be_heard(self):
        with open("/proc/sys/net/unix/max_dgram_qlen", encoding="ascii") as limit:
            times = 2 * int(limit.read()) + 2  # a stopped writer's bell holds this many wake-ups, and no more
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            line.join("stopped")
            os.kill(line.writers["stopped"][0], signal.SIGSTOP)  # first in line, it reads no wake-up
            line.fork("gives up", _give_up, times)  # each time it rings the stopped one
            self.assertEqual(line.finish("gives up"), (0, json.dumps("busy")))
            os.kill(line.writers["stopped"][0], signal.SIGCONT)
            line.release()
            self.assertEqual(line.finish("stopped")[0], 0)
            self.assertEqual(line.granted(), ["stopped"])

    @unittest.skipUnless(hasattr(os, "fork"), "writers in line are other processes")
    def test_a_writer_who_leaves_the_line_wakes_the_next_not_one_served_or_itself(self):
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            line.talk("served", _hold_turn, WATCHDOG, joins=True)  # ticket 0: it will have the turn
            line.release()
            line.heard("served")
            line.join("leaves", _leave_when_told)  # ticket 1
            line.talk("only woken", _only_woken, joins=True)  # ticket 2
            os.kill(line.writers["leaves"][0], signal.SIGUSR1)
            self.assertEqual(line.finish("leaves"), (0, json.dumps("left the line")))
            self.assertEqual(line.finish("only woken"), (0, json.dumps("!")))
            line.tell("served")
            self.assertEqual(line.finish("served"), (0, json.dumps("!")))

    @unittest.skipUnless(hasattr(os, "fork"), "writers in line are other processes")
    def test_a_writer_who_comes_when_the_turn_is_free_goes_behind_those_in_line(self):
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            line.join("waiting")
            os.kill(line.writers["waiting"][0], signal.SIGSTOP)  # first in line, it cannot take the turn
            line.release()
            line.join("newcomer")  # the turn is free, yet it draws a ticket and waits behind
            self.assertEqual(line.granted(), [])
            os.kill(line.writers["waiting"][0], signal.SIGCONT)
            self.assertEqual([line.finish(name)[0] for name in ("waiting", "newcomer")], [0, 0])
            self.assertEqual(line.granted(), ["waiting", "newcomer"])

    @unittest.skipUnless(hasattr(os, "fork"), "writers in line are other processes")
    def test_a_writer_who_dies_or_gives_up_in_line_holds_up_nobody(self):
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            database = ws.path("receiver")
            line.join("first")
            line.talk("gave up", _give_up_and_stay)
            line.heard("gave up")  # it drew a ticket and left the line, and stays alive
            self.assertEqual(run_experiment.run_forked(_give_up, database, 1, 0), "busy")  # one try: no ticket
            with self.assertRaises(line_mod.Busy):  # here: in line, then out, with nothing left open
                with line_mod.queued(ws.receiver, deadline=0.01):
                    pass
            self.assertEqual(queue_descriptors(), [])
            line.join("dies")
            line.join("last")
            line.kill("dies")  # killed while it waits: its place goes with it
            self.assertEqual(tickets_drawn(database), 5)
            line.release()
            self.assertEqual([line.finish(name)[0] for name in ("first", "last")], [0, 0])
            self.assertEqual(line.granted(), ["first", "last"])
            self.assertEqual(counts(ws)["tickets"], 0)  # the one that gave up wrote nothing
            line.tell("gave up")
            self.assertEqual(line.finish("gave up"), (0, json.dumps("busy")))


    @unittest.skipUnless(hasattr(os, "fork"), "another process tries the lock")
    def test_leaving_queued_releases_the_lock_for_the_next_writer(self):
        with workspace() as ws:
            for outcome in ("left", "raised"):
                with self.subTest(outcome), contextlib.suppress(RuntimeError):
                    with line_mod.queued(ws.receiver):
                        if outcome == "raised":
                            raise RuntimeError("the write failed")
                # one try (deadline 0) from another process: Busy would mean the lock was kept
                self.assertEqual(run_experiment.run_forked(_give_up, ws.path("receiver"), 1, 0), "had the turn")

    def test_the_lock_dies_with_its_holder_although_its_forked_child_keeps_the_descriptor(self):
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_CHILD_SUBREAPER = 36  # the orphaned grandchild becomes ours to reap
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            self.skipTest("prctl(PR_SET_CHILD_SUBREAPER) refused")
        self.addCleanup(libc.prctl, PR_SET_CHILD_SUBREAPER, 0, 0, 0)
        with workspace() as ws:
            database = ws.path("receiver")
            reader, writer = os.pipe()
            holder = os.fork()
            if holder == 0:  # never returns into the test runner
                code = 1
                try:
                    os.close(reader)
                    connection = reliability.connect(database)
                    with line_mod.queued(connection):
                        grandchild = os.fork()
                        if grandchild == 0:
                            try:
                                os.close(writer)
                                time.sleep(3600)  # keeps the queue descriptor it inherited
                            finally:
                                os._exit(1)
                        os.write(writer, f"{grandchild}\n".encode())
                        time.sleep(3600)
                finally:
                    os._exit(code)
            os.close(writer)
            grandchild = None
            try:
                with os.fdopen(reader, "rb") as pipe:
                    self.assertTrue(select.select([pipe], [], [], WATCHDOG)[0], "the holder never got the lock")
                    grandchild = int(pipe.readline())
                queue = database + "-queue"
                if os.path.isdir(f"/proc/{grandchild}/fd"):
                    held = []
                    for fd in os.listdir(f"/proc/{grandchild}/fd"):
                        with contextlib.suppress(FileNotFoundError):  # its pipe end, closed meanwhile: not ordered
                            held.append(os.readlink(f"/proc/{grandchild}/fd/{fd}"))
                    self.assertIn(os.path.realpath(queue), held)
                ran = []
                with self.assertRaises(line_mod.Busy) as caught:
                    with line_mod.queued(ws.receiver, deadline=0.05):
                        ran.append(True)
                self.assertIsInstance(caught.exception, sqlite3.OperationalError)
                self.assertEqual(ran, [])
                os.kill(holder, signal.SIGKILL)
                os.waitpid(holder, 0)
                holder = None
                os.kill(grandchild, 0)  # still alive, still holding the descriptor
                with line_mod.queued(ws.receiver, deadline=0):  # one try: no Busy
                    receive(ws)
                self.assertEqual(counts(ws)["tickets"], 1)
            finally:
                for pid in (holder, grandchild):
                    if pid is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
