"""Unit gates in traced stages (``mpar.partition._gates``): where they fire, what they own.

A recording gate stands in for ZeRO's unit-group hooks: every group must see
``pre_forward``/``post_forward`` in order in the forward, and in the backward
``pre_backward`` before and ``post_backward`` after its own gradients (so the
runtime may free its parameters at ``post_backward``), for every group, in
reverse order; the stage computes exactly what it computed without gates.
"""

from __future__ import annotations

import torch

from mpar.partition import find_units, split_module
from mpar.partition._gates import gate_graph, owners
from mpar.runtime._split_backward import accumulate_weight_grads, deferred_linear
from mpar.runtime._unit_hooks import group_units
from mpar.testing.models import GPTConfig, TinyGPT


class Recorder:
    def __init__(self, stage: torch.nn.Module, groups: list[list[str]]) -> None:
        self.calls: list[tuple[str, int]] = []
        self.params = [[stage.get_parameter(n) for n, _ in _named(stage, g)] for g in groups]

    def _log(self, kind: str, g: int) -> None:
        self.calls.append((kind, g))

    def pre_forward(self, g: int) -> None:
        self._log("pre_forward", g)

    def post_forward(self, g: int) -> None:
        self._log("post_forward", g)

    def pre_backward(self, g: int) -> None:
        # none of the group's gradients may exist yet
        assert all(p.grad is None for p in self.params[g]), g
        self._log("pre_backward", g)

    def post_backward(self, g: int) -> None:
        self._log("post_backward", g)


def _named(stage: torch.nn.Module, names: list[str]) -> list[tuple[str, torch.nn.Parameter]]:
    out = []
    for name, p in stage.named_parameters():
        if any(name == n or name.startswith(n + ".") for n in names):
            out.append((name, p))
    return out


def _split() -> tuple[TinyGPT, torch.Tensor, object]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, d_model=16, num_heads=2, num_layers=3, max_seq_len=8)
    model = TinyGPT(cfg)
    idx = torch.randint(0, 32, (2, 8))
    units = find_units(model, (idx,), {})
    split = split_module(model, (idx,), {}, [0, 3], units=units)
    return model, idx, split


def test_gates_fire_around_every_group_in_forward_and_backward() -> None:
    _, idx, split = _split()
    stage = split.stages[1]
    groups = group_units(split.units[1], "unit")
    x = split.stages[0](idx)
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in x]
    expected = stage(*inputs)

    owner = stage.install_unit_gates(groups, None)
    gate = Recorder(stage, groups)
    object.__setattr__(stage, "mpar_unit_gate", gate)
    out = stage(*inputs)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    n = len(groups)
    forward = [(k, g) for g in range(n) for k in ("pre_forward", "post_forward")]
    assert gate.calls == forward
    out.square().mean().backward()
    backward = gate.calls[len(forward) :]
    for g in reversed(range(n)):
        if not gate.params[g]:
            continue  # a group without parameters may have nothing to gate in backward
        assert backward.index(("pre_backward", g)) < backward.index(("post_backward", g))
    fired = [g for kind, g in backward if kind == "post_backward"]
    assert fired == sorted(fired, reverse=True)
    # every parameter is owned by the group of the unit it belongs to
    for g, names in enumerate(groups):
        for _, p in _named(stage, names):
            assert owner[id(p)] in (g, None)
    assert any(g is not None for g in owner.values())


class Keeping(Recorder):
    """A gate that keeps every linear layer's weight gradient for its group's
    ``post_backward``, as ZeRO-3 does to compute it after freeing the group."""

    def __init__(self, stage: torch.nn.Module, groups: list[list[str]]) -> None:
        super().__init__(stage, groups)
        self.kept: dict[int, list] = {}
        self.without_grad: list[torch.Tensor] = []  # kept weights at their post_backward

    def linear(self, g, x, weight, bias):
        def keep(w, x, dy):
            self.kept.setdefault(g, []).append((w, None, x, dy))
            return True

        return deferred_linear(x, weight, bias, defer=keep)

    def post_backward(self, g: int) -> None:
        super().post_backward(g)
        kept = self.kept.pop(g, [])
        self.without_grad += [w for w, *_ in kept if w.grad is None]
        accumulate_weight_grads(kept)


def test_linear_weight_gradients_can_wait_for_their_groups_end() -> None:
    """``aten.linear`` on a weight only it reads goes through ``gate.linear``: autograd
    computes no weight gradient in the group's backward, the gate computes it at
    ``post_backward``, and every gradient is bit for bit autograd's."""
    _, idx, split = _split()
    stage = split.stages[1]
    groups = group_units(split.units[1], "unit")
    x = split.stages[0](idx)
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in x]
    stage(*inputs).square().mean().backward()
    expected = {n: p.grad.clone() for n, p in stage.named_parameters()}
    expected_in = [t.grad.clone() for t in inputs if t.grad is not None]
    stage.zero_grad(set_to_none=True)
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in x]

    stage.install_unit_gates(groups, None)
    gate = Keeping(stage, groups)
    object.__setattr__(stage, "mpar_unit_gate", gate)
    calls = [n.target for n in stage.programs[stage.training].graph.nodes]
    stage(*inputs).square().mean().backward()
    assert not gate.kept  # every kept gradient was computed
    # the head (this stage reads the tied table only there) and the blocks' layers
    linears = sum(1 for t in calls if t is torch.ops.aten.linear.default)
    assert len(gate.without_grad) == linears > 0
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0, msg=name)
    got_in = [t.grad for t in inputs if t.grad is not None]
    for got, want in zip(got_in, expected_in, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_owners_leave_shared_parameters_to_no_group() -> None:
    _, _, split = _split()
    stage = split.stages[0]
    groups = group_units(split.units[0], "unit")
    program = stage.programs[stage.training]
    found = owners(program.graph, groups)
    assert found  # the stage reads parameters
    gated = gate_graph(program.graph, groups)
    calls = [n.target.__name__ for n in gated.nodes if n.op == "call_function"]
    assert calls.count("enter") == calls.count("leave") == len(groups)


def test_group_units_makes_groups_of_consecutive_units() -> None:
    units = ["a", "b", "c", "d", "e"]
    assert group_units(units, "unit") == [["a"], ["b"], ["c"], ["d"], ["e"]]
    assert group_units(units, 2) == [["a", "b"], ["c", "d"], ["e"]]
