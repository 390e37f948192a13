"""Everything past the two articles: see README.md here.

``python3 -m unittest`` from the project's root runs this folder's tests too.  There, the tests of
the PostgreSQL and HTTP editions run in a second Python process, with the same flags, while the
others run in this one, so that a second core works too; each of their results is then reported
here as the runner reports its own, in the order they ran (-b and --durations hold there too).  If
it dies, what it reported stays, and an error names the last test it started.  When the runner
stops (-f, -c, Ctrl-C), the second process is interrupted, then what is left of its group killed;
it ends at its next test once the runner has gone.  With ``-k``, everything runs here.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import unittest

BESIDE = ("beyond.postgres.test_article1", "beyond.postgres.test_article7", "beyond.test_http")


def load_tests(loader, tests, pattern):
    """unittest's hook for a package it discovers: this folder's tests, BESIDE's left out here."""
    # A SIGTERM to the runner ends it as a Ctrl-C does, so that each test's folder goes too.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    here = os.path.dirname(os.path.abspath(__file__))
    found = loader.discover(here, pattern or "test*.py", os.path.dirname(here))
    each = list(_each(found))
    beside = sorted({type(test).__module__ for test in each} & set(BESIDE))
    if loader.testNamePatterns or not beside:
        return found
    suite = _Beside(test for test in each if type(test).__module__ not in beside)
    suite.beside = beside
    return suite


class _Beside(unittest.TestSuite):
    """Its own tests here, those of the modules named in .beside in a second process started
    first; then their results."""

    def run(self, result, debug=False):
        top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        # Its record goes to a file, which never fills up as a pipe would while this process
        # is busy with its own tests.
        with tempfile.TemporaryFile() as said:
            child = subprocess.Popen(
                _command(getattr(result, "buffer", False), self.beside),
                cwd=top, stdout=said, stdin=subprocess.DEVNULL,
                # Out of a terminal's reach: a Ctrl-C stops this process, which then ends the
                # other (_stop).
                start_new_session=True)
            try:
                super().run(result, debug)
                # Stopped (-f, or -c's first Ctrl-C): so is the second process, unreported.
                if result.shouldStop:
                    return result
                child.wait()
            finally:
                if child.poll() is None:
                    _stop(child)
            said.seek(0)
            _replay(result, _lines(said.read()), child.returncode)
        return result


def _command(buffer, modules):
    """The second process's command line: ``modules`` run by _report(), reporting to this
    process, their output held back under ``buffer`` (-b)."""
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The flags this interpreter runs with (-X dev, -W error, ...), as multiprocessing takes them.
    return [sys.executable, *subprocess._args_from_interpreter_flags(), "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import beyond; beyond._report()", top,
            str(os.getpid()), "-b" if buffer else "-", *modules]


def _stop(child):
    """End the second process: an interrupt first, so that its tests' cleanups and atexit run
    (folders, PostgreSQL); then whatever of its group is left, killed."""
    child.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _replay(result, lines, code):
    """Report what the second process wrote (see _Record) to ``result`` as the tests' own, in
    the order it ran them.  If it ended before its last line, whatever ended it: one error more,
    naming the last test it started and its exit status ``code``."""
    running = "none"
    for line in lines:
        # -f: the runner stops at the first failure, whichever process it was in.
        if result.shouldStop:
            return
        if "running" in line:
            running = line["running"]
        elif "outcome" in line:
            _replay_one(result, *line["outcome"])
        else:
            # --durations (Python 3.12+): how long each took there.
            for name, took in line["durations"]:
                if hasattr(result, "addDuration"):
                    result.addDuration(name, took)
            return
    _replay_one(result, "beyond", "the second process", None, "error",
                f"it ended (exit status {code}) without the rest of its record; the last test it"
                f" started: {running}")


def _lines(data):
    """The JSON lines the second process wrote, up to one cut short."""
    lines = []
    for line in data.split(b"\n"):
        try:
            lines.append(json.loads(line))
        except ValueError:
            break
    return lines


def _replay_one(result, ident, name, doc, kind, text):
    """One outcome, as the runner reports a test's own."""
    test = _Reported(ident, name, doc)
    result.startTest(test)
    if kind == "success":
        result.addSuccess(test)
    elif kind == "skip":
        result.addSkip(test, text)
    elif kind == "expected failure":
        result.addExpectedFailure(test, (_Failed, _Failed(text), None))
    elif kind == "unexpected success":
        result.addUnexpectedSuccess(test)
    else:
        getattr(result, "addFailure" if kind == "failure" else "addError")(
            test, (_Failed, _Failed(text), None))
    result.stopTest(test)


def _report():
    """In the second process: run the named modules' tests, writing their outcomes as they come
    (see _Record)."""
    parent, names = int(sys.argv[2]), sys.argv[4:]
    # What the tests print goes to stderr: stdout carries the record alone.
    with os.fdopen(os.dup(1), "w", encoding="utf-8") as out:
        os.dup2(2, 1)
        record = _Record(parent, out)
        # -b: what a test prints is held, and shown with its failure only.
        record.buffer = sys.argv[3] == "-b"
        try:
            unittest.defaultTestLoader.loadTestsFromNames(names).run(record)
        except KeyboardInterrupt:
            # Stopped by the runner (_stop), its cleanups run: nothing more to say.
            sys.exit(130)
        record.write_new()
        record.write({"durations": getattr(record, "collectedDurations", [])})


class _Record(unittest.TestResult):
    """unittest's own record of outcomes, written to ``out`` as JSON lines as they come: the test
    it starts ({"running": id}), each outcome ({"outcome": [id, name, description, kind,
    text]}), and last the durations (Python 3.12+; [] before)."""

    def __init__(self, parent, out):
        super().__init__()
        self.parent, self.out, self.passed, self.written = parent, out, [], {}

    def startTest(self, test):
        # The process that would report these has gone: so does this one (atexit stops what
        # the tests started).
        if os.getppid() != self.parent:
            sys.exit(1)
        self.write({"running": test.id()})
        super().startTest(test)

    def stopTest(self, test):
        super().stopTest(test)
        self.write_new()

    def addSuccess(self, test):
        super().addSuccess(test)
        self.passed.append(test)

    def write_new(self):
        """The outcomes not written yet, from unittest's lists and the tests that passed."""
        kinds = [("success", [(test, None) for test in self.passed]),
                 ("failure", self.failures), ("error", self.errors), ("skip", self.skipped),
                 ("expected failure", self.expectedFailures),
                 ("unexpected success", [(test, None) for test in self.unexpectedSuccesses])]
        for kind, tests in kinds:
            for test, text in tests[self.written.get(kind, 0):]:
                self.write({"outcome": [test.id(), str(test), test.shortDescription(), kind,
                                        text]})
            self.written[kind] = len(tests)

    def write(self, line):
        # Flushed: a test that ends this process leaves what came before it.
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()


class _Reported:
    """A test the second process ran, as the runner here reports it."""
    failureException = AssertionError

    def __init__(self, ident, name, doc):
        self.ident, self.name, self.doc = ident, name, doc

    def id(self):
        return self.ident

    def __str__(self):
        return self.name

    def shortDescription(self):
        return self.doc


class _Failed(Exception):
    """A failure or error in the second process: its traceback, as written there."""


def _each(suite):
    for test in suite:
        if isinstance(test, unittest.TestSuite):
            yield from _each(test)
        else:
            yield test
