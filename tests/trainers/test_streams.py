"""MessageStreams (trainers/comm/streams.py): keyed messages between every pair of ranks, sent one at a
time per destination in priority or FIFO order; on the threaded driver gloo's comm uses (with a
transport the test holds) and on the simulator's; the comms that cannot carry them say so."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from emulator.simnet import FluidNetwork
from trainers.comm import Comm, MessageStreams, TorchComm
from trainers.comm.tcp import TcpComm
from trainers.sim import ComputeModel, SimComm, Simulator


class HeldComm(Comm):
    """Rank 0 whose stream messages are handed to the transport only when the test releases them
    (one ``released`` permit each), on the threaded driver that gloo's comm uses."""

    def __init__(self, world_size: int = 2):
        super().__init__(rank=0, world_size=world_size)
        self.released = threading.Semaphore(0)

    def tagged_isend(self, tensor, dst, tag):
        return (lambda: self.released.acquire(timeout=10) or pytest.fail("never released")), (lambda: False)

    def tagged_irecv(self, tensor, src, tag):
        raise NotImplementedError

    def _all_reduce(self, tensor, op):
        raise NotImplementedError

    def _broadcast(self, tensor, src):
        return (lambda: tensor), (lambda: True)

    def _all_gather(self, outputs, tensor):
        raise NotImplementedError

    def _isend(self, tensor, dst):
        raise NotImplementedError

    def _irecv(self, tensor, src):
        raise NotImplementedError

    def _barrier(self):
        return (lambda: None), (lambda: True)


@pytest.mark.parametrize("order, expected", [("priority", [10, 1, 11, 12]), ("fifo", [10, 11, 12, 1])])
def test_a_message_put_later_with_a_higher_priority_overtakes_the_queued_ones(order, expected):
    """10 is handed to the transport at once and 11, 12 wait behind it; 1, put last, goes next by
    priority (never recalling 10, already handed over), last in FIFO order."""
    comm = HeldComm()
    streams = MessageStreams(comm, 4, torch.float32, on_message=None, order=order)
    for priority in (10, 11, 12, 1):
        streams.put([1], key=priority, payload=torch.full((4,), float(priority)), priority=priority)
    assert list(streams.sent) == [(1, 10)]
    for _ in range(4):
        comm.released.release()
    streams.close()
    assert [key for _, key in streams.sent] == expected
    assert comm.stats.per_op["isend"].calls == 4
    assert comm.stats.per_op["isend"].bytes_sent == 4 * (8 + 4 * 4)  # each message: its key and payload


def test_a_put_to_this_rank_is_delivered_at_once():
    got = []
    streams = MessageStreams(HeldComm(), 2, torch.float32, on_message=lambda *message: got.append(message))
    streams.put([0], key=7, payload=torch.ones(2))
    assert len(got) == 1 and got[0][:2] == (0, 7) and got[0][2].tolist() == [1.0, 1.0]
    assert not streams.sent


def test_a_message_built_in_place_is_sent_as_it_is():
    """new_message: the payload is written once, in the buffer the transport sends (put copies a
    tensor, not a message); its key is written by put."""
    handed = []

    class Recording(HeldComm):
        def tagged_isend(self, tensor, dst, tag):
            handed.append(tensor)
            return (lambda: None), (lambda: True)

    streams = MessageStreams(Recording(), 3, torch.float32, on_message=None)
    message = streams.new_message()
    message.payload.copy_(torch.tensor([1.0, 2.0, 3.0]))
    streams.put([1], key=42, payload=message)
    streams.close()
    (sent,) = handed
    assert sent.data_ptr() == message.buffer.data_ptr() and sent.numel() == 8 + 3 * 4
    assert sent[:8].view(torch.int64).item() == 42 and sent[8:].view(torch.float32).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="a message of 20 bytes, this stream's are 24"):
        MessageStreams(HeldComm(), 4, torch.float32, on_message=None).put([1], 1, message)


def test_closing_on_an_error_drops_the_queue_waits_briefly_and_names_a_thread_left_running(caplog):
    """close(drain=False): what is queued is dropped, the send in flight (held by its peer) is
    waited for only ``timeout_s``, then named in a warning; close returns and raises nothing."""
    comm = HeldComm()
    streams = MessageStreams(comm, 4, torch.float32, on_message=None)
    for key in (1, 2):
        streams.put([1], key=key, payload=torch.zeros(4))
    (thread,) = [t for _, t in streams.driver._workers.values()]
    with caplog.at_level("WARNING", logger="trainers.comm"):
        streams.close(drain=False, timeout_s=0.2)
    assert thread.is_alive() and list(streams.sent) == [(1, 1)]
    assert ("rank 0: message stream thread stream-send-1-rank0 (send, peer rank 1) still waits on its operation "
            "0.2 s after close; left running") in caplog.messages
    comm.released.release()  # the peer takes it after all: the thread ends, and 2 is never sent
    thread.join(timeout=10)
    assert not thread.is_alive() and list(streams.sent) == [(1, 1)]


