"""Discrete-event execution of a plan's instruction streams on a described cluster.

Every worker runs its stream through queues; time advances from event to event (a
program ends, a flow activates or finishes).

Execution model
---------------
With ``overlap=True`` (an asynchronous runtime, CUDA-stream style) each worker has

- a **compute queue** in stream order: ``RUN``, ``LOAD``, ``ZEROS``, ``WAIT``,
  ``WAITALL``, ``FREE``.  A ``RUN`` starts when the previous compute op is done and
  every buffer it reads is ready; a program of a multi-host mesh is one SPMD program,
  started when all of the mesh's workers reach it.  ``WAIT buf`` blocks the queue
  until the receive or collective into ``buf`` is complete; ``WAITALL`` until every
  earlier send of the worker is.
- a **communication queue** in stream order: ``SEND``, ``RECV``, ``COLL``.  An op is
  issued once the previous one is issued and (``SEND``/``COLL``) its buffer is ready;
  issued ops proceed concurrently.  A collective starts when all its group members
  have issued it.

With ``overlap=False`` (a blocking runtime) a worker does one thing at a time: each
instruction starts when the previous one has completed, and ``SEND``/``RECV``/``COLL``
complete only when their data has moved.

Data movement: a send's flow starts when the ``SEND`` issues (the receiver buffers
it), and the matching ``RECV`` (same transfer, message, buffer, peer pair) completes
when that flow finishes.  With ``serial_comm=True`` (NCCL-like: one op at a time per
worker's comm stream, both sides must be there) a comm op starts only after the
previous one completed, and a flow starts only when both its ``SEND`` and ``RECV``
have been reached, which exposes head-of-line blocking and order effects.

Devices: a message of the plan that names its devices (``Message.dst_devices``)
moves between them: a point-to-point flow runs from ``src_device`` to the first
device listed for its receiving worker (through those devices' NICs) and, when the
receiver lists several devices, is copied on from there to each other device the
blocks it needs, in parallel (the in-host fan-out the runtime does after the receive,
:mod:`~meshshard.sim.fanout`); a broadcast chains from the root's ``src_device``
through one listed device of each receiver (the runtime has one transport rank per
host), which also scatters each chunk to its host's other listed devices, so the
intra-host fan-out costs its fabric hops.  Otherwise a host's NIC device stands in.

A buffer is ready when the last instruction before the reader (in that worker's
stream) that writes it has completed; buffers nobody wrote (parameters, optimizer
state) are ready at time 0.  If some instruction can never run the engine raises
:class:`SimulationDeadlock` naming the stuck instructions.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from meshshard.admission import admit
from meshshard.cluster import ClusterSpec
from meshshard.instructions import (
    Collective,
    Instruction,
    Run,
    Send,
)
from meshshard.plan import Message, Plan
from meshshard.refs import BufferKind, CollectiveKind
from meshshard.sim.collectives import decompose
from meshshard.sim.cores import CorePool
from meshshard.sim.costs import ProgramCost, program_cost
from meshshard.sim.fanout import device_shares, scatter_broadcast, scatter_fanout
from meshshard.sim.network import FlowNetwork
from meshshard.sim.rules import RULES, CollKey, P2PKey, RunKey, StreamState
from meshshard.sim.topology import Topology, topology_of

__all__ = ["SimOptions", "SimulationDeadlock", "Timeline", "OpRecord", "execute", "check_fits"]

_INF = math.inf
PENDING, ARRIVED, STARTED, DONE = 0, 1, 2, 3


class SimulationDeadlock(RuntimeError):
    """Some instructions can never run (unmatched communication or a dependency cycle)."""


@dataclass(frozen=True)
class SimOptions:
    """How the plan executes (see the module docstring).

    Args:
        overlap: asynchronous compute and communication queues (True) or a blocking
            runtime that does one thing at a time per worker (False).
        serial_comm: one communication at a time per worker, point-to-point flows
            start only when both sides reached them (NCCL-stream semantics).
        allreduce: ``"ring"``, ``"hierarchical"`` or ``"auto"`` (see collectives).
        chunk_bytes: pipelining chunk of broadcasts; None takes the cluster's.
        max_chunks: cap on chunks per broadcast channel (chunks grow beyond it).
        record: keep spans and per-link load samples (for the trace).
        admission: topology-aware admission (TriRace): a flow starts only when no flow
            of higher instruction priority is on one of its links
            (:func:`meshshard.admission.admit`), else it waits for them.
        core_demands: ``(("s0.F", 1.6), ...)``: the cores a program keeps busy while it
            runs, where hosts share cores (``ClusterSpec.host_cores``), measured from
            its CPU time (:func:`meshshard.sim.fidelity.program_demands`); a program
            not named keeps one per device of its mesh on a host.
    """

    overlap: bool = True
    serial_comm: bool = False
    allreduce: str = "auto"
    chunk_bytes: int | None = None
    max_chunks: int = 1024
    record: bool = True
    admission: bool = False
    core_demands: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class OpRecord:
    """When one instruction of a worker's stream reached its queue head, started and ended.

    For communication, ``comm_start``/``comm_end`` bound the time its data moved (a
    send's flow, a collective from rendezvous to this member's completion); a posted
    receive waiting for its sender is started but not yet moving.
    """

    worker: int
    index: int
    instruction: Instruction
    head: float
    start: float
    end: float
    comm_start: float | None = None
    comm_end: float | None = None


class _Op:
    __slots__ = (
        "id",
        "worker",
        "index",
        "ins",
        "rule",
        "queue",
        "deps",
        "dep_i",
        "registered",
        "blocking",
        "state",
        "head",
        "start",
        "end",
        "key",
        "dur",
        "comm_start",
        "comm_end",
        "copying",
    )

    def __init__(self, oid, worker, index, ins, rule):
        self.id = oid
        self.worker = worker
        self.index = index
        self.ins = ins
        self.rule = rule
        self.queue = None
        self.deps: list[int] = []
        self.dep_i = 0
        self.registered = -1
        self.blocking = True
        self.state = PENDING
        self.head = _INF
        self.start = _INF
        self.end = _INF
        self.key = None
        self.dur = 0.0
        self.comm_start = _INF
        self.comm_end = _INF
        self.copying = False  # a completed receive whose in-host copies still run


class _Queue:
    __slots__ = ("worker", "name", "ops", "pos", "queued")

    def __init__(self, worker: int, name: str):
        self.worker = worker
        self.name = name
        self.ops: list[_Op] = []
        self.pos = 0
        self.queued = False


class _P2P:
    """A matched SEND/RECV pair."""

    __slots__ = (
        "send",
        "recv",
        "nbytes",
        "flow_done",
        "src",
        "dst",
        "channel",
        "devices",
        "fanout",
        "chunk",
    )

    def __init__(self):
        self.send: _Op | None = None
        self.recv: _Op | None = None
        self.nbytes = 0.0
        self.flow_done = False
        self.devices: tuple[int, int] | None = None  # (src device, dst device) when known
        self.fanout: tuple[tuple[int, float], ...] = ()  # (device, bytes), when several need it
        self.chunk = 0


class _Rendezvous:
    __slots__ = ("expected", "arrived")

    def __init__(self, expected: int):
        self.expected = expected
        self.arrived: list[_Op] = []


@dataclass(frozen=True)
class Timeline:
    """Raw engine output: every instruction's times, program costs, network accounting."""

    records: tuple[tuple[OpRecord, ...], ...]  # per worker, in stream order
    workers: tuple[int, ...]
    end: float
    costs: tuple[ProgramCost, ...]
    topology: Topology
    network: FlowNetwork
    notes: tuple[str, ...]


