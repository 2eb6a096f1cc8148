"""ClusterSpec: defaults the compiler relies on, JSON round trips, presets, validation."""

import json
import re
from dataclasses import replace

import pytest

from meshshard.cluster import PRESETS, ClusterSpec, gbit


def test_defaults_and_str_unchanged():
    spec = ClusterSpec()
    assert (spec.name, spec.num_hosts, spec.devices_per_host) == ("local", 4, 2)
    assert spec.num_devices == 8
    assert str(spec) == "local (4 hosts x 2 devices)"
    assert ClusterSpec("x", 3, 4).num_devices == 12  # positional order of the first fields


def test_json_round_trip_and_hashable():
    for name in ClusterSpec.presets():
        spec = ClusterSpec.preset(name)
        assert ClusterSpec.from_dict(spec.to_dict()) == spec
        assert ClusterSpec.from_json(spec.to_json()) == spec
        json.dumps(spec.to_dict())
        hash(spec)


def test_old_dicts_take_defaults():
    spec = ClusterSpec.from_dict({"name": "old", "num_hosts": 2, "devices_per_host": 1})
    assert spec.nic_bandwidth == ClusterSpec().nic_bandwidth
    assert spec.nics_per_host == 1


def test_unknown_field_is_rejected():
    with pytest.raises(ValueError, match=r"unknown ClusterSpec field\(s\) \['nic_speed'\]"):
        ClusterSpec.from_dict({"nic_speed": 1})


def test_peak_flops_mapping_is_normalised():
    spec = ClusterSpec(peak_flops={"float32": 1e12, "bfloat16": 4e12})
    assert spec.peak_flops == (("float32", 1e12), ("bfloat16", 4e12))
    assert spec.flops_for("bfloat16") == 4e12
    assert spec.flops_for("int8") == 1e12  # falls back to float32


def test_presets_carry_their_published_figures():
    p38 = ClusterSpec.preset("aws-p3.8xlarge")
    assert (p38.devices_per_host, p38.nics_per_host, p38.nic_bandwidth) == (4, 1, 1.25e9)
    assert p38.flops_for("float32") == 15.7e12 and p38.flops_for("float16") == 125e12
    p316 = ClusterSpec.preset("aws-p3.16xlarge")
    assert (p316.devices_per_host, p316.nic_bandwidth) == (8, gbit(25))
    a100 = ClusterSpec.preset("dgx-a100")
    assert (a100.devices_per_host, a100.nics_per_host, a100.nic_bandwidth) == (8, 8, 25e9)
    assert a100.intra_fabric == "nvswitch" and a100.flops_for("bfloat16") == 312e12
    h100 = ClusterSpec.preset("dgx-h100")
    assert (h100.nics_per_host, h100.nic_bandwidth) == (8, 50e9)
    assert set(ClusterSpec.presets()) >= {
        "aws-p3.8xlarge",
        "aws-p3.16xlarge",
        "dgx-a100",
        "dgx-h100",
        "local",
    }
    for spec in PRESETS.values():
        assert spec.source


def test_preset_num_hosts_override():
    spec = ClusterSpec.preset("dgx-a100", num_hosts=4)
    assert spec.num_hosts == 4 and spec.num_devices == 32
    assert ClusterSpec.preset("dgx-a100").num_hosts == 1


def test_unknown_preset_names_the_choices():
    with pytest.raises(
        ValueError, match=r"unknown cluster preset 'tpu'; choose one of \[.*'dgx-a100'"
    ):
        ClusterSpec.preset("tpu")


def test_nic_sharing():
    p38 = ClusterSpec.preset("aws-p3.8xlarge")
    assert [p38.nic_of(d) for d in range(4)] == [0, 0, 0, 0]
    assert p38.devices_of_nic(0) == (0, 1, 2, 3)
    spread = ClusterSpec(devices_per_host=8, nics_per_host=4)
    assert [spread.nic_of(d) for d in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"num_hosts": 0}, r"ClusterSpec.num_hosts must be a positive int, got 0"),
        ({"nic_bandwidth": -1.0}, r"ClusterSpec.nic_bandwidth must be a positive number"),
        ({"nic_latency": -1e-6}, r"ClusterSpec.nic_latency must be a number of seconds >= 0"),
        ({"oversubscription": 0.5}, r"oversubscription must be >= 1"),
        (
            {"nic_of_device": (0, 1)},
            r"nic_of_device must give one NIC index in \[0, 1\) for each of the 2",
        ),
        ({"peak_flops": {}}, r"peak_flops must map dtypes to positive FLOP/s"),
        ({"max_mesh_hosts": -1}, r"ClusterSpec.max_mesh_hosts must be an int >= 0 \(0 = any\)"),
        (
            {"mesh_collective_latency": (1e-3,)},
            r"mesh_collective_latency must be \(\) or \(host axis, device axis\) numbers >= 0",
        ),
        (
            {"mesh_collective_bandwidth": (1e9, 0.0)},
            r"mesh_collective_bandwidth must be \(\) or \(host axis, device axis\) numbers > 0",
        ),
    ],
)
def test_validation_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ClusterSpec(**kwargs)


def test_describe_mentions_units():
    text = ClusterSpec.preset("aws-p3.8xlarge").describe()
    assert re.search(r"1 NIC\(s\) per host: 10 Gb/s each way, 30 us", text)
    assert "15.7 TFLOP/s" in text


def test_plan_round_trip_keeps_extended_cluster():
    from meshshard.plan import Plan
    from meshshard.sim.synthetic import synthetic_pipeline

    cluster = replace(ClusterSpec.preset("dgx-h100", num_hosts=2), name="h100x2")
    plan = synthetic_pipeline(2, 2, cluster=cluster)
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json(plan.to_json()).cluster.nic_bandwidth == 50e9


def test_mesh_collectives_default_to_the_fabrics_and_local_clusters_measure_them():
    """In-program collectives: the NICs and fabric unless given; the local clusters (and
    the ``local`` preset) carry this machine's measured figures, GPU presets do not."""
    from meshshard.cluster import LOCAL_MESH_COLLECTIVES
    from meshshard.runtime.cluster import ThreadsCluster

    p3 = ClusterSpec.preset("aws-p3.16xlarge")
    host_bw = p3.nic_bandwidth * p3.nics_per_host / p3.oversubscription
    assert p3.mesh_collective() == (
        (p3.nic_latency, host_bw),
        (p3.intra_latency, p3.intra_bandwidth),
    )
    local = ClusterSpec.preset("local")
    (ha, hb), (da, db) = local.mesh_collective()
    assert (ha, da) == LOCAL_MESH_COLLECTIVES["mesh_collective_latency"]
    assert (hb, db) == LOCAL_MESH_COLLECTIVES["mesh_collective_bandwidth"]
    assert ha > 5 * local.nic_latency  # gloo between JAX processes: far above a message
    assert ThreadsCluster(2, 4).spec.mesh_collective() == local.mesh_collective()
    assert ClusterSpec.from_json(local.to_json()) == local


def test_threads_clusters_search_single_host_submeshes():
    """The in-process backend runs one host's meshes only: its clusters say so, and the
    automatic stage search offers it no multi-host submesh."""
    from meshshard.passes.meshes import submesh_choices
    from meshshard.runtime.cluster import ThreadsCluster

    spec = ThreadsCluster(4, 2).spec
    assert spec.max_mesh_hosts == 1
    assert submesh_choices(spec) == ((1, 1), (1, 2))
    assert submesh_choices(replace(spec, max_mesh_hosts=0)) == (
        (1, 1),
        (1, 2),
        (2, 2),
        (3, 2),
        (4, 2),
    )
