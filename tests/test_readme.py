"""Every shell command in the README's ```bash blocks is exercised here (or is CI itself)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from demo_lightning.cli import main as cli_main

from dist_helpers import clean_env, free_port

ROOT = Path(__file__).parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


COMMANDS = readme_commands()
# covered elsewhere: CI runs the test suite; tests/test_cli.py runs this exact torchrun line
ELSEWHERE = {  # command prefix -> where it runs
    "bash scripts/test.sh": ".ci/run",
    "torchrun --standalone --nproc-per-node 2 examples/own_module.py": "test_own_module_example_under_torchrun_keeps_replicas_identical",
    "python scripts/tensorboard_picture.py": "test_tensorboard_picture_from_a_config_run",
    "tensorboard --logdir": "test_server_lists_the_runs_the_dashboard_tags_and_the_baseline",
    "python examples/fabric_loop.py": "test_the_fabric_example_trains_saves_and_resumes",
    "python examples/own_module.py --compile": "test_the_readme_compile_command_trains_with_identical_replicas",
}


def test_readme_has_the_quick_start_commands() -> None:
    assert COMMANDS[:2] == ["bash scripts/main.sh", "bash scripts/test.sh"]


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs(command: str, tmp_path: Path) -> None:
    elsewhere = [where for prefix, where in ELSEWHERE.items() if command.startswith(prefix)]
    if elsewhere:
        pytest.skip(f"README command {command!r} is not run here: it is exercised by {elsewhere[0]}")
    args = shlex.split(command)
    if args[0] == "demo-lightning":
        # the CLI parses and resolves the command (training itself: tests/test_cli.py runs every config)
        extra = [] if {"--help", "--print_config"} & set(args) else ["--print_config"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
            cli_main([*args[1:], *extra])
        assert info.value.code in (0, None), out.getvalue()[-2000:]
        assert out.getvalue().strip()
    elif args[:2] == ["bash", "scripts/main.sh"]:
        # the main job itself, cut to a few steps
        env = clean_env()
        env["MASTER_PORT"] = str(free_port())
        quick = ["--max-steps", "3", "--val-check-interval", "3", "--max-bytes", "300000", "--no-progress-bar",
                 "--log-dir", str(tmp_path / "runs")]
        proc = subprocess.run([*args, *quick], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "ratio" in proc.stdout.lower()
    else:
        pytest.fail(f"README command {command!r} is not exercised by any test: add it here or to ELSEWHERE")


_ANSWER_HELP = """
import contextlib, io, json, runpy, sys
answers = {}
for script in sys.argv[1:]:
    sys.argv, sys.path[0] = [script, "--help"], script.rsplit("/", 1)[0]  # as `python <script> --help` sees them
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
        code = "returned without printing help and exiting"
    except SystemExit as exit:
        code = exit.code or 0
    answers[script] = [code, out.getvalue()[:300]]
print(json.dumps(answers))
"""


def test_readme_python_entry_points_answer_help() -> None:
    """Scripts the README names in prose (``python <path>``) exist and answer --help: each run as
    ``__main__`` with ``--help`` in one interpreter (one start-up of torch and Lightning, not one each)."""
    text = (ROOT / "README.md").read_text()
    scripts = sorted(set(re.findall(r"python ((?:benchmarks|examples|scripts)/[\w/]+\.py)", text)))
    assert scripts
    missing = [s for s in scripts if not (ROOT / s).is_file()]
    assert not missing, f"the README names scripts that do not exist: {missing}"
    proc = subprocess.run([sys.executable, "-c", _ANSWER_HELP, *(str(ROOT / s) for s in scripts)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout.splitlines()[-1])
    for script in scripts:
        code, printed = answers[str(ROOT / script)]
        assert code == 0 and "usage:" in printed.lower(), (script, code, printed)
