"""Draw the TensorBoard scalars a user should look at, from a run's own event files, into a PNG.

    python scripts/tensorboard_picture.py runs/gpt_demo/version_0 --out docs/tensorboard.png

Panels: the training loss; bytes sent per optimizer step; the cumulative ratio of DDP's bytes to
ours; the momentum energy each layer group's exchange captured; modeled communication time per
step on a 1 Gbit/s link, ours against DDP's. Panels whose tags the run did not log are left out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

PANELS: list[tuple[str, list[str], str]] = [
    ("training loss", ["train/loss"], "linear"),
    ("bytes sent per step (per worker)", ["comm/bytes_sent_per_step"], "log"),
    ("cumulative ratio vs DDP (bytes)", ["comm/cumulative_ratio_vs_ddp", "comm/ratio_vs_ddp"], "linear"),
    ("momentum energy captured", ["demo/energy_captured/*"], "linear"),
    ("modeled comm s/step at 1 Gbit/s", ["comm/modeled_seconds_per_step/1Gbps", "comm/ddp_modeled_seconds_per_step/1Gbps"], "log"),
]


def read_scalars(logdir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """``{tag: (steps, values)}`` from every event file under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(logdir.rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files under {str(logdir)!r}")
    out: dict[str, tuple[list[int], list[float]]] = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            events = acc.Scalars(tag)
            steps, values = out.setdefault(tag, ([], []))
            steps += [e.step for e in events]
            values += [e.value for e in events]
    return out


def draw(scalars: dict[str, tuple[list[int], list[float]]], out: Path, title: str) -> list[str]:
    """Write the PNG; returns the tags drawn."""
    import fnmatch

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for name, patterns, scale in PANELS:
        tags = [t for p in patterns for t in sorted(scalars) if fnmatch.fnmatchcase(t, p)]
        if name.startswith("cumulative") and tags:
            tags = tags[:1]  # the monitor's cumulative ratio if present, else the strategy's
        if tags:
            panels.append((name, tags, scale))
    if not panels:
        raise ValueError("none of the expected tags were logged; is this a run of strategy='demo' or 'desloc'?")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    axes = [axes] if len(panels) == 1 else list(axes)
    drawn = []
    for ax, (name, tags, scale) in zip(axes, panels):
        for tag in tags:
            steps, values = scalars[tag]
            ax.plot(steps, values, label=tag.split("/", 1)[1] if len(tags) > 1 else None, linewidth=1.2)
            drawn.append(tag)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_yscale(scale)
        ax.grid(alpha=0.3)
        if len(tags) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logdir", help="a TensorBoard log folder (searched recursively)")
    parser.add_argument("--out", default="docs/tensorboard.png")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    logdir = Path(args.logdir)
    drawn = draw(read_scalars(logdir), Path(args.out), args.title or str(logdir))
    print(f"wrote {args.out} with {len(drawn)} curves: {', '.join(drawn)}")


if __name__ == "__main__":
    main()
