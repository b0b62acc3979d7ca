"""The simulated job (trainers.sim): engine semantics, timing against closed forms, equivalence
with real gloo ranks, determinism."""

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


def network(n, latency_s=0.05, rate_bytes=125e6, nic=None):
    lat = np.full((n, n), latency_s)
    np.fill_diagonal(lat, 0.0)
    return FluidNetwork(latency_s=lat, rate=np.full((n, n), rate_bytes), jitter_s=np.zeros((n, n)),
                        loss=np.zeros((n, n)), tcp_window=1e12, region_of=tuple(f"r{i}" for i in range(n)),
                        tcp=False, nic=nic)  # the fluid and the rendezvous alone (TCP's own terms: test_simnet)


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


@pytest.mark.parametrize("pad_layers", [False, True])
def test_a_profile_pads_each_step_once_whether_after_backward_or_over_the_layers(tmp_path, pad_layers):
    """min_compute_s 0.05 over a 10 ms compute model. Over the layers (pad_layers), the one bucket
    is ready only at the end of backward: the step is the profile's 50 ms, then the whole
    exchange, then the overhead (the layers' pads count as compute: the step's own pad adds
    nothing; it once added them again, 90 ms). After backward (the default), the exchange runs
    during the pad: the step is 10 ms of compute, then the longer of the pad's 40 ms and the
    exchange."""
    name = f"pad{int(pad_layers)}"
    cfg = config(tmp_path, name, steps=12, min_compute_s=0.05, pad_layers=pad_layers)
    run_simulated(cfg, 2, network(2, 0.05, 125e6), ComputeModel(0.010, 0.002))
    steps = records(tmp_path / name, 0, "step")
    nbytes = 4 * sum(p.numel() for p in torch.nn.Linear(64, 32).parameters()) + 4 * (32 * 10 + 10)
    exchange = 2 * 0.05 + nbytes / 125e6
    per_step = (steps[-1]["time_s"] - steps[1]["time_s"]) / (len(steps) - 2)
    expected = 0.05 + exchange + 0.002 if pad_layers else 0.010 + max(0.040, exchange) + 0.002
    assert per_step == pytest.approx(expected, rel=0.02)


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


@pytest.mark.parametrize("n", [4, 16, 64])
def test_sync_step_grows_with_the_nodes_as_n_minus_1_copies_through_each_nic(tmp_path, n):
    """The direct exchange puts n - 1 copies of the gradients through every NIC each way: with a
    NIC of 10 MB/s (below every pair's 125 MB/s) sync's step is compute + a round trip +
    (n - 1) x bytes / NIC, 4 to 64 nodes."""
    cfg = config(tmp_path, f"sync{n}", steps=8)
    nic = 10 * MB
    run_simulated(cfg, n, network(n, 0.05, 125e6, nic=nic), ComputeModel(0.010, 0.002))
    steps = records(tmp_path / f"sync{n}", 0, "step")
    nbytes = 4 * sum(p.numel() for p in torch.nn.Linear(64, 32).parameters()) + 4 * (32 * 10 + 10)
    per_step = (steps[-1]["time_s"] - steps[1]["time_s"]) / (len(steps) - 2)
    assert per_step == pytest.approx(0.010 + 2 * 0.05 + (n - 1) * nbytes / nic + 0.002, rel=1e-3)


def test_the_nic_s_share_of_each_collective_against_its_closed_form():
    """Ring all-reduce: 2(n-1) steps, each a round trip (notice, chunk) plus nbytes/n through the
    NIC (one message out and one in per NIC); broadcast: the root's NIC carries n - 1 copies;
    recursive doubling: log2 n rounds of a round trip plus the whole tensor through the NIC."""
    from trainers.sim import collectives

    lat, nbytes, nic = 0.05, 1 * MB, 10 * MB
    for n in (4, 8, 16, 64):
        def net():  # a fresh network per collective: each from a cold start, its slow start its own
            return network(n, lat, 125e6, nic=nic)
        entered = np.zeros(n)
        ring = collectives.ring_allreduce(entered, net(), nbytes)
        assert ring == pytest.approx(np.full(n, 2 * (n - 1) * (2 * lat + nbytes / n / nic)))
        direct = collectives.direct(entered, net(), nbytes)
        assert direct == pytest.approx(np.full(n, 2 * lat + (n - 1) * nbytes / nic))
        root = collectives.broadcast(entered, net(), nbytes, 0)
        assert root[1:] == pytest.approx(np.full(n - 1, 2 * lat + (n - 1) * nbytes / nic))
        doubling = collectives.recursive_doubling(entered, net(), nbytes)
        assert doubling == pytest.approx(np.full(n, np.log2(n) * (2 * lat + nbytes / nic)))
    # without a NIC the same exchange is the pair's rate alone, whatever the node count
    assert collectives.direct(np.zeros(64), network(64, lat, 125e6), nbytes) == pytest.approx(
        np.full(64, 2 * lat + nbytes / 125e6))


