"""Loss equality of meshplan's single-process step with eager PyTorch."""

import pytest

from meshplan.driver.verify import verify
from meshplan.errors import ConfigError


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("model", ["gpt", "bert", "resnet"])
def test_tiny_models_match_eager_for_20_steps(model, optimizer):
    r = verify(model, "tiny", steps=20, optimizer=optimizer)
    assert len(r["losses"]) == len(r["ref_losses"]) == 20
    assert r["max_abs_diff"] <= 1e-5, r
    # training actually moves the loss: equality is not of two frozen curves
    assert r["losses"][0] != r["losses"][-1]


def test_gradient_accumulation_matches_eager():
    r = verify("gpt", "tiny", steps=5, global_batch_size=8, num_microbatches=4)
    assert r["max_abs_diff"] <= 1e-5, r


def test_resnet_batchnorm_over_microbatches_matches_eager():
    r = verify("resnet", "tiny", steps=3, global_batch_size=8, num_microbatches=2)
    assert r["max_abs_diff"] <= 1e-5, r


def test_batch_not_divisible_into_microbatches_is_config_error():
    with pytest.raises(ConfigError, match="does not split into 3 micro-batches"):
        verify("gpt", "tiny", steps=1, global_batch_size=8, num_microbatches=3)
