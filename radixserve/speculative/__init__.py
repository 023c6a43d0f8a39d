"""Speculative decoding with no draft model: n-gram drafts from the request's own tokens and from the radix tree."""
