"""`dgxmm whatif` against two real boxes (3 minutes of the same Poisson traffic each):
with the recorded settings it reproduces the first, its cold starts and evictions among
them, and with make-room at once it predicts the second (`tests/whatif_calibration.py`;
docs/what-if.md has the figures)."""

from __future__ import annotations

import pytest

from tests.gateway_support import run
from tests.whatif_calibration import Comparison, calibrate


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Comparison, Comparison]:
    root = tmp_path_factory.mktemp("calibration")
    calibration, counterfactual = run(calibrate(root, 180.0, seed=1), timeout=1200)
    print("\n".join(calibration.rows() + counterfactual.rows()))
    return calibration, counterfactual


def test_whatif_with_the_recorded_settings_reproduces_the_real_box(
    compared: tuple[Comparison, Comparison],
) -> None:
    calibration, _ = compared
    recorded = calibration.recorded
    assert 0 < recorded.waited < recorded.requests  # not vacuous
    # The box made room several times: the replay's swaps are compared, not only its waits.
    assert recorded.cold_starts >= 3 and recorded.evictions >= 3
    # Every request has a fate on both sides, and they are compared (problems()).
    assert recorded.fates.total() == recorded.requests == calibration.simulated.fates.total()
    assert calibration.problems() == []


def test_whatif_predicts_the_box_that_made_room_at_once(
    compared: tuple[Comparison, Comparison],
) -> None:
    calibration, counterfactual = compared
    assert counterfactual.recorded.evictions > calibration.recorded.evictions
    assert counterfactual.simulated.fates.total() == counterfactual.simulated.requests
    assert counterfactual.problems() == []
