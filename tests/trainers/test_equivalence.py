"""Each algorithm against a reference it must reproduce (real gloo ranks on loopback)."""

import json

import pytest
import torch

from tests.trainers.conftest import records, run_sessions
from tests.trainers.reference import global_batches, make_model
from tests.trainers.workers import sync_union_worker
from trainers.training import loss_fn

pytestmark = pytest.mark.slow

MOMENTUM = {"optimizer": {"momentum": 0.9, "weight_decay": 1e-4}, "save_final_model": True, "steps": 25}
PLAIN = {"save_final_model": True, "steps": 25}
ADAMW = {"save_final_model": True, "steps": 12, "lr": 0.01, "optimizer": {"name": "adamw", "weight_decay": 0.01}}
RUNS = {
    "sync_momentum": {**MOMENTUM, "algorithm": {"name": "sync"}},
    "sync_momentum_again": {**MOMENTUM, "algorithm": {"name": "sync"}},
    "ddp_momentum": {**MOMENTUM, "algorithm": {"name": "ddp"}},
    "dts_t0_p1_momentum": {**MOMENTUM, "algorithm": {"name": "dts", "params": {"t": 0, "p": 1}}},
    "sync_momentum_gloo": {**MOMENTUM, "algorithm": {"name": "sync"}, "comm": {"allreduce": "gloo"}},
    "sync_momentum_ring": {**MOMENTUM, "algorithm": {"name": "sync"}, "comm": {"allreduce": "ring"}},
    "dts_t0_p1_momentum_gloo": {
        **MOMENTUM, "algorithm": {"name": "dts", "params": {"t": 0, "p": 1}}, "comm": {"allreduce": "gloo"},
    },
    "sync_plain": {**PLAIN, "algorithm": {"name": "sync"}},
    "local_sgd_h1_plain": {**PLAIN, "algorithm": {"name": "local_sgd", "params": {"H": 1}}},
    "local_sgd_h1_ring_plain": {**PLAIN, "algorithm": {"name": "local_sgd", "params": {"H": 1, "collective": "ring"}}},
    "local_sgd_h1_adamw": {**ADAMW, "algorithm": {"name": "local_sgd", "params": {"H": 1}}},
    "diloco_h1_adamw": {
        **ADAMW,
        "algorithm": {"name": "diloco", "params": {"H": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}},
    },
    "diloco_h1_ring_adamw": {
        **ADAMW,
        "algorithm": {
            "name": "diloco",
            "params": {"H": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False, "collective": "ring"},
        },
    },
    "sync_adamw": {**ADAMW, "algorithm": {"name": "sync"}},
    # the whole run is DiLoCo's data-parallel warm-up: it must be `sync` with AdamW
    "diloco_warmup_all_adamw": {**ADAMW, "algorithm": {"name": "diloco", "params": {"H": 5, "warmup_steps": 12}}},
    "diloco_warmup4_h3_adamw": {**ADAMW, "algorithm": {"name": "diloco", "params": {"H": 3, "warmup_steps": 4}}},
    # the job's lr is DiLoCo's (0.004); the warm-up runs at sync_adamw's 0.01 (warmup_lr): sync's first steps
    "diloco_warmup4_h3_lr_adamw": {**ADAMW, "lr": 0.004,
                                   "algorithm": {"name": "diloco", "params": {"H": 3, "warmup_steps": 4, "warmup_lr": 0.01}}},
    # local SGD from the same warm start (DiLoCo's controls); with outer lr 1 and no momentum DiLoCo averages the same way
    "local_sgd_warmup4_h3_lr_adamw": {**ADAMW, "lr": 0.004, "algorithm": {"name": "local_sgd", "params": {
        "H": 3, "warmup_steps": 4, "warmup_lr": 0.01}}},
    "diloco_warmup4_h3_lr_plain_outer_adamw": {**ADAMW, "lr": 0.004, "algorithm": {"name": "diloco", "params": {
        "H": 3, "warmup_steps": 4, "warmup_lr": 0.01, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}}},
    # streaming_diloco's warm start (the family's base class) through the runner: H 4, F 2, tau 1
    "streaming_warmup4_h4_f2_lr_adamw": {**ADAMW, "lr": 0.004, "algorithm": {"name": "streaming_diloco", "params": {
        "H": 4, "fragments": 2, "overlap": 1, "warmup_steps": 4, "warmup_lr": 0.01}}},
    "dts_p2_t3_plain": {**PLAIN, "steps": 24, "eval_every": 24, "algorithm": {"name": "dts", "params": {"p": 2, "t": 3}}},
    # a cosine schedule ends at lr 0, the step a correction is due (launched at 21, applied at 23)
    "dts_p2_t2_cosine_plain": {**PLAIN, "steps": 24, "eval_every": 24, "lr_schedule": {"name": "cosine"},
                               "algorithm": {"name": "dts", "params": {"p": 2, "t": 2}}},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, spawn_ranks_module):
    return run_sessions(spawn_ranks_module, tmp_path_factory.mktemp("equivalence"), 2, RUNS)


