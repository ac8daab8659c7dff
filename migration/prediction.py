"""Where a client goes next: a Markov model of its site transitions.

Pure and synchronous; the broker (`broker.prewarm`) and the policy simulator
(`edge_client.mobility.simulator`) feed it the same way: `observe(client, site)` at each
report of a site, then `predict(client)` for the distribution of its next site.

Four contexts, from the most general to the most specific, each smoothed towards the one
before it (hierarchical additive smoothing, `prior` pseudo-observations):

1. everyone, from the current site;
2. this client, from the current site;
3. everyone, from the previous and the current site (the direction of travel: a vehicle
   mostly goes on rather than back);
4. this client, from the previous and the current site (its own routes: a commute).

p_k(next) = (n_k(next) + prior * p_{k-1}(next)) / (N_k + prior), with p_1 = n_1 / N_1. A client
whose current site nobody ever left has no prediction. A report of the site the client is at
already is no transition.

Memory: the global tables grow with the distinct transitions of the network (sites x
neighbours); a client's with its own. Past `max_clients` the least recently seen client
goes (the broker keeps a client's history while it has none: it may deploy again);
`forget` drops one (the simulator's vehicles that left).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

Counts = dict[str, int]
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Prediction:
    site: str
    probability: float


@dataclass(slots=True)
class _Client:
    previous: str | None = None
    current: str | None = None
    by_site: dict[str, Counts] = field(default_factory=dict)
    by_pair: dict[tuple[str, str], Counts] = field(default_factory=dict)


class TransitionModel:
    def __init__(self, prior: float = 2.0, max_clients: int = 100_000) -> None:
        if not math.isfinite(prior) or prior <= 0 or max_clients < 1:
            raise ValueError("prior must be a positive number and max_clients at least 1")
        self.prior = prior
        self.max_clients = max_clients
        self._by_site: dict[str, Counts] = {}
        self._by_pair: dict[tuple[str, str], Counts] = {}
        self._clients: OrderedDict[str, _Client] = OrderedDict()

    def __len__(self) -> int:
        """Clients known."""
        return len(self._clients)

    def observe(self, client: str, site: str) -> None:
        """`client` reports `site`: a transition when it was elsewhere."""
        state = self._clients.get(client)
        if state is None:
            state = self._clients[client] = _Client()
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client)
        current = state.current
        if current == site:
            return
        if current is not None:
            _count(self._by_site, current, site)
            _count(state.by_site, current, site)
            if state.previous is not None:
                pair = (state.previous, current)
                _count(self._by_pair, pair, site)
                _count(state.by_pair, pair, site)
        state.previous, state.current = current, site

    def current(self, client: str) -> str | None:
        """The last site `client` reported; None for a client not known."""
        state = self._clients.get(client)
        return None if state is None else state.current

    def forget(self, client: str) -> None:
        self._clients.pop(client, None)

    def distribution(self, client: str) -> dict[str, float]:
        """P(next site) for `client` from where it is; {} when nothing is known of anyone
        leaving its current site (or of the client)."""
        state = self._clients.get(client)
        if state is None or state.current is None:
            return {}
        current = state.current
        pair = None if state.previous is None else (state.previous, current)
        levels = [self._by_site.get(current), state.by_site.get(current)]
        if pair is not None:
            levels += [self._by_pair.get(pair), state.by_pair.get(pair)]
        base = levels[0]
        if not base:
            return {}
        total = sum(base.values())
        p = {site: n / total for site, n in base.items()}
        for counts in levels[1:]:
            if not counts:
                continue
            n_total = sum(counts.values())
            p = {
                site: (counts.get(site, 0) + self.prior * p.get(site, 0.0))
                / (n_total + self.prior)
                for site in p.keys() | counts.keys()
            }
        return p

    def predict(self, client: str) -> Prediction | None:
        """The most likely next site (ties: the first by name); None when nothing is known."""
        p = self.distribution(client)
        if not p:
            return None
        site = min(p, key=lambda s: (-p[s], s))
        return Prediction(site, p[site])

    def transitions(self) -> Iterator[tuple[str, str, int]]:
        """Every (from, to, count) seen from everyone, for operators."""
        for current, counts in self._by_site.items():
            for site, n in counts.items():
                yield current, site, n


def _count(table: dict[K, Counts], key: K, site: str) -> None:
    counts = table.setdefault(key, {})
    counts[site] = counts.get(site, 0) + 1