def test_a_nic_sends_a_direct_exchange_s_copies_as_their_peers_are_ready():
    """Two regions of two nodes, 1 ms apart inside a region and 100 ms across, NICs that need
    50 ms a copy: each node's copy to its region's peer leaves at once (its "ready" notice comes
    1 ms after entry) and is sent before the two far peers' notices arrive at 100 ms, so the far
    copies share the NIC two ways from then, not three ways from the start: all done at
    2 x 100 ms + 2 x 50 ms = 0.30 s (equal shares of n - 1 from each copy's start: 0.35 s)."""
    from trainers.sim import collectives

    lat = np.full((4, 4), 0.1)
    lat[0, 1] = lat[1, 0] = lat[2, 3] = lat[3, 2] = 0.001
    np.fill_diagonal(lat, 0.0)
    nbytes, nic = 0.05 * MB, 1 * MB
    net = FluidNetwork(latency_s=lat, rate=np.full((4, 4), 1e12), jitter_s=np.zeros((4, 4)), loss=np.zeros((4, 4)),
                       tcp_window=1e12, nic=nic, region_of=("a", "a", "b", "b"), tcp=False)
    assert collectives.direct(np.zeros(4), net, nbytes) == pytest.approx(np.full(4, 0.30))


def test_a_nic_that_does_not_bind_changes_no_collective():
    """aws-4region's delays (unequal: 4 to 108 ms one way) with 10 Gbit/s NICs, which a 19 KB
    tensor never fills: every collective, from two sets of entry times in turn (the second on
    warm connections), ends within microseconds of the same network without NICs (the NIC's own
    15 us per copy)."""
    from trainers.sim import collectives

    one_way = np.array([[0, 0.10785, 0.0686, 0.0434], [0.10785, 0, 0.0502, 0.0718],
                        [0.0686, 0.0502, 0, 0.0252], [0.0434, 0.0718, 0.0252, 0]])

    def net(nic):
        return FluidNetwork(latency_s=one_way.copy(), rate=np.full((4, 4), 125e6), jitter_s=np.zeros((4, 4)),
                            loss=np.zeros((4, 4)), tcp_window=4e6, nic=nic, region_of=tuple("abcd"))

    with_nic, without = net(10e9 / 8), net(None)
    for entered in (np.array([0.0, 0.01, 0.02, 0.005]), np.array([0.003, 0.012, 0.021, 0.006])):
        for model in (collectives.direct, collectives.ring_allreduce, collectives.recursive_doubling,
                      lambda e, n, b: collectives.broadcast(e, n, b, 0)):
            assert model(entered, with_nic, 19240.0) == pytest.approx(model(entered, without, 19240.0), abs=5e-5)


def test_processor_sharing_against_its_hand_computed_times():
    """Node 0: two jobs of 1 s start at 0 and share the server (0.5 s done each by t = 1), a
    third starts at 1, three ways: the first two end at 2.5, the third, alone for its last
    0.5 s, at 3.0; node 1's one job of 2 s from 0.5 ends at 2.5, unaffected."""
    ends = FluidNetwork._processor_sharing(np.array([0, 1, 0, 0]), np.array([0.0, 0.5, 0.0, 1.0]),
                                           np.array([1.0, 2.0]))
    assert ends == pytest.approx([2.5, 2.5, 2.5, 3.0])


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


# --- crashes: the elastic comm (TcpComm's semantics) and the others ------------------------------


def asymmetric_network(n, rate_bytes=125e6):
    """One-way delays that differ per direction: rank i -> rank j takes 0.01 * (1 + i) + 0.001 * j s."""
    lat = np.array([[0.01 * (1 + i) + 0.001 * j for j in range(n)] for i in range(n)])
    np.fill_diagonal(lat, 0.0)
    return FluidNetwork(latency_s=lat, rate=np.full((n, n), rate_bytes), jitter_s=np.zeros((n, n)),
                        loss=np.zeros((n, n)), tcp_window=1e12, region_of=tuple(f"r{i}" for i in range(n)), tcp=False)


