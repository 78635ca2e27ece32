"""Whisper's tokenizer: `tokenizers` BPE from tokenizer.json plus special tokens looked up by string.

Works for the English-only (51864 tokens) and multilingual (51865) vocabularies; the
CTranslate2 config.json (suppress_ids, suppress_ids_begin, lang_ids, alignment_heads) is
read when present.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

# Whisper's language codes in token order (<|en|> is first).
LANGUAGES = (
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur "
    "hr bg lt la mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si "
    "km sn yo so af oc ka be tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha "
    "ba jw su yue"
).split()

TIME_PRECISION = 0.02  # seconds per timestamp token
# what a byte-level decode shows for a character whose bytes are not all there, at either end
_CUT_START = re.compile("^(\\s*)\ufffd+")
_CUT_END = re.compile("\ufffd+(\\s*)$")


def language_base(language: str) -> str:
    """A language code as Whisper spells it: "EN", "en-US" and "zh_TW" are "en", "en" and "zh"."""
    return language.strip().lower().replace("_", "-").split("-")[0]


def _with_first_merge(text: str) -> str:
    """tokenizer.json with the merge that makes token 256, when a converter lost it.

    GPT-2's merges.txt opens with a "#version" line, and converters that skip the first line as
    that header drop the first merge instead when the header is absent. Some published Whisper
    tokenizer.json files (whisper-base's among them) lack "Ġ t": the token " t" (256) is in the
    vocabulary but no merge makes it, so every word starting with "t" in a prompt or prefix was
    encoded as two tokens the model was never trained to read. Token 256 is the first one merges
    make, from two single characters, so the lost merge is known from the vocabulary.
    """
    data = json.loads(text)
    model = data.get("model", {})
    vocab, merges = model.get("vocab", {}), model.get("merges", [])
    if model.get("type") != "BPE" or not merges:
        return text
    first = next((token for token, i in vocab.items() if i == 256), None)
    if first is None or len(first) != 2 or not all(c in vocab for c in first):
        return text
    pairs = [m.split(" ") if isinstance(m, str) else m for m in merges]
    if any("".join(pair) == first for pair in pairs):
        return text
    merges.insert(0, f"{first[0]} {first[1]}" if isinstance(merges[0], str) else [first[0], first[1]])
    return json.dumps(data)


class WhisperTokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.tok = Tokenizer.from_str(_with_first_merge((model_dir / "tokenizer.json").read_text()))
        # text is text: a prompt or prefix that spells "<|endoftext|>" must not become that token
        self.tok.encode_special_tokens = True
        cfg_path = model_dir / "config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}

        def tid(s: str) -> int | None:
            return self.tok.token_to_id(s)

        self.sot = tid("<|startoftranscript|>")
        self.eot = tid("<|endoftext|>")
        self.transcribe = tid("<|transcribe|>")
        self.translate = tid("<|translate|>")
        self.no_timestamps = tid("<|notimestamps|>")
        self.sot_prev = tid("<|startofprev|>")
        self.sot_lm = tid("<|startoflm|>")
        self.no_speech = tid("<|nospeech|>") if tid("<|nospeech|>") is not None else tid("<|nocaptions|>")
        if None in (self.sot, self.eot, self.no_timestamps):
            raise ValueError(f"{model_dir}: tokenizer.json lacks Whisper's special tokens")
        # many converted tokenizer.json files omit the 1501 timestamp tokens; they follow <|notimestamps|>
        self.timestamp_begin = tid("<|0.00|>") or self.no_timestamps + 1
        if self.timestamp_begin != self.no_timestamps + 1:
            raise ValueError(f"{model_dir}: tokenizer.json lacks Whisper's special tokens")
        self.lang_to_id: dict[str, int] = {}
        for code in LANGUAGES:
            i = tid(f"<|{code}|>")
            if i is not None:
                self.lang_to_id[code] = i
        self.id_to_lang = {v: k for k, v in self.lang_to_id.items()}
        # English-only vocabularies have <|en|> but none of the other language tokens
        self.multilingual = len(self.lang_to_id) > 1 and self.transcribe is not None and self.eot == 50257

    @property
    def lang_ids(self) -> list[int]:
        return sorted(self.lang_to_id.values())

    @cached_property
    def suppress_tokens(self) -> list[int]:
        """Whisper's default "-1" set (config.json suppress_ids) plus the special tokens."""
        base = list(self.config.get("suppress_ids", []))
        if not base:
            base = self._non_speech_tokens()
        extra = [self.transcribe, self.translate, self.sot, self.sot_prev, self.sot_lm, self.no_speech]
        return sorted({t for t in base + extra if t is not None})

    @cached_property
    def suppress_begin(self) -> list[int]:
        ids = self.config.get("suppress_ids_begin")
        if ids:
            return list(ids)
        return sorted(set(self.encode(" ") + [self.eot]))

    def _non_speech_tokens(self) -> list[int]:
        symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
        symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
        miscellaneous = set("♩♪♫♬♭♮♯")
        result = {self.encode(" -")[0], self.encode(" '")[0]}
        for symbol in symbols + list(miscellaneous):
            for tokens in [self.encode(symbol), self.encode(" " + symbol)]:
                if len(tokens) == 1 or symbol in miscellaneous:
                    result.add(tokens[0])
        return sorted(result)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens left out. A character needs several tokens in many
        scripts (one per byte of it, for tiny.en); one cut between them at either end (a decode
        stopped at its token cap, a segment closed inside it) is left out, not shown as U+FFFD."""
        text = self.tok.decode([i for i in ids if i < self.eot], skip_special_tokens=False)
        return _CUT_END.sub(r"\1", _CUT_START.sub(r"\1", text))

    def characters(self, ids: list[int]) -> list[tuple[str, list[int]]]:
        """Text tokens `ids` in runs that each decode to whole characters, with their text: a
        character many scripts need several tokens for stays whole (a run cut short at the end
        joins the run before it, its part left out as `decode` leaves it)."""
        full = self.tok.decode(ids, skip_special_tokens=False)
        runs: list[tuple[str, list[int]]] = []
        run: list[int] = []
        offset = 0
        for i in ids:
            run.append(i)
            text = self.tok.decode(run, skip_special_tokens=False)
            if "\ufffd" not in text or full[offset + text.index("\ufffd")] == "\ufffd":
                runs.append((text, run))
                offset += len(text)
                run = []
        if run:
            if not runs:
                return [(self.decode(run), run)]
            text, before = runs.pop()
            runs.append((self.decode(before + run), before + run))
        return runs

    def language_code(self, language: str | None) -> str | None:
        """The model's code for `language` (see `language_base`), or None when it has none: a
        request's language is then detected."""
        if not language:
            return None
        code = language_base(language)
        return code if code in self.lang_to_id else None

    @property
    def languages(self) -> frozenset[str]:
        """The languages the model transcribes: an English-only one has no others' tokens."""
        return frozenset(self.lang_to_id) if self.multilingual else frozenset({"en"})

    def sot_sequence(self, language: str | None, task: str = "transcribe") -> list[int]:
        seq = [self.sot]
        if self.multilingual:
            lang = language or "en"
            if lang not in self.lang_to_id:
                raise ValueError(f"unknown language {lang!r}")
            seq.append(self.lang_to_id[lang])
            seq.append(self.translate if task == "translate" else self.transcribe)
        return seq

    def prompt_tokens(self, prompt: str | None, max_len: int) -> list[int]:
        """<|startofprev|> and the prompt's last `max_len` tokens, as Whisper conditions on them."""
        if not prompt or self.sot_prev is None:
            return []
        toks = self.encode(" " + prompt.strip())
        return [self.sot_prev] + toks[-max_len:]
