"""Suite-wide set-up: tiny checkpoints are built once per test session into a private cache; xdist groups.

The groups (every test that starts vLLM in one, the others by module) keep the vLLM tests on one
worker under ``--dist loadgroup``. pytest-xdist sends a group to the scheduler as an ``@group`` suffix
of the test id; a pytest that ignores it (9.2, pytest-dev/pytest-xdist#1386) would spread the groups
silently, so the run stops with an error instead.
"""

from __future__ import annotations

import inspect
import os
import re
import time

# Inductor compiles its C++ kernels in the test process, not in a pool of compile workers that each
# import torch again (two per process that compiles, on 2 cores already busy with two test workers).
# Read when torch._inductor.config is first imported (by Lightning), hence before the imports below.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402

# The real-vLLM fixtures, registered here once for the whole suite: a session-scoped fixture
# imported into several test modules would be a separate fixture per module (one engine and one
# checkpoint each). Test modules import only the constants and markers of tests/vllm_fixtures.py.
from tests.vllm_fixtures import (  # noqa: F401
    SHARED_SETUP,
    VLLM_MISSING,
    stand_in,
    tiny_ckpt,
    trainer_model,
    vllm_engine,
    vllm_engine_holder,
    vllm_server,
    vllm_server_holder,
)

#: Fixtures that start (or hold) a vLLM engine or server.
_VLLM_FIXTURES = {"vllm_engine", "vllm_engine_holder", "vllm_server", "vllm_server_holder"}
_VLLM_NAME = re.compile(r"vllm|remote", re.IGNORECASE)
_VLLM_SERVER_TESTS = re.compile(r"^tests/test_(partial_remote|remote_pool|remote_vllm)\.py::")


def _uses_vllm(item: pytest.Item) -> bool:
    """Whether a test starts vLLM: it needs vLLM installed, holds an engine or server, or names it."""
    needs_vllm = any(m.kwargs.get("reason") == VLLM_MISSING for m in item.iter_markers("skipif"))
    return needs_vllm or bool(_VLLM_FIXTURES & set(item.fixturenames)) or bool(_VLLM_NAME.search(item.nodeid))


def _uses_server(item: pytest.Item) -> bool:
    """Whether a test runs on the session's shared vLLM server (by its fixtures, or its module's)."""
    fixtures = set(item.fixturenames)
    return bool({"vllm_server", "vllm_server_holder"} & fixtures) or _VLLM_SERVER_TESTS.search(item.nodeid) is not None


def _vllm_order(item: pytest.Item) -> tuple[bool, bool, bool]:
    """Shared engine (not closing it), shared engine then closing it, engines of their own, shared server."""
    fixtures = set(item.fixturenames)  # with the fixtures they need: every user of the engine has its holder
    asks_holder = "vllm_engine_holder" in inspect.signature(item.obj).parameters
    return _uses_server(item), "vllm_engine" not in fixtures, asks_holder


# tryfirst: the groups must be marked before pytest-xdist's own hook reads them into the test ids.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Under `-n N --dist loadgroup` (`make test`) a group is one worker's unit of work:
    # - every test that starts vLLM is in one group: two engines starting at once on 2 cores slow
    #   both by far more than running them in turn (and each holds its own KV cache), and the
    #   session's shared engine and server stay one copy; it is the longest unit, so it goes first;
    # - every other test is grouped by its module, so a module's fixtures are set up once, unless it
    #   names its own group (long tests of one module that share nothing and can run side by side).
    vllm = [item for item in items if _uses_vllm(item)]
    chosen = set(vllm)
    for item in items:
        if item in chosen:
            item.add_marker(pytest.mark.xdist_group("vllm"))
        elif item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    # The tests on the session's shared engine first, those that may close it (they hold its holder:
    # one engine at a time) after the others: each test on the shared engine after such a one would
    # start it again (~27 s of CPU over three processes). Those on the shared server last, in a row:
    # it stays up from the first of them to the end of the session (and tests that check no vLLM
    # process is left would see its processes). In one process as on the xdist workers, where this
    # order is the vLLM group's.
    vllm.sort(key=_vllm_order)
    # Then the groups with the most long tests: a worker takes the next group when it is free, so the
    # long ones go early and the short ones fill the end (not one long test on one worker while the
    # other has finished). pytest-xdist keeps this order (pytest_configure turns its reordering by
    # group size off). Tests that run in another target (soak, bench) do not count.
    others = [item for item in items if item not in chosen]
    group_of = {item: next(iter(item.iter_markers("xdist_group"))).args[0] for item in others}
    long_tests: dict[str, int] = {}
    for item in others:
        counted = item.get_closest_marker("long") is not None and not any(map(item.get_closest_marker, ELSEWHERE))
        long_tests[group_of[item]] = long_tests.get(group_of[item], 0) + counted
    others.sort(key=lambda item: -long_tests[group_of[item]])
    items[:] = vllm + others


