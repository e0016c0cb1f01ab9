"""Models from Hugging Face: search GGUF repositories, list a repository's GGUF files with their sizes and
whether they fit this machine, and download one, resumable, into the models folder the library scans.

Everything here is blocking and thread-agnostic: the Download panel (app/download_panel.py) calls it
from a worker thread. The Hub is reached through huggingface_hub (`HfApi`, `hf_hub_url`, its HTTP
session and headers, so a logged-in token and HF_ENDPOINT work as in every Hugging Face tool); HF_ENDPOINT
is read at each call, so a test can point it at a stand-in server on loopback.

A download writes `<file>.gguf.part` beside the destination, asks for the missing bytes with an HTTP Range
header when a part is already there, checks the size and the LFS sha256 the Hub lists, and only then
renames the part to its `.gguf` name (the library never sees a half file). Cancelling keeps the part.

Whether a file suits this machine comes in two steps: `fit_text`, an estimate from the file size alone
for every file of a listing, and `plan_fit`, the planner's own verdict (the plan the layer map would
make, and its predicted tokens/s) from the file's header, fetched by Range requests for a file the
person picks.

Not here: widgets or threads (app/download_panel.py).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minecart.engine.devices import DeviceInfo, format_bytes
from minecart.engine.placement import MiB, device_overhead

DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK_BYTES = 1 * MiB
# What plan_auto keeps free on every device (its `reserve` default).
RESERVE_BYTES = 256 * MiB
# Weights are about the file's size; the KV cache at a 4K context, the recurrent state and the scratch of
# the models minecart runs add 5-15 % on top (placement.py prices them exactly once the file is here).
FIT_MARGIN = 1.15
# The GGUF header (metadata, vocabulary, tensor table) is read with Range requests starting at this many
# bytes, four times more each time it runs out; a 250k-token vocabulary makes it ~10 MB.
HEADER_FIRST_BYTES = 4 * MiB
HEADER_MAX_BYTES = 256 * MiB


class DownloadError(Exception):
    """A search, listing or download failed; the message says what to do."""


class DownloadCancelled(Exception):
    """The person cancelled; the part file is kept for a later resume."""


@dataclass(frozen=True)
class RemoteFile:
    repo: str
    path: str  # inside the repository
    size: int
    sha256: str | None = None  # from the Hub's LFS pointer; None for files outside LFS

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def is_mmproj(self) -> bool:
        return "mmproj" in self.name.lower()


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint())


def _readable(exc: Exception, what: str) -> DownloadError:
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if isinstance(exc, GatedRepoError):
        return DownloadError(f"{what}: the repository is gated; accept its licence on the Hugging Face "
                             "website and log in with `hf auth login`")
    if isinstance(exc, RepositoryNotFoundError):
        return DownloadError(f"{what}: no such model repository (check the spelling, 'owner/name'; "
                             "a private one needs `hf auth login`)")
    if isinstance(exc, HfHubHTTPError):
        return DownloadError(f"{what}: the Hub answered {exc}")
    return DownloadError(f"{what}: cannot reach {endpoint()} ({type(exc).__name__}: {exc})")


def search_repos(query: str, limit: int = 25) -> list[str]:
    """Ids ('owner/name') of GGUF model repositories matching `query`, most downloaded first."""
    query = query.strip()
    if not query:
        raise DownloadError("type part of a model's name to search, e.g. 'Qwen3.5 9B'")
    try:
        models = _api().list_models(search=query, filter="gguf", sort="downloads", limit=limit)
        return [m.id for m in models]
    except Exception as exc:  # noqa: BLE001 - every failure becomes a sentence
        raise _readable(exc, f"Searching for {query!r}") from exc


def list_gguf_files(repo: str) -> list[RemoteFile]:
    """The repository's GGUF files (every folder), sorted by path."""
    repo = repo.strip()
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise DownloadError(f"{repo!r} is not a repository id; write it as 'owner/name'")
    try:
        entries = list(_api().list_repo_tree(repo, recursive=True))
    except Exception as exc:  # noqa: BLE001
        raise _readable(exc, f"Listing {repo}") from exc
    files = []
    for e in entries:
        path = getattr(e, "path", "")
        if not path.lower().endswith(".gguf") or getattr(e, "size", None) is None:
            continue  # folders have no size
        lfs = getattr(e, "lfs", None)
        files.append(RemoteFile(repo, path, int(e.size), lfs.sha256 if lfs is not None else None))
    return sorted(files, key=lambda f: f.path)


