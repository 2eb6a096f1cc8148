"""The cluster's set of live arrays (runtime/live_arrays.py): what is alive is found,
what died is dropped in bulk, so the list stays bounded over a long run."""

import gc

from meshshard.runtime.live_arrays import MIN_PRUNE, LiveArrays


class Box:
    pass


def test_only_live_objects_are_found_and_dead_ones_are_pruned():
    live = LiveArrays()
    kept = [Box() for _ in range(10)]
    for b in kept:
        live.add(b)
    for _ in range(5 * MIN_PRUNE):  # a long run: each step's results die at once
        live.add(Box())
    gc.collect()
    assert {id(b) for b in live} == {id(b) for b in kept}
    assert len(live._refs) <= MIN_PRUNE + 1  # pruned, not grown with every add
    del kept[:5]
    gc.collect()
    assert len(list(live)) == 5
