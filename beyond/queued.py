"""Beyond 第一篇: writers take turns in the order they came, ``with queued(c): receive(c, ...)``.

Opt-in, for many processes writing one SQLite file: with transaction() alone, SQLite's busy
handler lets a writer wait far longer than its turn.  Imports reliability; nothing at the top
level imports this.
"""
import contextlib
from contextlib import contextmanager
import errno
import functools
import os
import sqlite3
import sys
import time

try:
    import fcntl  # POSIX record locks
except ImportError:
    fcntl = None

from reliability import BUSY_TIMEOUT

__all__ = ["queued", "Busy"]

QUEUE_COUNTER, QUEUE_TURN, QUEUE_PLACES = 0, 1, 64  # locked bytes of <db>-queue; ticket t's: 64 + t
QUEUE_TICKETS, QUEUE_NEXT = 0, 8  # ...stored in it: tickets drawn, the ticket to wake next
QUEUE_SPIN = 0.0005          # ...a writer just woken, or waiting for the counter, tries again at once this long,
QUEUE_PAUSE = 0.0005         # ...then this often
QUEUE_CHECK = 0.005          # ...and unwoken this often: a writer that dies first in line wakes nobody
QUEUE_SCAN = 64              # ...a wake-up tries this many tickets at most, from the one to wake next


class Busy(sqlite3.OperationalError):
    """queued() waited ``deadline`` seconds in line; nothing was written."""


@contextmanager
def queued(connection, *, deadline=BUSY_TIMEOUT):
    """Opt-in: writers take turns in the order they drew tickets, ``with queued(c): receive(c, ...)``.

    The turn is a POSIX record lock (fcntl.lockf) on one byte of ``<db>-queue``.  A writer
    takes it at once when nobody is in line; otherwise it draws a ticket and holds its
    ticket's byte, its place in line, until no earlier place is held and the turn is free.
    The writer leaving the turn, or the line, wakes the first in line (on Linux, a datagram
    to a socket named after its ticket); a waiter also looks every QUEUE_CHECK seconds, in
    case the one who should have woken it died.  What it buys, by ../shared/bench/run on
    a 2-core VM with 8 processes receiving at once (three runs): the slowest receive took
    69-75 fsync'd commits (10,300-11,800 with transaction() alone), the 99th percentile
    50-54; the price is 0.34-0.44 of one process's rate, as every turn goes to a process
    whose caches are cold (16 processes, once: 126, 90 and 0.41).  The kernel drops a
    process's locks when it dies, even one that forked, so a dead writer holds up nobody.
    The lock belongs to the process: use it from one thread per process, and never nest
    it (two threads, or an inner queued(), both pass, and the first to leave drops the
    other's turn).  Raises Busy after ``deadline`` seconds in line (0: one try, no
    ticket), with nothing written.  Without fcntl (Windows) it does nothing.
    """
    if type(deadline) not in (int, float) or not 0 <= deadline < float("inf"):  # nan fails this too
        raise ValueError(f"deadline must be a finite number of seconds from 0, not {deadline!r}")
    if fcntl is None:
        yield connection
        return
    database = connection.execute("PRAGMA database_list").fetchone()[2]
    if not database:  # in memory or temporary: no file to put the line beside
        raise ValueError("queued() needs a connection to a database file")
    line, ticket, bell = os.open(database + "-queue", os.O_RDWR | os.O_CREAT, 0o644), None, None
    try:
        if not (_nobody_in_line(line) and _take(line, QUEUE_TURN)):
            wait = functools.partial(_wait, until=time.monotonic() + deadline, deadline=deadline, database=database)
            if deadline == 0:
                wait(lambda: False)  # one try, and it failed: Busy, without a ticket
            wait(lambda: _take(line, QUEUE_COUNTER), spin=QUEUE_SPIN)  # held for microseconds
            ticket = _read(line, QUEUE_TICKETS) % 2 ** 62  # even a damaged counter gives a byte to lock
            os.pwrite(line, (ticket + 1).to_bytes(8, "big"), QUEUE_TICKETS)
            wait(lambda: _take(line, QUEUE_PLACES + ticket), spin=QUEUE_SPIN)  # others look at places a moment
            fcntl.lockf(line, fcntl.LOCK_UN, 1, QUEUE_COUNTER)
            bell = _bell(line, ticket)  # before the first look, so that no wake-up is lost
            wait(lambda: _nobody_in_line(line, before=ticket) and _take(line, QUEUE_TURN), bell=bell)
            os.pwrite(line, (ticket + 1).to_bytes(8, "big"), QUEUE_NEXT)  # the next wake-up starts there
            ticket, bell = _leave_line(line, ticket, bell)  # ours: out of the line, and nobody rings us
        yield connection
    finally:
        try:
            fcntl.lockf(line, fcntl.LOCK_UN, 1, QUEUE_TURN)  # the turn, if ours, and any place in line
            _leave_line(line, ticket, bell)
            waiting = () if _nobody_in_line(line) else _bells(line)
        finally:
            os.close(line)  # closing the descriptor releases every lock this process holds on the file
        _ring_first(waiting)


