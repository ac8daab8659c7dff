"""The transition model and the pre-warm verdict on hand-made sequences whose probabilities
are worked out by hand (prior 2: each context weighs 2 observations of the one before it)."""

from __future__ import annotations

import pytest

from migration.policy import Hysteresis, PrewarmSettings, prewarm_verdict
from migration.prediction import Prediction, TransitionModel


def drive(model: TransitionModel, client: str, *sites: str) -> None:
    for site in sites:
        model.observe(client, site)


def test_everyone_from_the_current_site() -> None:
    model = TransitionModel()
    drive(model, "a", "A", "B")
    drive(model, "b", "A", "C")
    drive(model, "c", "A", "B")
    model.observe("new", "A")
    assert model.distribution("new") == pytest.approx({"B": 2 / 3, "C": 1 / 3})
    assert model.predict("new") == Prediction("B", pytest.approx(2 / 3))
    assert sorted(model.transitions()) == [("A", "B", 2), ("A", "C", 1)]


def test_a_report_of_the_same_site_is_no_transition() -> None:
    model = TransitionModel()
    drive(model, "a", "A", "A", "A", "B", "B")
    assert list(model.transitions()) == [("A", "B", 1)]
    assert model.current("a") == "B"


def test_order_two_context_beats_order_one() -> None:
    # A line A - B - C driven both ways: from B, either neighbour is as likely, but coming
    # from A a vehicle goes on to C.
    model = TransitionModel()
    for i in range(3):
        drive(model, f"east{i}", "A", "B", "C")
        drive(model, f"west{i}", "C", "B", "A")
    drive(model, "x", "A", "B")
    # everyone from B: C 3, A 3 -> 1/2 each; everyone from (A, B): C 3 -> (3 + 2 * 1/2) / 5
    assert model.distribution("x") == pytest.approx({"C": 0.8, "A": 0.2})
    drive(model, "y", "C", "B")
    assert model.predict("y") == Prediction("A", pytest.approx(0.8))
    model.observe("z", "B")  # no previous site: the order-1 context alone, a tie
    assert model.predict("z") == Prediction("A", pytest.approx(0.5))  # ties: first by name


def test_the_clients_own_habits_beat_everyones() -> None:
    # Everyone goes on from (A, B) to C, but this client turns back to A there.
    model = TransitionModel()
    for i in range(4):
        drive(model, f"east{i}", "A", "B", "C")
    drive(model, "u", "A", "B", "A", "B", "A", "B")
    # everyone from B: C 4, A 2 -> 2/3, 1/3
    # the client from B: A 2 -> A (2 + 2/3) / 4 = 2/3, C (2 * 2/3) / 4 = 1/3
    # everyone from (A, B): C 4, A 2 -> A (2 + 2 * 2/3) / 8 = 5/12, C (4 + 2/3) / 8 = 7/12
    # the client from (A, B): A 2 -> A (2 + 2 * 5/12) / 4 = 17/24, C (2 * 7/12) / 4 = 7/24
    assert model.distribution("u") == pytest.approx({"A": 17 / 24, "C": 7 / 24})
    drive(model, "v", "A", "B")  # no habits of its own: everyone's (A, B) decides
    assert model.predict("v") == Prediction("C", pytest.approx(2 / 3))


def test_no_prediction_without_anyone_leaving_the_site() -> None:
    model = TransitionModel()
    assert model.predict("nobody") is None
    drive(model, "a", "A", "B")
    assert model.predict("a") is None  # nobody ever left B
    assert model.distribution("a") == {}


def test_forget_and_max_clients() -> None:
    model = TransitionModel(max_clients=2)
    drive(model, "a", "A", "B")
    model.observe("b", "A")
    model.observe("c", "A")  # a, the least recently seen, goes
    assert len(model) == 2 and model.current("a") is None
    model.observe("b", "A")  # b seen again: c is now the oldest
    model.observe("d", "A")
    assert (model.current("b"), model.current("c"), model.current("d")) == ("A", None, "A")
    assert model.predict("d") == Prediction("B", 1.0)  # everyone's counts stay
    model.forget("d")
    assert model.predict("d") is None and len(model) == 1
    model.forget("never-seen")
    with pytest.raises(ValueError):
        TransitionModel(prior=0)
    with pytest.raises(ValueError):
        TransitionModel(max_clients=0)


SETTINGS = PrewarmSettings(budget=5, min_probability=0.3, ttl_s=60)
HYSTERESIS = Hysteresis(min_gain_ms=2.0, min_gain_ratio=0.2, cooldown_s=30)


def test_prewarm_verdict_warms_a_likely_paying_move() -> None:
    # gain 5 ms passes max(2, 20 % of 10) ms; expected gain 0.4 x 5 = 2 ms reaches 2 ms
    verdict = prewarm_verdict(0.4, 10.0, 5.0, HYSTERESIS, SETTINGS)
    assert verdict.move, verdict.reason


@pytest.mark.parametrize(
    ("probability", "current_ms", "standby_ms", "why"),
    [
        (0.29, 10.0, 0.0, "pre-warm threshold"),  # too unlikely, however large the gain
        (1.0, 10.0, 8.5, "would not be made"),  # gain 1.5 ms under the 2 ms hysteresis
        (0.35, 10.0, 5.0, "expected gain"),  # 0.35 x 5 = 1.75 ms under 2 ms
    ],
)
def test_prewarm_verdict_refusals(
    probability: float, current_ms: float, standby_ms: float, why: str
) -> None:
    verdict = prewarm_verdict(probability, current_ms, standby_ms, HYSTERESIS, SETTINGS)
    assert not verdict.move
    assert why in verdict.reason


def test_prewarm_settings() -> None:
    assert not PrewarmSettings().enabled
    assert PrewarmSettings(budget=1).enabled
    for bad in ({"budget": -1}, {"min_probability": 0.0}, {"ttl_s": 0.0}):
        with pytest.raises(ValueError):
            PrewarmSettings(**bad)  # type: ignore[arg-type]
