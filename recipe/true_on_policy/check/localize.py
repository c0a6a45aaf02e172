"""``check --localize``: name the first op where the two engines' activations differ.

Both engines recompute the same token sequence (the first mismatching sequence, up
to and including the first mismatching position) with per-op capture hooks
(capture.py). The rollout replays it as a fresh prefill inside the running
vLLM engine; the trainer runs its packed forward. Ops are compared in forward
order, bitwise, on the positions both captured; the first op that differs is where
the numerics part ways (everything upstream of it is bit-identical).
"""
import json

import torch

from true_on_policy import scheme, truncation
from true_on_policy.check.capture import HEAD_SHARDED


def merge_ranks(per_rank):
    """Rank captures -> one capture: head-sharded ops concatenated in rank order."""
    merged = dict(per_rank[0])
    for name, (pos, _) in merged.items():
        if name.rsplit(".", 1)[-1] in HEAD_SHARDED and len(per_rank) > 1:
            merged[name] = (pos, torch.cat([r[name][1] for r in per_rank], dim=-1))
    return merged


def _index(positions, wanted):
    where = {}
    for i, p in enumerate(positions.tolist()):
        where.setdefault(p, i)
    return torch.tensor([where[p] for p in wanted], dtype=torch.long)


def compare_op(op, rollout, trainer):
    """Bitwise comparison of one op on the positions both engines captured."""
    (rp, ra), (tp, ta) = rollout, trainer
    shared = sorted(set(rp.tolist()) & set(tp.tolist()))
    a, b = ra[_index(rp, shared)].double(), ta[_index(tp, shared)].double()
    row = {"op": op, "positions": len(shared)}
    if a.shape != b.shape:
        return dict(row, equal=False, max_abs=float("nan"), n_diff=-1, first_pos=None,
                    note=f"shape {tuple(a.shape)} vs {tuple(b.shape)}")
    diff = (a != b) & ~(a.isnan() & b.isnan())
    bad = diff.any(-1).nonzero().flatten()
    return dict(row, equal=not bool(diff.any()), n_diff=int(diff.sum()),
                max_abs=float((a - b).abs().nan_to_num(0.0).max()) if len(bad) else 0.0,
                first_pos=shared[int(bad[0])] if len(bad) else None)


def compare(rollout, trainer):
    """{"ops": [per-op rows in forward order]} over ops both engines captured."""
    return {"ops": [compare_op(op, rollout[op], trainer[op]) for op in trainer if op in rollout]}


