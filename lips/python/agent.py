"""agent, in Python: a tool-using agent whose every action is valid by construction, like
agent.c. Each step the model writes one JSON action under a grammar: {"tool": "calculator" or
"docs", "input": ...} or {"answer": ...}; a tool's output goes back into the same KV file as an
observation, an answer ends the run.
Usage: agent [QUESTION] [MAX_STEPS]"""
import json

import symphony
from symphony import Grammar, Kv, Sampler

MAX_ACTION_TOKENS = 120
ACTION_SCHEMA = json.dumps({"anyOf": [
    {"type": "object", "additionalProperties": False, "required": ["tool", "input"],
     "properties": {"tool": {"enum": ["calculator", "docs"]}, "input": {"type": "string", "maxLength": 60}}},
    {"type": "object", "additionalProperties": False, "required": ["answer"],
     "properties": {"answer": {"type": "string", "maxLength": 200}}}]})
INSTRUCTIONS = ('Answer the question. Each step, write one JSON action: {"tool": "calculator", "input": '
                '"an arithmetic expression"}, {"tool": "docs", "input": "a topic"}, or {"answer": "the final answer"}.')


def main(args: list[str]) -> int:
    question = args[0] if args else "What is 12 times 7?"
    max_steps = int(args[1]) if len(args) > 1 else 4
    try:
        prompt = symphony.chat_template([("system", INSTRUCTIONS), ("user", question)])
    except symphony.Unsupported:  # a model without a chat template: plain text
        prompt = f"{INSTRUCTIONS}\nQuestion: {question}\n"
    ids = symphony.tokenize(prompt)
    eos = set(symphony.eos_ids())
    pristine = Grammar.json_schema(ACTION_SCHEMA)
    with Kv.create() as kv:
        if len(ids) > 1:
            kv.next_token(ids[:-1])  # the prompt's KV; its last token comes with the first draw
        last = ids[-1]
        for _ in range(max_steps):
            grammar = pristine.fork()
            sampler = Sampler(temperature=0.0, grammar=grammar)
            action: list[int] = []
            token = last
            while len(action) < MAX_ACTION_TOKENS:
                token = kv.next_token([token], sampler)
                if token in eos:
                    break
                action.append(token)
                if grammar.must_end:
                    break
            grammar.close()
            if not action:
                symphony.send("no answer: the model ended\n")
                return 0
            text = symphony.detokenize(action)
            symphony.send(f"action: {text}\n")
            last = action[-1]
            try:
                value = json.loads(text)
            except ValueError:
                symphony.send("no answer: the action was cut short\n")
                return 0
            if "answer" in value:
                symphony.send(f"answer: {value['answer']}\n")
                return 0
            try:
                output = symphony.tool(value["tool"], value["input"])
            except symphony.SymphonyError as error:
                output = f"error {error.code}"
            symphony.send(f"observation: {output}\n")
            observation = symphony.tokenize(f"\nObservation: {output}\n")
            if observation:
                kv.next_token([last] + observation[:-1])
                last = observation[-1]
    symphony.send("no answer\n")
    return 0


WitWorld = symphony.program(main)
