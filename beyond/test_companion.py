"""The companion's self-checks, beside the two articles' tests: the copy kits, README.md's tables
and walk-throughs, the public names, the driver's robustness, the five-file downloads, and the
twins that both articles' files keep identical.

test_reliability.py and test_preconditions.py hold their article's sections in article order
and their module's contracts (bad input, files, many processes); each runs alone in its
article's five-file download, which this file is not part of.  What checks the companion as a
whole is here, each helper written once.  The classes come in this order: article 1's (its
copy kits, and what README.md says of it), article 7's (its copy kit, and what README.md says
of it), then both articles' (the twins, the public names, README.md's limits and map, the
driver, the five-file downloads).  The machinery is in one section at the bottom; it uses the
two article test files' own workspaces, children and figures rather than copies of them.

Run from the project root: ``python3 -m unittest beyond.test_companion``, or
``python3 beyond/test_companion.py``.
"""
import ast
import concurrent.futures
import contextlib
import errno
import functools
import glob
import importlib.util
import io
import itertools
import json
import os
import re
import select
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock

# Run as python3 beyond/test_companion.py, it finds beyond/ on its path: the modules are one up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import beyond
import preconditions as pre
import reliability
import run_experiment
import test_preconditions as article7
import test_reliability as article1


# === 第一篇: reliability.py's copy kits, and what README.md says of the article ===

class TheKitsRunAlone(unittest.TestCase):
    """第一篇 §3 and §5, copied out: each kit is exactly what its functions need, and runs alone
    on a connection opened as README.md tells the copier (on Python 3.12+ too, where one is
    found)."""

    def test_each_kit_is_the_transitive_closure_of_what_its_functions_need(self):
        self.assertEqual(closure(RELIABILITY, ["receive"]), {
            "receive", "_replayed", "transaction", "canonical", "_least_bytes", "check_identity",
            "check_ticks", "crash_point", "CRASH_AT", "CRASH_EXIT", "Conflict", "Expired",
            "CorruptRecord", "MAX_IDENTITY_LENGTH", "MAX_PAYLOAD_BYTES", "MAX_PAYLOAD_DEPTH",
            "MAX_TICK", "_dumps"})
        self.assertEqual(closure(RELIABILITY, ["enqueue", "claim", "acknowledge"]), {
            "enqueue", "claim", "_sendable", "_oldest_due", "acknowledge", "check_response",
            "transaction", "canonical", "_least_bytes", "check_identity", "check_ticks",
            "crash_point", "CRASH_AT", "CRASH_EXIT", "Conflict", "MODES", "LEASE_TICKS",
            "MAX_ATTEMPTS", "MAX_IDENTITY_LENGTH", "MAX_PAYLOAD_BYTES", "MAX_PAYLOAD_DEPTH",
            "MAX_TICK", "_dumps"})
        self.assertEqual(closure(RELIABILITY, ["connect", "init"]), {
            "connect", "_open", "_Connection", "_check_kind", "_check_file", "init", "_create",
            "transaction", "KINDS", "SENDER", "RECEIVER", "EXTERNAL", "SCHEMAS", "SCHEMA_VERSION",
            "BUSY_TIMEOUT"})

    def test_the_receive_kit_runs_the_articles_replay_alone(self):
        self.assert_runs_alone("`reliability.receive`", """
connection.close()
connection = kit.connect(os.path.join("data", "receiver.db"))
first = kit.receive(connection, "agent", "k1", PAYLOAD, issued_at=0, now=0)
assert first["ticket_id"] == 1, first
# The replay.
assert kit.receive(connection, "agent", "k1", PAYLOAD, issued_at=0, now=1) == first
try:
    kit.receive(connection, "agent", "k1", OTHER_PAYLOAD, issued_at=0, now=2)
    raise AssertionError("the same key with another payload was accepted")
except kit.Conflict:
    pass
assert connection.execute("SELECT count(*) FROM tickets").fetchone()[0] == 1
connection.close()
""")

    def test_the_outbox_kit_runs_the_articles_lease_and_stale_acknowledgement_alone(self):
        self.assert_runs_alone("`reliability.enqueue` + `claim` + `acknowledge`", """
assert kit.enqueue(connection, "agent", "k1", PAYLOAD, now=0) == "accepted"
assert kit.claim(connection, 0)["attempt"] == 1
# The lease runs to tick 10.
assert kit.claim(connection, 9) is None
assert kit.claim(connection, 11)["attempt"] == 2
response = {"caller": "agent", "key": "k1", "digest": kit.canonical(PAYLOAD)[1], "ticket_id": 1}
# The stale attempt.
assert kit.acknowledge(connection, "agent", "k1", 1, response) is False
assert kit.acknowledge(connection, "agent", "k1", 2, response) is True
assert connection.execute("SELECT state, attempts FROM outbox").fetchall() == [("done", 2)]
connection.close()
""")

    def assert_runs_alone(self, use, check):
        """The kit README.md's row ``use`` lists, with the connection kit (connect, init),
        pasted in the README's order into a module of its own and run in fresh interpreters as
        a copier would: README.md's python block as printed, in the script's own folder, then
        ``check``."""
        recipe = readme_blocks("python")
        self.assertEqual(len(recipe), 1, "README.md has one python block: how a kit opens its"
                                         " connection")
        # Around ``check``: the script's own payloads; the kit's classes are its own, and no
        # reliability.py was there to import.
        check = "\n".join([
            f"PAYLOAD, OTHER_PAYLOAD = {article1.PAYLOAD!r}, {article1.OTHER_PAYLOAD!r}", check,
            "assert kit.Conflict.__module__ == 'kit'",
            "assert not os.path.exists(os.path.join(folder, 'reliability.py'))",
            "print('ok', sys.version_info >= (3, 12))"])
        kit = readme_kit(use, "`reliability.connect` + `init`")
        for python, (code, out, err) in run_kit(RELIABILITY, kit, recipe[0], check):
            with self.subTest(python=python):
                self.assertEqual((code, err.decode("utf-8")), (0, ""))
                self.assertTrue(out.startswith(b"ok"), out)

    def test_the_kits_fail_loudly_on_a_connection_made_another_way(self):
        # What the README warns about, shown: 3.12's autocommit=False opens a transaction of its
        # own.
        if sys.version_info < (3, 12):
            self.skipTest("sqlite3's autocommit setting exists from Python 3.12")
        with tempfile.TemporaryDirectory() as directory:
            connection = sqlite3.connect(os.path.join(directory, "r.db"), autocommit=False)
            try:
                with self.assertRaisesRegex(sqlite3.OperationalError, "within a transaction"):
                    reliability.transaction(connection).__enter__()
            finally:
                connection.close()