def test_a_crashed_peer_is_lost_one_one_way_delay_later_after_what_it_sent():
    from trainers.comm import PeerLost
    from trainers.sim import ElasticSimComm

    net = asymmetric_network(3)
    sim = Simulator(3, net, ComputeModel(0.0))
    log = {}

    def body(rank):
        comm = ElasticSimComm(sim, rank)
        if rank == 1:  # sends every 0.3 s until it is killed at 1.0 s
            for i in range(10):
                comm.send(torch.tensor([float(i)]), 0)
                sim.sleep(0.3)
            log["rank 1 ran on"] = True
        elif rank == 0:
            got = []
            try:
                while True:
                    tensor = torch.zeros(1)
                    comm.recv(tensor, 1)
                    got.append(tensor.item())
            except PeerLost as lost:
                log[0] = (sim.now, lost.rank, str(lost), got, comm.live_ranks())
            with pytest.raises(PeerLost, match="rank 1 crashed"):
                comm.isend(torch.zeros(1), 1)
        else:  # a send posted after the crash, before rank 2 can know: it fails when the FIN arrives
            sim.sleep(1.0 + 0.001)
            work = comm.isend(torch.zeros(2_500_000), 1)  # 10 MB at 125 MB/s: 0.08 s, not out by then
            with pytest.raises(PeerLost) as lost:
                work.wait()
            log[2] = (sim.now, str(lost.value), comm.is_live(1))

    sim.run([lambda r=r: body(r) for r in range(3)], actions=[(1.0, lambda s: log.setdefault("crash", s.crash(1)))])
    assert not sim.errors and log["crash"] == "rank 1 killed" and "rank 1 ran on" not in log
    at, rank, why, got, live = log[0]
    assert at == pytest.approx(1.0 + net.latency_s[1, 0]) and rank == 1  # the FIN: one one-way delay
    assert "crashed (its connection closed without a goodbye)" in why
    assert got == [0.0, 1.0, 2.0, 3.0] and live == [0, 2]  # everything sent before the kill arrived
    assert log[2][0] == pytest.approx(1.0 + net.latency_s[1, 2]) and log[2][2] is False
    assert net.in_flight() == 0  # the send that failed stopped its flow


def crash_config(tmp_path, name, **changes):
    return config(tmp_path, name, **{"algorithm": {"name": "swarmsgd", "params": {"H": 2}}, "comm": {"backend": "tcp"},
                                     "steps": 100, "eval_every": 10, **changes})


def crash_run(tmp_path, name, restart_after_s=0.2, **changes):
    """swarmsgd on 4 ranks (about 70 steps/s), rank 2 killed at 0.5 s (and restarted
    ``restart_after_s`` later)."""
    actions = [(0.5, lambda s: s.crash(2))]
    if restart_after_s is not None:
        actions.append((0.5 + restart_after_s, lambda s: s.restart(2)))
    net = asymmetric_network(4, 10 * MB)
    results = run_simulated(crash_config(tmp_path, name, **changes), 4, net, ComputeModel(0.004, 0.001), actions)
    return results, net


def test_swarmsgd_goes_on_through_a_crash_and_the_restarted_rank_rejoins_the_same_each_run(tmp_path):
    results, net = crash_run(tmp_path, "a")
    out = tmp_path / "a"
    assert [r.steps for r in results] == [100] * 4
    for rank in range(4):
        assert records(out, rank, "status")[-1]["status"] == "ok"
    # rank 2's first process: steps until the kill, then nothing (no status); then a second one
    rank2 = records(out, 2)
    starts = [i for i, r in enumerate(rank2) if r["kind"] == "start"]
    first = rank2[:starts[1]]
    assert [r["restarts"] for r in records(out, 2, "start")] == [0, 1]
    assert first[-1]["kind"] == "step" and first[-1]["time_s"] <= 0.5 and all(r["kind"] != "status" for r in first)
    # rank 0 saw it lost at its next eval point after the FIN arrived, then admitted it back
    lost, joined = records(out, 0, "membership")
    assert (lost["lost"], lost["live"]) == ([2], [0, 1, 3]) and (joined["joined"], joined["live"]) == ([2], [0, 1, 2, 3])
    assert lost["time_s"] >= 0.5 + net.latency_s[2, 0]
    (rejoin,) = records(out, 2, "rejoin")
    assert rejoin["step"] == joined["step"] and rejoin["restarts"] == 1
    after = [r["step"] for r in rank2[starts[1]:] if r["kind"] == "step"]
    assert after == list(range(rejoin["step"] + 1, 100)) and len(after) > 10  # it trains again, to the end
    # the survivors kept stepping while it was away
    steps0 = records(out, 0, "step")
    assert any(0.5 < r["time_s"] < 0.9 for r in steps0)
    # the same seed and faults give the same records, crash included
    crash_run(tmp_path, "b")

    def stripped(name):
        return [{k: v for k, v in r.items() if k not in ("time_unix", "max_rss_mib")}
                for rank in range(4) for r in records(tmp_path / name, rank)]

    assert stripped("a") == stripped("b")


