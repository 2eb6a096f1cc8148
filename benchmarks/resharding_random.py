"""500 small random resharding cases on the simulator: ``broadcast`` against every baseline.

    .venv/bin/python benchmarks/resharding_random.py [--cases 500] [--seed 0] [--json OUT.json]

Each case draws (seeded, so the suite is the same on every machine) a source and a
destination mesh of 1-3 hosts x 1-4 devices on disjoint hosts of a 6-host
``aws-p3.8xlarge``-like cluster, a 1-3 dim array, a random spec on each side (each
mesh axis on at most one dim, or none) and a size between 4 KiB and 16 MiB
(log-uniform): the small arrays where latency, chunking and fan-out decide.  Every
strategy plans it and the simulator runs the plan; ``broadcast_search`` gets a node
budget of ``--search-nodes`` (default 20,000) to keep the suite short.

Prints, for ``broadcast``: the ratio to the NIC bound, the tight bound, the hop
bound (:mod:`meshshard.resharding.hops`) and the relay bound
(:mod:`meshshard.resharding.relays`; distribution and worst cases); every
(case, strategy) that finishes before a bound (there must be none); and every case
where a baseline is faster, with by how much.  Writes one record per case with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshshard.cluster import ClusterSpec  # noqa: E402
from meshshard.plan import MeshSpec, spec_str  # noqa: E402
from meshshard.resharding import STRATEGIES, plan_resharding, simulate_resharding  # noqa: E402
from meshshard.resharding.bound import tight_bound  # noqa: E402
from meshshard.resharding.hops import hop_bound  # noqa: E402
from meshshard.resharding.relays import relay_bound  # noqa: E402
from meshshard.resharding.search import broadcast_search  # noqa: E402
from meshshard.tiles import resharding_problem  # noqa: E402

AXES = ("host", "device")
DTYPES = {"int8": 1, "float32": 4, "int32": 4}
BOUNDS = (
    ("nic_bound_s", "NIC"),
    ("tight_bound_s", "tight"),
    ("hop_bound_s", "hop"),
    ("relay_bound_s", "relay"),
)
"""Each record's bounds, weakest first: each is at least the one before it."""


def _spec(rng: np.random.Generator, ndim: int) -> tuple:
    entries: list[list[str]] = [[] for _ in range(ndim)]
    for ax in rng.permutation(AXES):
        dim = int(rng.integers(-1, ndim))
        if dim >= 0:
            entries[dim].append(str(ax))
    return tuple(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries)


def _parts(spec: tuple, mesh_shape: tuple[int, int]) -> list[int]:
    size = dict(zip(AXES, mesh_shape, strict=True))
    out = []
    for e in spec:
        axes = () if e is None else (e,) if isinstance(e, str) else e
        out.append(math.prod(size[a] for a in axes))
    return out


def random_problem(rng: np.random.Generator):
    """One random case (module docstring)."""
    ss = (int(rng.integers(1, 4)), int(rng.integers(1, 5)))
    ds = (int(rng.integers(1, 4)), int(rng.integers(1, 5)))
    ndim = int(rng.integers(1, 4))
    sp, dp = _spec(rng, ndim), _spec(rng, ndim)
    unit = [math.lcm(a, b) for a, b in zip(_parts(sp, ss), _parts(dp, ds), strict=True)]
    dtype = str(rng.choice(list(DTYPES)))
    target = 2 ** rng.uniform(12, 24) / DTYPES[dtype]  # elements: 4 KiB .. 16 MiB
    scale = max(1, round((target / math.prod(unit)) ** (1 / ndim)))
    shape = tuple(u * scale for u in unit)
    src = MeshSpec(0, ss, tuple(range(ss[0])))
    dst = MeshSpec(1, ds, tuple(range(ss[0], ss[0] + ds[0])))
    return resharding_problem(shape, dtype, src, sp, dst, dp)


def label(p) -> str:
    """A case as ``i32[64,8] (2, 4) P('host') -> (1, 3) P()``."""
    return (
        f"{p.dtype}{list(p.shape)} {p.src.shape} {spec_str(p.src_spec)} -> "
        f"{p.dst.shape} {spec_str(p.dst_spec)}"
    )


