"""Tests of beyond/queued.py: writers in line take turns in the order they came.

Run from the project root: ``python3 -m unittest beyond.test_queued``.  Every writer is a real
process on a real receiver.db in a fresh temporary directory; the order writers come in is
forced (each is forked once the one before holds its place), never hoped for.  A wait fails
after SILENCE seconds without the sign it waits for: the sign follows its cause within
milliseconds, so a broken line fails in seconds, and a loaded machine only makes it later.
"""
import contextlib
import errno
import json
import os
import select
import shutil
import signal
import socket
import sqlite3
import stat
import sys
import tempfile
import time
import unittest

# The project root, whether this runs as beyond.test_queued or as a file.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import reliability
import run_experiment
from beyond import queued as line_mod

# Seconds a wait hears nothing before it fails; never asserted as a measurement.
SILENCE = 5.0
# A child's deadline in line: it only ends a child that outlives its test.
CHILD_DEADLINE = 60.0
# Where queued() keeps its line and wakes writers; /proc tells the tests what they hold.
LINUX = line_mod.fcntl is not None and sys.platform.startswith("linux")
PAYLOAD = {"title": "打印机卡纸", "priority": 2}
TEMPLATE = {}
# Two users of one group, as root becomes them: nobody, and a uid no account has.
TEAM_GID, TEAM_UIDS = 65534, (65534, 65533)
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@unittest.skipUnless(LINUX, "POSIX record locks, and Linux's wake-ups by datagram")
class LineFileTest(unittest.TestCase):
    """Beyond 第一篇: queued() is opt-in, and writes into no file but its own line."""

    def test_transactions_alone_never_queue_and_queued_makes_its_line_with_its_header(self):
        with workspace() as ws:
            receive(ws)
            self.assertFalse(os.path.exists(ws.queue))
            with line_mod.queued(ws.receiver, deadline=0) as connection:
                self.assertIs(connection, ws.receiver)
                receive(ws, "k2")
            self.assertEqual(read_bytes(ws.queue), line_mod.QUEUE_HEADER)
            self.assertEqual(tickets(ws), 2)

    def test_a_deadline_that_is_not_a_finite_number_of_seconds_a_float_holds_raises_at_once(self):
        with workspace() as ws:
            for deadline in (float("nan"), float("inf"), -float("inf"), -1, -0.5, 10 ** 400,
                             -10 ** 400, 2 ** 1024, None, "1", [1], True, False):
                with self.subTest(deadline=deadline), self.assertRaises(ValueError):
                    with line_mod.queued(ws.receiver, deadline=deadline):
                        receive(ws)
            self.assertEqual(tickets(ws), 0)
            # Refused before the line is made.
            self.assertFalse(os.path.exists(ws.queue))

    def test_a_connection_to_no_file_is_refused_before_any_line_file(self):
        with contextlib.closing(sqlite3.connect(":memory:")) as memory:
            before = os.listdir(os.getcwd())
            with self.assertRaises(ValueError), line_mod.queued(memory):
                pass
            self.assertEqual(os.listdir(os.getcwd()), before)

    def test_a_symbolic_link_at_the_line_is_refused_and_what_it_points_to_is_left_alone(self):
        for target in ("an empty file", "nothing"):
            with self.subTest(target), workspace() as ws:
                victim = ws.path("victim")
                if target == "an empty file":
                    open(victim, "wb").close()
                os.symlink(victim, ws.queue)
                with self.assertRaises(OSError) as caught, line_mod.queued(ws.receiver):
                    receive(ws)
                self.assertEqual(refusal(caught), (errno.ELOOP, ws.queue))
                if target == "an empty file":
                    self.assertEqual(read_bytes(victim), b"")
                else:
                    self.assertFalse(os.path.lexists(victim))
                self.assertEqual(tickets(ws), 0)

    def test_a_database_named_like_the_line_is_refused_and_left_byte_for_byte(self):
        with workspace() as ws:
            with contextlib.closing(sqlite3.connect(ws.queue)) as other:
                other.execute("CREATE TABLE t (x)")
                other.execute("INSERT INTO t VALUES (1)")
                other.commit()
            before = read_bytes(ws.queue)
            with self.assertRaises(OSError) as caught, line_mod.queued(ws.receiver):
                receive(ws)
            self.assertEqual(refusal(caught), (errno.EINVAL, ws.queue))
            self.assertEqual(read_bytes(ws.queue), before)
            self.assertEqual(tickets(ws), 0)

    def test_a_file_that_is_not_a_line_is_refused_and_left_alone(self):
        # An earlier layout: the counters alone, with no header.
        earlier = (3).to_bytes(8, "big") + (2).to_bytes(8, "big")
        for content in (b"hello\n", b"queued() line 2\n", earlier):
            with self.subTest(content=content), workspace() as ws:
                with open(ws.queue, "wb") as handle:
                    handle.write(content)
                with self.assertRaises(OSError) as caught, line_mod.queued(ws.receiver):
                    receive(ws)
                self.assertEqual(refusal(caught), (errno.EINVAL, ws.queue))
                self.assertEqual(read_bytes(ws.queue), content)

    def test_a_fifo_or_a_directory_at_the_line_is_refused_naming_it(self):
        for make, expected in ((os.mkfifo, errno.EINVAL), (os.mkdir, errno.EISDIR)):
            with self.subTest(make.__name__), workspace() as ws:
                make(ws.queue)
                with self.assertRaises(OSError) as caught, line_mod.queued(ws.receiver):
                    receive(ws)
                self.assertEqual(refusal(caught), (expected, ws.queue))
                self.assertEqual(tickets(ws), 0)

    def test_an_empty_file_or_one_cut_short_in_its_header_becomes_a_line(self):
        for content in (b"", line_mod.QUEUE_HEADER[:5]):
            with self.subTest(content=content), workspace() as ws:
                with open(ws.queue, "wb") as handle:
                    handle.write(content)
                with line_mod.queued(ws.receiver):
                    receive(ws)
                self.assertEqual(read_bytes(ws.queue), line_mod.QUEUE_HEADER)
                self.assertEqual(tickets(ws), 1)

    def test_a_line_it_makes_takes_the_database_files_permission_bits_whatever_the_umask(self):
        for mode, umask in ((0o664, 0o002), (0o660, 0o077), (0o600, 0o000)):
            with self.subTest(mode=oct(mode), umask=oct(umask)), workspace() as ws:
                os.chmod(ws.path("receiver"), mode)
                # Process-wide, so put back before anything else runs.
                previous = os.umask(umask)
                try:
                    with line_mod.queued(ws.receiver):
                        receive(ws)
                finally:
                    os.umask(previous)
                self.assertEqual(permissions(ws.queue), mode)
                # SQLite's own -wal, made meanwhile under the same umask, says the same.
                self.assertEqual(permissions(ws.path("receiver") + "-wal"), mode)

    def test_a_line_file_found_keeps_its_mode_unless_it_is_empty_and_this_users(self):
        for content, owner, kept in ((line_mod.QUEUE_HEADER, None, True),
                                     (line_mod.QUEUE_HEADER[:5], None, True),
                                     (b"", None, False), (b"", TEAM_UIDS[0], True)):
            with self.subTest(content=content, owner=owner), workspace() as ws:
                if owner is not None and not ROOT:
                    self.skipTest("a file another user made needs root to make")
                os.chmod(ws.path("receiver"), 0o664)
                with open(ws.queue, "wb") as handle:
                    handle.write(content)
                os.chmod(ws.queue, 0o606)
                if owner is not None:
                    os.chown(ws.queue, owner, -1)
                with line_mod.queued(ws.receiver):
                    receive(ws)
                self.assertEqual(permissions(ws.queue), 0o606 if kept else 0o664)
                self.assertEqual(read_bytes(ws.queue), line_mod.QUEUE_HEADER)

    def test_a_database_whose_path_is_not_utf8_queues_like_any_other(self):
        with workspace(os.fsdecode(b"caf\xe9")) as ws:
            with line_mod.queued(ws.receiver):
                receive(ws)
            self.assertTrue(os.path.exists(ws.queue))
            ws.close()
            with Line(ws.path("receiver"), ws.path("granted")) as line:
                line.join("in line")
                line.release()
                self.assertEqual(line.finish("in line"), (0, json.dumps("in line")))
            self.assertEqual(tickets(ws), 1)

    def test_any_deadline_a_float_holds_waits_in_line_like_any_other(self):
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            for name, deadline in (("int", 10 ** 308), ("float", sys.float_info.max)):
                line.join(name, _write_in_turn, name, line.log, deadline)
            line.release()
            self.assertEqual([line.finish(name) for name in ("int", "float")],
                             [(0, json.dumps(name)) for name in ("int", "float")])
            self.assertEqual(line.granted(), ["int", "float"])


