"""The conversation of an OpenAI chat request: its messages (with an assistant's tool calls and a tool's answers,
in the history), the tools it declares, and a named tool_choice; what the chat template receives."""

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # the schema binds when the output is constrained (tool_choice), as vLLM


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back in the history


class MessageToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls, in the history
    tool_call_id: str | None = Field(None, validate_default=True)  # a tool's answer: to which call
    reasoning_content: str | None = None  # an assistant's reasoning, in the history

    @field_validator("role", mode="before")
    @classmethod
    def _function_role(cls, value):
        if value == "function":
            raise ValueError("role 'function' (OpenAI's deprecated function messages) is not supported by this "
                             "server yet; send a function's result as a 'tool' message with tool_call_id")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, value, info: ValidationInfo):
        """A tool's message says which call it answers (OpenAI requires it)."""
        if value is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs tool_call_id: the id of the call it answers")
        return value

    @field_validator("content")
    @classmethod
    def _content(cls, value, info: ValidationInfo):
        """Only an assistant's message may go without content (OpenAI's rule: its tool calls say it all)."""
        if value is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"a {info.data['role']} message needs content")
        return value

    def template_dict(self) -> dict:
        """The message as the chat template wants it: content as one string, the other fields only if given."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        for name in ("name", "tool_call_id", "reasoning_content"):
            if (value := getattr(self, name)) is not None:
                message[name] = value
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        return message


def _template_call(call: MessageToolCall) -> dict:
    """A history's tool call as chat templates take it (transformers' convention, vLLM's too): its arguments as the
    object that OpenAI's JSON text holds (Qwen3.5's template iterates them), the text itself when it holds none."""
    dumped = call.model_dump()
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        return dumped
    if isinstance(arguments, dict):
        dumped["function"]["arguments"] = arguments
    return dumped


# What a chat template's own variables are: chat_template_kwargs may not replace them.
TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template",
                      "continue_final_message", "return_dict")
