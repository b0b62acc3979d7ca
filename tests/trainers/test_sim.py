"""The simulated job (trainers.sim): engine semantics, timing against closed forms, equivalence
with real gloo ranks, determinism."""

import json
import statistics

import numpy as np
import pytest
import torch

from emulator.simnet import FluidNetwork
from tests.trainers.conftest import BASE_CONFIG, merge, records, run_sessions
from trainers.loading import load_config
from trainers import clock
from trainers.sim import ComputeModel, Deadlock, SimClock, SimComm, Simulator, layer_macs, run_simulated

MB = 1e6


def network(n, latency_s=0.05, rate_bytes=125e6):
    lat = np.full((n, n), latency_s)
    np.fill_diagonal(lat, 0.0)
    return FluidNetwork(latency_s=lat, rate=np.full((n, n), rate_bytes), jitter_s=np.zeros((n, n)),
                        loss=np.zeros((n, n)), tcp_window=1e12, region_of=tuple(f"r{i}" for i in range(n)),
                        tcp=False)  # the fluid and the rendezvous alone (TCP's own terms: test_simnet)


def simulate(n, body, net=None):
    """Run body(sim, comm, log) on every rank; returns the log of (rank, what, virtual s, value)."""
    sim = Simulator(n, net or network(n), ComputeModel(0.0))
    log = []
    sim.run([lambda r=r: body(sim, SimComm(sim, r), log) for r in range(n)])
    return log


@pytest.mark.parametrize("receive_early_s, starts_at", [(0.0, 0.05), (0.5, 0.5)])
def test_a_message_moves_once_the_receiver_is_ready_then_takes_bytes_over_rate_and_a_delay(receive_early_s, starts_at):
    # gloo's rendezvous: the receiver's "ready" notice needs one delay to reach the sender, so with
    # both posted at once the data leaves one delay late; a receive posted long before costs nothing
    def body(sim, comm, log):
        if comm.rank == 0:
            sim.sleep(receive_early_s)
            comm.isend(torch.full((250_000,), 7.0), 1).wait()   # 1 MB at 1 MB/s
            log.append(("sent", sim.now))
        else:
            tensor = torch.zeros(250_000)
            comm.recv(tensor, 0)
            log.append(("received", sim.now, tensor[0].item()))

    log = dict((entry[0], entry[1:]) for entry in simulate(2, body, network(2, 0.05, 1 * MB)))
    assert log["sent"][0] == pytest.approx(starts_at + 1.0)
    assert log["received"] == (pytest.approx(starts_at + 1.05), 7.0)


def test_messages_match_receives_by_source_in_order():
    def body(sim, comm, log):
        if comm.rank in (1, 2):
            for i in range(3):
                comm.send(torch.tensor([10.0 * comm.rank + i]), 0)
        else:
            got = []
            for _ in range(6):
                tensor = torch.zeros(1)
                source = comm.recv_any(tensor)
                got.append((source, tensor.item()))
            log.append(got)

    (got,) = simulate(3, body)
    for source in (1, 2):
        assert [v for s, v in got if s == source] == [10.0 * source + i for i in range(3)]


def test_an_all_reduce_ends_one_delay_after_the_last_rank_entered():
    def body(sim, comm, log):
        sim.sleep(0.1 * comm.rank)        # ranks enter at 0, 0.1, 0.2 s
        tensor = torch.full((4,), float(comm.rank + 1))
        comm.allreduce_async(tensor, "sum", algorithm="direct").wait()
        log.append((comm.rank, sim.now, tensor[0].item()))

    log = sorted(simulate(3, body, network(3, 0.05, 1e12)))
    # direct exchange: a rank is done when every other rank's tensor has arrived, and each tensor
    # leaves once its sender entered and heard that the receiver did (one delay): rank 2 entered
    # last, so rank 0's tensor leaves at 0.2 + 0.05 and reaches it at 0.3
    assert [t for _, t, _ in log] == pytest.approx([0.25, 0.25, 0.3])
    assert {v for _, _, v in log} == {6.0}


def test_every_rank_waiting_for_nothing_is_a_deadlock_named_per_rank():
    def body(sim, comm, log):
        comm.recv(torch.zeros(1), 1 - comm.rank)

    with pytest.raises(Deadlock, match="rank 0: receive from rank 1"):
        simulate(2, body)


def config(tmp_path, name, **changes):
    return load_config(merge(BASE_CONFIG, {**changes, "output_dir": str(tmp_path / name)}))