def _wait(ready, *, until, deadline, database, bell=None, spin=0.0):
    # Until ready(): try again at once for ``spin`` seconds, yielding the processor; then
    # after each wake-up on ``bell`` (at once again for QUEUE_SPIN) or QUEUE_CHECK seconds,
    # or without a bell every QUEUE_PAUSE seconds.  Busy at ``until``.
    spin_until = time.monotonic() + spin
    while not ready():
        now = time.monotonic()
        if now >= until:
            raise Busy(f"{database}: still in the writers' queue after {deadline:g} s; nothing was written")
        if now < spin_until:
            os.sched_yield()
        elif bell is not None:
            import socket
            bell.settimeout(min(QUEUE_CHECK, until - now))
            with contextlib.suppress(socket.timeout):
                bell.recv(1)
                spin_until = time.monotonic() + QUEUE_SPIN  # woken: the turn was let go just now
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


def _leave_line(line, ticket, bell):
    if ticket is not None:
        fcntl.lockf(line, fcntl.LOCK_UN, 1, QUEUE_PLACES + ticket)
    if bell is not None:
        bell.close()
    return None, None


def _read(line, offset):
    return int.from_bytes(os.pread(line, 8, offset).ljust(8, b"\0"), "big")


def _bell(line, ticket):
    # Where the writer holding ``ticket`` is woken: a datagram socket with an abstract name,
    # which goes with its process (Linux).  Elsewhere, or if the name is taken, it looks
    # every QUEUE_PAUSE seconds instead.
    if not sys.platform.startswith("linux"):
        return None
    import socket  # only writers in line need it
    bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        bell.bind(_bell_name(os.fstat(line), ticket))
        return bell
    except OSError:
        bell.close()
        return None


def _bells(line):
    # The bells of up to QUEUE_SCAN tickets drawn, from the one to wake next on.
    queue, first = os.fstat(line), _read(line, QUEUE_NEXT)
    return [_bell_name(queue, ticket) for ticket in range(first, min(_read(line, QUEUE_TICKETS), first + QUEUE_SCAN))]


def _bell_name(queue, ticket):
    return f"\0reliability-queue-{queue.st_dev}-{queue.st_ino}-{ticket}"


def _ring_first(bells):
    # Wakes the first writer in ``bells`` who listens: one who died or gave up has no bell
    # any more, and one who has not bound it yet looks for itself once it has.  A full bell
    # has its wake-ups already: never wait for one to be read.
    if not bells or not sys.platform.startswith("linux"):
        return
    import socket
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ringer:
        for name in bells:
            try:
                ringer.sendto(b"!", socket.MSG_DONTWAIT, name)
            except BlockingIOError:  # full
                pass
            except OSError:  # nobody listens there
                continue
            return
