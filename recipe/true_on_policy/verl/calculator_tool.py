"""The calculator as a verl function tool (``multi_turn.function_tool_path`` names this file;
the recipe fills it in for the ``true_on_policy_calculator`` format)."""
from verl.tools.function_tool import function_tool

from true_on_policy.tool_calls import calculate


@function_tool
def calculator(expression: str) -> str:
    """Evaluate the last integer expression (+, -, *) of a text.

    Args:
        expression: text ending with an integer expression, e.g. "so 12+7".
    """
    return calculate(expression)
