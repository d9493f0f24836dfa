"""A torchrun group over several nodes: the home's ranks come first, and a member's torchrun joins the home's rendezvous."""

from __future__ import annotations

import pytest

from openrld.worker.launchers.torchrun import SpanRendezvous, member_command, rendezvous_arguments
from openrld.worker.ranks import span_order

SPAN = SpanRendezvous(nodes=2, endpoint="10.0.0.5:29400", run_id="s-1:train:0", is_home=False, local_addr="10.0.0.7")


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        ({0: (True, 2), 1: (False, 2)}, [0, 1]),
        ({0: (False, 2), 1: (True, 2)}, [1, 0]),
        ({0: (False, 1), 1: (False, 3), 2: (True, 4)}, [2, 0, 1]),
    ],
    ids=["home-first-already", "home-numbered-second", "three-nodes"],
)
def test_the_home_nodes_ranks_come_first_whatever_torchrun_numbered_it(nodes, expected):
    assert span_order(nodes) == expected


def test_a_member_joins_the_homes_c10d_rendezvous_without_hosting_it():
    assert rendezvous_arguments(SPAN) == [
        "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.5:29400", "--rdzv-id", "s-1:train:0",
        "--rdzv-conf", "is_host=0,join_timeout=120", "--local-addr", "10.0.0.7", "--max-restarts", "0",
    ]


def test_a_members_ranks_follow_on_its_own_devices_and_model_copy_with_no_socket():
    argv, env = member_command("/envs/automodel/bin/python", SPAN, 2, "cuda:4,5", "/models/llama")
    assert argv[-4:] == ["--nproc-per-node", "2", "-m", "openrld.worker"]
    assert (env["OPENRLD_SPAN_HOME"], env["OPENRLD_SPAN_DEVICE"], env["OPENRLD_SPAN_MODEL_DIR"]) == ("0", "cuda:0,1", "/models/llama")
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert "OPENRLD_WORKER_SOCKET" not in env and "OPENRLD_WORKER_TOKEN" not in env
