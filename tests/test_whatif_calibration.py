"""`dgxmm whatif` against two real boxes (3 minutes of the same Poisson traffic each):
with the recorded settings it reproduces the first, and with make-room at once it predicts
the second (`tests/whatif_calibration.py`; docs/what-if.md has the 20-minute table)."""

from __future__ import annotations

from pathlib import Path

from tests.gateway_support import run
from tests.whatif_calibration import calibrate


def test_whatif_reproduces_a_real_box_and_predicts_another_within_the_tolerances(
    tmp_path: Path,
) -> None:
    calibration, counterfactual = run(calibrate(tmp_path, 180.0, seed=1), timeout=1200)
    print("\n".join(calibration.rows() + counterfactual.rows()))
    # Some requests waited and some did not, in both boxes: the comparison is not vacuous.
    for c in (calibration, counterfactual):
        assert 0 < c.recorded.waited < c.recorded.requests
    assert counterfactual.recorded.evictions > calibration.recorded.evictions
    assert calibration.problems() == []
    assert counterfactual.problems() == []