class TheReadmeOnArticle1ShowsWhatTheRunShows(unittest.TestCase):
    """README.md stays true for article 1's reader: its headline lines and tables are the
    driver's and results.json's, its walk-through runs as printed, its kit rows name what each
    kit needs."""

    # The first table's "ours" cell of each article 1 scenario, and the list beyond article 1:
    # the figures each gives, in order, as stage.figure in the scenario's results.
    FIGURES = {
        "naive_lost_ack": ["after_lost_ack.receiver_tickets", "after_recovery.receiver_tickets"],
        "mark_before_send_loses_task": ["after_restart.sender_state",
                                        "after_restart.receiver_tickets"],
        "idempotent_lost_ack": ["after_lost_ack.receiver_tickets",
                                "after_recovery.receiver_tickets",
                                "after_recovery.response.ticket_id"],
        "before_intent_commit": ["after_recovery.retry", "after_recovery.receiver_tickets"],
        "after_intent_commit": ["after_recovery.retry", "after_recovery.receiver_tickets"],
        "after_claim": ["before_lease_expiry.attempts", "after_recovery.attempts",
                        "after_recovery.receiver_tickets"],
        "before_receiver_commit": ["after_crash.receiver_tickets",
                                   "after_recovery.receiver_tickets"],
        "after_response_write": ["after_crash.sender_state", "after_crash.attempts"],
        "after_response_before_ack": ["after_recovery.attempts",
                                      "after_recovery.response.ticket_id"],
        "after_ack": ["after_restart.attempts", "after_restart.receiver_tickets"],
        "mismatched_payload": ["after_mismatch.refusal", "after_mismatch.receiver_tickets"],
        "concurrent_claim": ["after_race.claim_winners", "after_race.released_together",
                             "after_stale_ack.stale_ack"],
        "concurrent_receiver": ["after_race.receiver_tickets", "after_race.receiver_receipts",
                                "after_race.distinct_responses"],
        "before_external_effect": ["after_restart.sender_state",
                                   "after_restart.external_tickets"],
        "after_external_effect": ["after_restart.sender_state", "after_restart.external_tickets"],
        "unsafe_external_retry": ["after_unsafe_retry.external_tickets"],
        "reconcile_found": ["after_restart.external_tickets"],
        "reconcile_absent": ["after_retry.external_tickets"],
        "manual_resolution": ["after_resolution.audit_rewrite"],
        "late_replay_after_purge": ["after_late_replay.response.error",
                                    "after_late_replay.receiver_tickets"],
        "late_replay_without_policy": ["after_late_replay.receiver_tickets"],
    }

    @classmethod
    def setUpClass(cls):
        cls.text = readme()
        cls.lines = cls.text.splitlines()

    def assert_figures(self, name, cell):
        """``cell`` gives the figures of scenario ``name`` in order, and no other number."""
        values = [article1.figure(name, path) for path in self.FIGURES[name]]
        self.assertTrue(holds_figures(cell, values), f"{cell!r} does not give {values!r}")

    def test_its_headline_lines_are_the_consoles_within_the_first_60_lines(self):
        names = ["naive_lost_ack", "mark_before_send_loses_task", "idempotent_lost_ack"]
        top = self.lines[:60]
        for run in run_experiment.run_all(names):
            self.assertEqual(run.failures, [])
            self.assertIn(run_experiment.console_line(run), top)
        total = sum(len(group) for group in article1.RESULTS.values())
        self.assertIn(f"{total}/{total} scenarios match results.json", top)

    def test_the_scenario_counts_it_gives_are_the_drivers(self):
        article, beyond = len(article1.RESULTS["article_1"]), len(article1.RESULTS["open_ends"])
        cells = len(article1.MATRIX)
        ours = article + beyond + cells
        for said in (f"第一篇 {ours}（{article} 个文章场景 + {beyond} 个超出文章 + {cells} 格崩溃矩阵）",
                     f"article 1's {ours} ({article} scenarios + {beyond} beyond + {cells}"
                     " crash-matrix cells)"):
            self.assertTrue(said in self.text, f"README.md does not say {said!r}")

    def test_the_scenario_table_and_the_list_beyond_give_results_jsons_figures(self):
        rows = {re.match(r"`(\w+)`", row[0]).group(1): row
                for row in readme_table("| 场景 scenario")}
        self.assertEqual(list(rows), [name for name, (group, _, _)
                                      in run_experiment.SCENARIOS.items() if group == "article_1"])
        for name, row in rows.items():
            with self.subTest(name):
                self.assert_figures(name, row[2])
        beyond = {re.match(r"- `(\w+)`", line).group(1): line for line in self.lines
                  if re.match(r"- `\w+` ", line)}
        self.assertEqual(list(beyond), [name for name, (group, _, _)
                                        in run_experiment.SCENARIOS.items()
                                        if group == "open_ends"])
        for name, line in beyond.items():
            with self.subTest(name):
                self.assert_figures(name, line[line.rindex("（"):])

    def test_the_walk_through_runs_as_printed_in_a_copy_of_the_download_and_shows_it_all(self):
        [block] = [block for block in readme_blocks("sh")
                   if "python3 run_experiment.py reliability init" in block]
        self.assertGreaterEqual(len([line for line in block.splitlines()
                                     if line.startswith("python3")]), 10)
        code, out, unseen = walk_through(block, DOWNLOAD_1, SAME_FLAGS)
        # Each output where the reader is told to look, in the block's order.
        self.assertIsNone(unseen, out)
        self.assertEqual(code, 0, out)
        self.assertNotIn("Traceback", out)

    def test_each_kit_row_lists_its_closure(self):
        rows = {row[0]: row for row in readme_table("| 要用的")}
        for use in ("`reliability.receive`", "`reliability.enqueue` + `claim` + `acknowledge`",
                    "`reliability.connect` + `init`"):
            with self.subTest(use):
                roots = re.findall(r"`(?:reliability\.)?([^`]+)`", use)
                self.assertEqual(set(re.findall(r"`([^`]+)`", rows[use][1])) | set(roots),
                                 closure(RELIABILITY, roots))


# === 第七篇: preconditions.py's copy kit, and what README.md says of the article ===