def final_state(output_dir, rank):
    return torch.load(output_dir / f"rank{rank}_final.pt")


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_sync_equals_single_process_on_the_union_batch(spawn_ranks, tmp_path):
    steps = 8
    bucket_caps_mb = [25.0, 0.004]  # one bucket; one bucket per ~1000 floats
    assert spawn_ranks(sync_union_worker, 2, str(tmp_path), steps, bucket_caps_mb) == [0, 0]
    reference = make_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for x, y in global_batches(steps):
        optimizer.zero_grad()
        loss_fn(reference, (x, y)).backward()
        optimizer.step()
    for cap, expected_buckets in zip(bucket_caps_mb, (1, 4)):
        for rank in range(2):
            trained = torch.load(tmp_path / f"sync_{cap}_{rank}.pt")
            assert max_difference(trained, reference.state_dict()) < 1e-5, f"bucket_cap_mb={cap} rank {rank}"
            assert json.loads((tmp_path / f"buckets_{cap}_{rank}.json").read_text()) == expected_buckets


def test_same_seed_same_run(runs):
    """Seeds fix init, shards and batch order: a repeated run reproduces every loss and weight."""
    for rank in range(2):
        assert [r["loss"] for r in records(runs["sync_momentum_again"], rank, "step")] == [
            r["loss"] for r in records(runs["sync_momentum"], rank, "step")
        ]
        assert max_difference(final_state(runs["sync_momentum_again"], rank), final_state(runs["sync_momentum"], rank)) == 0.0


@pytest.mark.parametrize("name", ["ddp_momentum", "dts_t0_p1_momentum"])
def test_equals_sync_with_momentum(runs, name):
    for rank in range(2):
        difference = max_difference(final_state(runs[name], rank), final_state(runs["sync_momentum"], rank))
        assert difference < 1e-6, f"{name} rank {rank} differs from sync by {difference}"
    ours = [r["loss"] for r in records(runs[name], 0, "step")]
    theirs = [r["loss"] for r in records(runs["sync_momentum"], 0, "step")]
    assert ours == pytest.approx(theirs, abs=1e-5)


@pytest.mark.parametrize("name", ["sync_momentum_gloo", "sync_momentum_ring", "dts_t0_p1_momentum_gloo"])
def test_our_allreduce_equals_gloos_and_the_start_record_says_which(runs, name):
    """sync and DTS(t=0, p=1) on our all-reduce (comm.allreduce: auto, the default) against gloo's
    all_reduce and the ring; every rank's start record names the transport it used."""
    reference = "dts_t0_p1_momentum" if name.startswith("dts") else "sync_momentum"
    for rank in range(2):
        difference = max_difference(final_state(runs[name], rank), final_state(runs[reference], rank))
        assert difference < 1e-6, f"{name} rank {rank} differs from {reference} by {difference}"
        assert records(runs[reference], rank, "start")[0]["transport"] == "ours:auto"
        expected = "gloo" if name.endswith("gloo") else "ours:ring"
        assert records(runs[name], rank, "start")[0]["transport"] == expected
    ours = [r["bytes_sent"] for r in records(runs[reference], 0, "step")]
    assert ours == [r["bytes_sent"] for r in records(runs[name], 0, "step")]  # 2 ranks: 1 tensor each way


