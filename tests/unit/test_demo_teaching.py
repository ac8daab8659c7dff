"""The demo's teaching step under --prewarm: the trace's other vehicles reported as clients
of their own, so the broker's model learns their handovers and not the joins between them."""

from __future__ import annotations

from edge_client.demo.run import (
    MAX_TEACHING_VEHICLES,
    TRAFFIC_CLIENT,
    teaching_reports,
    traffic_clients,
)
from edge_client.demo.trace import Trace, Waypoint
from migration.prediction import TransitionModel

# Every vehicle ends where the next one does not start: reported back to back by one client,
# b -> c and b -> a would be learned, though no vehicle ever leaves b.
OTHERS = (("a", "b"), ("c", "b"), ("a", "c"))
TRACE = Trace("city/veh9", (Waypoint("a", 1.0),), OTHERS)


def learned(reports: list[tuple[str, str]]) -> TransitionModel:
    """The broker's model (`broker.prewarm` observes each ReportLocation so)."""
    model = TransitionModel()
    for client, site in reports:
        model.observe(client, site)
    return model


def leaving(model: TransitionModel, site: str) -> dict[str, float]:
    model.observe("probe", site)
    return model.distribution("probe")


def test_each_vehicle_is_a_client_of_its_own() -> None:
    clients = traffic_clients(TRACE)
    assert clients == (f"{TRAFFIC_CLIENT}-0", f"{TRAFFIC_CLIENT}-1", f"{TRAFFIC_CLIENT}-2")
    reports = teaching_reports(TRACE, clients)
    assert reports == [
        (clients[0], "a"), (clients[0], "b"),
        (clients[1], "c"), (clients[1], "b"),
        (clients[2], "a"), (clients[2], "c"),
    ]  # fmt: skip
    model = learned(reports)
    assert leaving(model, "b") == {}  # no vehicle leaves b: no join learned
    assert leaving(model, "a") == {"b": 0.5, "c": 0.5}
    assert leaving(model, "c") == {"b": 1.0}


def test_one_client_back_to_back_would_learn_the_joins() -> None:
    """What the step did before: the check above tells the two apart."""
    model = learned([("traffic", site) for sites in OTHERS for site in sites])
    assert leaving(model, "b") == {"c": 0.5, "a": 0.5}


def test_the_step_teaches_with_the_first_vehicles_up_to_the_cap() -> None:
    many = Trace("city/veh0", (Waypoint("a", 1.0),), (("a", "b"),) * (MAX_TEACHING_VEHICLES + 6))
    clients = traffic_clients(many)
    assert len(clients) == len(set(clients)) == MAX_TEACHING_VEHICLES
    reports = teaching_reports(many, clients)
    assert len(reports) == 2 * MAX_TEACHING_VEHICLES
    assert leaving(learned(reports), "b") == {}
    assert traffic_clients(Trace("alone", (Waypoint("a", 1.0),))) == ()