class TheExecuteKitRunsAlone(unittest.TestCase):
    """The copy kit for execute(): exactly the definitions it needs, pasted into a fresh module,
    run the article's scenario on the connection README.md's recipe opens."""

    def test_the_kit_list_is_exactly_what_execute_needs(self):
        found, needed = article7.definitions(PRECONDITIONS), closure(PRECONDITIONS, ["execute"])
        self.assertEqual(needed, set(KIT))
        self.assertEqual(closure(PRECONDITIONS, ["connect", "init"]), set(FILES_KIT))
        needed |= set(FILES_KIT)
        with open(PRECONDITIONS, encoding="utf-8") as handle:
            body = ast.parse(handle.read()).body
        imported = {alias.asname or alias.name for node in body
                    if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        used = {node.id for name in needed for node in ast.walk(found[name][0])
                if isinstance(node, ast.Name) and node.id in imported}
        self.assertLessEqual(used, {"errno", "hashlib", "json", "os", "sqlite3", "stat",
                                    "contextmanager"})

    def test_the_execute_kit_alone_runs_the_articles_scenario_on_the_readmes_connection(self):
        # As a copier would: the kit and the connection kit in a fresh module, the database
        # made by its init() and opened by its connect() as README.md's python block says, in
        # a fresh interpreter (and in Python 3.12+ too, where one is found).
        kit = readme_kit("`preconditions.execute` + `change`", "`preconditions.connect` + `init`")
        self.assertEqual(set(kit), set(KIT + FILES_KIT) | {"change"})
        [recipe] = readme_blocks("python")
        self.assertIn('kit.init("q.db", {"A": 10, "B": 0})', recipe)
        self.assertIn('kit.connect("q.db")', recipe)
        stale = {"status": "stale", "observed": {"A": 2, "B": 3}}
        check = f"""
kit.init("q.db", {{"A": 10, "B": 0}})
connection = kit.connect("q.db")
plan = {article7.plan()!r}
assert kit.execute(connection, "job-1", plan, issued_at=0, now=0) == {article7.APPLIED!r}
replayed = {{"status": "replayed", "result": {article7.APPLIED!r}}}
assert kit.execute(connection, "job-1", plan, issued_at=0, now=0) == replayed
# Another write.
connection.execute("UPDATE resources SET quantity = 5, revision = 3 WHERE name = 'B'")
assert kit.execute(connection, "job-2", plan, issued_at=0, now=0) == {stale!r}
assert not os.path.exists(os.path.join(folder, "preconditions.py"))
connection.close()
print('ok')
"""
        for python, (code, out, err) in run_kit(PRECONDITIONS, kit, "", check):
            with self.subTest(python=python):
                self.assertEqual((code, out, err.decode("utf-8")), (0, b"ok\n", ""))


class TheReadmeOnArticle7ShowsWhatTheRunShows(unittest.TestCase):
    """README.md stays true for article 7's reader: its headline lines are the console's, its
    counts are the driver's, its table holds results.json's figures, its walk-through runs as
    printed, and its kit row lists what execute() and change() need."""

    # The article 7 table: each scenario's figures, as paths into results.json, in the order its
    # "ours" cell gives them.
    FIGURES = {
        "unsafe_check_then_act": [("after_go", "quantities", "A"), ("after_go", "quantities", "B"),
                                  ("after_go", "effects")],
        "safe_stale_rejected": [("after_go", "status"), ("after_go", "quantities", "A"),
                                ("after_go", "quantities", "B"), ("after_go", "effects")],
        "lost_ack_replay": [("after_first", "status"), ("after_retry", "status"),
                            ("after_retry", "effects")],
        "replan_new_id": [("after_stale", "status"), ("after_same_id", "status"),
                          ("after_new_id", "status")],
        "aba_revision": [("after_execute", "quantities", "A"), ("after_execute", "revisions", "A"),
                         ("after_execute", "status")],
        "crash_points": [(f"{boundary}.{stage}", key) for boundary in pre.EXIT_CODES for stage, key
                         in (("after_crash", "exit_code"), ("after_retry", "status"))],
        "stale_rejection_durable": [("after_retry", "status"), ("after_retry", "stored_status"),
                                    ("after_retry", "effects")],
        "trigger_faults": [("receipt_insert_fault", "quantities", "A"),
                           ("receipt_insert_fault", "quantities", "B"),
                           ("receipt_insert_fault", "effects")],
        "concurrent_distinct_ops": [("after_race", "statuses", "applied"),
                                    ("after_race", "statuses", "stale"),
                                    ("after_race", "effects")],
        "concurrent_same_op": [("after_race", "statuses", "applied"),
                               ("after_race", "statuses", "replayed")],
        "undeclared_dependency": [("after_execute", "status"),
                                  ("after_execute", "quantities", "C")],
    }

    def test_its_headline_lines_are_the_consoles_within_the_first_60_lines(self):
        for run in run_experiment.run_all(["unsafe_check_then_act", "safe_stale_rejected"]):
            self.assertEqual(run.failures, [])
            self.assertIn(run_experiment.console_line(run), readme().splitlines()[:60])

    def test_the_counts_it_gives_are_the_drivers(self):
        groups, cells = len(article7.ARTICLE_7), len(article7.MATRIX)
        for said in (f"第七篇 {groups + cells}（{groups} 组 + {cells} 格）",
                     f"article 7's {groups + cells} ({groups} groups + {cells} cells)"):
            self.assertIn(said, readme(), f"README.md does not say {said!r}")

    def test_the_scenario_table_gives_results_jsons_figures(self):
        rows = {re.match(r"`(\w+)`", cells[0]).group(1): cells[2]
                for cells in readme_table("| `unsafe_check_then_act`")}
        self.assertEqual(list(rows), article7.ARTICLE_7)
        seven = article7.committed_results()["article_7"]
        for name, cell in rows.items():
            values = [functools.reduce(lambda value, key: value[key], path, seven[name])
                      for path in self.FIGURES[name]]
            # The values in order, and no other number.
            with self.subTest(name):
                self.assertTrue(holds_figures(cell, values), f"{cell!r} does not give {values!r}")

    def test_the_walk_through_runs_as_printed_in_the_download_and_shows_what_it_says(self):
        [block] = [block for block in readme_blocks("sh")
                   if "python3 run_experiment.py preconditions init" in block]
        self.assertGreaterEqual(len([line for line in block.splitlines()
                                     if line.startswith("python3")]), 10)
        code, out, unseen = walk_through(block, DOWNLOAD_7, SAME_FLAGS)
        # Each output where the reader is told to look, in the block's order.
        self.assertIsNone(unseen, out)
        self.assertEqual(code, 0, out)
        self.assertNotIn("Traceback", out)

    def test_the_kit_row_lists_the_closure_of_execute_and_change_for_aba(self):
        [row] = [cells(line) for line in readme().splitlines()
                 if line.startswith("| `preconditions.execute` + `change` |")]
        self.assertEqual(set(re.findall(r"`([^`]+)`", row[1])) | {"execute", "change"},
                         set(KIT) | {"change"})
        [row] = [cells(line) for line in readme().splitlines()
                 if line.startswith("| `preconditions.connect` + `init` |")]
        self.assertEqual(set(re.findall(r"`([^`]+)`", row[1])) | {"connect", "init"},
                         set(FILES_KIT))
        # change() needs nothing that execute() does not: the kit serves ABA as it is.
        self.assertLessEqual(closure(PRECONDITIONS, ["change"]), set(KIT) | {"change"})


# === both articles: the twins, the public names, README.md, the driver, the downloads ===

class TheTwinsAreIdentical(unittest.TestCase):
    """What the two articles' files share is written twice, so that each download runs alone:
    the definitions preconditions.py shares with reliability.py, and the helpers marked
    "# twin: ..." in the two test files, are identical."""

    def test_the_twin_definitions_are_identical_in_reliability_py(self):
        mine, theirs = article7.definitions(PRECONDITIONS), article7.definitions(RELIABILITY)
        for name in ["MAX_TICK", "BUSY_TIMEOUT", "_dumps", "transaction", "check_ticks", "_open",
                     "_Connection", "_check_kind", "_check_file", "_create"]:
            with self.subTest(name):
                self.assertIn(name, theirs)
                self.assertEqual(mine[name][1], theirs[name][1])

    def test_the_helpers_marked_twin_are_identical_in_both_article_test_files(self):
        one = twins(os.path.join(ROOT, "test_reliability.py"), "test_preconditions.py")
        seven = twins(os.path.join(ROOT, "test_preconditions.py"), "test_reliability.py")
        self.assertEqual(sorted(one), sorted(seven))
        for name in one:
            with self.subTest(name):
                self.assertEqual(one[name], seven[name])
        # A function both files define is a twin, or differs on purpose: each makes its own
        # article's template.
        functions = [{name for name, (node, _) in article7.definitions(os.path.join(ROOT, path))
                      .items() if isinstance(node, ast.FunctionDef)}
                     for path in ("test_reliability.py", "test_preconditions.py")]
        self.assertEqual((functions[0] & functions[1]) - set(one), {"setUpModule"})


class TheReadmeListsThePublicNames(unittest.TestCase):
    """README.md lists reliability.__all__ and preconditions.__all__, each on one line; neither
    may go stale."""

    def test_the_readme_lists_exactly_reliability_all(self):
        lines = [line for line in readme().splitlines()
                 if line.startswith("`reliability.__all__`:")]
        self.assertTrue(lines, "README.md has no line starting with `reliability.__all__`:")
        for line in lines:
            listed = re.findall(r"`([^`]+)`", line.split(":", 1)[1])
            self.assertEqual(sorted(listed), sorted(reliability.__all__))
        self.assertEqual(len(reliability.__all__), len(set(reliability.__all__)))
        self.assertTrue(all(hasattr(reliability, name) for name in reliability.__all__))

    def test_all_equals_the_readmes_public_list(self):
        lines = [line for line in readme().splitlines()
                 if line.startswith("`preconditions.__all__`:")]
        self.assertEqual(len(lines), 1,
                         "README.md needs exactly one line starting with `preconditions.__all__`:")
        listed = re.findall(r"`([^`]+)`", lines[0].split(":", 1)[1])
        self.assertEqual(set(pre.__all__), set(listed))


class TheReadmeKeepsItsLimitsAndItsMap(unittest.TestCase):
    """README.md as a whole: one page a reader finishes, with the two commands CI runs, and a map
    from each article's sections to code, scenarios and tests that exist."""

    @classmethod
    def setUpClass(cls):
        cls.text = readme()
        cls.lines = cls.text.splitlines()

    def test_it_keeps_its_limits_and_gives_the_two_commands_ci_runs(self):
        # One page a reader finishes: the design card's 300 lines, the hook's 20,000 characters.
        self.assertLessEqual(len(self.lines), 300)
        self.assertLessEqual(len(self.text), 20000)
        prose = re.sub(r"^```.*?^```", "", self.text, flags=re.S | re.M)
        units = [unit.strip() for paragraph in re.split(r"\n\s*\n", prose)
                 for unit in re.split(r"\n(?=\s*(?:[-*]|\d+\.)\s)", paragraph) if unit.strip()]
        self.assertLessEqual(max(len(unit) for unit in units if not unit.startswith("|")), 600)
        self.assertIn("python3 -m unittest\npython3 run_experiment.py --check\n", self.text)
        ci = os.path.join(ROOT, ".ci", "run")
        # Not in an article's five-file download.
        if os.path.exists(ci):
            with open(ci, encoding="utf-8") as handle:
                self.assertIn('"$real" -m unittest && "$real" run_experiment.py --check',
                              handle.read())

    def test_the_map_names_only_code_scenarios_and_tests_that_exist(self):
        rows = readme_table("| 章节")
        self.assertTrue(rows)
        for section, code, scenario, test in rows:
            article_7 = section.startswith("七")
            module, tests = (("preconditions.py", "test_preconditions.py") if article_7
                             else ("reliability.py", "test_reliability.py"))
            # The other article's five-file download.
            if not os.path.exists(os.path.join(ROOT, module)):
                continue
            for name in re.findall(r"`([^`]+)`", code):
                self.assertIn(name, article7.definitions(os.path.join(ROOT, module)), section)
            for name in re.findall(r"`([^`]+)`", scenario):
                self.assertIn(name, run_experiment.SCENARIOS, section)
                self.assertEqual(run_experiment.SCENARIOS[name][0].startswith("article_7"),
                                 article_7, section)
            if os.path.exists(os.path.join(ROOT, tests)):
                for name in re.findall(r"`([^`]+)`", test):
                    self.assertIn(name, article7.definitions(os.path.join(ROOT, tests)), section)


class TheDriverReportsEveryFailureAndLeavesNoChild(unittest.TestCase):
    """run_experiment.py itself: exit codes, Ctrl-C, a dead worker, a batch that fails, the
    barrier, --check's comparison, a failed invariant or integrity check."""

    @unittest.skipUnless(os.path.isdir("/proc/self/fd"), "the check reads /proc/self/fd")
    def test_a_forked_child_exits_as_sys_exit_of_main_would(self):
        def returns_or_raises(outcome):
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        cases = [(None, 0, ""), (3, 3, ""), (SystemExit(2), 2, ""), (SystemExit(None), 0, ""),
                 (ValueError("boom"), 1, "ValueError: boom\n")]
        for outcome, code, tail in cases:
            with self.subTest(outcome=outcome), tempfile.TemporaryFile() as stderr:
                child = run_experiment.fork_child(returns_or_raises, (outcome,),
                                                  stderr=stderr.fileno())
                child.communicate(b"", timeout=WATCHDOG)
                stderr.seek(0)
                self.assertEqual(child.returncode, code)
                self.assertTrue(stderr.read().decode("utf-8").endswith(tail))

    @unittest.skipUnless(hasattr(signal, "pthread_sigmask"), "stops are held back by the mask")
    def test_a_child_forked_as_a_stop_comes_is_recorded_then_killed_and_reaped_by_end_forked(self):
        # The driver's handlers, as at its command line; the child stops its parent at once.
        kept = {number: signal.getsignal(number) for number in run_experiment.STOPS}
        self.addCleanup(lambda: [signal.signal(n, h) for n, h in kept.items()])
        run_experiment.stop_on_signals()
        # As run_all() does: the pids of earlier tests' children may name other processes now.
        run_experiment.FORKED.clear()

        def stops_its_parent():
            os.kill(os.getppid(), signal.SIGINT)
            return select.select([], [], [], WATCHDOG)[0]
        with self.assertRaises(KeyboardInterrupt):
            # Raised in fork() or just after it: the caller may never learn the pid.
            run_experiment.fork(stops_its_parent)
            time.sleep(WATCHDOG)
        [pid] = run_experiment.FORKED
        run_experiment.end_forked()
        self.assertEqual(run_experiment.FORKED, set())
        with self.assertRaises(ChildProcessError, msg="killed and reaped"):
            os.waitpid(pid, os.WNOHANG)

    def test_a_forked_child_writes_to_its_stderr_even_when_the_parents_is_a_buffer(self):
        # As under python3 -m unittest -b: the parent's sys.stderr is no file at all.
        def says(words):
            sys.stderr.write(words)
            raise ValueError("boom")
        with tempfile.TemporaryFile() as stderr, mock.patch("sys.stderr", io.StringIO()) as held:
            child = run_experiment.fork_child(says, ("one line, é\n",), stderr=stderr.fileno())
            child.communicate(b"", timeout=WATCHDOG)
            stderr.seek(0)
            said = stderr.read().decode("utf-8")
        self.assertEqual((child.returncode, held.getvalue()), (1, ""))
        self.assertTrue(said.startswith("one line, é\nTraceback"), said)
        self.assertTrue(said.endswith("ValueError: boom\n"), said)

    def test_a_single_article_run_names_what_it_has_and_what_another_scenario_needs(self):
        with tempfile.TemporaryDirectory() as parent:
            folder = os.path.join(parent, "article-1")
            self.assertEqual(run_main("--download", "1", folder)[0], 0)
            done = in_download(folder, "run_experiment.py", "--explain", "unsafe_check_then_act")
            self.assertEqual(done.returncode, 2)
            self.assertIn(b"the scenarios of preconditions.py need it next to this script",
                          done.stderr)
            done = in_download(folder, "run_experiment.py", "--only", "reliability/after_ack")
            self.assertEqual(done.returncode, 0, done.stderr.decode("utf-8"))
            self.assertIn(b"Crash matrix: every named boundary of reliability.py, in every mode",
                          done.stdout)

    def test_an_unusable_output_or_check_file_exits_2_with_one_line_before_any_scenario(self):
        with tempfile.TemporaryDirectory() as directory:
            for argv in (["--output", directory],
                         ["--output", os.path.join(directory, "missing", "out.json")],
                         ["--check", os.path.join(directory, "missing.json")], ["--bogus"],
                         ["--only"], ["--explain"], ["--download", "1"], ["--list", "extra"]):
                with self.subTest(argv=argv):
                    code, out, err = run_main(*argv)
                    self.assertEqual((code, out, len(err.splitlines())), (2, "", 1))
                    self.assertIn("run_experiment.py: error:", err)

    def test_an_article_test_file_run_as_a_script_stops_in_one_line_with_exit_130(self):
        # Its main() runs the tests of the script that calls it: here, one that waits.
        for module in ("test_reliability", "test_preconditions"):
            script = ("import sys, unittest\n\n\nclass Waits(unittest.TestCase):\n"
                      "    def test_waits(self):\n        print('waiting', flush=True)\n"
                      f"        sys.stdin.read()\n\n\nimport {module}\n"
                      f"sys.argv[1:] = ['-k', 'test_waits']\n{module}.main()\n")
            for number in run_experiment.STOPS:
                with self.subTest(module=module, signal=number), subprocess.Popen(
                        [sys.executable, *SAME_FLAGS, "-c", script], cwd=ROOT,
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE) as run:
                    self.assertEqual(run.stdout.readline(), b"waiting\n")
                    run.send_signal(number)
                    _, err = run.communicate(timeout=WATCHDOG)
                    self.assertEqual((run.returncode, err.decode("utf-8").splitlines()[-1:]),
                                     (130, [f"{module}.py: interrupted"]))
                    self.assertNotIn(b"Traceback", err)

    def test_a_stop_while_the_driver_still_loads_its_modules_is_one_line_and_exit_130(self):
        # A reliability.py that holds the import until its stdin closes, and says so first.
        stub = "import sys\nprint('importing', flush=True)\nsys.stdin.read()\n"
        with tempfile.TemporaryDirectory() as folder:
            shutil.copy(RUN_EXPERIMENT, folder)
            with open(os.path.join(folder, "reliability.py"), "w", encoding="utf-8") as module:
                module.write(stub)
            for number in run_experiment.STOPS:
                with self.subTest(signal=number), subprocess.Popen(
                        [sys.executable, *SAME_FLAGS, "run_experiment.py", "--list"],
                        cwd=folder, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE) as driver:
                    self.assertEqual(driver.stdout.readline(), b"importing\n")
                    driver.send_signal(number)
                    out, err = driver.communicate(timeout=WATCHDOG)
                    self.assertEqual((driver.returncode, out, err),
                                     (130, b"", b"run_experiment.py: interrupted\n"))

    @unittest.skipUnless(os.path.exists("/dev/full"), "a full disk is /dev/full")
    def test_a_write_to_a_full_disk_exits_1_with_one_line(self):
        full = open("/dev/full", "w")
        self.addCleanup(full.close)
        for argv, stdout in ((["--output", "/dev/full"], subprocess.PIPE), (["--json"], full)):
            with self.subTest(argv=argv):
                done = subprocess.run([sys.executable, *SAME_FLAGS, RUN_EXPERIMENT, "--only",
                                       "naive_lost_ack", *argv], stdout=stdout,
                                      stderr=subprocess.PIPE, timeout=WATCHDOG * 4)
                said = done.stderr.decode("utf-8").splitlines()
                self.assertEqual((done.returncode, said[-1]),
                                 (1, "run_experiment.py: [Errno 28] No space left on device"))
                self.assertNotIn("Traceback", done.stderr.decode("utf-8"))

    @unittest.skipUnless(os.path.isdir("/proc"), "a FIFO holds the driver still (Linux /proc)")
    def test_ctrl_c_exits_130_with_one_line_and_no_traceback(self):
        # A background job: its children ignore SIGINT too.
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            self.skipTest("SIGINT is ignored in this process, so no child of it can be"
                          " interrupted")
        # --check opens a FIFO that nobody writes: the driver waits there until the interrupt.
        with tempfile.TemporaryDirectory() as directory:
            fifo = os.path.join(directory, "results.json")
            os.mkfifo(fifo)
            driver = os.path.join(ROOT, "run_experiment.py")
            child = subprocess.Popen([sys.executable, "-S", driver, "--check", fifo],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            writer = None
            try:
                deadline = time.monotonic() + WATCHDOG
                # Opened for writing once the driver has it open for reading.
                while writer is None:
                    try:
                        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                    except OSError as error:
                        # ENXIO: no reader yet.
                        self.assertEqual(error.errno, errno.ENXIO)
                        self.assertLess(time.monotonic(), deadline,
                                        "the driver never opened the FIFO")
                        time.sleep(0.005)
                # Interrupted once it sleeps in read() with the FIFO open: the read returns EINTR
                # and the interrupt is raised.  One that landed between open() and read() would
                # wait, unseen by Python's C code, until the read returned.
                while not sleeps_reading(child.pid, fifo):
                    self.assertLess(time.monotonic(), deadline, "the driver never read the FIFO")
                    time.sleep(0.005)
                child.send_signal(signal.SIGINT)
                try:
                    out, err = child.communicate(timeout=WATCHDOG)
                except subprocess.TimeoutExpired:
                    # What the driver did with the signal: blocked, ignored or pending.
                    with open(f"/proc/{child.pid}/status", encoding="utf-8") as status:
                        masks = [line.strip() for line in status if line.startswith("Sig")]
                    raise AssertionError(f"the driver outlived its interrupt: {masks}") from None
            finally:
                if writer is not None:
                    os.close(writer)
                if child.returncode is None:
                    child.kill()
                    child.communicate()
            self.assertEqual((child.returncode, out, err.decode("utf-8")),
                             (130, b"", "run_experiment.py: interrupted\n"))

    def test_a_scenario_whose_harness_fails_fails_alone_and_the_others_still_run(self):
        def fails(run):
            raise RuntimeError("the harness broke")

        def observes(run):
            run.stages["seen"] = {"ran": True}
        added = {"fails": fails, "observes": observes, "observes_too": observes}
        for name, function in added.items():
            run_experiment.SCENARIOS[name] = ("article_7", name, function)
        try:
            runs = run_experiment.run_all(list(added))
        finally:
            for name in added:
                del run_experiment.SCENARIOS[name]
        self.assertEqual({run.name: (run.failures, run.stages) for run in runs}, {
            "fails": (["RuntimeError: the harness broke"], {}),
            "observes": ([], {"seen": {"ran": True}}),
            "observes_too": ([], {"seen": {"ran": True}})})

    @unittest.skipUnless(hasattr(os, "fork"), "the driver forks its children")
    def test_a_batch_that_fails_half_way_kills_and_reaps_every_child_before_its_folder_goes(self):
        # Real children that would wait for ever (racing receivers with no request), then a
        # failure: a child at the watchdog, or a start that fails half way (the only simulated
        # part: fork refusing a fourth child).
        real, started = run_experiment.fork_child, []

        def fourth_fails(*args, **kwargs):
            if len(started) == 3:
                raise OSError("no more processes")
            started.append(real(*args, **kwargs))
            return started[-1]
        with article1.workspace() as ws:
            ws.close()
            run = run_experiment.Run("batch", ws.root)
            receiver = (run, run_experiment.racing_receiver, ws.path("receiver"))
            with self.assertRaises(RuntimeError), run_experiment.watched(run) as children:
                children += [run_experiment.spawn(*receiver) for _ in range(8)]
                raise RuntimeError("one child hung at the watchdog")
            with mock.patch.object(run_experiment, "fork_child", fourth_fails), \
                    self.assertRaises(OSError):
                with run_experiment.watched(run) as others:
                    for _ in range(8):
                        others.append(run_experiment.spawn(*receiver))
            for child in children + started:
                self.assertEqual(child.returncode, -signal.SIGKILL)
                with self.assertRaises(ChildProcessError, msg="reaped: no zombie either"):
                    os.waitpid(child.pid, os.WNOHANG)
            self.assertEqual((len(children), len(started)), (8, 3))

    @unittest.skipUnless(hasattr(os, "fork"), "the driver forks its children")
    def test_a_racer_that_never_reaches_the_barrier_fails_the_race(self):
        request = json.dumps({"caller": "agent", "key": "k1", "payload": article1.PAYLOAD,
                              "issued_at": 0, "now": 0})
        with article1.workspace() as ws:
            ws.close()
            run = run_experiment.Run("race", ws.root)
            racer = (run, run_experiment.racing_receiver, ws.path("receiver"))
            with run_experiment.watched(run) as children:
                children += [run_experiment.spawn(*racer) for _ in range(2)]
                self.assertEqual(run_experiment.race(children, request)[0], 2)
            with self.assertRaisesRegex(RuntimeError, "did not all reach the barrier"):
                # One answers at once.
                with run_experiment.watched(run) as children:
                    children += [run_experiment.spawn(*racer), run_experiment.spawn(
                        run, reliability.tool_child, ["receive", ws.path("receiver")])]
                    run_experiment.race(children, request)

    @unittest.skipUnless(hasattr(os, "fork"), "the tests' racers are forked")
    def test_the_tests_race_fails_at_once_when_a_racer_never_comes_to_its_barrier(self):
        def body(wait):
            # The first racer to number itself gives up before the barrier.
            if article1.numbered(folder, "racer")[0] == 0:
                raise RuntimeError("gave up before the barrier")
            wait()
            return "through"
        with tempfile.TemporaryDirectory() as folder, open(os.devnull, "w") as quiet:
            # The racer's traceback, if it is written before the race kills it, goes to fd 2
            # as any process's would: here, nowhere.
            sys.stderr.flush()
            kept = os.dup(2)
            os.dup2(quiet.fileno(), 2)
            try:
                with self.assertRaisesRegex(AssertionError, "ended while the others waited"):
                    article1.race(body, 3)
            finally:
                os.dup2(kept, 2)
                os.close(kept)

    def test_check_exits_1_and_names_each_difference_by_value_json_type_and_key(self):
        with tempfile.TemporaryDirectory() as directory:
            for label, tamper in (("changed", lambda stage: stage.update(receiver_tickets=2)),
                                  ("missing", lambda stage: stage.pop("receiver_tickets")),
                                  ("extra", lambda stage: stage.update(surplus=0))):
                with self.subTest(label):
                    expected = json.loads(json.dumps(article1.RESULTS))
                    tamper(expected["article_1"]["idempotent_lost_ack"]["after_recovery"])
                    path = os.path.join(directory, label + ".json")
                    with open(path, "w", encoding="utf-8") as handle:
                        json.dump(expected, handle)
                    code, out, _ = run_main("--check", path, "--only", "idempotent_lost_ack")
                    self.assertEqual(code, 1, out)
                    key = "surplus" if label == "extra" else "receiver_tickets"
                    self.assertIn("differs: article_1.idempotent_lost_ack.after_recovery."
                                  + key, out)
                    self.assertIn("0/1 scenarios match", out)
        differences = run_experiment.differences
        self.assertEqual(differences({"x": {"a": 1, "b": 2}}, {"x": {"a": 1}}),
                         [("x.b", 2, "<absent>")])
        self.assertEqual(differences({"x": {"a": 1}}, {"x": {"a": 1, "b": 2}}),
                         [("x.b", "<absent>", 2)])
        # JSON types are compared, so 1 is not true.
        self.assertEqual(differences({"a": 0, "b": 2, "c": [1]},
                                     {"a": False, "b": 2.0, "c": [True]}),
                         [("a", 0, False), ("b", 2, 2.0), ("c", [1], [True])])
        self.assertEqual(differences({"a": {"b": 1}}, {"a": {"b": 1}}), [])
        # A scenario in results.json that the driver no longer runs is compared, so it differs.
        ghost = dict(article1.RESULTS, article_1=dict(article1.RESULTS["article_1"],
                                                      ghost={"seen": {"tickets": 1}}))
        self.assertIn("ghost", run_experiment.compared(ghost)["article_1"])
        self.assertEqual(set(run_experiment.compared(ghost, ["ghost"])), {"article_1"})
        self.assertNotIn("ghost",
                         run_experiment.compared(ghost, ["idempotent_lost_ack"])["article_1"])

    def test_a_failed_invariant_fails_the_run_and_is_counted(self):
        def breaks_its_invariant(run):
            run.expect("the figure", 1, 2)
        run_experiment.SCENARIOS["breaks_its_invariant"] = ("article_1", "a scenario that fails",
                                                            breaks_its_invariant)
        try:
            code, out, _ = run_main("--only", "breaks_its_invariant")
        finally:
            del run_experiment.SCENARIOS["breaks_its_invariant"]
        self.assertEqual(code, 1)
        self.assertIn("invariant failed: the figure: expected 2, observed 1", out)
        self.assertIn("0/1 scenarios hold their invariants", out)

    def test_the_integrity_check_after_each_scenario_can_fail(self):
        with tempfile.TemporaryDirectory() as directory:
            # A receipt whose ticket does not exist.
            with article1.raw(os.path.join(directory, "keys.db")) as broken:
                for statement in reliability.SCHEMAS[reliability.RECEIVER]:
                    broken.execute(statement)
                broken.execute("INSERT INTO receipts VALUES ('a', 'k', 'd', 99, 0)")
            pages = os.path.join(directory, "pages.db")
            with article1.raw(pages) as broken:
                broken.execute("CREATE TABLE t (x TEXT)")
                broken.execute("CREATE INDEX t_x ON t (x)")
                broken.executemany("INSERT INTO t VALUES (?)",
                                   [(f"row {i}" * 20,) for i in range(200)])
            # The last page overwritten: SQLite's own check must see it.
            with open(pages, "r+b") as handle:
                handle.seek(-4096, os.SEEK_END)
                handle.write(article1.GARBAGE[:4096])
            run = run_experiment.Run("integrity", directory)
            run_experiment.check_integrity(run)
        self.assertEqual(sorted(name for name, verdict in run.integrity.items()
                                if verdict != "ok"), ["keys.db", "pages.db"])
        self.assertEqual(len(run.failures), 2)

    @unittest.skipUnless(os.path.isdir("/proc"), "a FIFO holds the driver still (Linux /proc)")
    def test_an_interrupt_at_a_terminal_or_to_a_background_start_exits_130_in_one_line(self):
        # Each of article1.STOPS (a background start ignores SIGINT, as `cmd &` in a script
        # starts it); --check holds it in the read of a FIFO that nobody writes.
        with tempfile.TemporaryDirectory() as directory:
            fifo = os.path.join(directory, "results.json")
            os.mkfifo(fifo)
            driver = [sys.executable, os.path.join(ROOT, "run_experiment.py"), "--check", fifo,
                      "--only", "idempotent_lost_ack"]
            for label, (stop, background) in article1.STOPS.items():
                writer = []

                def ready(pid, screen):
                    # Opened for writing once the driver has it open for reading (ENXIO until
                    # then): its open() returns, and its read() waits.
                    if not writer:
                        with contextlib.suppress(OSError):
                            writer.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                    return bool(writer) and sleeps_reading(pid, fifo)
                with self.subTest(label):
                    try:
                        done = article1.at_a_terminal(driver, ready, stop, background)
                    finally:
                        for fd in writer:
                            os.close(fd)
                    self.assertEqual(done, (130, "run_experiment.py: interrupted\n", []))

    @unittest.skipUnless(hasattr(os, "fork") and os.path.isdir("/proc"),
                         "forked children, seen through Linux /proc")
    def test_an_interrupt_while_a_child_runs_kills_it_and_its_own_and_is_one_line(self):
        # A scenario whose child (the driver's run_child) waits for a grandchild that waits for
        # ever in the read of a FIFO nobody writes.  The driver, as its command line runs it in
        # a process group of its own, is stopped while that grandchild waits: by SIGINT, SIGTERM
        # or SIGHUP to its group, or by SIGTERM to the driver alone.  Either way it kills the
        # child's process group itself, and it ends only after the child has.
        added = {"waits": lambda run: run_experiment.run_child(run, parks, fifo)}
        for name, function in added.items():
            run_experiment.SCENARIOS[name] = ("article_7", name, function)
        stops = {"SIGINT to its group": lambda pid: os.killpg(pid, signal.SIGINT),
                 "SIGTERM to its group": lambda pid: os.killpg(pid, signal.SIGTERM),
                 "SIGHUP to its group": lambda pid: os.killpg(pid, signal.SIGHUP),
                 "SIGTERM to it alone": lambda pid: os.kill(pid, signal.SIGTERM)}
        try:
            for label, stop in stops.items():
                with self.subTest(label), tempfile.TemporaryDirectory() as directory, \
                        tempfile.TemporaryDirectory() as held, \
                        tempfile.TemporaryFile() as said:
                    fifo = os.path.join(held, "never-written")
                    os.mkfifo(fifo)

                    def driver():
                        os.setpgid(0, 0)
                        tempfile.tempdir = directory
                        os.dup2(said.fileno(), 1)
                        os.dup2(said.fileno(), 2)
                        run_experiment.stop_on_signals()
                        return run_experiment.main(["--check", "--only", *added])
                    pid = run_experiment.fork(driver)
                    try:
                        deadline = time.monotonic() + WATCHDOG
                        waiting = []
                        while not waiting:
                            self.assertLess(time.monotonic(), deadline, "no grandchild waits")
                            time.sleep(0.005)
                            waiting = [grandchild for child in article1.children_of(pid)
                                       for grandchild in article1.children_of(child)
                                       if sleeps_reading(grandchild, fifo)]
                        [child] = article1.children_of(pid)
                        started = [(process, article1.started_at(process))
                                   for process in (child, *waiting)]
                        stop(pid)
                        while not os.waitpid(pid, os.WNOHANG)[0]:
                            self.assertLess(time.monotonic(), deadline, "the driver lives on")
                            time.sleep(0.005)
                    finally:
                        # Whatever failed: nothing of it lives on.
                        for group in {pid, *(os.getpgid(process) for process
                                             in article1.children_of(pid))}:
                            with contextlib.suppress(ProcessLookupError):
                                os.killpg(group, signal.SIGKILL)
                        with contextlib.suppress(ChildProcessError):
                            os.waitpid(pid, 0)
                    said.seek(0)
                    lines = said.read().decode("utf-8").splitlines()
                    self.assertEqual(lines[-1], "run_experiment.py: interrupted")
                    self.assertFalse([line for line in lines
                                      if "Traceback" in line or "scenarios" in line], lines)
                    self.assertEqual([process for process, when in started
                                      if article1.started_at(process) == when], [])
                    self.assertEqual(os.listdir(directory), [])
        finally:
            for name in added:
                del run_experiment.SCENARIOS[name]

    def test_a_scenario_an_interrupt_ended_stops_the_run_in_one_line_failing_nothing(self):
        # The scenario itself interrupted, in the driver: the run was stopped, nothing failed.
        def ends(run):
            run.stages["seen"] = {"ended": True}
            return "ended"
        added = {"interrupted": lambda run: os.kill(os.getpid(), signal.SIGINT), "ends": ends}
        for name, function in added.items():
            run_experiment.SCENARIOS[name] = ("article_7", name, function)
        # As at a terminal, even where this suite was started with interrupts ignored (a
        # shell's background job): the driver keeps ignoring those, as nohup's.
        before = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            code, out, err = run_main("--check", "--only", *added)
        finally:
            signal.signal(signal.SIGINT, before)
            for name in added:
                del run_experiment.SCENARIOS[name]
        self.assertEqual((code, out, err.splitlines()[-1]), (130, "",
                                                             "run_experiment.py: interrupted"))

    def test_the_driver_runs_without_path_for_its_children_are_forked(self):
        # A shell that exports no PATH (env -i bash) runs python3, found by name, with an empty
        # environment: its sys.executable is empty, and no child needs it.
        bare = ["import os, sys", "os.execve(sys.executable, ['python3', *sys.argv[1:]], {})"]
        bare = [sys.executable, "-I", "-S", "-c", "; ".join(bare),
                os.path.join(ROOT, "run_experiment.py"), "--only", "idempotent_lost_ack",
                "concurrent_same_op"]
        done = subprocess.run(bare, capture_output=True, timeout=WATCHDOG)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn(b"2/2 scenarios hold their invariants", done.stdout)


class TheFiveFilesRunAlone(unittest.TestCase):
    """Each article's five files, as ``run_experiment.py --download`` writes them into an empty
    folder, do what the article's last section says: its test file passes, ``--check results.json
    --output reproduced.json`` passes, and reproduced.json is results.json byte for byte, made
    by this run alone."""

    def test_each_articles_five_files_do_what_its_last_section_says(self):
        # Article 1 as the README prints it; article 7's commands as its §8 prints them, with
        # --output and cmp as in article 1.  Both in copies of the project, at the same time,
        # each stopping at the first command that fails.
        [block] = [block for block in readme_blocks("sh") if "--download 1" in block]
        self.assertIn("python3 test_reliability.py\n", block)
        self.assertIn("python3 run_experiment.py --check results.json --output reproduced.json\n"
                      "cmp reproduced.json results.json\n", block)
        seven = "\n".join(["python3 run_experiment.py --download 7 article-7 && cd article-7",
                           "python3 test_preconditions.py", "python3 run_experiment.py --check",
                           "python3 run_experiment.py --check results.json --output"
                           " reproduced.json", "cmp reproduced.json results.json", ""])
        self.assertIn("`--download 7 article-7`", readme())
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(walk_through, "set -e\n" + script, PROJECT, SAME_FLAGS)
                    for script in (block, seven)]
            for article, run in zip("17", runs):
                code, out, _ = run.result()
                with self.subTest(article=article):
                    self.assertEqual(code, 0, out)
                    self.assertIn(f"wrote article {article}'s five files to article-{article}\n",
                                  out)
                    self.assertIn("wrote reproduced.json\n", out)
        for article in "17":
            with self.subTest(article=article):
                self.assert_made_by_the_run_alone(article)

    def test_a_download_folder_that_cannot_be_used_is_one_line_and_leaves_nothing(self):
        with tempfile.TemporaryDirectory() as parent:
            os.chmod(parent, 0o777)
            made = {"a file": lambda path: open(path, "w").close(),
                    "a dangling link": lambda path: os.symlink("nowhere", path),
                    "a FIFO": os.mkfifo, "a folder that holds a file": lambda path: (
                        os.mkdir(path), open(os.path.join(path, "x"), "w").close())}
            for label, make in made.items():
                with self.subTest(label):
                    path = os.path.join(parent, label.replace(" ", "-"))
                    make(path)
                    before = sorted(os.listdir(parent))
                    code, out, err = run_main("--download", "1", path)
                    self.assertEqual((code, out), (2, ""))
                    self.assertRegex(err, rf"\Arun_experiment.py: error: --download:"
                                     rf" {re.escape(path)} exists and is not an empty folder"
                                     r" \([^)\n]+\); it is never overwritten\n\Z")
                    self.assertEqual(sorted(os.listdir(parent)), before)
            self.assertEqual(run_main("--download", "1", ""),
                             (2, "", "run_experiment.py: error: --download: the folder's name is"
                                     " empty\n"))
            # A folder another user may not write in: refused before anything is made.
            locked = os.path.join(parent, "locked")
            os.mkdir(locked, 0o555)
            if os.geteuid() == 0:
                done = run_experiment.run_forked(lambda: article1._become_nobody() or run_main(
                    "--download", "1", os.path.join(locked, "article-1")))
            else:
                done = run_main("--download", "1", os.path.join(locked, "article-1"))
            self.assertEqual(list(done), [2, "", "run_experiment.py: error: --download: cannot"
                                          f" write beside {locked}/article-1: Permission"
                                          " denied\n"])
            self.assertEqual(os.listdir(locked), [])
            # An empty folder is taken.
            empty = os.path.join(parent, "empty")
            os.mkdir(empty)
            self.assertEqual(run_main("--download", "7", empty)[0], 0)
            self.assertEqual(sorted(os.listdir(empty)), sorted(DOWNLOAD_7))

    def test_a_download_that_fails_half_way_leaves_nothing_and_the_next_one_succeeds(self):
        # The kernel refuses a write past a file-size limit (EFBIG), as a full disk would.
        def limited(folder):
            import resource
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
            return run_main("--download", "1", folder)
        with tempfile.TemporaryDirectory() as parent:
            folder = os.path.join(parent, "article-1")
            code, out, err = run_experiment.run_forked(limited, folder)
            self.assertEqual((code, out), (1, ""))
            self.assertEqual(err, "run_experiment.py: error: --download: could not write"
                             f" {folder}: File too large\n")
            self.assertEqual(os.listdir(parent), [])
            self.assertEqual(run_main("--download", "1", folder)[0], 0)
            self.assertEqual(sorted(os.listdir(folder)), sorted(DOWNLOAD_1))

    def test_files_copied_by_hand_with_the_whole_results_json_check_and_say_why_cmp_differs(self):
        # One article's files beside the project's whole results.json: its scenarios match, the
        # run says that the other article's were not run, and how to get the download.
        with tempfile.TemporaryDirectory() as folder:
            for name in DOWNLOAD_1:
                shutil.copyfile(os.path.join(ROOT, name), os.path.join(folder, name))
            note = ("note: the results also hold article 7's, which need preconditions.py here:"
                    " they were not run, and an --output file leaves them out, so cmp differs."
                    " Article 1's own five files: python3 run_experiment.py --download 1 DIR, in"
                    " the project.")
            outs = []
            for argv in (["--check"], ["--output", "reproduced.json"]):
                with self.subTest(argv=argv):
                    done = in_download(folder, "run_experiment.py", *argv)
                    outs.append(done.stdout.decode("utf-8"))
                    self.assertEqual(done.returncode, 0, outs[-1])
                    self.assertEqual(outs[-1].splitlines()[-1], note)
            self.assertIn("32/32 scenarios match results.json", outs[0])
            self.assertNotEqual(article1.file_bytes(os.path.join(folder, "reproduced.json")),
                                article1.file_bytes(os.path.join(folder, "results.json")))

    def assert_made_by_the_run_alone(self, article):
        """Article ``article``'s download holds exactly its part of the project's results.json,
        and its driver writes those bytes with no results.json beside it; a second --download
        into the same folder overwrites nothing."""
        with tempfile.TemporaryDirectory() as parent:
            folder = os.path.join(parent, f"article-{article}")
            code, out, err = run_main("--download", article, folder)
            self.assertEqual((code, out, err),
                             (0, f"wrote article {article}'s five files to {folder}\n", ""))
            committed = article1.file_bytes(os.path.join(folder, "results.json"))
            whole = article1.file_bytes(os.path.join(ROOT, "results.json")).decode("utf-8")
            part = {group: {name: stages for name, stages in scenarios.items()
                            if run_experiment.article_of(group, name) == article}
                    for group, scenarios in json.loads(whole).items()}
            self.assertEqual(json.loads(committed),
                             {group: found for group, found in part.items() if found})
            self.assertEqual(run_main("--download", article, folder)[0], 2, "never overwrites")
            os.remove(os.path.join(folder, "results.json"))
            done = in_download(folder, "run_experiment.py", "--output", "again.json")
            self.assertEqual(done.returncode, 0, done.stderr.decode("utf-8"))
            self.assertEqual(article1.file_bytes(os.path.join(folder, "again.json")), committed)


class TheSuiteRunsHalfOfBeyondBeside(unittest.TestCase):
    """beyond/__init__.py: what the second process runs is reported as if it ran here."""

    def test_each_outcome_of_the_second_process_is_reported_as_the_same_tests_run_here(self):
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "outcomes.py"), "w", encoding="utf-8") as module:
                module.write(OUTCOMES)
            done = beside(folder, "-b", "outcomes")
            self.assertEqual(done.returncode, 0, done.stderr)
            there = unittest.TestResult()
            beyond._replay(there, beyond._lines(done.stdout), done.returncode)
            spec = importlib.util.spec_from_file_location("outcomes", module.name)
            outcomes = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(outcomes)
        # What the failing test prints stays out of this run's output.
        with contextlib.redirect_stdout(io.StringIO()):
            here = unittest.TestResult()
            unittest.defaultTestLoader.loadTestsFromModule(outcomes).run(here)
        for name in ("failures", "errors", "skipped", "expectedFailures"):
            with self.subTest(name):
                self.assertEqual([test.id() for test, _ in getattr(there, name)],
                                 [test.id() for test, _ in getattr(here, name)])
                self.assertTrue(getattr(here, name))
        self.assertEqual([test.id() for test in there.unexpectedSuccesses],
                         [test.id() for test in here.unexpectedSuccesses])
        self.assertEqual((there.wasSuccessful(), here.wasSuccessful()), (False, False))
        self.assertIn("AssertionError: 1 != 2", there.failures[0][1])
        # -b: what the failing test printed is shown with its failure.
        self.assertIn("Stdout:\nsaid before failing", there.failures[0][1])
        # --durations (3.12+): each test's time, reported as the runner here reports it.
        self.assertEqual([name for name, _ in getattr(there, "collectedDurations", [])],
                         [name for name, _ in getattr(here, "collectedDurations", [])])
        self.assertIn("KeyError: 'k'", there.errors[0][1])
        self.assertEqual(there.skipped[0][1], "why")

    def test_a_second_process_that_dies_in_a_test_leaves_what_came_before_and_names_that_test(
            self):
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "dying.py"), "w", encoding="utf-8") as module:
                module.write(DYING)
            done = beside(folder, "-", "dying")
        there = unittest.TestResult()
        beyond._replay(there, beyond._lines(done.stdout), done.returncode)
        self.assertEqual((done.returncode, there.testsRun, len(there.errors)), (3, 2, 1))
        self.assertEqual(there.errors[0][0].id(), "beyond")
        self.assertIn("it ended (exit status 3) without the rest of its record; the last test"
                      " it started: dying.Dies.test_2_dies", there.errors[0][1])

    def test_discovery_makes_a_sigterm_to_the_runner_end_it_as_a_ctrl_c_does(self):
        self.addCleanup(signal.signal, signal.SIGTERM, signal.getsignal(signal.SIGTERM))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        beyond.load_tests(unittest.defaultTestLoader, None, "test_none_is_named_so*.py")
        self.assertIs(signal.getsignal(signal.SIGTERM), signal.default_int_handler)

    def test_with_failfast_the_replay_stops_at_the_first_failure(self):
        lines = [{"running": "m.T.a"}, {"outcome": ["m.T.a", "a (m.T)", None, "failure", "boom"]},
                 {"running": "m.T.b"}, {"outcome": ["m.T.b", "b (m.T)", None, "success", None]},
                 {"durations": []}]
        result = unittest.TestResult()
        result.failfast = True
        beyond._replay(result, lines, 0)
        self.assertEqual((result.testsRun, len(result.failures), result.shouldStop), (1, 1, True))

    def test_a_second_process_the_runner_interrupts_exits_130_without_a_traceback(self):
        waits = "import sys, unittest\n\n\nclass Waits(unittest.TestCase):\n" \
                "    def test_waits(self):\n        print('waiting', flush=True)\n" \
                "        sys.stdin.read()\n"
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "waits.py"), "w", encoding="utf-8") as module:
                module.write(waits)
            # As _Beside starts it, with a stdin to wait on; what a test prints is on stderr.
            with subprocess.Popen(beyond._command(False, ["waits"]), env=on_path(folder),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE) as second:
                self.assertEqual(second.stderr.readline(), b"waiting\n")
                second.send_signal(signal.SIGINT)
                out, err = second.communicate(timeout=WATCHDOG)
        self.assertEqual((second.returncode, err), (130, b""))
        self.assertEqual(beyond._lines(out), [{"running": "waits.Waits.test_waits"}])


