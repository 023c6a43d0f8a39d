"""benchmarks/llama_perplexity.read_base decodes llama-perplexity's `--kl-divergence-base` file: a file written here
the way perplexity.cpp writes it (its log_softmax coding ported), decoded back to each scored token's log-prob."""

import numpy as np

from benchmarks.llama_perplexity import read_base


def _coded_row(logits: np.ndarray) -> np.ndarray:
    """perplexity.cpp's log_softmax(n_vocab, logits, log_prob, tok): two floats, then one uint16 per vocab entry."""
    mx = np.float32(logits.max())
    mn = np.float32(max(logits.min(), mx - 16))
    lse = np.float32(np.log(np.exp((logits - mx).astype(np.float64)).sum()))
    scale = np.float32((mx - mn) / np.float32(65535))
    codes = np.where(logits > mn, np.rint((logits - mn) / scale), 0).astype(np.uint16)
    head = np.array([scale, mn - mx - lse], dtype=np.float32).view(np.uint16)
    pad = np.zeros(2 * ((len(logits) + 1) // 2) - len(logits), dtype=np.uint16)
    return np.concatenate([head, codes, pad])


def test_read_base_decodes_the_scored_tokens(tmp_path):
    rng = np.random.default_rng(0)
    ctx, vocab, chunks = 8, 5, 2
    per, first = ctx - ctx // 2 - 1, ctx // 2
    tokens = rng.integers(0, vocab, chunks * ctx).astype(np.int32)
    logits = rng.normal(0, 3, (chunks, per, vocab)).astype(np.float32)
    logits[1, 2, tokens[ctx + first + 3]] = logits[1, 2].max() - 30  # below the file's floor: unknown
    rows = [_coded_row(logits[c, i]) for c in range(chunks) for i in range(per)]
    path = tmp_path / "base.bin"
    path.write_bytes(b"_logits_" + np.array([ctx, vocab, chunks], np.int32).tobytes() + tokens.tobytes())
    with open(path, "ab") as f:
        f.write(np.concatenate(rows).tobytes())
    got_tokens, lp = read_base(path, per)
    assert np.array_equal(got_tokens, tokens)
    for c in range(chunks):
        exact = logits[c].astype(np.float64)
        exact = exact - exact.max(axis=1, keepdims=True)
        exact -= np.log(np.exp(exact).sum(axis=1, keepdims=True))
        want = exact[np.arange(per), tokens[c * ctx + first + 1 : (c + 1) * ctx]]
        if c == 1:
            assert np.isnan(lp[1, 2])
            want[2] = lp[1, 2] = 0.0
        assert np.allclose(lp[c], want, atol=2e-4)
