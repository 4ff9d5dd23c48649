"""Source files the pytester tests write into their temporary projects."""

MODEL_TEST = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 8)
    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))

def build():
    torch.manual_seed(0)
    return Net()

def test_net(msprobe):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    msprobe.check(build(), x, loss_fn=lambda out: out.float().pow(2).mean())
"""

FAULT = """faults:
  - {api: Functional.layer_norm, call: 0, direction: forward, perturb: scale, value: 1.02}
"""