# === machinery: paths, the driver in this process, the kits, the twins, README.md ===

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELIABILITY = os.path.join(ROOT, "reliability.py")
RUN_EXPERIMENT = os.path.join(ROOT, "run_experiment.py")
PRECONDITIONS = os.path.join(ROOT, "preconditions.py")
# Seconds: only ends a hung child, never asserted as a measurement (the article tests' twin).
WATCHDOG = article1.WATCHDOG
# This run's interpreter flags (-X dev, -W error), for the fresh interpreters that run the driver.
SAME_FLAGS = (["-X", "dev"] if sys.flags.dev_mode else []) + [f"-W{w}" for w in sys.warnoptions]
# Each article's download: these five files alone run it.
DOWNLOAD_1 = ("reliability.py", "run_experiment.py", "results.json", "test_reliability.py",
              "README.md")
DOWNLOAD_7 = ("preconditions.py", "run_experiment.py", "results.json", "test_preconditions.py",
              "README.md")
# The project's top-level files: what --download reads.
PROJECT = tuple(sorted(set(DOWNLOAD_1 + DOWNLOAD_7)))
# A module of tests with each outcome a runner reports, for beyond/__init__.py's second process.
OUTCOMES = """import unittest


class Each(unittest.TestCase):
    def test_passes(self):
        pass

    def test_fails(self):
        print("said before failing")
        self.assertEqual(1, 2)

    def test_raises(self):
        raise KeyError("k")

    @unittest.skip("why")
    def test_skipped(self):
        pass

    @unittest.expectedFailure
    def test_expected_to_fail(self):
        self.fail()

    @unittest.expectedFailure
    def test_passes_unexpectedly(self):
        pass

    def test_subtests(self):
        for number in range(3):
            with self.subTest(number=number):
                self.assertEqual(number % 2, 0)
"""
# A module of tests whose second test ends its process.
DYING = """import os
import unittest


class Dies(unittest.TestCase):
    def test_1_passes(self):
        pass

    def test_2_dies(self):
        os._exit(3)

    def test_3_never_runs(self):
        pass
"""
# Article 7's execute() kit, and the imports a kit module starts with.
KIT = ["execute", "history", "_expired", "validate", "_check_text", "_check_int", "check_ticks",
       "transaction", "crash_point", "CRASH_AT", "EXIT_CODES", "MAX_OP_LENGTH", "MAX_NAME_LENGTH",
       "MAX_AMOUNT", "MAX_INT64", "MAX_TICK", "_dumps"]
