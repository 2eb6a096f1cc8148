"""Sharding ILP: tiny programs whose optimal plan is known, pins, budgets, and errors."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import meshshard
from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import var_ids
from meshshard.passes.shard_costs import LogicalMesh
from meshshard.passes.shard_ilp import estimate_stage_cost, solve_stage
from meshshard.passes.shard_rules import layouts, reshard_comms

CLUSTER = ClusterSpec()
MESH = LogicalMesh.of((1, 4), CLUSTER)


def _mlp(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2


def _sgd_step(w1, w2, x):
    def loss(w1, w2):
        return jnp.mean(_mlp(x, w1, w2) ** 2)

    g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
    return w1 - 0.1 * g1, w2 - 0.1 * g2


def _adam_like(w, m, v, g):
    m2 = 0.9 * m + 0.1 * g
    v2 = 0.99 * v + 0.01 * g * g
    return w - 0.01 * m2 / (jnp.sqrt(v2) + 1e-8), m2, v2


def _outs(closed):
    from meshshard.jaxpr_util import var_ids

    ids = var_ids(closed.jaxpr)
    return [ids[v] for v in closed.jaxpr.outvars]


def test_tensor_parallel_wins_when_the_batch_cannot_split():
    # 2 rows on 4 devices: only splitting the 4096-wide hidden dim shares the work
    closed = jax.make_jaxpr(_mlp)(
        jnp.ones((2, 1024)), jnp.ones((1024, 4096)), jnp.ones((4096, 1024))
    )
    sol = solve_stage(closed, MESH, CLUSTER)
    assert sol.status == "optimal" and not sol.fallback and sol.gap <= 1e-3
    assert sol.specs[0] == ()  # x whole
    assert "device" in sol.specs[1][-1]  # w1 split along the hidden dim
    assert sol.specs[2] and sol.specs[2] != ()  # w2 split too
    kinds = {c.kind for _, c in sol.comms}
    assert kinds <= {"all-gather", "all-reduce"} and kinds


def test_data_parallel_wins_for_a_large_batch_and_small_weights():
    closed = jax.make_jaxpr(_sgd_step)(jnp.ones((64, 64)), jnp.ones((64, 64)), jnp.ones((8192, 64)))
    w1n, w2n = _outs(closed)
    sol = solve_stage(closed, MESH, CLUSTER, tied=[(0, w1n), (1, w2n)])
    assert sol.specs[0] == () and sol.specs[1] == ()  # weights replicated
    assert sol.specs[2] == ("device",)  # the batch split
    assert sol.specs[w1n] == () and sol.specs[w2n] == ()
    grads = [c for _, c in sol.comms if c.kind == "all-reduce" and c.nbytes == 64 * 64 * 4]
    assert len(grads) == 2  # one all-reduce per weight gradient
    assert not [c for _, c in sol.comms if c.kind in ("all-gather", "all-to-all")]


def test_memory_budget_forces_sharded_optimizer_state():
    a = jnp.ones((1024, 1024))  # 4 MiB each; w, m, v, g and the new w, m, v: 28 MiB whole
    closed = jax.make_jaxpr(_adam_like)(a, a, a, a)
    wn, mn, vn = _outs(closed)
    tied = [(0, wn), (1, mn), (2, vn)]
    roomy = solve_stage(closed, MESH, CLUSTER, memory_budget=1 << 40, tied=tied)
    tight = solve_stage(closed, MESH, CLUSTER, memory_budget=12 * 2**20, tied=tied)
    assert tight.memory <= 12 * 2**20 < 28 * 2**20
    assert tight.specs[1] != () and tight.specs[2] != ()  # optimizer state sharded
    assert tight.specs[1] == tight.specs[mn] and tight.specs[2] == tight.specs[vn]
    assert roomy.objective <= tight.objective + 1e-12


def test_a_budget_no_plan_fits_names_the_budget_mesh_and_need():
    a = jnp.ones((1024, 1024))
    closed = jax.make_jaxpr(_adam_like)(a, a, a, a)
    with pytest.raises(
        MeshshardInputError,
        match=r"memory_budget=1\.0 MiB per device: no sharding of this stage on mesh "
        r"host=1xdevice=4 fits; the most sharded plan needs \d+\.\d MiB",
    ):
        solve_stage(closed, MESH, CLUSTER, memory_budget=2**20)


def test_pins_are_respected_and_bad_pins_named():
    closed = jax.make_jaxpr(_mlp)(jnp.ones((64, 64)), jnp.ones((64, 64)), jnp.ones((64, 64)))
    sol = solve_stage(closed, MESH, CLUSTER, pins={1: (None, "device")})
    assert sol.specs[1] == (None, "device")
    odd = jax.make_jaxpr(_mlp)(jnp.ones((6, 64)), jnp.ones((64, 64)), jnp.ones((64, 64)))
    with pytest.raises(
        MeshshardInputError,
        match=r"pin P\('device'\) on %0 \(shape \(6, 64\)\) splits dim 0 of size 6 over 4 "
        r"devices of mesh host=1xdevice=4, which does not divide it; layouts that fit: P\(\)",
    ):
        solve_stage(odd, MESH, CLUSTER, pins={0: ("device",)})


def test_different_pins_on_values_of_one_follower_group_all_hold():
    # elementwise results of one operand share its layout variable; each pin still holds
    # (before: the last pin fixed the whole group, and the others were silently dropped)
    def fn(a):
        return (
            meshshard.shard(a * 2, P("host", None)),
            meshshard.shard(a + 1, P()),
            meshshard.shard(a / 2, P(None, "device")),
        )

    closed = jax.make_jaxpr(fn)(jnp.ones((8, 8)))
    sol = solve_stage(closed, LogicalMesh.of((2, 2), CLUSTER), CLUSTER)
    ids = var_ids(closed.jaxpr)
    got = [sol.specs[ids[v]] for v in closed.jaxpr.outvars]
    assert got == [("host",), (), (None, "device")], sol.specs


def test_greedy_estimate_is_a_feasible_upper_bound():
    closed = jax.make_jaxpr(_sgd_step)(jnp.ones((64, 64)), jnp.ones((64, 64)), jnp.ones((8192, 64)))
    est = estimate_stage_cost(closed, MESH, CLUSTER)
    sol = solve_stage(closed, MESH, CLUSTER)
    assert est.fits and est.seconds >= sol.objective - 1e-12
    assert est.seconds == pytest.approx(est.compute + est.comm)


def test_reshard_comms_and_layouts():
    mesh = LogicalMesh.of((2, 2), CLUSTER)
    assert len(layouts((4, 4), mesh)) == 9
    assert reshard_comms((8, 8), "float32", (("host",), ()), ((), ()), mesh)[0].kind == "all-gather"
    (move,) = reshard_comms((8, 8), "float32", (("host",), ()), ((), ("host",)), mesh)
    assert move.kind == "all-to-all" and move.nbytes == 8 * 8 * 4 / 2
    assert reshard_comms((8, 8), "float32", ((), ()), (("device",), ()), mesh) == ()


def test_scatter_add_rule_splits_rows_with_a_reduce_or_the_feature_dim_without():
    from meshshard.passes.shard_rules import strategies

    def emb_grad(ids, upd):  # the gradient of an embedding lookup
        return jnp.zeros((16, 8)).at[ids].add(upd)

    jx = jax.make_jaxpr(emb_grad)(jnp.zeros((12,), jnp.int32), jnp.ones((12, 8))).jaxpr
    (eqn,) = [e for e in jx.eqns if e.primitive.name == "scatter-add"]
    by_upd = {s.ins[2]: s for s in strategies(eqn, MESH)}
    rows = by_upd[(("device",), ())]  # each device scatters its 3 rows into a whole table
    assert rows.outs == (((), ()),) and rows.ins[1][0] == ("device",)
    assert [(c.kind, c.axes, c.nbytes) for c in rows.comms] == [("all-reduce", ("device",), 512)]
    feat = by_upd[((), ("device",))]  # the feature dim split on table and updates alike
    assert feat.outs == (((), ("device",)),) and feat.ins[0] == ((), ("device",))
    assert feat.comms == () and feat.split == 4
    assert by_upd[((), ())].comms == ()  # replicated


def test_values_of_key_type_are_costed():
    """A PRNG key inside the step (``nn.RNN`` makes one for its carry, dropout splits
    them) has an extended dtype NumPy cannot size; the solver still plans the stage."""

    def noisy(x, w):
        key = jax.random.split(jax.random.key(0))[1]
        return jnp.tanh(x @ w + jax.random.normal(key, (x.shape[0], w.shape[1])))

    closed = jax.make_jaxpr(noisy)(jnp.ones((64, 8)), jnp.ones((8, 8)))
    cluster = ClusterSpec()
    sol = solve_stage(closed, LogicalMesh.of((1, 2), cluster), cluster)
    assert not sol.fallback and sol.status == "optimal"


def test_a_stopped_solver_keeps_the_best_heuristic_plan():
    """When HiGHS stops before optimality (here: no time at all), the solution is the
    cheapest of its incumbent, the greedy plan and the data-parallel seed, each after
    local search; the status names which, and it is never worse than plain greedy.
    (GPT on a (2, 2) mesh: the incumbent after 27 s was 10x worse than the seed.)"""
    closed = jax.make_jaxpr(_sgd_step)(
        jnp.ones((256, 512)), jnp.ones((512, 64)), jnp.ones((64, 256))
    )
    seed = ("data-parallel", {2: ("device",), 0: (), 1: ()})
    sol = solve_stage(closed, MESH, CLUSTER, time_limit=0.0, seeds=[seed])
    greedy = estimate_stage_cost(closed, MESH, CLUSTER)
    assert sol.status.startswith("stopped") and "kept" in sol.status, sol.status
    assert sol.objective <= greedy.seconds * (1 + 1e-9)
    optimal = solve_stage(closed, MESH, CLUSTER)
    assert optimal.status == "optimal" and optimal.objective <= sol.objective * (1 + 1e-6)
    assert "kept" in sol.summary()


def test_amortized_reduces_make_data_parallel_cheaper():
    """A weight gradient's reduce that runs once per step (``amortize``: 1/M) costs the
    solver 1/M of it, so the same data-parallel plan is predicted cheaper."""
    closed = jax.make_jaxpr(_sgd_step)(
        jnp.ones((16, 16)), jnp.ones((16, 16)), jnp.ones((65536, 16))
    )
    dots = [
        i
        for i, e in enumerate(closed.jaxpr.eqns)
        if e.primitive.name == "dot_general" and 0 in e.params["dimension_numbers"][0][0]
    ]
    full = solve_stage(closed, MESH, CLUSTER)
    once = solve_stage(closed, MESH, CLUSTER, amortize=dict.fromkeys(dots, 0.25))
    assert dots and full.status == once.status == "optimal"
    assert once.objective < full.objective
    assert any(c.kind == "all-reduce" for _, c in once.comms)  # the batch split's reduce


def _four_gradients(x, w0, w1, w2, w3):
    # four small, independent gradient-like contractions over the batch, each feeding
    # only an elementwise update: data parallelism all-reduces each of them
    ws = (w0, w1, w2, w3)
    return tuple(w - 0.1 * jnp.einsum("bi,bj->ij", x, x * (k + 1.0)) for k, w in enumerate(ws))


def test_combinable_gradient_all_reduces_pay_one_latency(monkeypatch):
    import numpy as np

    from meshshard.jaxpr_util import var_ids
    from meshshard.passes import shard_ilp

    # a batch where the split wins only when the four all-reduces share one latency
    closed = jax.make_jaxpr(_four_gradients)(jnp.ones((128, 16)), *[jnp.ones((16, 16))] * 4)
    ids = var_ids(closed.jaxpr)
    whole = {ids[v]: () for v in (*closed.jaxpr.invars[1:], *closed.jaxpr.outvars)}
    sol = solve_stage(closed, MESH, CLUSTER, pins=whole)
    assert sol.status == "optimal" and sol.specs[0] == ("device",)  # the batch splits
    reduces = [c for _, c in sol.comms if c.kind == "all-reduce"]
    assert len(reduces) == 4 and all(c.nbytes == 16 * 16 * 4 for c in reduces)
    # priced as XLA's combiner runs them: the bandwidth of each, one latency in all
    latency = MESH.latency("all-reduce", ("device",))
    assert sol.comm_seconds == pytest.approx(MESH.comm_time(reduces) - 3 * latency)
    problem = shard_ilp._build(closed.jaxpr, MESH, None, {})
    shard_ilp._apply_pins(problem, whole, closed.jaxpr, MESH)
    assert list(problem.combine.values()) == [pytest.approx(latency)]
    choice, _, res = shard_ilp._milp(problem, None, 10.0, 1e-9)
    objective = shard_ilp._evaluate(problem, choice, MESH)[0]
    assert res.fun == pytest.approx(objective, rel=1e-9)  # the ILP and _evaluate agree
    assert objective == pytest.approx(sol.objective, rel=1e-6)
    improved = shard_ilp._improve(problem, choice)  # local search prices it alike
    assert shard_ilp._evaluate(problem, improved, MESH)[0] >= objective - 1e-15
    split = [n for n in problem.nodes if n.groups and any(n.groups)]
    assert len(split) == 4 and np.allclose([n.saved.max() for n in split], latency)
    # one latency per all-reduce (no combiner) makes the same split dearer than the
    # replicated plan: data parallelism wins only when priced combined
    monkeypatch.setattr(shard_ilp, "_combinable", lambda *a: set())
    alone = solve_stage(closed, MESH, CLUSTER, pins=whole)
    assert alone.specs[0] == () and not [c for _, c in alone.comms if c.kind == "all-reduce"]
    # the split plan priced one latency per all-reduce: dearer than the replicated one
    assert sol.objective < alone.objective < sol.objective + 3 * latency


def test_only_all_reduces_no_later_all_reduce_depends_on_combine():
    # SGD on a 2-layer MLP: the weight gradients feed only the update (combinable); the
    # forward contractions and the backward's dx feed later contractions (not)
    from meshshard.passes import shard_ilp
    from meshshard.passes.shard_rules import strategies

    closed = jax.make_jaxpr(_sgd_step)(jnp.ones((64, 64)), jnp.ones((64, 64)), jnp.ones((512, 64)))
    jaxpr = closed.jaxpr
    idx = list(range(len(jaxpr.eqns)))
    found = shard_ilp._combinable(
        jaxpr, idx, {i: strategies(e, MESH) for i, e in enumerate(jaxpr.eqns)}
    )
    dots = [i for i in idx if jaxpr.eqns[i].primitive.name == "dot_general"]
    weight_grads = [i for i in dots if jaxpr.eqns[i].outvars[0].aval.shape == (64, 64)]
    assert len(dots) == 5 and len(weight_grads) == 2
    assert set(weight_grads) <= found and not (set(dots) - set(weight_grads)) & found


def test_slices_splits_and_concatenations_split_the_dims_they_take_whole():
    from meshshard.passes.shard_rules import strategies

    def f(x):
        q, k, v = jnp.split(x, 3, axis=-1)  # a fused QKV projection
        head = jax.lax.dynamic_slice_in_dim(x, 2, 4, axis=1)
        return (
            jnp.concatenate([q, k], axis=-1),
            v[:, 1:],
            jax.lax.dynamic_update_slice_in_dim(x, head, 1, axis=1),
        )

    jx = jax.make_jaxpr(f)(jnp.ones((8, 12))).jaxpr
    names = set()
    for e in jx.eqns:
        split_dims = {d for s in strategies(e, MESH) for d, axes in enumerate(s.outs[0]) if axes}
        assert split_dims == {0}, e.primitive.name  # the rows; never the sliced dim
        assert all(s.comms == () for s in strategies(e, MESH))
        names.add(e.primitive.name)
    assert {"split", "concatenate", "slice", "dynamic_slice", "dynamic_update_slice"} <= names


def test_router_top_k_and_sorts_split_the_dims_they_do_not_order():
    from meshshard.passes.shard_rules import strategies

    def route(scores):
        gate, idx = jax.lax.top_k(scores, 2)
        keys, order = jax.lax.sort((scores, jnp.zeros(scores.shape, jnp.int32)), dimension=1)
        return gate, idx, keys, order, jax.lax.sort(scores, dimension=0)

    jx = jax.make_jaxpr(route)(jnp.ones((8, 4))).jaxpr
    seen = {}
    for e in jx.eqns:
        if e.primitive.name in ("top_k", "sort"):
            got = {d for s in strategies(e, MESH) for d, axes in enumerate(s.outs[0]) if axes}
            seen.setdefault(e.primitive.name, []).append(got)
    assert seen == {"top_k": [{0}], "sort": [{0}, {1}]}  # never the dim they order


def test_a_tiled_class_token_splits_with_the_batch():
    from meshshard.passes.shard_rules import strategies

    def f(cls, x):  # a ViT's class token repeated over the batch
        return jnp.concatenate([jnp.tile(cls, (x.shape[0], 1, 1)), x], axis=1)

    jx = jax.make_jaxpr(f)(jnp.ones((1, 1, 8)), jnp.ones((8, 5, 8))).jaxpr
    (tile,) = [e for e in jx.eqns if e.primitive.name == "tile"]
    by_out = {s.outs[0]: s for s in strategies(tile, MESH)}
    rows = by_out[(("device",), (), ())]
    assert rows.ins == (((), (), ()),) and rows.comms == ()  # the token whole, rows split
    assert by_out[((), (), ("device",))].ins == (((), (), ("device",)),)


def test_only_equations_with_something_to_split_are_noted_as_replicated():
    def f(seed, x):
        key = jax.random.key(seed)  # scalar key ops: nothing to split
        keys = jax.random.split(key, 8)  # nn.RNN's carry keys: a few words each
        data = jax.random.key_data(jax.random.wrap_key_data(jax.random.key_data(keys)))
        return jnp.fft.fft(x).real + jax.random.uniform(key, ()) + data[:, :1].astype(x.dtype)

    from meshshard.passes.inline import inline_calls

    closed = inline_calls(jax.make_jaxpr(f)(jnp.int32(0), jnp.ones((8, 8))))
    notes = [n for n in solve_stage(closed, MESH, CLUSTER).notes if "runs replicated" in n]
    assert notes == ["fft runs replicated (no sharding rule)"]


def tanh_mlp_jaxpr(layers: int = 4, width: int = 512, rows: int = 16):
    """The jaxpr of an SGD step of a tanh MLP of ``rows`` rows: on 2 x 2, a problem whose
    greedy plan is far from the optimum."""

    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.mean(h**2)

        return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws), strict=True)]

    return jax.make_jaxpr(step)([jnp.ones((width, width))] * layers, jnp.ones((rows, width)))


def test_a_stopped_solver_on_a_2d_mesh_keeps_a_one_axis_plan_near_the_optimum():
    """On a mesh of two split axes HiGHS may stop far from optimal (a BERT block on
    2 x 2: 174k variables, still at a 94% gap after 20 s).  Each axis alone, and both
    as one, make problems it solves; their plans, mapped onto the whole mesh and
    locally improved, are candidates.  A 4-layer MLP of 16 rows: with no time for the
    whole mesh, greedy and local search alone were 10.5% above the optimum; the host-axis
    plan is 0.1% above it (``benchmarks/ilp_one_axis.py`` reports both)."""
    closed = tanh_mlp_jaxpr()
    mesh = LogicalMesh.of((2, 2), CLUSTER)
    stopped = solve_stage(closed, mesh, CLUSTER, time_limit=0.0)
    optimal = solve_stage(closed, mesh, CLUSTER)
    assert optimal.status == "optimal"
    assert "-axis plan + local search" in stopped.status, stopped.status
    assert stopped.objective <= optimal.objective * 1.01, (stopped.objective, optimal.objective)


def test_one_axis_meshes_map_their_layouts_onto_the_whole_mesh():
    from meshshard.passes.shard_ilp import _one_axis_meshes

    meshes = _one_axis_meshes(LogicalMesh.of((2, 4), CLUSTER))
    assert [(label, m.axes, m.shape) for label, m, _ in meshes] == [
        ("host-axis", ("host", "device"), (2, 1)),
        ("device-axis", ("host", "device"), (1, 4)),
        ("all-axes", ("flat",), (8,)),
    ]
    flat = meshes[-1][2]
    assert flat(((), ("flat",))) == ((), ("host", "device"))
    assert _one_axis_meshes(MESH) == []  # one split axis: nothing to add


def test_a_tie_that_pins_rule_out_is_dropped_not_infeasible():
    """A state pinned one way as it comes in and another way as it goes out cannot keep
    its layout across steps: the pins hold and HiGHS solves the rest (it reported the
    problem infeasible, and a greedy plan was kept, when the tie stayed)."""

    def fn(a):
        a = meshshard.shard(a, P("host", None))
        return meshshard.shard(a * 2, P(None, "device")), a + 1

    closed = jax.make_jaxpr(fn)(jnp.ones((8, 8)))
    ids = var_ids(closed.jaxpr)
    a = ids[closed.jaxpr.invars[0]]
    out, kept = (ids[v] for v in closed.jaxpr.outvars)
    sol = solve_stage(closed, LogicalMesh.of((2, 2), CLUSTER), CLUSTER, tied=[(a, out), (a, kept)])
    assert sol.status == "optimal", sol.status
    assert (sol.specs[out], sol.specs[kept]) == ((None, "device"), ("host",))
