"""The auto-planner (pure): stage cuts, submeshes, mesh axes + layout rules, microbatches, schedule.

Modules: `model` (the small interface a model offers the planner) and `adapter`
(today's ModelSpec → that interface), `topology` (link classes, α-β collectives,
device memory/speed from the cluster YAML), `profile` (per-layer figures from XLA's
compiled programs, via a subprocess and a JSON cache), `cost` (stage time and
memory from profiles), `search` (the DP and the simulator replay), `report`
(the candidates table, `--explain`, the winning job YAML).
"""
from orchestrator.core.planner.model import ParamInfo, PlanLayer, PlanModel
from orchestrator.core.planner.profile import LayerProfile, ProfileError, ProfileRequest, Profiler
from orchestrator.core.planner.search import Candidate, PlanningError, SearchOptions, SearchResult, search
from orchestrator.core.planner.topology import LinkClass, Topology, from_cluster

__all__ = ["ParamInfo", "PlanLayer", "PlanModel", "LayerProfile", "ProfileError", "ProfileRequest", "Profiler",
           "Candidate", "PlanningError", "SearchOptions", "SearchResult", "search", "LinkClass", "Topology",
           "from_cluster"]
