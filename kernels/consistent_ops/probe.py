"""The invariance battery on the active backend: ``python -m consistent_ops.probe``.

Each line compares two ways of computing the same rows that the contract says give the
same bits: a row alone vs inside a batch, training attention vs prefill vs chunked
prefill vs decode over a paged cache, TP row-parallel emulation for k = 1, 2, 4 vs its
rank-order partials, a MoE token alone vs in a batch and expert placement, log-probs at
T 0.7. It prints a table and exits 1 on any difference (max |Δ| != 0). It is what a user
runs once on a new device (an Ascend NPU: CONSISTENT_OPS_BACKEND=ascend) before a job.
"""
import argparse
import hashlib
import math
import os
import sys

import torch

import consistent_ops as co

HQ, HKV, D, H, I, E, K, V = 4, 2, 64, 256, 128, 8, 2, 1000
BF16 = torch.bfloat16


def _rand(g, *shape, scale=1.0, dtype=BF16, dev="cpu"):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)


def _delta(a, b):
    """max |a - b| over possibly tuple outputs; inf when shapes or NaN placement differ."""
    if isinstance(a, (tuple, list)):
        return max(_delta(x, y) for x, y in zip(a, b))
    if a.shape != b.shape:
        return math.inf
    if torch.equal(a, b):
        return 0.0
    a, b = a.double().cpu(), b.double().cpu()
    nan = a.isnan() != b.isnan()
    return math.inf if nan.any() else float((a - b).nan_to_num().abs().max())


def _rows_alone(fn, batch, pick=(0, 5, -1)):
    """fn on the whole batch vs fn on one row at a time (rows given by ``pick``)."""
    full = fn(*batch)
    out = 0.0
    for r in pick:
        r = r % batch[0].shape[0]
        alone = fn(*(t[r:r + 1] for t in batch))
        part = tuple(f[r:r + 1] for f in full) if isinstance(full, tuple) else full[r:r + 1]
        out = max(out, _delta(alone, part))
    return out


def _ops(g, dev):
    x = _rand(g, 37, H, dev=dev)
    w = _rand(g, 3 * H, H, scale=H ** -0.5, dev=dev)
    nw = _rand(g, H, dev=dev)
    logits = _rand(g, 37, V, scale=3.0, dtype=torch.float32, dev=dev)
    ids = torch.randint(0, V - 24, (37,), generator=g).to(dev)
    pos = torch.arange(37, device=dev) * 7
    cos, sin = co.rope_cos_sin(pos, D, 1e6)
    qh = _rand(g, 37, HQ, D, dev=dev)
    yield "linear bf16", "row alone == in batch", _rows_alone(lambda a: co.linear(a, w), (x,))
    yield "linear fp32 out", "row alone == in batch", _rows_alone(
        lambda a: co.linear(a, w, out_dtype=torch.float32), (x,))
    yield "rms_norm", "row alone == in batch", _rows_alone(lambda a: co.rms_norm(a, nw, 1e-6), (x,))
    yield "add_rms_norm", "row alone == in batch", _rows_alone(lambda a, b: co.add_rms_norm(a, b, nw, 1e-6),
                                                              (x, x.flip(0)))
    yield "rope_cos_sin", "position alone == in table", _rows_alone(lambda p: co.rope_cos_sin(p, D, 1e6), (pos,))
    yield "apply_rope", "row alone == in batch", _rows_alone(co.apply_rope, (qh, cos, sin))
    yield "silu_mul", "row alone == in batch", _rows_alone(co.silu_mul, (x, x.flip(0)))
    t = torch.full((37,), 0.7, device=dev)
    yield "log_softmax T 0.7", "row alone == in batch", _rows_alone(
        lambda z, tt: co.log_softmax(z, tt, V - 24), (logits, t))
    yield "token_logprobs T 0.7", "row alone == in batch", _rows_alone(
        lambda z, i, tt: co.token_logprobs(z, i, tt, V - 24), (logits, ids, t))
    lsm = co.log_softmax(logits, 0.7, V - 24)
    yield "token_logprobs T 0.7", "== log_softmax[token]", _delta(
        co.token_logprobs(logits, ids, 0.7, V - 24), lsm.gather(1, ids[:, None])[:, 0])


def _tp(g, dev):
    x = _rand(g, 37, 4 * 64, dev=dev)
    w = _rand(g, H, 4 * 64, scale=1 / 16, dev=dev)
    for k in (1, 2, 4):
        yield f"row-parallel k={k}", "row alone == in batch", _rows_alone(
            lambda a: co.row_parallel_linear(a, w, k), (x,))
        shard = x.shape[1] // k
        parts = [co.row_parallel_partial(x[:, r * shard:(r + 1) * shard], w[:, r * shard:(r + 1) * shard])
                 for r in range(k)]
        yield f"row-parallel k={k}", "== partials in rank order", _delta(
            co.row_parallel_linear(x, w, k), co.finish_row_parallel(co.ordered_sum(parts), None, x.dtype))


