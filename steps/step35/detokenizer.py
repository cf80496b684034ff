"""Text that grows with each token, decoding only a short window instead of the whole output every time.

Decoding all output ids after every token costs O(n) per token and O(n^2) per request. Here each new token
decodes only a short window: the tokens since the start of an emitted piece (for context: a token's leading space
or a character split over several byte tokens). The window's text before the new tokens (its context) is kept
from the decode before, so a token costs one short decode, O(1). Once the window holds `window` tokens it moves on
to the last emitted piece, whose text is then decoded again, once. A piece that ends in the middle of a multi-byte
character (decoded as U+FFFD) is held back until the character is complete; `final_text` adds it as a full decode
would, so a finished request's text needs no decode of its whole output.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, window: int = 8):
        self.tokenizer = tokenizer
        self.window = window  # tokens a window may span before it moves on
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.prefix_offset = 0  # start of the window: an emitted piece, decoded again for context
        self.read_offset = 0  # tokens before this one are in self.text
        self.last_piece = 0  # start of the last emitted piece
        self.context = ""  # the decode of token_ids[prefix_offset:read_offset], kept from the decode before

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes ("" while a character is incomplete, or for a token
        that decodes to nothing)."""
        self.token_ids.append(token_id)
        window = self.tokenizer.decode(self.token_ids[self.prefix_offset:])  # this token's one decode
        if window.endswith("\ufffd") or (len(window) <= len(self.context) and window != self.context):
            return ""  # a multi-byte character still incomplete, or the text changed shape: wait for more
        # new text, or none at all (a token that decodes to nothing: a piece of its own, so the window moves on
        # past it instead of growing with every such token)
        new = window[len(self.context):]
        self.text += new
        self.last_piece, self.read_offset = self.read_offset, len(self.token_ids)
        if self.read_offset - self.prefix_offset >= self.window:  # move the window on to the piece just emitted
            self.prefix_offset = self.last_piece
            window = self.tokenizer.decode(self.token_ids[self.prefix_offset:])
        self.context = window
        return new

    def final_text(self) -> str:
        """The whole text, tokens held back included (as a full decode of every token gives them)."""
        if self.read_offset == len(self.token_ids):
            return self.text
        return self.text + self.tokenizer.decode(self.token_ids[self.prefix_offset:])[len(self.context):]
