import pytest

from chatsvc.engine.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Each id is one byte (ids < 256) or a multi-byte piece; decodes like byte-level BPE."""

    def __init__(self, pieces: dict[int, bytes] | None = None):
        self.pieces = pieces or {}

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids, skip_special_tokens=True):
        data = b"".join(self.pieces.get(t, bytes([t]) if t < 256 else b"") for t in token_ids)
        return data.decode("utf-8", errors="replace")


def _stream(detok, ids):
    return [detok.add_token(t) for t in ids]


def test_multibyte_characters_wait_for_their_last_byte():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("Say: "))
    text = "héllo 😀!"
    deltas = _stream(detok, tok.encode(text))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # The emoji is four bytes: three tokens release nothing, the fourth releases it.
    emoji_start = len("héllo ".encode())
    assert deltas[emoji_start : emoji_start + 4] == ["", "", "", "😀"]


def test_merged_tokens_and_context():
    tok = ByteTokenizer({300: b" wor", 301: b"ld", 302: "é".encode()[:1], 303: "é".encode()[1:]})
    detok = IncrementalDetokenizer(tok, [72, 105])
    assert _stream(detok, [300, 301, 302, 303]) == [" wor", "ld", "", "é"]
    assert detok.text == " worldé"


def test_stop_string_is_cut_and_ends_text():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=("END",))
    out = "".join(_stream(detok, tok.encode("abc ENfoo EN")))
    assert detok.stopped_by is None
    assert out + detok.flush() == "abc ENfoo EN"
    detok = IncrementalDetokenizer(tok, [], stop=("END",))
    deltas = _stream(detok, tok.encode("abc ENDxyz"))
    assert "".join(deltas) == "abc "
    assert detok.stopped_by == "END"
    assert detok.text == "abc "


def test_possible_stop_prefix_is_withheld_until_resolved():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=("\nUser:",))
    assert _stream(detok, tok.encode("hi\nUs")) == ["h", "i", "", "", ""]
    assert detok.add_token(ord("a")) == "\nUsa"
    assert detok.text == "hi\nUsa"


def test_earliest_of_several_stop_strings_wins():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=("bcd", "cx", "b"))
    assert "".join(_stream(detok, tok.encode("abcx"))) == "a"
    assert detok.stopped_by == "b"


def test_stop_string_spanning_a_merged_token():
    tok = ByteTokenizer({400: b"ST", 401: b"OP!"})
    detok = IncrementalDetokenizer(tok, [], stop=("STOP",))
    assert _stream(detok, [ord("x"), 400, 401]) == ["x", "", ""]
    assert detok.stopped_by == "STOP"
    assert detok.add_token(ord("z")) == ""


def test_flush_releases_withheld_text():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=("###",))
    assert "".join(_stream(detok, tok.encode("ok ##"))) == "ok "
    assert detok.flush() == "##"
    assert detok.text == "ok ##"


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError):
        IncrementalDetokenizer(ByteTokenizer(), [], stop=("",))
