"""Comm.allreduce_async: every algorithm equals gloo's all_reduce, is bitwise equal on every rank,
accounts the bytes it sends, and progresses in the background while the caller computes."""

import json
from pathlib import Path

import pytest
import torch

from tests.trainers.workers import allreduce_worker, overlap_worker
from trainers.comm import DIRECT_MAX_BYTES, allreduce_bytes


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_algorithm_equals_gloo_and_is_bitwise_equal_on_every_rank(spawn_ranks, tmp_path, world_size):
    assert spawn_ranks(allreduce_worker, world_size, str(tmp_path), timeout_s=120) == [0] * world_size
    outputs = [json.loads((tmp_path / f"allreduce{rank}.json").read_text()) for rank in range(world_size)]
    rows = [output["rows"] for output in outputs]
    assert len(rows[0]) == 5 * 4 * 4
    for index, row in enumerate(rows[0]):
        case = f"{row['algorithm']} {row['op']} numel={row['numel']} world={world_size}"
        # float32 sums of world_size terms in another order: a few ulps of the largest term
        assert row["max_error"] <= 1e-6 * max(1.0, row["scale"]) * world_size, case
        if row["op"] in ("max", "min"):
            assert row["max_error"] == 0.0, case
        assert row["same_tensor"], case
        assert len({r[index]["digest"] for r in rows}) == 1, f"{case}: ranks differ bitwise"
        for rank in range(world_size):
            expected = allreduce_bytes(
                row["algorithm"] if row["algorithm"] != "auto" else
                ("direct" if (world_size - 1) * row["numel"] * 4 <= DIRECT_MAX_BYTES else "ring"),
                rank, world_size, torch.empty(row["numel"]))
            assert (rows[rank][index]["sent"], rows[rank][index]["recv"]) == expected, case
    assert outputs[0]["in_flight"] == [sum(range(world_size)) + k * world_size for k in range(3)]


