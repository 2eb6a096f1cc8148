"""`meshshard simulate`, `calibrate` and `clusters` through cli.main."""

import json

import pytest

from meshshard.cli import load_cluster, main
from meshshard.cluster import ClusterSpec
from meshshard.sim.synthetic import synthetic_pipeline


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(synthetic_pipeline(2, 4, mesh_shape=(1, 8), activation_bytes=8 << 20).to_json())
    return str(path)


def test_simulate_prints_summary_and_writes_trace(plan_file, tmp_path, capsys):
    trace, out = tmp_path / "out.json", tmp_path / "result.json"
    rc = main(
        [
            "simulate",
            plan_file,
            "--cluster",
            "dgx-a100",
            "--hosts",
            "2",
            "--trace",
            str(trace),
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "simulated plan 'synthetic-1f1b' on dgx-a100 (2 hosts x 8 devices), overlap on" in text
    assert "iteration time" in text and f"trace written to {trace}" in text
    assert json.loads(trace.read_text())["traceEvents"]
    result = json.loads(out.read_text())
    assert result["cluster"]["name"] == "dgx-a100" and result["iteration_time"] > 0


def test_simulate_too_few_hosts_says_what_is_needed(plan_file, capsys):
    rc = main(["simulate", plan_file, "--cluster", "dgx-a100"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "uses 2 hosts" in err and "pass --hosts 2" in err


def test_simulate_options(plan_file, tmp_path, capsys):
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"s0.F": 0.01, "s1.F": 0.01, "s0.B": 0.02, "s1.B": 0.02}))
    rc = main(
        [
            "simulate",
            plan_file,
            "--cluster",
            "aws-p3.16xlarge",
            "--hosts",
            "2",
            "--no-overlap",
            "--program-times",
            str(times),
        ]
    )
    assert rc == 0
    assert "overlap off (blocking)" in capsys.readouterr().out


def test_simulate_unknown_cluster(plan_file, capsys):
    assert main(["simulate", plan_file, "--cluster", "tpu-v9"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_cluster_file_and_plan_default(plan_file, tmp_path, capsys):
    spec = ClusterSpec.preset("dgx-h100", num_hosts=3)
    path = tmp_path / "c.json"
    path.write_text(spec.to_json())
    assert load_cluster(str(path)) == spec
    assert load_cluster(str(path), num_hosts=5).num_hosts == 5
    assert main(["simulate", plan_file, "--cluster", str(path)]) == 0
    assert main(["simulate", plan_file]) == 0  # the plan's own cluster
    capsys.readouterr()


def test_clusters_lists_presets(capsys):
    assert main(["clusters"]) == 0
    out = capsys.readouterr().out
    for name in ("aws-p3.8xlarge", "aws-p3.16xlarge", "dgx-a100", "dgx-h100", "local"):
        assert name in out


@pytest.mark.slow  # measures this machine: minutes under load
def test_calibrate_quick_writes_a_loadable_spec(tmp_path, capsys):
    out = tmp_path / "local.json"
    rc = main(
        ["calibrate", "--out", str(out), "--quick", "--hosts", "2", "--devices-per-host", "2"]
    )
    assert rc == 0
    spec = ClusterSpec.load(str(out))
    assert (spec.name, spec.num_hosts, spec.devices_per_host) == ("local", 2, 2)
    assert spec.nic_bandwidth > 1e6 and spec.nic_latency > 0 and spec.flops_for("float32") > 1e6
    assert spec.oversubscription == 2.0
    assert "meshshard calibrate" in spec.source
    assert "written to" in capsys.readouterr().out
