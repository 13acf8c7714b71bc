"""Ring mode across two torchrun "nodes" on this machine: two `torchrun --nnodes 2 --node-rank r`
launches (one process each) meeting through a c10d rendezvous on 127.0.0.1, against the same case
run by a single launch (tests/dist_utils.run_group). The ring is deterministic, so the results must
be the same bits; exchange mode in the same processes must agree to fp32 rounding."""
import os
import subprocess
import sys

import numpy as np
import torch

from tests.dist_utils import free_port, run_group
from tests.parallel.ring_torchrun_worker import ring_case

HERE = os.path.dirname(os.path.abspath(__file__))


def _torchrun_node(node_rank, port, out_dir):
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "clipshard-ring-test", "--local-addr", "127.0.0.1", "--max-restarts", "0",
               os.path.join(HERE, "ring_torchrun_worker.py"), out_dir]
    repo = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [repo] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_ring_across_two_torchrun_nodes_equals_single_launch(tmp_path):
    port = free_port()
    nodes = [_torchrun_node(r, port, str(tmp_path)) for r in (0, 1)]
    logs = []
    try:
        for node in nodes:
            logs.append(node.communicate(timeout=120)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, log in zip(nodes, logs):
        assert node.returncode == 0, log
    single = run_group(ring_case, 2, timeout=60)
    for rank in (0, 1):
        multi = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert multi.keys() == single[rank].keys()
        for key, tensors in single[rank].items():
            for name, want, got in zip(["loss", "image", "text", "scale", "bias"], tensors, multi[key]):
                assert np.array_equal(got, want), f"rank {rank} {key} {name}: two-node launch differs"
        for local_loss in (True, False):
            for want, got in zip(multi["exchange", local_loss], multi["ring", local_loss]):
                assert np.allclose(got, want, rtol=2e-5, atol=2e-6), (rank, local_loss)
