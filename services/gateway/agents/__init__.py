"""What agents need from a chat turn: tool calls and reasoning parsed out of the model's text."""