def test_a_crash_without_restart_leaves_the_others_training(tmp_path):
    results, _ = crash_run(tmp_path, "c", restart_after_s=None)
    assert results[2] is None and [results[r].steps for r in (0, 1, 3)] == [100] * 3
    assert all(r["kind"] != "status" for r in records(tmp_path / "c", 2))
    assert records(tmp_path / "c", 0, "membership")[0]["lost"] == [2]


def test_sync_fails_at_the_crash_with_the_crash_named_and_is_not_restarted(tmp_path):
    net = asymmetric_network(4, 10 * MB)
    effects = []
    with pytest.raises(RuntimeError, match=r"^rank 2 killed by the injected node_crash at 0\.500 s; rank \d failed "
                                           r"at simulated .*ConnectionError: rank 2 closed its connections"):
        run_simulated(config(tmp_path, "sync", steps=60), 4, net, ComputeModel(0.004, 0.001),
                      [(0.5, lambda s: effects.append(s.crash(2))),
                       (0.5, lambda s: effects.append(s.restart(2)))])
    assert effects == ["rank 2 killed", "not restarted: sync needs every rank in every collective and cannot take "
                                        "a rank back (the job fails)"]
    failed = [r for rank in (0, 1, 3) for r in records(tmp_path / "sync", rank, "status")
              if "ConnectionError" in r["reason"]]
    # the first survivor to fail is one whose FIN arrived first (the nearest), at the crash + that delay
    assert failed and failed[0]["time_s"] == pytest.approx(0.5 + min(net.latency_s[2, r] for r in (0, 1, 3)), abs=1e-6)
    assert all(r["kind"] != "status" for r in records(tmp_path / "sync", 2))


def test_multiply_accumulates_of_a_conv_and_a_linear_layer():
    conv, linear = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Linear(512, 10)
    image = conv(torch.zeros(2, 3, 8, 8))
    # each kernel element once per output pixel, each bias once per output element
    assert layer_macs(conv, list(conv.parameters()), image) == 8 * 3 * 9 * (2 * 8 * 8) + 2 * 8 * 8 * 8
    assert layer_macs(linear, list(linear.parameters()), linear(image.flatten(1))) == 512 * 10 * 2 + 2 * 10


def two_passes_on_a_virtual_clock(layer_shares=None):
    """Two forward + backward passes of a conv + linear model on one simulated rank with 1 s of
    compute (forward_fraction 0.5): when the linear layer's forward began, when the conv weight's
    gradient reached a hook registered after the clock's (as an algorithm's), and the end."""
    sim = Simulator(1, network(1), ComputeModel(1.0, forward_fraction=0.5))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(512, 10))
    reached_linear, conv_grad = [], []
    model[2].register_forward_pre_hook(lambda module, inputs: reached_linear.append(clock.perf_counter()))
    sim_clock = SimClock(sim, 0.0)
    previous = clock.install(sim_clock)

    def body():
        sim_clock.attach(model, layer_shares)
        model[0].weight.register_post_accumulate_grad_hook(lambda p: conv_grad.append(clock.perf_counter()))
        for _ in range(2):
            started = clock.perf_counter()
            model(torch.zeros(2, 3, 8, 8)).sum().backward()
            clock.compute_done(started)

    try:
        sim.run([body])
    finally:
        clock.install(previous)
    return reached_linear, conv_grad, sim.now


def test_the_forward_pass_spends_its_time_layer_by_layer_by_multiply_accumulates():
    """From the second step on, a layer's share of the forward pass is spent as it ends, so what
    waits before a later layer (P3's per-layer wait) overlaps the earlier layers' compute. Here the
    conv layer holds 14,336 of the 19,466 multiply-accumulates per image, the linear layer most of
    the parameters."""
    reached_linear, _, end = two_passes_on_a_virtual_clock()
    # the first forward only measures (its share is spent with the first gradient)
    assert reached_linear == pytest.approx([0.0, 1.0 + 0.5 * 14_336 / 19_466])
    assert end == pytest.approx(2.0)


def test_measured_layer_shares_spend_the_compute_from_the_first_step():
    """With measured layer_shares the forward and backward shares are charged as measured (the
    compute model's forward_fraction unused) from the first step, not after a measuring pass."""
    reached_linear, conv_grad, end = two_passes_on_a_virtual_clock([[224, 0.1, 0.3], [5130, 0.2, 0.4]])
    assert reached_linear == pytest.approx([0.1, 1.1])
    # the conv weight's gradient after the forward (0.3), the linear layer's 0.4 and its own part of 0.3
    assert conv_grad == pytest.approx([0.7 + 0.3 * 216 / 224, 1.7 + 0.3 * 216 / 224])
    assert end == pytest.approx(2.0)


