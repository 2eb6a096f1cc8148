"""Cross-mesh resharding planners: many-to-many multicast as broadcasts, load balanced.

Pure planning (no Ray): from a :class:`~meshshard.tiles.ReshardingProblem` and a
described cluster to the messages of a :class:`~meshshard.plan.TransferSpec`.
"""
