"""The synthetic task's tool: a calculator, and the call format a tiny model can use.

Format ``true_on_policy_calculator`` (a verl tool parser, registered in every process that
imports verl): an assistant turn that ends with the token ``=`` is a call to the calculator
on the text before it — like a person writing "12+7=" and reading the result off — and
generation stops there (the parser's stop token). The calculator evaluates the last
integer expression of that text (``+ - *``) and answers with the number, or says it found
none. A turn that ends any other way (end of turn, length) calls nothing: the loop ends.

A tiny random model writes ``=`` about as often as any other of its ~1,000 tokens; one
built with ``make_tiny_model(call_token_prob=p)`` writes it with probability ~p at every
position, so verl's tool agent loop runs several assistant turns per sample.
"""
from __future__ import annotations

import re
from pathlib import Path

FORMAT = "true_on_policy_calculator"
CALL_TOKEN = "="
TOOL_FILE = Path(__file__).with_name("verl") / "calculator_tool.py"   # a verl function tool
_EXPRESSION = re.compile(r"(-?\d+(?:\s*[-+*]\s*-?\d+)+)\s*$")


def calculate(text: str) -> str:
    """The value of the trailing integer expression of ``text`` (``+ - *``, left to
    right with ``*`` first, as Python evaluates it), or a one-line refusal."""
    found = _EXPRESSION.search(text)
    if not found:
        return "no expression before '='"
    expression = re.sub(r"\s+", "", found.group(1))
    if len(expression) > 64:
        return "expression too long"
    return str(eval(expression, {"__builtins__": {}}))   # digits and + - * only (the regex)


def call_token_id(tokenizer) -> int:
    ids = tokenizer.encode(CALL_TOKEN, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{FORMAT}: {CALL_TOKEN!r} is not one token of this tokenizer ({ids})")
    return ids[0]


def register_parser(module) -> None:
    """verl's ``ToolParser`` registry (module: verl.experimental.agent_loop.tool_parser)."""
    if FORMAT in module.ToolParser._registry:
        return

    @module.ToolParser.register(FORMAT)
    class CalculatorCallParser(module.ToolParser):
        def __init__(self, tokenizer):
            super().__init__(tokenizer)
            self.call_id = call_token_id(tokenizer)

        @property
        def stop_token_ids(self):
            return [self.call_id]

        async def extract_tool_calls(self, responses_ids, tools=None):
            import json
            text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
            if not responses_ids or responses_ids[-1] != self.call_id:
                return text, []
            arguments = json.dumps({"expression": text[:-len(CALL_TOKEN)]})
            return text, [module.FunctionCall(name="calculator", arguments=arguments)]