def test_run_simulated_hands_back_who_was_killed_and_restarted(tmp_path):
    """The crash facts have one owner, the simulator: run_simulated returns them with the ranks'
    results (harness.sim_job reports a tolerated crash from them)."""
    results, _ = crash_run(tmp_path, "d")
    assert [r.steps for r in results] == [100] * 4
    assert (results.crashed_at, results.restarts) == ({2: 0.5}, {2: 1})


# --- start-up: ComputeModel.start_offsets_s ------------------------------------------------------


def test_a_rank_with_start_offset_x_begins_its_first_step_at_x_after_the_last_ready_rank():
    # ranks ready (setup done) at 0, 0.1 and 0.2 s: the start line is 0.2 s, and each rank's first
    # step begins its offset after it; a rank not listed (rank 2) has offset 0
    compute = ComputeModel(0.0, start_offsets_s=(0.3, 0.0))
    sim = Simulator(3, network(3), compute)
    log = []

    def body(rank):
        sim.sleep(0.1 * rank)
        sim.training_starts()
        sim.settle()  # pay what it owes (the engine's sleeps are lazy), as a clock reading does
        log.append((rank, sim.now))

    sim.run([lambda r=r: body(r) for r in range(3)])
    assert sorted(log) == [(0, pytest.approx(0.5)), (1, pytest.approx(0.2)), (2, pytest.approx(0.2))]
    # without offsets nothing is held: each rank begins when it is ready
    sim, log = Simulator(3, network(3), ComputeModel(0.0)), []
    sim.run([lambda r=r: body(r) for r in range(3)])
    assert sorted(log) == [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.2))]


def test_start_offsets_are_seconds_for_at_most_the_job_s_ranks():
    for bad in ((-0.1,), (float("nan"),)):
        with pytest.raises(ValueError, match="start_offsets_s must be seconds"):
            ComputeModel(0.01, start_offsets_s=bad)
    with pytest.raises(ValueError, match="start_offsets_s has 3 ranks, the job 2"):
        Simulator(2, network(2), ComputeModel(0.01, start_offsets_s=[0, 0, 1]))
    assert ComputeModel(0.01, start_offsets_s=[0, 1]).start_offsets_s == (0.0, 1.0)  # sim.json's list


def first_step_starts(output_dir, ranks):
    """Per rank: when its first step began and when it ended (virtual s: every writer starts at 0)."""
    out = []
    for rank in range(ranks):
        step = records(output_dir, rank, "step")[0]
        out.append((step["time_s"] - step["step_s"], step["time_s"]))
    return out


def test_sync_s_first_step_ends_after_the_latest_offset_plus_the_exchange(tmp_path):
    offsets = (0.0, 0.25, 0.5)
    cfg = config(tmp_path, "sync", steps=3)
    run_simulated(cfg, 3, network(3, 0.05, 125e6), ComputeModel(0.010, 0.002, start_offsets_s=offsets))
    ready = max(records(tmp_path / "sync", rank, "output")[0]["time_s"] for rank in range(3))
    assert ready > 0  # the setup broadcast took virtual time before the start line
    firsts = first_step_starts(tmp_path / "sync", 3)
    assert [start for start, _ in firsts] == pytest.approx([ready + s for s in offsets], abs=1e-9)
    nbytes = 4 * (64 * 32 + 32 + 32 * 10 + 10)
    # the all-reduce (direct exchange) cannot end before the latest rank computed and sent its
    # tensor (one delay + bytes); that rank also waits for the others' tensors, sent once they
    # heard it entered: one more delay
    latest_sent = ready + 0.5 + 0.010 + 0.05 + nbytes / 125e6
    assert all(end >= latest_sent - 1e-9 for _, end in firsts)
    assert firsts[2][1] == pytest.approx(latest_sent + 0.05 + 0.002, rel=1e-6)


def test_no_start_offsets_is_the_engine_as_before(tmp_path):
    def run(name, compute):
        cfg = config(tmp_path, name, algorithm={"name": "swarmsgd", "params": {"H": 2}}, steps=12)
        run_simulated(cfg, 4, network(4, 0.03, 10 * MB), compute)
        return [{k: v for k, v in r.items() if k not in ("time_unix", "max_rss_mib")}
                for rank in range(4) for r in records(tmp_path / name, rank)]

    plain = run("plain", ComputeModel(0.004, 0.001))
    empty = run("empty", ComputeModel(**{"forward_backward_s": 0.004, "step_overhead_s": 0.001,
                                          "start_offsets_s": []}))  # sim.json with an empty list
    assert plain == empty
    # nothing held: each rank's first step begins as its setup (the broadcast) ends, as before
    for rank in range(4):
        output = records(tmp_path / "plain", rank, "output")[0]["time_s"]
        assert first_step_starts(tmp_path / "plain", 4)[rank][0] == pytest.approx(output, abs=1e-12)


