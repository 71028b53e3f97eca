"""What the optimizers here share about precision: an fp32 momentum for fp16/bf16 parameters, kept so across checkpoints."""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

HALF_DTYPES = (torch.float16, torch.bfloat16)


def momentum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter of ``dtype`` keeps its momentum in: fp32 for fp16/bf16, else its own."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def load_state_dict_keeping_fp32(optimizer: Optimizer, state_dict: dict[str, Any], key: str) -> None:
    """``torch.optim.Optimizer.load_state_dict`` on ``optimizer``, then the saved ``state[key]`` of every
    fp16/bf16 parameter put back in fp32 (torch's own load casts floating state to the parameter's dtype,
    which would round a momentum that was kept in fp32)."""
    saved_state = state_dict["state"]
    saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
    Optimizer.load_state_dict(optimizer, state_dict)
    params = chain.from_iterable(g["params"] for g in optimizer.param_groups)
    for saved_id, p in zip(saved_ids, params):
        buf = saved_state.get(saved_id, {}).get(key)
        if isinstance(buf, Tensor) and p.dtype in HALF_DTYPES:
            optimizer.state[p][key] = buf.to(device=p.device, dtype=torch.float32, copy=True)
