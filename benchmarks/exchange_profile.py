"""Where one DeMo exchange step's time goes: ``torch.profiler`` over its named stage ranges and its top operators.

    .venv/bin/python benchmarks/exchange_profile.py                                    # 12.8 M-parameter GPT, reference settings
    .venv/bin/python benchmarks/exchange_profile.py --d-model 128 --n-layer 2 --topk 64 --value-format sign --decay 0.99
    python benchmarks/exchange_profile.py --device cuda --d-model 2048                 # on a GPU: kernel time per range and operator

One process, world size 1 (``Communicator()`` without a process group), ``--threads`` torch threads:
``DeMoExchange.step()`` then ``SGD.step()`` on the trainable shapes of
``demo_lightning.models.GPT(d_model, n_layer)`` with random gradients (fixed seed). Prints the median
wall time of ``--steps`` steps, then, from ``--profiled`` more steps under ``torch.profiler``, the
mean milliseconds per step inside each of the exchange's stage ranges (``demo/exchange``, the whole
step; ``demo/encode``, ``demo/transport``, ``demo/decode`` and the finer ranges inside them, see
``demo_lightning.profiling``; inclusive times) and of the ``--top`` operators by self CPU time. Writes
``<out>/exchange_profile_d<d_model>_l<n_layer>.md``.

``--device cuda``: the model, gradients and the exchange's state on the current GPU; the timed steps
are bracketed by ``torch.cuda.synchronize()``, the profiler records CUDA too, and the tables give
each range's and operator's GPU (kernel) time per step beside its CPU time (on a GPU the CPU time is
mostly launching kernels). Writes ``..._cuda.md``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--value-format", default="fp32")
    p.add_argument("--decay", type=float, default=0.999)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 untimed)")
    p.add_argument("--profiled", type=int, default=3, help="steps under torch.profiler")
    p.add_argument("--top", type=int, default=12, help="operators listed")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    from demo_lightning.algorithms import CodecConfig, DeMoConfig, DeMoExchange
    from demo_lightning.comm import Communicator
    from demo_lightning.models import GPT
    from demo_lightning.profiling import DEMO, DEMO_EXCHANGE

    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from codec import machine  # cores, processor model and GPU, as the codec benchmark names them

    ranges = (DEMO_EXCHANGE, *DEMO.all())

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(d_model=args.d_model, n_layer=args.n_layer, n_head=max(1, args.d_model // 64)).to(device)
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    config = DeMoConfig(CodecConfig(topk=args.topk, value_format=args.value_format), decay=args.decay)
    exchange = DeMoExchange(optimizer, config, Communicator())
    grads = [torch.randn_like(q) for q in params]  # on the parameters' device

    def step() -> None:
        for q, g in zip(params, grads):
            q.grad = g.clone()
        exchange.step()
        optimizer.step()

    times = []
    for i in range(2 + args.steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - start)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for _ in range(args.profiled):
            step()
        sync()
    events = prof.key_averages()

    def gpu_ms(e: object, self_only: bool = False) -> float:  # kernel time (torch >= 2.4 names it device_*)
        name = "self_device_time_total" if self_only else "device_time_total"
        legacy = "self_cuda_time_total" if self_only else "cuda_time_total"
        return float(getattr(e, name, getattr(e, legacy, 0.0))) / 1000 / args.profiled

    per_step = {e.key: e.cpu_time_total / 1000 / args.profiled for e in events}
    per_step_gpu = {e.key: gpu_ms(e) for e in events}
    key = (lambda e: gpu_ms(e, self_only=True)) if cuda else (lambda e: e.self_cpu_time_total)
    ops = sorted((e for e in events if e.key.startswith("aten::")), key=key, reverse=True)

    n = sum(q.numel() for q in params)
    lines = [
        f"Command: `python benchmarks/exchange_profile.py --d-model {args.d_model} --n-layer {args.n_layer} --topk {args.topk} "
        f"--value-format {args.value_format} --decay {args.decay} --threads {args.threads}{' --device cuda' if cuda else ''}` — "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {machine(device)}, torch {torch.__version__}.",
        "",
        f"{n:,} trainable parameters in {len(params)} tensors; world size 1; `DeMoExchange.step()` + `SGD.step()`: "
        f"median **{1000 * statistics.median(times):.1f} ms** per step over {args.steps} steps.",
        "",
    ]
    if cuda:
        lines += [
            f"| range (mean of {args.profiled} profiled steps) | CPU ms per step | GPU (kernel) ms per step |",
            "|---|---|---|",
            *(f"| `{r}` | {per_step.get(r, 0.0):.2f} | {per_step_gpu.get(r, 0.0):.2f} |" for r in ranges),
            "",
            "| operator (by self GPU time) | GPU ms per step | CPU ms per step | calls per step |",
            "|---|---|---|---|",
            *(f"| `{e.key}` | {gpu_ms(e, self_only=True):.2f} | {e.self_cpu_time_total / 1000 / args.profiled:.2f} | "
              f"{e.count / args.profiled:g} |" for e in ops[: args.top]),
        ]
    else:
        lines += [
            f"| range (mean of {args.profiled} profiled steps) | ms per step |",
            "|---|---|",
            *(f"| `{r}` | {per_step.get(r, 0.0):.1f} |" for r in ranges),
            "",
            "| operator (self CPU) | ms per step | calls per step |",
            "|---|---|---|",
            *(f"| `{e.key}` | {e.self_cpu_time_total / 1000 / args.profiled:.1f} | {e.count / args.profiled:g} |" for e in ops[: args.top]),
        ]
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"exchange_profile_d{args.d_model}_l{args.n_layer}{'_cuda' if cuda else ''}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
