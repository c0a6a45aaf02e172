"""Comparison statistics, the summary table and the JSON of ``true_on_policy.check``.

JSON keys num_tokens, max_abs_logdiff, mean_abs_logdiff and frac_exact are a stable
interface (CI and the H200 runs read them); new keys may be added, never renamed.
"""
import torch

PHASE_NAMES = ("initial", "updated")


def compare_phases(phases, trainer):
    """Token-by-token comparison of reported (rollout) vs recomputed (trainer) fp32 log-probs."""
    per_phase, diffs, first = [], [], None
    for p, (phase, lps) in enumerate(zip(phases, trainer)):
        phase_diffs = []
        for s, (seq, lp) in enumerate(zip(phase["sequences"], lps)):
            reported = torch.tensor(seq["logprobs"], dtype=torch.float32)
            d = (reported.double() - lp.double()).abs()
            bad = (reported != lp).nonzero().flatten()
            if first is None and len(bad):
                first = {"phase": p, "sequence": s, "token": int(bad[0]),
                         "rollout": float(reported[bad[0]]), "trainer": float(lp[bad[0]])}
            phase_diffs.append(d)
        d = torch.cat(phase_diffs) if phase_diffs else torch.zeros(0, dtype=torch.float64)
        per_phase.append(_stats(d))
        diffs.append(d)
    return {"phases": per_phase, "total": _stats(torch.cat(diffs)), "first_mismatch": first}


PLUGIN_LOG_MARK = "true_on_policy: "       # how the plugin starts its log lines


def plugin_log(lines):
    """The plugin's own lines among an engine's log lines, each once, in order: what it registered,
    each worker's model and contract, the decode paths it took (e.g. K/V stored by the attention
    prologue). [] for a stock engine (JSON key plugin_log; bench_vllm_gpu.py's too)."""
    found = {}
    for line in lines:
        _, mark, message = line.partition(PLUGIN_LOG_MARK)
        if mark:
            found.setdefault(message.strip(), None)
    return list(found)


def _stats(d):
    n = d.numel()
    return {"num_tokens": n, "num_exact": int((d == 0).sum()), "frac_exact": float((d == 0).sum()) / max(n, 1),
            "max_abs_logdiff": float(d.max()) if n else 0.0, "mean_abs_logdiff": float(d.mean()) if n else 0.0}


def summary_json(args, plan, model_dir, result, stats, localize, wall_s, log):
    gen_tokens = stats["total"]["num_tokens"]
    chunked = sum(len(p) > args.max_num_batched_tokens for p in plan["prompts"])
    out = dict(stats["total"])
    out.update(
        mode="stock" if args.stock else "plugin", model=model_dir, tp=args.tp, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        seed=args.seed, num_sequences=sum(len(p["sequences"]) for p in result["phases"]),
        max_num_batched_tokens=args.max_num_batched_tokens, chunked_prompts=chunked,
        enable_prefix_caching=args.enable_prefix_caching, block_size=args.block_size, cuda_graphs=args.cuda_graphs,
        prefix_cache_hits=result.get("prefix_cache_hits"), prefix_cache_queries=result.get("prefix_cache_queries"),
        phases=[dict(name=PHASE_NAMES[i], weights=p["weights"], **s)
                for i, (p, s) in enumerate(zip(result["phases"], stats["phases"]))],
        phase_outputs_differ=_phases_differ(result["phases"]), first_mismatch=stats["first_mismatch"],
        rollout_fingerprint=result.get("fingerprint"), trainer_fingerprint=_trainer_fingerprint(args, model_dir),
        engine_start_s=result.get("engine_start_s"), generate_s=result.get("generate_s"),
        rollout_tokens_per_s=gen_tokens / result["generate_s"] if result.get("generate_s") else None,
        wall_s=wall_s, localize=localize, plugin_log=log)
    return out


def _truncation_text(s):
    cut = [f"{k}={s[k]}" for k, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))
           if s.get(k) not in (None, off, -1)]
    return (", " + " ".join(cut)) if cut else ""


def _phases_differ(phases):
    if len(phases) < 2:
        return None
    a, b = phases
    return any(x["output"] != y["output"] or x["logprobs"] != y["logprobs"]
               for x, y in zip(a["sequences"], b["sequences"]))


def _trainer_fingerprint(args, model_dir):
    if args.stock:
        return None
    import consistent_ops as co
    from true_on_policy.models import ModelConfig
    return co.contract_fingerprint(ModelConfig.from_dir(model_dir).numerics())


def print_summary(s):
    rollout = "vLLM stock" if s["mode"] == "stock" else "vLLM + true_on_policy plugin"
    trainer = "HF transformers forward" if s["mode"] == "stock" else f"ConsistentForCausalLM (TP {s['tp']} emulated)"
    hits = "" if s["prefix_cache_hits"] is None else f", hits {s['prefix_cache_hits']:.0f}/{s['prefix_cache_queries']:.0f} tokens"
    lines = [
        "=" * 78, "true_on_policy.check",
        f"  model       {s['model']}",
        f"  rollout     {rollout}, TP {s['tp']}   contract {s['rollout_fingerprint'] or '-'}",
        f"  trainer     {trainer}   contract {s['trainer_fingerprint'] or '-'}",
        f"  sampling    T={s['temperature']}{_truncation_text(s)}, seed {s['seed']}, "
        f"{s['num_sequences']} sequences",
        f"  scheduling  max_num_batched_tokens={s['max_num_batched_tokens']} ({s['chunked_prompts']} prompts "
        f"chunked), prefix caching {'on' if s['enable_prefix_caching'] else 'off'}{hits}, page {s['block_size']}",
        *(f"  plugin      {line}" for line in s["plugin_log"]),
        "-" * 78,
        f"  {'phase':<10}{'tokens':>8}{'exact':>8}{'frac_exact':>12}{'max|d|':>14}{'mean|d|':>14}",
    ]
    for p in s["phases"] + [dict(s, name="total")]:
        lines.append(f"  {p['name']:<10}{p['num_tokens']:>8}{p['num_exact']:>8}{p['frac_exact']:>12.6f}"
                     f"{p['max_abs_logdiff']:>14.6g}{p['mean_abs_logdiff']:>14.6g}")
    lines.append("-" * 78)
    if s["phase_outputs_differ"] is not None:
        lines.append(f"  weight update changed the outputs: {s['phase_outputs_differ']}")
    if s["rollout_tokens_per_s"]:
        lines.append(f"  rollout {s['rollout_tokens_per_s']:.0f} tokens/s (engine start {s['engine_start_s']:.0f}s), "
                     f"wall {s['wall_s']:.0f}s")
    if "untruncated_max_abs_logdiff" in s:
        lines.append(f"  a trainer scoring the UNtruncated distribution would be off by max "
                     f"{s['untruncated_max_abs_logdiff']:.4g}, mean {s['untruncated_mean_abs_logdiff']:.4g} "
                     f"({100 * s['untruncated_frac_exact']:.1f} % exact)")
    if s["localize"]:
        lines.append("  localize: " + s["localize"]["text"].lstrip())
    bad = s["num_tokens"] - s["num_exact"]
    lines.append(f"  RESULT: {'EXACT' if bad == 0 else 'MISMATCH'} ({bad} of {s['num_tokens']} tokens differ)")
    if bad and s["first_mismatch"]:
        m = s["first_mismatch"]
        lines.append(f"  first mismatch: phase {m['phase']} sequence {m['sequence']} token {m['token']}: "
                     f"rollout {m['rollout']!r} vs trainer {m['trainer']!r}")
    print("\n".join(lines + ["=" * 78]), flush=True)
