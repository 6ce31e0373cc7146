"""Turn one request's generated token ids into text, one token at a time.

Two things keep text back from the caller:
- A character split across tokens. A byte-level BPE token can hold part of a
  UTF-8 sequence (an emoji is often 2-4 tokens); decoding it alone ends in the
  replacement character U+FFFD. Text is released only when its decode does not
  end in U+FFFD.
- A possible stop string. The longest tail of the text that is the start of a
  stop string is held until it either completes the stop (then it and all
  later text are dropped) or can no longer become one (then it is released).

Only a short window of recent tokens is decoded on each push: the last
released token (`prefix_offset:read_offset`, context so that the tokenizer
spaces the new text correctly) and the tokens not yet released
(`read_offset:`). The released text is the window's decode minus the
context's, so a push costs O(window), not O(output).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character is at most 4 bytes, so a character still incomplete must
# start within the last 3 tokens (each token is at least one byte). After this
# many held tokens, what is held is invalid bytes, not an unfinished character.
MAX_HELD_TOKENS = 8
# Tokens that decode to nothing (special tokens not named in skip_token_ids) may pile
# up as context; past this many, the context starts afresh.
MAX_CONTEXT_TOKENS = 4


class TextStream:
    """Per-request incremental detokenizer with stop strings."""

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop: Sequence[str] = (),
        skip_token_ids: Collection[int] = frozenset(),
    ) -> None:
        # decode: ids -> text with special tokens skipped (a tokenizer's decode).
        # skip_token_ids: the special tokens; they add no text, so they never enter the window.
        if isinstance(stop, str):
            stop = (stop,)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop must be non-empty strings")
        self._decode = decode
        self.stop: tuple[str, ...] = tuple(stop)
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._skip_token_ids = frozenset(skip_token_ids)
        self.num_tokens = 0  # tokens pushed, skipped ones included
        self._token_ids: list[int] = []  # the tokens that make text
        self._prefix_offset = 0  # start of the context window (tokens already released)
        self._read_offset = 0  # tokens before this are released
        self._prefix_text = ""  # decode of token_ids[prefix_offset:read_offset]
        self._held = ""  # decoded text held back because it could start a stop string
        self.stopped: str | None = None  # the stop string that matched
        self.text = ""  # everything released so far

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that is now safe to emit."""
        self.num_tokens += 1
        if self.stopped is not None or token_id in self._skip_token_ids:
            return ""
        self._token_ids.append(token_id)
        return self._release(self._decode_new(final=False))

    def flush(self) -> str:
        """At finish (not stopped): release the text still held back."""
        if self.stopped is not None:
            return ""
        out = self._release(self._decode_new(final=True))
        if self.stopped is None and self._held:
            out += self._held
            self.text += self._held
            self._held = ""
        return out

    def _decode_new(self, *, final: bool) -> str:
        """The newly complete text since the last release, advancing the window."""
        ids = self._token_ids
        full = self._decode(ids[self._prefix_offset :])
        if not final and full.endswith(REPLACEMENT_CHAR):
            # Part of a character: wait for the rest, unless more tokens are held than that needs.
            return self._decode_forced(full) if len(ids) - self._read_offset >= MAX_HELD_TOKENS else ""
        if len(full) < len(self._prefix_text):
            return ""  # a decoder that rewrote earlier text; wait for it to settle
        new = full[len(self._prefix_text) :]
        if new or len(ids) - self._prefix_offset > MAX_CONTEXT_TOKENS:
            self._advance(len(ids))
        else:
            # Tokens that decode to nothing (skipped special tokens) join the context, so the
            # next token is still decoded after real text (its leading space can depend on it).
            self._read_offset, self._prefix_text = len(ids), full
        return new

    def _decode_forced(self, full: str) -> str:
        """Release held tokens that can no longer form a character, keeping the last 3."""
        ids = self._token_ids
        cut = len(ids) - 3
        head = self._decode(ids[self._prefix_offset : cut])
        context = self._decode(ids[cut - 1 : cut])
        tail = self._decode(ids[cut - 1 :])
        # Safe only if decoding on from the new context token gives exactly the rest of
        # `full`, and something follows the context: an unfinished character at the cut
        # would then have been absorbed or completed, and the decodes would disagree.
        ok = tail.startswith(context) and len(tail) > len(context) and full == head + tail[len(context) :]
        if not ok or len(head) < len(self._prefix_text):
            return ""
        new = head[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset, self._prefix_text = cut - 1, cut, context
        return new

    def _advance(self, read: int) -> None:
        """Mark tokens before `read` released; the last of them is the next decode's context."""
        # Text before `read` is final, so decoding from any token before it gives the same
        # continuation; one token is enough context for a tokenizer's spacing rules.
        self._prefix_offset, self._read_offset = read - 1, read
        self._prefix_text = self._decode(self._token_ids[read - 1 : read])

    def _release(self, new: str) -> str:
        """Check `held + new` for stop strings; return what can be emitted."""
        buf = self._held + new
        if not buf:
            return ""
        if self.stop:
            hit = _first_stop(buf, self.stop)
            if hit is not None:
                index, stop = hit
                self.stopped = stop
                self._held = ""
                self.text += buf[:index]
                return buf[:index]
        keep = _stop_prefix_len(buf, self.stop, self._max_stop_len)
        out = buf[: len(buf) - keep]
        self._held = buf[len(buf) - keep :]
        self.text += out
        return out


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(index, stop) of the stop string that starts earliest in `text` (longest on a tie)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


def _stop_prefix_len(text: str, stops: tuple[str, ...], max_len: int) -> int:
    """Length of the longest tail of `text` that is the beginning of some stop string."""
    for k in range(min(len(text), max_len - 1), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0
