"""Text <-> token ids for the models minecart runs, built from a GGUF file's `tokenizer.ggml.*` keys.

Two vocabulary kinds are supported (`tokenizer.ggml.model`):

- `gpt2`: byte-level BPE with a merge list (Qwen3.5/3.6, Qwen2/3, Llama 3). Text is split on added
  tokens, NFC-normalised where transformers does (Qwen), cut by the pre-tokenizer regex named by
  `tokenizer.ggml.pre`, mapped through the GPT-2 byte-to-unicode table and merged by rank. Ids equal
  transformers' (not llama.cpp's where the two differ: llama.cpp skips NFC).
- `llama`: SentencePiece-style BPE (Gemma 3): tokens + scores + types, spaces written as U+2581,
  `<0xNN>` byte fallback for anything outside the vocabulary. The file carries no merges; they are
  rebuilt from the vocabulary the way transformers' GGUF loader does, so ids equal its ids.

The BPE itself runs in the `tokenizers` library. Decoding does not: every id has its bytes
precomputed here, which makes `decode` and `StreamDecoder` one code path that never splits a UTF-8
character (a multi-byte character can span several byte tokens).

Special tokens: CONTROL tokens (`<|im_start|>`, `<start_of_turn>`, `<bos>`) are recognised in text only
with `add_special=True` (llama.cpp's "parse special"; rendered chat templates need it). USER_DEFINED
tokens (`<think>`, `<tool_call>`, Gemma's newline runs) are always recognised, as in both llama.cpp and
transformers. This module knows nothing about chat formats (chat_template.py) or models.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import TokenizerError

if TYPE_CHECKING:
    from .gguf_file import GGUFFile

log = logging.getLogger(__name__)

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SPIECE_SPACE = "\u2581"  # SentencePiece's visible space

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (Oniguruma syntax, as in the HF tokenizer.json of
# each family). qwen35 lets letters absorb combining marks and splits digits one by one.
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


# pre name -> (split regex, NFC-normalise first, ignore_merges: look a whole piece up before merging)
BYTE_LEVEL_PRE_TOKENIZERS: dict[str, tuple[str, bool, bool]] = {
    "qwen35": (_QWEN35_SPLIT, True, False),
    "qwen2": (_QWEN2_SPLIT, True, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, True, False),
    "llama3": (_LLAMA3_SPLIT, False, True),
    "llama-v3": (_LLAMA3_SPLIT, False, True),
    "llama-bpe": (_LLAMA3_SPLIT, False, True),
    "gpt2": (_GPT2_SPLIT, False, False),
    "default": (_GPT2_SPLIT, False, False),
}

# Tokens that end a turn for the model families minecart knows, besides tokenizer.ggml.eos_token_id.
_END_OF_TURN_TEXTS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<eos>", "<|eot_id|>", "<|end_of_text|>")


def typed_list(metadata: Mapping[str, Any], key: str, elem: type | tuple[type, ...],
               source: str) -> list:
    """The list under `key` ([] when absent), every element of type `elem`, else a TokenizerError
    naming the key: a retyped array (tokens as f32, merges as integers) must not surface as a
    TypeError or AttributeError far from the file."""
    value = metadata.get(key)
    if value is None:
        return []
    types = elem if isinstance(elem, tuple) else (elem,)
    if not isinstance(value, list) or not all(
            isinstance(x, types) and (bool in types or not isinstance(x, bool)) for x in value):
        names = "/".join(t.__name__ for t in types)
        raise TokenizerError(f"{source}: '{key}' must be an array of {names} values, got "
                             f"{str(value)[:60]}; the file is corrupt, re-convert the model.")
    return value


def gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, 0x7F-0xA0, 0xAD) are
    moved to U+0100 upwards, in byte order, so no token contains whitespace or control characters.
    """
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def first_index_map(tokens: Sequence[str]) -> dict[str, int]:
    """token -> id; a spelling that occurs twice belongs to its first id (as in llama.cpp)."""
    index = dict(zip(tokens, range(len(tokens)), strict=True))  # last occurrence wins here...
    if len(index) != len(tokens):
        for i in range(len(tokens) - 1, -1, -1):  # ...so rewrite duplicates to the first one
            index[tokens[i]] = i
    return index


