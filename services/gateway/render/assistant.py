"""OpenAI's shapes of an assistant turn (agents/turn.py): the unary `message` and the streamed `delta`."""

from services.gateway.agents.turn import NumberedCall, TurnPiece


def _call(numbered: NumberedCall) -> dict:
    return {"id": numbered.id, "type": "function",
            "function": {"name": numbered.call.name, "arguments": numbered.call.arguments}}


def message(turn: TurnPiece, with_reasoning: bool) -> dict:
    """The whole turn; content null when the turn is only tool calls (as OpenAI)."""
    out: dict = {"role": "assistant", "content": turn.content if turn.content or not turn.calls else None}
    if with_reasoning:
        out["reasoning_content"] = turn.reasoning or None
    if turn.calls:
        out["tool_calls"] = [_call(numbered) for numbered in turn.calls]
    return out


def delta(piece: TurnPiece) -> dict:
    """One stream chunk's part of the turn. A complete call travels in one entry (id, name and all its
    arguments), which OpenAI's clients merge as they merge its fragments."""
    out: dict = {}
    if piece.reasoning:
        out["reasoning_content"] = piece.reasoning
    if piece.content or not (piece.reasoning or piece.calls):
        out["content"] = piece.content
    if piece.calls:
        out["tool_calls"] = [{"index": numbered.index, **_call(numbered)} for numbered in piece.calls]
    return out


def is_empty(piece: TurnPiece) -> bool:
    return not (piece.reasoning or piece.content or piece.calls)
