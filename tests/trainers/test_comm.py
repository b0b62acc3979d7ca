"""The comm layer on 2 real gloo ranks: results of every operation and their byte/time accounting."""

import json
import time

import pytest
import torch

from trainers.comm import Comm, Work


@pytest.mark.slow
def test_every_operation_and_its_accounting(spawn_ranks, tmp_path):
    from tests.trainers.workers import comm_worker

    assert spawn_ranks(comm_worker, 2, str(tmp_path)) == [0, 0]
    results = [json.loads((tmp_path / f"comm{r}.json").read_text()) for r in range(2)]
    for rank, res in enumerate(results):
        assert res["sum"] == 3.0
        assert res["avg"] == 1.5
        assert res["broadcast"] == [1.0] * 10
        assert res["all_gather"] == [0.0, 1.0]
        assert res["p2p"] == [float(i + 100 * (1 - rank)) for i in range(5)]
        assert res["fp16_avg"] == 1.0 and res["fp16_same_buffer"]
        # Ring model with n=2: 2(n-1)/n = 1 tensor each way per all_reduce.
        assert res["after_all_reduce"] == 2 * 4000
        assert res["fp16_bytes"] == 64 * 2
        stats = res["stats"]
        assert stats["all_reduce"]["calls"] == 3
        assert stats["all_gather"]["bytes_sent"] == 12 and stats["all_gather"]["bytes_recv"] == 12
        assert stats["barrier"]["calls"] == 1 and stats["barrier"]["bytes_sent"] == 0
        sent_p2p = stats["send"]["bytes_sent"] + stats["isend"]["bytes_sent"]
        recv_p2p = stats["recv"]["bytes_recv"] + stats["irecv"]["bytes_recv"]
        assert sent_p2p == 20 and recv_p2p == 20
        total_sent = sum(s["bytes_sent"] for s in stats.values())
        assert res["totals"][0] == total_sent
        assert res["totals"][2] > 0.0  # blocking calls took some time
    # Broadcast: the root (rank 1) sends one copy to the other rank, which receives it.
    assert results[1]["stats"]["broadcast"]["bytes_sent"] == 40 and results[1]["stats"]["broadcast"]["bytes_recv"] == 0
    assert results[0]["stats"]["broadcast"]["bytes_recv"] == 40 and results[0]["stats"]["broadcast"]["bytes_sent"] == 0


class SlowLocalComm(Comm):
    """A world of one whose all_reduce takes 50 ms to complete (a stand-in for a network)."""

    def _all_reduce(self, tensor, op):
        return (lambda: (time.sleep(0.05), tensor)[1]), (lambda: False)

    def _unused(self, *args):
        raise NotImplementedError("only all_reduce is needed here")

    _broadcast = _all_gather = _isend = _irecv = _barrier = _unused


def test_shutdown_ends_gloos_threads_even_after_an_optimizer_was_made(spawn_ranks, tmp_path):
    """A group torch._dynamo's first import still holds cannot be freed: its threads then run on
    into the interpreter's exit, which aborts (SIGABRT) now and then. TorchComm imports it first."""
    from tests.trainers.workers import gloo_threads_worker

    assert spawn_ranks(gloo_threads_worker, 2, str(tmp_path)) == [0, 0]
    for rank in range(2):
        threads = json.loads((tmp_path / f"threads{rank}.json").read_text())
        assert threads and not [t for t in threads if "gloo" in t], f"rank {rank} still runs {threads}"


def test_chained_work_counts_blocked_time_once():
    """A handle derived with then() must not add its inner wait a second time."""
    comm = SlowLocalComm(rank=0, world_size=1)
    work = comm.all_reduce(torch.ones(4), async_op=True).then(lambda t: t * 2)
    assert isinstance(work, Work)
    assert work.wait().tolist() == [2.0] * 4
    assert 0.05 <= comm.stats.blocked_s < 0.09


@pytest.mark.slow
def test_ring_all_reduce_equals_all_reduce_on_three_ranks(spawn_ranks, tmp_path):
    from tests.trainers.workers import ring_worker

    assert spawn_ranks(ring_worker, 3, str(tmp_path)) == [0, 0, 0]
    for rank in range(3):
        for row in json.loads((tmp_path / f"ring{rank}.json").read_text()):
            assert row["max_error"] < 1e-5, row
            if row["numel"] == 100_003:
                # Two passes of n-1 = 2 chunks of about numel/3 floats each.
                assert abs(row["ring_bytes"] - 4 * 100_003 * 4 / 3) <= 16, row


class LaunchOnly(Comm):
    """A comm that overrides only ``_launch`` of the all-reduce template (as the simulator's does):
    it records each launch and sums nothing (the tensor comes back as it was)."""

    def __init__(self, rank: int, world_size: int, allreduce: str = "auto"):
        super().__init__(rank, world_size, allreduce)
        self.launches: list[tuple[str, str, int]] = []

    def _launch(self, tensor, op, algorithm, tag):
        self.launches.append((op, algorithm, tag))
        return (lambda: tensor), (lambda: True)

    # the collective hooks: not reached by allreduce_async unless it takes the backend's own
    _all_reduce = _broadcast = _all_gather = _isend = _irecv = _barrier = None


def test_allreduce_async_is_a_template_whose_exchange_is_the_launch_hook():
    from trainers.comm import allreduce_bytes

    comm = LaunchOnly(rank=1, world_size=4)
    small, large = torch.ones(8), torch.ones(8 * 2**20)  # 32 B and 32 MiB: direct and ring under auto
    assert comm.allreduce_async(small, op="avg").wait() is small
    comm.allreduce_async(large).wait()
    comm.allreduce_async(small, algorithm="recursive_doubling").wait()
    # the template resolved auto by size, and gave each launch the next message tag
    assert comm.launches == [("avg", "direct", 0), ("sum", "ring", 1), ("sum", "recursive_doubling", 2)]
    expected = [allreduce_bytes(a, 1, 4, t) for a, t in (("direct", small), ("ring", large),
                                                           ("recursive_doubling", small))]
    per_op = comm.stats.per_op["all_reduce"]
    assert per_op.calls == 3
    assert (per_op.bytes_sent, per_op.bytes_recv) == tuple(map(sum, zip(*expected)))
    with pytest.raises(ValueError, match="op: 'prod'"):
        comm.allreduce_async(small, op="prod")  # the template's checks, before any launch
    assert len(comm.launches) == 3


def test_the_simulators_comm_overrides_the_launch_hook_alone():
    from trainers.sim.comm import SimComm

    assert "allreduce_async" not in vars(SimComm)
    assert SimComm.allreduce_async is Comm.allreduce_async
    assert SimComm._launch is not Comm._launch