@unittest.skipUnless(LINUX, "POSIX record locks, and Linux's wake-ups by datagram")
class OrderTest(unittest.TestCase):
    """Beyond 第一篇: first come, first served; the one leaving the turn wakes the next."""

    def test_a_writer_alone_takes_the_turn_without_a_ticket(self):
        with workspace() as ws:
            for key in ("k1", "k2"):
                with line_mod.queued(ws.receiver):
                    receive(ws, key)
            self.assertEqual(counters(ws.path("receiver")), (0, 0))
            self.assertEqual(tickets(ws), 2)

    def test_writers_in_line_get_the_turn_in_the_order_they_came(self):
        names = ["first", "second", "third", "fourth"]
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            for name in names:
                line.join(name)
            self.assertEqual(line.granted(), [])
            line.release()
            self.assertEqual([line.finish(name) for name in names],
                             [(0, json.dumps(name)) for name in names])
            self.assertEqual(line.granted(), names)
            self.assertEqual(counters(ws.path("receiver")), (4, 4))

    def test_a_writer_who_comes_when_the_turn_is_free_goes_behind_those_in_line(self):
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            line.join("waiting")
            # First in line, it cannot take the turn.
            os.kill(line.writers["waiting"][0], signal.SIGSTOP)
            line.release()
            # The turn is free, yet it draws a ticket and waits behind.
            line.join("newcomer")
            self.assertEqual(line.granted(), [])
            os.kill(line.writers["waiting"][0], signal.SIGCONT)
            self.assertEqual([line.finish(name)[0] for name in ("waiting", "newcomer")], [0, 0])
            self.assertEqual(line.granted(), ["waiting", "newcomer"])

    def test_the_writer_leaving_the_turn_wakes_the_first_in_line(self):
        # Whoever has the turn, however it got it.
        for came in ("at once", "through the line"):
            with self.subTest(came), workspace() as ws, \
                    Line(ws.path("receiver"), ws.path("granted")) as line:
                if came == "through the line":
                    # Woken by the holder, it has the turn next.
                    line.join("first")
                # It never looks for itself: only a wake-up lets it go.
                line.talk("only woken", _only_woken, joins=True)
                line.release()
                if came == "through the line":
                    self.assertEqual(line.finish("first")[0], 0)
                self.assertEqual(line.finish("only woken"), (0, json.dumps("!")))
                self.assertEqual(line.granted(), ["first"] if came == "through the line" else [])

    def test_a_wake_up_starts_from_the_writer_served_last(self):
        # Tickets of writers who left, with no place and no bell: more than a wake-up tries.
        abandoned = line_mod.QUEUE_SCAN + 5
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            set_counters(ws.path("receiver"), 0, abandoned)
            # Nobody wakes it past so many: it looks for itself.
            line.join("first")
            line.talk("only woken", _only_woken, joins=True)
            line.release()
            # Served, it wakes from the ticket after its own.
            self.assertEqual(line.finish("first")[0], 0)
            self.assertEqual(line.finish("only woken"), (0, json.dumps("!")))
            self.assertEqual(counters(ws.path("receiver"))[1], abandoned + 2)

    def test_a_wake_up_never_waits_to_be_heard(self):
        with open("/proc/sys/net/unix/max_dgram_qlen", encoding="ascii") as limit:
            # A stopped writer's bell holds this many wake-ups, and no more.
            times = 2 * int(limit.read()) + 2
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            line.join("stopped")
            # First in line, it reads no wake-up.
            os.kill(line.writers["stopped"][0], signal.SIGSTOP)
            # Each time it gives up, it rings the stopped one.
            line.fork("gives up", _give_up, times)
            self.assertEqual(line.finish("gives up"), (0, json.dumps("busy")))
            os.kill(line.writers["stopped"][0], signal.SIGCONT)
            line.release()
            self.assertEqual(line.finish("stopped")[0], 0)
            self.assertEqual(line.granted(), ["stopped"])

    def test_leaving_queued_releases_the_lock_for_the_next_writer(self):
        with workspace() as ws:
            for outcome in ("left", "raised"):
                with self.subTest(outcome), contextlib.suppress(RuntimeError):
                    with line_mod.queued(ws.receiver):
                        if outcome == "raised":
                            raise RuntimeError("the write failed")
                # One try (deadline 0) from another process: Busy would mean the lock was kept.
                ws.close()
                self.assertEqual(run_experiment.run_forked(_give_up, ws.path("receiver"), 1, 0),
                                 "had the turn")


