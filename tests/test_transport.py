"""The torch transport's data path: DLPack device tensors on NCCL + GPU, NumPy bytes on
gloo, and a clear error when the transport is made for NCCL with host data.

No GPU here: the backend name and the device platform are faked, and torch.distributed's
point-to-point calls are replaced by an in-memory mailbox, so the tests check which
path is taken, that device blocks reach torch without a copy, and that a sharded array
crosses between two meshes' interpreters on the device path.  What only a GPU can
check is listed in BUILD_NOTES.md.
"""

from dataclasses import dataclass

import jax
import numpy as np
import pytest
import torch
import torch.distributed as dist

from meshshard.errors import MeshshardInputError
from meshshard.passes.lower_transfer import transfer_streams
from meshshard.plan import MeshSpec, Message, Plan, Schedule, TensorSpec, TransferSpec
from meshshard.runtime import transport as tp
from meshshard.runtime.device_blocks import DeviceBlocks
from meshshard.runtime.interpreter import JaxBlocks, StreamInterpreter
from meshshard.runtime.programs import make_mesh, sharding


@dataclass(frozen=True)
class FakeGPU:
    """What the transport reads of a JAX device, with a GPU platform."""

    platform: str = "gpu"
    local_hardware_id: int = 0
    process_index: int = 0


class FakeDist:
    """torch.distributed's isend/irecv/broadcast over in-memory mailboxes (one process)."""

    def __init__(self):
        self.rank = 0
        self.mail: dict = {}
        self.sent: list = []

    class Work:
        def __init__(self, fn=None):
            self.fn = fn

        def wait(self):
            if self.fn is not None:
                self.fn()

    def isend(self, tensor, dst, tag):
        self.sent.append(tensor)
        self.mail.setdefault((self.rank, dst, tag), []).append(tensor.clone())
        return self.Work()

    def irecv(self, tensor, src, tag):
        box = self.mail.setdefault((src, self.rank, tag), [])
        return self.Work(lambda: tensor.copy_(box.pop(0)))


@pytest.fixture
def nccl(monkeypatch):
    """torch.distributed reports an initialized NCCL group; sends go to a FakeDist."""
    fake = FakeDist()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "isend", fake.isend)
    monkeypatch.setattr(dist, "irecv", fake.irecv)
    # the fake GPU's memory is this process's CPU memory
    monkeypatch.setattr(tp, "_torch_device", lambda device: torch.device("cpu"))
    return fake


@pytest.mark.parametrize(
    "backend,platform,path",
    [("gloo", "cpu", tp.HOST), ("gloo", "gpu", tp.HOST), ("gloo", None, tp.HOST)]
    + [("nccl", p, tp.DEVICE) for p in tp.GPU_PLATFORMS],
)
def test_data_path_by_backend_and_platform(backend, platform, path):
    assert tp.data_path(backend, platform) == path


def test_nccl_with_host_data_fails_when_the_transport_is_made(nccl):
    fix = r"Run the plan on GPU devices .* or use the gloo backend for host data"
    with pytest.raises(
        MeshshardInputError, match=r"backend is NCCL but .* on 'cpu' devices.*" + fix
    ):
        tp.TorchTransport(0, devices=jax.devices()[:1])
    with pytest.raises(MeshshardInputError, match=r"NCCL .* host NumPy tiles .*" + fix):
        tp.TorchTransport(0)  # a transfer-only plan moves NumPy tiles
    assert nccl.sent == []


def test_gloo_sends_numpy_bytes(monkeypatch):
    fake = FakeDist()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "isend", fake.isend)
    t = tp.TorchTransport(0, devices=jax.devices()[:1])
    assert (t.backend, t.path, t.device) == ("gloo", tp.HOST, None)
    data = np.arange(4, dtype=np.int32)
    t.isend(data, 1, tag=7).wait()
    assert fake.sent[0].dtype == torch.uint8
    assert fake.sent[0].numpy().tobytes() == data.tobytes()


