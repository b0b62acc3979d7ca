"""The DiLoCo family's warm start (``warmup_steps``; `diloco` and `streaming_diloco`) in one
process: params, the warm-up's lr and model, and diloco's rejoin arithmetic. The multi-rank
references (warm-up = `sync`, first outer step H steps later) are in test_equivalence.py, and
streaming's against diloco's in test_streaming_diloco.py."""

import pytest
import torch

from trainers.algorithms import AlgorithmContext
from trainers.algorithms.diloco import DiLoCo, DiLoCoParams, DiLoCoState
from trainers.algorithms.local_sgd import LocalSGDParams
from trainers.algorithms.streaming_diloco import StreamingDiLoCo, StreamingDiLoCoParams
from trainers.config import ConfigError, OptimizerConfig


class OneRank:
    rank, world_size = 0, 1


FAMILY = {"diloco": (DiLoCo, DiLoCoParams), "streaming_diloco": (StreamingDiLoCo, StreamingDiLoCoParams)}
# local SGD takes the same warm start (its controls start where DiLoCo does): the same checks
WARMUP_PARAMS = {name: params for name, (_, params) in FAMILY.items()} | {"local_sgd": LocalSGDParams}


def _diloco(name: str = "diloco", model: torch.nn.Module | None = None, **params) -> DiLoCo | StreamingDiLoCo:
    torch.manual_seed(0)
    ctx = AlgorithmContext(model=model if model is not None else torch.nn.Linear(3, 2), comm=OneRank(), loss_fn=None, optimizer=OptimizerConfig(),
                           lr=0.1, device=torch.device("cpu"))
    cls, params_cls = FAMILY[name]
    if name == "streaming_diloco":
        params.setdefault("fragments", 1)  # a fragment count that divides any H
    algorithm = cls(params_cls(**params), ctx)
    algorithm.rejoining = True  # setup() without the start broadcast (one rank, no comm)
    algorithm.setup()
    return algorithm


@pytest.mark.parametrize("changes, field", [({"warmup_steps": -1}, "warmup_steps"), ({"warmup_steps": 2.5}, "warmup_steps"),
                                            ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
                                            ({"warmup_steps": 4, "warmup_lr": 0}, "warmup_lr"),
                                            ({"warmup_lr": 0.02}, "warmup_lr")])
@pytest.mark.parametrize("name", WARMUP_PARAMS)
def test_bad_warmup_params_name_the_field(changes, field, name):
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        WARMUP_PARAMS[name](**changes)


@pytest.mark.parametrize("warmup_steps, step, expected", [
    (0, 9, DiLoCoState(inner_steps=0, rounds=2)),       # steps 0..9 done: rounds end at 4 and 9
    (0, 11, DiLoCoState(inner_steps=2, rounds=2)),
    (6, 3, DiLoCoState(warm=False)),                     # step 4 is still a warm-up step
    (6, 5, DiLoCoState(inner_steps=0, rounds=0)),        # the warm-up's last step: rounds start at 6
    (6, 9, DiLoCoState(inner_steps=4, rounds=0)),
    (6, 10, DiLoCoState(inner_steps=0, rounds=1)),       # first outer step ended step 6 + 5 - 1 = 10
    (6, 18, DiLoCoState(inner_steps=3, rounds=2)),
])
def test_a_rejoined_rank_counts_its_round_from_the_warmups_end(warmup_steps, step, expected):
    source = _diloco(H=5, warmup_steps=warmup_steps)
    rejoiner = _diloco(H=5, warmup_steps=warmup_steps)
    rejoiner.load_rejoin_state(source.rejoin_state(source.deployable_model()), step)
    assert rejoiner.state == expected
    assert (rejoiner.bucketer is not None) == (not expected.warm)  # the gradient all-reduce only in the warm-up


