"""tool_choice required or naming a function: the JSON schema the output is constrained to.

As vLLM and SGLang do it: a named function's output is its arguments (the function's `parameters` schema);
`required` is an array of {"name": one of the tools, "parameters": that tool's arguments}, one item at most
without parallel_tool_calls. The grammar makes the output parse, whatever the model's own format.
"""

import json

ANY_OBJECT = {"type": "object"}


def arguments_schema(parameters: dict | None) -> dict:
    return parameters if parameters else ANY_OBJECT


def required_calls_schema(functions: dict[str, dict | None], parallel: bool) -> str:
    """`functions`: each tool's name -> its parameters schema."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                "parameters": arguments_schema(parameters)},
              "required": ["name", "parameters"]}
             for name, parameters in functions.items()]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def named_call_schema(parameters: dict | None) -> str:
    return json.dumps(arguments_schema(parameters))