class Tokenizer:
    """Encodes text to ids and ids to text for one GGUF vocabulary. Build it with `from_gguf`.

    Thread-safe: encoding takes a lock (the special-token switch lives on the shared backend), decoding
    only reads immutable tables.
    """

    def __init__(
        self,
        *,
        backend: Any,
        kind: str,
        tokens: Sequence[str],
        token_types: Sequence[int],
        token_bytes: list[bytes],
        bos_id: int | None,
        add_bos: bool,
        eos_id: int | None,
        add_eos: bool,
        eos_ids: frozenset[int],
        source: str,
    ):
        self._backend = backend
        self.kind = kind
        self._tokens = list(tokens)
        self._types = list(token_types)
        self._token_bytes = token_bytes
        self._bos_id = bos_id
        self._add_bos = add_bos
        self._eos_id = eos_id
        self._add_eos = add_eos
        self._eos_ids = eos_ids
        self.source = source
        self._lock = threading.Lock()
        self._id_of = first_index_map(self._tokens)
        self._skip_on_decode = frozenset(
            i for i, ty in enumerate(self._types) if ty in (TOKEN_CONTROL, TOKEN_UNUSED, TOKEN_UNKNOWN)
        )

    def __repr__(self) -> str:
        return (f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos_id={self._bos_id}, "
                f"eos_ids={sorted(self._eos_ids)}, source={self.source!r})")

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile) -> Tokenizer:
        """Build from an opened `GGUFFile` (only its metadata is read)."""
        return cls.from_metadata(gguf_file.metadata, source=str(gguf_file.path))

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], *, source: str = "<metadata>") -> Tokenizer:
        """Build from a GGUF metadata mapping (key -> Python value), e.g. `GGUFFile.metadata`."""

        def require(key: str) -> Any:
            if key not in metadata:
                raise TokenizerError(
                    f"{source}: tokenizer key '{key}' is missing; the file cannot be tokenized. "
                    "Re-convert the model with a current llama.cpp convert_hf_to_gguf.py."
                )
            return metadata[key]

        model = str(require("tokenizer.ggml.model"))
        require("tokenizer.ggml.tokens")
        tokens: list[str] = typed_list(metadata, "tokenizer.ggml.tokens", str, source)
        if not tokens:
            raise TokenizerError(f"{source}: 'tokenizer.ggml.tokens' is empty; re-convert the model.")
        types = typed_list(metadata, "tokenizer.ggml.token_type", int, source) or [TOKEN_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise TokenizerError(
                f"{source}: 'tokenizer.ggml.token_type' has {len(types)} entries for {len(tokens)} tokens; "
                "the file is inconsistent, re-convert it."
            )
        types = [int(t) for t in types]
        n = len(tokens)

        def token_id(key: str) -> int | None:
            value = metadata.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int):
                raise TokenizerError(f"{source}: '{key}' = {str(value)[:60]} is not a token id (an "
                                     "integer); the file is corrupt, re-convert it.")
            if not 0 <= value < n:
                raise TokenizerError(f"{source}: '{key}' = {value} is outside the vocabulary (0..{n - 1}).")
            return value

        bos_id = token_id("tokenizer.ggml.bos_token_id")
        eos_id = token_id("tokenizer.ggml.eos_token_id")
        if model == "gpt2":
            backend, token_bytes = _build_byte_level(metadata, tokens, types, source)
            # Qwen and the other byte-level families never prepend BOS unless the file asks.
            add_bos_default = False
        elif model == "llama":
            backend, token_bytes = _build_sentencepiece(metadata, tokens, types, source)
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
            add_bos_default = True
        else:
            raise TokenizerError(
                f"{source}: tokenizer model '{model}' (key 'tokenizer.ggml.model') is not supported; "
                "minecart reads 'gpt2' (byte-level BPE) and 'llama' (SentencePiece) vocabularies."
            )
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos_id is not None
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None

        eos_ids = set()
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            tid = token_id(key)
            if tid is not None:
                eos_ids.add(tid)
        by_text = {t: i for i, t in enumerate(tokens) if types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)}
        for text in _END_OF_TURN_TEXTS:
            if text in by_text:
                eos_ids.add(by_text[text])
        return cls(
            backend=backend,
            kind=model,
            tokens=tokens,
            token_types=types,
            token_bytes=token_bytes,
            bos_id=bos_id,
            add_bos=add_bos,
            eos_id=eos_id,
            add_eos=add_eos,
            eos_ids=frozenset(eos_ids),
            source=source,
        )

    # ---------------------------------------------------------------- properties

    @property
    def vocab_size(self) -> int:
        """Number of entries in the GGUF token list (= rows of the embedding for the models here)."""
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        """`tokenizer.ggml.eos_token_id` alone; generation should stop on any of `eos_ids`."""
        return self._eos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends generation: the file's eos/eot ids plus known end-of-turn tokens."""
        return self._eos_ids

    @property
    def adds_bos(self) -> bool:
        """Whether `encode(..., add_special=True)` prepends BOS (Gemma: yes; Qwen: no)."""
        return self._add_bos

    # ---------------------------------------------------------------- encoding

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text`.

        add_special=True: special (CONTROL) token strings in the text become their single ids, and BOS
        (EOS) is added where the file asks for it. A BOS already written at the start of the text (many
        chat templates emit `{{ bos_token }}`) is not doubled. Use it for rendered chat templates.
        add_special=False: only USER_DEFINED tokens (`<think>`, ...) are recognised; everything else,
        `<|im_start|>` included, is plain text. Use it for user-supplied text.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        with self._lock:
            self._backend.encode_special_tokens = not add_special
            try:
                ids = self._backend.encode(text, add_special_tokens=False).ids
            finally:
                self._backend.encode_special_tokens = False
        return self._add_bos_eos(ids) if add_special else ids

    def encode_batch(self, texts: Sequence[str], add_special: bool = False) -> list[list[int]]:
        """`encode` for several texts at once (the backend spreads them over threads)."""
        with self._lock:
            self._backend.encode_special_tokens = not add_special
            try:
                encoded = self._backend.encode_batch(list(texts), add_special_tokens=False)
            finally:
                self._backend.encode_special_tokens = False
        return [self._add_bos_eos(list(enc.ids)) if add_special else list(enc.ids) for enc in encoded]

    def _add_bos_eos(self, ids: list[int]) -> list[int]:
        """BOS/EOS where the file asks for them, never doubling one the text already starts/ends with."""
        if self._add_bos and self._bos_id is not None and not (ids and ids[0] == self._bos_id):
            ids.insert(0, self._bos_id)
        if self._add_eos and self._eos_id is not None and not (ids and ids[-1] == self._eos_id):
            ids.append(self._eos_id)
        return ids

    # ---------------------------------------------------------------- decoding

    def _check_id(self, token_id: int) -> int:
        token_id = int(token_id)
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(
                f"{self.source}: token id {token_id} is outside the vocabulary (0..{len(self._tokens) - 1})."
            )
        return token_id

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (may be part of a UTF-8 character)."""
        return self._token_bytes[self._check_id(token_id)]

    def text_token_bytes(self) -> list[bytes]:
        """Every token's bytes, with b"" for the tokens that are not text (control, user-defined such
        as <think>, unused, unknown): what may appear inside generated text that a format constrains
        (engine/json_output.py). A new list each call."""
        return [raw if ty in (TOKEN_NORMAL, TOKEN_BYTE) else b""
                for raw, ty in zip(self._token_bytes, self._types, strict=True)]

    def token_to_piece(self, token_id: int) -> str:
        """The text of one token, as it would appear in decoded output (invalid UTF-8 -> U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """The token's spelling in the GGUF vocabulary (`Ġthe`, `▁the`, `<0x0A>`, `<|im_end|>`)."""
        return self._tokens[self._check_id(token_id)]

    def token_type(self, token_id: int) -> int:
        return self._types[self._check_id(token_id)]

    def is_special(self, token_id: int) -> bool:
        """CONTROL or UNUSED tokens: the ones `decode(skip_special=True)` leaves out."""
        return self._check_id(token_id) in self._skip_on_decode

    def id_of(self, text: str) -> int | None:
        """The id whose vocabulary spelling is exactly `text` (e.g. '<|im_end|>'), or None."""
        return self._id_of.get(text)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of a sequence of ids. skip_special leaves out CONTROL/UNUSED tokens (BOS, <|im_end|>)."""
        table = self._token_bytes
        n = len(table)
        parts = []
        for raw in ids:
            i = int(raw)
            if not 0 <= i < n:
                self._check_id(i)
            if skip_special and i in self._skip_on_decode:
                continue
            parts.append(table[i])
        return b"".join(parts).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)


class StreamDecoder:
    """Turns ids arriving one at a time into text deltas, holding back incomplete UTF-8 characters.

    `feed(id)` returns the new text (possibly ''); `flush()` returns whatever is still held (an
    unfinished character becomes U+FFFD). Concatenating every delta equals `decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        tok = self._tokenizer
        if self._skip_special and tok.is_special(token_id):
            return ""
        return self._utf8.decode(tok.token_bytes(token_id))

    def feed_many(self, ids: Iterable[int]) -> str:
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished character are held back."""
        return bool(self._utf8.getstate()[0])


# ---------------------------------------------------------------------------------- merge cache
#
# A SentencePiece vocabulary (Gemma) has no merges in the file: ~515k of them are rebuilt from 262k
# tokens in Python, about half of the tokenizer's build time. They depend only on the vocabulary, so
# they are kept on disk (the spellings, NUL-separated), keyed by a hash of the tokenizer metadata (the
# same vocabulary in another quantization of a model shares the entry). An unreadable, truncated or
# damaged file is ignored and rebuilt; writes go through a temporary file and a rename, so two
# processes never see half a file. Not cached: the `tokenizers` JSON (Tokenizer.from_str is slower
# than constructing the BPE from the merge list) and byte-level merges (already in the file).

CACHE_ENV = "MINECART_TOKENIZER_CACHE"  # a folder for the merge cache, or "off" to disable it
_CACHE_FORMAT = b"minecart-merges-v2\n"  # bump when the merge rules of a builder change
_DIGEST_BYTES = 32


def tokenizer_cache_dir() -> Path | None:
    """Folder of the merge cache (platformdirs user cache, e.g. ~/.cache/minecart/tokenizers), or None
    when `MINECART_TOKENIZER_CACHE=off`."""
    override = os.environ.get(CACHE_ENV)
    if override is not None and override.strip():
        if override.strip().lower() in ("off", "0", "none", "false"):
            return None
        return Path(override)
    try:
        import platformdirs
    except ImportError:
        return None
    return platformdirs.user_cache_path("minecart", appauthor=False) / "tokenizers"


def _cache_key(kind: str, tokens: Sequence[str], extra: Sequence[str]) -> str:
    """Hex SHA-256 over everything the merge list depends on."""
    h = hashlib.sha256(_CACHE_FORMAT + kind.encode() + b"\0")
    for part in (tokens, extra):
        h.update(len(part).to_bytes(8, "little"))
        h.update("\0".join(part).encode("utf-8", "surrogatepass"))  # no vocabulary token holds a NUL
    return h.hexdigest()


def _read_merges(path: Path) -> list[tuple[str, str]] | None:
    """The cached merges, or None when the file is missing or not a valid entry."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    head = len(_CACHE_FORMAT)
    if len(blob) < head + _DIGEST_BYTES or not blob.startswith(_CACHE_FORMAT):
        return None
    digest, payload = blob[head : head + _DIGEST_BYTES], blob[head + _DIGEST_BYTES :]
    if hashlib.sha256(payload).digest() != digest:
        return None
    if not payload:
        return []
    try:
        parts = payload.decode("utf-8", "surrogatepass").split("\0")
    except UnicodeDecodeError:
        return None
    if len(parts) % 2:
        return None
    spellings = iter(parts)
    return list(zip(spellings, spellings, strict=True))  # consecutive (left, right) pairs, built in C


