"""The layer list capture records (`capture/structure.py`): the longest
`nn.ModuleList` the forward runs, of one block class where two are as
long, its blocks of one class or several (Mllama's self- and
cross-attention layers), so `layer_pattern="derived"` pipelines such a
model."""

import torch
import torch.nn.functional as F
from torch import nn

import meshplan.api as mp
from meshplan.capture.structure import structure_facts
from meshplan.ir.mesh import DERIVED


class Dense(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.gate = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc(x) * torch.sigmoid(self.gate(x))


class Mixed(nn.Module):
    """Four layers of two classes, and a shorter one-class list (Zamba 2's adapters)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList([Dense(), Gated(), Dense(), Gated()])
        self.adapters = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(h), y)


def test_the_longest_list_is_the_layer_list_whatever_its_classes():
    module = Mixed()
    ran = frozenset({"embed", "layers.0.fc", "layers.1.fc", "layers.1.gate", "layers.2.fc",
                     "layers.3.fc", "layers.3.gate", "head"})
    assert structure_facts(module, ran).layers == "layers"
    assert structure_facts(module, ran | {"adapters.0.x", "adapters.1.x"}).layers == "layers"
    # the forward never enters it: not a layer list, however long
    alone = frozenset({"embed", "adapters.0.x", "head"})
    assert structure_facts(module, alone).layers == "adapters"
    # of two lists as long, the one of one class
    module.layers = module.layers[:2]
    assert structure_facts(module, ran | {"adapters.0.x", "adapters.1.x"}).layers == "adapters"


def test_derived_layers_of_two_classes_train_at_pp2_as_eager():
    torch.manual_seed(0)
    module = Mixed()
    batches = [(torch.randn(4, 4), torch.randint(0, 3, (4,))) for _ in range(2)]
    graph = mp.capture(module, (batches[0][0][:2], batches[0][1][:2]))
    job = mp.plan(graph, mp.Mesh(1, 2), mp.Strategy(pp=2, global_batch_size=4,
                                                    micro_batch_size=2,
                                                    layer_pattern=DERIVED))
    assert job.strategy.layer_pattern == r"layers\.(\d+)"
    res = mp.verify(job, module, batches)
    assert res.ok, res.problems
