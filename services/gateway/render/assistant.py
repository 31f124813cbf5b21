"""OpenAI's shapes of an assistant turn (agents/turn.py): the unary `message` and the streamed `delta`."""

from services.gateway.agents.turn import CallDelta, TurnPiece


def _call(first: CallDelta) -> dict:
    """A call as its first fragment has it (OpenAI's tool_calls[] entry, without its stream index)."""
    return {"id": first.id, "type": "function", "function": {"name": first.name, "arguments": first.arguments}}


def _calls(deltas: list[CallDelta]) -> list[dict]:
    """Each call whole: its fragments joined."""
    calls: dict[int, dict] = {}
    for piece in deltas:
        if piece.id is not None:
            calls[piece.index] = _call(piece)
        else:
            calls[piece.index]["function"]["arguments"] += piece.arguments
    return [calls[index] for index in sorted(calls)]


def message(turn: TurnPiece, with_reasoning: bool) -> dict:
    """The whole turn; content null when the turn is only tool calls (as OpenAI) or only reasoning (as SGLang)."""
    out: dict = {"role": "assistant",
                 "content": turn.content if turn.content or not (turn.calls or turn.reasoning) else None}
    if with_reasoning:
        out["reasoning_content"] = turn.reasoning or None
    if turn.calls:
        out["tool_calls"] = _calls(turn.calls)
    return out


def _call_delta(piece: CallDelta) -> dict:
    """A call's first fragment: index, id, type, name and arguments so far; the next: index and more arguments
    (as OpenAI streams them)."""
    if piece.id is None:
        return {"index": piece.index, "function": {"arguments": piece.arguments}}
    return {"index": piece.index, **_call(piece)}


def delta(piece: TurnPiece) -> dict:
    """One stream chunk's part of the turn."""
    out: dict = {}
    if piece.reasoning:
        out["reasoning_content"] = piece.reasoning
    if piece.content or not (piece.reasoning or piece.calls):
        out["content"] = piece.content
    if piece.calls:
        out["tool_calls"] = [_call_delta(call) for call in piece.calls]
    return out


def is_empty(piece: TurnPiece) -> bool:
    return not (piece.reasoning or piece.content or piece.calls)