def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    # On the xdist controller, with the test ids a worker collected.
    if node.config.getvalue("dist") != "loadgroup":
        return
    ungrouped = [nodeid for nodeid in ids if "@" not in nodeid.rpartition("]")[2]]
    if ungrouped:
        pytest.exit(
            f"--dist loadgroup: {len(ungrouped)} test ids lack their xdist group suffix (first: {ungrouped[0]}), "
            "so vLLM tests would run on several workers at once. This pytest / pytest-xdist pair does not "
            "support groups (pytest-dev/pytest-xdist#1386): install the versions the dev extra of pyproject.toml "
            "pins (`make venv-dev`), or run one process (`make test TEST_WORKERS=0`).",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


@pytest.fixture(scope="session", autouse=True)
def tiny_checkpoint_cache(tmp_path_factory, request):
    """Point ``tiny:<task>`` checkpoints at one cache for the session, shared by the xdist workers
    (builds are atomic and locked), and never the user's home."""
    if "LIGHTNING_OFFPOLICY_CACHE" in os.environ:
        yield os.environ["LIGHTNING_OFFPOLICY_CACHE"]
        return
    root = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):  # an xdist worker's basetemp is a folder of the run's one
        root = root.parent
    path = root / "tiny_cache"
    path.mkdir(exist_ok=True)
    os.environ["LIGHTNING_OFFPOLICY_CACHE"] = str(path)
    yield str(path)
    os.environ.pop("LIGHTNING_OFFPOLICY_CACHE", None)


@pytest.fixture(autouse=True)
def no_run_seed_from_an_earlier_test(monkeypatch):
    """Components without a seed of their own take the run's (``seed_everything``'s ``PL_GLOBAL_SEED``,
    lightning_offpolicy/seeding.py): a test that seeded the run must not seed the next one on its worker."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)


#: A test that takes longer (setup + call + teardown, on a 2-core machine) carries ``@pytest.mark.long(why)``.
#: The start of a module- or session-wide fixture, and of the shared vLLM engine and server, is not counted:
#: it is paid once, by whichever test of its users comes first.
LONG_S = 30.0
#: The suite's wall-time budget on the project's 2-core machine (README, "Two commands"), printed against.
BUDGET_S = 12 * 60.0
_unmarked_long: list[tuple[float, str]] = []
_file_seconds: dict[str, float] = {}  # every phase of every test of a file, shared starts included
_session_start = time.perf_counter()
_phase_seconds: dict[str, float] = {}  # a test's setup (+ call) so far
_running: list[pytest.Item] = []  # the test being set up, on this process


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    _running[:] = [item]
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    started = time.perf_counter()
    yield
    if fixturedef.scope in ("module", "package", "session") and _running:
        # Carried to the report (and to the xdist controller) with the test's user properties.
        _running[0].user_properties.append((SHARED_SETUP, time.perf_counter() - started))


#: Markers of the tests that run in another make target than `make test` (each says what it tests there).
ELSEWHERE = {
    "soak": "a test of the soak's tools or of a fault the soak runs at full length; `make soak` runs it first",
    "bench": "a test of a benchmark script at test size; `make bench` runs it first",
    "study": "a test of a study script (studies/) at test size; `make study` runs it first",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"long(why): a test over {LONG_S:.0f} s on 2 cores; `why` says what it proves that a shorter one cannot",
    )
    for name, where in ELSEWHERE.items():
        config.addinivalue_line("markers", f"{name}(what): {where}")
    # pytest-xdist would hand out the groups by their number of tests (the vLLM group first, then the
    # modules of many quick tests, the single long tests last); the order set at collection is better.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Runs on the xdist controller too, where a report carries its test's marker names in `keywords`.
    test_file = report.nodeid.split("::", 1)[0]
    _file_seconds[test_file] = _file_seconds.get(test_file, 0.0) + report.duration
    seconds = _phase_seconds.pop(report.nodeid, 0.0) + report.duration
    if report.when == "setup":
        seconds -= sum(value for name, value in report.user_properties if name == SHARED_SETUP)
    if report.when != "teardown":
        _phase_seconds[report.nodeid] = seconds
    elif seconds > LONG_S and "long" not in report.keywords:
        _unmarked_long.append((seconds, report.nodeid))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _file_seconds and not hasattr(config, "workerinput"):
        wall = time.perf_counter() - _session_start
        workers = getattr(config.option, "numprocesses", None) or 1
        verdict = "within" if wall <= BUDGET_S else "OVER"
        terminalreporter.section(
            f"suite {wall / 60:.1f} min of wall time: {verdict} its {BUDGET_S / 60:.0f} min budget "
            f"({workers} worker(s), load {os.getloadavg()[0]:.1f} at the end)"
        )
        terminalreporter.write_line("the files that cost most (test seconds, summed over their tests):")
        for test_file, seconds in sorted(_file_seconds.items(), key=lambda item: -item[1])[:12]:
            terminalreporter.write_line(f"{seconds:7.1f} s  {test_file}")
    if _unmarked_long:
        terminalreporter.section(f"tests over {LONG_S:.0f} s without @pytest.mark.long(why)")
        for seconds, nodeid in sorted(_unmarked_long, reverse=True):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
