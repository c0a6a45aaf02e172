"""A synthetic verifiable task, generated in code: small integer arithmetic.

Prompts like "What is 12+7?" are written as verl RL parquet files (the layout of verl's
gsm8k preprocessing: chat-format ``prompt``, ``data_source``, ``ability``,
``reward_model.ground_truth``, ``extra_info``) into a cache directory, deterministic
from a seed; ``compute_score`` is the rule-based reward, used as verl's custom reward
function::

    reward.custom_reward_function.path=pkg://true_on_policy.task
    reward.custom_reward_function.name=compute_score

No hub, no download: the recipe's default run needs nothing but this file.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import tempfile
from pathlib import Path

DATA_SOURCE = "true_on_policy/arithmetic"
FORMAT_VERSION = 1  # bump when the rows change: part of the cache key
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
INSTRUCTION = "Put the final answer after ####."


# ----------------------------------------------------------------------------- data
def make_rows(n: int, seed: int, split: str, max_operand: int = 20, ops: str = "+-") -> list[dict]:
    """``n`` rows in verl's RL dataset layout; the same arguments give the same rows."""
    if not ops or set(ops) - set(OPS):
        raise ValueError(f"task: ops {ops!r} must be a non-empty subset of {''.join(OPS)!r}")
    if max_operand < 0:
        raise ValueError(f"task: max_operand must be >= 0, got {max_operand}")
    rng = random.Random(f"{seed}-{split}")  # str seeds hash deterministically (no PYTHONHASHSEED)
    rows = []
    for index in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        question = f"What is {a}{op}{b}?"
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(OPS[op](a, b))},
            "extra_info": {"split": split, "index": index, "question": question},
        })
    return rows


def write_parquet(rows: list[dict], path) -> Path:
    """Write rows atomically (temp file + rename): a crash never leaves half a file."""
    import pandas as pd
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        pd.DataFrame(rows).to_parquet(tmp, index=False)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def ensure_task_data(cache_dir, seed: int = 0, train_size: int = 256, val_size: int = 32,
                     max_operand: int = 20, ops: str = "+-") -> tuple[Path, Path]:
    """(train.parquet, val.parquet) under ``cache_dir``, written on first use."""
    args = dict(seed=seed, train_size=train_size, val_size=val_size, max_operand=max_operand,
                ops=ops, format=FORMAT_VERSION)
    key = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(cache_dir).expanduser().resolve() / f"arithmetic-{key}"
    paths = []
    for split, n in (("train", train_size), ("val", val_size)):
        path = out / f"{split}.parquet"
        if not path.is_file():
            write_parquet(make_rows(n, seed, split, max_operand, ops), path)
        paths.append(path)
    return paths[0], paths[1]


# ----------------------------------------------------------------------------- reward
_INT = r"-?\d+"
_MARKERS = (re.compile(rf"####\s*({_INT})"), re.compile(rf"\\boxed\{{\s*({_INT})\s*\}}"),
            re.compile(rf"answer is\s*:?\s*({_INT})", re.IGNORECASE))


def extract_answer(text: str) -> str | None:
    """The integer the response commits to: after ``####``, in ``\\boxed{}`` or after
    "answer is" (last match of the first marker found), else the last integer; None if
    the text has no integer. Leading zeros are dropped ("007" -> "7")."""
    for marker in _MARKERS:
        found = marker.findall(text)
        if found:
            return str(int(found[-1]))
    found = re.findall(_INT, text)
    return str(int(found[-1])) if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None,
                  format_score: float = 0.1, score: float = 1.0, **kwargs) -> float:
    """verl custom reward: ``score`` for the right integer, ``format_score`` for a wrong
    one, 0 for a response with no integer. The small credit for answering with a number
    keeps GRPO advantages non-zero while a tiny random model is still far from right."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    return score if answer == str(int(ground_truth)) else format_score
