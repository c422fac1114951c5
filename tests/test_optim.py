import math

from tformer_cli.config import TrainConfig
from tformer_cli.optim import cosine_horizon, learning_rate


def test_noam_schedule_matches_the_paper():
    cfg = TrainConfig(schedule="noam", lr=1.0, warmup_steps=4000)
    for step in (1, 100, 4000, 10000):
        expected = 512 ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)
        assert math.isclose(learning_rate(step, cfg, 512), expected)
    assert learning_rate(4000, cfg, 512) > learning_rate(3000, cfg, 512) > 0
    assert learning_rate(4000, cfg, 512) > learning_rate(8000, cfg, 512)


def test_other_schedules_warm_up_to_the_peak_and_decay():
    inv = TrainConfig(schedule="inverse_sqrt", lr=1e-3, warmup_steps=100)
    assert math.isclose(learning_rate(50, inv, 1), 5e-4) and math.isclose(learning_rate(100, inv, 1), 1e-3)
    assert math.isclose(learning_rate(400, inv, 1), 5e-4)
    cos = TrainConfig(schedule="cosine", lr=1e-3, warmup_steps=10, max_steps=110, min_lr=1e-5)
    assert math.isclose(learning_rate(10, cos, 1), 1e-3) and math.isclose(learning_rate(110, cos, 1), 1e-5)


def test_cosine_ends_at_the_first_of_max_steps_epochs_and_max_time():
    cfg = TrainConfig(schedule="cosine", lr=1e-3, warmup_steps=10, max_steps=1000, max_time=100.0, min_lr=0.0)
    # 60 steps in the first 50 s: at this pace max_time runs out at step 120, before max_steps
    assert cosine_horizon(cfg, 1000, 60, 50.0) == 120
    assert math.isclose(learning_rate(65, cfg, 1, 120), 1e-3 * 0.5 * (1 + math.cos(math.pi * 55 / 110)))
    assert learning_rate(120, cfg, 1, cosine_horizon(cfg, 1000, 120, 100.0)) == 0.0
    assert cosine_horizon(cfg, 80, 60, 50.0) == 80  # epochs end first
    timed_only = TrainConfig(schedule="cosine", lr=1e-3, warmup_steps=0, max_steps=None, max_time=100.0)
    assert cosine_horizon(timed_only, None, 0, 0.0) is None  # no pace yet: the peak
    assert learning_rate(1, timed_only, 1, None) == 1e-3
    untimed = TrainConfig(schedule="cosine", max_steps=1000)
    assert cosine_horizon(untimed, 1000, 60, 50.0) == 1000
