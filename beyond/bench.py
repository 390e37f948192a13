"""Beyond 第一篇: what queued() buys and costs, three ways of waiting side by side in one run.

Run from the project root:  python3 beyond/bench.py            (about 60 s)
                            python3 beyond/bench.py --quick    (about 15 s)

N processes (8 unless --processes says otherwise), each its own interpreter as agents are,
call reliability.receive() with new keys on one receiver.db; the same work is also done by
1 process alone.  Three ways of waiting:
  - the ideal line: strict turns, each process handing the turn to the next through a
    semaphore, with no lock and no polling: what any first-come-first-served order costs;
  - queued(): ``with queued(c): receive(c, ...)``;
  - plain transaction(): receive() alone, SQLite's busy handler deciding who writes next.
Every round runs each way, 1 process and N, in a rotated order, so that a busy machine slows
all alike.  Throughput is N processes' receives per second while all N run, against 1
process's, the median over the rounds; "vs ideal" divides it by the ideal line's.  "alone"
is 1 process's time per receive, p99 and max the N processes' receive times, waiting
included, over all rounds; all three are multiples of the floor, one fsync'd single-row
INSERT commit, measured between the runs.  This is not a test: the figures belong to the
machine, and only ratios from one run carry over.  Ctrl-C, SIGTERM or SIGHUP ends it with one
line and exit status 130, its workers killed and its folder removed first.
"""
import argparse
import contextlib
import multiprocessing
import os
import queue
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
import types
from multiprocessing import resource_tracker

# Run as python3 beyond/bench.py, it finds beyond/ on its path: the modules are one folder up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import reliability
import run_experiment
from beyond.queued import queued

PROCESSES = 8
# Rounds, and receives per run of each way, in a full run and with --quick.
ROUNDS, RECEIVES = 12, 1600
QUICK_ROUNDS, QUICK_RECEIVES = 4, 800
# Receives before the rounds: past the -wal's growth and its first checkpoint.
WARM = 600
# Commits per measurement of the floor.
FLOOR_COMMITS = 100
# Seconds without a result before the bench gives up on a run.
WATCHDOG = 300.0
PAYLOAD = {"title": "Synthetic documentation ticket", "body": "No real service is called."}
WAYS = {"ideal": "ideal line (hand-off)", "queued": "queued()", "plain": "plain transaction()"}