# connect() and init(): what every kit's connection needs.
FILES_KIT = ["connect", "_open", "_Connection", "_check_kind", "_check_file", "init", "_create",
             "transaction", "_check_text", "_check_int", "APPLICATION_ID", "SCHEMA",
             "SCHEMA_VERSION", "BUSY_TIMEOUT", "MAX_NAME_LENGTH", "MAX_INT64"]
KIT_IMPORTS = ("import errno\nimport hashlib\nimport json\nimport os\nimport sqlite3\n"
               "import stat\nfrom contextlib import contextmanager")


def setUpModule():
    # The driver's tests work in article 1's workspaces, copies of the template its module
    # fixture makes.
    article1.setUpModule()


def tearDownModule():
    article1.tearDownModule()


# --- the driver: its main() in this process, and a child of it watched through /proc

def run_main(*argv):
    """run_experiment.main(argv) in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run_experiment.main(list(argv))
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue()


def beside(folder, buffer, module):
    """``module`` of ``folder`` run as beyond/__init__.py's second process, started as _Beside
    starts it (``buffer``: "-b" or "-"), to its end."""
    return subprocess.run(beyond._command(buffer == "-b", [module]), env=on_path(folder),
                          capture_output=True, timeout=WATCHDOG)


def on_path(folder):
    """This process's environment, with ``folder``'s modules importable."""
    earlier = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=folder + (os.pathsep + earlier if earlier else ""))


def in_download(folder, *argv):
    """A fresh interpreter with this run's flags, without site-packages or Python's environment
    variables, in ``folder``: argv's command run to its end."""
    return subprocess.run([sys.executable, "-S", *SAME_FLAGS, *argv], cwd=folder,
                          env=article7.without_python_variables(PYTHONDONTWRITEBYTECODE="1"),
                          capture_output=True, timeout=WATCHDOG * 4)


