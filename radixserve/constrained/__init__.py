"""Constrained decoding: grammars (regex, JSON schema, EBNF) compiled through llguidance, one matcher per request,
and the per-step token bitmask applied to the logits of constrained rows before sampling."""
