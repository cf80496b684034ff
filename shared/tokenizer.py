"""A thin wrapper over the HF tokenizer: encode, decode, chat template, end-of-sequence ids."""
from __future__ import annotations

import functools
import json
from pathlib import Path

# transformers' names for its plain fast tokenizer (5.x calls it TokenizersBackend; PreTrainedTokenizerFast is its
# alias, and its name before 5.0)
FAST_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


@functools.lru_cache(maxsize=8)
def _hf_tokenizer(model_dir: str, files_stamp: tuple):
    """The HF tokenizer of a model folder, loaded once per process (about half a second each time otherwise) and
    shared by every engine built on that folder: nothing here changes its settings. files_stamp (the tokenizer
    files' names, sizes and modification times) is part of the key, so a folder whose files change is read again.
    A folder whose tokenizer is the plain fast one (every model folder this project makes: tokenizer.json, read by
    `tokenizers`) loads it with that class itself, not through AutoTokenizer, which imports transformers' model
    configurations and torch with them: a serving front end (step26 on) runs without torch."""
    config = Path(model_dir) / "tokenizer_config.json"
    named = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if named in FAST_TOKENIZER_CLASSES and (Path(model_dir) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _files_stamp(model_dir: Path) -> tuple:
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(model_dir.glob("*"))
                 if f.is_file() and f.suffix in (".json", ".txt", ".model", ".jinja"))


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir).resolve()
        self.hf = _hf_tokenizer(str(model_dir), _files_stamp(model_dir))
        config = json.loads((model_dir / "config.json").read_text())
        eos = config.get("eos_token_id", self.hf.eos_token_id)
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_token_ids: set[int] = {int(e) for e in eos if e is not None}
        if self.hf.eos_token_id is not None:
            self.eos_token_ids.add(int(self.hf.eos_token_id))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True)

    def token_to_str(self, token_id: int) -> str:
        return self.hf.convert_ids_to_tokens(int(token_id)) or ""

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation, ending with the prompt for the assistant's reply."""
        if not self.hf.chat_template:
            raise ValueError("chat: this model's tokenizer has no chat template; use generate() with plain text")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.encode(text)
