"""The CIFAR-10 tutorial's model (DeepSpeedExamples ``training/cifar``) and made-up data in
CIFAR's shapes: ``tests/scripts/ds_tutorial_cifar.py`` trains them, and
``tests/test_ds_tutorial.py`` trains them again in plain torch for its reference."""

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)  # type: ignore[no-any-return]


def datasets() -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(80, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (80,), generator=generator)
    return (torch.utils.data.TensorDataset(images[:64], labels[:64]),
            torch.utils.data.TensorDataset(images[64:], labels[64:]))
