"""`dgxmm whatif` against three real boxes (3 minutes of traffic each): with the recorded
settings it reproduces the first, its cold starts and evictions among them; with make-room
at once it predicts the second; and on the third, under `ondemand_policy = "learned"`, it
reproduces the pre-warms of a periodically used model beside two irregular ones
(`tests/whatif_calibration.py`; docs/what-if.md has the figures)."""

from __future__ import annotations

import pytest

from tests.gateway_support import run
from tests.whatif_calibration import (
    JOB_PERIOD_S,
    JOB_PHASE_S,
    JOB_SESSION,
    Comparison,
    calibrate,
    prewarms_apart,
)

SECONDS = 180.0


@pytest.fixture(scope="module")
def compared(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Comparison, Comparison, Comparison]:
    root = tmp_path_factory.mktemp("calibration")
    calibration, counterfactual, learned = run(calibrate(root, SECONDS, seed=1), timeout=1200)
    print("\n".join(calibration.rows() + counterfactual.rows() + learned.rows()))
    return calibration, counterfactual, learned


def test_whatif_with_the_recorded_settings_reproduces_the_real_box(
    compared: tuple[Comparison, Comparison, Comparison],
) -> None:
    calibration, _, _ = compared
    recorded = calibration.recorded
    assert 0 < recorded.waited < recorded.requests  # not vacuous
    # The box made room several times: the replay's swaps are compared, not only its waits.
    assert recorded.cold_starts >= 3 and recorded.evictions >= 3
    # Every request has a fate on both sides, and they are compared (problems()).
    assert recorded.fates.total() == recorded.requests == calibration.simulated.fates.total()
    assert calibration.problems() == []


def test_whatif_predicts_the_box_that_made_room_at_once(
    compared: tuple[Comparison, Comparison, Comparison],
) -> None:
    _, counterfactual, _ = compared
    calibration = compared[0]
    assert counterfactual.recorded.evictions > calibration.recorded.evictions
    assert counterfactual.simulated.fates.total() == counterfactual.simulated.requests
    assert counterfactual.problems() == []


def test_whatif_of_the_learned_policy_reproduces_its_pre_warms_cold_starts_and_waits(
    compared: tuple[Comparison, Comparison, Comparison],
) -> None:
    _, _, learned = compared
    assert learned.prewarms is not None and learned.job_waited is not None
    done, _ = learned.prewarms
    # Not vacuous: the real box pre-warmed the job for each of its sessions in the window
    # but perhaps the last (due within its lead of the end), the job's requests found it
    # warm, and the irregular models were never pre-warmed; the others still cold-started.
    sessions = int((SECONDS - JOB_PHASE_S) // JOB_PERIOD_S) + 1
    assert done.get("job", 0) >= sessions - 1, done
    assert set(done) == {"job"}, done
    assert learned.job_waited[0] <= len(JOB_SESSION), learned.job_waited
    assert learned.recorded.cold_starts >= 2
    assert learned.recorded.fates.total() == learned.recorded.requests
    assert learned.problems() == []


def test_whatif_begins_the_learned_policys_pre_warms_when_the_box_did(
    compared: tuple[Comparison, Comparison, Comparison],
) -> None:
    """Each of the box's pre-warms begins within `PREWARM_TIME_S` of the what-if's nearest
    (`prewarms_apart`).  The first after the box's restart is the test: the box had never
    timed the job's start (its only start before the window was cut short by the stop) and
    led by its default (`DEFAULT_START_S`); the what-if's box, which times its own warm-up
    start, must lead as the recorded box did (`StartHistory.reset` in `whatif_run._seed`),
    not by ~3.4 s."""
    _, _, learned = compared
    assert learned.prewarm_times is not None
    assert learned.prewarm_timing() == []


def test_each_pre_warm_is_paired_with_the_predictions_nearest() -> None:
    """An extra pre-warm on either side (the counts allow one) shifts no other pair; one
    begun too early or too late is named (the 20-minute run's figures, docs/what-if.md)."""
    box = [20.7, 120.8, 332.3, 754.6, 822.5, 961.4, 1102.0, 1168.1]
    whatif = [20.7, 119.8, 332.3, 750.8, 822.3, 960.9, 1029.5, 1102.0, 1172.0]
    assert prewarms_apart({"job": box}, {"job": whatif}, 2.0) == [
        "pre-warm 4 of job at 750.8 s vs 754.6 s",
        "pre-warm 8 of job at 1172.0 s vs 1168.1 s",
    ]
    assert prewarms_apart({"job": box}, {"job": whatif}, 4.0) == []
    assert prewarms_apart({"job": whatif}, {"job": box}, 4.0) == []  # the extra is the box's
    first_late = {"job": [50.0, *box[1:]]}
    assert prewarms_apart({"job": box}, first_late, 4.0) == [
        "pre-warm 1 of job at 50.0 s vs 20.7 s"
    ]
    assert prewarms_apart({"job": box}, {"chat": box}, 0.0) == []  # only a model's own
