"""BERT's static-shape masking and masked-LM loss."""

import torch

from apps.bert.model import Bert, BertArgs
from lingua.model.transformer import TransformerArgs

MASK_ID = 99


def tiny_bert(mask_ratio=0.2):
    torch.manual_seed(0)
    model = Bert(BertArgs(TransformerArgs(dim=16, n_layers=1, n_heads=2, max_seqlen=50), mask_ratio), 100, MASK_ID)
    model.init_weights()
    return model


def test_masking_has_a_static_shape_and_exact_count():
    model, generator = tiny_bert(), torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 90, (6, 50))
    batch = model.make_batch(tokens, generator)
    assert batch["mask_idx"].shape == batch["targets"].shape == (6, 10)  # round(0.2 * 50)
    for row in range(6):
        idx = batch["mask_idx"][row]
        assert len(set(idx.tolist())) == 10  # no duplicates
        assert (batch["inputs"][row] == MASK_ID).sum() == 10
        assert torch.equal(batch["inputs"][row][idx], torch.full((10,), MASK_ID))
        assert torch.equal(batch["targets"][row], tokens[row][idx])
        kept = torch.ones(50, dtype=torch.bool).index_fill(0, idx, False)
        assert torch.equal(batch["inputs"][row][kept], tokens[row][kept])


def test_masks_differ_across_rows_and_steps_and_repeat_from_a_seed():
    model = tiny_bert()
    tokens = torch.randint(0, 90, (4, 50))
    first = model.make_batch(tokens, torch.Generator().manual_seed(1))["mask_idx"]
    generator = torch.Generator().manual_seed(1)
    again, later = (model.make_batch(tokens, generator)["mask_idx"] for _ in range(2))
    assert torch.equal(first, again)
    assert not torch.equal(first, later)
    assert len({tuple(sorted(row.tolist())) for row in first}) == 4


def test_loss_is_the_cross_entropy_at_the_masked_positions():
    model, generator = tiny_bert(), torch.Generator().manual_seed(0)
    batch = model.make_batch(torch.randint(0, 90, (2, 50)), generator)
    loss, stats = model(**batch)
    logits = model.encoder.logits(model.encoder(batch["inputs"], torch.arange(50).expand(2, -1)))
    picked = logits[torch.arange(2)[:, None], batch["mask_idx"]]  # [2, 10, vocab]
    expected = torch.nn.functional.cross_entropy(picked.flatten(0, 1), batch["targets"].flatten())
    assert torch.allclose(loss, expected, atol=1e-6)
    assert stats["accuracy"] == (picked.argmax(-1) == batch["targets"]).float().mean()