def main(argv=None):
    """The command line: 0 measured, 2 bad usage or no interpreter for the workers, 130
    interrupted (one line; see run_experiment.stop_on_signals())."""
    options = parse(argv)
    rounds, receives = (QUICK_ROUNDS, QUICK_RECEIVES) if options.quick else (ROUNDS, RECEIVES)
    try:
        reliability._interpreter()
    except OSError as error:
        print(f"beyond/bench.py: error: {error.strerror}", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    try:
        with tempfile.TemporaryDirectory(prefix="bench-") as root:
            figures, floor = measure(root, options.processes, rounds, receives)
            over_http = http_cost(root, options.quick)
    except KeyboardInterrupt:
        # The workers are killed and reaped, the folder removed (workers(), the with above).
        print("beyond/bench.py: interrupted", file=sys.stderr)
        return 130
    print(f"{options.processes} processes receiving on one receiver.db, against 1 doing the same"
          f" work; {rounds} rounds of {receives} receives each way")
    print(f"floor {floor * 1e6:.0f} us per fsync'd commit; load average {load:.1f} before,"
          f" {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} processors")
    print(f"{'way of waiting':22} alone {options.processes:>3} vs 1  vs ideal  p99    max  errors"
          "  (alone, p99, max: x floor)")
    ideal = figures["ideal"][1]
    for way, label in WAYS.items():
        alone, speedup, times, errors = figures[way]
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        print(f"{label:22} {alone / floor:5.2f} {speedup:8.2f} {speedup / ideal:9.2f}"
              f" {p99 / floor:4.0f} {times[-1] / floor:6.0f} {errors:7}")
    print(http_row(*over_http))
    return 0


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and receives")
    parser.add_argument("--processes", type=int, default=PROCESSES, help="processes in line (8)")
    options = parser.parse_args(argv)
    # Each process receives an equal share of a round's receives: at least one each.
    most = QUICK_RECEIVES if options.quick else RECEIVES
    if not 2 <= options.processes <= most:
        parser.error(f"--processes must be from 2 to {most}"
                     f"{' with --quick' if options.quick else ''}, not {options.processes}")
    return options


def measure(root, processes, rounds, receives):
    """({way: (seconds per receive by 1 process alone, N vs 1 throughput, sorted seconds of
    each receive by N processes, errors)}, the floor in seconds)."""
    alone = {way: [] for way in WAYS}
    speedups = {way: [] for way in WAYS}
    times = {way: [] for way in WAYS}
    errors = dict.fromkeys(WAYS, 0)
    floors = []
    with workers(processes) as pool, contextlib.closing(floor_database(root)) as floor:
        databases = {}
        for way in WAYS:
            reliability.init(os.path.join(root, way))
            databases[way] = os.path.join(root, way, reliability.RECEIVER)
            contend(pool, databases[way], way, 1, WARM, "warm")
        for k in range(rounds):
            ways = list(WAYS)[k % len(WAYS):] + list(WAYS)[:k % len(WAYS)]
            for way in ways:
                rate = {}
                for n in (1, processes) if k % 2 == 0 else (processes, 1):
                    floors.append(floor_commit(floor))
                    rate[n], took, failed = contend(pool, databases[way], way, n, receives, f"{k}")
                    errors[way] += failed
                    if n == processes:
                        times[way] += took
                alone[way].append(1 / rate[1])
                speedups[way].append(rate[processes] / rate[1])
    figures = {way: (statistics.median(alone[way]), statistics.median(speedups[way]),
                     sorted(times[way]), errors[way]) for way in WAYS}
    return figures, statistics.median(floors)


@contextlib.contextmanager
def workers(processes):
    """``processes`` interpreters of their own, started once, so that no run pays for a
    start or an exit; each runs the jobs it is given (see worker()).  None outlives the
    block.  They start with Ctrl-C, SIGTERM and SIGHUP held back for good: a stop is this
    process's to handle, and it kills them quietly."""
    context = multiprocessing.get_context("spawn")
    # sys.executable, or where a shell that exports no PATH left it empty, the same program.
    context.set_executable(reliability._interpreter())
    # The tracker of the semaphores below, started once, keeps the mask it starts with too: a
    # hang-up must not end it before they are let go (it ignores SIGINT and SIGTERM itself).
    with run_experiment.stops_held():
        resource_tracker.ensure_running()
    pool = types.SimpleNamespace(
        jobs=[context.Queue() for _ in range(processes)], results=context.Queue(),
        gates={n: context.Barrier(n + 1) for n in (1, processes)},
        turns=[context.Semaphore(0) for _ in range(processes)])
    pool.processes = [
        context.Process(target=worker, daemon=True,
                        args=(me, pool.jobs[me], pool.results, pool.gates, pool.turns))
        for me in range(processes)]
    try:
        # The workers keep the mask they start with; here the stops wait until all have started.
        with run_experiment.stops_held():
            for process in pool.processes:
                process.start()
        yield pool
        for jobs in pool.jobs:
            jobs.put(None)
        for process in pool.processes:
            process.join(WATCHDOG)
    finally:
        for process in pool.processes:
            if process.is_alive():
                process.kill()
                process.join()


def contend(pool, database, way, processes, receives, tag):
    """The first ``processes`` workers each receive ``receives // processes`` new keys on
    ``database``, released together: (receives per second while all run, each receive's
    seconds, errors raised to the caller)."""
    for me in range(processes):
        job = database, way, processes, receives // processes, f"{tag}-{processes}-{me}"
        pool.jobs[me].put(job)
    pool.gates[processes].wait(WATCHDOG)
    start = time.perf_counter()
    if way == "ideal" and processes > 1:
        pool.turns[0].release()
    measured = [result(pool) for _ in range(processes)]
    until = min(ends[-1] for _, ends, _ in measured)
    done = sum(end <= until for _, ends, _ in measured for end in ends)
    took = [end - begin for begins, ends, _ in measured for begin, end in zip(begins, ends)]
    return done / (until - start), took, sum(failed for _, _, failed in measured)


def result(pool):
    silence = time.monotonic() + WATCHDOG
    while True:
        try:
            return pool.results.get(timeout=0.5)
        except queue.Empty:
            codes = [process.exitcode for process in pool.processes]
            if codes.count(None) < len(codes) or time.monotonic() > silence:
                raise RuntimeError(f"a worker died or hung (exit codes {codes})") from None


def worker(me, jobs, results, gates, turns):
    """Worker ``me``: for each job (database, way, processes, receives, tag) until None, its
    receives, each timed from before it waits to after it commits; (starts, ends, errors)
    go to ``results``.  On the ideal line it waits for turns[me] and hands the turn on."""
    for database, way, processes, receives, tag in iter(jobs.get, None):
        connection = reliability.connect(database)
        wait = queued if way == "queued" else lambda connection: contextlib.nullcontext()
        ring = turns[:processes] if way == "ideal" and processes > 1 else None
        begins, ends, errors = [], [], 0
        # Its first receive, before the gate and not timed, reads the schema and fills caches.
        reliability.receive(connection, "bench", f"{tag}-warm", PAYLOAD, issued_at=0, now=0)
        gates[processes].wait(WATCHDOG)
        for i in range(receives):
            begins.append(time.perf_counter())
            if ring:
                ring[me].acquire()
            try:
                with wait(connection):
                    reliability.receive(connection, "bench", f"{tag}-{i}", PAYLOAD,
                                        issued_at=0, now=0)
            except sqlite3.OperationalError:
                errors += 1
            if ring:
                ring[(me + 1) % processes].release()
            ends.append(time.perf_counter())
        if ring and me == 0:
            # The run's last hand-off comes back here: taken, so that the next run starts clean.
            ring[0].acquire()
        connection.close()
        results.put((begins, ends, errors))


def floor_database(root):
    connection = sqlite3.connect(os.path.join(root, "floor.db"), isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    connection.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)")
    return connection


def floor_commit(connection):
    """Seconds per single-row INSERT committed with BEGIN IMMEDIATE: one fsync'd commit."""
    start = time.perf_counter()
    for _ in range(FLOOR_COMMITS):
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("INSERT INTO t (v) VALUES ('v')")
        connection.execute("COMMIT")
    return (time.perf_counter() - start) / FLOOR_COMMITS


# --- beyond/service.py: what receive() over HTTP costs, against the same SQL without it ------

# Keep-alive clients, rounds, and receives per client in each run of each server, in a full run
# and with --quick.
HTTP_CLIENTS = 8
HTTP_ROUNDS, HTTP_RECEIVES = 16, 60
QUICK_HTTP_ROUNDS, QUICK_HTTP_RECEIVES = 8, 30


def http_cost(root, quick):
    """One receive() over HTTP: beyond/service.py's POST /callers/CALLER/tickets, against the
    same HTTP round trip to a bare handler that runs the same receive() and nothing of the
    protocol (no Idempotency-Key, envelope, problem details or input checks of its own).  Both
    are http.server's ThreadingHTTPServer on 127.0.0.1 in a process of its own, on a
    receiver.db of its own, with one writer at a time; HTTP_CLIENTS keep-alive clients, each a
    process, send new keys to one and then the other, in an order rotated every round.
    Returns (clients, rounds, seconds per receive through each, the median of the rounds'
    ratios service / bare)."""
    import multiprocessing
    import preconditions
    from beyond import service
    rounds, receives = (QUICK_HTTP_ROUNDS, QUICK_HTTP_RECEIVES) if quick else (
        HTTP_ROUNDS, HTTP_RECEIVES)
    context = multiprocessing.get_context("spawn")
    urls, results = context.Queue(), context.Queue()
    gate = context.Barrier(HTTP_CLIENTS + 1)
    jobs = [context.Queue() for _ in range(HTTP_CLIENTS)]
    servers, clients = [], []
    try:
        for kind in ("service", "bare"):
            folder = os.path.join(root, f"http-{kind}")
            reliability.init(folder)
            preconditions.init(os.path.join(folder, service.PLANS), {"A": 1})
            servers.append(context.Process(target=_http_server, args=(kind, folder, urls),
                                           daemon=True))
            servers[-1].start()
        url = dict(_http_result(urls, servers) for _ in servers)
        clients = [context.Process(target=_http_client, args=(jobs[me], results, gate),
                                   daemon=True) for me in range(HTTP_CLIENTS)]
        for client in clients:
            client.start()
        per = {"service": [], "bare": []}
        for k in range(-1, rounds):
            for kind in ("service", "bare") if k % 2 else ("bare", "service"):
                for me in range(HTTP_CLIENTS):
                    jobs[me].put((url[kind], kind, receives, f"{k}-{me}"))
                gate.wait(WATCHDOG)
                measured = [_http_result(results, servers + clients) for _ in clients]
                if any(errors for _, _, errors in measured):
                    raise RuntimeError(f"{kind}: a request failed")
                start = min(begin for begin, _, _ in measured)
                end = max(finish for _, finish, _ in measured)
                # Round -1 warms both up: past the -wal's growth and the first checkpoint.
                if k >= 0:
                    per[kind].append((end - start) / (receives * HTTP_CLIENTS))
        for job in jobs:
            job.put(None)
        for client in clients:
            client.join(WATCHDOG)
    finally:
        for process in servers + clients:
            if process.is_alive():
                process.kill()
            process.join()
    ratios = [service / bare for service, bare in zip(per["service"], per["bare"])]
    return (HTTP_CLIENTS, rounds, statistics.median(per["service"]),
            statistics.median(per["bare"]), statistics.median(ratios))


def _http_result(results, processes):
    """The next result, failing at once when one of ``processes`` has died."""
    silence = time.monotonic() + WATCHDOG
    while True:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            codes = [process.exitcode for process in processes]
            if codes.count(None) < len(codes) or time.monotonic() > silence:
                raise RuntimeError(f"a server or client died or hung (exit codes {codes})")


def http_row(clients, rounds, service, bare, ratio):
    return (f"receive over HTTP, {clients} keep-alive clients, median of {rounds} rounds:"
            f" service.py {service * 1e6:.0f} us, the same SQL behind a bare handler"
            f" {bare * 1e6:.0f} us, ratio {ratio:.2f}")


def _http_server(kind, folder, urls):
    """Serve ``folder`` until killed: beyond/service.py, or the bare handler."""
    import http.server
    import json
    import threading
    from beyond import service
    if kind == "service":
        server = service.make_server(folder)
    else:
        class Bare(http.server.BaseHTTPRequestHandler):
            # As the service's handler is, but its request is the article's pipe line as JSON.
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def setup(self):
                self.database = reliability.connect(os.path.join(folder, reliability.RECEIVER))
                super().setup()

            def finish(self):
                try:
                    super().finish()
                finally:
                    self.database.close()

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with writer:
                    answer = reliability.receive(
                        self.database, request["caller"], request["key"], request["payload"],
                        issued_at=request["issued_at"], now=request["now"])
                body = json.dumps(answer).encode("utf-8")
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *arguments):
                pass
        writer = threading.Lock()
        server = http.server.ThreadingHTTPServer((service.HOST, 0), Bare)
    urls.put((kind, "http://%s:%d" % server.server_address[:2]))
    server.serve_forever()