def test_bytes_per_algorithm_follow_the_textbook_counts():
    flat = torch.empty(1200)  # 4800 bytes, divisible by 2, 3 and 4
    whole = 4800
    for n in (2, 3, 4, 5):
        for rank in range(n):
            assert allreduce_bytes("ring", rank, n, flat) == (2 * (n - 1) * whole // n,) * 2
            assert allreduce_bytes("direct", rank, n, flat) == ((n - 1) * whole,) * 2
    assert [allreduce_bytes("recursive_doubling", r, 4, flat)[0] for r in range(4)] == [2 * whole] * 4
    # 3 ranks: rank 2 folds into rank 0 and gets the result back; ranks 0 and 1 do one round.
    assert [allreduce_bytes("recursive_doubling", r, 3, flat)[0] for r in range(3)] == [2 * whole, whole, whole]


def test_unknown_algorithm_and_op_fail_at_once_and_one_rank_is_a_no_op():
    from trainers.comm import Comm

    world_of_one = type("WorldOfOne", (Comm,), {name: None for name in Comm.__abstractmethods__})
    with pytest.raises(ValueError, match="allreduce: 'fastest'"):
        world_of_one(0, 1, allreduce="fastest")
    comm = world_of_one(0, 1, allreduce="auto")
    x = torch.arange(3.0)
    with pytest.raises(ValueError, match="algorithm: 'fastest'"):
        comm.allreduce_async(x, algorithm="fastest")
    with pytest.raises(ValueError, match="op: 'prod'"):
        comm.allreduce_async(x, op="prod")
    assert comm.allreduce_async(x, op="avg").wait() is x and x.tolist() == [0.0, 1.0, 2.0]
    assert comm.transport == "ours:auto"


@pytest.mark.slow
def test_background_allreduce_overlaps_compute(spawn_ranks, tmp_path):
    """4 ranks, 100 ms added to every background message: launch, compute 1 s, then wait is
    (nearly) never blocked; launch-and-wait is blocked for the algorithm's rounds of delay."""
    one_way_delay_s, compute_s = 0.1, 1.0
    assert spawn_ranks(overlap_worker, 4, str(tmp_path), one_way_delay_s, compute_s, timeout_s=120) == [0] * 4
    for rank in range(4):
        results = json.loads((tmp_path / f"overlap{rank}.json").read_text())
        for algorithm, rounds in (("ring", 6), ("direct", 1), ("recursive_doubling", 2)):
            at_once, overlapped = results[f"{algorithm}/wait_at_once"], results[f"{algorithm}/compute_then_wait"]
            assert at_once["correct"] and overlapped["correct"]
            assert at_once["blocked_s"] >= rounds * one_way_delay_s * 0.9, (rank, algorithm, at_once)
            # had it progressed only inside wait(), the wait would take the same rounds of delay
            assert overlapped["blocked_s"] < 0.5 * rounds * one_way_delay_s, (rank, algorithm, overlapped)
            assert overlapped["wall_s"] >= compute_s


# ---------------------------------------------------------------------------------------------
# allgather_async: the all-gather on the all-reduce's exchange (direct / ring)


def _run_in_threads(n, body):
    """Run ``body(rank, exchange)`` for every rank on its own thread over in-process mailboxes;
    ``exchange(sends, receives)`` as the comm's: posts every send, then fills every receive."""
    import queue
    import threading

    boxes = {(src, dst): queue.Queue() for src in range(n) for dst in range(n) if src != dst}
    errors = []

    def exchange_for(rank):
        def exchange(sends, receives):
            for tensor, peer in sends:
                boxes[(rank, peer)].put(tensor.clone())
            for tensor, peer in receives:
                tensor.copy_(boxes[(peer, rank)].get(timeout=10))
        return exchange

    def run(rank):
        try:
            body(rank, exchange_for(rank))
        except BaseException as error:  # surfaced below, on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert all(boxes[key].empty() for key in boxes), "a message was sent that nobody received"


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("name", ["direct", "ring"])
def test_allgather_algorithms_give_every_rank_every_part(name, n):
    from trainers.comm.allreduce import ALLGATHER_ALGORITHMS

    gathered = {}

    def body(rank, exchange):
        parts = [torch.full((7,), -1.0) for _ in range(n)]
        parts[rank].copy_(torch.arange(7.0) + 100 * rank)
        ALLGATHER_ALGORITHMS[name](parts, rank, n, exchange)
        gathered[rank] = parts

    _run_in_threads(n, body)
    for rank in range(n):
        assert [p.tolist() for p in gathered[rank]] == [(torch.arange(7.0) + 100 * r).tolist() for r in range(n)]


def test_allgather_follows_the_allreduce_setting_and_accounts_n_minus_1_tensors():
    from trainers.comm import Comm, allgather_bytes
    from trainers.comm.allreduce import resolve_allgather

    payload = torch.zeros(1000, dtype=torch.uint8)
    big = torch.zeros(DIRECT_MAX_BYTES // 3 + 1, dtype=torch.uint8)  # (4-1) x bytes just over the limit
    assert [resolve_allgather(a, payload, 4) for a in ("auto", "direct", "ring", "recursive_doubling", "gloo")] == \
        ["direct", "direct", "ring", "ring", "gloo"]
    assert resolve_allgather("auto", big, 4) == "ring"
    assert allgather_bytes("ring", 4, payload) == allgather_bytes("direct", 4, payload) == (3000, 3000)

    class LaunchOnly(Comm):
        """Overrides only the all-gather's launch hook: records it, fills nothing."""

        launches = []

        def _launch_allgather(self, outputs, tensor, algorithm, tag):
            self.launches.append((algorithm, tag))
            return (lambda: outputs), (lambda: True)

        def _launch(self, tensor, op, algorithm, tag):
            return (lambda: tensor), (lambda: True)

        _all_reduce = _broadcast = _all_gather = _isend = _irecv = _barrier = None

    comm = LaunchOnly(1, 4, allreduce="ring")
    outputs = [torch.empty_like(payload) for _ in range(4)]
    assert comm.allgather_async(outputs, payload).wait() is outputs
    comm.allreduce_async(torch.ones(4))  # an all-reduce between: it takes the tag in between
    comm.allgather_async(outputs, payload, algorithm="direct")
    # one launch order (and tag sequence) for every background collective
    assert comm.launches == [("ring", 0), ("direct", 2)]
    per_op = comm.stats.per_op["all_gather"]
    assert (per_op.calls, per_op.bytes_sent, per_op.bytes_recv) == (2, 6000, 6000)
    with pytest.raises(ValueError, match="outputs: need 4 tensors"):
        comm.allgather_async(outputs[:3], payload)
    with pytest.raises(ValueError, match="outputs: every tensor must be"):
        comm.allgather_async([torch.empty(3)] * 4, payload)


def test_max_in_flight_is_one_setting_checked_at_once():
    from trainers.comm import MAX_IN_FLIGHT, Comm
    from trainers.config import CommConfig, ConfigError

    world_of_one = type("WorldOfOne", (Comm,), {name: None for name in Comm.__abstractmethods__})
    assert CommConfig().max_in_flight == MAX_IN_FLIGHT == world_of_one(0, 1).max_in_flight == 4
    assert world_of_one(0, 2, max_in_flight=9)._pool()._max_workers == 9  # the thread pool obeys it
    with pytest.raises(ValueError, match="max_in_flight: 0"):
        world_of_one(0, 2, max_in_flight=0)
    with pytest.raises(ConfigError, match="max_in_flight"):
        CommConfig(max_in_flight=0)


def allgather_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """allgather_async (every setting) against torch.distributed's all_gather; bytes accounted;
    eight in flight with a limit of 2."""
    from tests.trainers.workers import _init_env

    _init_env(rank, world_size, port)
    import torch.distributed as dist

    from trainers.comm import TorchComm

    comm = TorchComm("gloo", timeout_s=60, allreduce="ring", max_in_flight=2)
    rows = []
    generator = torch.Generator().manual_seed(7 + rank)
    for numel, dtype in ((1, torch.float32), (1037, torch.float32), (100_003, torch.uint8)):
        data = (torch.randn(numel, generator=generator) * 50).to(dtype)
        reference = [torch.empty_like(data) for _ in range(world_size)]
        dist.all_gather(reference, data)
        for algorithm in ("ring", "direct", "auto", "gloo", None):
            outputs = [torch.full_like(data, 3) for _ in range(world_size)]
            before = (comm.stats.per_op["all_gather"].bytes_sent, comm.stats.per_op["all_gather"].bytes_recv)
            returned = comm.allgather_async(outputs, data.clone(), algorithm=algorithm).wait()
            rows.append({"numel": numel, "algorithm": str(algorithm), "same_list": returned is outputs,
                         "equal": all(torch.equal(o, r) for o, r in zip(outputs, reference)),
                         "sent": comm.stats.per_op["all_gather"].bytes_sent - before[0],
                         "recv": comm.stats.per_op["all_gather"].bytes_recv - before[1],
                         "nbytes": numel * data.element_size()})
    # eight background collectives at once, all-gathers and all-reduces mixed, on two threads
    works = []
    for k in range(8):
        if k % 2:
            works.append(comm.allreduce_async(torch.full((11,), float(rank + k)), algorithm="direct"))
        else:
            outputs = [torch.empty(5) for _ in range(world_size)]
            works.append(comm.allgather_async(outputs, torch.full((5,), float(10 * rank + k))))
    in_flight = [w.wait()[0].item() if k % 2 else [o[0].item() for o in w.wait()] for k, w in enumerate(works)]
    threads = comm._background._max_workers
    comm.shutdown()
    Path(out_dir, f"allgather{rank}.json").write_text(json.dumps({"rows": rows, "in_flight": in_flight,
                                                                  "threads": threads}))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_allgather_async_equals_torch_all_gather(spawn_ranks, tmp_path, world_size):
    assert spawn_ranks(allgather_worker, world_size, str(tmp_path), timeout_s=120) == [0] * world_size
    n = world_size
    for rank in range(n):
        output = json.loads((tmp_path / f"allgather{rank}.json").read_text())
        assert len(output["rows"]) == 3 * 5
        for row in output["rows"]:
            assert row["equal"] and row["same_list"], (rank, row)
            assert row["sent"] == row["recv"] == (n - 1) * row["nbytes"], (rank, row)
        assert output["threads"] == 2
        assert output["in_flight"] == [[10.0 * r + k for r in range(n)] if k % 2 == 0 else sum(range(n)) + k * n
                                        for k in range(8)]


def ddp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """torch's DDP under comm.allreduce gloo (its reducer) and direct / ring (our comm hook)."""
    from tests.trainers.test_quantized import _start_rank, train_on_digits

    comm = _start_rank(rank, world_size, port)
    results = {}
    for transport in ("gloo", "direct", "ring"):
        comm.allreduce_algorithm = transport
        before = {op: (s.calls, s.bytes_sent) for op, s in comm.stats.per_op.items()}
        result = train_on_digits(comm, "ddp", {"broadcast_buffers": False}, 5, 0.3)
        result["ops"] = {op: (s.calls - before[op][0], s.bytes_sent - before[op][1])
                         for op, s in comm.stats.per_op.items()}
        result["transport"] = comm.transport
        results[transport] = result
    comm.shutdown()
    Path(out_dir, f"ddp{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow
def test_ddp_runs_on_our_transport_through_its_comm_hook(spawn_ranks, tmp_path):
    assert spawn_ranks(ddp_worker, 3, str(tmp_path), timeout_s=240) == [0] * 3
    for rank in range(3):
        results = json.loads((tmp_path / f"ddp{rank}.json").read_text())
        reducer = results["gloo"]
        d = reducer["numel"]
        # torch's reducer: no all_reduce through our comm, its bytes accounted from the ring model
        assert reducer["ops"]["all_reduce"][0] == 0 and reducer["transport"] == "gloo"
        assert reducer["bytes_sent"] == [2 * 2 * 4 * d // 3] * 5
        for transport, per_rank_bytes in (("direct", 2 * 4 * d), ("ring", None)):
            ours = results[transport]
            assert ours["transport"] == f"ours:{transport}"
            calls, sent = ours["ops"]["all_reduce"]
            assert calls >= 5 and ours["ops"]["external"][0] == 0, ours["ops"]  # every step's bucket(s) on ours
            if per_rank_bytes is not None:
                assert sent == 5 * per_rank_bytes
            # the same average, summed in another order: float32 rounding apart
            difference = max(abs(a - b) for a, b in zip(ours["params"], reducer["params"]))
            assert difference < 1e-5, (transport, rank, difference)


# ---------------------------------------------------------------------------------------------
# allreduce_coded_async's ring: every message encoded (INTELLECT-1's int8 ring all-reduce)


@pytest.mark.parametrize("codec_name", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("numel", [3, 1000, 4099])
def test_coded_ring_gives_every_rank_the_same_bits_equal_to_its_reference(codec_name, n, numel):
    from trainers.comm.allreduce import ring_coded, ring_coded_reference
    from trainers.compression import build_compressor

    codec = build_compressor(codec_name)
    generator = torch.Generator().manual_seed(numel + n)
    inputs = [torch.randn(numel, generator=generator) * (1 + r) for r in range(n)]
    results = {}

    def body(rank, exchange):
        flat = inputs[rank].clone()
        ring_coded(flat, codec, "avg", rank, n, exchange)
        results[rank] = flat
        summed = inputs[rank].clone()
        ring_coded(summed, codec, "sum", rank, n, exchange)
        sums[rank] = summed

    sums = {}
    _run_in_threads(n, body)
    reference = ring_coded_reference(inputs, codec, "avg")
    for rank in range(n):
        assert torch.equal(results[rank], reference), (codec_name, n, numel, rank)
        assert torch.equal(sums[rank], ring_coded_reference(inputs, codec, "sum")), (codec_name, n, numel, rank)
    assert torch.allclose(sums[0], torch.stack(inputs).sum(0), atol=2 * n * n * max(x.abs().max().item() for x in inputs) / 14)
    exact = torch.stack(inputs).mean(0)
    if numel > 2 * n:  # (a one-element chunk is its own scale: exact in any of these codes)
        assert not torch.equal(reference, exact)  # it is a code: something was rounded
    if codec_name == "int8":
        # n-1 partial sums rounded on the way, each by at most half a step of its chunk's largest
        # element (<= n max|x|), then the mean once: at most n max|x| / 254 + max|x| / 254
        bound = (n + 1) * max(x.abs().max().item() for x in inputs) / 254
        assert (reference - exact).abs().max().item() <= bound * (1 + 1e-5)


def test_coded_ring_bytes_are_the_ring_s_at_the_code_s_size():
    from trainers.comm.allreduce import ring_coded_bytes
    from trainers.compression import build_compressor

    int8, int4 = build_compressor("int8"), build_compressor("int4")
    flat = torch.empty(8 * 4096)  # 8 chunks of 4096 elements, 8 int8 scales each
    for n in (2, 4, 8):
        chunk = flat.numel() // n
        payload8 = chunk + 4 * (chunk // 512)
        assert ring_coded_bytes(0, n, flat, int8) == (2 * (n - 1) * payload8,) * 2
        assert ring_coded_bytes(n - 1, n, flat, int4) == (2 * (n - 1) * (chunk // 2 + 4 * (chunk // 512)),) * 2
        fp32_ring = allreduce_bytes("ring", 0, n, flat)[0]
        assert fp32_ring / ring_coded_bytes(0, n, flat, int8)[0] == pytest.approx(4 / (1 + 4 / 512))


def coded_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """allreduce_coded_async on gloo ranks: the reference's bits on every rank, the bytes
    accounted, one rank's tensor the same object."""
    from tests.trainers.workers import _init_env

    _init_env(rank, world_size, port)
    from trainers.comm import TorchComm
    from trainers.compression import build_compressor

    comm = TorchComm("gloo", timeout_s=60, allreduce="auto", max_in_flight=2)
    rows = []
    for numel in (5, 1037, 70_001):
        for codec_name in ("int8", "int4"):
            generator = torch.Generator().manual_seed(numel)
            inputs = [torch.randn(numel, generator=generator) for _ in range(world_size)]
            tensor = inputs[rank].clone()
            before = (comm.stats.per_op["all_reduce"].bytes_sent, comm.stats.per_op["all_reduce"].bytes_recv)
            returned = comm.allreduce_coded_async(tensor, build_compressor(codec_name), op="avg").wait()
            from trainers.comm.allreduce import ring_coded_bytes, ring_coded_reference
            reference = ring_coded_reference(inputs, build_compressor(codec_name), "avg")
            rows.append({"numel": numel, "codec": codec_name, "same": returned is tensor,
                         "equal": torch.equal(tensor, reference),
                         "bytes": [comm.stats.per_op["all_reduce"].bytes_sent - before[0],
                                   comm.stats.per_op["all_reduce"].bytes_recv - before[1]],
                         "expected": list(ring_coded_bytes(rank, world_size, inputs[rank], build_compressor(codec_name)))})
    comm.shutdown()
    Path(out_dir, f"coded{rank}.json").write_text(json.dumps(rows))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 4])
def test_coded_ring_on_gloo_ranks_equals_its_reference_and_accounts_its_payloads(spawn_ranks, tmp_path, world_size):
    assert spawn_ranks(coded_worker, world_size, str(tmp_path), timeout_s=120) == [0] * world_size
    for rank in range(world_size):
        rows = json.loads((tmp_path / f"coded{rank}.json").read_text())
        assert len(rows) == 6
        for row in rows:
            assert row["equal"] and row["same"], (rank, row)
            assert row["bytes"] == row["expected"], (rank, row)


def test_coded_ring_checks_its_arguments_and_one_rank_rounds_once():
    from trainers.comm import Comm
    from trainers.compression import build_compressor

    world_of_one = type("WorldOfOne", (Comm,), {name: None for name in Comm.__abstractmethods__})
    comm = world_of_one(0, 1, allreduce="auto")
    int8 = build_compressor("int8")
    with pytest.raises(ValueError, match="op: 'max'"):
        comm.allreduce_coded_async(torch.ones(3), int8, op="max")
    with pytest.raises(ValueError, match="contiguous float"):
        comm.allreduce_coded_async(torch.ones(3, dtype=torch.int64), int8)
    x = torch.tensor([1.0, -0.5, 0.3])
    assert comm.allreduce_coded_async(x, int8).wait() is x
    assert x.tolist() == int8.decode(int8.encode(torch.tensor([1.0, -0.5, 0.3])), 3, torch.float32).tolist()
