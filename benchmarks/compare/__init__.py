"""Side-by-side benchmarks of radixserve (radix cache on and off), llama.cpp's llama-server and transformers, each
served on 127.0.0.1 and driven by one replay client: multi-turn chat, shared-prefix RAG, DSL forks, no sharing, and a
decode/prefill micro-benchmark. Entry point: `python -m benchmarks.compare` (see __main__.py)."""
