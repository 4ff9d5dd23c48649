"""Example model suite: copy this folder into your project and point the plugin at your own backends.

The models are built from small ``transformers`` configs with fixed seeds (no downloads). Dropout is off and the
models run in eval mode so that the bench and target see identical computations.
"""

import pytest
import torch


@pytest.fixture
def token_batch():
    """A fixed batch of token ids: shape (2, 16), int64, vocabulary 256."""
    g = torch.Generator().manual_seed(100)
    return torch.randint(0, 256, (2, 16), generator=g)