@unittest.skipUnless(LINUX, "POSIX record locks, and Linux's wake-ups by datagram")
class LeavingTest(unittest.TestCase):
    """Beyond 第一篇: a writer who dies or gives up holds up nobody; its lock dies with it."""

    def test_a_writer_waits_no_longer_than_its_deadline_even_to_take_its_place(self):
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            line.talk("looks", _look_and_stay)
            line.heard("looks")
            line.fork("gives up", _give_up)
            # While the other looks.
            self.assertEqual(line.finish("gives up"), (0, json.dumps("busy")))
            line.tell("looks")
            self.assertEqual(line.finish("looks"), (0, json.dumps("!")))

    def test_a_writer_who_leaves_the_line_wakes_the_next_not_one_served_or_itself(self):
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            # Ticket 0: it will have the turn.
            line.talk("served", _hold_turn, CHILD_DEADLINE, joins=True)
            line.release()
            line.heard("served")
            line.join("leaves", _leave_when_told)
            line.talk("only woken", _only_woken, joins=True)
            os.kill(line.writers["leaves"][0], signal.SIGUSR1)
            self.assertEqual(line.finish("leaves"), (0, json.dumps("left the line")))
            self.assertEqual(line.finish("only woken"), (0, json.dumps("!")))
            line.tell("served")
            self.assertEqual(line.finish("served"), (0, json.dumps("!")))

    def test_a_writer_whose_bell_name_another_process_holds_still_wakes_the_one_behind_it(self):
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            # Ticket 0's bell name, bound before its writer comes, as a process still listening
            # on a line file whose inode this one reuses would hold it.
            line.talk("holds the name", _hold_bell_name, 0)
            line.heard("holds the name")
            # Ticket 0: its own bell cannot be bound, so it looks for itself.
            line.join("leaves", _leave_when_told)
            # Ticket 1, behind it: it never looks for itself, only a wake-up lets it go.
            line.talk("only woken", _only_woken, joins=True)
            os.kill(line.writers["leaves"][0], signal.SIGUSR1)
            self.assertEqual(line.finish("leaves"), (0, json.dumps("left the line")))
            self.assertEqual(line.finish("only woken"), (0, json.dumps("!")))
            # The wake-up went to the writer in line, not to the name's holder, who is not.
            line.tell("holds the name")
            self.assertEqual(line.finish("holds the name"), (0, json.dumps(None)))

    def test_a_writer_who_dies_or_gives_up_in_line_holds_up_nobody(self):
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            database = ws.path("receiver")
            line.join("first")
            line.talk("gave up", _give_up_and_stay)
            # It drew a ticket and left the line, and stays alive.
            line.heard("gave up")
            # One try: no ticket.
            self.assertEqual(run_experiment.run_forked(_give_up, database, 1, 0), "busy")
            # Here: in line, then out, with nothing left open.
            with self.assertRaises(line_mod.Busy):
                with line_mod.queued(ws.receiver, deadline=0.01):
                    pass
            self.assertEqual(queue_descriptors(), [])
            ws.close()
            line.join("dies")
            line.join("last")
            # Killed while it waits: its place goes with it.
            line.kill("dies")
            self.assertEqual(counters(database)[1], 5)
            line.release()
            self.assertEqual([line.finish(name)[0] for name in ("first", "last")], [0, 0])
            self.assertEqual(line.granted(), ["first", "last"])
            # The one that gave up wrote nothing.
            self.assertEqual(tickets(ws), 0)
            line.tell("gave up")
            self.assertEqual(line.finish("gave up"), (0, json.dumps("busy")))

    def test_a_wake_up_rings_past_a_writer_who_gave_up_and_has_not_left_yet(self):
        with workspace() as ws, Line(ws.path("receiver"), ws.path("granted")) as line:
            # Ticket 0: it gives up, and is held inside queued() once it has rung as it leaves.
            line.talk("gave up", _give_up_and_stay_after_ringing)
            line.heard("gave up")
            # Ticket 1, behind it: it never looks for itself, only a wake-up lets it go.
            line.talk("only woken", _only_woken, joins=True)
            # Leaving the turn, the holder rings from ticket 0: past the one who gave up.
            line.release()
            self.assertEqual(line.finish("only woken"), (0, json.dumps("!")))
            line.tell("gave up")
            self.assertEqual(line.finish("gave up"), (0, json.dumps("busy")))

    def test_a_writer_who_takes_the_turn_at_once_moves_the_line_past_writers_gone(self):
        with workspace() as ws:
            with Line(ws.path("receiver"), ws.path("granted")) as line:
                line.talk("gave up", _give_up_and_stay)
                line.heard("gave up")
                line.release()
                # Its ticket is still the one to wake next: nobody was served since.
                self.assertEqual(counters(ws.path("receiver")), (0, 1))
                with line_mod.queued(ws.receiver):
                    receive(ws)
                self.assertEqual(counters(ws.path("receiver")), (1, 1))
                line.tell("gave up")
                self.assertEqual(line.finish("gave up"), (0, json.dumps("busy")))

    def test_the_lock_dies_with_its_holder_although_its_forked_child_keeps_the_descriptor(self):
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        # The orphaned grandchild becomes ours to reap.
        PR_SET_CHILD_SUBREAPER = 36
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            self.skipTest("prctl(PR_SET_CHILD_SUBREAPER) refused")
        self.addCleanup(libc.prctl, PR_SET_CHILD_SUBREAPER, 0, 0, 0)
        with workspace() as ws:
            database = ws.path("receiver")
            reader, writer = os.pipe()
            holder = os.fork()
            if holder == 0:
                # Never returns into the test runner.
                code = 1
                try:
                    os.close(reader)
                    connection = reliability.connect(database)
                    with line_mod.queued(connection):
                        grandchild = os.fork()
                        if grandchild == 0:
                            try:
                                os.close(writer)
                                # It keeps the queue descriptor it inherited.
                                time.sleep(3600)
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
                    self.assertTrue(select.select([pipe], [], [], SILENCE)[0],
                                    "the holder never got the lock")
                    grandchild = int(pipe.readline())
                if os.path.isdir(f"/proc/{grandchild}/fd"):
                    held = []
                    for fd in os.listdir(f"/proc/{grandchild}/fd"):
                        # Its pipe end, closed meanwhile: not ordered.
                        with contextlib.suppress(FileNotFoundError):
                            held.append(os.readlink(f"/proc/{grandchild}/fd/{fd}"))
                    self.assertIn(os.path.realpath(ws.queue), held)
                ran = []
                with self.assertRaises(line_mod.Busy) as caught:
                    with line_mod.queued(ws.receiver, deadline=0.05):
                        ran.append(True)
                self.assertIsInstance(caught.exception, sqlite3.OperationalError)
                self.assertEqual(ran, [])
                os.kill(holder, signal.SIGKILL)
                os.waitpid(holder, 0)
                holder = None
                # Still alive, still holding the descriptor.
                os.kill(grandchild, 0)
                # One try: no Busy.
                with line_mod.queued(ws.receiver, deadline=0):
                    receive(ws)
                self.assertEqual(tickets(ws), 1)
            finally:
                for pid in (holder, grandchild):
                    if pid is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)