def _write_merges(path: Path, merges: Sequence[tuple[str, str]]) -> None:
    from itertools import chain

    # spellings NUL-separated: no vocabulary token holds a NUL, and a join is C-speed (looking the
    # spellings up again as ids would cost as much as the rebuild's own lookups)
    payload = "\0".join(chain.from_iterable(merges)).encode("utf-8", "surrogatepass")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_CACHE_FORMAT + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_merges(key: str, build: Callable[[], list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """`build()`'s merge list, read from the cache entry `key` when a valid one exists, else built
    and stored. The key must cover everything the merges depend on (`_cache_key`)."""
    folder = tokenizer_cache_dir()
    path = folder / f"{key}.merges" if folder is not None else None
    if path is not None:
        merges = _read_merges(path)
        if merges is not None:
            return merges
    merges = build()
    if path is not None:
        try:
            _write_merges(path, merges)
        except OSError as exc:  # read-only home, full disk: the next start rebuilds, nothing breaks
            log.info("tokenizer merge cache not written to %s (%s)", path, exc)
    return merges


# ---------------------------------------------------------------------------------- builders


def _added_tokens(tokens: Sequence[str], types: Sequence[int], in_vocab: Mapping[str, int]) -> tuple[list, list]:
    """AddedToken lists (control, user_defined), matched in raw text before normalisation."""
    from tokenizers import AddedToken

    control, user = [], []
    for tok, ty in zip(tokens, types, strict=True):
        if ty == TOKEN_CONTROL and tok:
            control.append(AddedToken(tok, special=True, normalized=False))
        elif ty == TOKEN_USER_DEFINED and tok and tok in in_vocab:
            user.append(AddedToken(tok, special=False, normalized=False))
    return control, user


def _build_byte_level(metadata: Mapping[str, Any], tokens: list[str], types: list[int], source: str):
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in BYTE_LEVEL_PRE_TOKENIZERS:
        raise TokenizerError(
            f"{source}: pre-tokenizer '{pre}' (key 'tokenizer.ggml.pre') is unknown to minecart; known: "
            f"{', '.join(sorted(BYTE_LEVEL_PRE_TOKENIZERS))}. Guessing would give wrong token ids."
        )
    split, nfc, ignore_merges = BYTE_LEVEL_PRE_TOKENIZERS[pre]

    vocab = first_index_map(tokens)
    # Not cached: checking the file's merges costs about what reading them back from the cache does
    # (measured on Qwen3.5's 247k merges; docs/first-run.md).
    merges = []
    bad = []
    for line in typed_list(metadata, "tokenizer.ggml.merges", str, source):
        left, _, right = line.partition(" ")
        # the tokenizers library panics (not raises) on a merge outside the vocabulary: check here
        if left in vocab and right in vocab and left + right in vocab:
            merges.append((left, right))
        else:
            bad.append(line)
    if bad:
        log.warning("%s: ignored %d merge rules naming tokens outside the vocabulary (first: %r)",
                    source, len(bad), bad[0])

    byte_chars = gpt2_byte_to_unicode()
    missing = [b for b, ch in byte_chars.items() if ch not in vocab]
    if missing:
        raise TokenizerError(
            f"{source}: byte-level vocabulary lacks the tokens for {len(missing)} of the 256 bytes "
            f"(first: 0x{missing[0]:02X}); text with those bytes could not be encoded. Re-convert the model."
        )

    backend = HFTokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False))
    if nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    control, user = _added_tokens(tokens, types, vocab)
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)

    # str.translate maps the byte alphabet back to Latin-1 code points, which then encode 1:1 to bytes.
    to_latin1 = str.maketrans({ch: chr(b) for b, ch in byte_chars.items()})
    token_bytes = []
    for t, ty in zip(tokens, types, strict=True):
        if ty in (TOKEN_NORMAL, TOKEN_BYTE):
            try:
                token_bytes.append(t.translate(to_latin1).encode("latin-1"))
                continue
            except UnicodeEncodeError:
                pass  # a character outside the byte alphabet: not a byte-level spelling
        # added tokens and padding entries are written as plain text, not in the byte alphabet
        token_bytes.append(t.encode("utf-8"))
    return backend, token_bytes