def test_start_offsets_repeat_bit_for_bit(tmp_path):
    def run(name):
        cfg = config(tmp_path, name, algorithm={"name": "async_ps", "params": {"server_ranks": [0]}}, steps=10)
        run_simulated(cfg, 4, network(4, 0.03, 10 * MB), ComputeModel(0.004, 0.001, start_offsets_s=(0, 0.4, 0.1)))
        return [{k: v for k, v in r.items() if k not in ("time_unix", "max_rss_mib")}
                for rank in range(4) for r in records(tmp_path / name, rank)]

    first = run("a")
    assert first == run("b")
    starts = [start for start, _ in first_step_starts(tmp_path / "a", 4)]
    assert [s - starts[0] for s in starts] == pytest.approx([0.0, 0.4, 0.1, 0.0], abs=1e-9)


def test_a_rank_killed_in_its_start_up_does_not_hold_the_others_at_the_start_line():
    sim = Simulator(3, network(3), ComputeModel(0.0, start_offsets_s=(0.0, 0.2, 0.1)))
    log = []

    def body(rank):
        sim.sleep(0.5 if rank == 1 else 0.0)  # rank 1 is killed at 0.3 s, before it is ready
        sim.training_starts()
        sim.settle()
        log.append((rank, sim.now))

    sim.run([lambda r=r: body(r) for r in range(3)], [(0.3, lambda s: s.crash(1))])
    assert sorted(log) == [(0, pytest.approx(0.3)), (2, pytest.approx(0.4))]


# ---------------------------------------------------------------------------------------------
# One concurrency limit for background collectives (comm.max_in_flight), and the all-gather


@pytest.mark.parametrize("limit, finish_rounds, peak", [(4, [1] * 4 + [2] * 4 + [3], 4), (100, [1] * 9, 9)])
def test_background_collectives_beyond_the_limit_start_when_one_finishes(limit, finish_rounds, peak):
    # 9 direct all-reduces launched at once on 2 ranks; one takes a round trip (the receiver's
    # "ready" notice, then the tensor) = 0.1 s on a network this fast: with 4 allowed in flight,
    # the 5th..8th start when the first four finish, the 9th after those (queueing in virtual time)
    def body(sim, comm, log):
        comm.max_in_flight = limit
        tensors = [torch.full((4,), float(comm.rank + k)) for k in range(9)]
        works = [comm.allreduce_async(t, "sum", algorithm="direct") for t in tensors]
        done = []
        for work in works:
            work.wait()
            done.append(sim.now)
        log.append((comm.rank, done, [t[0].item() for t in tensors], comm.peak_in_flight))

    for rank, done, values, seen_peak in simulate(2, body, network(2, 0.05, 1e12)):
        assert done == pytest.approx([0.1 * k for k in finish_rounds])
        assert values == [1.0 + 2 * k for k in range(9)]
        assert seen_peak == peak


def test_allgather_on_sim_follows_the_setting_direct_in_one_round_trip_ring_in_n_minus_1_steps():
    def body(sim, comm, log):
        for algorithm in ("direct", "ring", "gloo"):
            start = sim.now
            outputs = [torch.zeros(3) for _ in range(3)]
            comm.allgather_async(outputs, torch.full((3,), float(comm.rank)), algorithm=algorithm).wait()
            log.append((algorithm, comm.rank, round(sim.now - start, 9), [o.tolist() for o in outputs]))

    log = simulate(3, body, network(3, 0.05, 1e12))
    expected = [[float(r)] * 3 for r in range(3)]
    for algorithm, rank, took, outputs in log:
        assert outputs == expected, (algorithm, rank)
        # direct: every rank's notice, then its tensor (a round trip); ring: 2 steps of a round
        # trip each, the first's notice overlapping nothing; gloo's own all_gather: modelled as the ring
        assert took == pytest.approx({"direct": 0.1, "ring": 0.2, "gloo": 0.2}[algorithm]), (algorithm, rank)


def dts_period(tmp_path, name, limit, compute_s, t=8):
    """DTS p=1 on 2 ranks: the mean step time over 72 steady steps (whole cycles of 4, 8 and 9)."""
    cfg = config(tmp_path, name, steps=90, algorithm={"name": "dts", "params": {"p": 1, "t": t}},
                 comm={"max_in_flight": limit})
    run_simulated(cfg, 2, network(2, 0.05, 125e6), ComputeModel(compute_s, 0.0))
    times = [r["time_s"] for r in records(tmp_path / name, 0, "step")]
    return (times[88] - times[16]) / 72