@pytest.mark.parametrize("name", ["local_sgd_h1_plain", "local_sgd_h1_ring_plain"])
def test_local_sgd_h1_equals_sync_for_plain_sgd(runs, name):
    for rank in range(2):
        assert max_difference(final_state(runs[name], rank), final_state(runs["sync_plain"], rank)) < 1e-6
    if name.endswith("ring_plain"):  # the same bytes as the all-reduce, moved by isend/irecv
        sent = [r["bytes_sent"] for r in records(runs[name], 0, "step")]
        assert sent == [r["bytes_sent"] for r in records(runs["local_sgd_h1_plain"], 0, "step")]


@pytest.mark.parametrize("name", ["diloco_h1_adamw", "diloco_h1_ring_adamw"])
def test_diloco_with_h1_plain_outer_step_is_averaging_every_step(runs, name):
    """outer_lr 1 without momentum: theta_g - 1 * mean(theta_g - theta_i) = mean(theta_i)."""
    for rank in range(2):
        difference = max_difference(final_state(runs[name], rank), final_state(runs["local_sgd_h1_adamw"], rank))
        assert difference < 1e-5


def test_diloco_warmup_over_the_whole_run_is_sync_with_adamw(runs):
    """warmup_steps = steps: every step averages the gradients and AdamW steps on the average, as
    `sync` with the same AdamW; no outer step is taken."""
    for rank in range(2):
        difference = max_difference(final_state(runs["diloco_warmup_all_adamw"], rank),
                                    final_state(runs["sync_adamw"], rank))
        assert difference < 1e-5, f"rank {rank} differs from sync by {difference}"
    assert [r["syncs_applied"] for r in records(runs["diloco_warmup_all_adamw"], 0, "step")] == [1] * 12


def test_diloco_rounds_count_from_the_end_of_the_warmup(runs):
    """warmup_steps 4, H 3, 12 steps: one gradient average per warm-up step (0-3), then outer steps
    end steps 4 + 3 - 1 = 6 and 9; the warm-up's losses are sync's, and the replicas then train apart."""
    out = runs["diloco_warmup4_h3_adamw"]
    for rank in range(2):
        steps = records(out, rank, "step")
        assert [r["syncs_applied"] for r in steps] == [1, 1, 1, 1, 0, 0, 1, 0, 0, 1, 0, 0]
        sync_losses = [r["loss"] for r in records(runs["sync_adamw"], rank, "step")]
        assert [r["loss"] for r in steps[:5]] == pytest.approx(sync_losses[:5], abs=1e-6)
    assert [r["loss"] for r in records(out, 0, "step")][5:] != [r["loss"] for r in records(runs["sync_adamw"], 0, "step")][5:]
    assert max_difference(final_state(out, 0), final_state(out, 1)) > 1e-4  # 2 inner steps since the last round


def warmup_at_syncs_lr(runs, name: str, rank: int) -> list[dict]:
    """``name``'s step records on ``rank``, checked to have warmed up as `sync_adamw`: warmup_steps 4
    at its lr 0.01 (warmup_lr), then the job's 0.004; the losses of steps 0-4 (step 4's from the
    warm-up's model) are sync's."""
    steps = records(runs[name], rank, "step")
    sync = records(runs["sync_adamw"], rank, "step")
    assert [r["lr"] for r in steps] == pytest.approx([0.01] * 4 + [0.004] * 8)
    assert [r["loss"] for r in steps[:5]] == pytest.approx([r["loss"] for r in sync[:5]], abs=1e-6)
    return steps


def test_diloco_warmup_lr_makes_the_warmup_syncs_own_first_steps(runs):
    """warmup_lr = sync's lr, job lr lower: steps 0-3 run at sync's lr and are sync's steps (the
    losses of steps 0-4 agree, step 4's from the warm-up's model), then the job's lr applies."""
    out = runs["diloco_warmup4_h3_lr_adamw"]
    for rank in range(2):
        warmup_at_syncs_lr(runs, "diloco_warmup4_h3_lr_adamw", rank)
        assert [r["lr"] for r in records(runs["sync_adamw"], rank, "step")] == pytest.approx([0.01] * 12)
    # from step 4 the replicas take smaller steps than diloco_warmup4_h3_adamw's (job lr 0.01)
    same_job_lr = [r["loss"] for r in records(runs["diloco_warmup4_h3_adamw"], 0, "step")]
    assert [r["loss"] for r in records(out, 0, "step")][6:] != pytest.approx(same_job_lr[6:], abs=1e-6)