def run_case(p, cluster: ClusterSpec, search_nodes: int) -> dict:
    """Every strategy's simulated time on one case, with both bounds."""
    times = {}
    notes = {}
    for s in STRATEGIES:
        if s == "broadcast_search":
            msgs, _ = broadcast_search(p, cluster, max_nodes=search_nodes)
            times[s] = simulate_resharding(p, msgs, cluster)
        else:
            plan = plan_resharding(p, s, cluster)
            times[s], notes[s] = plan.sim_time_s, list(plan.notes)
            if s == "broadcast":
                nic = plan.lower_bound_s
    tight = tight_bound(p, cluster)
    return {
        "hop_bound_s": hop_bound(p, cluster),
        "relay_bound_s": relay_bound(p, cluster),
        "case": label(p),
        "nbytes": int(np.prod(p.shape)) * p.itemsize,
        "nic_bound_s": nic,
        "tight_bound_s": tight,
        "times_s": times,
        "broadcast_notes": notes["broadcast"],
    }


def _worst(rows: list[dict], ratio: np.ndarray, name: str) -> list[str]:
    out = []
    for i in np.argsort(-ratio)[:5]:
        r = rows[i]
        out.append(f"  worst vs {name}: {r['case']}: {ratio[i]:.3f}x ({r['broadcast_notes'][0]})")
    return out


def _beaten(rows: list[dict], key: str) -> list[str]:
    """Every (case, strategy) that finishes before bound ``key``: none may."""
    out = []
    for r in rows:
        for s, t in r["times_s"].items():
            if t < r[key] * (1 - 1e-9):
                out.append(f"  {key} above {s} on {r['case']}: {r[key] / t:.4f}x")
    return [f"strategies faster than {key}: {len(out)} of {len(rows)} cases x strategies"] + out


def summarize(rows: list[dict]) -> list[str]:
    """The target check: ratios to the bounds (NIC, tight, hop, relay), that no strategy
    beats any of them, and every case a baseline wins."""
    ours = np.array([r["times_s"]["broadcast"] for r in rows])
    nic = ours / np.array([r["nic_bound_s"] for r in rows])
    out = [
        f"{len(rows)} cases; broadcast / NIC bound: median {np.median(nic):.3f}x, "
        f"p95 {np.percentile(nic, 95):.3f}x, max {nic.max():.3f}x"
    ]
    for key, name in BOUNDS[1:]:
        ratio = ours / np.array([r[key] for r in rows])
        out.append(
            f"broadcast / {name} bound: median {np.median(ratio):.3f}x, "
            f"p95 {np.percentile(ratio, 95):.3f}x, min {ratio.min():.3f}x, "
            f"max {ratio.max():.3f}x, {int((ratio > 1.05).sum())} case(s) over 1.05x"
        )
        out += _worst(rows, ratio, name)
    for key, _ in BOUNDS:
        out += _beaten(rows, key)
    lost = []
    for r in rows:
        t = r["times_s"]
        best = min((s for s in STRATEGIES if s != "broadcast"), key=lambda s: t[s])
        if t["broadcast"] > t[best] * (1 + 1e-9):
            lost.append((t["broadcast"] / t[best], best, r["case"]))
    out.append(f"broadcast slower than a baseline on {len(lost)} case(s)")
    for ratio, best, case in sorted(lost, reverse=True):
        out.append(f"  {case}: {ratio:.3f}x slower than {best}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the suite, print the summary, optionally write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--search-nodes", type=int, default=20_000)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args(argv)
    cluster = ClusterSpec.preset("aws-p3.8xlarge")
    cluster = ClusterSpec(**{**cluster.__dict__, "num_hosts": 6})
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    rows = [run_case(random_problem(rng), cluster, args.search_nodes) for _ in range(args.cases)]
    wall = time.perf_counter() - t0
    for line in summarize(rows):
        print(line)
    print(f"{len(rows)} cases x {len(STRATEGIES)} strategies in {wall:.1f} s")
    if args.json_out:
        meta = {
            "benchmark": "resharding_random",
            "seed": args.seed,
            "cluster": cluster.to_dict(),
            "python": platform.python_version(),
            "wall_s": wall,
        }
        with open(args.json_out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
