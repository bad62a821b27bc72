"""Suite-wide hooks: the two lanes of `make test`, and the summary of what the chaos and fuzz
suites tried.

**Lanes.** `make test` (`scripts/test-lanes`) runs two pytest processes at once:
`--lane side` runs the tests of `SIDE`, which spend their time waiting in real time (a real
engine's 60-s idle timer, three minutes of recorded traffic, a browser watching a model go
to sleep) and use neither Docker (DGXMM's reconcile stops containers it does not know, so
every Docker test stays in one lane) nor vLLM (whose cold starts want both cores);
`--lane main` runs all the others, in file order, as the suite runs alone.  The suite then
takes the longer lane's time, not the sum.  Without `--lane`, pytest runs every test.

**What was tried.** A test reports the lines of what it tried through the `tried` fixture;
they are printed together at the end of the run, under their test's name, also when every
test passed (its own output is captured).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

# The side lane's files (their Docker and vLLM tests stay in the main lane).
SIDE = (
    "tests/test_whatif_calibration.py",
    "tests/test_real_engine.py",
    "tests/test_keepalive_real.py",
    "tests/test_prewarm_real.py",
    "tests/test_browser.py",
    "tests/test_browser_anticipation.py",
    "tests/test_browser_dashboard.py",
    "tests/test_browser_timeline.py",
    "tests/test_browser_tune.py",
    "tests/test_quickstart.py",
    "tests/test_demo.py",
    "tests/test_shutdown_signals.py",
    "tests/test_cli_resolution.py",
)
_PROPERTY = "dgxmm-tried"
_TRIED: list[tuple[str, str]] = []  # (test, line)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--lane",
        choices=("all", "main", "side"),
        default="all",
        help="run one lane of `make test` (tests/conftest.py); default all",
    )


def lane_of(item: pytest.Item) -> str:
    """`side` for a test of `SIDE` that uses neither Docker nor vLLM, else `main`."""
    path = item.nodeid.split("::", 1)[0]
    if path not in SIDE or item.get_closest_marker("docker") or item.get_closest_marker("vllm"):
        return "main"
    return "side"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    lane = config.getoption("lane")
    if lane == "all":
        return
    keep = [item for item in items if lane_of(item) == lane]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if lane_of(item) != lane])
        items[:] = keep


@pytest.fixture
def tried(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """`tried(line)`: a line for the end-of-run summary of what this test tried."""

    def say(line: str) -> None:
        request.node.user_properties.append((_PROPERTY, line))

    return say


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":  # the last report of a test carries all of its lines
        _TRIED.extend(
            (report.nodeid, str(value)) for key, value in report.user_properties if key == _PROPERTY
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _TRIED:
        return
    terminalreporter.section("what the chaos and fuzz suites tried")
    last = None
    for test, line in _TRIED:
        if test != last:
            terminalreporter.write_line(test)
            last = test
        terminalreporter.write_line(f"  {line}")