def _http_client(jobs, results, gate):
    """For each job (url, kind, receives, tag) until None: one keep-alive connection, one
    untimed receive, the gate, then ``receives`` new keys; (start, end, errors) to
    ``results``."""
    import http.client
    import json
    import urllib.parse
    for url, kind, receives, tag in iter(jobs.get, None):
        parts = urllib.parse.urlsplit(url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=WATCHDOG)
        errors = 0

        def receive(key):
            if kind == "service":
                body = {"payload": PAYLOAD, "now": 0}
                path, headers = "/callers/bench/tickets", {"Idempotency-Key": f'"{key}"'}
            else:
                body = {"caller": "bench", "key": key, "payload": PAYLOAD, "issued_at": 0,
                        "now": 0}
                path, headers = "/receive", {}
            headers["Content-Type"] = "application/json"
            connection.request("POST", path, json.dumps(body).encode("utf-8"), headers)
            response = connection.getresponse()
            response.read()
            return response.status < 300
        receive(f"{tag}-warm")
        gate.wait(WATCHDOG)
        start = time.perf_counter()
        for i in range(receives):
            errors += not receive(f"{tag}-{i}")
        results.put((start, time.perf_counter(), errors))
        connection.close()


if __name__ == "__main__":
    run_experiment.stop_on_signals()
    status = main()
    # Said and done: a stop now changes nothing.
    for number in run_experiment.STOPS:
        signal.signal(number, signal.SIG_IGN)
    sys.exit(status)
