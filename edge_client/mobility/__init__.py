"""Mobility: vehicle traces from Eclipse SUMO, and a simulator of the migration policy on them.

Modules: `traces` (the versioned trace format: sites, links, per-vehicle site sequences),
`handover` (positions -> serving site, with the hysteresis and time-to-trigger radio networks
use), `sumo` (the adapter that runs SUMO's binaries and reads their positions; the only module
that starts processes), `generate` (`offload trace generate`: network, trips, simulation,
sites, handovers), `cluster` (a synthetic cluster over a trace's sites from real topology
captures), `simulator` (replays a trace through the real placement and migration policy,
`offload simulate` and `python -m bench.mobility`).
"""
