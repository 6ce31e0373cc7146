"""pagoda.core.text_stream: incremental detokenization and stop strings.

Most tests use a byte tokenizer (token id = one byte, 256 = a special token
that decodes to nothing), the smallest model of byte-level BPE; the rest use
the default model's real tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.core.text_stream import MAX_CONTEXT_TOKENS, MAX_HELD_TOKENS, REPLACEMENT_CHAR, TextStream

MAX_WINDOW = MAX_HELD_TOKENS + MAX_CONTEXT_TOKENS + 1

SPECIAL = 256


class ByteDecoder:
    """decode(ids) for byte tokens; records the window length of every call."""

    def __init__(self) -> None:
        self.window_lens: list[int] = []

    def __call__(self, ids: Sequence[int]) -> str:
        self.window_lens.append(len(ids))
        return bytes(i for i in ids if i != SPECIAL).decode("utf-8", errors="replace")


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def stream_all(stream: TextStream, ids: Sequence[int]) -> list[str]:
    chunks = [stream.push(i) for i in ids]
    if stream.stopped is None:
        chunks.append(stream.flush())
    return chunks


def test_multibyte_characters_are_held_until_complete():
    text = "héllo 😀 中文 🇫🇷!"
    decode = ByteDecoder()
    stream = TextStream(decode)
    chunks = stream_all(stream, byte_ids(text))
    assert "".join(chunks) == stream.text == text
    assert not any(REPLACEMENT_CHAR in c for c in chunks)
    assert chunks[byte_ids(text).index(0xF0)] == ""  # the hard case: the emoji's first byte was held
    assert max(decode.window_lens) <= 8  # a short window, not the whole output


def test_real_tokenizer_streams_emoji_and_cjk(default_tokenizer):
    text = "Sure! 😀👍🏽 中文字符和日本語のテキスト 🇫🇷 done."
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    # The hard case: some tokens are pieces of a character and decode alone to U+FFFD.
    assert any(REPLACEMENT_CHAR in default_tokenizer.decode([i]) for i in ids)
    stream = default_tokenizer.text_stream()
    chunks = stream_all(stream, ids)
    assert "".join(chunks) == stream.text == default_tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in c for c in chunks)


def test_stop_string_split_across_two_tokens():
    stream = TextStream(ByteDecoder(), stop=("STOP",))
    out = [stream.push(i) for i in byte_ids("Hello ST")]
    assert out[-2:] == ["", ""]  # "S" and "T" held: they may begin the stop string
    assert stream.push(ord("O")) == "" and stream.push(ord("P")) == ""
    assert stream.stopped == "STOP" and stream.text == "Hello "
    assert stream.push(ord("x")) == "" and stream.flush() == ""  # nothing after a stop


def test_real_tokenizer_stop_string_spanning_tokens(default_tokenizer):
    text = "The answer is 42.\nUser: and now"
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    pieces = [default_tokenizer.decode([i]) for i in ids]
    assert ".\n" in pieces or "\n" in pieces  # "\nUser:" is really spread over several tokens
    stream = default_tokenizer.text_stream(stop=("\nUser:",))
    chunks = stream_all(stream, ids)
    assert stream.stopped == "\nUser:"
    assert "".join(chunks) == stream.text == "The answer is 42."


def test_stop_string_at_the_very_start():
    stream = TextStream(ByteDecoder(), stop=("<end>",))
    chunks = stream_all(stream, byte_ids("<end> more"))
    assert stream.stopped == "<end>" and stream.text == "" and "".join(chunks) == ""


def test_stop_string_inside_one_token():
    decode = lambda ids: "".join({1: "Hello", 2: " wor", 3: "ld! ok"}[i] for i in ids)  # noqa: E731
    stream = TextStream(decode, stop=("world",))
    assert stream.push(1) == "Hello"
    assert stream.push(2) == " "  # "wor" may begin "world"
    assert stream.push(3) == "" and stream.stopped == "world" and stream.text == "Hello "


def test_overlapping_candidate_stop_strings():
    # "bc" completes before "abcd" could: the first stop to complete wins.
    s = TextStream(ByteDecoder(), stop=("abcd", "bc"))
    stream_all(s, byte_ids("xabcd"))
    assert (s.stopped, s.text) == ("bc", "xa")
    # A held prefix shared by two stops is resolved by the next character.
    s = TextStream(ByteDecoder(), stop=("abc", "abd"))
    stream_all(s, byte_ids("xabd"))
    assert (s.stopped, s.text) == ("abd", "x")
    # Both complete in the same push: the one starting earliest (then the longest) wins.
    decode = lambda ids: "".join({1: "xy", 2: "abc"}[i] for i in ids)  # noqa: E731
    s = TextStream(decode, stop=("bc", "abc"))
    stream_all(s, [1, 2])
    assert (s.stopped, s.text) == ("abc", "xy")


def test_held_prefix_is_released_when_it_cannot_stop():
    s = TextStream(ByteDecoder(), stop=("STOP",))
    chunks = [s.push(i) for i in byte_ids("a ST")]
    assert "".join(chunks) == "a "
    assert s.push(ord("x")) == "STx"
    s2 = TextStream(ByteDecoder(), stop=("STOP",))
    [s2.push(i) for i in byte_ids("a ST")]
    assert s2.flush() == "ST" and s2.text == "a ST" and s2.stopped is None


def test_stop_string_with_a_multibyte_character():
    s = TextStream(ByteDecoder(), stop=("😀",))
    chunks = stream_all(s, byte_ids("ok 😀 no"))
    assert s.stopped == "😀" and "".join(chunks) == s.text == "ok "


def test_special_tokens_are_skipped_and_keep_the_window_short():
    ids = byte_ids("a") + [SPECIAL] * 50 + byte_ids("b😀") + [SPECIAL] * 3 + byte_ids("c")
    for skip in (frozenset(), frozenset({SPECIAL})):  # known to the stream, or only to decode
        decode = ByteDecoder()
        s = TextStream(decode, skip_token_ids=skip)
        assert "".join(stream_all(s, ids)) == "ab😀c" and s.num_tokens == len(ids)
        assert max(decode.window_lens) <= (MAX_WINDOW if not skip else 5)  # 4-byte emoji + 1 context


def test_special_tokens_inside_a_character():
    """Bytes of one emoji with special tokens between them: held across them, then joined."""
    decode = ByteDecoder()
    s = TextStream(decode, skip_token_ids={SPECIAL})
    ids = byte_ids("x") + [0xF0] + [SPECIAL] * 40 + [0x9F, 0x98] + [SPECIAL] + [0x80] + byte_ids("y")
    chunks = [s.push(i) for i in ids]
    assert "".join(chunks) == "x😀y" and chunks[-2] == "😀"
    assert max(decode.window_lens) <= 5


def test_flush_releases_an_unfinished_character_as_the_full_decode_does():
    decode = ByteDecoder()
    s = TextStream(decode)
    ids = byte_ids("ok ") + [0xF0, 0x9F]
    assert "".join(s.push(i) for i in ids) == "ok "
    assert s.flush() == REPLACEMENT_CHAR and s.text == decode(ids)


def test_invalid_bytes_do_not_stall_the_stream():
    """Lone continuation bytes never complete a character: they are released, in a short window."""
    decode = ByteDecoder()
    s = TextStream(decode)
    ids = byte_ids("a") + [0x80] * 100 + byte_ids("é")
    chunks = [s.push(i) for i in ids]
    assert sum(len(c) for c in chunks[:-5]) > 50  # released while streaming, not only at flush
    chunks.append(s.flush())
    assert max(decode.window_lens) <= MAX_WINDOW
    assert "".join(chunks) == s.text == decode(ids)


def test_long_output_cost_is_per_token():
    decode = ByteDecoder()
    s = TextStream(decode, stop=("never appears",))
    text = "Lorem ipsum 😀 中文 " * 300
    assert "".join(stream_all(s, byte_ids(text))) == text
    assert max(decode.window_lens) <= 8 and len(decode.window_lens) <= 2 * len(byte_ids(text)) + 2


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c😀é", max_size=40),
    stops=st.lists(st.text(alphabet="ab c😀é", min_size=1, max_size=4), max_size=3),
)
def test_matches_a_whole_text_reference(text, stops):
    """Streaming byte by byte == cutting the full text before the first stop string to complete."""
    s = TextStream(ByteDecoder(), stop=tuple(stops))
    streamed = "".join(stream_all(s, byte_ids(text)))
    want, want_stop = text, None
    for end in range(1, len(text) + 1):  # the first character at which some stop completes
        done = [x for x in stops if text[:end].endswith(x)]
        if done:
            want_stop = max(done, key=len)
            want = text[: end - len(want_stop)]
            break
    assert (streamed, s.stopped) == (want, want_stop)
    assert s.text == streamed


@settings(max_examples=400, deadline=None)
@given(chunks=st.lists(st.one_of(st.binary(min_size=1, max_size=3), st.just(b"")), max_size=60))
def test_any_bytes_stream_to_the_full_decode(chunks):
    """Arbitrary (often invalid) UTF-8 cut into 1-3 byte tokens (b"" = a special token)."""
    calls: list[int] = []

    def decode(ids: Sequence[int]) -> str:
        calls.append(len(ids))
        return b"".join(chunks[i] for i in ids).decode("utf-8", errors="replace")

    s = TextStream(decode, skip_token_ids={i for i, c in enumerate(chunks) if not c})
    out = [s.push(i) for i in range(len(chunks))]
    # Before the flush, released text is final: the full text starts with it.
    want = b"".join(chunks).decode("utf-8", errors="replace")
    assert want.startswith("".join(out))
    out.append(s.flush())
    assert "".join(out) == s.text == want
    # Held tokens are forced out after MAX_HELD_TOKENS; a character spans at most 3 more.
    assert max(calls, default=0) <= MAX_HELD_TOKENS + 4


def test_sentencepiece_style_spaces_survive_the_window():
    """A Metaspace decoder drops the leading space of a decode's first token: context keeps it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {"▁Hello": 0, "▁world": 1, "!": 2, "▁and": 3, "▁more": 4, "<s>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="!"))
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    tok.decoder = decoders.Metaspace()
    ids = [0, 1, 5, 5, 5, 5, 5, 5, 2, 3, 5, 4, 2]
    want = tok.decode(ids, skip_special_tokens=True)
    assert want == "Hello world! and more!"
    assert tok.decode([1]) == "world"  # the hard case: alone, the space is gone
    s = TextStream(lambda x: tok.decode(list(x), skip_special_tokens=True))
    assert "".join(stream_all(s, ids)) == want