def parks(fifo):
    """A child that waits for a grandchild (in its process group) that waits for ever in the
    read of the FIFO ``fifo``, opened for reading and writing so that no writer is needed."""
    return os.waitpid(run_experiment.fork(lambda: os.read(os.open(fifo, os.O_RDWR), 1)), 0)[1]


def sleeps_reading(pid, path):
    """Whether process ``pid`` holds ``path`` open and sleeps (state S), as in a read that waits
    for a writer (Linux /proc)."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
        holds = any(os.readlink(f"/proc/{pid}/fd/{fd}") == os.path.realpath(path)
                    for fd in os.listdir(f"/proc/{pid}/fd"))
        return holds and state == "S"
    return False


# --- the copy kits: a module's definitions, what each needs, a kit run alone

def needs(path, node):
    """The module-level definitions of the module at ``path`` that ``node``, one of its
    definitions, refers to (names it binds itself excluded)."""
    names = [n for n in ast.walk(node) if isinstance(n, ast.Name)]
    loaded = {n.id for n in names if isinstance(n.ctx, ast.Load)}
    bound = {n.id for n in names if not isinstance(n.ctx, ast.Load)}
    bound |= {n.arg for n in ast.walk(node) if isinstance(n, ast.arg)}
    bound -= {name for n in ast.walk(node) if isinstance(n, ast.Global) for name in n.names}
    return (loaded - bound) & set(article7.definitions(path))


def closure(path, roots):
    """The names of ``roots`` and of every definition they need in the module at ``path``,
    transitively: a kit."""
    defined, found, todo = article7.definitions(path), set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo.extend(needs(path, defined[name][0]) - found)
    return found


def readme_kit(*uses):
    """What README.md's kit table tells a copier to paste for the rows ``uses`` (their first
    cells), in the table's order: each row's functions, then the names it lists."""
    names = []
    for use, listed in readme_table("| 要用的"):
        if use in uses:
            names += re.findall(r"`(?:\w+\.)?([^`]+)`", use) + re.findall(r"`([^`]+)`", listed)
    return names


def run_kit(path, names, recipe, check):
    """The definitions ``names`` of the module at ``path`` written to kit.py in a fresh folder,
    in that order after KIT_IMPORTS, each once; then ``recipe`` (README.md's python block) and
    ``check`` run in a fresh interpreter, this one and a 3.12+ where found, each in a
    ``folder`` of its own, which is its working directory.
    [(interpreter, (exit code, stdout, stderr))]."""
    defined = article7.definitions(path)
    # Each definition once: SENDER, RECEIVER, EXTERNAL = ... binds three names.
    kit = list({id(defined[name][0]): defined[name] for name in names}.values())
    interpreters = [sys.executable] + [newer for newer in [newer_python()] if newer]
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "kit.py"), "w", encoding="utf-8") as handle:
            handle.write("\n\n\n".join([KIT_IMPORTS] + [text for _, text in kit]) + "\n")
        script = "\n".join([
            "import os, sys", f"folder = {directory!r}", "sys.path.insert(0, folder)",
            "import kit",
            # Each interpreter its own databases: they run at the same time.
            "folder = os.path.join(folder, sys.implementation.cache_tag)", "os.mkdir(folder)",
            "os.chdir(folder)", recipe, check])
        return list(zip(interpreters, article1.run_together(
            [[python, "-I", "-S", *SAME_FLAGS, "-c", script] for python in interpreters])))


@functools.lru_cache(maxsize=None)
def newer_python():
    """A CPython 3.12 or newer when this one is older, so the kits meet 3.12's sqlite3 (its
    ``autocommit`` setting) on every run: on PATH, or installed by pyenv though not selected.
    Returns the interpreter itself (a pyenv shim resolved), or None when none is found."""
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    # 3.12.10 sorts after 3.12.9.
    numbers = lambda path: [int(n) for n in re.findall(r"\d+", path)]
    for minor in range(20, 11, -1) if sys.version_info < (3, 12) else ():
        installed = glob.glob(os.path.join(glob.escape(pyenv), "versions", f"3.{minor}.*", "bin",
                                           f"python3.{minor}"))
        tried = set()
        for found in [shutil.which(f"python3.{minor}"), *sorted(installed, key=numbers,
                                                                reverse=True)]:
            # One interpreter under two names: probed once.
            if not found or os.path.realpath(found) in tried:
                continue
            tried.add(os.path.realpath(found))
            probe = "import sqlite3, sys; sqlite3.Connection.autocommit; print(sys.executable)"
            done = subprocess.run([found, "-I", "-S", "-c", probe], capture_output=True,
                                  timeout=WATCHDOG)
            executable = done.stdout.decode("utf-8").strip()
            if done.returncode == 0 and os.path.isabs(executable):
                return executable
    return None


# --- the twins: the helpers both article test files keep, written twice so each runs alone

def twins(path, other):
    """{name: source} of each module-level definition in the file at ``path`` that the line
    directly above marks "# twin: identical in ``other``"; a marker anywhere else, or naming
    another file, fails."""
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    marker = f"# twin: identical in {other}"
    markers = [number for number, line in enumerate(lines, 1)
               if line.lstrip().startswith("# twin")]
    for number in markers:
        if lines[number - 1] != marker:
            raise AssertionError(f"{path}:{number}: {lines[number - 1]!r}, not {marker!r}")
    found, marked = {}, set()
    for name, (node, text) in article7.definitions(path).items():
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        if first - 1 in markers:
            found[name] = text
            marked.add(first - 1)
    if marked != set(markers):
        raise AssertionError(f"{path}:{sorted(set(markers) - marked)}: no definition directly"
                             " below")
    return found


# --- README.md: its blocks, its tables, its figures, its walk-throughs

def readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        return handle.read()


def readme_blocks(language):
    """The fenced code blocks of README.md in ``language`` (sh, sql, python), in order."""
    return re.findall(rf"^```{language}[^\n]*\n(.*?)^```", readme(), flags=re.S | re.M)


def cells(line):
    """A Markdown table row's cells, stripped."""
    return [cell.strip() for cell in line.strip("|").split("|")]


