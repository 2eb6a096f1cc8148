"""hlo_collectives: the collectives parsed from real compiled programs on emulated devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshshard.hlo_collectives import (
    bytes_by_kind,
    collectives_of,
    count_by_kind,
    parse_collectives,
    parse_replica_groups,
)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))


def _compile(f, mesh, in_specs, out_specs, *shapes):
    args = [
        jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, spec))
        for s, spec in zip(shapes, in_specs, strict=True)
    ]
    outs = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs)
    return jax.jit(f, out_shardings=outs).lower(*args).compile()


def _shmap(mesh, f, in_specs, out_specs, **kw):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)


def test_contracting_split_all_reduces_the_output_shard(mesh):
    # a[16,32] split (x, y), b[32,8] split (y, -): the y-split contraction needs a psum
    # over y of the [8,8] output block; x then gathers nothing (output sharded on x).
    c = _compile(
        lambda a, b: a @ b, mesh, [P("x", "y"), P("y", None)], P("x", None), (16, 32), (32, 8)
    )
    got = collectives_of(c)
    assert count_by_kind(got) == {"all-reduce": 1}
    (ar,) = got
    assert ar.dtype == "f32" and ar.shape == (8, 8) and ar.nbytes == 8 * 8 * 4
    assert set(ar.groups) == {(0, 1), (2, 3)}  # along y
    assert ar.in_entry


def test_all_gather_is_the_full_gathered_size(mesh):
    c = _compile(lambda a: a * 2.0, mesh, [P("x", None)], P(None, None), (16, 6))
    (ag,) = collectives_of(c)
    assert ag.kind == "all-gather" and ag.nbytes == 16 * 6 * 4
    assert ag.dimensions == (0,) and ag.group_size == 2
    assert set(ag.groups) == {(0, 2), (1, 3)}  # along x


def test_shard_map_collectives_of_every_kind(mesh):
    def body(a):
        s = jax.lax.psum(a, "x")  # all-reduce over x
        r = jax.lax.psum_scatter(a, "y", scatter_dimension=0, tiled=True)  # reduce-scatter
        t = jax.lax.all_to_all(a, "y", 0, 1, tiled=True)  # all-to-all
        p = jax.lax.ppermute(a, "x", [(0, 1), (1, 0)])  # collective-permute
        return s, r, t, p

    f = _shmap(mesh, body, P("x", "y"), (P(None, "y"), P("x", "y"), P("x", "y"), P("x", "y")))
    c = _compile(
        f, mesh, [P("x", "y")], (P(None, "y"), P("x", "y"), P("x", "y"), P("x", "y")), (16, 16)
    )
    got = collectives_of(c)
    kinds = count_by_kind(got)
    assert kinds == {
        "all-reduce": 1,
        "reduce-scatter": 1,
        "all-to-all": 1,
        "collective-permute": 1,
    }, kinds
    by = {x.kind: x for x in got}
    block = 8 * 8 * 4  # each device's [8,8] block
    assert by["all-reduce"].nbytes == block and set(by["all-reduce"].groups) == {(0, 2), (1, 3)}
    # reduce-scatter: nbytes is the full (input) size, the result is half of it
    assert by["reduce-scatter"].shape == (4, 8) and by["reduce-scatter"].nbytes == block
    assert set(by["reduce-scatter"].groups) == {(0, 1), (2, 3)}
    assert by["all-to-all"].nbytes == block
    assert set(by["collective-permute"].pairs) == {(0, 2), (2, 0), (1, 3), (3, 1)}
    assert bytes_by_kind(got)["reduce-scatter"] == block


def test_collectives_inside_a_loop_are_marked_outside_entry(mesh):
    def body(a):
        return jax.lax.fori_loop(0, 3, lambda i, v: jax.lax.psum(v, "y") * 0.5, a)

    f = _shmap(mesh, body, P("x", "y"), P("x", "y"), check_vma=False)
    c = _compile(f, mesh, [P("x", "y")], P("x", "y"), (8, 8))
    got = [x for x in collectives_of(c) if x.kind == "all-reduce"]
    assert got and all(not x.in_entry for x in got)
    # each runs once per iteration: counted and priced 3 times per call
    assert [x.runs for x in got] == [3] * len(got)
    assert count_by_kind(got) == {"all-reduce": 3 * len(got)}
    assert bytes_by_kind(got) == {"all-reduce": 3 * sum(x.nbytes for x in got)}


def test_nested_loops_multiply_their_trip_counts(mesh):
    def body(a):
        inner = lambda j, v: jax.lax.psum(v, "y") * 0.5  # noqa: E731
        return jax.lax.fori_loop(0, 4, lambda i, v: jax.lax.fori_loop(0, 3, inner, v), a)

    f = _shmap(mesh, body, P("x", "y"), P("x", "y"), check_vma=False)
    c = _compile(f, mesh, [P("x", "y")], P("x", "y"), (8, 8))
    got = [x for x in collectives_of(c) if x.kind == "all-reduce"]
    assert got and [x.runs for x in got] == [12] * len(got)
    assert str(got[0]).endswith(" x12")


def test_replicated_program_has_no_collectives(mesh):
    c = _compile(lambda a: jnp.tanh(a) @ a, mesh, [P()], P(), (8, 8))
    assert collectives_of(c) == ()


def test_a_parallelized_step_reports_the_collectives_xla_compiled():
    """``step.compiled_collectives()``: each program's collectives as the runtime compiles
    it, here a data-parallel matmul's gradient all-reduce; before the first call it says
    to call the step."""
    import meshshard
    from meshshard.errors import MeshshardInputError
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)

    with use_cluster(ThreadsCluster(1, 2)):
        par = meshshard.parallelize(step, method=meshshard.DataParallel((1, 2)))
        with pytest.raises(MeshshardInputError, match="call it once"):
            par.compiled_collectives()
        par(jnp.ones((8, 8)), jnp.ones((16, 8)))
        got = par.compiled_collectives()
    assert list(got) == [str(p.name) for p in par.plan.programs_run()]
    (program,) = got.values()
    assert count_by_kind(program) == {"all-reduce": 1}
    assert bytes_by_kind(program) == {"all-reduce": 8 * 8 * 4}


@pytest.mark.parametrize(
    "text, n, want",
    [
        ("{}", 4, ((0, 1, 2, 3),)),
        (None, 2, ((0, 1),)),
        ("{{0,1},{2,3}}", 4, ((0, 1), (2, 3))),
        ("[2,2]<=[2,2]T(1,0)", 4, ((0, 2), (1, 3))),
        ("[1,8]<=[8]", 8, ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=2] {'axis_1'}", 4, ((0, 2), (1, 3))),
        ("mesh['a'=2,'b'=2] {'a','b'}", 4, ((0, 1, 2, 3),)),
    ],
)
def test_replica_group_forms(text, n, want):
    assert parse_replica_groups(text, n) == want


def test_unknown_replica_group_form_is_named():
    with pytest.raises(ValueError, match=r"unknown replica-group form '<oops>'"):
        parse_replica_groups("<oops>", 4)


def test_async_start_pairs_and_tuple_all_reduce():
    text = """HloModule m, num_partitions=2
ENTRY %main (p: f32[4], q: bf16[8]) -> f32[8] {
  %ar = (f32[4]{0}, bf16[8]{0}) all-reduce(%p, %q), replica_groups={}, to_apply=%add
  %ags = (f32[4]{0}, f32[8]{0}) all-gather-start(%p), replica_groups={{0,1}}, dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ags)
  ROOT %cp = f32[8]{0} collective-permute(%agd), source_target_pairs={{0,1},{1,0}}
}"""
    ar, ag, cp = parse_collectives(text)
    assert (ar.kind, ar.nbytes, ar.groups) == ("all-reduce", 4 * 4 + 8 * 2, ((0, 1),))
    assert (ag.kind, ag.is_async, ag.shape, ag.nbytes) == ("all-gather", True, (8,), 32)
    assert cp.pairs == ((0, 1), (1, 0)) and cp.group_size == 2
    assert str(cp) == "collective-permute f32[8] pairs=0->1,1->0 32 B"