@unittest.skipUnless(LINUX, "POSIX record locks, and Linux's wake-ups by datagram")
class TeamTest(unittest.TestCase):
    """Beyond 第一篇: every member of a group who may write the database may take turns."""

    @unittest.skipUnless(ROOT, "becoming two users of one group needs root")
    def test_a_second_member_of_the_group_takes_turns_on_the_line_the_first_made(self):
        # SQLite gives its -wal the database's mode whatever the umask: a stricter one changes
        # nothing.
        for umask in (0o002, 0o022):
            with self.subTest(umask=oct(umask)), workspace("team") as ws:
                database = ws.path("receiver")
                # The temporary directory above the folder, which only its owner may enter.
                os.chmod(os.path.dirname(ws.root), 0o711)
                for path, mode in ((ws.root, 0o775), (database, 0o664)):
                    os.chown(path, 0, TEAM_GID)
                    os.chmod(path, mode)
                self.assertFalse(os.path.exists(ws.queue))
                first = run_experiment.run_forked(_as_member, database, TEAM_UIDS[0], umask, "k1")
                # The first member made the line.
                self.assertEqual(os.stat(ws.queue).st_uid, TEAM_UIDS[0])
                second = run_experiment.run_forked(_as_member, database, TEAM_UIDS[1], umask,
                                                   "k2")
                member = {"turn": "had the turn", "line": 0o664, "-wal": 0o664}
                self.assertEqual([first, second], [member, member])
                self.assertEqual(tickets(ws), 2)


