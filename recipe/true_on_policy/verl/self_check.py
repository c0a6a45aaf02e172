"""Startup self-check: before step 1, probe sequences through both engines.

Runs ``python -m true_on_policy.check`` with the job's model, rollout TP, temperature,
top-k / top-p, batching and prefix caching (a vLLM engine with the plugin, then the
trainer's model in another process) and stops the job with the check's report unless
every probe token's log-prob is bitwise equal. ``true_on_policy.self_check.enable=false`` skips it.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

DEFAULTS = {"enable": True, "prompts": 4, "max_tokens": 16}


class SelfCheckFailed(RuntimeError):
    pass


def command(cfg, settings, json_path):
    ro = cfg.actor_rollout_ref.rollout
    cmd = [sys.executable, "-m", "true_on_policy.check", "--model", str(cfg.actor_rollout_ref.model.path),
           "--tp", str(int(ro.get("tensor_model_parallel_size", 1) or 1)),
           "--temperature", str(float(ro.get("temperature", 1.0))),
           "--top-k", str(int(ro.get("top_k", -1) or 0)), "--top-p", str(float(ro.get("top_p", 1.0) or 1.0)),
           "--max-num-batched-tokens", str(int(ro.get("max_num_batched_tokens", 2048) or 2048)),
           "--prompts", str(settings["prompts"]), "--max-tokens", str(settings["max_tokens"]),
           "--json", str(json_path)]
    return cmd + (["--enable-prefix-caching"] if ro.get("enable_prefix_caching", False) else [])


def run(cfg):
    """Raise SelfCheckFailed (with the check's output) unless the probe is exact."""
    section = OmegaConf.select(cfg, "true_on_policy.self_check", default=None) or {}
    if OmegaConf.is_config(section):
        section = OmegaConf.to_container(section)
    settings = {**DEFAULTS, **section}
    if not settings["enable"]:
        return None
    with tempfile.TemporaryDirectory(prefix="true-on-policy-self-check-") as tmp:
        json_path = Path(tmp) / "summary.json"
        print("[true_on_policy] startup self-check: probing rollout and trainer log-probs", flush=True)
        proc = subprocess.run(command(cfg, settings, json_path), capture_output=True, text=True)
        summary = json.loads(json_path.read_text()) if json_path.is_file() else None
    if proc.returncode != 0 or summary is None:
        raise SelfCheckFailed("true_on_policy startup self-check failed (rollout and trainer log-probs are not "
                              "bitwise equal on probe sequences); its output:\n" + (proc.stdout + proc.stderr)[-6000:])
    print(f"[true_on_policy] self-check exact: {summary['num_tokens']} probe tokens, max |d| = "
          f"{summary['max_abs_logdiff']}", flush=True)
    return summary
