"""Content negotiation: which of the response's media types an Accept header prefers (RFC 9110 12.5.1)."""

DEFAULT = "application/json"


def _rank(accept: str, media_type: str) -> tuple[float, int]:
    """(q, specificity) of the most specific Accept range that matches `media_type`; (0, -1) when none does."""
    kind = media_type.split("/")[0]
    best = (0.0, -1)
    for entry in accept.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        specificity = {media_type: 2, f"{kind}/*": 1, "*/*": 0}.get(name.lower())
        if specificity is None or specificity < best[1]:
            continue
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = min(max(float(value), 0.0), 1.0)
                except ValueError:
                    q = 0.0  # a q that does not parse accepts nothing
        if specificity > best[1] or q > best[0]:
            best = (q, specificity)
    return best


def prefers(accept: str | None, media_type: str) -> bool:
    """Whether the client asks for `media_type` rather than JSON: it accepts it (q > 0), at a higher q than
    JSON or at the same q by name while JSON only by a wildcard. No Accept header: JSON."""
    if not accept:
        return False
    wanted = _rank(accept, media_type)
    return wanted[0] > 0 and wanted > _rank(accept, DEFAULT)
