"""Replace one generated section of the README: the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_section(name: str, body: str, readme: Path = README) -> None:
    """Write ``body`` between the section's markers; exits naming the markers if either is missing."""
    start, end = markers(name)
    text = readme.read_text()
    if text.count(start) != 1 or text.count(end) != 1:
        raise SystemExit(f"{readme.name} needs exactly one {start} and one {end}")
    head, rest = text.split(start, 1)
    readme.write_text(head + start + "\n" + body.rstrip("\n") + "\n" + end + rest.split(end, 1)[1])
