"""OpenAI's function calling for any model: the tools shown to the model (through its chat
template when the template shows tools, else in a system message), the answer held to a call by a
grammar (`tool_choice` "required" or a named function) or left to the model (`auto`: a call or
text, the grammar allowing both), and the call parsed back into `tool_calls`.

A call is the JSON object {"name": <a function's name>, "arguments": <its parameters>}: with a
grammar, its arguments are valid against the function's parameters schema by construction.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..engine.grammar import GrammarKind

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
# How a model whose chat template does not show tools learns of them.
TOOLS_PROMPT = ('Functions you can call:\n{tools}\nTo call one, answer only {{"name": ..., "arguments": {{...}}}}.')


class ToolError(ValueError):
    """A 400: `param` names what is wrong."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    functions: dict[str, dict]  # name -> {"name", "description", "parameters"}
    grammar: tuple[int, str]  # (kind, source) the answer keeps to
    forced: bool  # a call is required (tool_choice "required" or a named function)

    @property
    def tools(self) -> list[dict]:
        """The functions as OpenAI's `tools` (what a chat template with tools takes)."""
        return [{"type": "function", "function": function} for function in self.functions.values()]


def plan_tools(tools: list | None, tool_choice) -> ToolPlan | None:
    """What a chat request's `tools` and `tool_choice` ask for; None when no tool may be called."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if not tools:
        if tool_choice not in ("none", "auto"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"tools is a list of at most {MAX_TOOLS} functions", "tools")
    functions: dict[str, dict] = {}
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not TOOL_NAME.match(function["name"]):
            raise ToolError("each tool is {\"type\": \"function\", \"function\": {\"name\": a-z, A-Z, 0-9, _ or -, "
                            "at most 64}}", f"tools.{index}")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError("a function's parameters are a JSON schema object", f"tools.{index}.function.parameters")
        if function["name"] in functions:
            raise ToolError(f"two tools are named {function['name']!r}", f"tools.{index}")
        functions[function["name"]] = {"name": function["name"], "description": str(function.get("description", "")),
                                       "parameters": parameters}
    if tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if name not in functions:
            raise ToolError("tool_choice names a function that is not among the tools", "tool_choice")
        callable_ = [name]
    elif tool_choice in ("auto", "required"):
        callable_ = list(functions)
    else:
        raise ToolError('tool_choice is "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                        "tool_choice")
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": name}, "arguments": functions[name]["parameters"]}}
             for name in callable_]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    forced = tool_choice != "auto"
    if forced:
        grammar = (GrammarKind.JSON_SCHEMA, json.dumps(schema))
    else:  # a call, or text that does not start like one
        grammar = (GrammarKind.LARK, "start: call | text\n"
                                     f"call: %json {json.dumps(schema)}\n"
                                     "text: TEXT\nTEXT: /[^{\\s](.|\\n)*/\n")
    return ToolPlan(functions, grammar, forced)


def tools_prompt(plan: ToolPlan) -> str:
    """The tools as a system message tells them (compact JSON, one line a function)."""
    lines = [json.dumps({key: value for key, value in function.items() if value != ""}, separators=(",", ":"))
             for function in plan.functions.values()]
    return TOOLS_PROMPT.format(tools="\n".join(lines))


def parse_call(text: str, plan: ToolPlan) -> dict | None:
    """The tool call an answer makes, as OpenAI's `tool_calls` entry; None when it is text (or
    a call cut short by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(value, dict) and set(value) == {"name", "arguments"} and value["name"] in plan.functions
            and isinstance(value["arguments"], dict)):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(value["arguments"])}}
