"""Tests of beyond/bench.py's command line: stopped while its worker processes run, it says one
line and exits 130, and leaves no process and no folder; without PATH its workers still start,
or it says in one line why they cannot.  What it measures belongs to the machine and is not
tested.

Run from the project root: ``python3 -m unittest beyond.test_bench``.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

# Run as python3 beyond/test_bench.py, it finds beyond/ on its path: the modules are one up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import test_reliability as article1
from beyond import bench

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py")
# Seconds: only ends a hung child, never asserted as a measurement.
WATCHDOG = article1.WATCHDOG
# A python3 as a shell that exports no PATH (env -i bash) runs it, found by name, with an empty
# environment: its sys.executable is empty.
BARE = [sys.executable, "-I", "-S", "-c",
        "import os, sys; os.execve(sys.executable, ['python3', *sys.argv[1:]], {})"]


class TheBenchRefusesWhatItCannotRun(unittest.TestCase):
    def test_a_process_count_it_cannot_run_is_one_usage_line_before_any_worker_starts(self):
        # Every process receives a share of a round's receives, at least one.
        for argv, most in ((["--processes", "1"], bench.RECEIVES),
                           (["--processes", str(bench.RECEIVES + 1)], bench.RECEIVES),
                           (["--quick", "--processes", str(bench.QUICK_RECEIVES + 1)],
                            bench.QUICK_RECEIVES),
                           (["--processes", str(10 ** 23)], bench.RECEIVES)):
            with self.subTest(argv=argv):
                done = subprocess.run([sys.executable, "-S", SCRIPT, *argv], capture_output=True,
                                      timeout=WATCHDOG)
                said = done.stderr.decode("utf-8").splitlines()
                self.assertEqual((done.returncode, done.stdout), (2, b""))
                self.assertTrue(said[-1].endswith(f"--processes must be from 2 to {most}"
                                                  f"{' with --quick' if '--quick' in argv else ''}"
                                                  f", not {argv[-1]}"), said)
                self.assertTrue(said[0].startswith("usage: "), said)


@unittest.skipUnless(os.path.exists("/proc/self/syscall"), "a pseudo-terminal, Linux /proc")
class TheBenchStopsInOneLine(unittest.TestCase):
    def test_ctrl_c_sigterm_or_sighup_while_its_workers_run_exit_130_in_one_line(self):
        # Typed at a terminal; SIGTERM to it alone; a hang-up to its group.  Once its workers
        # run, one of them is stopped: the run waits for it (for its 300 s watchdog), so the
        # stop surely lands while the workers live, and they must be killed.
        stops = {"Ctrl-C": None, "SIGTERM to it alone": lambda pid: os.kill(pid, signal.SIGTERM),
                 "SIGHUP to its group": lambda pid: os.killpg(pid, signal.SIGHUP)}
        for label, stop in stops.items():
            with self.subTest(label):
                self.assert_stops_in_one_line([sys.executable, SCRIPT, "--quick"], stop)

    def test_without_path_its_workers_start_or_it_says_why_not_in_one_line(self):
        probe = subprocess.run(BARE + ["-c", "import sys; print(repr(sys.executable))"],
                               capture_output=True, timeout=WATCHDOG)
        self.assertEqual(probe.stdout, b"''\n")
        # The kernel tells which program runs: the workers start, then Ctrl-C ends the run.
        self.assert_stops_in_one_line(BARE + [SCRIPT, "--quick"])
        if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("unshare")):
            self.skipTest("hides /proc in a mount namespace of its own: needs unshare and root")
        # Where /proc is hidden too, nothing proves which program runs: one line says why.
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               'mount -t tmpfs none /proc && exec "$@"', "sh", *BARE, SCRIPT,
                               "--quick"], capture_output=True, timeout=WATCHDOG)
        self.assertEqual((done.returncode, done.stdout), (2, b""))
        self.assertEqual(done.stderr.decode("utf-8"), "beyond/bench.py: error: the Python"
                         " interpreter is unknown (sys.executable is empty): run python3 by its"
                         " full path, or export PATH\n")

    def assert_stops_in_one_line(self, argv, stop=None):
        """``argv`` run at a terminal (TMPDIR a fresh folder) is stopped by ``stop`` (default:
        Ctrl-C typed) once all its workers run, one of them held: one line, exit 130, nothing
        left of it, its stopped worker killed too."""
        held = []

        def ready(pid, screen):
            workers = [child for child in article1.children_of(pid) if spawned(child)]
            if len(workers) < bench.PROCESSES:
                return False
            os.kill(workers[0], signal.SIGSTOP)
            held.append((workers[0], article1.started_at(workers[0])))
            return True
        with tempfile.TemporaryDirectory() as directory:
            done = article1.at_a_terminal([shutil.which("env"), f"TMPDIR={directory}", *argv],
                                          ready, stop)
            self.assertEqual(done, (130, "beyond/bench.py: interrupted\n", []))
            self.assertNotEqual(article1.started_at(held[0][0]), held[0][1],
                                "the stopped worker lives on")
            self.assertEqual(os.listdir(directory), [])


def spawned(pid):
    """Whether process ``pid`` is a worker multiprocessing spawned (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"multiprocessing.spawn" in handle.read()
    except OSError:
        return False


if __name__ == "__main__":
    unittest.main()