def routing_agreement(rollout, trainer):
    """MoE: the fraction of (token, layer) top-k expert sets both engines chose alike,
    overall and per layer (in layer order), and the first layer where any differs (None:
    none). None for a model without MoE layers (no ``experts`` op captured)."""
    layers = [op for op in trainer if op.endswith(".experts") and op in rollout]
    if not layers:
        return None
    per_layer, agree, total = [], 0, 0
    for op in layers:
        (rp, ra), (tp, ta) = rollout[op], trainer[op]
        shared = sorted(set(rp.tolist()) & set(tp.tolist()))
        same = (ra[_index(rp, shared)] == ta[_index(tp, shared)]).all(-1)
        per_layer.append(float(same.float().mean()) if len(shared) else 1.0)
        agree, total = agree + int(same.sum()), total + len(shared)
    first = next((int(op.split(".")[1]) for op, f in zip(layers, per_layer) if f < 1.0), None)
    return {"fraction": agree / max(total, 1), "per_layer": per_layer, "first_differing_layer": first,
            "tokens": total // len(layers)}


def format_routing(routing):
    layers = " ".join(f"{f:.4f}" for f in routing["per_layer"])
    where = "none" if routing["first_differing_layer"] is None else f"layer {routing['first_differing_layer']}"
    return (f"routing: {routing['fraction']:.4f} of (token, layer) top-k expert sets agree over "
            f"{routing['tokens']} tokens; per layer {layers}; first differing: {where}")


def first_divergence(report):
    return next((r for r in report["ops"] if not r["equal"]), None)


def format_report(report, context=3):
    """The first divergent op, its neighbours, and one line per layer before it."""
    ops, first = report["ops"], first_divergence(report)
    lines = [f"  compared {len(ops)} ops, bitwise, on the positions both engines computed"]
    if first is None:
        return "\n".join(lines + ["  every captured op is bit-identical (the difference is outside the "
                                  "captured ops, or the replay did not reproduce it)"])
    k = ops.index(first)
    lines.append(f"  FIRST DIVERGENCE: {first['op']}  (max |d| {first['max_abs']:.3g}, "
                 f"{first['n_diff']} elements, first at position {first['first_pos']})")
    for r in ops[max(0, k - context):k + context + 1]:
        mark = "==" if r["equal"] else "!="
        lines.append(f"    {mark} {r['op']:<22} max|d| {r['max_abs']:.3g}")
    return "\n".join(lines)


def localize_mismatch(args, rollout, result, stats, workdir, vocab_limit):
    """Replay the first mismatching sequence in both engines with capture on; report."""
    m = stats["first_mismatch"]
    phase = result["phases"][m["phase"]]
    seq = phase["sequences"][m["sequence"]]
    tokens = seq["prompt"] + seq["output"][:m["token"]]      # the last position predicts the mismatch
    print(f"[check] localize: phase {m['phase']} sequence {m['sequence']} token {m['token']} "
          f"({len(tokens)} positions), capturing both engines", flush=True)
    if args.stock and args.tp > 1:
        return {"text": "--localize with --stock supports TP 1 only", "ops": []}
    ours, theirs = _capture_both(args, rollout, phase["weights"], tokens, workdir)
    report = compare(ours, theirs)
    report["replay"] = _replay_check(ours, tokens, seq["output"][m["token"]], m, args, vocab_limit)
    report["text"] = format_report(report) + "\n  " + report["replay"]
    _add_routing(report, ours, theirs)
    first = first_divergence(report)
    report["first_divergent_op"] = first and first["op"]
    return report


def _add_routing(report, rollout, trainer):
    report["routing"] = routing_agreement(rollout, trainer)
    if report["routing"]:
        report["text"] += "\n  " + format_routing(report["routing"])


def _capture_both(args, rollout, weights, tokens, workdir):
    rollout.send({"cmd": "capture", "tokens": tokens, "path": str(workdir / "capture")})
    paths = json.loads(rollout.wait_for("@@captured"))
    from true_on_policy.check import trainer as check_trainer
    ours = merge_ranks([torch.load(p) for p in sorted(paths)])
    dtype = None if args.stock else scheme.ROLLOUT_DTYPE
    return ours, check_trainer.capture(weights, tokens, args.tp, args.stock, dtype)


def localize_exact(args, rollout, result, workdir):
    """No mismatch: for an MoE model, the routing agreement over the first sequence (the
    number R3 users watch; 1.0 under the plugin), and the ops compared on the way. The last
    phase's weights: the ones the engine holds now (after any --update-weights-from)."""
    phase = result["phases"][-1]
    seq = phase["sequences"][0]
    tokens = seq["prompt"] + seq["output"]
    print(f"[check] localize: no mismatch; capturing both engines on sequence 0 ({len(tokens)} positions) "
          f"for the routing agreement", flush=True)
    if args.stock and args.tp > 1:
        return {"text": "--localize with --stock supports TP 1 only", "ops": []}
    ours, theirs = _capture_both(args, rollout, phase["weights"], tokens, workdir)
    report = compare(ours, theirs)
    report["text"] = format_report(report)
    _add_routing(report, ours, theirs)
    first = first_divergence(report)
    report["first_divergent_op"] = first and first["op"]
    return report


def _replay_check(capture, tokens, target, m, args, vocab_limit):
    """Does the replay reproduce the rollout's reported number for the mismatching token?"""
    import consistent_ops as co
    if "logits" not in capture:
        return "replay: logits not captured"
    pos, rows = capture["logits"]
    hit = (pos == len(tokens) - 1).nonzero().flatten()
    if len(hit) == 0:
        return "replay: last position not captured"
    logits = rows[hit[:1]].float()
    t = scheme.logprob_temperature(args.temperature)
    if args.stock:
        lp = float(torch.log_softmax(logits / t, -1)[0, target])
    else:
        cut = truncation.of_settings(args)
        lp = float(co.token_logprobs(logits, torch.tensor([target]), t, vocab_limit, cut)[0])
    same = lp == m["rollout"]
    return (f"replay {'reproduces' if same else 'does NOT reproduce'} the rollout's log-prob "
            f"({lp!r} vs {m['rollout']!r})" + ("" if same else ": the rollout value depended on "
                                                 "scheduling (batch, chunking or cache hits)"))
