"""The live arrays a cluster keeps, found again when its host-actors restart.

A GPT step makes ~160 result arrays and drops as many; a ``weakref.WeakSet`` pays a
weak reference with a callback on every add and a callback on every death.  This keeps
plain weak references and drops the dead ones in bulk when the list has doubled.

>>> class Box:
...     pass
>>> live = LiveArrays()
>>> kept = [Box() for _ in range(3)]
>>> for b in kept + [Box()]:
...     live.add(b)
>>> del b  # the last box dies
>>> len(list(live))
3
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator

#: a list shorter than this is never pruned
MIN_PRUNE = 1024


class LiveArrays:
    """Weakly held objects: ``add`` one, iterate over those still alive."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self._limit = MIN_PRUNE
        self._lock = threading.Lock()

    def add(self, obj) -> None:
        """Hold ``obj`` weakly (it is forgotten once garbage-collected)."""
        self.add_all((obj,))

    def add_all(self, objs) -> None:
        """Hold each of ``objs`` weakly (a step's results: one lock for all of them)."""
        refs = [weakref.ref(o) for o in objs]
        with self._lock:
            self._refs.extend(refs)
            if len(self._refs) > self._limit:
                self._refs = [r for r in self._refs if r() is not None]
                self._limit = max(MIN_PRUNE, 2 * len(self._refs))

    def __iter__(self) -> Iterator:
        with self._lock:
            refs = list(self._refs)
        for r in refs:
            obj = r()
            if obj is not None:
                yield obj
