"""Beyond 第一篇: writers take turns in the order they came, ``with queued(c): ...``.

Opt-in, for many processes writing one SQLite file: with transaction() alone, SQLite's busy
handler lets a writer wait far longer than its turn.  What it buys and costs is measured by
``python3 beyond/bench.py``.  Imports reliability; nothing at the top level imports this.
"""
import contextlib
import errno
import functools
import os
import socket
import sqlite3
import stat
import sys
import time
from contextlib import contextmanager

try:
    # POSIX record locks.
    import fcntl
except ImportError:
    fcntl = None

from reliability import BUSY_TIMEOUT

__all__ = ["queued", "Busy"]

# The line is the file <db>-queue.  It begins with QUEUE_HEADER, which queued() writes into
# a file it finds empty and requires of any other: it never writes into a file not its own.
QUEUE_HEADER = b"queued() line 1\n"
# Stored after the header: how many tickets were drawn, and the first ticket whose writer
# may still be waiting, where a wake-up starts.
QUEUE_TICKETS, QUEUE_NEXT = 16, 24
# Locked bytes, whatever they hold: the counter, the turn, and ticket t's place at 64 + t.
QUEUE_COUNTER, QUEUE_TURN, QUEUE_PLACES = 0, 1, 64
# A writer waiting for the counter or its place tries again at once for this long, yielding
# the processor, then this often.
QUEUE_SPIN = 0.0005
QUEUE_PAUSE = 0.0005
# A writer in line looks for itself this often: one who died before waking it wakes nobody.
QUEUE_CHECK = 0.005
# A wake-up tries this many tickets at most, from the one to wake next.
QUEUE_SCAN = 64


class Busy(sqlite3.OperationalError):
    """queued() waited ``deadline`` seconds in line; nothing was written."""


@contextmanager
def queued(connection, *, deadline=BUSY_TIMEOUT):
    """Opt-in: writers take turns in the order they drew tickets, ``with queued(c): ...``.

    The turn is a POSIX record lock (fcntl.lockf) on one byte of ``<db>-queue``.  A writer
    takes it at once when nobody is in line; otherwise it draws a ticket and holds its
    ticket's byte, its place in line, until no earlier place is held and the turn is free.
    Whoever leaves the turn, or the line, wakes the first in line (on Linux, a datagram to
    a socket named after its ticket, closed by a writer giving up before it lets go, so that
    a wake-up goes past it); a waiter also looks every QUEUE_CHECK seconds, in case the one
    who should have woken it died.  The kernel drops a process's locks when it dies, even
    one that forked, so a dead writer holds up nobody.

    What it buys and costs, as ``python3 beyond/bench.py`` measures it (8 processes on one
    file; three runs on an otherwise idle 2-core VM): the slowest receive took 136-206
    fsync'd commits (5,187-6,675 with transaction() alone) and the 99th percentile 71-100
    (111-224); the 8 wrote at 0.90-1.14 of the rate of strict turns with a bare hand-off, the
    ideal line, which itself reached 0.49-0.58 of one process's rate; a writer alone took 2.9
    commits per receive (2.1 without it).

    The lock belongs to the process: use it from one thread per process, and never nest it
    (two threads, or an inner queued(), both pass, and the first to leave drops the other's
    turn).  Raises Busy after ``deadline`` seconds in line (0: one try, no ticket) with
    nothing written, and ValueError for a deadline that is not seconds from 0 a float holds.
    ``<db>-queue`` is opened without following a symbolic link, and anything there but a
    regular file that begins with QUEUE_HEADER, or is empty, is refused, naming it, and
    left as it was.  Made (or found empty, and this user's), it gets the database file's
    permission bits whatever the umask, as SQLite's -wal and -shm do, so that everyone who
    may write the database may take turns.  Without fcntl (Windows) it does nothing.
    """
    seconds = _seconds(deadline)
    if fcntl is None:
        yield connection
        return
    database = _database(connection)
    line, queue = _open_line(database)
    ticket, bell = None, None
    try:
        first, drawn = _counters(line)
        if _nobody_in_line(line) and _take(line, QUEUE_TURN):
            # Each ticket drawn before we looked held its place before it counted, and none
            # is held now: those writers left, and the next wake-up starts after them.
            if first < drawn:
                os.pwrite(line, drawn.to_bytes(8, "big"), QUEUE_NEXT)
        else:
            wait = functools.partial(_wait, until=time.monotonic() + seconds, deadline=seconds,
                                     database=database)
            if seconds == 0:
                # One try, and it failed: Busy, without a ticket.
                wait(lambda: False)
            # The counter is held for microseconds, by a writer drawing its ticket.
            wait(lambda: _take(line, QUEUE_COUNTER), spin=QUEUE_SPIN)
            # Even a damaged counter gives a byte to lock.
            ticket = _counters(line)[1] % 2 ** 62
            # Others look at the places for a moment, with a shared lock.
            wait(lambda: _take(line, QUEUE_PLACES + ticket), spin=QUEUE_SPIN)
            os.pwrite(line, (ticket + 1).to_bytes(8, "big"), QUEUE_TICKETS)
            fcntl.lockf(line, fcntl.LOCK_UN, 1, QUEUE_COUNTER)
            # The bell listens before the first look, so that no wake-up is lost.
            bell = _bell(queue, ticket)
            wait(lambda: _nobody_in_line(line, before=ticket) and _take(line, QUEUE_TURN),
                 bell=bell)
            # The next wake-up starts after us.  Our place and bell are let go when we leave:
            # until then nobody behind us could have the turn anyway.
            os.pwrite(line, (ticket + 1).to_bytes(8, "big"), QUEUE_NEXT)
        yield connection
    finally:
        try:
            # Deaf before we let go: a wake-up that lands on a bell about to close stops there
            # and is lost, and the next in line would wait for its own look.  With the bell
            # closed first, a wake-up sent while we still hold our place goes past us (the next
            # finds our place held and listens again), and one that reached us before is rung
            # on by our own wake-up below, sent once our place is free.
            if bell is not None:
                bell.close()
            # Every lock this process holds on the line, at once: the turn, a place, the counter.
            fcntl.lockf(line, fcntl.LOCK_UN)
            _ring_first(line, queue, ticket)
        finally:
            os.close(line)


