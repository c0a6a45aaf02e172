"""true_on_policy.task: the synthetic arithmetic task is deterministic, its ground truth is
right, its files are verl's RL parquet layout, and the rule-based reward parses answers.
(verl reading these files and loading the reward: tests/test_verl_cpu.py.)"""
import re

import pandas as pd
import pytest

from true_on_policy import task


def test_rows_are_deterministic_per_seed_and_split():
    rows = task.make_rows(50, seed=3, split="train")
    assert rows == task.make_rows(50, seed=3, split="train")
    assert rows != task.make_rows(50, seed=4, split="train")
    assert rows != task.make_rows(50, seed=3, split="val")


def test_ground_truth_is_the_value_of_the_question():
    for row in task.make_rows(200, seed=0, split="train", max_operand=30, ops="+-*"):
        a, op, b = re.fullmatch(r"What is (\d+)([+*-])(\d+)\?", row["extra_info"]["question"]).groups()
        assert int(row["reward_model"]["ground_truth"]) == task.OPS[op](int(a), int(b))
        assert max(int(a), int(b)) <= 30


def test_row_layout_is_verl_rl_dataset():
    row = task.make_rows(1, seed=0, split="val")[0]
    assert row["data_source"] == task.DATA_SOURCE
    assert [m["role"] for m in row["prompt"]] == ["user"]
    assert row["prompt"][0]["content"].startswith(row["extra_info"]["question"])
    assert row["reward_model"]["style"] == "rule" and isinstance(row["reward_model"]["ground_truth"], str)
    assert row["extra_info"]["split"] == "val" and row["extra_info"]["index"] == 0


@pytest.mark.parametrize("kwargs", [dict(ops=""), dict(ops="+/"), dict(max_operand=-1)])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError, match="task:"):
        task.make_rows(1, seed=0, split="train", **kwargs)


def test_files_are_written_once_and_read_back(tmp_path):
    train, val = task.ensure_task_data(tmp_path, seed=1, train_size=16, val_size=4)
    stamp = train.stat().st_mtime_ns
    assert task.ensure_task_data(tmp_path, seed=1, train_size=16, val_size=4) == (train, val)
    assert train.stat().st_mtime_ns == stamp  # cached, not rewritten
    df = pd.read_parquet(train)
    assert len(df) == 16 and len(pd.read_parquet(val)) == 4
    assert df.iloc[0]["reward_model"]["ground_truth"] == task.make_rows(1, 1, "train")[0]["reward_model"]["ground_truth"]
    assert task.ensure_task_data(tmp_path, seed=2, train_size=16, val_size=4)[0] != train
    assert not [p for p in train.parent.iterdir() if p.name.startswith(".")]  # no temp files left


@pytest.mark.parametrize("text, answer", [
    ("#### 19", "19"), ("12+7=19", "19"), ("so 3 then #### -4", "-4"),
    ("The answer is \\boxed{42}.", "42"), ("the answer is: 007", "7"),
    ("#### 5 ... #### 6", "6"), ("12 and 13 \\boxed{1}", "1"), ("no digits here", None), ("", None),
])
def test_extract_answer(text, answer):
    assert task.extract_answer(text) == answer


def test_compute_score_rules():
    score = lambda text, gt="19": task.compute_score(task.DATA_SOURCE, text, gt)  # noqa: E731
    assert score("12+7=19") == 1.0
    assert score("#### 019") == 1.0
    assert score("#### 18") == 0.1      # a number, the wrong one: format credit
    assert score("nineteen") == 0.0     # no number at all
    assert score("-3", gt="-3") == 1.0
    assert task.compute_score(task.DATA_SOURCE, "#### 18", "19", format_score=0.0) == 0.0
