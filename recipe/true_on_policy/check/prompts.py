"""Prompts for ``true_on_policy.check``: deterministic, varied in length, sharing prefixes.

Three long shared prefixes (several KV pages each) make prefix-cache hits happen
when caching is on; a per-prompt question plus a random tail of 0..60 words makes
lengths vary so that a small --max-num-batched-tokens splits prompts into chunks.
"""
import random

WORDS = ("the of and to in is it that for on with as was at by this be are from or have an they which "
         "number sum total equal plus minus times answer question step think compute result apples books "
         "coins left gives buys sells first second each more how many").split()
PREFIXES = (
    "You are a careful math tutor. Read the question, think step by step, show each intermediate "
    "result on its own line, and finish with the final answer after four hash marks. ",
    "Solve the arithmetic problem below. Explain how many items are left after each step, check the "
    "result twice, and write only the number at the end. The answer is always an integer. ",
    "Question and answer practice: each question asks for a sum, a difference or a product of two "
    "numbers. Think about the first number, then the second, then compute the result. ",
)


def make_prompts(tokenizer, n, seed):
    """n lists of token ids."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 60)))
        text = PREFIXES[i % len(PREFIXES)] * 2 + f"Question: What is {a}{op}{b}? {tail} Answer:"
        prompts.append(tokenizer(text)["input_ids"])
    return prompts
