"""The synthetic task's calculator tool and its call format (true_on_policy.tool_calls), through
verl's own tool-parser registry and function-tool loader; the tiny model built to call it."""
import asyncio
import json

import pytest
import torch

from true_on_policy import tool_calls


@pytest.mark.parametrize("text, value", [("so 12+7", "19"), ("x 3 * 4 - 5 ", "7"), ("-2+-3", "-5"),
                                         ("no numbers", "no expression before '='"), ("7", "no expression before '='")])
def test_calculate(text, value):
    assert tool_calls.calculate(text) == value


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from true_on_policy.make_tiny_model import ensure_tiny_model
    model = ensure_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_moe", hidden_size=64, num_layers=1, head_dim=16)
    return AutoTokenizer.from_pretrained(model)


def test_parser_is_registered_in_verl_and_calls_on_the_stop_token(tokenizer):
    """Registered by the verl plugin (register.py) on import of verl's tool_parser: a turn that
    ends with "=" (the parser's stop token) calls the calculator on the text before it."""
    from verl.experimental.agent_loop.tool_parser import ToolParser
    parser = ToolParser.get_tool_parser(tool_calls.FORMAT, tokenizer)
    call = tool_calls.call_token_id(tokenizer)
    assert parser.stop_token_ids == [call]
    ids = tokenizer.encode("so 12+7=", add_special_tokens=False)
    assert ids[-1] == call
    _, calls = asyncio.run(parser.extract_tool_calls(ids))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("calculator", {"expression": "so 12+7"})]
    _, none = asyncio.run(parser.extract_tool_calls(tokenizer.encode("#### 19", add_special_tokens=False)))
    assert none == []


def test_calculator_loads_as_a_verl_function_tool():
    from verl.tools.tool_registry import load_all_tools
    (tool,) = load_all_tools(None, str(tool_calls.TOOL_FILE))
    assert tool.name == "calculator" and "expression" in tool.tool_schema.function.parameters.properties
    assert asyncio.run(tool.call({"expression": "so 12+7"})) == "19"


def test_tiny_model_built_to_call(tmp_path):
    """call_token_prob: "=" is far likelier than under a plain random model (~1/1000) at every
    position; 0 (the default) leaves the model, and its cache key, as before."""
    from transformers import AutoTokenizer

    from true_on_policy.make_tiny_model import cache_key, ensure_tiny_model
    from true_on_policy.models import ConsistentForCausalLM
    sizes = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, moe_intermediate_size=64)
    assert cache_key("qwen3_moe", **sizes) == cache_key("qwen3_moe", call_token_prob=0.0, **sizes)
    model_dir = ensure_tiny_model(tmp_path, "qwen3_moe", call_token_prob=0.5, **sizes)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = ConsistentForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, len(tok), (48,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.forward_packed(ids, torch.arange(len(ids))).float()
    p = torch.softmax(logits[:, :len(tok)], -1)[:, tool_calls.call_token_id(tok)]
    assert float(p.min()) > 0.02, p
