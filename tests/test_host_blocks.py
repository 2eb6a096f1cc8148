"""How a host-path worker reads the blocks it sends and rebuilds the arrays it receives
(``JaxBlocks`` and ``local_block``): a message that holds a whole array takes a short
path (no slicing on the sender, no staging copy on the receiver), every other message
the general one, and both give the same arrays."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
import pytest

from meshshard.runtime import interpreter
from meshshard.runtime.interpreter import JaxBlocks, covers, local_block
from meshshard.runtime.programs import make_mesh, sharding


@dataclass(frozen=True)
class Tensor:
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Transfer:
    """What ``JaxBlocks.assemble`` reads of a transfer."""

    tensor: Tensor
    dst_spec: tuple


@dataclass(frozen=True)
class Part:
    index: tuple[tuple[int, int], ...]


def whole(shape) -> tuple[tuple[int, int], ...]:
    return tuple((0, n) for n in shape)


def wire(value: np.ndarray) -> np.ndarray:
    """``value`` as the flat bytes a transport hands over."""
    return np.frombuffer(np.ascontiguousarray(value).tobytes(), np.uint8).copy()


def values(shape, dtype) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype == "bool":
        return (np.arange(n) % 3 == 0).reshape(shape)
    return (np.arange(n) - 5).astype(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "bool"])
@pytest.mark.parametrize("shape", [(), (3,), (2, 3, 4)])
def test_a_whole_array_message_is_rebuilt_without_placing_blocks(monkeypatch, shape, dtype):
    def no_staging(full, parts):
        raise AssertionError("a whole-array message was copied into a staging array")

    monkeypatch.setattr(interpreter, "place_blocks", no_staging)
    mesh = make_mesh(jax.devices()[:1], (1, 1))
    want = values(shape, dtype)
    got = JaxBlocks(mesh).assemble(
        Transfer(Tensor(shape, dtype), ()), [(Part(whole(shape)), wire(want))]
    )
    assert got.dtype == np.dtype(dtype) and got.shape == shape
    assert got.sharding == sharding(mesh, ())
    np.testing.assert_array_equal(np.asarray(got), want)


def test_a_whole_array_is_laid_out_on_a_sharded_destination():
    mesh = make_mesh(jax.devices()[:2], (1, 2))
    want = values((4, 6), "float32")
    blocks = JaxBlocks(mesh)
    got = blocks.assemble(
        Transfer(Tensor((4, 6), "float32"), ("device",)), [(Part(whole((4, 6))), wire(want))]
    )
    assert got.sharding == sharding(mesh, ("device",))
    assert [s.data.shape for s in got.addressable_shards] == [(2, 6), (2, 6)]
    np.testing.assert_array_equal(np.asarray(got), want)
    # the destination sharding is made once per spec, not once per message
    again = blocks.assemble(
        Transfer(Tensor((4, 6), "float32"), ("device",)), [(Part(whole((4, 6))), wire(want))]
    )
    assert again.sharding is got.sharding


def test_blocks_of_a_message_are_placed_where_they_belong():
    mesh = make_mesh(jax.devices()[:1], (1, 1))
    want = values((4, 3), "float32")
    parts = [
        (Part(((2, 4), (0, 3))), wire(want[2:4])),
        (Part(((0, 2), (0, 3))), wire(want[0:2])),
    ]
    got = JaxBlocks(mesh).assemble(Transfer(Tensor((4, 3), "float32"), ()), parts)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_covers_is_the_whole_array_only():
    assert covers((), ())
    assert covers(((0, 4), (0, 3)), (4, 3))
    assert not covers(((0, 2), (0, 3)), (4, 3))
    assert not covers(((1, 4), (0, 3)), (4, 3))
    assert not covers(((0, 4),), (4, 3))


def test_the_sender_reads_whole_arrays_and_blocks_alike():
    one = make_mesh(jax.devices()[:1], (1, 1))
    full = values((4, 6), "float32")
    arr = jax.device_put(full, sharding(one, ()))
    np.testing.assert_array_equal(local_block(arr, whole((4, 6))), full)
    np.testing.assert_array_equal(local_block(arr, ((1, 3), (2, 6))), full[1:3, 2:6])
    two = make_mesh(jax.devices()[:2], (1, 2))
    split = jax.device_put(full, sharding(two, ("device",)))
    np.testing.assert_array_equal(local_block(split, ((2, 4), (0, 6))), full[2:4])
