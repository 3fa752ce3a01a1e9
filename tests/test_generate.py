"""Byte generation, the loop around a model: oracles are models whose next byte is known."""

import pytest
import torch

from elastic_zero.models.generate import generate_bytes

pytestmark = pytest.mark.unit


class NextByte(torch.nn.Module):
    """Logits that favour (last byte + 1) % 256 by a wide margin; it refuses a window over `context`."""

    def __init__(self, context: int) -> None:
        super().__init__()
        self.context = context

    def forward(self, ids):
        assert ids.shape[1] <= self.context, ids.shape
        logits = torch.zeros(ids.shape[0], ids.shape[1], 256)
        logits.scatter_(2, ((ids + 1) % 256).unsqueeze(-1), 50.0)
        return logits


def test_each_byte_follows_from_the_last_within_the_window():
    assert generate_bytes(NextByte(4), b"a", 5, context=4, temperature=0) == b"abcdef"
    assert generate_bytes(NextByte(2), b"\xfe", 3, context=2, temperature=1.0) == b"\xfe\xff\x00\x01"


def test_sampling_is_seeded_and_follows_the_model():
    model = torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))
    one = generate_bytes(model, b"def ", 40, context=16, seed=3)
    assert one == generate_bytes(model, b"def ", 40, context=16, seed=3) and one.startswith(b"def ")
    assert one != generate_bytes(model, b"def ", 40, context=16, seed=4)
    assert model.training  # left as it was found


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="prompt"):
        generate_bytes(NextByte(4), b"", 3, context=4)
    with pytest.raises(ValueError, match="temperature"):
        generate_bytes(NextByte(4), b"a", 3, context=4, temperature=-1)
