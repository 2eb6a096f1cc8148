"""The cross-mesh all-reduce on the in-process transport and its identities."""

import numpy as np
import pytest

from meshshard.program_fn import reduction_identity
from meshshard.runtime.executable import run_in_threads
from meshshard.runtime.transport import QueueTransport, reduce_arrays


@pytest.mark.parametrize(
    "op,dtype,want",
    [
        ("sum", np.float32, [6.0, -3.0]),
        ("max", np.float32, [3.0, 0.0]),
        ("min", np.int32, [1, -2]),
        ("and", np.bool_, [True, False]),
        ("or", np.bool_, [True, True]),
    ],
)
def test_every_member_gets_the_reduction(op, dtype, want):
    values = {
        0: np.array([1, -2], dtype),
        1: np.array([2, 0], dtype),
        2: np.array([3, -1], dtype),
    }
    if dtype is np.bool_:
        values = {0: np.array([1, 0], bool), 1: np.array([1, 1], bool), 2: np.array([1, 0], bool)}
    transports = QueueTransport.group((0, 1, 2))
    for _ in range(2):  # the channel is reused step after step
        got = run_in_threads(
            (0, 1, 2),
            lambda w: transports[w].iallreduce(values[w], op, (0, 1, 2), "r0:0,1,2").wait(),
        )
        for w in (0, 1, 2):
            assert got[w].dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got[w], np.array(want, dtype))


COMBOS = [(op, dt) for op in ("sum", "max", "min") for dt in (np.float32, np.int32)] + [
    ("and", np.bool_),
    ("or", np.bool_),
]


@pytest.mark.parametrize("op,dtype", COMBOS)
def test_identity_leaves_a_value_unchanged(op, dtype):
    x = np.array([3, 0, 1], dtype) if dtype is not np.bool_ else np.array([1, 0, 1], bool)
    ident = reduction_identity(op, x.shape, dtype)
    np.testing.assert_array_equal(reduce_arrays(op, [x, ident]), x)
    np.testing.assert_array_equal(reduce_arrays(op, [ident, x]), x)