# --- machinery: workspaces, the line's file, writers in their own processes ---------------

def setUpModule():
    TEMPLATE["dir"] = tempfile.TemporaryDirectory()
    reliability.init(TEMPLATE["dir"].name)


def tearDownModule():
    TEMPLATE.pop("dir").cleanup()


class Workspace:
    def __init__(self, root):
        self.root, self._receiver = root, None
        self.queue = self.path("receiver") + "-queue"

    def path(self, name):
        return os.path.join(self.root, {"receiver": reliability.RECEIVER}.get(name, name))

    @property
    def receiver(self):
        if self._receiver is None:
            self._receiver = reliability.connect(self.path("receiver"))
        return self._receiver

    def close(self):
        """Close the connection before forking writers that open the same file."""
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None


@contextlib.contextmanager
def workspace(folder=""):
    """A fresh receiver.db (and its siblings) in a new temporary directory, under ``folder``."""
    with tempfile.TemporaryDirectory() as top:
        root = os.path.join(top, folder)
        os.makedirs(root, exist_ok=True)
        for name in reliability.KINDS:
            shutil.copyfile(os.path.join(TEMPLATE["dir"].name, name), os.path.join(root, name))
        ws = Workspace(root)
        try:
            yield ws
        finally:
            ws.close()


def receive(ws, key="k1"):
    return reliability.receive(ws.receiver, "agent", key, PAYLOAD, issued_at=0, now=0)


