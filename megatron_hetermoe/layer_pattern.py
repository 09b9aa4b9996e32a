"""Which of a model's layers are MoE layers: Megatron's --moe-layer-freq, read as Megatron reads it.

`--moe-layer-freq N` (an int, or its decimal string) makes layer i an MoE layer when i % N == 0;
a list expression such as "([0]+[1]*2)" (DeepSeek's first-k dense layers) gives the pattern
itself, 1 = MoE, 0 = dense, one entry per layer. A HeterMoE plan counts its MoE layers
(`num_layers`, one placement each) and names the dense ones by model index (`dense_layers`).
"""
from __future__ import annotations

import ast

from megatron_hetermoe.errors import UserError


class LayerPatternError(UserError, ValueError):
    """A --moe-layer-freq that names no valid pattern for the model."""


def _evaluate(node: ast.AST):
    """Lists of ints, +, * and parentheses: the expressions Megatron-LM's _eval_pattern accepts
    (which checks the characters and calls eval); evaluated here without eval."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_evaluate(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        a, b = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(a, list) == isinstance(b, list):
            raise LayerPatternError("* repeats a list an int number of times")
        if (b if isinstance(a, list) else a) > 1 << 16:  # no pattern is that long; refuse before allocating
            raise LayerPatternError("a repeat above 65536")
        return a * b
    raise LayerPatternError(f"{ast.dump(node)[:60]} is not a list of 0/1, +, * or ()")


def parse_moe_layer_freq(value: int | str | list[int]) -> int | list[int]:
    """An int or a list of 0/1, from what a flag or a YAML config gives."""
    if isinstance(value, list):
        return list(value)
    if type(value) is int:
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return int(text)
        try:
            out = _evaluate(ast.parse(text, mode="eval"))
        except (SyntaxError, LayerPatternError, TypeError) as e:
            raise LayerPatternError(f"moe_layer_freq {value!r} is not an int nor a list expression such as "
                                    f"'([0]+[1]*2)' ({e})") from None
        return out
    raise LayerPatternError(f"moe_layer_freq {value!r} is not an int nor a list expression such as '([0]+[1]*2)'")


def moe_layer_pattern(moe_layer_freq: int | str | list[int], num_layers: int) -> list[int]:
    """One entry per layer, 1 = MoE layer, 0 = dense (Megatron's meaning of --moe-layer-freq)."""
    freq = parse_moe_layer_freq(moe_layer_freq)
    if isinstance(freq, int):
        if freq < 1:
            raise LayerPatternError(f"moe_layer_freq {freq} must be >= 1 (1: every layer is an MoE layer)")
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    if len(freq) != num_layers or any(v not in (0, 1) for v in freq):
        raise LayerPatternError(f"moe_layer_freq {moe_layer_freq!r} gives {freq}: need {num_layers} entries of 0 "
                                f"(dense) or 1 (MoE), one per layer (num_layers={num_layers})")
    return freq


def dense_layers(moe_layer_freq: int | str | list[int], num_layers: int) -> list[int]:
    """The model indices of the layers without experts."""
    pattern = moe_layer_pattern(moe_layer_freq, num_layers)
    if not any(pattern):
        raise LayerPatternError(f"moe_layer_freq {moe_layer_freq!r} leaves no MoE layer in {num_layers} layers; "
                                f"HeterMoE trains MoE models")
    return [i for i, v in enumerate(pattern) if not v]


def model_dense_layers(moe_layer_freq: int | str | list[int], num_layers: int,
                       mtp_num_layers: int | None = None) -> list[int]:
    """dense_layers of a model with `num_layers` decoder layers and `mtp_num_layers` MTP layers
    after them (model layers num_layers + k): Megatron builds each MTP layer from the decoder's
    last layer spec, so an MTP layer is dense exactly when the last decoder layer is."""
    dense = dense_layers(moe_layer_freq, num_layers)
    mtp = mtp_num_layers or 0
    return dense + ([num_layers + k for k in range(mtp)] if num_layers - 1 in dense else [])
