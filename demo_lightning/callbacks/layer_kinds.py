"""What kind of layer each parameter belongs to: the vocabulary of per-layer policies.

Kinds (one per parameter, first that applies):

==================  ==========================================================================
``embedding``       ``nn.Embedding`` weights; loose parameters named ``*embed*``, ``*token*``, ``pos*``
``norm``            LayerNorm, RMSNorm, GroupNorm, BatchNorm (any module class named ``*Norm*``)
``conv``            ``nn.Conv1d/2d/3d`` and transposed convolutions (timm patch embeddings too)
``attention_qk``    linears named ``q``, ``k``, ``q_proj``, ``k_proj``, ``query``, ``key``, fused
                    ``qkv`` / ``c_attn`` / ``in_proj``, and ``nn.MultiheadAttention.in_proj_*``
``attention_v``     linears named ``v``, ``v_proj``, ``value``
``attention_out``   ``proj`` / ``out_proj`` / ``o_proj`` / ``c_proj`` next to a Q/K/V linear, or
                    inside a module whose class or name says attention
``ffn``             other linears inside an MLP / feed-forward block (names ``mlp``, ``ffn``,
                    ``feed_forward``, ``fc*``, ``w1..w3``, ``up/down/gate_proj``, ``c_fc``)
``linear``          any other ``nn.Linear`` (heads, classifiers)
``other``           anything else
==================  ==========================================================================

A rule's ``kind="attention"`` matches all three attention kinds. Pure ``torch.nn``; no Lightning.
"""

from __future__ import annotations

import re

from torch import nn

__all__ = ["LAYER_KINDS", "RULE_KINDS", "kind_matches", "layer_kinds"]

LAYER_KINDS: tuple[str, ...] = (
    "embedding", "norm", "conv", "attention_qk", "attention_v", "attention_out", "ffn", "linear", "other",
)
RULE_KINDS: tuple[str, ...] = (*LAYER_KINDS, "attention")

_QK = {"q", "k", "q_proj", "k_proj", "query", "key", "qkv", "c_attn", "in_proj", "wq", "wk"}
_V = {"v", "v_proj", "value", "wv"}
_OUT = {"proj", "out_proj", "o_proj", "c_proj", "o", "wo", "dense"}
_FFN_PATH = re.compile(r"(^|[._])(mlp|ffn|feed_forward|feedforward)([._]|$)")
_FFN_NAME = re.compile(r"^(fc\d*|fc_\w+|w[123]|up_proj|down_proj|gate_proj|c_fc|lin\d*)$")
_ATTN_PATH = re.compile(r"(^|[._])(attn|attention|self_attn|self_attention)([._]|$)")


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)) or "Norm" in type(module).__name__


def _linear_kind(path: str, leaf: str, parent: nn.Module | None) -> str:
    if leaf in _QK:
        return "attention_qk"
    if leaf in _V:
        return "attention_v"
    siblings = {name for name, _ in parent.named_children()} if parent is not None else set()
    in_attention = bool(_ATTN_PATH.search(path)) or (parent is not None and "Attention" in type(parent).__name__)
    if leaf in _OUT and (in_attention or siblings & (_QK | _V)):
        return "attention_out"
    if in_attention:
        return "attention_out"
    if _FFN_PATH.search(path) or _FFN_NAME.match(leaf):
        return "ffn"
    return "linear"


def layer_kinds(model: nn.Module) -> dict[str, str]:
    """``{parameter name: kind}`` for every parameter of ``model`` (names as ``named_parameters``)."""
    modules = dict(model.named_modules())
    kinds: dict[str, str] = {}
    for name, _ in model.named_parameters():
        module_path, _, param_leaf = name.rpartition(".")
        module = modules.get(module_path, model)
        parent_path, _, leaf = module_path.rpartition(".")
        parent = modules.get(parent_path) if module_path else None
        if isinstance(module, nn.Embedding):
            kind = "embedding"
        elif _is_norm(module):
            kind = "norm"
        elif isinstance(module, nn.modules.conv._ConvNd):
            kind = "conv"
        elif isinstance(module, nn.MultiheadAttention):
            kind = "attention_qk" if param_leaf.startswith("in_proj") else "attention_out"
        elif isinstance(module, nn.Linear):
            kind = _linear_kind(module_path, leaf, parent)
        elif re.search(r"embed|token|^pos", param_leaf):
            kind = "embedding"
        else:
            kind = "other"
        kinds[name] = kind
    return kinds


def kind_matches(rule_kind: str, kind: str) -> bool:
    """Whether a rule's ``kind`` covers a parameter's kind (``"attention"`` covers all three)."""
    return rule_kind == kind or (rule_kind == "attention" and kind.startswith("attention"))
