"""Real ranks over NCCL == single-GPU emulation, bit for bit (needs 2 GPUs).

Row-parallel linear: each rank's fp32 partial over its K-shard, gathered and summed in
rank order (parallel.gather_ordered_sum), equals row_parallel_linear(x, w, 2) on one GPU.
Expert parallel: each rank computes its 64 experts' contributions, exchanged by owner
(parallel.gather_owned), equals all 128 experts on one GPU.
"""
import os
import socket

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)
pytest.importorskip("triton")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD, BF16 = 2, torch.bfloat16


def rand(*shape, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)   # same values on every GPU
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(BF16)


def _worker(rank, port):
    import consistent_ops as co
    from consistent_ops import parallel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD)
    co.set_backend("triton")
    try:
        # row-parallel linear (o_proj shape)
        x, w = rand(1000, 4096, seed=1), rand(2048, 4096, seed=2, scale=1 / 64)
        shard = slice(rank * 2048, (rank + 1) * 2048)
        total = parallel.gather_ordered_sum(co.row_parallel_partial(x[:, shard], w[:, shard]))
        real = co.finish_row_parallel(total, None, BF16)
        assert torch.equal(real, co.row_parallel_linear(x, w, WORLD)), "TP=2 ranks != emulation"
        # expert parallel (64 experts per rank)
        h, inter = 2048, 768
        experts = {e: (rand(inter, h, seed=100 + e, scale=h ** -0.5), rand(inter, h, seed=300 + e, scale=h ** -0.5),
                       rand(h, inter, seed=500 + e, scale=inter ** -0.5)) for e in range(128)}
        xm, gate = rand(512, h, seed=3), rand(128, h, seed=4, scale=h ** -0.5)
        ids, wts = co.moe_route(xm, gate, 8)
        local = range(rank * 64, (rank + 1) * 64)
        contrib, owned = co.moe_expert_contributions(xm, ids, wts, {e: experts[e] for e in local}, local)
        exchanged = parallel.gather_owned(contrib, owned)
        whole, _ = co.moe_expert_contributions(xm, ids, wts, experts)
        assert torch.equal(exchanged, whole), "EP=2 ranks != one GPU"
    finally:
        dist.destroy_process_group()


def test_tp2_and_ep2_over_nccl_equal_single_gpu():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port,), nprocs=WORLD, join=True)