def sim_network(n, latency_s=0.0005, rate_bytes=125e6):
    latency = np.full((n, n), latency_s)
    np.fill_diagonal(latency, 0.0)
    return FluidNetwork(latency_s=latency, rate=np.full((n, n), rate_bytes), jitter_s=np.zeros((n, n)),
                        loss=np.zeros((n, n)), tcp_window=1e12, region_of=tuple(f"r{i}" for i in range(n)), tcp=False)


@pytest.mark.parametrize("order, expected", [("priority", [10, 1, 11, 12]), ("fifo", [10, 11, 12, 1])])
def test_on_the_simulator_the_receiver_gets_them_in_the_order_sent(order, expected):
    """The simulator's driver: events instead of threads, the same order on both sides."""
    sim = Simulator(2, sim_network(2, 0.01, 1e6), ComputeModel(0.0))
    sent, arrived = {}, []

    def body(rank):
        comm = SimComm(sim, rank)
        streams = MessageStreams(comm, 25_000, torch.float32, order=order,
                                 on_message=lambda src, key, payload: arrived.append((key, payload[0].item(), sim.now)))
        if rank == 0:
            for priority in (10, 11, 12):  # 0.1 s each at 1 MB/s
                streams.put([1], priority, torch.full((25_000,), float(priority)), priority=priority)
            sim.sleep(0.05)                 # 10 is on the wire
            streams.put([1], 1, torch.full((25_000,), 1.0), priority=1)
            streams.close()
            sent[rank] = [key for _, key in streams.sent]
        else:
            streams.expect(0, 4)
            streams.wait_until(lambda: len(arrived) == 4)
            streams.close()

    sim.run([lambda r=r: body(r) for r in range(2)])
    assert sent[0] == expected
    assert [(key, value) for key, value, _ in arrived] == [(k, float(k)) for k in expected]
    # the first leaves once the receiver's "ready" notice arrived (one delay), the rest back to back
    assert arrived[-1][2] == pytest.approx(0.01 + 4 * 100_008 / 1e6 + 0.01)


def test_comms_without_tagged_messages_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="TcpComm has no tagged point-to-point messages"):
        TcpComm.stream_driver(object.__new__(TcpComm))
    nccl = object.__new__(TorchComm)
    nccl.backend = "nccl"
    with pytest.raises(NotImplementedError, match="NCCL does not allow"):
        nccl.stream_driver()




def test_a_killed_rank_receives_and_sends_nothing_more():
    """A message whose last byte left before its receiver was killed arrives after: nobody reads it
    (no callback of the dead rank runs, so it sends nothing in answer); and a send of the dead
    rank matched after the kill never starts its flow (gloo's data leaves only from a live process)."""
    net = sim_network(3, 0.5, 1e6)
    sim = Simulator(3, net, ComputeModel(0.0))
    got, answered = [], []

    def body(rank):
        comm = SimComm(sim, rank)
        if rank == 0:  # killed at 0.8 s; rank 1's message (out at 0.6 s) arrives at 1.1 s
            streams = MessageStreams(comm, 25_000, torch.float32, on_message=lambda src, key, payload: (
                got.append((src, key)), streams.put([2], key, payload)))
            streams.expect(1, 1)
            streams.put([2], 5, torch.zeros(25_000))  # rank 2 posts its receives only at 1 s
            streams.wait_until(lambda: len(got) == 1)
        elif rank == 1:
            streams = MessageStreams(comm, 25_000, torch.float32, on_message=None)
            streams.put([0], 7, torch.zeros(25_000))
            streams.close()
            sim.sleep(1.0)
            sim.settle()
        else:
            streams = MessageStreams(comm, 25_000, torch.float32,
                                     on_message=lambda src, key, payload: answered.append((src, key)))
            sim.sleep(1.0)
            streams.expect(0, 2)
            sim.sleep(2.0)  # rank 0's message would have arrived at 2.1 s
            sim.settle()

    sim.run([lambda r=r: body(r) for r in range(3)], actions=[(0.8, lambda s: s.crash(0))])
    assert not sim.errors
    assert got == [] and answered == []
    assert net.in_flight() == 0
