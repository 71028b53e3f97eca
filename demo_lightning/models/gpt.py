"""A small GPT-style byte-level language model and its LightningModule.

Pre-norm decoder blocks (causal self-attention with ``scaled_dot_product_attention``, GELU MLP),
learned positions, bias-free linears and an output head tied to the token embedding. Bytes are
tokens (vocabulary 256), so any text trains without a tokenizer.
"""

from __future__ import annotations

import math
from typing import Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from demo_lightning.models.training import OPTIMIZERS, OptimizerName, optimizer_with_schedule

__all__ = ["GPT", "GPTLightningModule"]


class _Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model, bias=False)
        self.fc_out = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer over bytes.

    Args:
        vocab_size: number of tokens (256 for bytes).
        block_size: longest context.
        d_model: width.
        n_layer: number of blocks.
        n_head: attention heads (must divide ``d_model``).
    """

    def __init__(self, vocab_size: int = 256, block_size: int = 128, d_model: int = 192, n_layer: int = 4, n_head: int = 4) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"n_head ({n_head}) must divide d_model ({d_model})")
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for block in self.blocks:
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * n_layer))
            nn.init.normal_(block.fc_out.weight, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens exceeds block_size={self.block_size}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPTLightningModule(pl.LightningModule):
    """Trains :class:`GPT` on next-byte prediction.

    Args:
        block_size: context length.
        d_model: width.
        n_layer: blocks.
        n_head: attention heads.
        optimizer: ``"sgd"`` (plain SGD: the pairing for DeMo's sign update), ``"adamw"``,
            ``"decoupled"`` (:class:`demo_lightning.optim.DecoupledMomentum`) or ``"signum"``
            (:class:`demo_lightning.optim.Signum`: DeMo's sign rule on the exact gradient, under DDP).
        lr: peak learning rate.
        weight_decay: decoupled weight decay (SGD's coupled decay equals it under a sign update).
        momentum: SGD's momentum (``None``: 0, for DeMo's sign update, which brings its own momentum) or
            Signum's beta (``None``: 0.9) or AdamW's first beta (``None``: 0.9); ignored by ``"decoupled"``.
        warmup_steps: linear warm-up steps, then cosine decay to ``min_lr_ratio`` of ``lr`` at ``max_steps``.
        max_steps: length of the cosine schedule (the Trainer's ``max_steps``).
        min_lr_ratio: the rate at ``max_steps`` over ``lr``, in [0, 1].
    """

    def __init__(
        self,
        block_size: int = 128,
        d_model: int = 192,
        n_layer: int = 4,
        n_head: int = 4,
        optimizer: OptimizerName = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: Optional[float] = None,
        warmup_steps: int = 20,
        max_steps: int = 300,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        self.save_hyperparameters()
        self.model = GPT(block_size=block_size, d_model=d_model, n_layer=n_layer, n_head=n_head)

    @override
    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def _loss(self, batch: Tensor) -> Tensor:
        logits = self.model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    @override
    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.shape[0])
        return loss

    @override
    def validation_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch.shape[0])
        return loss

    @override
    def predict_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        """The most likely next byte after every position of each window."""
        return self.model(batch[:, :-1]).argmax(-1)

    @override
    def test_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("test/loss", loss, sync_dist=True, batch_size=batch.shape[0])
        return loss

    @override
    def configure_optimizers(self) -> dict:
        hp = self.hparams
        return optimizer_with_schedule(
            self.parameters(), hp.optimizer, hp.lr, hp.weight_decay, hp.momentum, hp.warmup_steps, hp.max_steps,
            hp.get("min_lr_ratio", 0.1),  # checkpoints saved before it existed
        )
