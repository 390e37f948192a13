"""A throw-away PostgreSQL server and real psql clients, for the tests of beyond/postgres.

One server per test run, started on first use in a temporary folder: Unix socket only (no TCP),
trust authentication, run as uid 65534 when we are root (initdb refuses root).  It dies with this
process (PR_SET_PDEATHSIG); it is stopped and its folder removed at exit, on SIGTERM and SIGHUP,
and a folder left by a process killed outright is removed by the next run.  Every client is a
psql process; race() releases many of them together at an advisory-lock barrier that it checks
in pg_locks.  A wait that sees no progress for SILENCE seconds fails.  Standard library only.
"""
import atexit
import collections
import ctypes
import glob
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ARTICLES = {name: os.path.join(HERE, name + ".sql") for name in ("article1", "article7")}
SUPERUSER = "tester"
NOBODY = 65534                # uid and gid of the server when we are root
SILENCE = 10.0                # seconds without progress: a client, or the server, hangs
START = 30.0                  # seconds initdb and start-up may take on a loaded machine
RETRIED = ("40001", "40P01")  # serialization failure, deadlock: README.md's retry rule
RETRIES = 100                 # tries of one call in a race: more is a livelock, not a race
FOLDER_PREFIX = "beyond-pg-"
SEPARATOR = "\x1f"            # psql's field separator: in no value the tests print
BARRIER_CLASS = 7301          # the advisory-lock class of race()'s barriers
PR_SET_PDEATHSIG = 1          # linux/prctl.h
SKIP = ("beyond/postgres: PostgreSQL not found (initdb, postgres and psql on PATH or in"
        " /usr/lib/postgresql/*/bin): its tests are skipped")

Reply = collections.namedtuple("Reply", "rows state error")
_run = {"server": None, "said": False, "admin": None, "template": None, "databases": 0,
        "barriers": 0}
_open = []  # clients not closed yet: killed at exit, on SIGTERM and on SIGHUP


def pg_bindir():
    """The folder holding initdb, postgres and psql (initdb's on PATH first, then the newest
    /usr/lib/postgresql/*/bin), or None."""
    folders = []
    initdb = shutil.which("initdb")
    if initdb:
        folders.append(os.path.dirname(os.path.realpath(initdb)))
    folders += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version, reverse=True)
    for folder in folders:
        if all(os.access(os.path.join(folder, name), os.X_OK)
               for name in ("initdb", "postgres", "psql")):
            return folder
    return None


def _version(folder):
    # /usr/lib/postgresql/15/bin: sorted by number, so 10 comes after 9.
    name = os.path.basename(os.path.dirname(folder))
    return tuple(int(part) if part.isdigit() else -1 for part in name.split("."))


# --- the server -------------------------------------------------------------------------------

def server():
    """The server of this test run, started on first use; SkipTest without PostgreSQL, said
    once on stderr."""
    if _run["server"] is None:
        bindir = pg_bindir()
        if bindir is None:
            if not _run["said"]:
                _run["said"] = True
                sys.stderr.write(SKIP + "\n")
            raise unittest.SkipTest(SKIP)
        # It is the run's server from its first step, so that a stop while it starts ends it.
        _start(bindir)
    return _run["server"]


def _start(bindir):
    _remove_stale()
    # From here on a SIGTERM or SIGHUP removes what is made, also while it starts.
    _stop_on_signals()
    folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=_base())
    started = types.SimpleNamespace(bindir=bindir, folder=folder, process=None)
    _run["server"] = started
    try:
        with open(os.path.join(folder, "owner.pid"), "w") as f:
            f.write(str(os.getpid()))
        nobody = os.geteuid() == 0
        if nobody:
            os.chown(folder, NOBODY, NOBODY)
        data, log = os.path.join(folder, "data"), os.path.join(folder, "server.log")
        with open(log, "ab") as out:
            subprocess.run([os.path.join(bindir, "initdb"), "-D", data, "-U", SUPERUSER,
                            "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"],
                           stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=_env(),
                           cwd=folder, check=True, timeout=START,
                           preexec_fn=_tied(nobody, signal.SIGKILL))
            # SIGQUIT when we die: an immediate shutdown, which ends every backend too.
            started.process = subprocess.Popen(
                [os.path.join(bindir, "postgres"), "-D", data, "-k", folder,
                 "-c", "listen_addresses=", "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off", "-c", "autovacuum=off",
                 "-c", "max_connections=50", "-c", "deadlock_timeout=100ms",
                 "-c", "dynamic_shared_memory_type=mmap"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=_env(), cwd=folder,
                preexec_fn=_tied(nobody, signal.SIGQUIT))
        _ready(started, log)
    except BaseException:
        _stop(started)
        raise
    atexit.register(_stop, started)
    return started


def _tied(nobody, death_signal):
    """A preexec_fn: become nobody if asked, THEN ask for death_signal when we die (the kernel
    clears that signal on a change of credentials); a child whose parent is gone exits."""
    libc, parent = ctypes.CDLL(None, use_errno=True), os.getpid()

    def preexec():
        if nobody:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        if libc.prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0) != 0:
            os._exit(1)
        if os.getppid() != parent:
            os._exit(1)
    return preexec