def test_device_path_hands_the_jax_array_to_torch_without_a_copy(nccl):
    t = tp.TorchTransport(0, devices=[FakeGPU()])
    assert (t.backend, t.path) == ("nccl", tp.DEVICE)
    block = jax.numpy.arange(6, dtype=jax.numpy.float32).reshape(2, 3)
    t.isend(block, 1, tag=3)
    sent = nccl.sent[0]
    assert sent.dtype == torch.uint8 and sent.numel() == block.nbytes
    assert sent.data_ptr() == block.unsafe_buffer_pointer()  # DLPack view, no host copy
    with pytest.raises(Exception, match="handed a host NumPy block"):
        t.isend(np.zeros(3, np.float32), 1, tag=4)

    nccl.rank = 1
    got = tp.TorchTransport(1, devices=[FakeGPU()]).irecv(block.nbytes, 0, tag=3).wait()
    assert isinstance(got, jax.Array) and got.dtype == np.uint8
    assert np.asarray(got).tobytes() == np.asarray(block).tobytes()


def transfer_plan(shape, src, src_spec, dst, dst_spec, messages) -> Plan:
    t = TransferSpec(
        "t0", TensorSpec(0, "x", shape, "float32", src_spec), dst_spec, 0, 1, "-", "-", messages
    )
    return Plan(
        method="transfer",
        cluster=None,
        num_micro_batches=1,
        fingerprint="",
        meshes=(src, dst),
        stages=(),
        programs=(),
        buffers=(),
        transfers=(t,),
        schedule=Schedule("none", 0, 1, ()),
        streams=transfer_streams(t, (src, dst)),
        inputs=(),
        outputs=(),
    )


def test_a_sharded_array_crosses_meshes_on_the_device_path(nccl, monkeypatch):
    """Worker 0 (2 devices, rows sharded) sends to worker 1 (2 devices, replicated):
    the interpreters pick DeviceBlocks, read blocks as device arrays and rebuild the
    value on the destination mesh with the planned sharding."""
    shape = (4, 6)
    src, dst = MeshSpec(0, (1, 2), (0,)), MeshSpec(1, (1, 2), (1,))
    msgs = (
        Message(0, 1, ((0, 2), (0, 6)), 48, src_device=0),
        Message(0, 1, ((2, 4), (0, 6)), 48, src_device=1),
    )
    plan = transfer_plan(shape, src, ("device",), dst, (), msgs)
    buf = plan.transfers[0].name.buffer(0)
    full = np.arange(24, dtype=np.float32).reshape(shape)
    devs = jax.devices()
    meshes = {0: make_mesh(devs[0:2], (1, 2)), 1: make_mesh(devs[2:4], (1, 2))}
    value = jax.device_put(full, sharding(meshes[0], ("device",)))
    reads = []
    real_read = DeviceBlocks.read

    def spy(self, v, index):
        reads.append(real_read(self, v, index))
        return reads[-1]

    monkeypatch.setattr(DeviceBlocks, "read", spy)
    out = {}
    for w in (0, 1):  # the sender runs first: its sends wait in the mailbox
        nccl.rank = w
        fake_gpus = [FakeGPU(local_hardware_id=i) for i in range(2)]
        t = tp.TorchTransport(w, devices=fake_gpus)
        interp = StreamInterpreter(plan.streams[w], plan, {}, meshes[w], t)
        assert isinstance(interp.blocks, DeviceBlocks)
        out[w] = interp.run({buf: (value,)} if w == 0 else {}, load=None)
    assert len(reads) == 2 and all(isinstance(r, jax.Array) for r in reads)
    got = out[1][buf][0]
    assert got.sharding == sharding(meshes[1], ())
    np.testing.assert_array_equal(np.asarray(got), full)
    for shard in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full)


def test_host_path_keeps_the_numpy_adapter():
    t = tp.QueueTransport.group([0])[0]
    mesh = make_mesh(jax.devices()[:1], (1, 1))
    plan = transfer_plan((2,), MeshSpec(0, (1, 1), (0,)), (), MeshSpec(1, (1, 1), (1,)), (), ())
    assert isinstance(StreamInterpreter(plan.streams[0], plan, {}, mesh, t).blocks, JaxBlocks)
