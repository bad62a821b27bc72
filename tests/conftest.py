"""Suite-wide hooks: the two lanes of `make test`, and the summary of what the chaos and fuzz
suites tried.

**Lanes.** `make test` runs pytest with two xdist workers and `--dist loadgroup`.  Every test
is in the group `main`, which one worker runs in file order, as the suite runs alone, except
the tests of `SIDE`: they spend their time waiting in real time (a real engine's 60-s idle
timer, three minutes of recorded traffic, a browser watching a model go to sleep) and use
neither Docker (DGXMM's reconcile stops containers it does not know, so every Docker test
stays in one lane) nor vLLM (whose cold starts want both cores).  They run in the group
`side`, on the other worker, beside the main lane: the suite takes the longer lane's time,
not the sum.  Run alone (`pytest tests/test_x.py`, no `-n`), the groups do nothing.

**What was tried.** A worker's output does not reach the terminal, so a test reports the
lines of what it tried through the `tried` fixture; they are printed together at the end of
the run, under their test's name, also when every test passed.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

# The side lane's files (their Docker and vLLM tests stay in the main lane).
SIDE = (
    "tests/test_whatif_calibration.py",
    "tests/test_real_engine.py",
    "tests/test_browser.py",
    "tests/test_quickstart.py",
    "tests/test_demo.py",
)
_PROPERTY = "dgxmm-tried"
_TRIED: list[tuple[str, str]] = []  # (test, line), on the process that prints the summary


def _lane(item: pytest.Item) -> str:
    path = item.nodeid.split("::", 1)[0]
    if path not in SIDE or item.get_closest_marker("docker") or item.get_closest_marker("vllm"):
        return "main"
    return "side"


def pytest_configure(config: pytest.Config) -> None:
    # Also known without xdist (`-p no:xdist`), where the groups do nothing.
    config.addinivalue_line("markers", "xdist_group(name): the lane of a test (tests/conftest.py)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_lane(item)))


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
