"""Described clusters: what planning and simulation know about the hardware.

Planning code never touches Ray: it reads a :class:`ClusterSpec`, which a live
cluster (``meshshard.init``) reports about itself, or which a user writes down (or
takes from a preset) to plan for a cluster they are not sitting at.

A spec describes ``num_hosts`` identical hosts.  Each host has ``devices_per_host``
devices (peak FLOP/s per dtype, memory size and bandwidth), an intra-host fabric
(every device has one port into it, ``intra_bandwidth`` per direction: NVLink,
NVSwitch, or memcpy between emulated CPU devices) and ``nics_per_host`` NICs, each
full duplex (``nic_bandwidth`` out *and* in).  Device ``d`` reaches other hosts
through NIC ``nic_of_device[d]``.  Hosts meet at a switch that is non-blocking unless
``oversubscription`` > 1.  Units are SI throughout: bytes, bytes/s, FLOP/s, seconds.

    >>> spec = ClusterSpec.preset("dgx-a100", num_hosts=2)
    >>> print(spec)
    dgx-a100 (2 hosts x 8 devices)
    >>> spec.nic_bandwidth  # 200 Gb/s HDR InfiniBand, in bytes/s
    25000000000.0
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

__all__ = ["ClusterSpec", "PRESETS", "LOCAL_MESH_COLLECTIVES", "gbit", "register_preset"]


def gbit(gbits_per_s: float) -> float:
    """Convert a link rate in Gb/s (how NICs are sold) to bytes/s (what the simulator uses)."""
    return gbits_per_s * 1e9 / 8


# Figures of the development machine (2 cores, 23.5 GiB) emulating 4 hosts x 2 CPU
# devices, from `meshshard calibrate` runs (the machine is shared, so they vary):
# gloo send/recv between two processes 2.6-2.9 GB/s and 90-150 us one way; float32
# matmul 60-110 GFLOP/s for the whole machine; numpy copy 11.6 GB/s (the fabric
# between emulated devices).  Each device gets 1/8 of the machine's compute, memory
# and memory bandwidth (reads + writes).  They describe the default ``local`` cluster;
# on another machine run `meshshard calibrate --out local.json`.
_LOCAL = dict(
    device="cpu",
    peak_flops=(("float32", 1.0e10),),
    device_memory=3.0e9,
    memory_bandwidth=2.9e9,
    launch_overhead=5e-5,
    intra_fabric="memcpy",
    intra_bandwidth=11.6e9,
    intra_latency=5e-6,
    nics_per_host=1,
    nic_bandwidth=2.7e9,
    nic_latency=1e-4,
    oversubscription=1.0,
)


#: In-program collectives on this machine's emulated cluster (``mesh_collective_*`` of
#: the local clusters): a ``psum`` over 2 JAX processes joined by ``jax.distributed``
#: with gloo took 0.8-0.9 ms at 16-256 KiB and 2.9 / 7.2 ms at 1 / 4 MiB (median of 30,
#: less a no-collective program's time); over 2 emulated devices of one process, 60-500
#: us (2026-12-02, the machine otherwise idle).  Fitted alpha-beta: 0.8 ms + 1/0.66 GB/s
#: across processes, 80 us + the fabric's bandwidth within one.
LOCAL_MESH_COLLECTIVES = dict(
    mesh_collective_latency=(8e-4, 8e-5),
    mesh_collective_bandwidth=(6.6e8, _LOCAL["intra_bandwidth"]),
)

_OPCODES = ("LOAD", "ZEROS", "RUN", "SEND", "RECV", "COLL", "WAIT", "WAITALL", "FREE")


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster of ``num_hosts`` identical hosts with ``devices_per_host`` devices each.

    Args:
        name: a label shown in plans (``"local-4x2"``, ``"dgx-a100"``).
        num_hosts: number of hosts (one host-actor each at run time).
        devices_per_host: accelerator (or emulated CPU) devices per host.
        device: the device model, for people (``"V100-SXM2-16GB"``).
        peak_flops: peak FLOP/s of one device per dtype, as ``((dtype, flops), ...)``;
            a ``{dtype: flops}`` mapping is accepted and normalised.
        device_memory: bytes of memory per device.
        memory_bandwidth: bytes/s between a device and its memory (roofline).
        launch_overhead: seconds added to every program run (launch, dispatch).
        intra_fabric: kind of intra-host fabric (``nvlink``, ``nvswitch``, ``pcie``, ``memcpy``).
        intra_bandwidth: bytes/s of one device's port into the fabric, per direction.
        intra_latency: seconds each intra-host message pays.
        nics_per_host: NICs per host.
        nic_bandwidth: bytes/s of one NIC per direction (full duplex).
        nic_latency: seconds each inter-host message pays (wire, switch, library).
        nic_of_device: NIC index used by each device; empty means devices are spread
            evenly (device ``d`` uses NIC ``d * nics_per_host // devices_per_host``).
        oversubscription: switch oversubscription; 1.0 is non-blocking, ``r`` > 1 caps
            all inter-host traffic together at ``hosts * nics * nic_bandwidth / r``.
        chunk_bytes: chunk size of pipelined collectives (NCCL-style chain broadcast).
        host_cores: CPU cores all hosts share (an emulated cluster on one machine); 0
            means enough cores for everything.  When more work runs than there are
            cores, every running program slows down (processor sharing, sim/cores.py).
        instruction_overhead: host seconds the runtime spends on each LOAD, ZEROS,
            FREE, WAIT and WAITALL (Python interpreter, array bookkeeping).
        opcode_overheads: host seconds per instruction of a given opcode, as
            ``(("ZEROS", 0.01), ("SEND", 0.004), ...)``, overriding
            ``instruction_overhead``; a communication's host time (``SEND``, ``RECV``,
            ``COLL``) delays that worker's next compute-queue instruction, as the
            runtime's one host thread issues both.
        dispatch_overhead: driver seconds per step (handing inputs to the workers,
            collecting results), added to the iteration.
        mesh_collective_latency: seconds per step of a collective *inside* a compiled
            program, as ``(host axis, device axis)``; ``()`` means the NIC and fabric
            latencies.  XLA's own collectives can be far slower than the transport's
            messages (on the local cluster gloo between JAX processes, see
            :data:`LOCAL_MESH_COLLECTIVES`); the sharding solver prices them with these.
        mesh_collective_bandwidth: bytes/s of those collectives, ``(host axis, device
            axis)``; ``()`` means the NICs' (shared, oversubscribed) and the fabric's.
        max_mesh_hosts: hosts one mesh may span (0: any); the in-process threads
            backend runs single-host meshes only, so its clusters say 1 and
            ``stages="auto"`` searches single-host submeshes there.
        worker_blocks: ``()`` for a cluster as started (one worker per host, all of its
            devices).  In the worker view :meth:`split` makes, where several meshes
            share a host: ``(host, first device, devices)`` of each worker (host-actor),
            ``num_hosts`` workers in all, ``devices_per_host`` the largest block.
        source: where the figures come from (citations, or the calibration run).
    """

    name: str = "local"
    num_hosts: int = 4
    devices_per_host: int = 2
    device: str = _LOCAL["device"]
    peak_flops: tuple[tuple[str, float], ...] = _LOCAL["peak_flops"]
    device_memory: float = _LOCAL["device_memory"]
    memory_bandwidth: float = _LOCAL["memory_bandwidth"]
    launch_overhead: float = _LOCAL["launch_overhead"]
    intra_fabric: str = _LOCAL["intra_fabric"]
    intra_bandwidth: float = _LOCAL["intra_bandwidth"]
    intra_latency: float = _LOCAL["intra_latency"]
    nics_per_host: int = _LOCAL["nics_per_host"]
    nic_bandwidth: float = _LOCAL["nic_bandwidth"]
    nic_latency: float = _LOCAL["nic_latency"]
    nic_of_device: tuple[int, ...] = ()
    oversubscription: float = _LOCAL["oversubscription"]
    chunk_bytes: int = 1 << 20
    host_cores: int = 0
    instruction_overhead: float = 0.0
    opcode_overheads: tuple[tuple[str, float], ...] = ()
    dispatch_overhead: float = 0.0
    mesh_collective_latency: tuple[float, ...] = ()
    mesh_collective_bandwidth: tuple[float, ...] = ()
    max_mesh_hosts: int = 0
    worker_blocks: tuple[tuple[int, int, int], ...] = ()
    source: str = "built-in defaults for an emulated CPU cluster (see meshshard calibrate)"

    def __post_init__(self) -> None:
        for field_name in ("num_hosts", "devices_per_host", "nics_per_host", "chunk_bytes"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"ClusterSpec.{field_name} must be a positive int, got {value!r}; "
                    f"pass e.g. ClusterSpec({field_name}=2)"
                )
        flops = self.peak_flops
        if isinstance(flops, Mapping):
            flops = tuple(flops.items())
        flops = tuple((str(k), float(v)) for k, v in flops)
        if not flops or any(not math.isfinite(v) or v <= 0 for _, v in flops):
            raise ValueError(
                f"ClusterSpec.peak_flops must map dtypes to positive FLOP/s, got {self.peak_flops!r}; "
                "pass e.g. peak_flops={'float32': 15.7e12}"
            )
        object.__setattr__(self, "peak_flops", flops)
        for field_name in (
            "device_memory",
            "memory_bandwidth",
            "intra_bandwidth",
            "nic_bandwidth",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(
                    f"ClusterSpec.{field_name} must be a positive number, got {value!r}"
                )
        if (
            not isinstance(self.host_cores, int)
            or isinstance(self.host_cores, bool)
            or (self.host_cores < 0)
        ):
            raise ValueError(
                f"ClusterSpec.host_cores must be an int >= 0 (0 = no limit), got "
                f"{self.host_cores!r}; pass e.g. ClusterSpec(host_cores=os.cpu_count())"
            )
        for field_name in (
            "launch_overhead",
            "intra_latency",
            "nic_latency",
            "instruction_overhead",
            "dispatch_overhead",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(
                    f"ClusterSpec.{field_name} must be a number of seconds >= 0, got {value!r}"
                )
        if not self.oversubscription >= 1:
            raise ValueError(
                f"ClusterSpec.oversubscription must be >= 1 (1 = non-blocking switch), "
                f"got {self.oversubscription!r}"
            )
        nic_of = tuple(int(n) for n in self.nic_of_device)
        if nic_of and (
            len(nic_of) != self.devices_per_host
            or any(not 0 <= n < self.nics_per_host for n in nic_of)
        ):
            raise ValueError(
                f"ClusterSpec.nic_of_device must give one NIC index in [0, {self.nics_per_host}) "
                f"for each of the {self.devices_per_host} devices, got {self.nic_of_device!r}; "
                "pass () to spread devices evenly over the NICs"
            )
        object.__setattr__(self, "nic_of_device", nic_of)
        blocks = tuple(tuple(int(x) for x in b) for b in self.worker_blocks)
        object.__setattr__(self, "worker_blocks", blocks)
        if blocks and (
            len(blocks) != self.num_hosts
            or any(len(b) != 3 or b[0] < 0 or b[1] < 0 or b[2] < 1 for b in blocks)
            or max(b[2] for b in blocks) != self.devices_per_host
            or len(set(blocks)) != len(blocks)
        ):
            raise ValueError(
                f"ClusterSpec.worker_blocks must give (host, first device, devices) for each "
                f"of the {self.num_hosts} workers, the largest {self.devices_per_host} "
                f"devices, got {self.worker_blocks!r}; make it with ClusterSpec.split"
            )
        if not isinstance(self.max_mesh_hosts, int) or self.max_mesh_hosts < 0:
            raise ValueError(
                f"ClusterSpec.max_mesh_hosts must be an int >= 0 (0 = any), got "
                f"{self.max_mesh_hosts!r}"
            )
        for field_name, positive in (
            ("mesh_collective_latency", False),
            ("mesh_collective_bandwidth", True),
        ):
            value = tuple(float(v) for v in getattr(self, field_name))
            if value and (len(value) != 2 or any(v <= 0 if positive else v < 0 for v in value)):
                raise ValueError(
                    f"ClusterSpec.{field_name} must be () or (host axis, device axis) numbers "
                    f"{'> 0' if positive else '>= 0'}, got {getattr(self, field_name)!r}"
                )
            object.__setattr__(self, field_name, value)
        ops = self.opcode_overheads
        if isinstance(ops, Mapping):
            ops = tuple(ops.items())
        try:
            ops = tuple(sorted((str(k).upper(), float(v)) for k, v in ops))
        except (TypeError, ValueError):
            ops = ((str(self.opcode_overheads), -1.0),)
        if any(k not in _OPCODES or not v >= 0 for k, v in ops):
            raise ValueError(
                f"ClusterSpec.opcode_overheads must map opcodes ({', '.join(_OPCODES)}) to "
                f"seconds >= 0, got {self.opcode_overheads!r}; pass e.g. "
                "opcode_overheads={'ZEROS': 0.01}"
            )
        object.__setattr__(self, "opcode_overheads", ops)

    # --- derived -------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        """Total devices in the cluster."""
        return self.num_hosts * self.devices_per_host

    @property
    def physical_hosts(self) -> int:
        """Hosts of the machine this spec describes (``num_hosts`` unless split)."""
        if not self.worker_blocks:
            return self.num_hosts
        return max(h for h, _, _ in self.worker_blocks) + 1

    def physical_host(self, worker: int) -> int:
        """The physical host that worker (host-actor) ``worker`` runs on."""
        return self.worker_blocks[worker][0] if self.worker_blocks else worker

    def worker_devices(self, worker: int) -> int:
        """How many devices worker ``worker`` owns."""
        return self.worker_blocks[worker][2] if self.worker_blocks else self.devices_per_host

    def split(self, blocks) -> ClusterSpec:
        """The worker view of this cluster in which each worker (host-actor) owns one
        block of a host's devices, so several meshes can share a host (one host-actor per
        submesh, as Alpa launches a worker per submesh).  ``blocks``: ``(host, first
        device, devices)`` per worker, in worker order, or an int ``k``: every host as
        ``k`` equal blocks.

        ``nics_per_host`` stays the physical host's count: the simulator's topology maps
        workers back to their host, so two workers of one host talk over its fabric and
        share its NICs; on a ``memcpy`` fabric (emulated CPU devices) each worker is a
        process priced as a host of its own.

        >>> str(ClusterSpec(num_hosts=2, devices_per_host=4).split(2))
        'local (4 workers on 2 hosts: h0 2+2, h1 2+2 devices)'
        >>> ClusterSpec(num_hosts=1, devices_per_host=4).split([(0, 0, 1), (0, 1, 3)]).num_hosts
        2
        """
        if self.worker_blocks:
            raise ValueError("ClusterSpec.split: this spec is already a worker view")
        D = self.devices_per_host
        if isinstance(blocks, int):
            if blocks < 1 or D % blocks:
                raise ValueError(
                    f"ClusterSpec.split({blocks!r}): the parts must divide devices_per_host={D}"
                )
            b = D // blocks
            blocks = [(h, i * b, b) for h in range(self.num_hosts) for i in range(blocks)]
        blocks = tuple(tuple(int(x) for x in blk) for blk in blocks)
        used: dict[int, set[int]] = {}
        for h, first, n in blocks:
            devs = set(range(first, first + n))
            if (
                not (0 <= h < self.num_hosts)
                or first < 0
                or first + n > D
                or used.get(h, set()) & devs
            ):
                raise ValueError(
                    f"ClusterSpec.split: block (host {h}, devices {first}..{first + n - 1}) "
                    f"is outside {self} or overlaps another block"
                )
            used.setdefault(h, set()).update(devs)
        return replace(
            self,
            num_hosts=len(blocks),
            devices_per_host=max(n for _, _, n in blocks),
            nic_of_device=(),
            worker_blocks=blocks,
        )

    def nic_of(self, device: int) -> int:
        """The NIC that device ``device`` of a host sends and receives through."""
        if self.nic_of_device:
            return self.nic_of_device[device]
        return device * self.nics_per_host // self.devices_per_host

    def devices_of_nic(self, nic: int) -> tuple[int, ...]:
        """The devices of a host that share NIC ``nic``."""
        return tuple(d for d in range(self.devices_per_host) if self.nic_of(d) == nic)

    def host_seconds(self, opcode: str) -> float:
        """Host seconds the runtime spends on one instruction of ``opcode`` (``"ZEROS"``):
        its ``opcode_overheads`` entry, else ``instruction_overhead`` for the local
        instructions and 0 for programs and communication."""
        for k, v in self.opcode_overheads:
            if k == opcode:
                return v
        if opcode in ("LOAD", "ZEROS", "WAIT", "WAITALL", "FREE"):
            return self.instruction_overhead
        return 0.0

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s of one device for ``dtype`` (falls back to float32, then the first entry)."""
        table = dict(self.peak_flops)
        if dtype in table:
            return table[dtype]
        return table.get("float32", self.peak_flops[0][1])

    # --- text ----------------------------------------------------------------------
    def __str__(self) -> str:
        if self.worker_blocks:
            per = {}
            for h, _, n in sorted(self.worker_blocks):  # each host's blocks in device order
                per.setdefault(h, []).append(str(n))
            hosts = ", ".join(f"h{h} {'+'.join(ns)}" for h, ns in sorted(per.items()))
            return f"{self.name} ({self.num_hosts} workers on {len(per)} hosts: {hosts} devices)"
        return f"{self.name} ({self.num_hosts} hosts x {self.devices_per_host} devices)"

    def describe(self) -> str:
        """A few lines with every figure in human units, for logs and the CLI."""
        flops = ", ".join(f"{k} {v / 1e12:.4g} TFLOP/s" for k, v in self.peak_flops)
        over = (
            "non-blocking switch"
            if self.oversubscription == 1
            else f"switch oversubscribed {self.oversubscription:g}:1"
        )
        return "\n".join(
            [
                str(self),
                f"  device {self.device}: {flops}; {self.device_memory / 2**30:.4g} GiB at "
                f"{self.memory_bandwidth / 1e9:.4g} GB/s; launch {self.launch_overhead * 1e6:.3g} us",
                f"  intra-host {self.intra_fabric}: {self.intra_bandwidth / 1e9:.4g} GB/s per device "
                f"per direction, {self.intra_latency * 1e6:.3g} us",
                f"  {self.nics_per_host} NIC(s) per host: {self.nic_bandwidth * 8 / 1e9:.4g} Gb/s "
                f"each way, {self.nic_latency * 1e6:.3g} us; {over}",
                f"  source: {self.source}",
            ]
        )

    def mesh_collective(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """((alpha, bytes/s) of the host axis, (alpha, bytes/s) of the device axis) of a
        collective inside a compiled program on this cluster."""
        host_bw = self.nic_bandwidth * self.nics_per_host / self.oversubscription
        lat = self.mesh_collective_latency or (self.nic_latency, self.intra_latency)
        bw = self.mesh_collective_bandwidth or (host_bw, self.intra_bandwidth)
        return (lat[0], bw[0]), (lat[1], bw[1])

    # --- JSON ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-ready dict; :meth:`from_dict` reads it back."""
        d = asdict(self)
        d["peak_flops"] = dict(self.peak_flops)
        d["nic_of_device"] = list(self.nic_of_device)
        d["mesh_collective_latency"] = list(self.mesh_collective_latency)
        d["mesh_collective_bandwidth"] = list(self.mesh_collective_bandwidth)
        d["opcode_overheads"] = dict(self.opcode_overheads)
        return d

    @staticmethod
    def from_dict(d: dict) -> ClusterSpec:
        """Inverse of :meth:`to_dict`; missing fields take their defaults (old plans)."""
        known = {f.name for f in fields(ClusterSpec)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"unknown ClusterSpec field(s) {unknown}; known fields are {sorted(known)}"
            )
        d = dict(d)
        for key in ("nic_of_device", "mesh_collective_latency", "mesh_collective_bandwidth"):
            if key in d:
                d[key] = tuple(d[key])
        return ClusterSpec(**d)

    def to_json(self, indent: int | None = 2) -> str:
        """Serialise to JSON text (what ``meshshard calibrate --out`` writes)."""
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_json(text: str) -> ClusterSpec:
        """Inverse of :meth:`to_json`."""
        return ClusterSpec.from_dict(json.loads(text))

    @staticmethod
    def load(path: str) -> ClusterSpec:
        """Read a spec written by :meth:`to_json` (e.g. ``local.json`` from calibration)."""
        with open(path) as f:
            return ClusterSpec.from_json(f.read())

    # --- presets -------------------------------------------------------------------
    @staticmethod
    def preset(name: str, num_hosts: int | None = None) -> ClusterSpec:
        """The preset cluster ``name`` (see :data:`PRESETS`), optionally with ``num_hosts`` hosts.

        >>> ClusterSpec.preset("aws-p3.8xlarge", num_hosts=5).num_devices
        20
        """
        if name not in PRESETS:
            raise ValueError(
                f"unknown cluster preset {name!r}; choose one of {sorted(PRESETS)}, "
                "or load a JSON file with ClusterSpec.load(path)"
            )
        spec = PRESETS[name]
        return spec if num_hosts is None else replace(spec, num_hosts=num_hosts)

    @staticmethod
    def presets() -> tuple[str, ...]:
        """Names of the registered presets."""
        return tuple(sorted(PRESETS))


PRESETS: dict[str, ClusterSpec] = {}


def register_preset(spec: ClusterSpec) -> ClusterSpec:
    """Add ``spec`` to the preset registry under ``spec.name`` (replacing any old entry)."""
    PRESETS[spec.name] = spec
    return spec


# --- presets with their public sources --------------------------------------------
#
# AWS P3 launch table (aws.amazon.com/ec2/instance-types/p3/; the 2017 AWS blog
# "New - Amazon EC2 Instances with Up to 8 NVIDIA Tesla V100 GPUs (P3)"):
#   p3.8xlarge: 4 x V100 16 GiB, NVLink 200 GB/s, 10 Gbps network;
#   p3.16xlarge: 8 x V100 16 GiB, NVLink 300 GB/s, 25 Gbps network.
# NVIDIA V100 SXM2 datasheet: 15.7 TFLOP/s fp32, 125 TFLOP/s tensor (fp16), 900 GB/s
# HBM2.  V100 has 6 NVLink2 links of 25 GB/s per direction (300 GB/s both ways), which
# is the AWS p3.16xlarge figure; we read AWS's NVLink column as per-GPU bidirectional,
# so p3.8xlarge gets 100 GB/s per device per direction and p3.16xlarge 150 GB/s.  The
# hybrid cube-mesh gives some GPU pairs fewer links; a per-device port ignores that.
# Latencies are not published: 5 us NVLink, 30 us over the 10/25 Gb/s ENA (TCP) are the
# middle of the ranges in PAPER_NOTES section 4.1 (calibrate to replace them).
_V100 = dict(
    device="V100-SXM2-16GB",
    peak_flops=(("float32", 15.7e12), ("float16", 125e12)),
    device_memory=16 * 2**30,
    memory_bandwidth=900e9,
    launch_overhead=10e-6,
    intra_fabric="nvlink",
    intra_latency=5e-6,
    nics_per_host=1,
    nic_latency=30e-6,
)
register_preset(
    ClusterSpec(
        name="aws-p3.8xlarge",
        num_hosts=5,
        devices_per_host=4,
        intra_bandwidth=100e9,
        nic_bandwidth=gbit(10),
        source="AWS P3 table (4 x V100, NVLink 200 GB/s, 10 Gbps); NVIDIA V100 datasheet; "
        "5 hosts = the cross-mesh resharding paper's testbed (MLSys'23 artifact)",
        **_V100,
    )
)
register_preset(
    ClusterSpec(
        name="aws-p3.16xlarge",
        num_hosts=8,
        devices_per_host=8,
        intra_bandwidth=150e9,
        nic_bandwidth=gbit(25),
        source="AWS P3 table (8 x V100, NVLink 300 GB/s, 25 Gbps); NVIDIA V100 datasheet; "
        "8 hosts = 64 GPUs, the PipeDream-2BW testbed (ICML'21)",
        **_V100,
    )
)

# NVIDIA DGX A100 datasheet (nvidia.com, "NVIDIA DGX A100 | Datasheet"): 8 x A100 80GB
# SXM4, 6 NVSwitches, 600 GB/s NVLink per GPU (bidirectional, so 300 GB/s per
# direction), 8 single-port ConnectX-6 200 Gb/s HDR InfiniBand for compute traffic,
# one per GPU through a shared PCIe switch.  A100 datasheet: 19.5 TFLOP/s fp32,
# 156 TF32, 312 fp16/bf16 (dense), 2,039 GB/s HBM2e (80 GB).
register_preset(
    ClusterSpec(
        name="dgx-a100",
        num_hosts=1,
        devices_per_host=8,
        device="A100-SXM4-80GB",
        peak_flops=(
            ("float32", 19.5e12),
            ("tfloat32", 156e12),
            ("bfloat16", 312e12),
            ("float16", 312e12),
        ),
        device_memory=80 * 2**30,
        memory_bandwidth=2039e9,
        launch_overhead=10e-6,
        intra_fabric="nvswitch",
        intra_bandwidth=300e9,
        intra_latency=5e-6,
        nics_per_host=8,
        nic_bandwidth=gbit(200),
        nic_latency=10e-6,
        nic_of_device=tuple(range(8)),
        source="NVIDIA DGX A100 and A100 datasheets (8 x A100 80GB, NVSwitch 600 GB/s per GPU, "
        "8 x 200 Gb/s HDR IB)",
    )
)

# NVIDIA DGX H100 user guide and H100 datasheet: 8 x H100 SXM5 80 GB, 4 NVSwitches,
# NVLink4 900 GB/s per GPU bidirectional (450 GB/s per direction); 8 ConnectX-7
# 400 Gb/s NDR InfiniBand ports for compute (one per GPU, the guide's OSFP port
# table maps each to a GPU).  H100 SXM5: 67 TFLOP/s fp32, 494.7 TF32, 989.4 bf16/fp16
# (dense; the headline figures are with sparsity), 3.35 TB/s HBM3.
register_preset(
    ClusterSpec(
        name="dgx-h100",
        num_hosts=1,
        devices_per_host=8,
        device="H100-SXM5-80GB",
        peak_flops=(
            ("float32", 67e12),
            ("tfloat32", 494.7e12),
            ("bfloat16", 989.4e12),
            ("float16", 989.4e12),
            ("float8", 1978.9e12),
        ),
        device_memory=80 * 2**30,
        memory_bandwidth=3.35e12,
        launch_overhead=10e-6,
        intra_fabric="nvswitch",
        intra_bandwidth=450e9,
        intra_latency=5e-6,
        nics_per_host=8,
        nic_bandwidth=gbit(400),
        nic_latency=10e-6,
        nic_of_device=tuple(range(8)),
        source="NVIDIA DGX H100 user guide and H100 datasheet (8 x H100 80GB, NVLink4 900 GB/s "
        "per GPU, 8 x 400 Gb/s NDR IB)",
    )
)

# An emulated CPU cluster on this machine (the defaults above); `meshshard calibrate
# --out local.json` measures a better one.
register_preset(ClusterSpec(name="local", **LOCAL_MESH_COLLECTIVES))