def tickets(ws):
    return ws.receiver.execute("SELECT count(*) FROM tickets").fetchone()[0]


def refusal(caught):
    """(errno, filename) of the OSError an assertRaises block caught."""
    return caught.exception.errno, caught.exception.filename


def read_bytes(path):
    with open(path, "rb") as handle:
        return handle.read()


def permissions(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def counters(database):
    """(the ticket to wake next, tickets drawn), as stored in ``<db>-queue`` after its header."""
    stored = read_bytes(database + "-queue")[line_mod.QUEUE_TICKETS:][:16].ljust(16, b"\0")
    return int.from_bytes(stored[8:], "big"), int.from_bytes(stored[:8], "big")


def set_counters(database, first, drawn):
    with open(database + "-queue", "r+b") as handle:
        handle.seek(line_mod.QUEUE_TICKETS)
        handle.write(drawn.to_bytes(8, "big") + first.to_bytes(8, "big"))


def locked_by_another(database, byte):
    """Whether another process holds a lock on ``byte`` of ``<db>-queue``.  Never call it from a
    process in its turn: closing any descriptor of a file drops all the process's locks on it."""
    with open(database + "-queue", "rb") as handle:
        try:
            line_mod.fcntl.lockf(handle.fileno(), line_mod.fcntl.LOCK_SH | line_mod.fcntl.LOCK_NB,
                                 1, byte)
        except OSError:
            return True
        line_mod.fcntl.lockf(handle.fileno(), line_mod.fcntl.LOCK_UN, 1, byte)
        return False


def queue_descriptors():
    """What this process holds open of the queue: its lock file or a socket."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        # The listing's own descriptor, closed meanwhile.
        with contextlib.suppress(FileNotFoundError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            held += [target] if target.endswith("-queue") or target.startswith("socket:") else []
    return held


def bell_bound(database, ticket):
    """Whether the writer holding ``ticket`` listens on its bell (Linux lists abstract names
    as @...)."""
    name = line_mod._bell_name(os.stat(database + "-queue"), ticket)
    with open("/proc/net/unix", encoding="utf-8", errors="replace") as sockets:
        return any(row.split()[-1] == "@" + name[1:] for row in sockets if len(row.split()) > 7)


def _write_in_turn(database, name, log, deadline=CHILD_DEADLINE):
    """A writer in its own process: in its turn, it adds its name to ``log``."""
    with contextlib.closing(reliability.connect(database)) as connection:
        with line_mod.queued(connection, deadline=deadline):
            with open(log, "a", encoding="utf-8") as handle:
                handle.write(name + "\n")
    return name


def _as_member(database, uid, umask, key):
    """As user ``uid`` of TEAM_GID alone, under ``umask``: writes in its turn and says so, with
    the permission bits of the line and of SQLite's -wal; or the error that stopped it."""
    os.setgroups([])
    os.setgid(TEAM_GID)
    os.setuid(uid)
    os.umask(umask)
    try:
        with contextlib.closing(reliability.connect(database)) as connection:
            with line_mod.queued(connection, deadline=0):
                reliability.receive(connection, "agent", key, PAYLOAD, issued_at=0, now=0)
            # While the connection is open, SQLite's -wal is there.
            return {"turn": "had the turn", "line": permissions(database + "-queue"),
                    "-wal": permissions(database + "-wal")}
    except OSError as error:
        return {"turn": f"{type(error).__name__}: {error}"}


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


def _give_up_and_stay_after_ringing(database, said, leave):
    """Gives up in line and, once it has rung as it leaves, says so and stays inside queued()
    until told to leave, as a writer the scheduler held up there would."""
    ring = line_mod._ring_first

    def ring_and_stay(*args):
        ring(*args)
        os.write(said, b"in")
        os.read(leave, 1)
    # This process's own copy of the module.
    line_mod._ring_first = ring_and_stay
    return _give_up(database)


def _only_woken(database, said, leave):
    """Stands in line like queued() does but never looks for itself: it only learns that its
    turn may have come from a wake-up on its bell, and says what it heard (None: nothing)."""
    line, queue = line_mod._open_line(database)
    line_mod.fcntl.lockf(line, line_mod.fcntl.LOCK_EX, 1, line_mod.QUEUE_COUNTER)
    ticket = line_mod._counters(line)[1]
    line_mod.fcntl.lockf(line, line_mod.fcntl.LOCK_EX, 1, line_mod.QUEUE_PLACES + ticket)
    os.pwrite(line, (ticket + 1).to_bytes(8, "big"), line_mod.QUEUE_TICKETS)
    line_mod.fcntl.lockf(line, line_mod.fcntl.LOCK_UN, 1, line_mod.QUEUE_COUNTER)
    with line_mod._bell(queue, ticket) as bell:
        os.write(said, b"in")
        bell.settimeout(CHILD_DEADLINE)
        try:
            return bell.recv(1).decode()
        except OSError:
            return None


def _hold_bell_name(database, said, leave, ticket):
    """Binds the bell name of ``ticket`` on the line as it is now, as a process that is not in
    this line may hold it, until told to leave; says what it heard there (None: nothing)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as bell:
        bell.bind(line_mod._bell_name(os.stat(database + "-queue"), ticket))
        os.write(said, b"in")
        os.read(leave, 1)
        bell.setblocking(False)
        try:
            return bell.recv(1).decode()
        except BlockingIOError:
            return None


def _look_and_stay(database, said, leave):
    """Holds the shared lock a writer takes for a moment to look at the line, as one stopped
    while it looks would, until told to leave."""
    line, _ = line_mod._open_line(database)
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
            with line_mod.queued(connection, deadline=CHILD_DEADLINE):
                return "had the turn"
    except _ToldToLeave:
        return "left the line"


class Line:
    """Writers forked one at a time, each once the one before holds its place in line and
    listens on its bell, so the order they came in is forced.  The turn is held first by a
    process of its own, since the test's own opening of ``<db>-queue`` would drop it.  A
    child that talks, ``writer(database, said, leave, *args)``, writes b"in" to ``said``
    once it is where it should be and ends when told on ``leave``.  Every wait fails after
    SILENCE seconds without its sign; on leaving, every child is killed and reaped."""

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
        ticket = counters(self.database)[1]
        self.fork(name, writer or _write_in_turn, *(args if writer else (name, self.log)))
        place = line_mod.QUEUE_PLACES + ticket
        silence = time.monotonic() + SILENCE
        while not (locked_by_another(self.database, place) and bell_bound(self.database, ticket)
                   and not locked_by_another(self.database, line_mod.QUEUE_COUNTER)):
            assert time.monotonic() < silence, f"{name} never took its place in line"
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
        assert select.select([said], [], [], SILENCE)[0], f"{name} said nothing"
        assert os.read(said, 2) == b"in", f"{name} said something else"

    def tell(self, name):
        os.write(self.pipes[name][1], b"!")

    def fork(self, name, writer, *args):
        self.writers[name] = run_experiment.fork_json(writer, self.database, *args)

    def finish(self, name):
        pid, reader = self.writers[name]
        assert select.select([reader], [], [], SILENCE)[0], f"{name} never ended"
        del self.writers[name]
        with os.fdopen(reader, encoding="utf-8") as pipe:
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


# Keep last: classes defined below it would not run under `python3 beyond/test_queued.py`.
if __name__ == "__main__":
    unittest.main()
