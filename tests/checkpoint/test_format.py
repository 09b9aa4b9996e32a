"""The rank file's contents (checkpoint/format.py), without processes."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_hetermoe.checkpoint.format import RankState, rank_payload


def test_a_save_copies_parameters_to_the_host_not_on_the_device():
    """Issue 24 item 3: a copy on the rank's device doubles the model's memory there at the first
    --save-interval. Parameters on a (fake) CUDA device, which needs no GPU: every saved tensor
    is a CPU copy."""
    with FakeTensorMode():
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.empty(4, 4, device="cuda"))
        module.bias = torch.nn.Parameter(torch.empty(4, device="cuda"))
    optimizer = SimpleNamespace(state_dict=dict, optimizer=SimpleNamespace(param_groups=[
        {"params": list(module.parameters())}]))
    state = RankState("hetero", 0, 1, "expert", module, {"weight": "w", "bias": "b"}, optimizer,
                      SimpleNamespace(state_dict=dict), {}, {})
    model = rank_payload(state, 1)["model"]
    assert {n: t.device.type for n, t in model.items()} == {"weight": "cpu", "bias": "cpu"}