def test_a_rank_rejoining_in_the_warmup_gets_the_replica_and_the_inner_adamw_state():
    source = _diloco(H=5, warmup_steps=6)
    with torch.no_grad():  # the replica has moved from theta_g (the start), as after warm-up steps
        for param in source.model.parameters():
            param.add_(1.0)
            param.grad = torch.ones_like(param)
    source.optimizer.step()
    state = source.rejoin_state(source.deployable_model())
    assert source.deployable_model() is source.model
    rejoiner = _diloco(H=5, warmup_steps=6)
    rejoiner.load_rejoin_state(state, 2)
    for ours, theirs in zip(rejoiner.model.parameters(), source.model.parameters()):
        assert torch.equal(ours, theirs)
    moments = [s["exp_avg"] for s in rejoiner.optimizer.state_dict()["state"].values()]
    assert moments and all(m.abs().sum() > 0 for m in moments)


@pytest.mark.parametrize("warmup_lr, expected", [(None, [0.1] * 8), (0.02, [0.02] * 6 + [0.1] * 2)])
@pytest.mark.parametrize("name", FAMILY)
def test_warmup_lr_is_the_peak_lr_of_the_warmups_steps_only(warmup_lr, expected, name):
    algorithm = _diloco(name, H=5, warmup_steps=6, warmup_lr=warmup_lr)
    assert [algorithm.peak_lr(step, 0.1) for step in range(8)] == expected


@pytest.mark.parametrize("name", FAMILY)
def test_the_warmup_deploys_the_replica_and_its_end_hands_it_to_theta_g(name):
    algorithm = _diloco(name, H=5, warmup_steps=6)
    assert algorithm.bucketer is not None and algorithm.deployable_model() is algorithm.model
    with torch.no_grad():  # the replica has moved from theta_g (the start), as after warm-up steps
        for param in algorithm.model.parameters():
            param.add_(1.0)
    algorithm.bucketer.wait_and_apply = lambda: None  # one rank, no comm: only the hand-over is checked here
    algorithm.end_warmup()
    assert algorithm.bucketer is None and algorithm.deployable_model() is algorithm.global_model
    for ours, theirs in zip(algorithm.global_model.parameters(), algorithm.model.parameters()):
        assert torch.equal(ours, theirs)
    assert algorithm.state.warm and algorithm.state.inner_steps == 0


@pytest.mark.parametrize("name", FAMILY)
def test_the_warmups_end_averages_the_float_buffers_into_theta_g(name):
    """end_warmup averages the replica's float buffers over the ranks (BatchNorm statistics: no
    gradient trains them) before theta_g takes the replica; here one rank, the average recorded. A
    non-persistent buffer (a constant such as the transformer's causal mask) is not exchanged."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    model.register_buffer("constant", torch.full((4,), -1.0), persistent=False)
    algorithm = _diloco(name, model=model, H=5, warmup_steps=6)
    algorithm.bucketer.wait_and_apply = lambda: None
    averaged = []

    def average(tensors, collective="allreduce"):
        averaged.append(len(tensors))
        for tensor in tensors:
            tensor.fill_(0.25)   # stands for the mean over the ranks

    algorithm.average_tensors = average
    algorithm.end_warmup()
    assert averaged == [2]   # running_mean and running_var (num_batches_tracked is not a float)
    assert torch.equal(model.constant, torch.full((4,), -1.0))
    batchnorm = algorithm.global_model[1]
    assert torch.equal(batchnorm.running_mean, torch.full((2,), 0.25))
    assert torch.equal(batchnorm.running_var, torch.full((2,), 0.25))


def test_the_language_models_causal_mask_is_not_among_the_buffers_the_family_exchanges():
    """The byte LM keeps its causal mask as a non-persistent float buffer (seq_len^2 floats); the
    family's rounds exchange only persistent float buffers, so none for this model."""
    from trainers.algorithms.diloco_common import float_buffers
    from trainers.models import TinyTransformerLM, TransformerParams

    model = TinyTransformerLM(TransformerParams(), seq_len=32, vocab_size=256)
    assert model.causal_mask.is_floating_point() and model.causal_mask.numel() == 32 * 32
    assert float_buffers(model) == []
