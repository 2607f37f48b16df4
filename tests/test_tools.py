"""Operator tools (symphony_os/lip/tools.py): the calculator computes arithmetic and nothing else."""
import re

import pytest

from symphony_os.errors import InvalidArgument, Unsupported
from symphony_os.lip.tools import DOCS, calculator, default_tools


@pytest.mark.parametrize("expression, result", [("2+3*4", "14"), ("(1+2)/4", "0.75"), ("2**10", "1024"),
                                                ("7//2", "3"), ("-3%5", "2"), ("6/3", "2")])
def test_calculator_does_arithmetic(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize("expression", ["__import__('os')", "a+1", "(1).real", "[1]*9", "9**9**9",
                                        "((9**64)**64)**64", "1/0", "1e308*10", "True+1", "'a'*3",
                                        "-" * 4000 + "1", "(" * 2000 + "1" + ")" * 2000, "(-8)**0.5",
                                        "(-8)**0.5 % 2", "(-8)**(1/3)", "1" + "0" * 400, "1\x00", "9" * 5000])
def test_calculator_refuses_everything_else(expression):
    with pytest.raises(InvalidArgument):
        calculator(expression)


@pytest.mark.parametrize("expression, message", [("2**65", "exponents are limited to 64"),
                                                 ("x", "only numbers and"), ("(-8)**(1/3)", "not a real number")])
def test_calculator_says_why_it_refuses(expression, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        calculator(expression)


def test_registry_calls_only_registered_tools():
    tools = default_tools()
    assert tools.call("docs", "CAT") == DOCS["cat"]
    with pytest.raises(Unsupported):
        tools.call("shell", "ls")
    assert list(tools.calls) == [("docs", "CAT")]


def test_a_tool_that_breaks_gets_internal_and_one_logged_traceback(tiny_engine, caplog):
    import struct

    from guests import wat

    from symphony_os.errors import ErrorCode
    from symphony_os.lip.runtime import Runtime
    from symphony_os.lip.tools import ToolRegistry

    def broken(text: str) -> str:
        raise RuntimeError("the tool's backend is down")

    module = wat("""(module
      (import "symphony" "tool" (func $tool (param i32 i32 i32 i32 i32 i32) (result i32)))
      (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") 1)
      (data (i32.const 16) "broken")
      (func (export "_start") (local $i i32)
        (loop $again
          (i32.store (i32.const 0) (call $tool (i32.const 16) (i32.const 6) (i32.const 16) (i32.const 1)
                                              (i32.const 32) (i32.const 16)))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $again (i32.lt_s (local.get $i) (i32.const 50))))
        (drop (call $send (i32.const 0) (i32.const 4)))))""")
    with Runtime(tiny_engine, tools=ToolRegistry({"broken": broken})) as runtime:
        out = []
        process = runtime.spawn(runtime.load(module, "loop"), on_output=out.append)
        assert runtime.wait(process, 60) == 0, process.end_reason
    assert struct.unpack("<i", b"".join(out)) == (ErrorCode.INTERNAL,)
    tracebacks = [r for r in caplog.records if r.name == "symphony.syscalls" and r.exc_info]
    assert len(tracebacks) == 1
