"""LoRA's keyed dropout: masks that follow the row's key, also on a tensor-parallel rank's slice."""

from __future__ import annotations

import torch

from ember.train.dropout import DropoutKeys, KeyedDropout


def test_a_rank_holding_a_slice_of_the_columns_drops_the_slice_of_one_process_mask():
    """Under tensor parallelism a row-wise layer's input is this rank's columns: with `split` set,
    each of 2 ranks drops exactly what one process drops in those columns (without it, rank 1
    drew rank 0's mask and the two-rank losses left the tolerance: 3e-5 relative at step 3)."""
    keys = DropoutKeys(seed=7)
    keys.at(step=3, first=10)
    x = torch.randn(2, 5, 8)
    whole = KeyedDropout(0.3, keys, layer=4).train()(x)
    for index in range(2):
        part = KeyedDropout(0.3, keys, layer=4).train()
        part.split = (index, 2)
        cols = slice(4 * index, 4 * index + 4)
        assert torch.equal(part(x[..., cols]), whole[..., cols])
    assert not torch.equal(whole[..., :4] == 0, whole[..., 4:] == 0)  # the two halves differ: a real check


def test_unsplit_masks_depend_on_the_row_key_not_the_batch_position():
    keys = DropoutKeys(seed=7)
    x = torch.ones(3, 16)
    keys.at(step=1, first=0)
    rows = KeyedDropout(0.5, keys, layer=0).train()(x)
    keys.at(step=1, first=1)
    assert torch.equal(KeyedDropout(0.5, keys, layer=0).train()(x[1:]), rows[1:])