def readme_table(first):
    """The rows (lists of cells) of the README.md table from the line that starts with ``first``;
    where that line is a header, it and its --- line are left out."""
    lines = readme().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    if lines[start + 1:start + 2] and lines[start + 1].startswith("| ---"):
        start += 2
    return [cells(line) for line in itertools.takewhile(lambda line: line.startswith("|"),
                                                         lines[start:])]


def in_order(text, fragments):
    """The first of ``fragments`` that ``text`` does not hold after the one before it; None if
    none."""
    position = 0
    for fragment in fragments:
        found = text.find(fragment, position)
        if found < 0:
            return fragment
        position = found + len(fragment)
    return None


def holds_figures(cell, values):
    """A README cell gives ``values``: its numbers are exactly the ints, and the strings are in
    order."""
    numbers = [str(value) for value in values if isinstance(value, int)]
    strings = [value for value in values if isinstance(value, str)]
    return re.findall(r"\d+", cell) == numbers and in_order(cell, strings) is None


def walk_through(block, files, flags=()):
    """Run a README walk-through as printed: bash in a fresh folder holding a copy of ``files``
    (also its temporary folder), where ``python3`` is this interpreter (with ``flags``).
    Returns (exit code, its stdout and stderr interleaved as text, the first output its "# → "
    lines say the reader should see that did not come, in their order)."""
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as bin_dir:
        # It is TMPDIR too: the tests run in it become another user, who must pass through.
        os.chmod(folder, 0o755)
        for name in files:
            shutil.copyfile(os.path.join(ROOT, name), os.path.join(folder, name))
        wrapper = os.path.join(bin_dir, "python3")
        # -S: the download needs no site-packages, and a host's .pth hooks cost every command
        # time.
        with open(wrapper, "w", encoding="utf-8") as handle:
            python = " ".join(map(shlex.quote, [sys.executable, "-S", *flags]))
            handle.write(f'#!/bin/sh\nexec {python} "$@"\n')
        os.chmod(wrapper, 0o755)
        # TMPDIR: the block's `mktemp -d` folders land in ``folder``, which goes with it.
        env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
                   PYTHONDONTWRITEBYTECODE="1", TMPDIR=folder)
        done = subprocess.run(["bash"], input=block.encode("utf-8"), cwd=folder, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=WATCHDOG * 4)
    out = done.stdout.decode("utf-8")
    return done.returncode, out, in_order(out, [line[len("# → "):] for line in block.splitlines()
                                                 if line.startswith("# → ")])


# Keep last: classes defined below it would not run under `python3 beyond/test_companion.py`.
if __name__ == "__main__":
    unittest.main()