def _parse_byte_token(text: str) -> int | None:
    """0xNN for a SentencePiece byte token '<0xNN>', else None."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def _sentencepiece_merges(tokens: list[str], vocab: Mapping[str, int], order: Iterable[int]) -> list:
    """Merge rules implied by a SentencePiece-BPE vocabulary (the file stores none).

    Every way to cut a token into two vocabulary entries is a merge producing that token. `order`
    lists token ids best-first; a token's merges follow that order, longer left part first. This is
    the order transformers' GGUF loader uses, so the ids agree with it.
    """
    merges: list[tuple[str, str]] = []
    append = merges.append  # ~1.2M cuts and 2M dictionary probes for a 262k vocabulary: lean loop
    lookup = vocab.get
    for i in order:
        tok = tokens[i]
        n = len(tok)
        if n < 2 or lookup(tok) != i:
            continue  # single characters need no merge; a duplicate spelling belongs to its first id
        for cut in range(n - 1, 0, -1):  # longer left part first
            left = tok[:cut]
            if left in vocab:
                right = tok[cut:]
                if right in vocab:
                    append((left, right))
    return merges


def _build_sentencepiece(metadata: Mapping[str, Any], tokens: list[str], types: list[int], source: str):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    arch = str(metadata.get("general.architecture", ""))
    is_gemma = arch.startswith("gemma")
    spelled = list(tokens)
    if is_gemma:
        # Gemma files store tokens made of several spaces with real spaces ("  "); in the text they
        # are looked up after the space -> U+2581 rewrite, so spell them that way.
        spelled = [SPIECE_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = first_index_map(spelled)

    scores = typed_list(metadata, "tokenizer.ggml.scores", (int, float), source)
    if is_gemma or not scores or len(scores) != len(tokens):
        # Gemma's scores do not follow its merge order; the token order does (transformers finding).
        order: Iterable[int] = range(len(tokens))
    else:
        order = sorted(range(len(tokens)), key=lambda i: -float(scores[i]))  # stable: ties by id
    order_text = "id-order" if isinstance(order, range) else ",".join(map(str, order))
    key = _cache_key("llama", spelled, [order_text])
    merges = cached_merges(key, lambda: _sentencepiece_merges(spelled, vocab, order))

    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = HFTokenizer(
        BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", not is_gemma))
    if add_space_prefix:
        # Llama-2 style: one U+2581 in front of the first piece of text only.
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_SPACE, prepend_scheme="first", split=False)
    else:
        backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    control, user = _added_tokens(spelled, types, vocab)
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)

    token_bytes = []
    for t, ty in zip(tokens, types, strict=True):
        byte = _parse_byte_token(t) if ty == TOKEN_BYTE else None
        if byte is not None:
            token_bytes.append(bytes([byte]))
        elif ty in (TOKEN_CONTROL, TOKEN_UNUSED, TOKEN_UNKNOWN):
            token_bytes.append(t.encode("utf-8"))
        else:
            token_bytes.append(t.replace(SPIECE_SPACE, " ").encode("utf-8"))
    return backend, token_bytes