def test_dts_with_8_all_reduces_in_flight_is_throttled_to_the_limit(tmp_path):
    # One all-reduce (direct, 2 ranks) takes A = a round trip + bytes / rate. DTS p=1 t=8: step s
    # computes (c), launches its all-reduce and waits for the one of step s-8. Unthrottled, that
    # one was launched c + A before: a cycle of t+1 steps lasts A + c (A > t c), 8-9 in flight.
    # With L < t+1 allowed, one starts only when the one launched L before has finished: A / L
    # a step (the real comm's 4 threads do the same).
    nbytes = 4 * (64 * 32 + 32 + 32 * 10 + 10)
    all_reduce_s, compute_s = 2 * 0.05 + nbytes / 125e6, 0.001
    assert dts_period(tmp_path, "limit4", 4, compute_s) == pytest.approx(all_reduce_s / 4, rel=1e-6)
    assert dts_period(tmp_path, "limit8", 8, compute_s) == pytest.approx(all_reduce_s / 8, rel=1e-6)
    unthrottled = (all_reduce_s + compute_s) / 9
    assert dts_period(tmp_path, "limit9", 9, compute_s) == pytest.approx(unthrottled, rel=1e-6)
    assert dts_period(tmp_path, "limit1000", 1000, compute_s) == pytest.approx(unthrottled, rel=1e-6)


def test_the_limit_is_a_workload_knob_and_a_job_under_it_is_unchanged(tmp_path):
    # sync keeps one all-reduce in flight: the limit changes nothing, bit for bit
    def steps(name, limit):
        run_simulated(config(tmp_path, name, steps=15, comm={"max_in_flight": limit}), 2, network(2),
                      ComputeModel(0.004, 0.001))
        return [(r["time_s"], r["loss"]) for r in records(tmp_path / name, 0, "step")]

    assert steps("one", 1) == steps("many", 1000)
    # a scenario sets it for its jobs as `workload: {comm: {max_in_flight: N}}`, checked at load
    import yaml

    from harness.scenario import scenario_from_dict

    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    document = yaml.safe_load((root / "scenarios" / "paper-dts-90x.yaml").read_text())
    document.setdefault("workload", {})["comm"] = {"max_in_flight": 2}
    assert {job.trainer.comm.max_in_flight for job in scenario_from_dict(document, "s.yaml").jobs} == {2}
    document["workload"]["comm"] = {"max_in_flight": 0}
    with pytest.raises(Exception, match="s.yaml: workload.comm.max_in_flight: must be an integer >= 1"):
        scenario_from_dict(document, "s.yaml")


@pytest.mark.parametrize("compressor", ["onebit", "topk", "qsgd", "terngrad"])
def test_quantized_on_the_direct_exchange_decodes_the_same_as_on_gloos_all_gather(tmp_path, compressor):
    # Same payloads, decoded in rank order: the same losses at every step; only the time differs
    # (gloo's all_gather is modelled as the ring: n-1 steps; direct: one round trip). Stochastic
    # codes too: each rank draws from its own generator (Algorithm.rank_generator), not from the
    # process's default one that simulated ranks share, whose draws followed the order the ranks
    # ran in, which the transport's timing changes (real ranks: tests/trainers/test_quantized.py)
    def steps(name, allreduce):
        cfg = config(tmp_path, name, steps=12, algorithm={"name": "quantized", "params": {"compressor": compressor}},
                     comm={"allreduce": allreduce})
        # per-direction delays: the ranks finish their exchanges, and so draw, in an order that
        # differs between the two transports
        run_simulated(cfg, 4, asymmetric_network(4), ComputeModel(0.001, 0.0))
        return records(tmp_path / name, 0, "step")

    gloo, direct = steps("gloo", "gloo"), steps("direct", "direct")
    assert [r["loss"] for r in gloo] == [r["loss"] for r in direct]
    assert direct[-1]["time_s"] < 0.5 * gloo[-1]["time_s"]


