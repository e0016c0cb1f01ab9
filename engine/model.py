"""Model and load_model: a GGUF file opened, its weights placed on backends, ready to run.

The runner here is architecture-agnostic: it asks the model module (engine/models/<arch>.py) which
tensors each part needs ("global" = embedding, "layer.<i>", "head" = final norm + LM head), loads each
part on its own backend, and runs the parts in order, moving the hidden state through the host when
two consecutive parts sit on different backends. Sequence state lives in sessions (session.py); the
generate loop in generation.py; sampling in sampling.py.

What this file is not: a scheduler. One call runs one sequence on the calling thread; the runtime
(one thread owning the model) serializes requests.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .backends.base import LayerState
from .chat_template import ChatTemplate
from .config import ModelConfig, validate_tensors
from .errors import GenerationCancelled, GGUFError, TokenizerError, UnsupportedArchitectureError
from .execution import (
    Executor,
    device_specs,  # the devices' free memory, for --experts-on auto
    hold_as_priced,
    make_backend,
    normalize_device,
    part_names,
    plan_devices,
    resolve_devices,
)
from .experts import ExpertsApart
from .generation import generate
from .gguf_file import GGUFFile
from .kvquant import DEFAULT_KV_TYPE, check_kv_type
from .models import module_for, spec_for
from .models.spec import GDN, ArchSpec
from .placement import (
    CPU_WEIGHTS,
    STREAMED_EXPERTS_CHUNK,
    Placement,
    check_experts_on,
    experts_map,
    fill_experts,
    model_costs,
    streams_experts,
)
from .sampling import LaunchedStep, PickSpec, compile_candidate_loop
from .session import Session, initial_capacity
from .tokenizer import Tokenizer
from .vision import VisionTower, attach_vision

_NOT_LOADED = object()


def _load_tokenizer(gf):
    try:
        return Tokenizer.from_gguf(gf)
    except TokenizerError:
        return None  # e.g. synthetic test models without tokenizer metadata: run by token ids


def _warm_lm_head(backend, head_weights: dict) -> None:
    """Let a backend that decodes the LM head on first use (NumPy: the tied embedding to float32) do it
    now, inside the load, instead of inside the first token."""
    for wt in head_weights.values():
        backend.prepare_lm_head(wt)


def _load_chat_template(gf):
    if gf.get("tokenizer.ggml.tokens") is None:
        return None  # no tokenizer at all; a file with one but no template gets a built-in template
    return ChatTemplate.from_gguf(gf)


class _KVTypedBackend:
    """A layer's backend whose new_kv_cache makes `kv_type` caches, so model modules' new_layer_state
    (config, backend, i, capacity) need not know about KV types. Everything else passes through."""

    def __init__(self, backend, kv_type: str):
        self._backend = backend
        self._kv_type = kv_type

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def new_kv_cache(self, n_kv_heads, head_dim, value_dim, capacity):
        return self._backend.new_kv_cache(n_kv_heads, head_dim, value_dim, capacity, kv_type=self._kv_type)


def _with_kv_type(backend, kv_type: str):
    return backend if kv_type == "f32" else _KVTypedBackend(backend, kv_type)


class Model:
    """A loaded model. Attributes: config, tokenizer and chat_template (built on first access), path,
    placement (as given; None = automatic), device_plan (part -> device in use), backends (part ->
    backend), weights (part -> {gguf name: Weight}), module, executor (the stages that run it),
    load_seconds."""

    def __init__(self, path, gguf: GGUFFile, config: ModelConfig, module, plan: dict[str, str],
                 backends: dict, weights: dict, placement, roles):
        self.executor = Executor(config, module, plan, backends, _run_weights(weights))
        self.path = Path(path)
        self.gguf = gguf
        self.config = config
        self.module = module
        self.device_plan = plan
        self.backends = backends
        self.weights = weights
        self._tokenizer = _NOT_LOADED
        self._chat_template = _NOT_LOADED
        self._lazy_lock = threading.Lock()
        self.placement = placement
        self._roles = roles
        self.load_seconds = 0.0
        self.vision: VisionTower | None = None  # engine.vision.VisionTower when an mmproj was loaded (load_model(mmproj=))
        self.kv_type = DEFAULT_KV_TYPE  # KV cache type of new states (load_model(kv_type=))

    # ---- text side (built on first use: a 248k-entry BPE vocabulary takes seconds to build, and
    # logits-only users such as tests and benchmarks never need it) --------------------------------
    @property
    def tokenizer(self):
        """engine.tokenizer.Tokenizer, or None when the file has no usable tokenizer metadata."""
        with self._lazy_lock:
            if self._tokenizer is _NOT_LOADED:
                self._tokenizer = _load_tokenizer(self.gguf)
            return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer = value

    @property
    def chat_template(self):
        """engine.chat_template.ChatTemplate, or None when the file has no template."""
        with self._lazy_lock:
            if self._chat_template is _NOT_LOADED:
                self._chat_template = _load_chat_template(self.gguf)
            return self._chat_template

    @chat_template.setter
    def chat_template(self, value) -> None:
        self._chat_template = value

    @property
    def is_base_model(self) -> bool:
        """True for a pretrained (not instruction-tuned) model: its file carries no chat template and
        its name says nothing of instruct/chat tuning. Such models continue text; clients say so."""
        if self.gguf.get("tokenizer.chat_template"):
            return False
        text = " ".join(str(self.gguf.get(k, "")) for k in ("general.name", "general.finetune",
                                                             "general.tags")).lower()
        # whole words only: "gemma-3-270m-it" and "Instruct" count, "Italian" or "chatterbox" do not
        return re.search(r"\b(it|instruct|instruction|chat)\b", text) is None

    # ---- running ---------------------------------------------------------------------------------
    def backend_of(self, part: str):
        return self.backends[part]

    def forward(self, ids, states, positions, *, rows: str | None = "last", hidden_hook=None,
                chunk: int | None = None, cancel=None, embed_override=None, top: int = 0):
        """Run `ids` through every part, updating `states` (one per layer) in place: the executor's
        forward (engine/execution.py), the one route every caller takes.

        rows: "last" -> logits (1, vocab) of the last token; "all" -> (T, vocab); None -> no head.
        chunk / cancel: tokens per run and a threading.Event checked between runs. hidden_hook(index,
        host_array) receives the residual stream after the embedding (0) and after each layer (1..L).
        embed_override (rows (n,), values (n, H)): host arrays replacing those rows of the token
        embeddings (image embeddings at `<|image_pad|>` tokens); use (3, T) M-RoPE positions with it.
        top > 0 (rows "last"): the last token's `top` largest logits (sampling.TopLogits) instead.
        Returns host float32 logits, TopLogits or None."""
        return self.executor.forward(ids, states, positions, rows=rows, hidden_hook=hidden_hook,
                                     chunk=chunk, cancel=cancel, embed_override=embed_override, top=top)

    def launch_decode(self, token: int, states, positions, top: int = 0,
                      pick: PickSpec | None = None) -> LaunchedStep:
        """One decode step launched without a host wait where the device allows it (the executor's
        launch_decode): result() gives what forward([token], ...) would have returned; with `pick` the
        device also draws the next token (TopLogits.picks)."""
        return self.executor.launch_decode(token, states, positions, top=top, pick=pick)

    def launch_next(self, states, positions, top: int, pick: PickSpec) -> LaunchedStep | None:
        """The step of the previous step's device pick, launched on the device before the host has it
        (the executor's launch_next), or None when that is not possible."""
        return self.executor.launch_next(states, positions, top=top, pick=pick)

    def new_state(self, capacity: int | None = None, kv_type: str | None = None) -> list:
        # default: the whole context limit of a planned model (its memory estimate assumed it; see
        # engine/session.py initial_capacity), so a session's caches never grow past the plan
        cap = capacity or initial_capacity(self)
        kv_type = kv_type or self.kv_type
        states: list[LayerState] = []
        try:
            for i in range(self.config.n_layers):
                states.append(self.module.new_layer_state(
                    self.config, _with_kv_type(self.backends[f"layer.{i}"], kv_type), i, cap))
        except BaseException:
            self._free_states(states)  # no half-made session keeps device memory (or a rig's charge)
            raise
        return states

    def logits(self, token_ids, positions=None, embed_override=None) -> np.ndarray:
        """Full logit rows (T, vocab) float32 for a fresh sequence (no session state is touched).
        positions / embed_override as for forward (images); default positions 0..T-1."""
        ids = [int(t) for t in token_ids]
        if not ids:
            return np.zeros((0, self.config.vocab_size), np.float32)
        states = self.new_state(len(ids))
        pos = np.arange(len(ids)) if positions is None else np.asarray(positions)
        try:
            return self.forward(ids, states, pos, rows="all", embed_override=embed_override)
        finally:
            self._free_states(states)

    def hidden_states(self, token_ids, positions=None, embed_override=None) -> dict[str, np.ndarray]:
        """Debug/test view of a fresh forward pass: "layers" (L+1, T, H) = embeddings then the output
        of each layer, "final" (T, H) = the LM head's input (after the final norm)."""
        ids = [int(t) for t in token_ids]
        states = self.new_state(max(len(ids), 1))
        layers: list[np.ndarray] = []
        pos = np.arange(len(ids)) if positions is None else np.asarray(positions)
        try:
            self.forward(ids, states, pos, rows=None, hidden_hook=lambda i, h: layers.append(h),
                         embed_override=embed_override)
        finally:
            self._free_states(states)
        be = self.backends["head"]
        final = self.module.final_norm(self.config, be, self.weights["head"], be.asarray(layers[-1]))
        return {"layers": np.stack(layers), "final": be.to_numpy(final)}

    def _free_states(self, states: list[LayerState]) -> None:
        for i, st in enumerate(states):
            be = self.backends[f"layer.{i}"]
            if st.kv is not None:
                be.free(st.kv)
            for arr in st.recurrent.values():
                be.free(arr)

    def new_session(self, capacity: int | None = None, kv_type: str | None = None):
        return Session(self, capacity=capacity, kv_type=kv_type)

    def generate(self, prompt, params=None, session=None, cancel=None, enable_thinking: bool = True,
                 **prompt_extras):
        """Yield GenerationEvents for a prompt (token ids, text, or chat messages); see generation.py.
        prompt_extras: positions / embed_override for prompts with images (token ids only)."""
        return generate(self, prompt, params, session=session, cancel=cancel,
                        enable_thinking=enable_thinking, **prompt_extras)

    # ---- placement -------------------------------------------------------------------------------
    def reload_placement(self, placement, *, progress=None, cancel=None) -> None:
        """Move parts whose device changed to their new device. Existing sessions keep state on the
        old devices and must be recreated afterwards."""
        new_plan = plan_devices(self.config, placement)
        new_plan.update({p: d for p, d in self.device_plan.items() if p.endswith(EXPERTS_SUFFIX)})
        moved = [p for p in new_plan if new_plan[p] != self.device_plan.get(p)]
        backends = {p: _unwrapped(b) for p, b in self.backends.items()}
        by_device = {self.device_plan[p]: backends[p] for p in backends}
        for p in moved:
            dev = new_plan[p]
            if dev not in by_device:
                by_device[dev] = make_backend(dev)
            backends[p] = by_device[dev]
        if isinstance(placement, Placement):  # the moved parts are held as the new plan priced them
            hold_as_priced({new_plan[p]: by_device[new_plan[p]] for p in moved}, placement.costs.layout)
        kept = {p: ws for p, ws in self.weights.items() if p not in moved}
        new_weights = _load_parts(self.gguf, {p: self._roles[p] for p in moved}, backends,
                                  spec_for(self.config.architecture),
                                  progress=progress, cancel=cancel, shared_from=kept,
                                  shared_roles=self._roles)
        for p in moved:
            for wt in self.weights[p].values():
                if not _used_elsewhere(wt, p, self.weights, moved):
                    self.backends[p].free(wt)
            self.weights[p] = new_weights[p]
        for proxy in {id(b): b for b in self.backends.values() if isinstance(b, ExpertsApart)}.values():
            proxy.close()  # the new wiring makes its own (engine/experts.py)
        self.backends = _wire_experts(new_plan, backends, self.weights)
        self.device_plan = new_plan
        self.placement = placement
        self.executor.close()  # the old split's workers and bridges
        self.executor = Executor(self.config, self.module, new_plan, self.backends,
                                 _run_weights(self.weights))

    def close(self) -> None:
        """Release device memory; the Model is unusable afterwards."""
        if self.vision is not None:
            self.vision.close()
            self.vision = None
        self.executor.close()
        for proxy in {id(b): b for b in self.backends.values() if isinstance(b, ExpertsApart)}.values():
            proxy.close()  # its staging buffers and page-locked expert copies (engine/experts.py)
        for part, ws in self.weights.items():
            be = self.backends.get(part)
            for wt in ws.values():
                if be is not None:
                    be.free(wt)
        self.weights = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        devices = sorted(set(self.device_plan.values()))
        return f"Model({self.path.name!r}, {self.config.architecture}, devices={devices})"


EXPERTS_SUFFIX = ".experts"  # the part of a layer's routed-expert block placed apart ("layer.<i>.experts")


def _unwrapped(backend):
    return backend.inner if isinstance(backend, ExpertsApart) else backend


def _wire_experts(plan: dict[str, str], backends: dict, weights: dict) -> dict:
    """part -> backend, where every device that runs a layer whose experts sit on another device has
    one ExpertsApart proxy (shared by all its parts) holding those experts' weights."""
    proxies: dict[str, ExpertsApart] = {}
    for part, edev in plan.items():
        if not part.endswith(EXPERTS_SUFFIX):
            continue
        layer = part[: -len(EXPERTS_SUFFIX)]
        dev = plan[layer]
        if dev == edev:
            continue  # experts back beside their layer: the device's own moe runs them
        if dev not in proxies:
            proxies[dev] = ExpertsApart(_unwrapped(backends[layer]), backends[part])
        proxies[dev].hold(weights[part])
    return {p: proxies[d] if d in proxies and not p.endswith(EXPERTS_SUFFIX) else _unwrapped(backends[p])
            for p, d in plan.items()}


def _run_weights(weights: dict) -> dict:
    """The weights the executor runs a layer with: a layer part's own, plus its routed experts when
    they sit in a part of their own (the model's layer function reads them by name either way)."""
    if not any(p.endswith(EXPERTS_SUFFIX) for p in weights):
        return weights
    out = {p: ws for p, ws in weights.items() if not p.endswith(EXPERTS_SUFFIX)}
    for p, ws in weights.items():
        if p.endswith(EXPERTS_SUFFIX):
            layer = p[: -len(EXPERTS_SUFFIX)]
            out[layer] = {**out[layer], **ws}
    return out


def _used_elsewhere(wt, part, weights, moved) -> bool:
    return any(w2 is wt for p, ws in weights.items() if p != part and p not in moved for w2 in ws.values())


def _load_parts(gf: GGUFFile, roles: dict, backends: dict, spec: ArchSpec, *, progress=None, cancel=None,
                shared_from: dict | None = None, shared_roles: dict | None = None) -> dict:
    """{part: {name: Weight}}. A tensor needed by two parts on the same backend with the same role is
    loaded once (the tied embedding / LM head). The weights of each of the spec's fused groups that a
    part holds (the projections one matmul_many call reads) are loaded together, through
    Backend.load_fused, which lays them out as one array. Each part's loads run inside its backend's
    part_arena, given the tensors it will load (the CUDA backend puts them in one device allocation).
    On cancel, everything loaded here is freed."""
    total = sum(len(r) for r in roles.values()) or 1
    loaded: dict = {}  # (id(backend), name, role) -> weight
    if shared_from and shared_roles:  # weights already loaded (reload_placement): reuse, not reload
        for part, ws in shared_from.items():
            be = backends[part]
            for name, wt in ws.items():
                loaded.setdefault((id(be), name, shared_roles[part][name]), wt)
    fresh = []
    out: dict = {}
    done = 0
    try:
        for part, part_roles in roles.items():
            be = backends[part]
            out[part] = {}
            grouped = {members[0]: members for members in spec.fused_members(part_roles)}
            in_group = {n for members in grouped.values() for n in members}
            # the part's loads: a tensor, or a group at its first member (loaded with it)
            steps = [grouped.get(name, (name,)) for name in part_roles
                     if name not in in_group or name in grouped]
            keys = {n: (id(be), n, part_roles[n]) for n in part_roles}
            todo = [n for names in steps if any(keys[m] not in loaded for m in names) for n in names]
            with be.part_arena([(gf.tensor(n), part_roles[n]) for n in todo]):
                for names in steps:
                    if cancel is not None and cancel.is_set():
                        raise GenerationCancelled(f"{gf.path}: loading cancelled")
                    wts = [loaded.get(keys[n]) for n in names]
                    if names[0] in todo:  # a group is loaded whole, never in pieces
                        if len(names) > 1:
                            wts = be.load_fused([gf.tensor(n) for n in names])
                        else:
                            wts = [be.load_weight(gf.tensor(names[0]), role=part_roles[names[0]])]
                        for n, wt in zip(names, wts, strict=True):
                            loaded[keys[n]] = wt
                            fresh.append((be, wt))
                    for n, wt in zip(names, wts, strict=True):
                        out[part][n] = wt
                        done += 1
                        if progress is not None:
                            progress(done / total, f"{part}: {n}")
    except BaseException:
        for be, wt in fresh:
            be.free(wt)
        raise
    # keep the part's tensors in role order (what callers iterate over)
    return {part: {n: out[part][n] for n in part_roles} for part, part_roles in roles.items()}


def open_model_file(path) -> tuple[GGUFFile, ModelConfig]:
    """The opened GGUF and its config, after every check that needs only the header: the format, the
    architecture and each tensor's presence, type and shape. Reads no weights (milliseconds), so the
    runtime can refuse a broken file before it unloads the model that works."""
    gf = GGUFFile(path)
    try:
        if gf.architecture == "clip":  # the most likely mix-up: the picture half of a vision model
            raise UnsupportedArchitectureError(
                gf.path, "this is a vision projector (mmproj), not a language model: open the model's "
                "own GGUF and give this file as its projector (--mmproj FILE; an mmproj-*.gguf beside "
                "the model is found by itself)", key="general.architecture")
        if not gf.tensors:  # before the config, whose checks would call it corrupt
            raise GGUFError(gf.path, "this is a vocabulary-only GGUF: it holds a tokenizer and "
                            "hyper-parameters but no weights (convert_hf_to_gguf.py --vocab-only writes "
                            "such files, for tokenizer tests), so there is nothing to run; `minecart "
                            "inspect` shows what it holds; open the model's full GGUF instead")
        config = ModelConfig.from_gguf(gf)
        # Wrong or truncated files fail here with the tensor's name, not inside a layer's matmul.
        validate_tensors(config, gf)
    except BaseException:
        gf.close()
        raise
    return gf, config


def check_model_file(path) -> None:
    """Raise the error load_model would raise for a broken or unsupported file, without loading it."""
    gf, _ = open_model_file(path)
    gf.close()


def load_model(path, placement=None, devices=None, *, backend=None,
               progress: Callable[[float, str], None] | None = None, cancel=None,
               mmproj=None, max_image_tokens: int | None = None, kv_type: str | None = None,
               experts: str | None = None, context: int | None = None,
               cpu_weights: str | None = None) -> Model:
    """Open a GGUF model and load its weights.

    placement: a part -> device plan (see plan_devices); devices: device strings to spread the layers
    over (default: cuda:0 when available, else cpu:0); backend: one ready Backend instance for every
    part (tests, custom backends). progress(fraction, message) is called while weights load; when
    `cancel` (threading.Event) is set, loading stops and raises GenerationCancelled with nothing kept.
    mmproj: the vision projector GGUF (path); None = an mmproj-*.gguf beside the model that fits it,
    if any; False = none. It ends up as `model.vision` (engine/vision); max_image_tokens caps the
    image tokens per picture (default engine.vision.DEFAULT_MAX_IMAGE_TOKENS). kv_type: the KV cache
    of every session: "f16", "q8_0", "q3" (3-bit) or "f32" (exact), engine/kvquant.py; None = the
    placement's when one is given (the plan that was priced is the plan that runs), else "f16".
    experts: where MoE layers' routed experts and routers go, apart from their layer (engine/experts.py):
    "host" (host RAM, cpu:0), a device for all of them, "N" (the first N MoE layers keep theirs, the
    rest in host RAM) or "auto" (the GPUs keep as many layers' experts as fit; placement.fill_experts);
    None = the placement's per-layer experts map, else with their layer.
    context: the context limit in tokens (engine/session.py context_limit: every session is allocated
    for it and never holds more); it replaces the placement's context; None = the placement's (4096
    when no placement is given).
    cpu_weights: how a model on the CPU alone holds its matmul weights when no placement is given
    (CPU_WEIGHTS): "float32" (None: decoded copies, the reference, exact) or "stored" (as the file
    stores them, int8 activations on engine/cpu_experts.py's kernels: 4-7x less RAM, ~3x the decode
    speed). Beside a GPU the CPU's layers are always held as stored; a given placement's
    costs.layout decides for itself.
    """
    t0 = time.perf_counter()
    if cpu_weights is not None and cpu_weights not in CPU_WEIGHTS:
        raise ValueError(f"cpu_weights '{cpu_weights}' is not known; use one of {', '.join(CPU_WEIGHTS)}")
    if kv_type is None:
        kv_type = placement.kv_type if isinstance(placement, Placement) else DEFAULT_KV_TYPE
    if experts is not None:
        experts = check_experts_on(experts)
    check_kv_type(kv_type)
    gf, config = open_model_file(path)
    module = module_for(config.architecture)
    if backend is not None:
        plan = {p: str(backend.device) for p in part_names(config)}
        backends = dict.fromkeys(plan, backend)
        by_device = {str(backend.device): backend}
    else:
        # several devices without a plan get one here (an MoE model's may put experts in host RAM)
        placement, plan, by_device = resolve_devices(config, gf, placement, devices, plan_experts=experts is None,
                                                     cpu_weights=cpu_weights)
        backends = {p: by_device[d] for p, d in plan.items()}
    apart: dict[str, str] | None = None  # "layer.N" -> the device of its routed experts, when apart
    if experts is None and isinstance(placement, Placement) and placement.experts:
        apart = dict(placement.experts)  # the plan put these layers' routed experts there
    roles = spec_for(config.architecture).tensor_roles(config, set(gf.tensors),
                                                       experts_apart=experts is not None or bool(apart))
    if context is not None and not isinstance(placement, Placement):
        # backend= without a plan: the one-device plan, to carry the context
        layout = "numpy" if str(backend.device).startswith("cpu") else "stored"
        placement = Placement.single(model_costs(config, gf, layout=layout), str(backend.device))
    if isinstance(placement, Placement):
        # the plan says what runs: its context is the context limit (engine/session.py), and it
        # prices the KV cache type the sessions get
        placement = placement.with_settings(
            context=placement.context if context is None else int(context), kv_type=kv_type)
    if experts is not None:  # --experts-on: host, auto, N (layers that keep theirs) or a device
        moe_layers = [p[: -len(EXPERTS_SUFFIX)] for p in roles if p.endswith(EXPERTS_SUFFIX)]

        def streamed(where: dict[str, str]) -> bool:  # layer -> its experts' device
            return streams_experts({**plan, **{f"{p}{EXPERTS_SUFFIX}": d for p, d in where.items()}})

        if experts == "auto" and not isinstance(placement, Placement):  # backend= without a plan
            placement = Placement.single(model_costs(config, gf), str(backend.device))
        # streamed experts prefill in longer runs (STREAMED_EXPERTS_CHUNK): the plan prices their activations
        longer = placement.with_settings(chunk=max(placement.chunk, STREAMED_EXPERTS_CHUNK)) \
            if isinstance(placement, Placement) else None
        if experts == "auto":
            assert longer is not None
            specs = device_specs(devices if devices is not None else list(by_device))
            # the GPUs are filled after the longer runs' activations, unless every layer's experts fit anyway
            apart = fill_experts(longer, specs)
            if streamed(apart):
                placement = longer
            else:
                apart = fill_experts(placement, specs)
        else:
            apart = experts_map(experts, moe_layers)
            if longer is not None and streamed(apart):
                placement = longer
        if isinstance(placement, Placement):
            placement = placement.with_settings(experts=apart)  # model.placement says where they are
    if apart is not None:
        for part in roles:
            if part.endswith(EXPERTS_SUFFIX):
                layer = part[: -len(EXPERTS_SUFFIX)]
                edev = normalize_device(apart.get(layer, plan[layer]))
                if edev not in by_device:
                    by_device[edev] = make_backend(edev)
                plan[part] = edev
                backends[part] = by_device[edev]
    distinct = list({id(b): b for b in backends.values()}.values())  # each backend once
    if kv_type != "f32":  # fail before loading weights when a device or the head dims cannot take it
        for be in distinct:
            be.free(be.new_kv_cache(config.n_kv_heads, config.head_dim, config.value_head_dim, 1,
                                    kv_type=kv_type))
    if progress is not None:
        progress(0.0, f"opening {Path(path).name}")
    weights = _load_parts(gf, roles, backends, spec_for(config.architecture), progress=progress,
                          cancel=cancel)
    if progress is not None:
        # A caller that shows progress (app, CLI, server) has a person waiting: decode a lazily
        # decoded LM head now, not inside the first token. Logits-only callers (tests) stay lazy.
        # (Building the tokenizer on a thread beside the weights was measured slower on 2 cores:
        # its Python loops hold the GIL, and every NumPy call of the weight load waits for it.)
        _warm_lm_head(backends["head"], weights["head"])
        gdn_runners = {id(backends[f"layer.{i}"]) for i, kind in enumerate(config.layer_types) if kind == GDN}
        for be in distinct:
            be.prepare_kernels(id(be) in gdn_runners)
        compile_candidate_loop()  # the host's picks from top logits (engine/sampling.py)
    backends = _wire_experts(plan, backends, weights)
    model = Model(path, gf, config, module, plan, backends, weights, placement, roles)
    model.kv_type = kv_type
    if mmproj is not False:
        try:
            model.vision = attach_vision(path, config, backends["global"], mmproj,
                                         max_image_tokens=max_image_tokens)
        except BaseException:
            model.close()
            raise
    model.load_seconds = time.perf_counter() - t0
    if progress is not None:
        progress(1.0, "loaded")
    return model