def _base():
    # A memory file system first: initdb writes some 40 MB.  A socket path stays short.
    for base in ("/dev/shm", tempfile.gettempdir()):
        try:
            space = os.statvfs(base)
        except OSError:
            continue
        roomy = space.f_bavail * space.f_frsize > 1 << 28
        if len(base) < 60 and os.access(base, os.W_OK) and roomy:
            return base
    return tempfile.gettempdir()


def _ready(started, log):
    # postmaster.pid's eighth line reads "ready" once the server takes connections.
    deadline = time.monotonic() + START
    pidfile = os.path.join(started.folder, "data", "postmaster.pid")
    while True:
        if started.process.poll() is not None:
            raise RuntimeError(f"postgres exited with {started.process.returncode}: {_tail(log)}")
        try:
            with open(pidfile) as f:
                if [line.strip() for line in f.read().split("\n")[7:8]] == ["ready"]:
                    return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"postgres not ready after {START:g} s: {_tail(log)}")
        time.sleep(0.01)


def _tail(path):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-20:])
    except OSError:
        return ""


def _stop(started):
    """Kill our clients, stop the server (fast shutdown, else SIGKILL), remove its folder."""
    for client in list(_open):
        _kill(client)
    process, started.process = started.process, None
    try:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=SILENCE)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    finally:
        shutil.rmtree(started.folder, ignore_errors=True)
        if _run["server"] is started:
            _run.update(server=None, admin=None, template=None)


def _stop_on_signals():
    # SIGKILL cannot be caught: then the server dies by its parent-death signal, and the next
    # run removes the folder.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _stop_and_die)
        except ValueError:  # not the main thread: atexit and the parent-death signal remain
            return


def _stop_and_die(signum, frame):
    if _run["server"] is not None:
        _stop(_run["server"])
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _remove_stale():
    """Remove the folders of earlier runs that were killed: their owner and server are gone."""
    for base in {"/dev/shm", tempfile.gettempdir()}:
        for folder in glob.glob(os.path.join(base, FOLDER_PREFIX + "*")):
            try:
                with open(os.path.join(folder, "owner.pid")) as f:
                    os.kill(int(f.read()), 0)
            except ProcessLookupError:
                if not _alive(os.path.join(folder, "data", "postmaster.pid")):
                    shutil.rmtree(folder, ignore_errors=True)
            except (OSError, ValueError):  # unreadable, half-written or alive: left alone
                pass


def _alive(pidfile):
    try:
        with open(pidfile) as f:
            os.kill(int(f.readline()), 0)
    except (ProcessLookupError, FileNotFoundError):
        return False
    except (OSError, ValueError):
        return True
    return True


def _env():
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C",
            "PGCLIENTENCODING": "UTF8", "PGCONNECT_TIMEOUT": "10",
            "PGOPTIONS": "-c client_min_messages=warning"}


# --- databases --------------------------------------------------------------------------------

def database():
    """A new database holding both articles, copied from a template that loads article1.sql
    and article7.sql once per run; drop() removes it."""
    server()
    if _run["admin"] is None:
        _run["admin"] = connect("postgres")
    if _run["template"] is None:
        # A template whose load failed earlier in this run goes first.
        query(_run["admin"], "DROP DATABASE IF EXISTS beyond_template")
        query(_run["admin"], "CREATE DATABASE beyond_template")
        for path in ARTICLES.values():
            code, errors = load(path, "beyond_template")
            if code != 0:
                raise RuntimeError(f"{path} did not load: {errors}")
        _run["template"] = "beyond_template"
    _run["databases"] += 1
    name = f"beyond_{_run['databases']}"
    query(_run["admin"], f"CREATE DATABASE {name} TEMPLATE {_run['template']}")
    return name