def check_fits(plan: Plan, cluster: ClusterSpec) -> None:
    """Raise ValueError, naming ``num_hosts``/``--hosts``, if the plan needs more than ``cluster`` has."""
    need_hosts = 1 + max(
        [w for w in plan.workers] + [h for m in plan.meshes for h in m.hosts], default=-1
    )
    need_devices = max((m.shape[1] for m in plan.meshes), default=1)
    problems = []
    if need_hosts > cluster.num_hosts:
        problems.append(
            f"the plan uses {need_hosts} hosts (workers w0..w{need_hosts - 1}) but cluster "
            f"{cluster} has {cluster.num_hosts}; pass --hosts {need_hosts} "
            f"(or ClusterSpec.preset(name, num_hosts={need_hosts}))"
        )
    if need_devices > cluster.devices_per_host:
        problems.append(
            f"the plan's meshes need {need_devices} devices per host but cluster {cluster} has "
            f"{cluster.devices_per_host}; choose a cluster with devices_per_host >= {need_devices}"
        )
    if problems:
        raise ValueError("plan does not fit the cluster: " + "; ".join(problems))


class _Engine:
    def __init__(self, plan: Plan, cluster: ClusterSpec, options: SimOptions, program_times):
        self.plan = plan
        self.cluster = cluster
        self.opt = options
        self.topo = topology_of(cluster)
        self.net = FlowNetwork(self.topo.capacity, record=options.record)
        self.now = 0.0
        self.heap: list = []
        self.seq = 0
        self.notes: list[str] = []
        self.ops: list[_Op] = []
        self.waiters: dict[int, list[_Op]] = {}
        self.to_pump: deque[_Queue] = deque()
        self.rdv: dict = {}
        self.p2p: dict = {}
        self.coll_cache: dict = {}
        self.in_flight: dict[int, list[int]] = {}  # link -> priorities of flows on it
        self.held: list = []  # flows admission delayed: (-priority, seq, args)
        self.mesh_of_program = {p.name: p.mesh for p in plan.programs}
        self.transfers = {t.name: t for t in plan.transfers}
        self.mesh_workers = {m.id: tuple(m.hosts) for m in plan.meshes}
        self.costs: dict[str, ProgramCost] = {}
        for p in plan.programs:
            self.costs[p.name] = program_cost(plan, p, cluster, program_times)
        missing = sorted(str(n) for n, c in self.costs.items() if c.source == "none")
        if missing:
            self.notes.append(
                "no flops/bytes or measured time for "
                + ", ".join(missing)
                + f": each costs only the launch overhead ({cluster.launch_overhead * 1e6:.3g} us)"
            )
        if program_times:
            unknown = sorted(set(program_times) - {str(p) for p in self.costs})
            if unknown:
                self.notes.append(f"program_times for unknown programs ignored: {unknown}")
        self.devices_of_mesh = {m.id: m.shape[1] for m in plan.meshes}
        self.core_demands = dict(options.core_demands)
        self.cores = (
            CorePool(self, cluster.host_cores, self._complete) if cluster.host_cores else None
        )
        self.queues: dict[int, list[_Queue]] = {}
        self._host_seconds: dict[type, float] = {}
        self._build()

    # --- building ------------------------------------------------------------------
    def _build(self) -> None:
        counts: dict = {}
        for stream in self.plan.streams:
            self._build_stream(stream, counts)
        for pair in self.p2p.values():
            self._match(pair)
        for key, n in counts.items():
            if isinstance(key, RunKey):
                self._check_run_group(key, n)
            elif isinstance(key, CollKey):
                self._check_collective_group(key, n)
            self.rdv[key] = _Rendezvous(n)

    def _build_stream(self, stream, counts: dict) -> None:
        """Ops of one worker's stream, their queues, dependencies and matching keys."""
        overlap, serial = self.opt.overlap, self.opt.serial_comm
        w = stream.worker
        qs = [_Queue(w, "compute"), _Queue(w, "comm")] if overlap else [_Queue(w, "all")]
        self.queues[w] = qs
        state = StreamState(w)
        carried = 0.0  # host seconds of communications, paid by the next compute op
        host_of = self._host_seconds  # per instruction type: the runtime's own work
        for i, ins in enumerate(stream.instructions):
            kind = type(ins)
            rule = RULES.get(kind)
            if rule is None:
                raise TypeError(f"w{w}: cannot simulate instruction {ins!r}")
            op = _Op(len(self.ops), w, i, ins, rule)
            self.ops.append(op)
            comm = ins.is_comm
            op.queue = qs[1] if (overlap and comm) else qs[0]
            op.queue.ops.append(op)
            op.blocking = (not overlap) or (not comm) or serial
            rule.build(self, op, state)
            host = host_of.get(kind)
            if host is None:
                host = host_of[kind] = self.cluster.host_seconds(ins.opcode.value)
            if comm:
                carried += host
            else:
                op.dur += host + carried
                carried = 0.0
            for b in ins.writes:
                state.last_writer[b] = op.id
            if op.key is not None:
                counts[op.key] = counts.get(op.key, 0) + 1

    def pair(self, key: P2PKey) -> _P2P:
        """The SEND/RECV pair of ``key`` (made on first use)."""
        pair = self.p2p.get(key)
        if pair is None:
            pair = self.p2p[key] = _P2P()
        return pair

    def _match(self, pair: _P2P) -> None:
        """Check a SEND has its RECV (and the reverse); size and route the message."""
        if pair.send is None or pair.recv is None:
            have = pair.send or pair.recv
            peer = have.ins.peer
            raise SimulationDeadlock(
                f"w{have.worker}: {have.ins} has no matching "
                f"{'RECV' if pair.send else 'SEND'} on w{peer} "
                f"(same transfer {have.ins.transfer}, message #{have.ins.message}, buffer "
                f"{have.ins.buffer}); the plan's streams are inconsistent"
            )
        pair.nbytes = self._message_bytes(pair.send.ins)
        pair.channel = pair.send.ins.message % self.cluster.nics_per_host
        msg = self._message(pair.send.ins)
        peer = pair.send.ins.peer
        if msg is not None and msg.src == pair.send.worker and peer in msg.receivers:
            devs = msg.dst_devices[msg.receivers.index(peer)] if msg.dst_devices else ()
            if devs:
                pair.devices = (msg.src_device, devs[0])
            if len(devs) > 1:
                shares = device_shares(msg, msg.receivers.index(peer))
                pair.fanout, pair.chunk = shares, msg.chunk_bytes

    def _check_run_group(self, key: RunKey, n: int) -> None:
        mesh = self.mesh_of_program[key.program]
        if n != len(self.mesh_workers[mesh]):
            self.notes.append(
                f"RUN {key.program} mb{key.mb} appears on {n} of mesh{mesh}'s "
                f"{len(self.mesh_workers[mesh])} workers; started when those {n} reach it"
            )

    def _check_collective_group(self, key: CollKey, n: int) -> None:
        if n != len(key.group):
            missing = sorted(set(key.group) - {op.worker for op in self.ops if op.key == key})
            raise SimulationDeadlock(
                f"COLL {key.kind.value} {key.buffer} #{key.message} over {list(key.group)} is "
                f"missing on workers {missing}; every group member must issue it"
            )

    def _message(self, ins: Send | Collective) -> Message | None:
        """The plan's message an instruction carries, or None when the plan lacks it."""
        try:
            return self.transfers[ins.transfer].messages[ins.message]
        except (KeyError, IndexError):
            return None

    def _message_bytes(self, ins: Send) -> float:
        try:
            return float(self.transfers[ins.transfer].messages[ins.message].nbytes)
        except (KeyError, IndexError):
            pass
        try:
            nbytes = float(self.plan.buffer(ins.buffer).nbytes)
        except KeyError:
            nbytes = 0.0
        self.notes.append(
            f"message {ins.transfer} #{ins.message} is not in the plan's transfers; "
            f"sized from buffer {ins.buffer} ({nbytes:.0f} B)"
        )
        return nbytes

    def _coll_bytes(self, ins: Collective) -> float:
        try:
            return float(self.transfers[ins.transfer].messages[ins.message].nbytes)
        except (KeyError, IndexError):
            pass
        try:
            return float(self.plan.reduction(ins.buffer).nbytes)
        except KeyError:
            pass
        try:
            nbytes = float(self.plan.buffer(ins.buffer).nbytes)
        except KeyError:
            self.notes.append(f"COLL {ins.kind} {ins.buffer}: size unknown, taken as 0 bytes")
            return 0.0
        if ins.buffer.kind is BufferKind.ACCUMULATORS:  # replicas' gradients
            dense, rows = self.plan.grad_nbytes(ins.buffer)
            if ins.kind is CollectiveKind.ALLGATHER:  # every member's touched rows
                return float(rows * len(ins.group))
            return dense / self._grad_chunks(ins.buffer)  # the rest, in chunks
        return nbytes

    def _grad_chunks(self, buffer) -> int:
        """How many chunks (``COLL``s) the replicas' all-reduce of ``buffer`` has."""
        if not hasattr(self, "_chunks"):
            self._chunks: dict = {}
            for st in self.plan.streams:
                for x in st.instructions:
                    if (
                        isinstance(x, Collective)
                        and x.buffer.kind is BufferKind.ACCUMULATORS
                        and x.kind is CollectiveKind.ALLREDUCE
                    ):
                        self._chunks[x.buffer] = self._chunks.get(x.buffer, 0) + 1
        return self._chunks.get(buffer, 1)

    # --- the event loop ------------------------------------------------------------
    def at(self, t: float, fn, arg) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, arg))

    def run(self) -> None:
        for qs in self.queues.values():
            for q in qs:
                self._schedule_pump(q)
        self._drain()
        net, heap = self.net, self.heap
        while True:
            t_net = net.next_time()
            t_ev = heap[0][0] if heap else _INF
            if t_net == _INF and t_ev == _INF:
                break
            if t_net <= t_ev:
                self.now = t_net
                net.advance(t_net)
            else:
                t, _, fn, arg = heapq.heappop(heap)
                self.now = t
                net.set_time(t)
                fn(arg)
            self._drain()
        self._check_done()

    def _schedule_pump(self, q: _Queue) -> None:
        if not q.queued:
            q.queued = True
            self.to_pump.append(q)

    def _drain(self) -> None:
        while self.to_pump:
            q = self.to_pump.popleft()
            q.queued = False
            self._pump(q)

    def _pump(self, q: _Queue) -> None:
        ops = q.ops
        while q.pos < len(ops):
            op = ops[q.pos]
            st = op.state
            if st == DONE or (st >= ARRIVED and not op.blocking):
                q.pos += 1
                continue
            if st != PENDING:
                return  # waiting for peers or for completion
            if op.head == _INF:
                op.head = self.now
            if not self._deps_done(op):
                return
            op.state = ARRIVED  # (inline: once per op of the plan)
            op.rule.arrive(self, op)

    def _deps_done(self, op: _Op) -> bool:
        deps, ops = op.deps, self.ops
        while op.dep_i < len(deps):
            d = deps[op.dep_i]
            if ops[d].state != DONE or ops[d].copying:
                if op.registered != d:
                    op.registered = d
                    self.waiters.setdefault(d, []).append(op)
                return False
            op.dep_i += 1
        return True

    def rendezvous(self, op: _Op) -> list[_Op] | None:
        """Register ``op`` at its rendezvous; all members (marked started) once complete.

        An op without a key (a program of a one-host mesh) needs nobody: ``[op]``.
        """
        if op.key is None:
            return [op]
        r = self.rdv[op.key]
        r.arrived.append(op)
        if len(r.arrived) != r.expected:
            return None
        for member in r.arrived:
            member.state = STARTED
            member.start = self.now
        return r.arrived

    def start(self, op: _Op) -> None:
        """Start ``op`` now; it completes after its duration (programs) or at once."""
        op.state = STARTED
        op.start = self.now
        if op.dur > 0 and self.cores is not None:
            self.cores.add(op, op.dur, self._demand(op))
        elif op.dur > 0:
            self.at(self.now + op.dur, self._complete, op)
        else:
            self._complete(op)

    def _demand(self, op: _Op) -> float:
        """Cores ``op`` keeps busy: a program its measured demand, else one per device of
        its mesh on a host; host work one."""
        if isinstance(op.ins, Run):
            measured = self.core_demands.get(str(op.ins.program))
            if measured is not None:
                return measured
            return self.devices_of_mesh[self.mesh_of_program[op.ins.program]]
        return 1

    def _complete(self, op: _Op) -> None:
        op.state = DONE
        op.end = self.now
        if op.start == _INF:
            op.start = self.now
        self._wake(op)
        self._schedule_pump(op.queue)

    def _wake(self, op: _Op) -> None:
        """Let the ops waiting on ``op`` check their dependencies again."""
        waiting = self.waiters.pop(op.id, None)
        if waiting:
            for other in waiting:
                other.registered = -1
                self._schedule_pump(other.queue)

    # --- admission ---------------------------------------------------------------------
    def flow(self, prio: int, links, nbytes: float, latency: float, on_done, label: str = ""):
        """Start a flow now, or hold it while a higher-priority flow is on its links."""
        if not self.opt.admission:
            self.net.start(self.now, links, nbytes, latency=latency, on_done=on_done, label=label)
            return
        if not admit(prio, links, self.in_flight):
            self.seq += 1
            heapq.heappush(self.held, (-prio, self.seq, links, nbytes, latency, on_done, label))
            return
        for link in links:
            self.in_flight.setdefault(link, []).append(prio)

        def finished(f, prio=prio, links=links, on_done=on_done):
            for link in links:
                self.in_flight[link].remove(prio)
            self._release()
            on_done(f)

        self.net.start(self.now, links, nbytes, latency=latency, on_done=finished, label=label)

    def _release(self) -> None:
        """Start the held flows that are admitted now, highest priority first."""
        held, self.held = self.held, []
        while held:
            neg, _, links, nbytes, latency, on_done, label = heapq.heappop(held)
            self.flow(-neg, links, nbytes, latency, on_done, label)

    # --- point to point --------------------------------------------------------------
    def arrive_p2p(self, op: _Op) -> None:
        """A SEND or RECV reached its queue head: start the flow when both sides allow."""
        pair: _P2P = self.p2p[op.key]
        op.state = STARTED
        op.start = self.now
        rendezvous = self.opt.serial_comm
        if isinstance(op.ins, Send):
            if not rendezvous or pair.recv.state >= STARTED:
                self._start_flow(pair)
        else:
            if pair.flow_done:
                self._complete(op)
            elif rendezvous and pair.send.state >= STARTED:
                self._start_flow(pair)

    def _start_flow(self, pair: _P2P) -> None:
        send = pair.send
        src = send.worker
        dst = send.ins.peer
        if pair.fanout:
            self._start_fanout(pair)
            return
        if pair.devices is not None:  # the message names its devices: route between them
            a, b = (src, pair.devices[0]), (dst, pair.devices[1])
        elif src == dst:
            g = self.cluster.devices_per_host
            a, b = (src, 0), (dst, g - 1)
        else:
            a = self.topo.nic_device(src, pair.channel)
            b = self.topo.nic_device(dst, pair.channel)
        send.comm_start = pair.recv.comm_start = self.now
        self.flow(
            send.ins.priority,
            self.topo.path(a, b),
            pair.nbytes,
            self.topo.latency(a, b),
            lambda flow, pair=pair: self._p2p_done(pair),
            send.ins.label,
        )

    def _start_fanout(self, pair: _P2P) -> None:
        """A message several devices of its receiving host need: chunks to the first, each
        copied on to the other devices that need them (:mod:`~meshshard.sim.fanout`).
        The send and the receive complete when the NIC part is done (the runtime places
        blocks on the devices when it waits for the buffer, not on its transport), so
        both workers' next communication may start; the buffer's ``WAIT`` also waits
        for the copies."""
        src, dst = pair.send.worker, pair.send.ins.peer
        d = scatter_fanout(
            (src, pair.devices[0]),
            (dst, pair.devices[1]),
            pair.nbytes,
            pair.fanout,
            self.cluster,
            chunk_bytes=pair.chunk or self.opt.chunk_bytes,
            max_chunks=self.opt.max_chunks,
        )
        steps = d.steps
        remaining = [len(s.deps) for s in steps]
        succ: list[list[int]] = [[] for _ in steps]
        for i, s in enumerate(steps):
            for dep in s.deps:
                succ[dep].append(i)
        left = [len(steps)]
        nic = [sum(1 for st in steps if st.dst == (dst, pair.devices[1]))]
        arrived = [0]
        pair.send.comm_start = pair.recv.comm_start = self.now

        def launch(i: int) -> None:
            s = steps[i]
            lat = self.topo.latency(s.src, s.dst) if s.latency else 0.0
            self.flow(
                pair.send.ins.priority,
                self.topo.path(s.src, s.dst),
                s.nbytes,
                lat,
                lambda f: done(i),
            )

        def done(i: int) -> None:
            left[0] -= 1
            for j in succ[i]:
                remaining[j] -= 1
                if remaining[j] == 0:
                    launch(j)
            if steps[i].dst == (dst, pair.devices[1]):
                arrived[0] += 1
                if arrived[0] == nic[0]:  # the NIC part is done: both sides move on
                    pair.recv.copying = left[0] > 0
                    self._p2p_done(pair)
            if left[0] == 0 and pair.recv.copying:
                pair.recv.copying = False  # the copies are done: its WAIT may complete
                self._wake(pair.recv)

        for i, n in enumerate(remaining):
            if n == 0:
                launch(i)

    def _p2p_done(self, pair: _P2P) -> None:
        pair.flow_done = True
        pair.send.comm_end = pair.recv.comm_end = self.now
        self._complete(pair.send)
        if pair.recv.state >= STARTED:
            self._complete(pair.recv)

    # --- collectives -------------------------------------------------------------------
    def start_collective(self, members: list[_Op]) -> None:
        """All members of a collective arrived: launch its decomposed flows."""
        ins: Collective = members[0].ins
        nbytes = self._coll_bytes(ins)
        devices = self._broadcast_devices(ins)
        msg = self._message(ins) if ins.kind == "broadcast" else None
        chunk = (msg.chunk_bytes if msg is not None else 0) or self.opt.chunk_bytes
        key = (ins.kind, ins.group, ins.root, nbytes, devices, chunk)
        prep = self.coll_cache.get(key)
        if prep is None:
            prep = self.coll_cache[key] = self._prepare_collective(ins, nbytes, devices, chunk)
        paths, lats, sizes, succ, ndeps, touching, per_member = prep
        by_worker = {op.worker: op for op in members}
        left = dict(per_member)
        remaining = list(ndeps)
        for w, n in left.items():
            if n == 0:
                self._complete(by_worker[w])

        def launch(i: int) -> None:
            self.flow(ins.priority, paths[i], sizes[i], lats[i], lambda f, i=i: done(i))

        def done(i: int) -> None:
            for s in succ[i]:
                remaining[s] -= 1
                if remaining[s] == 0:
                    launch(s)
            for w in touching[i]:
                left[w] -= 1
                if left[w] == 0:
                    self._complete(by_worker[w])

        for i, n in enumerate(ndeps):
            if n == 0:
                launch(i)

    def _broadcast_devices(self, ins: Collective) -> tuple | None:
        """``((host, ((device, bytes), ...)), ...)`` of a broadcast whose message names its
        devices (``src_device`` on the root, then what each receiver's devices need,
        :func:`~meshshard.sim.fanout.device_shares`), else None."""
        if ins.kind != "broadcast":
            return None
        msg = self._message(ins)
        if msg is None or not msg.group or len(msg.dst_devices) != len(msg.group) - 1:
            return None
        pairs = [(msg.group[0], ((msg.src_device, float(msg.nbytes)),))]
        pairs += [(h, device_shares(msg, r)) for r, h in enumerate(msg.group[1:])]
        return tuple(pairs)

    def _prepare_collective(
        self, ins: Collective, nbytes: float, devices: tuple | None = None, chunk: int | None = None
    ):
        if devices:  # one rank per host: a host chain, each host scattering to its devices
            (root, ((src_device, _),)), *receivers = devices
            d = scatter_broadcast(
                (root, src_device),
                receivers,
                nbytes,
                self.cluster,
                chunk_bytes=chunk or self.opt.chunk_bytes,
                max_chunks=self.opt.max_chunks,
            )
        else:
            d = decompose(
                ins.kind,
                ins.group,
                ins.root,
                nbytes,
                self.cluster,
                allreduce=self.opt.allreduce,
                chunk_bytes=chunk or self.opt.chunk_bytes,
                max_chunks=self.opt.max_chunks,
            )
        steps = d.steps
        paths = [self.topo.path(s.src, s.dst) for s in steps]
        lats = [self.topo.latency(s.src, s.dst) if s.latency else 0.0 for s in steps]
        sizes = [s.nbytes for s in steps]
        succ: list[list[int]] = [[] for _ in steps]
        for i, s in enumerate(steps):
            for dep in s.deps:
                succ[dep].append(i)
        ndeps = [len(s.deps) for s in steps]
        members = set(ins.group)
        touching = [tuple(sorted({s.src[0], s.dst[0]} & members)) for s in steps]
        per_member = {w: 0 for w in ins.group}
        for t in touching:
            for w in t:
                per_member[w] += 1
        return paths, lats, sizes, succ, ndeps, touching, per_member

    # --- the end -----------------------------------------------------------------------
    def _check_done(self) -> None:
        stuck = [op for op in self.ops if op.state != DONE]
        if not stuck:
            return
        lines = ["the plan cannot finish: these instructions never completed"]
        for w, qs in sorted(self.queues.items()):
            for q in qs:
                if q.pos < len(q.ops):
                    op = q.ops[q.pos]
                    lines.append(f"  w{w} {q.name} queue: {op.ins}  <-- {self._why(op)}")
        hint = (
            " (with overlap=False every SEND/RECV blocks; the streams must order them so each "
            "blocking send finds its receiver)"
            if not self.opt.overlap
            else ""
        )
        raise SimulationDeadlock("\n".join(lines) + hint)

    def _why(self, op: _Op) -> str:
        if op.state == PENDING:
            for d in op.deps[op.dep_i :]:
                other = self.ops[d]
                if other.state != DONE:
                    return f"waits for w{other.worker}#{other.index} {other.ins}"
            return "never reached"
        if op.state == ARRIVED and op.key in self.rdv:
            r = self.rdv[op.key]
            here = sorted(o.worker for o in r.arrived)
            return f"rendezvous: {len(here)} of {r.expected} arrived ({here})"
        if isinstance(op.key, P2PKey):
            pair = self.p2p[op.key]
            other = pair.recv if isinstance(op.ins, Send) else pair.send
            return f"waits for w{other.worker}#{other.index} {other.ins}"
        return "in flight"

    def timeline(self) -> Timeline:
        end = max((op.end for op in self.ops), default=0.0)
        end = max(end, self.net.now)
        self.net.finish_stats(end)
        records = []
        workers = []
        by_worker: dict[int, list[OpRecord]] = {}
        for op in self.ops:
            comm = (None, None)
            if op.rule.comm_span == "rendezvous":
                comm = (op.start, op.end)
            elif op.rule.comm_span == "flow":
                comm = (op.comm_start, op.comm_end)
            by_worker.setdefault(op.worker, []).append(
                OpRecord(
                    op.worker, op.index, op.ins, min(op.head, op.start), op.start, op.end, *comm
                )
            )
        for w in sorted(by_worker):
            workers.append(w)
            records.append(tuple(by_worker[w]))
        return Timeline(
            tuple(records),
            tuple(workers),
            end,
            tuple(self.costs.values()),
            self.topo,
            self.net,
            tuple(self.notes),
        )


def execute(
    plan: Plan,
    cluster: ClusterSpec,
    options: SimOptions = SimOptions(),
    program_times: Mapping[str, float] | None = None,
) -> Timeline:
    """Run ``plan``'s streams on ``cluster`` and return every instruction's times.

    Raises ValueError if the plan does not fit the cluster and
    :class:`SimulationDeadlock` if its streams cannot finish.
    """
    return _ran(plan, cluster, options, program_times).timeline()


def finish_time(
    plan: Plan,
    cluster: ClusterSpec,
    options: SimOptions = SimOptions(),
    program_times: Mapping[str, float] | None = None,
) -> float:
    """When :func:`execute`'s timeline ends (its ``end``), without building the
    timeline's per-instruction records: for searches that compare many plans' times."""
    engine = _ran(plan, cluster, options, program_times)
    return max(max((op.end for op in engine.ops), default=0.0), engine.net.now)


def _ran(plan, cluster, options, program_times) -> _Engine:
    check_fits(plan, cluster)
    engine = _Engine(plan, cluster, options, program_times)
    engine.run()
    return engine
