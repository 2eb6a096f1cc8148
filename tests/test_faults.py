"""Worker death, restarts and cluster lifecycle: nothing is lost silently, errors say why.

The threads tests check the driver-side rules fast; the Ray tests run
``benchmarks/faults.py`` (which kills its own host-actors' processes and asserts parity
with ``jax.jit`` after recovery) on the local cluster and on a two-node
``ray.cluster_utils.Cluster``, each in its own process.
"""

import json
import logging
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import meshshard
from examples import mlp
from meshshard import MeshshardRuntimeError
from meshshard.runtime import cluster as cluster_mod
from meshshard.runtime.executable import RemoteArray
from meshshard.runtime.faults import Failure, WorkerFault, death_cause
from tests.conftest import assert_trees_close

ROOT = pathlib.Path(__file__).resolve().parent.parent
PIPELINE = meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])


def test_failure_names_hosts_causes_and_blocked_peers():
    f = Failure("step of plan ab12", ((1, "process 42: The actor died"),), (), (0, 2), 0.25)
    assert str(f) == (
        "step of plan ab12 failed after 0.2s:\n"
        "  host-actor w1 died: process 42: The actor died\n"
        "  w0, w2 did not finish (blocked waiting on a failed peer)"
    )
    assert str(WorkerFault(f, "Call meshshard.recover().")).endswith("Call meshshard.recover().")


def test_death_cause_keeps_first_sentence_and_pid():
    text = (
        "ActorDiedError: The actor died unexpectedly before finishing this task.\n"
        "\tclass_name: HostActor\n\tactor_id: f1a2\n\tpid: 18626\n\tnamespace: x"
    )
    assert death_cause(Exception(text)) == (
        "process 18626: The actor died unexpectedly before finishing this task"
    )


@pytest.fixture
def fresh_threads():
    """A threads cluster made current with meshshard.init (not the session's Ray one)."""
    with cluster_mod.use_cluster(None):
        cluster = meshshard.init(backend="threads")
        yield cluster
        meshshard.shutdown()


def test_init_reuses_a_matching_cluster_and_refuses_another(fresh_threads):
    assert meshshard.init() is fresh_threads
    assert meshshard.init(backend="threads", num_hosts=4) is fresh_threads
    with pytest.raises(
        MeshshardRuntimeError,
        match=r"init\(num_hosts=2 \(running: 4\)\): a different meshshard cluster "
        r"\(threads-4x2\) is running; call meshshard.shutdown\(\) first",
    ):
        meshshard.init(backend="threads", num_hosts=2)


@pytest.mark.slow
def test_steps_and_arrays_after_shutdown_fail_clearly(fresh_threads, caplog):
    batch = mlp.make_batch(8)
    state = mlp.make_state(mlp.MLP(num_layers=2), batch["x"])
    step = meshshard.parallelize(mlp.train_step, method=PIPELINE)
    with caplog.at_level(logging.INFO, logger="meshshard"):
        new_state, _ = step(state, batch)
    assert [(r.name, r.levelname) for r in caplog.records] == [("meshshard.api", "INFO")]
    assert re.match(
        r"compiled train_step for threads-4x2 in [\d.]+s \(2 stages, 2 workers\)",
        caplog.records[0].getMessage(),
    )
    kernel = new_state.params["dense1"]["kernel"]
    assert isinstance(kernel, RemoteArray)
    host_copy = meshshard.fetch(new_state)
    exe = step.executable
    meshshard.shutdown()
    with pytest.raises(MeshshardRuntimeError, match=r"lived on a meshshard cluster that was shut"):
        np.asarray(kernel)
    with pytest.raises(MeshshardRuntimeError, match=r"compiled for a meshshard cluster that was"):
        exe(new_state, batch)
    meshshard.init(backend="threads")  # the same step object recompiles on the new cluster
    got, loss = step(host_copy, batch)
    ref_step = jax.jit(mlp.train_step)
    ref, ref_loss = ref_step(ref_step(state, batch)[0], batch)
    assert_trees_close(ref.params, got.params)
    assert_trees_close(ref_loss, loss)


class _Backend:
    """Two workers' stores; ``dead`` workers raise like an actor that died."""

    cluster = None

    def __init__(self, stores, dead=()):
        self.stores, self.dead = stores, set(dead)

    def fetch(self, worker, key):
        if worker in self.dead:
            raise MeshshardRuntimeError(f"w{worker} died")
        return self.stores[worker][key]


class _Owner:
    def __init__(self, backend):
        self.backend = backend
        self.freed = []

    def drop_keys(self, keys):
        self.freed.extend(keys.items())