def _moe(g, dev):
    x = _rand(g, 29, H, dev=dev)
    gate = _rand(g, E, H, scale=H ** -0.5, dev=dev)
    experts = [(_rand(g, I, H, scale=H ** -0.5, dev=dev), _rand(g, I, H, scale=H ** -0.5, dev=dev),
                _rand(g, H, I, scale=I ** -0.5, dev=dev)) for _ in range(E)]

    def layer(a):
        ids, wts = co.moe_route(a, gate, K)
        contrib, _ = co.moe_expert_contributions(a, ids, wts, experts)
        return co.moe_combine(contrib, a.dtype)
    yield "moe_route", "token alone == in batch", _rows_alone(lambda a: co.moe_route(a, gate, K), (x,))
    yield "moe layer", "token alone == in batch", _rows_alone(layer, (x,))
    ids, wts = co.moe_route(x, gate, K)
    full, _ = co.moe_expert_contributions(x, ids, wts, experts)
    halves = [co.moe_expert_contributions(x, ids, wts, experts, range(h * E // 2, (h + 1) * E // 2))
              for h in (0, 1)]
    placed = torch.where(halves[1][1][..., None], halves[1][0], halves[0][0])    # what gather_owned does
    yield "moe experts", "2-rank placement == all local", _delta(placed, full)


def _attention(g, dev, page):
    lens = (70, 150)
    q, k, v = (_rand(g, sum(lens), h, D, dev=dev) for h in (HQ, HKV, HKV))
    cu = torch.tensor([0, *lens], device=dev).cumsum(0).to(torch.int32)
    train = co.attention_varlen(q, k, v, cu)
    pages = [math.ceil(n / page) for n in lens]
    order = torch.randperm(sum(pages), generator=g)                  # pages placed anywhere
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    at = 0
    for s, n in enumerate(pages):
        table[s, :n] = order[at:at + n]
        at += n
    table = table.to(dev)

    def run(chunks):
        """Feed each sequence by the chunk sizes given (the same steps for both)."""
        kc = torch.zeros(sum(pages), page, HKV, D, dtype=BF16, device=dev)
        vc = torch.zeros_like(kc)
        out = torch.empty_like(q)
        done = [0, 0]
        for step in chunks:
            rows, qsl, seq_lens, slots, seqs = [], [0], [], [], []
            for s, n in enumerate(step):
                lo, hi = done[s], min(done[s] + n, lens[s])
                if hi == lo:
                    continue                           # not in this step
                seqs.append(s)
                base = int(cu[s])
                rows += range(base + lo, base + hi)
                qsl.append(qsl[-1] + hi - lo)
                seq_lens.append(hi)
                slots += [int(table[s, p // page]) * page + p % page for p in range(lo, hi)]
                done[s] = hi
            idx = torch.tensor(rows, device=dev)
            co.write_kv_cache(k[idx], v[idx], kc, vc, torch.tensor(slots, device=dev))
            out[idx] = co.attention_paged(q[idx], kc, vc, table[seqs], torch.tensor(seq_lens, dtype=torch.int32).to(dev),
                                          torch.tensor(qsl, dtype=torch.int32).to(dev))
        return out
    yield "attention", "prefill == train", _delta(run([lens]), train)
    yield "attention", "chunked prefill == train", _delta(run([(40, 64), (30, 64), (0, 22)]), train)
    decode = [(lens[0] - 6, lens[1] - 6)] + [(1, 1)] * 6
    yield "attention", "decode == train", _delta(run(decode), train)


def battery(seed=0):
    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else co.backend_device()   # the interpreter: CPU
    page = 128 if co.backend_name() == "ascend" else 16    # flash-attention-npu takes pages of 128
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for part in (_ops(g, dev), _tp(g, dev), _moe(g, dev), _attention(g, dev, page)):
            yield from part


def digests(seed=0):
    """(op, sha256 prefix of its output's bytes) on seeded inputs: the same fingerprint on two
    machines (two CPU kinds, say) must print the same lines: the bits do not depend on the ISA."""
    dev = co.backend_device()
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: _rand(g, *shape, scale=0.5, dev=dev)
    x, w, res, nw = r(37, 1024), r(512, 1024), r(37, 512), r(512)
    q, k, v = r(40, 4, 64), r(40, 2, 64), r(40, 2, 64)
    gate, up, down = r(256, 512), r(256, 512), r(512, 256)
    logits = r(5, 1000).float()
    with torch.no_grad():
        y = co.linear(x, w)
        outs = {"linear": y, "add_rms_norm": co.add_rms_norm(y, res, nw, 1e-6)[0],
                "attention_varlen": co.attention_varlen(q, k, v, torch.tensor([0, 13, 40], dtype=torch.int32, device=dev)),
                "mlp": co.mlp(res, gate, up, down), "log_softmax": co.log_softmax(logits, temperature=0.7)}
    for op, t in outs.items():
        if t is not None:      # None: a fused call the backend does not have
            yield op, hashlib.sha256(t.contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m consistent_ops.probe", description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--digest", action="store_true", help="print each op's output digest on seeded inputs "
                    "instead (compare two machines: same fingerprint, same lines)")
    args = ap.parse_args(argv)
    try:
        co.set_backend()
    except (ImportError, ValueError, NotImplementedError) as e:
        print(f"consistent_ops.probe: {e}", file=sys.stderr)
        return 2
    print(f"backend {co.backend_name()}  contract {co.contract_fingerprint()}")
    if args.digest:
        for op, digest in digests(args.seed):
            print(f"{op:<18} {digest}")
        return 0
    rows = list(battery(args.seed))
    width = max(len(op) for op, _, _ in rows)
    print(f"{'op':<{width}}  {'check':<30} {'max|Δ|':>10}  result")
    for op, check, d in rows:
        print(f"{op:<{width}}  {check:<30} {d:>10.3g}  {'ok' if d == 0.0 else 'DIFFERS'}")
    bad = sum(d != 0.0 for _, _, d in rows)
    print(f"{len(rows) - bad} identical, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
