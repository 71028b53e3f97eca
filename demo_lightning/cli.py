"""``demo-lightning``: LightningCLI with our strategies, callbacks, models and data modules.

    demo-lightning fit --config configs/gpt_demo.yaml
    demo-lightning fit --config configs/gpt_demo.yaml --trainer.max_steps 50 --trainer.strategy.init_args.topk 32
    demo-lightning fit --config configs/gpt_demo.yaml --print_config      # the full resolved config
    demo-lightning validate --config configs/gpt_demo.yaml --ckpt_path runs/.../last.ckpt

Subcommands ``fit``, ``validate``, ``test``, ``predict`` (LightningCLI's), and ``plan``, handled
before LightningCLI: a model of a multi-node run's communication per method, no training
(:mod:`demo_lightning.planning`)::

    demo-lightning plan --params 1.2e9 --nodes 8 --devices-per-node 8 --inter-gbps 10 --intra-gbps 400 --step-compute-s 0.8
 Any LightningModule and
LightningDataModule can be chosen by ``class_path`` (ours by short name: ``GPTLightningModule``,
``ImageClassifier``, ``TextDataModule``, ``ImageDataModule``); strategies by registered name
(``strategy: demo``) or by ``class_path`` (``demo_lightning.DeMoStrategy`` with ``init_args``);
callbacks by ``class_path`` (``demo_lightning.callbacks.CommunicationMonitor`` or the short name).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.cli import ArgsType, LightningCLI

import demo_lightning  # noqa: F401  registers strategy="demo" and "desloc"
import demo_lightning.callbacks  # noqa: F401  short class names resolve once imported
import demo_lightning.data  # noqa: F401
import demo_lightning.models  # noqa: F401

__all__ = ["DemoLightningCLI", "build_cli", "main", "plan_main"]


class DemoLightningCLI(LightningCLI):
    """LightningCLI whose model and data are any LightningModule / LightningDataModule subclass."""


def build_cli(args: ArgsType = None, run: bool = True) -> DemoLightningCLI:
    """The CLI over ``args`` (``None``: ``sys.argv``); ``run=False`` only builds the Trainer, model and data."""
    return DemoLightningCLI(
        model_class=pl.LightningModule,
        datamodule_class=pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def _number(low: float, open_low: bool, integer: bool = False) -> Callable[[str], Any]:
    """An argparse type: a finite number above ``low`` (or at least, unless ``open_low``); bad input
    becomes argparse's ``argument --name: ...`` error (exit status 2)."""
    kind = ("an integer" if integer else "a number") + (f" > {low:g}" if open_low else f" >= {low:g}")

    def parse(text: str) -> Any:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
        if not math.isfinite(value) or (value <= low if open_low else value < low) or (integer and value != int(value)):
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}")
        return int(value) if integer else value

    return parse


def _plan_parser() -> argparse.ArgumentParser:
    from demo_lightning.codec import SELECTIONS, VALUE_FORMATS
    from demo_lightning.algorithms.config import DENSE_FORMATS, POSITION_FORMAT_SETTINGS
    from demo_lightning.planning import METHODS, SHARED_VALUE_FORMATS

    parser = argparse.ArgumentParser(
        prog="demo-lightning plan",
        description="Model one optimizer step's communication for every method on N nodes of G ranks and say which "
        "to pick: bytes per rank per step by link (ring collectives, the byte ledger's formulas) and a modelled step "
        "time (compute + communication, no overlap). Formulas and assumptions: demo_lightning.planning.",
    )
    positive_int, positive = _number(0, True, integer=True), _number(0, True)
    parser.add_argument("--params", type=_number(1, False, integer=True), required=True,
                        help="trainable parameters of the model (1.2e9 works); modelled as GPT-like shapes")
    parser.add_argument("--nodes", type=positive_int, required=True, help="number of nodes N")
    parser.add_argument("--devices-per-node", type=positive_int, required=True, help="ranks (GPUs) per node G")
    parser.add_argument("--inter-gbps", type=positive, default=10.0, help="each node's link to the others, Gbit/s (shared by its G ranks; default 10)")
    parser.add_argument("--intra-gbps", type=positive, default=400.0, help="each rank's link inside its node, Gbit/s (default 400)")
    parser.add_argument("--step-compute-s", type=_number(0, False), default=0.0, help="compute seconds per step (default 0: communication only)")
    parser.add_argument("--latency-ms", type=_number(0, False), default=0.5, help="per ring hop across nodes, ms (default 0.5, as CommunicationMonitor)")
    parser.add_argument("--intra-latency-ms", type=_number(0, False), default=0.01, help="per ring hop inside a node, ms (default 0.01)")
    parser.add_argument("--d-model", type=positive_int, default=None, help="width of the GPT-like shapes (default: depth about d_model / 64)")
    parser.add_argument("--topk", type=positive_int, default=None, help="DeMo coefficients kept per tile (default: clamp(128 // W, 8, 64) for an all-gathered exchange over W DeMo workers, 64 for an all-reduced one)")
    parser.add_argument("--keep-ratio", type=positive, default=None, help="fraction of each tile kept (instead of --topk)")
    parser.add_argument("--chunk", type=positive_int, default=64, help="DeMo tile side (default 64)")
    parser.add_argument("--value-format", choices=VALUE_FORMATS, default="sign", help="DeMo value format (default sign)")
    parser.add_argument("--selection", choices=[s for s in SELECTIONS], default="topk", help="DeMo selection of flat/hierarchical (default topk)")
    parser.add_argument("--position-format", choices=POSITION_FORMAT_SETTINGS, default="auto",
                        help="top-k positions of flat/hierarchical: auto (default: elias_fano unless --value-format mixed or another "
                        "--selection), packed (fixed width) or elias_fano (sorted, about 2 + log2(tile / k) bits each)")
    parser.add_argument("--shared-value-format", choices=SHARED_VALUE_FORMATS, default=None,
                        help="value format of the shared methods (default: --value-format if a float format, else bf16)")
    parser.add_argument("--dense-below", type=_number(0, False, integer=True), default=1024, help="tensors with fewer elements are sent densely (default 1024)")
    parser.add_argument("--dense-vectors", action=argparse.BooleanOptionalAction, default=True,
                        help="1-D tensors (norms, biases) are sent densely whatever their size (default on; --no-dense-vectors: only under --dense-below)")
    parser.add_argument("--dense-format", choices=DENSE_FORMATS, default="bf16",
                        help="wire format of the tensors sent densely (default bf16: 2 bytes an element; fp32: 4)")
    parser.add_argument("--bucket-cap-mb", type=positive, default=25.0, help="largest payload of one collective, MB (default 25)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)} (default all)")
    return parser


