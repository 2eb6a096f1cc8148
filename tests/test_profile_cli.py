"""`meshshard profile STEP_SCRIPT`: programs timed on their meshes into the profile cache
that ``step.lower(..., profile=True)`` reads (threads backend, tiny MLP)."""

import json
import os

import pytest

import meshshard
from examples import mlp
from meshshard.cli import main
from meshshard.profiling import profile_key

METHOD = dict(num_micro_batches=2, stages=[(1, 2), (1, 2)], schedule="1f1b")
SCRIPT = (
    "import meshshard\nfrom examples import mlp\n"
    "def setup():\n"
    "    model = mlp.MLP(num_layers=2, hidden=32)\n"
    "    batch = mlp.make_batch(batch_size=8)\n"
    "    state = mlp.make_state(model, batch['x'])\n"
    f"    method = meshshard.PipeshardParallel(**{METHOD!r})\n"
    "    return meshshard.parallelize(mlp.train_step, method=method), (state, batch)\n"
)


@pytest.mark.slow
def test_profile_cli_fills_the_cache_lower_profile_reads(
    threads_cluster, tmp_path, capsys, monkeypatch
):
    script, out, cache = tmp_path / "step.py", tmp_path / "times.json", tmp_path / "cache"
    script.write_text(SCRIPT)
    argv = ["profile", str(script), "--steps", "2", "--cache-dir", str(cache), "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    times = json.loads(out.read_text())
    assert "measured; cache" in text and "s0.F" in text
    # the same step, parallelized anew: lower(profile=True) reads the CLI's figures
    # (a second measurement would not equal them to the last bit)
    monkeypatch.setenv("MESHSHARD_PROFILE_CACHE", str(cache))
    model = mlp.MLP(num_layers=2, hidden=32)
    batch = mlp.make_batch(batch_size=8)
    step = meshshard.parallelize(mlp.train_step, method=meshshard.PipeshardParallel(**METHOD))
    plan = step.lower(mlp.make_state(model, batch["x"]), batch, profile=True, costs=False)
    assert step.program_times == times
    assert sorted(times) == sorted(str(p.name) for p in plan.programs_run())
    assert all(t > 0 for t in times.values())
    assert sorted(p.stem for p in cache.iterdir()) == sorted(
        profile_key(plan, name, plan.cluster.host_cores) for name in times
    )
    # the threads' workers share this machine's cores: the times have that sharing
    # removed, for a simulation that models it (ClusterSpec.host_cores)
    assert plan.cluster.host_cores == (os.cpu_count() or 1)


def test_profile_cli_names_a_script_without_setup(tmp_path, capsys):
    script = tmp_path / "empty.py"
    script.write_text("x = 1\n")
    assert main(["profile", str(script), "--backend", "threads"]) == 2
    assert "defines no setup(); define setup() returning" in capsys.readouterr().err