def test_evacuate_copies_from_survivors_and_marks_lost_arrays():
    halves = {0: {7: [(((0, 2), (0, 3)), np.ones((2, 3)))]}}
    halves[1] = {7: [(((2, 4), (0, 3)), np.full((2, 3), 2.0))]}
    replicated = {0: {8: [(((0, 2),), np.arange(2.0))]}, 1: {8: [(((0, 2),), np.arange(2.0))]}}
    backend = _Backend({w: {**halves[w], **replicated[w]} for w in (0, 1)}, dead={1})
    owner = _Owner(backend)
    split = RemoteArray(owner, {0: 7, 1: 7}, (4, 3), np.float64)
    copy = RemoteArray(owner, {0: 8, 1: 8}, (2,), np.float64)
    assert copy.evacuate(hosts=[1], dead={1}) and copy.keys == {0: 8}
    np.testing.assert_array_equal(np.asarray(copy), np.arange(2.0))
    assert not split.evacuate(hosts=[1], dead={1})
    with pytest.raises(MeshshardRuntimeError, match=r"is lost: it was kept only on host-actors"):
        np.asarray(split)


@pytest.mark.ray
@pytest.mark.own_cluster
@pytest.mark.parametrize(
    "kind, cases",
    [("local", "layout,between,compile"), ("multinode", "step")],
)
def test_fault_matrix(tmp_path, kind, cases):
    """Kill host-actors between steps, during a step and during compile; a DataParallel
    eval between pipeline steps regroups the hosts.  Every case raises an error naming
    the host and ``meshshard.recover()`` within seconds, keeps the survivors' arrays,
    and trains equal to jax.jit after recovery (the script asserts parity itself).
    Each case runs once, on one of the two clusters (the benchmark runs all four on each)."""
    out = tmp_path / "faults.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "faults.py"),
            "--cluster",
            kind,
            "--cases",
            cases,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert "FAULTS OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    if "layout" in cases:
        kept, total = rows["eval with another layout"]["state_kept"].split()[0].split("/")
        assert kept == total, rows  # every leaf moved and still equal to jax.jit
    kills = ("kill w1 between steps", "kill w1 during a step", "kill w0 during compile")
    assert len(rows) == len(cases.split(","))
    for case in (c for c in kills if c in rows):
        r = rows[case]
        assert r["detect_s"] < 10 and r["after_recovery_equals_jit"], r
        assert "died" in r["error"], r
        kept, total = map(int, r["state_kept"].split()[0].split("/"))
        assert 0 < kept < total, r  # the survivor's leaves stay; the dead host's are lost
    assert "[Gloo]" not in proc.stdout + proc.stderr  # quiet unless MESHSHARD_VERBOSE=1
    assert "Token authentication" not in proc.stderr
    assert "restarting host-actors" in proc.stderr  # meshshard's own warnings do show


def test_refs_pickled_to_another_process_still_key_dicts(tmp_path):
    """Plans and step requests cross to the host-actors pickled; a reference's cached
    hash must be the receiving process's (str hashes differ per process)."""
    code = (
        "import pickle, sys; from meshshard.refs import BufferRef, BufferKind, ProgramRef, "
        "Phase, TransferRef\n"
        "refs = [BufferRef(BufferKind.APPLY_OUTPUTS, 0), ProgramRef(Phase.APPLY, 1), "
        "TransferRef(2)]\n"
        "if sys.argv[1] == 'dump':\n"
        "    open(sys.argv[2], 'wb').write(pickle.dumps({r: i for i, r in enumerate(refs)}))\n"
        "else:\n"
        "    d = pickle.loads(open(sys.argv[2], 'rb').read())\n"
        "    print([d[r] for r in refs])\n"
    )
    path = str(tmp_path / "refs.pkl")
    env = {"PYTHONPATH": str(ROOT)}
    for seed, mode in (("1", "dump"), ("2", "load")):
        proc = subprocess.run(
            [sys.executable, "-c", code, mode, path],
            capture_output=True,
            text=True,
            env={**env, "PYTHONHASHSEED": seed},
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[0, 1, 2]"


@pytest.mark.slow
def test_a_script_that_never_shuts_down_exits_cleanly(tmp_path):
    """Worker threads still inside XLA at interpreter exit used to abort the process
    (exit code 134); ``init`` registers a shutdown at exit."""
    script = tmp_path / "train.py"
    script.write_text(
        "import meshshard\n"
        "from examples import mlp\n"
        "meshshard.init(backend='threads')\n"
        "batch = mlp.make_batch(8)\n"
        "state = mlp.make_state(mlp.MLP(num_layers=2), batch['x'])\n"
        "step = meshshard.parallelize(mlp.train_step, method=meshshard.PipeshardParallel(\n"
        "    num_micro_batches=2, stages=[(1, 2), (1, 2)]))\n"
        "for _ in range(2):\n"
        "    state, loss = step(state, batch)\n"
        "print('loss', float(loss))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env["XLA_FLAGS"] = os.environ["XLA_FLAGS"]  # 8 devices and the session's fast compiles
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("loss ")