@pytest.mark.parametrize("wire_scale", [1.0, 1000.0])
def test_a_stand_in_s_all_reduce_is_charged_at_its_bytes_by_the_collective_model(tmp_path, wire_scale):
    """A stand-in model (wire_scale = its bytes over the real model's): sync's step on a link of
    known rate is compute + a round trip + the stand-in's bytes over the rate, the comm's byte
    counters report the stand-in's bytes."""
    name = f"sync-x{wire_scale:g}"
    cfg = config(tmp_path, name, steps=8)
    rate = 125e6
    run_simulated(cfg, 2, network(2, 0.05, rate), ComputeModel(0.010, 0.002), wire_scale=wire_scale)
    steps = records(tmp_path / name, 0, "step")
    nbytes = 4 * sum(p.numel() for p in torch.nn.Linear(64, 32).parameters()) + 4 * (32 * 10 + 10)
    per_step = (steps[-1]["time_s"] - steps[1]["time_s"]) / (len(steps) - 2)
    assert per_step == pytest.approx(0.010 + 2 * 0.05 + wire_scale * nbytes / rate + 0.002, rel=1e-3)
    # the direct exchange of 2 ranks: one copy of the model each way per step, at the stand-in's size
    assert statistics.median(r["bytes_sent"] for r in steps) == pytest.approx(wire_scale * nbytes, rel=1e-6)


def test_the_same_job_trains_the_same_bits_whatever_it_stands_in_for(tmp_path):
    losses = {}
    for scale in (1.0, 50.0):
        name = f"x{scale:g}"
        run_simulated(config(tmp_path, name, steps=6), 2, network(2), ComputeModel(0.01), wire_scale=scale)
        losses[scale] = [r["loss"] for r in records(tmp_path / name, 0, "step")]
    assert losses[1.0] == losses[50.0]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_wire_scale_must_be_a_finite_positive_number(bad):
    with pytest.raises(ValueError, match="wire_scale"):
        Simulator(2, network(2), ComputeModel(0.0), wire_scale=bad)


def test_auto_picks_the_ring_for_a_stand_in_s_tensor_and_charges_its_bytes_by_the_collective_model():
    """A 4 kB tensor standing for 400 MB: auto takes the ring (as it would for 400 MB, not the
    direct exchange 4 kB gets), which ends when the ring model says for 400 MB, and the byte
    counters count the ring's 2(n-1)/n of 400 MB."""
    from trainers.sim import collectives

    n, scale, tensor_bytes = 4, 1e5, 4000
    net = network(n, 0.05, 125e6)

    def body(sim, comm, log):
        tensor = torch.full((tensor_bytes // 4,), float(comm.rank))
        work = comm.allreduce_async(tensor, "sum")
        work.wait()
        log.append((comm.rank, sim.now, tensor[0].item(), comm.stats.bytes_sent))

    sim = Simulator(n, net, ComputeModel(0.0), wire_scale=scale)
    log = []
    sim.run([lambda r=r: body(sim, SimComm(sim, r, "auto"), log) for r in range(n)])
    expected = collectives.ring_allreduce(np.zeros(n), net, scale * tensor_bytes)
    direct = collectives.direct(np.zeros(n), net, scale * tensor_bytes)
    assert not np.allclose(expected, direct)  # the two models differ here: the check can tell them apart
    for rank, done, value, sent in log:
        assert done == pytest.approx(expected[rank], rel=1e-9)
        assert value == sum(range(n))  # the real tensor, reduced exactly
        assert sent == pytest.approx(2 * (n - 1) / n * scale * tensor_bytes, rel=1e-6)


def test_the_coded_ring_on_sim_gives_the_real_ring_s_bits_and_its_payloads_time():
    """allreduce_coded_async on sim: ring_coded_reference's bits (what the real coded ring leaves,
    tests/trainers/test_allreduce.py) on every rank; the ring's time at the payloads' bytes."""
    from trainers.comm.allreduce import ring_coded_bytes, ring_coded_reference
    from trainers.compression import build_compressor

    n, numel, rate = 3, 30_000, 1e6
    int8 = build_compressor("int8")
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]

    def body(sim, comm, log):
        start = sim.now
        fp32 = inputs[comm.rank].clone()
        comm.allreduce_async(fp32, op="avg", algorithm="ring").wait()
        took_fp32 = sim.now - start
        coded = inputs[comm.rank].clone()
        start = sim.now
        comm.allreduce_coded_async(coded, int8, op="avg").wait()
        log.append((comm.rank, took_fp32, sim.now - start, coded, comm.stats.per_op["all_reduce"].bytes_sent))

    log = simulate(n, body, network(n, 1e-6, rate))
    reference = ring_coded_reference(inputs, int8, "avg")
    fp32_bytes = 2 * (n - 1) * numel * 4 // n
    for rank, took_fp32, took_coded, coded, sent in log:
        assert torch.equal(coded, reference), rank
        coded_bytes = ring_coded_bytes(rank, n, inputs[rank], int8)[0]
        assert sent == fp32_bytes + coded_bytes
        assert took_fp32 == pytest.approx(fp32_bytes / rate, rel=0.01)
        assert took_coded == pytest.approx(coded_bytes / rate, rel=0.01)
