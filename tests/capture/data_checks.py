"""A model with a check on its data, outside the test files: pytest rewrites
an `assert` in a test file, and torch.export knows only Python's own
(it turns `assert <value> <= n` into a runtime assert)."""

from torch import nn


class Checked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x, y):
        lengths = (x > -100).sum(dim=1)
        assert lengths.max().item() <= x.shape[1]  # a check on the data, as XLM's
        return nn.functional.mse_loss(self.fc(x).squeeze(-1), y)
