"""benchmarks/verl_step_table.py (scripts/gpu_verl_suite.sh's side-by-side table) on fake metrics
files written as verl's file logger writes them: phases, means after the first step, the step-time
ratio, the exactness verdict and its exit status."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("verl_step_table", ROOT / "benchmarks" / "verl_step_table.py")
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)


def _write(path, steps, plugin=True, logdiff=0.0):
    """steps: (gen, old_log_prob, ref, update_actor) seconds per step."""
    with open(path, "w") as f:
        f.write(json.dumps({"step": 0, "data": {"val-core/acc": 0.0}}) + "\n")   # a validation row: no step
        for i, (gen, old, ref, update) in enumerate(steps, 1):
            d = {"timing_s/gen": gen, "timing_s/old_log_prob": old, "timing_s/ref": ref,
                 "timing_s/update_actor": update, "timing_s/step": gen + old + ref + update,
                 "training/rollout_probs_diff_max": 0.0 if plugin else 0.25}
            if plugin:
                d.update({"true_on_policy/logdiff_max": logdiff, "true_on_policy/contract_match": 1.0})
            f.write(json.dumps({"step": i, "data": d}) + "\n")
    return path


def test_side_by_side_means_after_the_first_step_and_the_ratio(tmp_path, capsys):
    plugin = _write(tmp_path / "p.jsonl", [(30, 3, 2, 8), (12, 2, 1, 5), (14, 2, 1, 5)])
    stock = _write(tmp_path / "s.jsonl", [(40, 4, 3, 9), (10, 2, 1, 5), (10, 2, 1, 5)], plugin=False)
    out = tmp_path / "t.json"
    assert table.main([f"plugin={plugin}", f"stock={stock}", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["phases"] == ["gen", "old_log_prob", "ref", "update_actor", "step"]
    assert s["runs"]["plugin"]["mean_s"]["gen"] == 13.0 and s["runs"]["stock"]["mean_s"]["step"] == 18.0
    assert s["step_ratio"] == {"plugin": 21.0 / 18.0} and s["runs"]["plugin"]["exact"]
    assert s["runs"]["stock"]["probs_diff_positive"] and len(s["steps"]["stock"]) == 3
    printed = capsys.readouterr().out
    assert "plugin/stock" in printed and "1.30x" in printed          # gen: 13 / 10
    assert "step time 1.17x stock's (mean of steps 2+)" in printed


def test_a_plugin_step_off_by_any_bit_fails(tmp_path, capsys):
    plugin = _write(tmp_path / "p.jsonl", [(1, 1, 1, 1), (1, 1, 1, 1)], logdiff=2 ** -20)
    assert table.main([f"plugin={plugin}"]) == 1
    assert "plugin: 2 step(s), NOT exact" in capsys.readouterr().out


def test_a_job_without_steps_fails_and_a_missing_file_is_named(tmp_path, capsys):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    assert table.main([f"stock={empty}"]) == 1
    assert table.main([f"stock={tmp_path / 'none.jsonl'}"]) == 2
    assert "give NAME=PATH of a metrics file" in capsys.readouterr().err