def _seconds(deadline):
    # An int or a float from 0 that a float can hold: not bool, nan, inf or 10 ** 400.
    if type(deadline) in (int, float) and 0 <= deadline <= sys.float_info.max:
        return float(deadline)
    huge = type(deadline) is int and abs(deadline) > sys.float_info.max
    raise ValueError("deadline must be a finite number of seconds from 0, not "
                     + ("an int no float can hold" if huge else repr(deadline)))


def _database(connection):
    # The path as bytes, as SQLite has it: a name that is not UTF-8 opens like any other.
    row = connection.execute(
        "SELECT CAST(file AS BLOB) FROM pragma_database_list WHERE name = 'main'").fetchone()
    if not row or not row[0]:
        raise ValueError("queued() needs a connection to a database file, not one in memory")
    return os.fsdecode(row[0])


def _open_line(database):
    # (descriptor, os.stat) of the line of ``database``, made if missing.  Never through a
    # symbolic link, and never writing into a file that is not a line.
    path = database + "-queue"
    # SQLite makes a -wal or -shm with exactly the database's permission bits, whatever the
    # umask (unixOpen and robust_open: open, then fchmod a file still empty), so that all who
    # may write the database may write those too: a group sharing a folder, say.
    mode = os.stat(database).st_mode & 0o777
    try:
        line = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link: queued() never follows one",
                          path) from None
        raise
    try:
        queue = os.fstat(line)
        if not stat.S_ISREG(queue.st_mode):
            raise OSError(errno.EINVAL, "not a regular file, so not queued()'s line", path)
        # The umask may have taken bits from the mode: put them back, as SQLite does, while the
        # file is empty, and only in a file of our own: one someone else made keeps the mode
        # they gave it.  Refused (a file system without modes), it stays as made, as SQLite's.
        if (queue.st_size == 0 and queue.st_uid == os.geteuid()
                and (queue.st_mode & 0o777) != mode):
            with contextlib.suppress(OSError):
                os.fchmod(line, mode)
        header = os.pread(line, len(QUEUE_HEADER), 0)
        if header != QUEUE_HEADER:
            if not QUEUE_HEADER.startswith(header):
                raise OSError(errno.EINVAL, "not queued()'s line (it does not begin with"
                              f" {QUEUE_HEADER!r}); nothing was written", path)
            # Empty, or made by a writer who has not written its header yet: the same bytes.
            os.pwrite(line, QUEUE_HEADER, 0)
        return line, queue
    except BaseException:
        os.close(line)
        raise


