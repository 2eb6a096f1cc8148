"""The examples in the simulator's docstrings run and print what they show."""

import doctest
import importlib

import pytest

MODULES = [
    "meshshard.cluster",
    "meshshard.sim.collectives",
    "meshshard.sim.network",
    "meshshard.sim.rules",
    "meshshard.sim.simulator",
    "meshshard.sim.synthetic",
    "meshshard.sim.topology",
    "meshshard.sim.trace",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, extraglobs={"ClusterSpec": importlib.import_module("meshshard.cluster").ClusterSpec}
    )
    assert result.failed == 0
