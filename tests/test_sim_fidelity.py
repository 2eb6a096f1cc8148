"""The simulator's host model (issue 10): shared CPU cores, runtime and driver overheads."""

from dataclasses import replace

import pytest

from meshshard.cluster import ClusterSpec
from meshshard.sim import simulate
from meshshard.sim.synthetic import synthetic_pipeline

TIMES = {"s0.F": 1.0, "s1.F": 1.0, "s0.B": 2.0, "s1.B": 2.0}


def _plan(mesh_shape=(1, 1)):
    return synthetic_pipeline(2, 4, schedule="1f1b", mesh_shape=mesh_shape)


def _iteration(plan, **fields):
    cluster = replace(plan.cluster, **fields)
    return simulate(plan, cluster, program_times=TIMES).iteration_time


def test_programs_sharing_one_core_take_their_summed_work():
    plan = _plan()
    free = _iteration(plan)
    assert free == pytest.approx(15.0, abs=0.01)  # (M + S - 1) * (F + B)
    # one core: both stages' 4 x (1 + 2) s of work run one after the other, at best
    shared = _iteration(plan, host_cores=1)
    assert 24.0 <= shared <= 24.0 + 0.01 + (free - 15.0)
    assert _iteration(plan, host_cores=2) == pytest.approx(free)  # enough cores: no effect


def test_a_program_demands_one_core_per_device_of_its_mesh():
    plan = _plan(mesh_shape=(1, 2))
    # each stage keeps 2 cores busy: on 2 cores the stages share as on 1 core above
    assert _iteration(plan, host_cores=2) >= 24.0
    assert _iteration(plan, host_cores=4) == pytest.approx(_iteration(plan), rel=1e-9)


def test_runtime_and_driver_overheads_add_host_time():
    plan = _plan()
    base = _iteration(plan)
    assert _iteration(plan, dispatch_overhead=0.5) == pytest.approx(base + 0.5)
    per_ins = _iteration(plan, instruction_overhead=0.01)
    assert base + 0.01 < per_ins < base + 0.01 * sum(len(s.instructions) for s in plan.streams)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("host_cores", -1, r"host_cores must be an int >= 0.*host_cores=os.cpu_count\(\)"),
        ("instruction_overhead", -1e-6, r"instruction_overhead must be a number of seconds"),
        ("dispatch_overhead", "1ms", r"dispatch_overhead must be a number of seconds"),
    ],
)
def test_host_fields_are_checked(field, value, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec(**{field: value})