def _wait(ready, *, until, deadline, database, bell=None, spin=0.0):
    # Until ready(): try again at once for ``spin`` seconds, yielding the processor; then
    # after each wake-up on ``bell`` (at once again for QUEUE_SPIN) or QUEUE_CHECK seconds,
    # or without a bell every QUEUE_PAUSE seconds.  Busy at ``until``.
    spin_until = time.monotonic() + spin
    while not ready():
        now = time.monotonic()
        if now >= until:
            raise Busy(f"{database}: still in the writers' queue after {deadline:g} s;"
                       " nothing was written")
        if now < spin_until:
            os.sched_yield()
        elif bell is not None:
            bell.settimeout(min(QUEUE_CHECK, until - now))
            with contextlib.suppress(socket.timeout):
                bell.recv(1)
                # Woken: the turn was let go just now.
                spin_until = time.monotonic() + QUEUE_SPIN
        else:
            time.sleep(min(QUEUE_PAUSE, until - now))


def _take(line, byte):
    return _lock(line, fcntl.LOCK_EX, byte, 1)


def _nobody_in_line(line, *, before=None):
    # No other process holds a place, or none before ticket ``before``: a shared lock on
    # those places succeeds, and is let go at once.  Length 0 reaches past every ticket.
    if before == 0:
        return True
    length = before or 0
    if not _lock(line, fcntl.LOCK_SH, QUEUE_PLACES, length):
        return False
    fcntl.lockf(line, fcntl.LOCK_UN, length, QUEUE_PLACES)
    return True


def _lock(line, kind, start, length):
    try:
        fcntl.lockf(line, kind | fcntl.LOCK_NB, length, start)
        return True
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        return False


def _counters(line):
    # (the ticket to wake next, tickets drawn), 0 where nothing was written yet.
    stored = os.pread(line, 16, QUEUE_TICKETS).ljust(16, b"\0")
    return int.from_bytes(stored[8:], "big"), int.from_bytes(stored[:8], "big")


def _bell(queue, ticket):
    # Where the writer holding ``ticket`` is woken: a datagram socket with an abstract name,
    # which goes with its process (Linux).  Elsewhere, or if the name is taken, it looks
    # every QUEUE_PAUSE seconds instead.
    if not sys.platform.startswith("linux"):
        return None
    bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        bell.bind(_bell_name(queue, ticket))
        return bell
    except OSError:
        bell.close()
        return None


def _bell_name(queue, ticket):
    return f"\0reliability-queue-{queue.st_dev}-{queue.st_ino}-{ticket}"


def _ring_first(line, queue, own):
    # Wakes the first writer who listens, from the ticket to wake next on: one who died or
    # gave up has no bell any more (queued() closes it before it lets go), and one who has
    # not bound it yet looks for itself once it has.  Never ``own``: whoever still holds that
    # name (a child that inherited our bell, or one whose bind made ours fail) is not in line.
    # A full bell has its wake-ups already: never wait for one to be read.
    first, drawn = _counters(line)
    if first >= drawn or not sys.platform.startswith("linux"):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ringer:
        for ticket in range(first, min(drawn, first + QUEUE_SCAN)):
            if ticket == own:
                continue
            try:
                ringer.sendto(b"!", socket.MSG_DONTWAIT, _bell_name(queue, ticket))
            except BlockingIOError:
                return
            except OSError:
                # Nobody listens there.
                continue
            return
