"""Which tensors skip the codec (issue 18): fewer than ``dense_below`` (1,024) elements, or 1-D under
``dense_vectors`` (on by default), and a per-tensor ``TensorCodec.dense`` over both. Oracles: the
shapes a timm ResNet's plan sends densely, a wide 1-D tensor's update equal to its gradient (as
DDP's) under fp32, and a checkpoint from the old rule (4,096, vectors compressed) resumed under the
new one with the momentum it had."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from demo_lightning.algorithms import CodecConfig, DeMoConfig, DeMoExchange
from demo_lightning.algorithms.config import TensorCodec
from demo_lightning.comm import Communicator

from exchange_inputs import unclipped_of

pytestmark = pytest.mark.timeout(120)

OLD_RULE = {"dense_below": 4096, "dense_vectors": False}


@pytest.mark.parametrize(
    ("shape", "dense", "dense_without_vectors", "dense_old_rule"),
    [
        ((1,), True, True, True),
        ((256,), True, True, True),
        ((5000,), True, False, False),  # a wide model's LayerNorm: compressed before, dense now
        ((24, 3, 3, 3), True, True, True),  # 648 elements: a ResNet stem
        ((32, 64, 1, 1), False, False, True),  # 2,048: a 1x1 downsampling convolution, dense before
        ((10, 256), False, False, True),  # 2,560: a classifier
        ((64, 64), False, False, False),
    ],
)
def test_the_rule_by_shape(shape: tuple[int, ...], dense: bool, dense_without_vectors: bool, dense_old_rule: bool) -> None:
    assert CodecConfig().dense_below == 1024 and CodecConfig().dense_vectors is True
    assert (CodecConfig().layout(shape)[0] is None) is dense
    assert CodecConfig().sends_densely(shape) is dense
    assert (CodecConfig(dense_vectors=False).layout(shape)[0] is None) is dense_without_vectors
    assert (CodecConfig(**OLD_RULE).layout(shape)[0] is None) is dense_old_rule
    # a tensor's own setting decides over both
    assert CodecConfig().layout(shape, TensorCodec(dense=True)) == (None, 0)
    assert CodecConfig().layout(shape, TensorCodec(dense=False))[0] is not None


def test_dense_below_zero_without_vectors_compresses_everything() -> None:
    config = CodecConfig(dense_below=0, dense_vectors=False)
    assert all(config.layout(s)[0] is not None for s in [(1,), (7,), (5000,), (3, 3)])
    assert CodecConfig(dense_below=0).layout((7,))[0] is None  # vectors stay dense unless said


def test_bad_dense_vectors_names_the_argument_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"dense_vectors must be True .* or False .*got 'no'"):
        CodecConfig(dense_vectors="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dense_vectors"):
        DeMoConfig.of(dense_vectors=1)


def test_a_resnets_plan_keeps_only_its_norms_biases_and_stem_dense() -> None:
    """The digits ResNet-10t of ``benchmarks/parity.py``: under the old rule its 1x1 convolutions and
    classifier went dense too (the 81x of issue 18); now the 1-D tensors and the 648-element stem do."""
    timm = pytest.importorskip("timm")
    model = timm.create_model("resnet10t", num_classes=10, channels=(32, 64, 128, 256))
    params = list(model.parameters())
    ex = DeMoExchange(torch.optim.SGD(params, lr=0.1), DeMoConfig(), Communicator())
    names = {p: n for n, p in model.named_parameters()}
    dense = {names[p] for p in params if ex.k_of(p) == 0}
    assert dense == {n for n, p in model.named_parameters() if p.dim() == 1} | {"conv1.0.weight"}
    old = DeMoExchange(torch.optim.SGD(params, lr=0.1), unclipped_of(**OLD_RULE), Communicator())
    newly_compressed = {names[p] for p in params if old.k_of(p) == 0} - dense
    assert newly_compressed == {"layer1.0.downsample.1.weight", "layer2.0.downsample.1.weight", "fc.weight"}
    dense_elements = sum(p.numel() for p in params if ex.k_of(p) == 0)
    assert sum(CodecConfig().payload_bytes(tuple(p.shape)) for p in params if ex.k_of(p) == 0) == 2 * dense_elements


def test_a_wide_vector_gets_its_gradient_as_ddp_would() -> None:
    """One worker, fp32 dense format, raw update: the first step's update of a 6,000-element vector is
    its momentum, the gradient, bit for bit, and nothing stays behind; compressed (the old rule) it is not."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(6000, generator=gen)
    for settings, exact in (({}, True), (OLD_RULE, False)):
        vec = nn.Parameter(torch.zeros(6000))
        ex = DeMoExchange(torch.optim.SGD([vec], lr=1.0), unclipped_of(update="raw", decay=0.9, dense_format="fp32", **settings),
                          Communicator())
        vec.grad = g.clone()
        stats = ex.step()
        assert torch.equal(vec.grad, g) is exact
        assert (float(ex.momentum(vec).abs().max()) == 0.0) is exact
        assert (stats.payload_bytes == 6000 * 4) is exact


def test_a_checkpoint_of_the_old_rule_resumes_with_its_momentum() -> None:
    """Saved where the (32, 64) convolution and the 5,000-element vector went the other way, loaded
    under the defaults: each momentum comes back (re-laid out at the next step), the exchange goes on."""
    torch.manual_seed(0)
    conv, vec = nn.Parameter(torch.randn(32, 64, 1, 1)), nn.Parameter(torch.randn(5000))
    old = DeMoExchange(torch.optim.SGD([conv, vec], lr=0.01), unclipped_of(update="raw", **OLD_RULE), Communicator())
    for _ in range(3):
        conv.grad, vec.grad = torch.randn_like(conv), torch.randn_like(vec)
        old.step()
    before = {"conv": old.momentum(conv), "vec": old.momentum(vec)}
    assert float(before["vec"].abs().max()) > 0  # the compressed vector kept a residual
    new = DeMoExchange(torch.optim.SGD([conv, vec], lr=0.01), unclipped_of(update="raw"), Communicator())
    new.load_state_dict(old.state_dict())
    assert torch.allclose(new.momentum(conv), before["conv"], atol=1e-6)
    assert torch.allclose(new.momentum(vec), before["vec"], atol=1e-6)
    zero = {"conv": torch.zeros_like(conv), "vec": torch.zeros_like(vec)}
    conv.grad, vec.grad = zero["conv"].clone(), zero["vec"].clone()
    new.step()  # with zero gradients the update is the decayed loaded momentum, through the new layout
    assert new.k_of(conv) > 0 and new.k_of(vec) == 0
    m_vec = 0.99 * before["vec"]
    assert torch.allclose(vec.grad + new.momentum(vec), m_vec, atol=1e-6)  # dense (bf16): sent + kept = m
