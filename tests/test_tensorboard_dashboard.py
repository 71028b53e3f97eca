"""CommunicationMonitor's TensorBoard dashboard, read back through a real TensorBoard server.

A 2-process ``strategy="demo"`` fit (tests/tensorboard_run.py) logs into ``<tmp>/tb/demo`` with
``baseline=`` a DDP run's loss curve (written here by a ``SummaryWriter``: known values, into
``<tmp>/tb/ddp``). A ``tensorboard`` server started on 127.0.0.1 (port chosen by the OS) then serves
``<tmp>/tb``; its HTTP data API must list both runs, the scalar tags, the Custom Scalars layout
(every chart's regular expressions match tags of the run, as the server itself matches them) and
the HParams experiment and session with the values the run ended with. The server is stopped (its
whole process group, data server included) at the end of the module.

Bad ``baseline`` / ``loss_tag`` values: one row each, at construction or at setup; a bad baseline
raises the same error on every rank of a 2-process group while only rank 0 reads the files.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from demo_lightning.callbacks import CommunicationMonitor
from demo_lightning.callbacks.communication_monitor import DASHBOARD, read_baseline
from demo_lightning.comm import ByteLedger

from dist_helpers import clean_env, free_port, run_launch, run_workers

HERE = Path(__file__).parent
SCRIPT = HERE / "tensorboard_run.py"
STEPS = 6
BASELINE = [(step, 5.6 - 0.1 * step) for step in range(STEPS + 2)]  # the DDP run's loss, known exactly
SERVER_START_S = 60.0

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------------------------------- the run
def _write_baseline(run_dir: Path, points: list[tuple[int, float]], tag: str = "train/loss") -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(run_dir)) as writer:
        for step, value in points:
            writer.add_scalar(tag, value, step)
        writer.add_scalar("val/loss", 6.0, 0)  # another scalar: only loss_tag's is taken


@pytest.fixture(scope="module")
def dashboard_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """``(logdir, rank 0's record)`` of the 2-process fit."""
    out = tmp_path_factory.mktemp("dashboard")
    logdir = out / "tb"
    _write_baseline(logdir / "ddp" / "version_0", BASELINE)
    env = clean_env()
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    # baseline: the folder above the DDP run's version directory (exactly one run below it)
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--devices", "2", "--steps", str(STEPS), "--baseline", str(logdir / "ddp")]
    returncode, output = run_launch(cmd, env, out, SCRIPT, timeout=180)
    assert returncode == 0, output[-6000:]
    return logdir, json.loads((out / "rank0.json").read_text())


# ---------------------------------------------------------------------------------------- the server
class _Server:
    """A running ``tensorboard`` on 127.0.0.1; JSON over HTTP, no proxy."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def get(self, route: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with self._opener.open(self.url + route + query, timeout=10) as response:
            return json.loads(response.read())

    def post(self, route: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            self.url + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST",
        )
        with self._opener.open(request, timeout=10) as response:
            return json.loads(response.read())


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server's whole process group (TensorBoard and its data server) and reap it."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        deadline = time.monotonic() + wait_s  # the group's other members (the data server) end too
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
    proc.wait(5)


def _wait_for(what: str, probe: Callable[[], Optional[Any]], deadline: float, proc: subprocess.Popen[bytes], log: Path) -> Any:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tensorboard exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        try:
            found = probe()
        except (OSError, urllib.error.URLError, ValueError):
            found = None
        if found:
            return found
        time.sleep(0.25)
    pytest.fail(f"tensorboard: no {what} after {SERVER_START_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(dashboard_run: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Server]:
    logdir, _ = dashboard_run
    log = tmp_path_factory.mktemp("tensorboard") / "server.log"
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0"]
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_S

        def url() -> Optional[str]:  # "TensorBoard 2.x at http://127.0.0.1:PORT/ (Press CTRL+C to quit)"
            found = re.search(r"(http://127\.0\.0\.1:\d+)/", log.read_text(errors="replace"))
            return found.group(1) if found else None

        served = _Server(_wait_for("URL", url, deadline, proc, log))

        def loaded() -> bool:  # the data server reads in the background: wait for the last tags written
            tags = served.get("/data/plugin/scalars/tags")
            return {"ddp/version_0", "demo/version_0"} <= set(tags) and "final/loss" in tags["demo/version_0"]

        _wait_for("data", loaded, deadline, proc, log)
        yield served
    finally:
        _stop(proc)
    assert proc.returncode is not None


def _series(server: _Server, run: str, tag: str) -> list[tuple[int, float]]:
    return [(int(step), float(value)) for _, step, value in server.get("/data/plugin/scalars/scalars", run=run, tag=tag)]


# ---------------------------------------------------------------------------------------- served data
def test_server_lists_the_runs_the_dashboard_tags_and_the_baseline(server: _Server) -> None:
    assert {"ddp/version_0", "demo/version_0"} <= set(server.get("/data/runs"))
    tags = set(server.get("/data/plugin/scalars/tags")["demo/version_0"])
    expected = {
        "train/loss", "baseline/train/loss", "comm/bytes_sent_per_step", "comm/ratio_vs_ddp", "comm/cumulative_ratio_vs_ddp",
        "comm/cumulative_sent_bytes", "comm/step_sent_bytes/demo/topk", "comm/modeled_seconds_per_step/1Gbps",
        "comm/ddp_modeled_seconds_per_step/1Gbps", "demo/energy_captured/ffn", "demo/keep_ratio", "guard/skipped_steps",
        "final/loss", "final/ratio_vs_ddp", "final/sent_bytes",
    }
    assert expected <= tags, sorted(expected - tags)
    # the baseline's curve, copied into this run at its own steps; the other scalar of the baseline is not
    served = _series(server, "demo/version_0", "baseline/train/loss")
    assert [s for s, _ in served] == [s for s, _ in BASELINE]
    assert [v for _, v in served] == pytest.approx([v for _, v in BASELINE], rel=1e-6)
    assert "baseline/val/loss" not in tags


def test_custom_scalars_layout_charts_match_logged_tags(server: _Server, dashboard_run: tuple[Path, dict[str, Any]]) -> None:
    layout = server.get("/data/plugin/custom_scalars/layout")
    (category,) = layout["category"]
    assert category["title"] == DASHBOARD
    charts = {c["title"]: c["multiline"]["tag"] for c in category["chart"]}
    titles = set(charts)
    assert {"loss vs DDP baseline", "bytes sent per step, by tag", "cumulative ratio vs DDP (bytes)",
            "modeled link time per step at 1 Gbit/s, ours vs DDP", "modeled link time per step at 10 Gbit/s, ours vs DDP",
            "momentum energy captured, by layer group"} <= titles, titles
    tags = set(server.get("/data/plugin/scalars/tags")["demo/version_0"])
    for title, regexes in charts.items():
        for regex in regexes:
            matched = {t for t in tags if re.match(regex, t)}  # the custom scalars plugin's own rule
            assert matched, f"chart {title!r}: {regex!r} matches no tag of the run"
            served = server.get("/data/plugin/custom_scalars/scalars", run="demo/version_0", tag=regex)
            assert served["regex_valid"] and set(served["tag_to_events"]) == matched
    # the loss chart overlays exactly our loss and the baseline's; the bytes chart has every ledger tag
    assert [{t for t in tags if re.match(r, t)} for r in charts["loss vs DDP baseline"]] == [{"train/loss"}, {"baseline/train/loss"}]
    by_tag = {t for t in tags if re.match(charts["bytes sent per step, by tag"][0], t)}
    assert {"comm/step_sent_bytes/demo/topk", "comm/step_sent_bytes/demo/dense"} <= by_tag
    ours, ddp = charts["modeled link time per step at 1 Gbit/s, ours vs DDP"]
    assert {t for t in tags if re.match(ours, t)} == {"comm/modeled_seconds_per_step/1Gbps"}
    assert {t for t in tags if re.match(ddp, t)} == {"comm/ddp_modeled_seconds_per_step/1Gbps"}


def test_hparams_tab_lists_the_run_settings_and_its_final_metrics(server: _Server, dashboard_run: tuple[Path, dict[str, Any]]) -> None:
    _, record = dashboard_run
    hparams, final = record["hparams"], record["final_metrics"]
    assert hparams["strategy"] == "demo" and hparams["world_size"] == 2 and hparams["demo/topk"] == 64
    assert hparams["model/d_model"] == 64 and hparams["desloc/param_sync_every"] == "None"
    experiment = server.post("/data/plugin/hparams/experiment", {"experimentName": ""})
    assert {h["name"] for h in experiment["hparamInfos"]} == set(hparams)  # ours, not Lightning's later hp_metric
    assert {m["name"]["tag"] for m in experiment["metricInfos"]} == set(final)
    groups = server.post("/data/plugin/hparams/session_groups", {
        "experimentName": "", "startIndex": 0, "sliceSize": 100,
        "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
    })["sessionGroups"]
    (group,) = [g for g in groups if g["name"] == "demo/version_0"]
    assert group["hparams"] == {k: float(v) if isinstance(v, (int, float)) else v for k, v in hparams.items()}
    assert [s["status"] for s in group["sessions"]] == ["STATUS_SUCCESS"]
    values = {m["name"]["tag"]: m for m in group["metricValues"]}
    assert set(values) == set(final)
    for tag, value in final.items():
        assert values[tag]["value"] == pytest.approx(value, rel=1e-6), tag
        assert values[tag]["trainingStep"] == record["global_step"] == STEPS

    # the final metrics are what the run's own scalars ended with
    def last(tag: str) -> float:
        return _series(server, "demo/version_0", tag)[-1][1]

    assert values["final/loss"]["value"] == pytest.approx(last("train/loss"), rel=1e-6)
    assert values["final/ratio_vs_ddp"]["value"] == pytest.approx(last("comm/cumulative_ratio_vs_ddp"), rel=1e-6)
    assert values["final/ratio_vs_ddp"]["value"] == pytest.approx(record["summary"]["ratio_vs_ddp"], rel=1e-6) and final["final/ratio_vs_ddp"] > 5
    assert values["final/sent_bytes"]["value"] == pytest.approx(last("comm/cumulative_sent_bytes"), rel=1e-6)
    assert values["final/sent_bytes"]["value"] > 0
    per_step = [v for _, v in _series(server, "demo/version_0", "comm/bytes_sent_per_step")]
    assert len(per_step) == STEPS and values["final/sent_bytes_per_step"]["value"] == pytest.approx(sum(per_step) / STEPS, rel=1e-6)
    assert values["final/skipped_steps"]["value"] == last("guard/skipped_steps") == 0
    assert values["final/optimizer_steps"]["value"] == record["summary"]["optimizer_steps"] == STEPS
    assert values["final/modeled_seconds/1Gbps"]["value"] == pytest.approx(
        sum(v for _, v in _series(server, "demo/version_0", "comm/modeled_seconds_per_step/1Gbps")), rel=1e-5,
    )


# ---------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"baseline": 3}, r"baseline must be None or the path \(str or pathlib\.Path\).*e\.g\. baseline='lightning_logs/ddp/version_0'"),
        ({"baseline": "  "}, r"baseline must be None or the path"),
        ({"loss_tag": ""}, r"loss_tag must be the name of the scalar.*e\.g\. 'train/loss'"),
        ({"loss_tag": None}, r"loss_tag must be the name of the scalar"),
    ],
    ids=["baseline-type", "baseline-empty", "loss_tag-empty", "loss_tag-none"],
)
def test_bad_dashboard_arguments_raise_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CommunicationMonitor(**kwargs)


def _stub_trainer(rank: int = 0, broadcast: Optional[Callable[[Any, int], Any]] = None) -> Any:
    """What ``CommunicationMonitor.setup`` reads of a Trainer."""
    strategy = SimpleNamespace(ledger=ByteLedger(), broadcast=broadcast or (lambda obj, src=0: obj))
    return SimpleNamespace(strategy=strategy, is_global_zero=rank == 0, loggers=[])


def _two_runs(root: Path) -> Path:
    _write_baseline(root / "a" / "version_0", BASELINE)
    _write_baseline(root / "b" / "version_0", BASELINE)
    return root


@pytest.mark.parametrize(
    ("make", "loss_tag", "message"),
    [
        (lambda p: p / "missing", "train/loss", r"baseline='.*missing' does not exist: pass baseline= the TensorBoard run directory"),
        (lambda p: p, "train/loss", r"baseline='.*' holds no TensorBoard event file \(events\.out\.tfevents\.\*\)"),
        (_two_runs, "train/loss", r"baseline='.*' holds 2 TensorBoard runs \('.*a/version_0', '.*b/version_0'\): pass one of them"),
        (lambda p: (p / "notes.txt", (p / "notes.txt").write_text("not events\n"))[0], "train/loss",
         r"baseline='.*notes\.txt' holds no TensorBoard scalars"),
        (lambda p: (p / "run", _write_baseline(p / "run", BASELINE))[0], "train/nll",
         r"the baseline run '.*run' has no scalar 'train/nll' \(loss_tag='train/nll'\); its scalars are \['train/loss', 'val/loss'\]"),
    ],
    ids=["missing", "no-events", "two-runs", "not-events", "no-such-tag"],
)
def test_bad_baseline_raises_at_setup_naming_the_argument(tmp_path: Path, make: Callable[[Path], Path], loss_tag: str, message: str) -> None:
    monitor = CommunicationMonitor(baseline=make(tmp_path), loss_tag=loss_tag)  # constructing reads nothing
    with pytest.raises(ValueError, match=r"CommunicationMonitor: " + message):
        monitor.setup(_stub_trainer(), None, "fit")  # type: ignore[arg-type]


def test_baseline_reads_the_run_event_file_and_step_suffix(tmp_path: Path) -> None:
    _write_baseline(tmp_path / "run", [(1, 2.0), (2, 1.5)], tag="train/loss_step")  # logged with on_epoch=True too
    (events,) = (tmp_path / "run").glob("events.out.tfevents.*")
    assert read_baseline(events, "train/loss") == [(1, 2.0), (2, 1.5)]
    monitor = CommunicationMonitor(baseline=tmp_path)  # the folder above the run
    with pytest.warns(UserWarning, match="no TensorBoardLogger"):
        monitor.setup(_stub_trainer(), None, "fit")  # type: ignore[arg-type]
    assert monitor._baseline_curve == [(1, 2.0), (2, 1.5)]
    assert monitor.dashboard_layout(SimpleNamespace(strategy=None))[DASHBOARD]["loss vs DDP baseline"][1] == [
        r"train/loss(_step)?$", r"baseline/train/loss$",
    ]


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.usefixtures("isolated_process_group")
def test_a_fit_with_a_missing_baseline_stops_before_its_first_step(tmp_path: Path) -> None:
    model = _Tiny()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy="demo", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[CommunicationMonitor(baseline=tmp_path / "ddp")],
    )
    data = DataLoader(TensorDataset(torch.randn(8, 8), torch.randint(0, 2, (8,))), batch_size=4)
    with pytest.raises(ValueError, match=r"CommunicationMonitor: baseline='.*ddp' does not exist"):
        trainer.fit(model, data)
    assert model.steps == 0 and trainer.global_step == 0


def _setup_on_every_rank(rank: int, world_size: int, baseline: str) -> dict[str, Any]:
    import torch.distributed as dist

    import demo_lightning.callbacks.communication_monitor as module

    reads: list[int] = []
    original = module.read_baseline

    def counted(path: Any, tag: str) -> list[tuple[int, float]]:
        reads.append(rank)
        return original(path, tag)

    module.read_baseline = counted

    def broadcast(obj: Any, src: int = 0) -> Any:  # Lightning's DDPStrategy.broadcast
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    monitor = CommunicationMonitor(baseline=baseline)
    try:
        monitor.setup(_stub_trainer(rank, broadcast), None, "fit")  # type: ignore[arg-type]
        return {"error": None, "reads": reads, "curve": monitor._baseline_curve}
    except ValueError as e:
        return {"error": str(e), "reads": reads, "curve": None}


def test_bad_baseline_raises_the_same_error_on_every_rank_and_only_rank_0_reads(tmp_path: Path) -> None:
    _write_baseline(tmp_path / "ddp", [(0, 3.0), (1, 2.5)])
    good = run_workers(_setup_on_every_rank, 2, tmp_path / "good", str(tmp_path / "ddp"), timeout=90, collective_timeout=30)
    assert [r["reads"] for r in good] == [[0], []]  # rank 1 never touches the files
    assert [r["error"] for r in good] == [None, None] and good[0]["curve"] == [(0, 3.0), (1, 2.5)] and good[1]["curve"] == []
    bad = run_workers(_setup_on_every_rank, 2, tmp_path / "bad", str(tmp_path / "missing"), timeout=90, collective_timeout=30)
    assert bad[0]["error"] == bad[1]["error"] and "does not exist" in bad[0]["error"]
    assert [r["reads"] for r in bad] == [[0], []]
