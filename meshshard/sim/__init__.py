"""Predict a plan's timeline on a described cluster: ``simulate(plan, cluster) -> SimResult``.

The simulator runs the same per-worker instruction streams the runtime executes, on
a model of the cluster (:class:`meshshard.cluster.ClusterSpec`): programs cost their
measured or roofline time, every transfer is a flow sharing links max-min fairly,
collectives decompose into the flows of their real algorithms.  One module per job:

- ``topology``: links of a cluster and message paths;
- ``network``: the flow model and its max-min solver;
- ``collectives``: broadcast/all-reduce/... as DAGs of flows;
- ``costs``: program run times;
- ``engine``: the discrete-event executor of the streams;
- ``memory``: live ranges and peak memory per device;
- ``result`` / ``trace``: the summary table and the Chrome trace;
- ``synthetic``: pipeline plans built without a compiler, for tests and benchmarks;
- ``calibrate``: measure this machine into a ``local`` ClusterSpec.
"""

from meshshard.sim.engine import SimOptions, SimulationDeadlock, check_fits
from meshshard.sim.result import LinkStats, MemoryStats, SimResult, WorkerStats
from meshshard.sim.simulator import simulate
from meshshard.sim.synthetic import synthetic_pipeline

__all__ = [
    "simulate",
    "SimOptions",
    "SimResult",
    "SimulationDeadlock",
    "WorkerStats",
    "LinkStats",
    "MemoryStats",
    "check_fits",
    "synthetic_pipeline",
]
