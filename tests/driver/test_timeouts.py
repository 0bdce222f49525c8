"""How long a rank waits in a collective (`driver/run.py`): with Inductor's
kernels a cold first step waits on the peers' builds (a cold ResNet tiny
dp2·pp2 receive waited past 60 s)."""

from meshplan.driver.run import timeout_for, train_timeout


def test_a_timeout_left_unset_covers_a_cold_first_step_of_inductor_kernels():
    """A timeout the caller sets is kept, either way."""
    assert timeout_for(None, "eager") == 60.0 and timeout_for(None, "inductor") == 900.0
    assert timeout_for(30.0, "inductor") == 30.0 and timeout_for(5.0, "eager") == 5.0


def test_a_training_runs_timeout_is_past_its_watchdog_and_a_cold_first_step():
    """`meshplan train`: a minute past `--stall-timeout` (the watchdog names a
    hung rank first), and with Inductor no shorter than `run`'s wait."""
    assert train_timeout(300.0, "eager") == 360.0
    assert train_timeout(300.0, "inductor") == 900.0
    assert train_timeout(1000.0, "inductor") == 1060.0 and train_timeout(3.0, "eager") == 63.0