def plan_main(argv: Sequence[str]) -> None:
    """``demo-lightning plan ARGS``: print the per-method table and the pick (argparse errors exit 2)."""
    from demo_lightning.algorithms.config import CodecConfig
    from demo_lightning.planning import METHODS, estimate_all, format_plan, gpt_like_shapes
    from demo_lightning.comm.topology import NodeTopology

    parser = _plan_parser()
    a = parser.parse_args(list(argv))
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        parser.error(f"argument --methods: unknown method(s) {unknown or a.methods!r}; choose from {','.join(METHODS)}")
    if a.keep_ratio is not None and a.keep_ratio > 1:
        parser.error(f"argument --keep-ratio: must lie in (0, 1], got {a.keep_ratio:g}")
    if a.topk is not None and a.keep_ratio is not None:
        parser.error("argument --keep-ratio: give --topk or --keep-ratio, not both")
    try:
        codec = CodecConfig(chunk=a.chunk, topk=a.topk, keep_ratio=a.keep_ratio, selection=a.selection, value_format=a.value_format,
                            position_format=a.position_format, dense_below=a.dense_below, dense_vectors=a.dense_vectors, dense_format=a.dense_format, bucket_cap_mb=a.bucket_cap_mb)
    except ValueError as error:
        parser.error(f"codec settings: {error}")
    topology = NodeTopology(a.nodes * a.devices_per_node, a.devices_per_node)
    shapes = gpt_like_shapes(a.params, a.d_model)
    estimates = estimate_all(
        shapes, topology, codec, methods, inter_gbps=a.inter_gbps, intra_gbps=a.intra_gbps, step_compute_s=a.step_compute_s,
        latency_ms=a.latency_ms, intra_latency_ms=a.intra_latency_ms, shared_value_format=a.shared_value_format,
    )
    print(_plan_header(a, codec, shapes, estimates))
    print()
    print(format_plan(estimates))


def _plan_header(a: argparse.Namespace, codec: Any, shapes: list[tuple[int, ...]], estimates: dict[str, Any]) -> str:
    from demo_lightning.planning import gpt_like_dims, strength_text

    d, blocks = gpt_like_dims(a.params, a.d_model)
    dense = sum(1 for s in shapes if codec.layout(s)[0] is None)
    strength = strength_text(codec)
    shared = next((e.value_format for m, e in estimates.items() if "shared" in m), None)
    return "\n".join([
        f"Plan for {a.params:,} parameters (GPT-like shapes: d_model {d}, {blocks} blocks; {len(shapes)} tensors, {dense} "
        f"sent densely in {codec.dense_format}: under dense_below={codec.dense_below}{' or 1-D' if codec.dense_vectors else ''}) on {a.nodes} node(s) x {a.devices_per_node} rank(s) (W = {a.nodes * a.devices_per_node}).",
        f"Links: {a.inter_gbps:g} Gbit/s per node between nodes (shared by its ranks), {a.intra_gbps:g} Gbit/s per rank inside a node; "
        f"latency {a.latency_ms:g} ms per inter-node hop, {a.intra_latency_ms:g} ms per intra-node hop; compute {a.step_compute_s:g} s per step.",
        f"Codec: chunk {codec.chunk}, {strength}, selection {codec.selection}, {codec.value_format} values"
        + (", Elias-Fano positions" if codec.position_format == "elias_fano" else "")
        + (f" (shared methods: {shared} values, summed by an all-reduce)." if shared else "."),
        "Bytes are per rank per optimizer step, sent (= received); the node link carries its G ranks' inter-node bytes. "
        "Ring collectives, no overlap of compute and communication.",
    ])


def main(args: ArgsType = None) -> None:
    """Entry point of the ``demo-lightning`` console script (returns nothing: its exit status is 0 on success).

    ``plan`` is handled here, before LightningCLI (which owns ``fit``, ``validate``, ``test``, ``predict``)."""
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, (list, tuple)) and argv and argv[0] == "plan":
        plan_main([str(x) for x in argv[1:]])
        return
    if isinstance(argv, (list, tuple)) and list(argv) in (["-h"], ["--help"]):
        print("demo-lightning plan --help: model a multi-node run's communication per method (no training)\n")
    build_cli(args)


if __name__ == "__main__":
    main()
