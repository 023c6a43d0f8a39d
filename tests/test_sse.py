"""Server-sent events: every `data:` line survives a reader that splits lines on every Unicode line break."""

import msgspec

from radixserve.server.serving import sse_json

TEXT = "one\x85two\u2028three\u2029four\nfive"


def test_the_json_of_a_data_line_holds_no_character_a_line_reader_splits_on():
    data = sse_json(msgspec.json.Encoder(), {"text": TEXT})
    assert len(data.decode().splitlines()) == 1  # str.splitlines splits on \x85, \u2028, \u2029 as httpx does
    assert msgspec.json.decode(data) == {"text": TEXT}


def test_plain_text_is_encoded_as_msgspec_encodes_it():
    obj = {"text": "ascii and ünïcödé ✓", "n": 3}
    assert sse_json(msgspec.json.Encoder(), obj) == msgspec.json.encode(obj)