def fit_text(size: int, devices: list[DeviceInfo]) -> str:
    """Whether a file of `size` bytes fits this machine's free memory, in words: on one GPU, across N
    GPUs, with some on the CPU, or not at all. Per GPU the room is its free memory less the CUDA
    context and plan_auto's reserve (engine/placement.py)."""
    need = int(size * FIT_MARGIN)
    rooms = sorted(((max(0, d.free_bytes - RESERVE_BYTES - device_overhead(d.id)), d)
                    for d in devices if d.kind == "cuda" and d.free_bytes > 0),
                   key=lambda x: x[0], reverse=True)
    if rooms and rooms[0][0] >= need:
        return f"fits on one GPU ({rooms[0][1].name})"
    gpu_room = 0
    for n, (room, _) in enumerate(rooms, 1):
        gpu_room += room
        if gpu_room >= need:
            return f"fits across {n} GPUs"
    cpu_room = sum(max(0, d.free_bytes - RESERVE_BYTES) for d in devices if d.kind == "cpu")
    if gpu_room + cpu_room >= need:
        if not rooms:
            return "runs on the CPU only (slow)"
        return f"{format_bytes(need - gpu_room)} on the CPU (slow)"
    return f"too big: needs ~{format_bytes(need)}, {format_bytes(gpu_room + cpu_room)} free"


@dataclass(frozen=True)
class PlanFit:
    """The planner's verdict on a remote file for this machine: whether its best plan fits, on which
    devices, and its predicted decode speed (engine/placement.py plan_candidates / predict_speed)."""

    fits: bool
    devices: tuple[str, ...]
    decode_tokens_per_s: float | None
    text: str  # the words the file list shows
    detail: str = ""  # why it does not fit (the planner's first error), for the tooltip


@contextmanager
def _get(file: RemoteFile, first_byte: int = 0, last_byte: int | None = None) -> Iterator[Any]:
    """A streamed GET of `file` from byte `first_byte` (to `last_byte`, inclusive), with the Hub's
    headers; a 4xx/5xx is raised as huggingface_hub's error. The response's status tells whether the
    server honoured the Range (206)."""
    from huggingface_hub import get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    headers = build_hf_headers()
    if first_byte or last_byte is not None:
        headers["Range"] = f"bytes={first_byte}-{'' if last_byte is None else last_byte}"
    url = hf_hub_url(file.repo, file.path, endpoint=endpoint())
    with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=30.0) as r:
        if r.status_code >= 400:
            r.read()
            hf_raise_for_status(r)
        yield r


def _header_prefix(file: RemoteFile, cancel: threading.Event) -> bytes:
    """The file's first bytes, enough to hold the whole GGUF header (metadata and tensor table): asked
    for with growing Range requests until engine/model_library's header reader no longer runs out."""
    import tempfile

    from minecart.engine import model_library as ml

    want = min(HEADER_FIRST_BYTES, file.size)
    with tempfile.TemporaryDirectory(prefix="minecart-header-") as tmp:
        probe = Path(tmp) / "prefix.gguf"
        while True:
            if cancel.is_set():
                raise DownloadCancelled("cancelled")
            chunks, got = [], 0
            try:
                with _get(file, 0, want - 1) as r:
                    for chunk in r.iter_bytes(CHUNK_BYTES):  # a server ignoring Range: stop early
                        chunks.append(chunk)
                        got += len(chunk)
                        if got >= want or cancel.is_set():
                            break
            except Exception as exc:  # noqa: BLE001
                raise _readable(exc, f"Reading the header of {file.name}") from exc
            prefix = b"".join(chunks)[:want]
            if prefix[:4] != ml.GGUF_MAGIC:
                raise DownloadError(f"{file.name} is not a GGUF file (it does not start with 'GGUF')")
            probe.write_bytes(prefix)
            try:
                ml.read_header(probe)
                return prefix
            except ValueError as exc:  # a cut-off header reads as truncated or oversized: ask for more
                if want >= min(file.size, HEADER_MAX_BYTES):
                    raise DownloadError(f"{file.name} is not a readable GGUF file ({exc})") from exc
            want = min(want * 4, file.size, HEADER_MAX_BYTES)


def _device_specs(devices: list[DeviceInfo]):
    """What the planner needs per device, as the layer map prices it (layer_map.device_spec: the card's
    speed and link from resources/gpu_profiles.json when the card is known there; unknown cards are
    priced as placement's UNKNOWN_GPU)."""
    from .layer_map import device_spec

    return [device_spec(d) for d in devices]


