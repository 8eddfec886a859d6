"""The fp16 dynamic loss scaler: halved on an overflow, doubled after a window of good steps, bounded below."""

import pytest

from ppctl.optim.loss_scale import DynamicLossScaler


def test_backs_off_on_overflow_and_grows_after_a_window_of_good_steps():
    scaler = DynamicLossScaler(scale=1024.0, growth_interval=3, min_scale=256.0)
    assert scaler.is_overflow(False) and not scaler.is_overflow(True)
    scaler.update(False)
    assert scaler.scale == 512.0
    for _ in range(2):
        scaler.update(True)
    scaler.update(False)  # an overflow restarts the count of good steps
    assert scaler.scale == 256.0
    assert not scaler.is_overflow(False)  # at the minimum, a non-finite norm is a real fault
    scaler.update(False)
    assert scaler.scale == 256.0
    for _ in range(3):
        scaler.update(True)
    assert scaler.scale == 512.0 and scaler.good_steps == 0


@pytest.mark.parametrize("settings", [{"scale": 1.0, "min_scale": 2.0}, {"min_scale": 0.0}, {"growth_interval": 0}])
def test_bad_settings_refused(settings):
    with pytest.raises(ValueError):
        DynamicLossScaler(**settings)
