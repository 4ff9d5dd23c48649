import os

import pytest
import torch

# msprobe 26.2.0's own TinyNet dumps and outputs, copied from ../shared/fixtures so a plain clone is complete
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "msprobe-26.2.0", "tinynet")


class TinyNet(torch.nn.Module):
    """fc1 Linear(16,32) → ReLU → LayerNorm(32) → h*2+1 → fc2 Linear(32,8), as the msprobe fixtures."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.act = torch.nn.ReLU()
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 8)

    def forward(self, x):
        h = self.norm(self.act(self.fc1(x)))
        h = h * 2 + 1
        return self.fc2(h)


@pytest.fixture
def tinynet():
    torch.manual_seed(7)
    return TinyNet()


@pytest.fixture
def fixtures_dir():
    assert os.path.isdir(FIXTURES), f"test data missing: {FIXTURES} (part of the repository)"
    return FIXTURES