def plan_fit(file: RemoteFile, devices: list[DeviceInfo], context: int = 4096,
             cancel: threading.Event | None = None) -> PlanFit:
    """Plan `file` on `devices` as the layer map would once it is downloaded, from its header alone:
    the header is fetched with Range requests into a sparse stand-in of the file's full size (the
    tensor data is never fetched or read), priced as the load will hold it (engine/execution.py
    costs_for_devices), and plan_candidates picks the fastest plan that fits."""
    import tempfile

    from minecart.engine.execution import costs_for_devices
    from minecart.engine.model import open_model_file
    from minecart.engine.placement import plan_candidates, validate

    from .layer_map import DEFAULT_KV_TYPE

    cancel = cancel or threading.Event()
    specs = _device_specs(devices)
    if not specs:
        raise DownloadError("no devices to plan on")
    prefix = _header_prefix(file, cancel)
    with tempfile.TemporaryDirectory(prefix="minecart-plan-") as tmp:
        standin = Path(tmp) / file.name
        with open(standin, "wb") as fh:
            fh.write(prefix)
            # sparse on Linux and macOS file systems: the header's offsets stay valid and no data is
            # written (on NTFS the size is reserved, not written)
            fh.truncate(file.size)
        try:
            gf, config = open_model_file(standin)
        except Exception as exc:  # noqa: BLE001 - the engine's message names the key or tensor
            raise DownloadError(f"{file.name} cannot be planned: {exc}") from exc
        try:
            costs = costs_for_devices(config, gf, [s.name for s in specs])  # as the load will hold it
        finally:
            gf.close()
    best = plan_candidates(costs, specs, context=context, kv_type=DEFAULT_KV_TYPE)[0]
    used = tuple(best.plan.devices_used())
    speed = best.speed.decode_tokens_per_s
    where = " + ".join(used)
    if best.fits:
        return PlanFit(True, used, speed, f"fits on {where} · ~{speed:.0f} tok/s")
    errors = [i.message for i in validate(best.plan, specs) if i.severity == "error"]
    return PlanFit(False, used, speed, f"does not fit at {context} tokens of context",
                   errors[0] if errors else "")


def download_folder(model_folders: list[str], data_dir: Path) -> Path:
    """Where downloads go: the first model folder the person chose, else `<data dir>/models`."""
    return Path(model_folders[0]).expanduser() if model_folders else Path(data_dir) / "models"


def destination(file: RemoteFile, folder: Path) -> Path:
    """`folder/owner/name/path`, the layout LM Studio uses, so two repos' same-named files never clash.
    A name that would land outside `folder` (a '..' from a hostile mirror) is refused."""
    owner, name = file.repo.split("/")
    root = Path(folder).resolve()
    dest = (root / owner / name / file.path).resolve()
    if root not in dest.parents or ".." in Path(file.path).parts or ".." in (owner, name):
        raise DownloadError(f"refusing to save {file.repo}/{file.path}: the name leads outside {root}")
    return dest


def part_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def _hash_file(path: Path, cancel: threading.Event) -> hashlib._Hash:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK_BYTES):
            if cancel.is_set():
                raise DownloadCancelled("cancelled")
            h.update(chunk)
    return h


def download(file: RemoteFile, folder: Path, progress: Callable[[int, int], None] | None = None,
             cancel: threading.Event | None = None) -> Path:
    """Fetch `file` into `folder` (see `destination`), resuming a part left by an earlier try.
    `progress(done_bytes, total_bytes)` is called from this thread after every chunk. Raises
    DownloadCancelled when `cancel` is set (the part stays), DownloadError on any failure."""
    cancel = cancel or threading.Event()
    progress = progress or (lambda done, total: None)
    dest = destination(file, folder)  # before any request: a bad name fails without network
    if dest.is_file() and dest.stat().st_size == file.size:
        progress(file.size, file.size)
        return dest
    part = part_path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DownloadError(f"Cannot create {dest.parent}: {exc.strerror or exc}") from exc
    have = part.stat().st_size if part.is_file() else 0
    if have > file.size:
        part.unlink()
        have = 0
    digest = _hash_file(part, cancel) if have and file.sha256 else hashlib.sha256()
    try:
        with _get(file, have) as r:
            if have and r.status_code != 206:  # the server ignored the Range: start over
                have = 0
                digest = hashlib.sha256()
            progress(have, file.size)
            with open(part, "ab" if have else "wb") as out:
                for chunk in r.iter_bytes(CHUNK_BYTES):
                    if cancel.is_set():
                        raise DownloadCancelled("cancelled")
                    out.write(chunk)
                    digest.update(chunk)
                    have += len(chunk)
                    progress(have, file.size)
    except (DownloadCancelled, DownloadError):
        raise
    except OSError as exc:
        raise DownloadError(f"Writing {part} failed: {exc.strerror or exc} (is the disk full?)") from exc
    except Exception as exc:  # noqa: BLE001 - network and Hub errors become a sentence
        raise _readable(exc, f"Downloading {file.name}") from exc
    if have != file.size:
        raise DownloadError(f"Downloading {file.name} stopped at {format_bytes(have)} of "
                            f"{format_bytes(file.size)}; press Download again to resume")
    if file.sha256 and digest.hexdigest() != file.sha256:
        part.unlink()
        raise DownloadError(f"{file.name} arrived damaged (its sha256 differs from the Hub's); the "
                            "partial file was removed, press Download to fetch it again")
    os.replace(part, dest)
    return dest


__all__ = ["DownloadCancelled", "DownloadError", "PlanFit", "RemoteFile", "destination", "download",
           "download_folder", "endpoint", "fit_text", "list_gguf_files", "part_path", "plan_fit",
           "search_repos"]