def test_local_sgd_takes_diloco_s_warm_start_and_averages_as_diloco_with_a_plain_outer_step(runs):
    """local_sgd with warmup_steps 4 at sync's lr (warmup_lr), H 3: steps 0-3 are sync's (lr and
    the losses of steps 0-4), then the job's lr; averages end steps 6 and 9; and every step and the
    final replicas are DiLoCo's from the same warm start with outer lr 1 and no momentum
    (theta_g - mean(theta_g - theta_i) = mean(theta_i)), the control it stands beside."""
    out = runs["local_sgd_warmup4_h3_lr_adamw"]
    diloco = runs["diloco_warmup4_h3_lr_plain_outer_adamw"]
    for rank in range(2):
        steps = warmup_at_syncs_lr(runs, "local_sgd_warmup4_h3_lr_adamw", rank)
        assert [r["syncs_applied"] for r in steps] == [1, 1, 1, 1, 0, 0, 1, 0, 0, 1, 0, 0]
        assert [r["loss"] for r in steps] == pytest.approx([r["loss"] for r in records(diloco, rank, "step")], abs=1e-5)
        assert max_difference(final_state(out, rank), final_state(diloco, rank)) < 1e-5
    assert [r["loss"] for r in records(out, 0, "step")][5:] != pytest.approx([r["loss"] for r in records(runs["sync_adamw"], 0, "step")][5:], abs=1e-6)


def test_streaming_diloco_warmup_is_syncs_own_first_steps_and_its_fragments_count_from_its_end(runs):
    """Streaming DiLoCo with warmup_steps 4 at sync's lr: steps 0-3 are sync's (losses of steps 0-4
    agree, lr as sync's), then the job's lr; fragments (H 4, F 2, tau 1) are applied after inner
    steps 2, 4, 6, 8, i.e. at steps 5, 7, 9, 11, each sync launched one step earlier (the bytes)."""
    for rank in range(2):
        steps = warmup_at_syncs_lr(runs, "streaming_warmup4_h4_f2_lr_adamw", rank)
        assert [r["syncs_applied"] for r in steps] == [1, 1, 1, 1, 0, 1, 0, 1, 0, 1, 0, 1]
        assert [r["bytes_sent"] > 0 for r in steps] == [True] * 4 + [True, False] * 4


def test_dts_replicas_agree_once_every_correction_is_applied(runs):
    """Plain SGD, p=2, t=3 (two syncs in flight): after finish() every local contribution has been
    replaced by the global one, so the replicas must be identical although they trained apart."""
    out = runs["dts_p2_t3_plain"]
    assert max_difference(final_state(out, 0), final_state(out, 1)) < 1e-5
    steps = records(out, 0, "step")
    staleness = [r["staleness"] for r in steps]
    # Syncs launch at steps 1, 3, 5, ... and are applied 3 steps later.
    assert staleness[:6] == [None, None, None, None, 3, None]
    assert staleness.count(3) == 10  # 12 launched, the last 2 are applied by finish()
    assert all(r["bytes_sent"] > 0 for r in steps if r["step"] % 2 == 1)
    assert all(r["bytes_sent"] == 0 for r in steps if r["step"] % 2 == 0)
    # Replicas did train apart between syncs: their losses differ on the same step.
    other = [r["loss"] for r in records(out, 1, "step")]
    assert [r["loss"] for r in steps] != other


def test_dts_applies_a_correction_due_at_lr_0(runs):
    """The last step of a cosine schedule has lr 0: the correction due there cannot pass through the
    gradient (it is divided by the lr) and is applied to the parameters directly; the replicas
    still agree once every correction is in (a paper-dts-lm job failed with ZeroDivisionError)."""
    out = runs["dts_p2_t2_cosine_plain"]
    steps = records(out, 0, "step")
    assert steps[-1]["lr"] == 0.0 and steps[-1]["staleness"] == 2
    assert max_difference(final_state(out, 0), final_state(out, 1)) < 1e-5
