"""Microbatches travel to a GPU as one packed byte buffer (``ppctl.run.train.pack_fields``): the round trip."""

import torch

from ppctl.data.dataset import Microbatch
from ppctl.run.train import pack_fields, to_device, unpack_fields


def test_every_field_comes_back_equal_with_its_dtype_and_shape_and_none_stays_none():
    microbatch = Microbatch(tokens=torch.arange(12).reshape(2, 6), position_ids=None,
                            labels=torch.arange(12).reshape(2, 6).t(),  # a strided field packs contiguously
                            loss_mask=torch.rand(2, 6, dtype=torch.float32))
    packed, layout = pack_fields(microbatch)
    assert packed.dtype == torch.uint8 and packed.numel() == 12 * 8 * 2 + 12 * 4  # one buffer, one transfer
    back = unpack_fields(packed.clone(), layout, Microbatch)
    assert back.position_ids is None
    for name in ("tokens", "labels", "loss_mask"):
        original, restored = getattr(microbatch, name), getattr(back, name)
        assert restored.dtype == original.dtype and restored.shape == original.shape
        assert torch.equal(restored, original)


def test_on_cpu_the_microbatch_is_used_as_it_is():
    microbatch = Microbatch(tokens=torch.zeros(1, 4, dtype=torch.int64), position_ids=None, labels=None,
                            loss_mask=None)
    assert to_device(microbatch, "cpu") is microbatch
