"""Text that grows with each token, decoding only a short window instead of the whole output every time.

Decoding all output ids after every token costs O(n) per token and O(n^2) per request. Here each new token
decodes only the tokens since the last emitted piece plus that piece (for context: a token's leading space or
a character split over several byte tokens), so a token costs O(1). A piece that ends in the middle of a
multi-byte character (decoded as U+FFFD) is held back until the character is complete.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.prefix_offset = 0  # start of the window: the last emitted piece, decoded again for context
        self.read_offset = 0  # tokens before this one are in self.text

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes ("" while a character is incomplete)."""
        self.token_ids.append(token_id)
        context = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.token_ids[self.prefix_offset:])
        if len(window) <= len(context) or window.endswith("\ufffd"):
            return ""  # nothing new yet, or a multi-byte character still incomplete
        new = window[len(context):]
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new
