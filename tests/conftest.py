import os

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tiny_model_config(**overrides):
    """A model small enough for a unit test, overridable per test."""
    from tformer_cli.config import ModelConfig

    values = dict(d_model=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=64, dropout=0.0,
                  max_len=64)
    values.update(overrides)
    return ModelConfig(**values)