def test_sync_step_is_compute_plus_the_exchange(tmp_path):
    cfg = config(tmp_path, "sync", steps=12)
    run_simulated(cfg, 2, network(2, 0.05, 125e6), ComputeModel(0.010, 0.002))
    steps = records(tmp_path / "sync", 0, "step")
    nbytes = 4 * sum(p.numel() for p in torch.nn.Linear(64, 32).parameters()) + 4 * (32 * 10 + 10)
    exchange = 2 * 0.05 + nbytes / 125e6
    # every step: forward + backward, the one all-reduce (the direct exchange: the receiver's
    # "ready" notice one way, the tensor the other: a round trip), overhead
    per_step = (steps[-1]["time_s"] - steps[1]["time_s"]) / (len(steps) - 2)
    assert per_step == pytest.approx(0.010 + exchange + 0.002, rel=1e-3)
    # one bucket: launched when the whole backward is done, so all of the exchange is waited for
    assert statistics.mean(r["comm_blocked_s"] for r in steps[2:]) == pytest.approx(exchange, rel=0.02)
    assert steps[0]["compute_unpadded_s"] == pytest.approx(0.010)


def test_same_seed_same_records(tmp_path):
    def run(name):
        cfg = config(tmp_path, name, algorithm={"name": "swarmsgd", "params": {"H": 2}}, steps=20)
        run_simulated(cfg, 4, network(4, 0.03, 10 * MB), ComputeModel(0.004, 0.001))
        out = []
        for rank in range(4):
            for record in records(tmp_path / name, rank):
                record.pop("time_unix")
                record.pop("max_rss_mib", None)
                out.append(record)
        return out

    first, second = run("a"), run("b")
    assert [r for r in first if r["kind"] == "step"] and first == second


def test_ddp_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="ddp cannot run on sim"):
        run_simulated(config(tmp_path, "ddp", algorithm={"name": "ddp"}), 2, network(2), ComputeModel(0.01))


@pytest.mark.slow
def test_sync_on_sim_equals_sync_on_real_gloo_ranks(tmp_path, spawn_ranks):
    changes = {"save_final_model": True, "steps": 15, "optimizer": {"momentum": 0.9}}
    real = run_sessions(spawn_ranks, tmp_path / "real", 2, {"sync": changes})["sync"]
    cfg = config(tmp_path, "sim", **changes)
    run_simulated(cfg, 2, network(2), ComputeModel(0.01))
    for rank in range(2):
        a = torch.load(real / f"rank{rank}_final.pt")
        b = torch.load(tmp_path / "sim" / f"rank{rank}_final.pt")
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert [r["loss"] for r in records(real, 0, "step")] == pytest.approx(
        [r["loss"] for r in records(tmp_path / "sim", 0, "step")], abs=1e-6)


def test_a_collective_on_a_down_path_waits_for_the_link_to_come_back():
    from emulator.linkspec import LinkSpec

    def body(sim, comm, log):
        tensor = torch.full((4,), float(comm.rank + 1))
        comm.allreduce_async(tensor, "sum", algorithm="ring").wait()
        log.append((comm.rank, sim.now, tensor[0].item()))

    down = LinkSpec(one_way_delay_ms=50, rate_bit_s=1e9, loss_fraction=1.0)
    sim = Simulator(2, network(2, 0.05, 1e12), ComputeModel(0.0))
    log = []
    sim.run([lambda r=r: body(sim, SimComm(sim, r), log) for r in range(2)],
            actions=[(0.0, lambda s: s.network.set_link("r0", "r1", down)),
                     (1.0, lambda s: s.network.set_link("r0", "r1", None))])
    # from the link's return at 1 s: 2 ring steps, each a notice one way and the chunk the other
    assert sorted(log) == [(0, pytest.approx(1.2), 3.0), (1, pytest.approx(1.2), 3.0)]


def test_multiply_accumulates_of_a_conv_and_a_linear_layer():
    conv, linear = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Linear(512, 10)
    image = conv(torch.zeros(2, 3, 8, 8))
    # each kernel element once per output pixel, each bias once per output element
    assert layer_macs(conv, list(conv.parameters()), image) == 8 * 3 * 9 * (2 * 8 * 8) + 2 * 8 * 8 * 8
    assert layer_macs(linear, list(linear.parameters()), linear(image.flatten(1))) == 512 * 10 * 2 + 2 * 10


def test_the_forward_pass_spends_its_time_layer_by_layer_by_multiply_accumulates():
    """From the second step on, a layer's share of the forward pass is spent as it ends, so what
    waits before a later layer (P3's per-layer wait) overlaps the earlier layers' compute. Here the
    conv layer holds 14,336 of the 19,466 multiply-accumulates per image, the linear layer most of
    the parameters."""
    sim = Simulator(1, network(1), ComputeModel(1.0, forward_fraction=0.5))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(512, 10))
    reached_linear = []
    model[2].register_forward_pre_hook(lambda module, inputs: reached_linear.append(clock.perf_counter()))
    sim_clock = SimClock(sim, 0.0)
    previous = clock.install(sim_clock)

    def body():
        sim_clock.attach(model)
        for _ in range(2):
            started = clock.perf_counter()
            model(torch.zeros(2, 3, 8, 8)).sum().backward()
            clock.compute_done(started)

    try:
        sim.run([body])
    finally:
        clock.install(previous)
    # the first forward only measures (its share is spent with the first gradient)
    assert reached_linear == pytest.approx([0.0, 1.0 + 0.5 * 14_336 / 19_466])
    assert sim.now == pytest.approx(2.0)
