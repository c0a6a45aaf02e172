"""verl jobs side by side, from their metrics files (verl's file logger, one JSON line per step:
``{"step": N, "data": {...}}``): verl's time per phase (``timing_s/*``) for each job, per step
and as the mean over the steps after the first (start-up, compilation and graph capture land in
step 1), the plugin's step time / the baseline's, and per step the plugin's ``logdiff_max`` /
``contract_match`` and verl's own ``training/rollout_probs_diff_max``.

    python3 benchmarks/verl_step_table.py plugin=P/metrics.jsonl stock=S/metrics.jsonl [--json out.json]

A job with ``true_on_policy/*`` metrics is a plugin job: exit 1 unless its logdiff_max is 0 and
contract_match 1 at every step (and unless every job has a step). Used by scripts/gpu_verl_suite.sh.
"""
import argparse
import json
import sys
from pathlib import Path

from true_on_policy.console import CONTRACT, LOGDIFF, PROBS_DIFF

# verl 0.9.1's v1 trainer (trainer/ppo/v1): marked_timer names, in the order a step runs them.
PHASES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
          "update_weights", "step")
PER_STEP = (("step_s", "timing_s/step", "{:.2f}"), ("gen", "timing_s/gen", "{:.2f}"),
            ("old_lp", "timing_s/old_log_prob", "{:.2f}"), ("ref", "timing_s/ref", "{:.2f}"),
            ("update", "timing_s/update_actor", "{:.2f}"), ("resp_len", "response_length/mean", "{:.0f}"),
            ("actor_mem_gb", "actor/perf/max_memory_reserved_gb", "{:.1f}"),
            ("logdiff_max", LOGDIFF, "{:.3e}"), ("contract", CONTRACT, "{:.0f}"),
            ("probs_diff_max", PROBS_DIFF, "{:.3e}"))


def read_steps(path) -> list[dict]:
    """The training steps' metrics of one file, in order (rows without timing_s/step, e.g. a
    validation pass, are not steps)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [{"step": r.get("step"), **r["data"]} for r in rows if "timing_s/step" in r.get("data", {})]


def phases(runs: dict) -> list[str]:
    """timing_s/* names present in any run: verl's order, then any other."""
    seen = {k[len("timing_s/"):] for steps in runs.values() for s in steps for k in s if k.startswith("timing_s/")}
    return [p for p in PHASES if p in seen] + sorted(seen - set(PHASES))


def mean_after_first(steps: list[dict], key: str):
    values = [s[key] for s in (steps[1:] or steps) if key in s]
    return sum(values) / len(values) if values else None


def is_plugin(steps: list[dict]) -> bool:
    return any(LOGDIFF in s for s in steps)


def summary(runs: dict, baseline: str = "stock") -> dict:
    """Per run: the mean of each phase after the first step and the exactness verdict; the
    ratio of each plugin run's mean step time to the baseline's."""
    out = {"phases": phases(runs), "runs": {}}
    for name, steps in runs.items():
        means = {p: mean_after_first(steps, f"timing_s/{p}") for p in out["phases"]}
        run = {"steps": len(steps), "mean_s": means, "plugin": is_plugin(steps)}
        if run["plugin"]:
            run["exact"] = bool(steps) and all(s.get(LOGDIFF) == 0.0 and s.get(CONTRACT) == 1.0 for s in steps)
        else:
            run["probs_diff_positive"] = bool(steps) and all(s.get(PROBS_DIFF, 0.0) > 0 for s in steps)
        out["runs"][name] = run
    base = out["runs"].get(baseline, {}).get("mean_s", {}).get("step")
    out["step_ratio"] = {name: run["mean_s"]["step"] / base for name, run in out["runs"].items()
                         if run["plugin"] and base and run["mean_s"].get("step")}
    return out


def _cell(value, fmt: str, width: int) -> str:
    return f"{fmt.format(value) if value is not None else '-':>{width}}"


def render(runs: dict, baseline: str = "stock") -> str:
    s = summary(runs, baseline)
    names, lines = list(runs), []
    width = max(10, *(len(n) for n in names))
    after = "steps 2+" if any(len(steps) > 1 for steps in runs.values()) else "step 1"
    vs = [n for n in names if s["runs"][n]["plugin"] and baseline in runs]   # ratio columns
    lines.append(f"{'phase (s, mean of ' + after + ')':<32}" + "".join(f" | {n:>{width}}" for n in names)
                 + "".join(f" | {n + '/' + baseline:>{width + 3}}" for n in vs))
    for p in s["phases"]:
        mean = {n: s["runs"][n]["mean_s"][p] for n in names}
        base = mean.get(baseline)
        lines.append(f"{p:<32}" + "".join(f" | {_cell(mean[n], '{:.2f}', width)}" for n in names) + "".join(
            f" | {_cell(mean[n] / base if mean[n] is not None and base else None, '{:.2f}x', width + 3)}"
            for n in vs))
    lines.append("")
    head = f"{'job':<{width}} | step" + "".join(f" | {c:>{max(len(c), 9)}}" for c, _, _ in PER_STEP)
    lines.append(head)
    for n in names:
        for st in runs[n]:
            lines.append(f"{n:<{width}} | {st['step']:>4}" + "".join(
                f" | {_cell(st.get(k), fmt, max(len(c), 9))}" for c, k, fmt in PER_STEP))
    lines.append("")
    for n, r in s["runs"].items():
        if r["plugin"]:
            verdict = "exact: logdiff_max 0 and contract_match 1 every step" if r["exact"] else "NOT exact"
        else:
            verdict = ("stock: rollout_probs_diff_max > 0 every step" if r["probs_diff_positive"]
                       else "stock: rollout_probs_diff_max 0 at some step")
        ratio = s["step_ratio"].get(n)
        lines.append(f"{n}: {r['steps']} step(s), {verdict}"
                     + (f"; step time {ratio:.2f}x {baseline}'s (mean of {after})" if ratio else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="NAME=METRICS.jsonl")
    p.add_argument("--baseline", default="stock", help="the run the plugin's step time is divided by")
    p.add_argument("--json", help="write the summary (and every run's steps) here")
    a = p.parse_args(argv)
    runs = {}
    for arg in a.runs:
        name, _, path = arg.partition("=")
        if not path or not Path(path).is_file():
            print(f"error: {arg}: give NAME=PATH of a metrics file", file=sys.stderr)
            return 2
        runs[name] = read_steps(path)
    print(render(runs, a.baseline))
    s = summary(runs, a.baseline)
    if a.json:
        Path(a.json).write_text(json.dumps({**s, "steps": runs}, indent=1))
    ok = all(r["steps"] for r in s["runs"].values()) and all(r["exact"] for r in s["runs"].values() if r["plugin"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