def drop(name):
    """Drop a database of database(), ending any session still on it."""
    if _run["admin"] is not None:
        query(_run["admin"], f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def load(path, name, role=SUPERUSER):
    """Run psql -v ON_ERROR_STOP=1 -f path on database name as role: (exit code, stderr text)."""
    started = server()
    done = subprocess.run([os.path.join(started.bindir, "psql"), "-X", "-q",
                           "-v", "ON_ERROR_STOP=1", "-h", started.folder, "-U", role,
                           "-d", name, "-f", path],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, env=_env(), timeout=START)
    return done.returncode, done.stderr.decode("utf-8", "replace")


# --- clients ----------------------------------------------------------------------------------

def connect(name, isolation=None):
    """A psql session on database ``name`` (at ``isolation``, e.g. "repeatable read", for every
    transaction); each statement sent to it answers with its SQLSTATE."""
    started = server()
    errors = tempfile.TemporaryFile()
    process = subprocess.Popen([os.path.join(started.bindir, "psql"), "-X", "-q", "-A", "-t",
                                "-F", SEPARATOR, "-v", "ON_ERROR_STOP=0", "-h", started.folder,
                                "-U", SUPERUSER, "-d", name],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
                               env=_env())
    client = types.SimpleNamespace(process=process, errors=errors, read=0, buffer=b"", sent=0)
    _open.append(client)
    if isolation:
        query(client, f"SET default_transaction_isolation = '{isolation}'")
    return client


def close(client):
    """End the session: psql reads EOF and exits, or is killed."""
    if client.process.poll() is None:
        try:
            client.process.stdin.close()
            client.process.wait(timeout=SILENCE)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            pass
    _kill(client)


def _kill(client):
    if client.process.poll() is None:
        client.process.kill()
    client.process.wait()
    for stream in (client.process.stdin, client.process.stdout, client.errors):
        try:
            stream.close()
        except OSError:
            pass
    if client in _open:
        _open.remove(client)


def send(client, sql):
    """Send one statement (or several; the SQLSTATE is the last one's) without waiting."""
    client.sent += 1
    sql = sql.strip()
    if not sql.endswith(";"):
        sql += ";"
    try:
        client.process.stdin.write(f"{sql}\n\\echo @@reply {client.sent} :SQLSTATE\n".encode())
        client.process.stdin.flush()
    except BrokenPipeError:
        raise AssertionError(f"psql had ended: {_errors(client)}") from None


def reply(client):
    """The next reply of ``client``: its rows (lists of fields; NULL is ''), SQLSTATE, error."""
    while True:
        answer = _take(client)
        if answer is not None:
            return answer
        with selectors.DefaultSelector() as selector:
            selector.register(client.process.stdout, selectors.EVENT_READ)
            if not selector.select(SILENCE):
                raise AssertionError(f"no reply from psql for {SILENCE:g} s")
        _fill(client)


def query(client, sql):
    """The rows ``sql`` printed; AssertionError with the server's message if it failed."""
    send(client, sql)
    answer = reply(client)
    if answer.state != "00000":
        raise AssertionError(f"{sql[:200]!r} failed with {answer.state}: {answer.error}")
    return answer.rows


def value(client, sql):
    """The one field ``sql`` printed, parsed when it is a JSON object or array."""
    rows = query(client, sql)
    if len(rows) != 1 or len(rows[0]) != 1:
        raise AssertionError(f"expected one value from {sql[:200]!r}, got {rows!r}")
    return parsed(rows[0][0])


def wait_until(client, sql):
    """Poll ``sql`` (true or false) until it is true; fail after SILENCE seconds of false."""
    deadline = time.monotonic() + SILENCE
    while value(client, sql) != "t":
        if time.monotonic() > deadline:
            raise AssertionError(f"still false after {SILENCE:g} s: {sql[:200]!r}")
        time.sleep(0.002)


def waits(control, pid, marker):
    """Whether the session ``pid``, once it runs the statement holding ``marker``, waits on a
    lock (True) or ends it (False), as pg_stat_activity shows; fail after SILENCE seconds of
    neither.  The marker tells that statement from the one before."""
    sql = (f"SELECT CASE WHEN position({literal(marker)} IN query) = 0 THEN ''"
           " WHEN wait_event_type = 'Lock' THEN 'waits' WHEN state <> 'active' THEN 'ended'"
           f" ELSE '' END FROM pg_stat_activity WHERE pid = {pid}")
    deadline = time.monotonic() + SILENCE
    while True:
        seen = value(control, sql)
        if seen:
            return seen == "waits"
        if time.monotonic() > deadline:
            raise AssertionError(f"session {pid} neither waits nor ends {marker!r} after"
                                 f" {SILENCE:g} s")
        time.sleep(0.002)


def state_of(client, sql):
    """The SQLSTATE ``sql`` ended with: '00000' when it succeeded."""
    return outcome(client, sql)[0]


def outcome(client, sql):
    """(SQLSTATE, the one value printed or None) of ``sql``, run once."""
    send(client, sql)
    answer = reply(client)
    if answer.state != "00000":
        return answer.state, None
    if len(answer.rows) != 1 or len(answer.rows[0]) != 1:
        raise AssertionError(f"expected one value from {sql[:200]!r}, got {answer.rows!r}")
    return answer.state, parsed(answer.rows[0][0])


def parsed(field):
    """A printed field: JSON objects and arrays parsed, anything else as printed."""
    return json.loads(field) if field[:1] in ("{", "[") else field


def _take(client):
    # A complete reply in the buffer: the lines before "@@reply N SQLSTATE".
    marker = f"@@reply {client.sent} ".encode()
    start = 0 if client.buffer.startswith(marker) else client.buffer.find(b"\n" + marker) + 1
    end = client.buffer.find(b"\n", start) if start or client.buffer.startswith(marker) else -1
    if end < 0:
        return None
    lines = client.buffer[:start - 1].decode("utf-8").split("\n") if start else []
    state = client.buffer[start + len(marker):end].decode()
    client.buffer = client.buffer[end + 1:]
    return Reply([line.split(SEPARATOR) for line in lines], state,
                 _errors(client) if state != "00000" else "")


def _fill(client):
    chunk = os.read(client.process.stdout.fileno(), 1 << 16)
    if not chunk:
        client.process.wait()
        raise AssertionError(f"psql exited with {client.process.returncode}: {_errors(client)}")
    client.buffer += chunk


def _errors(client):
    # What psql wrote on stderr since the last look: the failed statement's message.
    client.errors.seek(client.read)
    text = client.errors.read()
    client.read += len(text)
    return " ".join(text.decode("utf-8", "replace").split())


# --- races ------------------------------------------------------------------------------------

def race(control, clients, calls, retried=RETRIED):
    """Release one call per client together; return (answers, retries).

    Every client first waits on an advisory lock that ``control`` holds; once pg_locks shows
    all of them waiting, control lets go.  A call that fails with a SQLSTATE in ``retried`` is
    sent again at once by its client, as README.md's retry rule says (``retries`` counts them
    by SQLSTATE), up to RETRIES times; any other failure fails the race.  answers[i] is client
    i's one value.
    """
    _run["barriers"] += 1
    key = _run["barriers"]
    query(control, f"SELECT pg_advisory_lock({BARRIER_CLASS}, {key})")
    try:
        for client, call in zip(clients, calls):
            send(client, f"DO $$ BEGIN PERFORM pg_advisory_lock_shared({BARRIER_CLASS}, {key});"
                         f" PERFORM pg_advisory_unlock_shared({BARRIER_CLASS}, {key}); END $$;\n"
                         f"{call}")
        _gather(control, key, clients)
        query(control, f"SELECT pg_advisory_unlock({BARRIER_CLASS}, {key})")
        return _collect(control, clients, calls, retried)
    except BaseException:
        for client in clients:
            _kill(client)
        raise
    finally:
        if control.process.poll() is None:
            query(control, "SELECT pg_advisory_unlock_all()")


def _gather(control, key, clients):
    """Wait until exactly len(clients) sessions wait on the barrier's lock."""
    count = ("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
             f" AND classid = {BARRIER_CLASS} AND objid = {key} AND objsubid = 2"
             " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())")
    seen, since = -1, time.monotonic()
    while True:
        waiting = int(value(control, count))
        if waiting == len(clients):
            return
        if waiting > len(clients):
            raise AssertionError(f"{waiting} sessions wait at the barrier, not {len(clients)}")
        for i, client in enumerate(clients):
            if client.process.poll() is not None:
                raise AssertionError(f"client {i} exited before the barrier: {_errors(client)}")
        if waiting != seen:
            seen, since = waiting, time.monotonic()
        elif time.monotonic() - since > SILENCE:
            raise AssertionError(f"only {waiting} of {len(clients)} clients reached the barrier")
        time.sleep(0.002)


def _collect(control, clients, calls, retried):
    answers, retries, tries = [None] * len(clients), collections.Counter(), [0] * len(clients)
    pending = set(range(len(clients)))
    with selectors.DefaultSelector() as selector:
        for i, client in enumerate(clients):
            selector.register(client.process.stdout, selectors.EVENT_READ, i)
        while pending:
            events = selector.select(SILENCE)
            if not events:
                raise AssertionError(f"no reply for {SILENCE:g} s from clients {sorted(pending)};"
                                     f" sessions: {_sessions(control)}")
            for event, _ in events:
                i = event.data
                _fill(clients[i])
                answer = _take(clients[i])
                if answer is None:
                    continue
                if answer.state in retried:
                    retries[answer.state] += 1
                    tries[i] += 1
                    if tries[i] > RETRIES:
                        raise AssertionError(f"client {i}: still {answer.state} after {RETRIES}"
                                             f" retries: {answer.error}")
                    send(clients[i], calls[i])
                elif answer.state != "00000":
                    raise AssertionError(f"client {i}: {calls[i][:200]!r} failed with"
                                         f" {answer.state}: {answer.error}")
                else:
                    if len(answer.rows) != 1 or len(answer.rows[0]) != 1:
                        raise AssertionError(f"client {i} printed {answer.rows!r}, not one value")
                    answers[i] = parsed(answer.rows[0][0])
                    pending.discard(i)
    return answers, retries


def _sessions(control):
    return query(control, "SELECT pid, state, wait_event_type, wait_event, left(query, 60)"
                          " FROM pg_stat_activity WHERE datname = current_database()"
                          " AND pid <> pg_backend_pid()")


# --- SQL text ---------------------------------------------------------------------------------

def literal(value):
    """A SQL literal: NULL, true/false, an integer, a string, or JSON text of anything else."""
    if value is None:
        return "NULL"
    if type(value) is bool:
        return "true" if value else "false"
    if type(value) is int:
        return str(value)
    if type(value) is str:
        return "'" + value.replace("'", "''") + "'"
    return literal(json.dumps(value, ensure_ascii=False))


def call(function, *args):
    """``SELECT function(args...)`` with every argument a literal()."""
    return f"SELECT {function}({', '.join(map(literal, args))})"


# --- the tests' base --------------------------------------------------------------------------

# The tests' races: clients released together, and rounds of them at each isolation setting:
# every level alone, and the three mixed (client i at LEVELS[i % 3]).
CLIENTS, ROUNDS = 16, 2
LEVELS = ("read committed", "repeatable read", "serializable")
MIXED = tuple(LEVELS[i % len(LEVELS)] for i in range(CLIENTS))
SETTINGS = {**{level: (level,) * CLIENTS for level in LEVELS}, "mixed": MIXED}
# Receipts a racing purge deletes besides the replayed ones: long enough to overlap.
FILLER = 500


def isolate(clients, levels):
    """Set each client's isolation level for its next transactions."""
    for client, level in zip(clients, levels):
        query(client, f"SET default_transaction_isolation = '{level}'")


class TestCase(unittest.TestCase):
    """A test on a new database of its own (both articles loaded), with ``self.session``."""

    @classmethod
    def setUpClass(cls):
        server()

    def setUp(self):
        self.database = database()
        self.addCleanup(drop, self.database)
        self.session = self.client()

    def client(self, isolation=None):
        """Another psql session on the test's database, closed after the test."""
        opened = connect(self.database, isolation)
        self.addCleanup(close, opened)
        return opened

    def racers(self, levels):
        """One client per isolation level in ``levels``."""
        return [self.client(level) for level in levels]
