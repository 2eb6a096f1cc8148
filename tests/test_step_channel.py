"""Step calls over direct connections (runtime/step_channel.py): framing, the token, and
faults named as Ray-path faults are; on the Ray cluster, the same results either way."""

import socket
import threading

import jax
import numpy as np
import pytest

import meshshard
from examples import mlp
from meshshard.runtime.faults import WorkerFault
from meshshard.runtime.step_channel import (
    ChannelServer,
    StepChannel,
    gather_channels,
    recv_exact,
    recv_msg,
    send_msg,
)
from tests.conftest import assert_trees_close


def test_replies_carry_results_arrays_and_raised_messages():
    def handler(x):
        if x is None:
            raise KeyError("no input")
        return np.arange(x)

    server = ChannelServer(b"t0k3n", handler, "127.0.0.1")
    ch = StepChannel(server.address, b"t0k3n")
    big = 3 << 20  # several MiB: the framing reads until every byte arrived
    ch.send((big,))
    ok, value = ch.recv()
    assert ok and value.shape == (big,) and value[-1] == big - 1
    ch.send((None,))
    assert ch.recv() == (False, "KeyError: 'no input'")
    ch.close()
    server.close()


def test_a_wrong_token_gets_no_answer():
    server = ChannelServer(b"right", lambda: 1, "127.0.0.1")
    ch = StepChannel(server.address, b"wrong")
    with pytest.raises((EOFError, OSError)):  # the server hangs up, seen here or there
        ch.send(())
        ch.recv()
    ch.close()
    right = StepChannel(server.address, b"right")  # the server accepts the next one
    right.send(())
    assert right.recv() == (True, 1)
    right.close()
    server.close()


def test_a_raised_step_fails_and_its_waiting_peer_counts_as_blocked():
    release = threading.Event()
    raises = ChannelServer(b"k", lambda: 1 / 0, "127.0.0.1")
    waits = ChannelServer(b"k", release.wait, "127.0.0.1")
    channels = {0: StepChannel(raises.address, b"k"), 1: StepChannel(waits.address, b"k")}
    for ch in channels.values():
        ch.send(())
    with pytest.raises(WorkerFault) as err:
        gather_channels(channels, "step of plan x", deaths=lambda hosts, timeout_s: {}, grace_s=0.2)
    f = err.value.failure
    assert (f.dead, f.failed, f.blocked) == (
        (),
        ((0, "ZeroDivisionError: division by zero"),),
        (1,),
    )
    release.set()
    for ch in channels.values():
        ch.close()
    raises.close()
    waits.close()


def test_a_closed_connection_is_a_death_when_ray_says_so():
    listener = socket.create_server(("127.0.0.1", 0))

    def accept_and_close():  # an actor process that dies during the call
        conn, _ = listener.accept()
        recv_exact(conn, 1)  # the token
        recv_msg(conn)  # the call, never answered
        conn.close()

    threading.Thread(target=accept_and_close, daemon=True).start()
    ok = ChannelServer(b"k", lambda: "done", "127.0.0.1")
    channels = {0: StepChannel(ok.address, b"k"), 3: StepChannel(listener.getsockname(), b"k")}
    for ch in channels.values():
        ch.send(())
    asked = []

    def deaths(hosts, timeout_s):
        asked.extend(hosts)
        return {3: "process 99: The actor died"}

    with pytest.raises(WorkerFault) as err:
        gather_channels(channels, "step", deaths=deaths, grace_s=0.5)
    f = err.value.failure
    assert asked == [3]
    assert (f.dead, f.failed, f.blocked) == (((3, "process 99: The actor died"),), (), ())
    for ch in channels.values():
        ch.close()
    ok.close()
    listener.close()


@pytest.mark.ray
def test_steps_over_connections_equal_steps_over_ray_calls(ray_cluster):
    batch = mlp.make_batch(8)
    state = mlp.make_state(mlp.MLP(num_layers=4), batch["x"])
    method = meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    ref_step = jax.jit(mlp.train_step)
    ref, ref_loss = state, None
    for _ in range(3):
        ref, ref_loss = ref_step(ref, batch)
    got = {}
    for on in (True, False):
        ray_cluster.use_step_channel = on
        ray_cluster.close_channels()
        try:
            step = meshshard.parallelize(mlp.train_step, method=method)
            s = state
            for _ in range(3):
                s, loss = step(s, batch)
            got[on] = (meshshard.fetch(s), loss)
            assert bool(ray_cluster._channels) == on  # the path the steps took
        finally:
            ray_cluster.use_step_channel = True
    for s, loss in got.values():
        assert_trees_close(ref.params, s.params)
        assert_trees_close(ref_loss, loss)


def test_arrays_travel_out_of_band_and_arrive_equal_and_writable():
    a, b = socket.socketpair()
    sent = [np.arange(1 << 20, dtype=np.float32), np.ones((4, 6))[:, ::2], 7, "x", np.int64(3)]
    sender = threading.Thread(target=send_msg, args=(a, sent))
    sender.start()
    got = recv_msg(b)
    sender.join()
    assert got[2:4] == [7, "x"] and got[4] == 3
    for want, have in zip(sent[:2], got[:2], strict=True):
        np.testing.assert_array_equal(want, have)
    got[0][0] = -1.0  # backed by the received bytes, usable in place
    a.close()
    b.close()


@pytest.mark.ray
def test_a_connection_that_cannot_open_falls_back_to_ray_calls(ray_cluster, monkeypatch, caplog):
    import meshshard.runtime.step_channel as step_channel

    def refuse(address, token, timeout_s=30.0):
        raise ConnectionRefusedError("firewalled")

    batch = mlp.make_batch(8)
    state = mlp.make_state(mlp.MLP(num_layers=2), batch["x"])
    method = meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    step = meshshard.parallelize(mlp.train_step, method=method)
    ray_cluster.close_channels()
    monkeypatch.setattr(step_channel, "StepChannel", refuse)
    try:
        got, loss = step(state, batch)
        assert not ray_cluster.use_step_channel and not ray_cluster._channels
        assert "step calls go through Ray from now on" in caplog.text
    finally:
        ray_cluster.use_step_channel = True
    ref, ref_loss = jax.jit(mlp.train_step)(state, batch)
    assert_trees_close(ref.params, meshshard.fetch(got).params)
    assert_trees_close(ref_loss, loss)
