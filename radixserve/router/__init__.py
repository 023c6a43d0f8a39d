"""A cache-aware router in front of several radixserve servers (data parallelism): `radixserve route --worker URL ...`.

It speaks the workers' API (OpenAI and native), keeps an approximate radix tree of the prompt text sent to each
worker, and sends a request where its prefix probably is cached unless that worker is overloaded. See docs/router.md.
"""
