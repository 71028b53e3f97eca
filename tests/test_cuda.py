"""The CUDA path, on a machine with a GPU (every test here is skipped without one; CI has none).

The rest of the suite runs on CPUs with gloo, where tests/test_devices.py stands in for a GPU's
device rules. Here the same code runs with its tensors on a GPU:

* the DeMo exchange on the GPU takes the same steps as on the CPU (fp32 values, ``update="raw"``:
  the only differences are float rounding in the transforms; TF32 stays off, PyTorch's default)
  and records the same bytes, with its momenta on the GPU;
* two processes on one GPU, over a gloo process group handed CUDA tensors (NCCL refuses two ranks
  on one device, so this is the only two-rank run one GPU allows): replicas stay bitwise identical
  after every step while the momenta differ, and both ranks match a CPU run of the same workers;
* Lightning fits on one GPU over NCCL (the backend the strategies choose on GPUs): DeMo in
  bf16-mixed precision, DES-LOC with AdamW and compressed parameter syncs, and a checkpoint of the
  DeMo fit resumed on the GPU. The state lives on the GPU while training, and when a fit ends
  (Lightning moves the model and the optimizer's state to the CPU) the strategies' state follows:
  the GPU's allocated memory is back where it was before the fit. One rank's collectives cross no
  process, so these check placement, precision, memory and the checkpoint's per-rank shards on
  the GPU, not NCCL's transport.

Run on a GPU machine: ``python -m pytest tests/test_cuda.py -v``.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from demo_lightning import DeMoStrategy, DesLocStrategy
from demo_lightning.algorithms import DeMoConfig, DeMoExchange
from demo_lightning.comm import Communicator

from dist_helpers import run_workers, tensor_hash
from test_exchange_distributed import _Net  # multiples of the 64-wide tile and not, a conv, small dense tensors

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]

# fp32 values and the raw update: CPU and GPU then differ by float rounding only (sign values or the
# sign update would turn a rounding difference of a value near zero into a whole step).
EXACT = {"topk": 8, "dense_below": 100, "value_format": "fp32", "update": "raw"}
DEFAULTS = {"dense_below": 100}  # the library's defaults: top-k, sign values, sign update


def _train(device: str, steps: int, config: dict[str, Any], rank: int = 0, comm: Communicator | None = None) -> dict[str, Any]:
    """``steps`` DeMo steps of ``_Net`` on ``device``; the data are drawn on the CPU (the same on every device)."""
    torch.manual_seed(0)
    model = _Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    exchange = DeMoExchange(opt, DeMoConfig.of(**config), comm if comm is not None else Communicator())
    hashes = []
    for step in range(steps):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1000 * step + rank)).to(device)
        opt.zero_grad()
        model(x, branch=False).backward()
        exchange.step()
        opt.step()
        hashes.append([tensor_hash(p) for p in model.parameters()])
    return {
        "params": [p.detach().cpu().clone() for p in model.parameters()],
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
        "momentum_devices": sorted({str(exchange.momentum(p).device) for p in model.parameters()}),
        "momentum_hash": [tensor_hash(exchange.momentum(p)) for p in model.parameters()],
        "hashes": hashes,
        "payload": exchange.comm.ledger.total_payload_bytes,
        "sent": exchange.comm.ledger.total_sent_bytes,
    }


def test_the_exchange_on_the_gpu_takes_the_cpu_steps_and_records_the_same_bytes() -> None:
    cpu, gpu = _train("cpu", 4, EXACT), _train("cuda", 4, EXACT)
    assert gpu["param_devices"] == ["cuda:0"] and gpu["momentum_devices"] == ["cuda:0"]
    assert gpu["payload"] == cpu["payload"] > 0 and gpu["sent"] == cpu["sent"]
    for c, g in zip(cpu["params"], gpu["params"]):
        torch.testing.assert_close(g, c, rtol=1e-4, atol=1e-6)
    # the defaults (sign values, sign update) run on the GPU too, with the same bytes
    cpu_d, gpu_d = _train("cpu", 4, DEFAULTS), _train("cuda", 4, DEFAULTS)
    assert gpu_d["payload"] == cpu_d["payload"] > 0
    assert all(torch.isfinite(p).all() for p in gpu_d["params"])


def _two_ranks(rank: int, world: int, device: str, names: list[str]) -> dict[str, Any]:
    if device == "cuda":
        torch.cuda.set_device(0)
    comm = Communicator(device=device)  # gloo handed CUDA tensors on the GPU
    out: dict[str, Any] = {"backend": str(dist.get_backend())}
    for name in names:
        out[name] = _train(device, 4, {"exact": EXACT, "defaults": DEFAULTS}[name], rank=rank, comm=comm)
    return out


def test_two_processes_on_one_gpu_keep_replicas_identical_and_match_the_cpu(tmp_path: Path) -> None:
    names = ["exact", "defaults"]
    gpu = run_workers(_two_ranks, 2, tmp_path / "gpu", "cuda", names, timeout=240)
    cpu = run_workers(_two_ranks, 2, tmp_path / "cpu", "cpu", names, timeout=240)
    for name in names:
        g0, g1 = gpu[0][name], gpu[1][name]
        assert g0["param_devices"] == ["cuda:0"] and g0["momentum_devices"] == ["cuda:0"], name
        assert g0["hashes"] == g1["hashes"], name  # the same parameters on both ranks after every step
        assert g0["momentum_hash"] != g1["momentum_hash"], name  # negative control: different data, different residuals
        assert g0["payload"] == cpu[0][name]["payload"] > 0, name
    for c, g in zip(cpu[0]["exact"]["params"], gpu[0]["exact"]["params"]):
        torch.testing.assert_close(g, c, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------- Lightning on one GPU
class _Classifier(pl.LightningModule):
    """About 1.1 M parameters (4.5 MB in fp32): the state the strategies keep for it is large enough
    that GPU memory it still held after a fit would show against the allocator's small change."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4))
        self.optimizer_name = optimizer
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class _Placement(pl.Callback):
    """The devices of the parameters and of the strategy's state at the end of the first training step."""

    def __init__(self) -> None:
        self.seen: dict[str, set[str]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if self.seen:
            return
        params = list(module.parameters())
        self.seen["params"] = {p.device.type for p in params}
        exchanges = trainer.strategy.exchanges
        if exchanges:
            self.seen["momenta"] = {exchanges[0].momentum(p).device.type for p in params}
        state = trainer.optimizers[0].state
        self.seen["optimizer_state"] = {t.device.type for p in params for t in state.get(p, {}).values()
                                        if isinstance(t, torch.Tensor) and t.dim() > 0}


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 64, generator=g), torch.randint(0, 4, (64,), generator=g)), batch_size=16)


