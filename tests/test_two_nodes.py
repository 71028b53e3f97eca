"""Two nodes on one machine: two torchrun launches (``--nnodes 2 --nproc-per-node 2``) on 127.0.0.1.

Flat DeMo, hierarchical DeMo (``hierarchy="node"``) and DES-LOC train the small GPT with
``Trainer(num_nodes=2, devices=2)``; parameters must be equal on all four ranks after every DeMo
exchange (after every DES-LOC parameter sync), and the hierarchical run must put at most
``1 / devices`` of the flat run's bytes on the inter-node link, by the ledger and by an independent
count of the bytes handed to ``torch.distributed`` over groups that span both nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dist_helpers import clean_env, free_port, kill_launch

HERE = Path(__file__).parent
SCRIPT = HERE / "two_node_run.py"
STEPS = 6


RUNS = {
    # every tensor compressed (dense_below=0, dense_vectors=False): in this small GPT the dense all-reduce of the norms would
    # otherwise outweigh the compressed payload, and an all-reduce's bytes on a node's link shrink only
    # from 2 (W-1)/W to 2 (N-1)/N of its size under the hierarchy, not by 1/devices
    "flat": "flat:dense-below=0:no-dense-vectors",
    "node": "node:dense-below=0:no-dense-vectors",
    "desloc": "desloc",
    # composed with DES-LOC averaging of the residuals (over the inter-node groups) and the callbacks
    "node-shared": "node:selection=shared:value-format=bf16:compose",
}
pytestmark = pytest.mark.timeout(600)  # the module's one launch runs the four fits in turn


def _launch_two_nodes(out: Path, runs: dict[str, str], timeout: float = 540) -> dict[str, list[dict[str, Any]]]:
    """One torchrun launch per node; the fits of ``runs`` (name: ``METHOD[:FLAG...]``) run one after
    another in the same process group, which saves three launches' start-up."""
    env = clean_env()
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    port = free_port()
    launches = []
    for node in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            str(SCRIPT), "--out", str(out), "--max-steps", str(STEPS), *(f"{name}:{spec}" for name, spec in runs.items()),
        ]
        log = open(out.parent / f"{out.name}-node{node}.log", "w")
        launches.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
    try:
        for proc, _ in launches:
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, log in launches:
            if proc.poll() is None:
                kill_launch(proc, out, SCRIPT)
            log.close()
    logs = "\n".join((out.parent / f"{out.name}-node{n}.log").read_text()[-3000:] for n in range(2))
    assert all(proc.returncode == 0 for proc, _ in launches), logs
    return {name: [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(4)] for name in runs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return _launch_two_nodes(tmp_path_factory.mktemp("two_nodes") / "fits", RUNS)


def test_the_ranks_see_two_nodes_of_two(runs: dict[str, list[dict[str, Any]]]) -> None:
    for method, ranks in runs.items():
        assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)], method
        for r in ranks:
            assert r["topology"] == [2, 2] and r["world_size"] == 4 and r["global_step"] == STEPS
    for method in ("node", "node-shared"):
        assert all(r["hierarchical"] for r in runs[method]), method
        assert not any(r["groups_after_fit"] for r in runs[method]), method  # destroyed at teardown
    assert not any(r["hierarchical"] for r in runs["flat"])


@pytest.mark.parametrize("method", ["flat", "node", "node-shared"])
def test_demo_replicas_equal_on_all_four_ranks_after_every_exchange(runs: dict[str, list[dict[str, Any]]], method: str) -> None:
    ranks = runs[method]
    assert len(ranks[0]["param_hashes"]) == STEPS
    for r in ranks[1:]:
        assert r["param_hashes"] == ranks[0]["param_hashes"]
    assert len(set(ranks[0]["param_hashes"])) == STEPS  # they trained


def test_desloc_replicas_equal_after_every_parameter_sync(runs: dict[str, list[dict[str, Any]]]) -> None:
    ranks = runs["desloc"]
    for step in range(1, STEPS, 2):  # param_sync_every=2: after steps 2, 4, 6
        assert len({r["param_hashes"][step] for r in ranks}) == 1, step
    assert len({r["param_hashes"][0] for r in ranks}) == 4  # local steps in between: the ranks differ


def test_hierarchical_inter_node_bytes_at_most_one_over_devices_of_flat(runs: dict[str, list[dict[str, Any]]]) -> None:
    flat, node = runs["flat"], runs["node"]
    for method in runs:
        for r in runs[method]:  # the ledger's account of the links equals the independent count
            assert r["payload_by_link"]["inter"] == r["handed"]["inter"], (method, r["rank"])
            assert r["payload_by_link"]["intra"] == r["handed"]["intra"], (method, r["rank"])
    for node_rank in range(2):
        def on_node(ranks: list[dict[str, Any]], key: str) -> float:
            return sum(r[key] for r in ranks if r["node_rank"] == node_rank)

        # bytes on the node's link: modelled by the ledger, and counted from what came from the other node
        assert on_node(node, "steps_inter_node_bytes") <= on_node(flat, "steps_inter_node_bytes") / 2
        assert on_node(node, "from_other_node") <= on_node(flat, "from_other_node") / 2
    for method in ("flat", "node"):  # the README's figures: pytest tests/test_two_nodes.py -s -k inter_node
        ranks = runs[method]
        print(f"{method}: inter-node bytes/step by rank {[round(r['steps_inter_node_bytes'] / r['steps']) for r in ranks]}, "
              f"DDP/ours on the inter-node link {ranks[0]['steps_ddp_inter_node_bytes'] / ranks[0]['steps_inter_node_bytes']:.0f}x, "
              f"bytes from the other node (node 0, {STEPS} steps) {sum(r['from_other_node'] for r in ranks if r['node_rank'] == 0)}")
    for r in node:
        logged = r["logged"]
        assert logged["comm/inter_node_bytes_per_step"] > 0 and logged["comm/intra_node_bytes_per_step"] > 0
    for r in flat:
        assert r["steps_ddp_inter_node_bytes"] / r["steps_inter_node_bytes"] > 10


def test_hierarchical_shared_composes_with_residual_averaging_and_the_callbacks(runs: dict[str, list[dict[str, Any]]]) -> None:
    ranks = runs["node-shared"]
    for r in ranks:
        assert r["desloc_syncs"][0].get("state/demo_momentum") == STEPS // 2  # residuals averaged every 2 steps
        ours, ddp = r["monitor"]["links"]
        assert 0 < ours < ddp  # the two-link model without latency: 10 Gbit/s between nodes, 400 inside
        assert r["monitor"]["metrics"]["comm/cumulative_inter_node_ratio_vs_ddp"] > 1