def _trainer(strategy: Any, max_steps: int, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_steps=max_steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


# what may stay allocated after a fit: Lightning's logged scalars and the like (each at least 512 bytes)
LEFTOVER = 1 << 20


@pytest.mark.usefixtures("isolated_process_group")
def test_demo_fit_on_one_gpu_over_nccl_in_bf16_mixed_frees_the_gpu_and_resumes_on_it(tmp_path: Path) -> None:
    model = _Classifier("sgd")
    placement = _Placement()
    trainer = _trainer(DeMoStrategy(dense_below=100), 4, precision="bf16-mixed", callbacks=[placement])
    before = _allocated()
    trainer.fit(model, _loader())
    assert dist.get_backend() == "nccl"
    assert trainer.strategy.runtime.communicator.device == torch.device("cuda", 0)
    assert placement.seen == {"params": {"cuda"}, "momenta": {"cuda"}, "optimizer_state": set()}
    exchange = trainer.strategy.exchanges[0]
    assert trainer.strategy.last_stats.steps == 4 and len(model.losses) == 4
    assert all(torch.isfinite(torch.tensor(model.losses)))
    assert "comm/bytes_sent_per_step" in trainer.callback_metrics  # 0 on one rank: nothing crosses a process
    assert exchange.comm.ledger.total_payload_bytes > 0  # but the payload was encoded and handed over
    # Lightning moved the model to the CPU when the fit ended; the momenta followed, the GPU is free again
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {exchange.momentum(p).device.type for p in model.parameters()} == {"cpu"}
    assert _allocated() - before < LEFTOVER, (before, _allocated())

    ckpt = tmp_path / "demo.ckpt"
    trainer.save_checkpoint(ckpt)
    momenta = [exchange.momentum(p).clone() for p in model.parameters()]
    resumed_model = _Classifier("sgd")
    captured: dict[str, Any] = {}

    class _Capture(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
            if not captured:  # before the first resumed step: what the checkpoint restored
                ex = trainer.strategy.exchanges[0]
                captured["momenta"] = [ex.momentum(p).detach().cpu().clone() for p in module.parameters()]
                captured["devices"] = {ex.momentum(p).device.type for p in module.parameters()}

    resumed = _trainer(DeMoStrategy(dense_below=100), 6, precision="bf16-mixed", callbacks=[_Capture()])
    resumed.fit(resumed_model, _loader(), ckpt_path=ckpt)
    assert resumed.global_step == 6 and captured["devices"] == {"cuda"}
    for saved, restored in zip(momenta, captured["momenta"]):
        assert torch.equal(saved, restored)  # the per-rank shard restored this rank's momenta, on the GPU


@pytest.mark.usefixtures("isolated_process_group")
def test_desloc_fit_with_adamw_and_compressed_syncs_on_one_gpu_over_nccl_frees_the_gpu() -> None:
    model = _Classifier("adamw")
    placement = _Placement()
    trainer = _trainer(DesLocStrategy(param_sync_every=2, compress_params=True), 6, callbacks=[placement])
    before = _allocated()
    trainer.fit(model, _loader())
    assert dist.get_backend() == "nccl"
    assert placement.seen["params"] == {"cuda"} and placement.seen["optimizer_state"] == {"cuda"}
    assert len(model.losses) == 6 and all(torch.isfinite(torch.tensor(model.losses)))
    assert model.losses[-1] < model.losses[0]
    assert trainer.strategy.averagers[0].stats.syncs.get("params", 0) >= 3
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert _allocated() - before < LEFTOVER, (before, _allocated())
