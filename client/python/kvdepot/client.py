"""kvdepot.Client: the RPCs of libkvdepot for Python, NumPy in and out.

K and V travel in kvdepot's wire layout, [layer][token][kv_head][head_dim]
row-major: a C-contiguous NumPy array of shape (layers, tokens, kv_heads,
head_dim) in the model's dtype (float16, float32, or uint16 holding bfloat16
bits) is sent from its own memory, without a copy. Reads come back as
arrays over the buffer libkvdepot received them into (freed when the arrays
are). Every failure raises a kvdepot.errors exception.
"""
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ._native import ffi, lib
from .errors import InvalidArgument, error_for

Id = Union[str, bytes]

_DTYPE_BY_NAME = {"f16": lib.KVDEPOT_DTYPE_F16, "bf16": lib.KVDEPOT_DTYPE_BF16,
                  "f32": lib.KVDEPOT_DTYPE_F32}
_NAME_BY_DTYPE = {v: k for k, v in _DTYPE_BY_NAME.items()}
_NUMPY_BY_DTYPE = {lib.KVDEPOT_DTYPE_F16: np.float16, lib.KVDEPOT_DTYPE_BF16: np.uint16,
                   lib.KVDEPOT_DTYPE_F32: np.float32}
_CODEC = {"raw": lib.KVDEPOT_CODEC_RAW, "int2": lib.KVDEPOT_CODEC_INT2,
          "int4": lib.KVDEPOT_CODEC_INT4, "vq": lib.KVDEPOT_CODEC_VQ}
_AXIS = {"default": lib.KVDEPOT_AXIS_DEFAULT, "token": lib.KVDEPOT_AXIS_TOKEN,
         "channel": lib.KVDEPOT_AXIS_CHANNEL}
_SERVING = {lib.KVDEPOT_SERVING_UNKNOWN: "UNKNOWN", lib.KVDEPOT_SERVING: "SERVING",
            lib.KVDEPOT_NOT_SERVING: "NOT_SERVING", lib.KVDEPOT_SERVICE_UNKNOWN: "SERVICE_UNKNOWN"}


@dataclass
class Model:
    """A registered shape profile (kvdepot.v1.Model)."""
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "f16"
    num_q_heads: int = 0
    hidden_size: int = 0
    revision: str = ""
    created_unix_ms: int = 0


@dataclass
class SequenceInfo:
    """The state of a sequence (kvdepot.v1.SequenceInfo)."""
    id: bytes
    model: str
    num_tokens: int
    layer_tokens: List[int] = field(default_factory=list)
    page_tokens: int = 0
    sealed_pages: int = 0
    stored_bytes: int = 0
    created_unix_ms: int = 0
    prefix_blocks: int = 0
    activation_tokens: int = 0
    pq_index_bytes: int = 0  # the PQ index (centroids, early codes), part of stored_bytes
    # How the sequence stores its pages, as the server reports them (None
    # from a server that does not): group sizes and axes resolved.
    codecs: Optional["Codecs"] = None
    # XXH3-64 of the artifact snapshot it codes with (0 = none), and the kept
    # SVD width of every (layer, kv head) of K and of V, layer-major.
    artifacts_fingerprint: int = 0
    svd_widths: Tuple[List[int], List[int]] = ((), ())
    # Appends with create= only: whether that call made the sequence (False:
    # it existed, and the append went on as without create); None elsewhere.
    created: Optional[bool] = None


@dataclass
class Codecs:
    """How a sequence's pages are stored once they seal (kvdepot_codecs).
    k, v: "raw", "int2", "int4" or "vq"; group: 8, 16, 32, 64 or 128 (0 = 64,
    smaller for small heads);
    axis: "default" (channel where the group divides the page size, else
    token), "token" or "channel"; stochastic rounding
    with seed; VQ sub-vector width and bits (the model needs calibrated
    codebooks); raw_sink_tokens: leading tokens kept raw; pq_m > 0 builds
    the PQ index Search and SparseAttend use (pq_bits 4, 6 or 8), trained
    once a layer holds pq_min_train_tokens tokens (0 = 4096: the same index
    whatever the chunking of a prefill)."""
    k: str = "raw"
    v: str = "raw"
    k_group: int = 0
    v_group: int = 0
    k_axis: str = "default"
    v_axis: str = "default"
    stochastic: bool = False
    seed: int = 0
    vq_sub_dim: int = 0
    vq_bits: int = 0
    raw_sink_tokens: int = 0
    pq_m: int = 0
    pq_bits: int = 0
    pq_iterations: int = 0
    pq_min_train_tokens: int = 0


@dataclass
class HeadTokens:
    """The tokens Search chose for one kv head, best first, with their
    approximate scores."""
    kv_head: int
    tokens: np.ndarray
    scores: np.ndarray


@dataclass
class FetchPlan:
    """PlanFetch: send activations for tokens [0, split_tokens), K/V for the
    rest; the predicted time, and that of a plain K/V fetch."""
    split_tokens: int
    num_tokens: int
    predicted_seconds: float
    kv_only_seconds: float
    recompute_seconds: float
    activation_bytes: int
    kv_bytes: int


@dataclass
class AttendResult:
    """Attention of one query: output (num_q_heads, head_dim) and the
    log-sum-exp (num_q_heads) of the scores, over num_tokens tokens."""
    output: np.ndarray
    lse: np.ndarray
    num_tokens: int


def _raise(rc: int, client=None) -> None:
    """Raise the exception of status rc with the calling thread's message."""
    msg = lib.kvdepot_errmsg(client if client else ffi.NULL)
    raise error_for(rc, ffi.string(msg).decode(errors="replace") if msg else "")


def _id(sid: Id) -> bytes:
    b = sid.encode() if isinstance(sid, str) else bytes(sid)
    if not b:
        raise InvalidArgument("sequence id: must not be empty", -3, "INVALID_ARGUMENT")
    return b


def _model_of(m) -> Model:
    return Model(name=ffi.string(m.name).decode(), num_layers=m.num_layers,
                 num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                 dtype=_NAME_BY_DTYPE.get(m.dtype, str(m.dtype)), num_q_heads=m.num_q_heads,
                 hidden_size=m.hidden_size, revision=ffi.string(m.revision).decode(),
                 created_unix_ms=m.created_unix_ms)


def _codecs_of(c) -> Codecs:
    """A reported kvdepot_codecs as Codecs (seed and VQ shape from the side
    that has them)."""
    name = {v: k for k, v in _CODEC.items()}
    axis = {v: k for k, v in _AXIS.items()}
    vq = c.k if c.k.codec == lib.KVDEPOT_CODEC_VQ else c.v
    rnd = c.k if c.k.stochastic else c.v
    return Codecs(k=name.get(c.k.codec, "?"), v=name.get(c.v.codec, "?"),
                  k_group=c.k.group_size, v_group=c.v.group_size,
                  k_axis=axis.get(c.k.axis, "?"), v_axis=axis.get(c.v.axis, "?"),
                  stochastic=bool(rnd.stochastic), seed=rnd.seed if rnd.stochastic else 0,
                  vq_sub_dim=vq.vq_sub_dim, vq_bits=vq.vq_bits,
                  raw_sink_tokens=c.raw_sink_tokens, pq_m=c.pq_m, pq_bits=c.pq_bits,
                  pq_iterations=c.pq_iterations, pq_min_train_tokens=c.pq_min_train_tokens)


def _info_of(s) -> SequenceInfo:
    widths = tuple([side.svd_widths[i] for i in range(side.svd_num_widths)]
                   for side in (s.codecs.k, s.codecs.v))
    return SequenceInfo(
        id=bytes(ffi.buffer(s.id, s.id_len)), model=ffi.string(s.model).decode(),
        num_tokens=s.num_tokens,
        layer_tokens=[s.layer_tokens[i] for i in range(s.num_layers)] if s.layer_tokens else [],
        page_tokens=s.page_tokens, sealed_pages=s.sealed_pages, stored_bytes=s.stored_bytes,
        created_unix_ms=s.created_unix_ms, prefix_blocks=s.prefix_blocks,
        activation_tokens=s.activation_tokens, pq_index_bytes=s.pq_index_bytes,
        codecs=_codecs_of(s.codecs) if s.have_codecs else None,
        artifacts_fingerprint=s.artifacts_fingerprint, svd_widths=widths)


def _bad(msg: str) -> InvalidArgument:
    return InvalidArgument(msg, -3, "INVALID_ARGUMENT")


def _codecs_c(c: Codecs):
    out = ffi.new("kvdepot_codecs *")
    for side, codec, group, axis in ((out.k, c.k, c.k_group, c.k_axis),
                                     (out.v, c.v, c.v_group, c.v_axis)):
        if codec not in _CODEC or axis not in _AXIS:
            raise _bad(f"codecs: {codec!r} / axis {axis!r}: codec raw, int2, int4 or vq; "
                       "axis default, token or channel")
        side.codec, side.group_size, side.axis = _CODEC[codec], group, _AXIS[axis]
        side.stochastic, side.seed = int(c.stochastic), c.seed
        side.vq_sub_dim, side.vq_bits = c.vq_sub_dim, c.vq_bits
    out.raw_sink_tokens = c.raw_sink_tokens
    out.pq_m, out.pq_bits, out.pq_iterations = c.pq_m, c.pq_bits, c.pq_iterations
    out.pq_min_train_tokens = c.pq_min_train_tokens
    return out


def _heads_of(r) -> List[HeadTokens]:
    heads = []
    for i in range(r.num_heads):
        h = r.heads[i]
        t = np.frombuffer(ffi.buffer(h.tokens, 8 * h.count), dtype=np.uint64).copy()
        s = np.frombuffer(ffi.buffer(h.scores, 4 * h.count), dtype=np.float32).copy()
        heads.append(HeadTokens(h.kv_head, t, s))
    return heads


def prefix_hashes(token_ids: Sequence[int], page_tokens: int = 256) -> np.ndarray:
    """The prefix-index hash chain of token ids: one uint64 per complete
    block of page_tokens tokens (the server's page size), as the server
    computes it from Append's token_ids."""
    ids = np.ascontiguousarray(np.asarray(token_ids, dtype=np.uint32))
    out = np.zeros(max(len(ids) // page_tokens, 1) if page_tokens else 1, dtype=np.uint64)
    n = lib.kvdepot_prefix_hash_chain(ffi.cast("const uint32_t *", ffi.from_buffer(ids)),
                                      len(ids), page_tokens,
                                      ffi.cast("uint64_t *", ffi.from_buffer(out)))
    return out[:n]


@dataclass
class Artifact:
    """One calibration artifact of a model (kvdepot_artifact): kind (one of
    ARTIFACT_KINDS), layer, kv_head and its f32 array."""
    kind: str
    layer: int
    kv_head: int
    data: np.ndarray


ARTIFACT_KINDS = {"key_smoothing": 1, "vq_codebook_k": 2, "vq_codebook_v": 3,
                  "svd_rotation_k": 4, "svd_rotation_v": 5, "svd_spectrum_k": 6,
                  "svd_spectrum_v": 7}
_KIND_NAME = {v: k for k, v in ARTIFACT_KINDS.items()}


@dataclass
class CalibrationError:
    """Relative reconstruction errors of one (layer, kv head) after Calibrate."""
    layer: int
    kv_head: int
    vq_k: float
    vq_v: float
    svd_k: float
    svd_v: float
    svd_width_k: int
    svd_width_v: int


@dataclass
class CodecChoice:
    """One side's codec in Calibrate's advice: codec "raw", "int2", "int4"
    or "vq"; group and axis ("token", "channel") for INT; the VQ shape; a
    removal rate > 0 means raw after an SVD reduction at that rate."""
    codec: str
    group: int = 0
    axis: str = "default"
    vq_sub_dim: int = 0
    vq_bits: int = 0
    svd_removal_rate: float = 0.0


@dataclass
class CodecEvaluation:
    """A candidate measured on one layer's held-out sample, the other side
    exact: bits per value as stored, attention-output error
    ||o - o^||^2 / ||o||^2."""
    choice: CodecChoice
    bits_per_value: float
    attention_error: float


@dataclass
class LayerAdvice:
    """Every candidate of K and of V on one layer, the recommended pair
    (fewest bits within the budget, measured with both coded) and, with
    exhaustive=True, the best of all pairs."""
    layer: int
    k: List[CodecEvaluation]
    v: List[CodecEvaluation]
    k_recommended: CodecChoice
    v_recommended: CodecChoice
    bits_per_value: float
    attention_error: float
    k_best: Optional[CodecChoice] = None
    v_best: Optional[CodecChoice] = None
    best_bits_per_value: float = 0.0
    best_attention_error: float = 0.0


@dataclass
class CodecAdvice:
    """Calibrate's codec advice: per layer, and one K/V pair for the whole
    model (within the budget on every layer); codecs() gives it as the
    Codecs of a new sequence."""
    error_budget: float
    eval_tokens: int
    eval_queries: int
    layers: List[LayerAdvice]
    k: CodecChoice
    v: CodecChoice
    bits_per_value: float
    max_attention_error: float

    def codecs(self) -> "Codecs":
        """The model-wide pair as Codecs (ValueError for an SVD choice,
        which Codecs does not express)."""
        if self.k.svd_removal_rate or self.v.svd_removal_rate:
            raise ValueError("the advice reduces by SVD, which Codecs does not express")
        vq = self.k if self.k.codec == "vq" else self.v
        return Codecs(k=self.k.codec, v=self.v.codec, k_group=self.k.group,
                      v_group=self.v.group, k_axis=self.k.axis, v_axis=self.v.axis,
                      vq_sub_dim=vq.vq_sub_dim, vq_bits=vq.vq_bits)


@dataclass
class CalibrateResult:
    samples: int
    artifacts: int
    errors: List[CalibrationError]
    advice: Optional[CodecAdvice] = None


def _choice_of(s) -> CodecChoice:
    name = {v: k for k, v in _CODEC.items()}
    axis = {v: k for k, v in _AXIS.items()}
    return CodecChoice(name.get(s.codec, "?"), s.group_size, axis.get(s.axis, "?"),
                       s.vq_sub_dim, s.vq_bits, s.svd_removal_rate)


def _advice_of(a) -> CodecAdvice:
    layers = []
    for i in range(a.n_layers):
        x = a.layers[i]
        evs = [[CodecEvaluation(_choice_of(e.codec), e.bits_per_value, e.attention_error)
                for e in (arr[j] for j in range(n))] for arr, n in ((x.k, x.n_k), (x.v, x.n_v))]
        best = x.best_bits_per_value > 0
        layers.append(LayerAdvice(x.layer, evs[0], evs[1], _choice_of(x.k_recommended),
                                  _choice_of(x.v_recommended), x.bits_per_value,
                                  x.attention_error,
                                  _choice_of(x.k_best) if best else None,
                                  _choice_of(x.v_best) if best else None,
                                  x.best_bits_per_value, x.best_attention_error))
    return CodecAdvice(a.error_budget, a.eval_tokens, a.eval_queries, layers, _choice_of(a.k),
                       _choice_of(a.v), a.bits_per_value, a.max_attention_error)


def _model_c(model: "Model"):
    m = ffi.new("kvdepot_model *")
    name, rev = model.name.encode(), model.revision.encode()
    if len(name) > lib.KVDEPOT_NAME_MAX or len(rev) > lib.KVDEPOT_NAME_MAX:
        raise InvalidArgument("model name or revision longer than %d bytes"
                              % lib.KVDEPOT_NAME_MAX, -3, "INVALID_ARGUMENT")
    m.name = name
    m.revision = rev
    m.num_layers, m.num_kv_heads, m.head_dim = (model.num_layers, model.num_kv_heads,
                                                model.head_dim)
    m.num_q_heads, m.hidden_size = model.num_q_heads, model.hidden_size
    if model.dtype not in _DTYPE_BY_NAME:
        raise InvalidArgument(f"dtype: {model.dtype!r} is not f16, bf16 or f32", -3,
                              "INVALID_ARGUMENT")
    m.dtype = _DTYPE_BY_NAME[model.dtype]
    return m


def _artifacts_c(artifacts: Sequence[Artifact]):
    """A kvdepot_artifact array over the artifacts' f32 arrays (kept alive
    by the returned list)."""
    a = ffi.new("kvdepot_artifact[]", max(len(artifacts), 1))
    keep = [a]
    for i, art in enumerate(artifacts):
        if art.kind not in ARTIFACT_KINDS:
            raise _bad(f"artifact {i}: kind {art.kind!r} is not one of {sorted(ARTIFACT_KINDS)}")
        d = np.ascontiguousarray(np.asarray(art.data, dtype=np.float32))
        if d.ndim not in (1, 2):
            raise _bad(f"artifact {i}: {d.ndim}-d data; artifacts are 1-d or 2-d")
        a[i].kind, a[i].layer, a[i].kv_head = ARTIFACT_KINDS[art.kind], art.layer, art.kv_head
        a[i].ndim = d.ndim
        a[i].shape[0] = d.shape[0]
        a[i].shape[1] = d.shape[1] if d.ndim == 2 else 0
        buf = ffi.from_buffer(d)
        a[i].data = ffi.cast("float *", buf)
        keep += [d, buf]
    return a, keep


def _pages_out(pages, count) -> List[bytes]:
    try:
        return [bytes(ffi.buffer(pages[0][i].data, pages[0][i].len)) for i in range(count[0])]
    finally:
        lib.kvdepot_pages_free(pages[0], count[0])


def encode_pages(model: "Model", k, v, *, layer: int, token_start: int = 0,
                 page_tokens: int = 256, codecs: Optional[Codecs] = None,
                 artifacts: Sequence[Artifact] = ()) -> List[bytes]:
    """Encode K and V of one layer, each (tokens, kv_heads, head_dim) in the
    model's dtype, into pages of page_tokens tokens with the server's own
    encoder (whole blocks coded with codecs, partial ones raw); VQ and SVD
    need the model's artifacts. The pages go to Client.append_pages."""
    ka, va = _kv_array(k, "k", 3), _kv_array(v, "v", 3)
    if ka.shape != va.shape:
        raise _bad(f"k {ka.shape} and v {va.shape}: want equal (tokens, kv_heads, head_dim)")
    m = _model_c(model)
    cc = _codecs_c(codecs) if codecs is not None else ffi.NULL
    arts, keep = _artifacts_c(artifacts)
    pages, count = ffi.new("kvdepot_page **"), ffi.new("size_t *")
    rc = lib.kvdepot_encode_pages_with_artifacts(
        m, cc, arts, len(artifacts), page_tokens, layer, token_start, ka.shape[0],
        ffi.from_buffer(ka), ffi.from_buffer(va), pages, count)
    if rc:
        _raise(rc)
    return _pages_out(pages, count)


def attention_local(q, k, v, *, scale: float = 0.0, dtype: Optional[str] = None
                    ) -> Tuple[np.ndarray, np.ndarray]:
    """Attention of q (num_q_heads, head_dim) over K and V of one layer,
    each (tokens, kv_heads, head_dim), with the server's CPU kernels:
    (output (num_q_heads, head_dim), lse (num_q_heads)), f32."""
    qa = np.ascontiguousarray(np.asarray(q, dtype=np.float32))
    ka, va = _kv_array(k, "k", 3), _kv_array(v, "v", 3)
    if ka.shape != va.shape or qa.ndim != 2 or qa.shape[1] != ka.shape[2]:
        raise _bad(f"q {qa.shape}, k {ka.shape}, v {va.shape} do not fit")
    if dtype is None:
        dtype = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}.get(ka.dtype)
    out = np.empty(qa.shape, np.float32)
    lse = np.empty(qa.shape[0], np.float32)
    rc = lib.kvdepot_attention_local(
        _DTYPE_BY_NAME[dtype], qa.shape[0], ka.shape[1], qa.shape[1], scale,
        ffi.cast("const float *", ffi.from_buffer(qa)), ffi.from_buffer(ka), ffi.from_buffer(va),
        ka.shape[0], ffi.cast("float *", ffi.from_buffer(out)),
        ffi.cast("float *", ffi.from_buffer(lse)))
    if rc:
        _raise(rc)
    return out, lse


def attention_merge(out_a, lse_a, out_b, lse_b) -> Tuple[np.ndarray, np.ndarray]:
    """Combine attention over two disjoint token ranges by log-sum-exp."""
    oa = np.array(out_a, dtype=np.float32, order="C")
    la = np.array(lse_a, dtype=np.float32, order="C")
    ob = np.ascontiguousarray(np.asarray(out_b, dtype=np.float32))
    lb = np.ascontiguousarray(np.asarray(lse_b, dtype=np.float32))
    if oa.ndim != 2 or oa.shape != ob.shape or la.shape != (oa.shape[0],) or lb.shape != la.shape:
        raise _bad(f"out {oa.shape}/{ob.shape} and lse {la.shape}/{lb.shape} do not fit")
    rc = lib.kvdepot_attention_merge(oa.shape[0], oa.shape[1],
                                     ffi.cast("float *", ffi.from_buffer(oa)),
                                     ffi.cast("float *", ffi.from_buffer(la)),
                                     ffi.cast("const float *", ffi.from_buffer(ob)),
                                     ffi.cast("const float *", ffi.from_buffer(lb)))
    if rc:
        _raise(rc)
    return oa, la


def transfer_threads(n: int) -> None:
    """Most threads libkvdepot's transfer pool runs (1..256, default 8)."""
    rc = lib.kvdepot_transfer_threads(n)
    if rc:
        _raise(rc)


def _create_into(a, create, ttl_seconds, codecs):
    """An append's create= into its C arguments a (create and created); what
    must stay alive with them, or None without create."""
    if create is None:
        if ttl_seconds or codecs is not None:
            raise _bad("ttl_seconds and codecs are for create=")
        return None
    ca = ffi.new("kvdepot_create_args *")
    mb = ffi.new("char[]", create.encode())
    ca.model, ca.ttl_seconds = mb, ttl_seconds
    cc = _codecs_c(codecs) if codecs is not None else None
    if cc is not None:
        ca.codecs = cc
    a.create = ca
    cr = ffi.new("int *")
    a.created = cr
    return (ca, mb, cc, cr)


def _set_created(info: "SequenceInfo", a) -> "SequenceInfo":
    """info.created from an append's kvdepot_append_args (create= only)."""
    if a.created != ffi.NULL:
        info.created = bool(a.created[0])
    return info


class Transfer:
    """An append or read in flight (Client.append_start, read_start): done()
    polls, wait() blocks until it completed and raises its error (appends
    return the SequenceInfo as that append's commit left it: appends of
    other layers in flight may land after it). Wait on every transfer once; the client must
    stay open until then."""

    def __init__(self, client, t, keep, is_append: bool):
        self._c, self._t, self._keep, self._append = client, t, keep, is_append
        self._result = None

    def done(self) -> bool:
        return self._t is None or bool(lib.kvdepot_transfer_poll(self._t))

    def wait(self) -> Optional["SequenceInfo"]:
        if self._t is None:
            return self._result
        info = ffi.new("kvdepot_sequence_info *")
        t, self._t = self._t, None
        try:
            self._c._check(lib.kvdepot_transfer_wait(t, info))
            self._result = _info_of(info) if self._append else None
            if self._append:
                _set_created(self._result, self._keep[0])
            return self._result
        finally:
            lib.kvdepot_sequence_info_clear(info)
            self._keep = None

    def __del__(self):
        if getattr(self, "_t", None) is not None:  # never leave a transfer behind
            lib.kvdepot_transfer_wait(self._t, ffi.NULL)


class EngineHashes:
    """An engine's own names for its blocks (vLLM's sha256 chain, ...):
    `hashes`, one bytes object per engine block, all of one length (1..64),
    at `block_tokens` tokens a block (a divisor of the server's page size).
    A page is known by the name of its last engine block, so names must
    stand for the whole prefix up to their block, as chained hashes do.
    The server keys them by tenant and model."""

    def __init__(self, hashes: Sequence[bytes], block_tokens: int):
        self.hashes = [bytes(h) for h in hashes]
        self.block_tokens = int(block_tokens)
        lens = {len(h) for h in self.hashes}
        if len(lens) > 1:
            raise InvalidArgument(f"engine hashes: lengths {sorted(lens)} differ; give one length",
                                  -3, "INVALID_ARGUMENT")
        self._buf = b"".join(self.hashes)

    def _fill(self, c) -> None:
        """Point a kvdepot_engine_hashes at these names (kept alive by self)."""
        self._cbuf = ffi.from_buffer(self._buf)
        c.bytes = ffi.cast("const uint8_t *", self._cbuf) if self._buf else ffi.NULL
        c.len = len(self.hashes[0]) if self.hashes else 0
        c.num = len(self.hashes)
        c.block_tokens = self.block_tokens


def _kv_array(a, what: str, ndim: int = 4) -> np.ndarray:
    """A C-contiguous array, as given: (layers, tokens, kv_heads, head_dim),
    or with ndim 3 one layer's (tokens, heads, head_dim). PyTorch CPU
    tensors come through their own buffer."""
    arr = np.asarray(a)
    if arr.ndim != ndim:
        want = "(layers, tokens, kv_heads, head_dim)" if ndim == 4 else "(tokens, heads, head_dim)"
        raise InvalidArgument(f"{what}: shape {arr.shape}, want {want}", -3, "INVALID_ARGUMENT")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


class Client:
    """A connection to kvdepotd (or, with several endpoints in the address,
    to a sharded set of them; see libkvdepot). Use as a context manager or
    call close()."""

    def __init__(self, address: str, *, token: Optional[str] = None,
                 deadline_ms: Optional[int] = None, wait_for_ready: bool = False,
                 tls: bool = False, tls_ca_file: Optional[str] = None,
                 tls_cert_file: Optional[str] = None, tls_key_file: Optional[str] = None,
                 tls_server_name: Optional[str] = None):
        opt = ffi.new("kvdepot_options *")
        lib.kvdepot_options_init(opt)
        keep = []

        def cstr(s):
            if s is None:
                return ffi.NULL
            c = ffi.new("char[]", s.encode())
            keep.append(c)
            return c

        opt.address = cstr(address)
        if deadline_ms is not None:
            opt.deadline_ms = deadline_ms
        opt.wait_for_ready = int(wait_for_ready)
        opt.tls = int(tls)
        opt.tls_ca_file = cstr(tls_ca_file)
        opt.tls_cert_file = cstr(tls_cert_file)
        opt.tls_key_file = cstr(tls_key_file)
        opt.tls_server_name = cstr(tls_server_name)
        opt.token = cstr(token)
        out = ffi.new("kvdepot_client **")
        rc = lib.kvdepot_connect(opt, out)
        if rc:
            _raise(rc)
        self._c = out[0]

    # ---- plumbing ----

    def _check(self, rc: int) -> None:
        if rc:
            _raise(rc, self._c)

    def _client(self):
        if not self._c:
            raise error_for(-14, "client closed")
        return self._c

    def close(self) -> None:
        """Close the connection; later calls raise Unavailable."""
        if getattr(self, "_c", None):
            lib.kvdepot_close(self._c)
            self._c = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    # ---- health, models ----

    def health(self, service: str = "") -> str:
        """gRPC health: "SERVING", "NOT_SERVING", ..."""
        out = ffi.new("kvdepot_serving *")
        self._check(lib.kvdepot_health_check(self._client(), service.encode(), out))
        return _SERVING.get(out[0], str(out[0]))

    def put_model(self, model: Model, replace: bool = False) -> Tuple[Model, bool]:
        """Register a model; returns it as stored and whether it was created."""
        m = _model_c(model)
        out = ffi.new("kvdepot_model *")
        created = ffi.new("int *")
        self._check(lib.kvdepot_model_put(self._client(), m, int(replace), out, created))
        return _model_of(out), bool(created[0])

    def list_models(self) -> List[Model]:
        out, n = ffi.new("kvdepot_model **"), ffi.new("size_t *")
        self._check(lib.kvdepot_model_list(self._client(), out, n))
        try:
            return [_model_of(out[0][i]) for i in range(n[0])]
        finally:
            lib.kvdepot_free(out[0])

    def get_model(self, name: str) -> Model:
        out = ffi.new("kvdepot_model *")
        self._check(lib.kvdepot_model_get(self._client(), name.encode(), out))
        return _model_of(out)

    def delete_model(self, name: str, force: bool = False) -> int:
        """Delete a model (force: with its sequences); the sequences deleted."""
        n = ffi.new("uint64_t *")
        self._check(lib.kvdepot_model_delete(self._client(), name.encode(), int(force), n))
        return n[0]

    # ---- sequences ----

    def _info_call(self, fn, *args) -> SequenceInfo:
        info = ffi.new("kvdepot_sequence_info *")
        try:
            self._check(fn(self._client(), *args, info))
            return _info_of(info)
        finally:
            lib.kvdepot_sequence_info_clear(info)

    def create_sequence(self, sid: Id, model: str, *, ttl_seconds: int = 0,
                        codecs: Optional[Codecs] = None,
                        prefix_hashes: Optional[Sequence[int]] = None,
                        engine_prefix: Optional[EngineHashes] = None) -> SequenceInfo:
        """Create a sequence of `model`: its codecs (default raw), a time to
        live, and optionally the stored prefix it starts from (a hash
        chain, see prefix_hashes and lookup, or engine block names in whole
        pages, see EngineHashes and engine_lookup)."""
        b = _id(sid)
        a = ffi.new("kvdepot_create_args *")
        idb, mb = ffi.from_buffer(b), ffi.new("char[]", model.encode())
        a.id, a.id_len, a.model, a.ttl_seconds = idb, len(b), mb, ttl_seconds
        cc = _codecs_c(codecs) if codecs is not None else None
        if cc is not None:
            a.codecs = cc
        hs = None
        if prefix_hashes is not None and len(prefix_hashes):
            hs = np.ascontiguousarray(np.asarray(prefix_hashes, dtype=np.uint64))
            a.prefix_hashes = ffi.cast("const uint64_t *", ffi.from_buffer(hs))
            a.num_prefix_hashes = len(hs)
        if engine_prefix is not None:
            engine_prefix._fill(a.engine_prefix)
        return self._info_call(lib.kvdepot_sequence_create, a)

    def engine_lookup(self, model: str, hashes: EngineHashes) -> Tuple[int, int]:
        """How many leading engine blocks of a chain of engine block names
        (from block 0) the server stores for `model`, in whole pages:
        (engine blocks, tokens)."""
        c = ffi.new("kvdepot_engine_hashes *")
        hashes._fill(c)
        nb, nt = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        self._check(lib.kvdepot_engine_lookup(self._client(), model.encode(), c, nb, nt))
        return nb[0], nt[0]

    def lookup(self, model: str, hashes: Sequence[int]) -> Tuple[int, int]:
        """How many leading blocks of a hash chain the server stores for
        `model`: (blocks, tokens)."""
        hs = np.ascontiguousarray(np.asarray(hashes, dtype=np.uint64))
        nb, nt = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        self._check(lib.kvdepot_prefix_lookup(
            self._client(), model.encode(),
            ffi.cast("const uint64_t *", ffi.from_buffer(hs)) if len(hs) else ffi.NULL, len(hs),
            nb, nt))
        return nb[0], nt[0]

    def stat(self, sid: Id) -> SequenceInfo:
        b = _id(sid)
        return self._info_call(lib.kvdepot_sequence_stat, ffi.from_buffer(b), len(b))

    def list_sequences(self, model: Optional[str] = None) -> List[SequenceInfo]:
        out = ffi.new("kvdepot_sequence_info **")
        n = ffi.new("size_t *")
        self._check(lib.kvdepot_sequence_list(self._client(),
                                              model.encode() if model else ffi.NULL, out, n))
        try:
            return [_info_of(out[0][i]) for i in range(n[0])]
        finally:
            lib.kvdepot_sequence_list_free(out[0], n[0])

    def delete_sequence(self, sid: Id) -> int:
        """Delete a sequence; the pages freed."""
        b = _id(sid)
        n = ffi.new("uint64_t *")
        self._check(lib.kvdepot_sequence_delete(self._client(), ffi.from_buffer(b), len(b), n))
        return n[0]

    def evict(self, sid: Id) -> Tuple[int, int]:
        """Move a sequence's pages out of the memory tiers: (pages, bytes)."""
        b = _id(sid)
        p, n = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        self._check(lib.kvdepot_sequence_evict(self._client(), ffi.from_buffer(b), len(b), p, n))
        return p[0], n[0]

    def append(self, sid: Id, k, v, *, token_start: int, layer_start: int = 0,
               dtype: Optional[str] = None,
               token_ids: Optional[Sequence[int]] = None,
               engine_hashes: Optional[EngineHashes] = None,
               create: Optional[str] = None, ttl_seconds: int = 0,
               codecs: Optional[Codecs] = None) -> SequenceInfo:
        """Append K and V, each (layers, tokens, kv_heads, head_dim) in the
        model's dtype, at token_start of layers [layer_start, +layers).
        dtype: "f16", "f32" or "bf16" (uint16 arrays of bfloat16 bits);
        default from the arrays. token_ids, or engine_hashes (the names of
        every engine block whose last token is in this append), register
        the pages it completes for prefix reuse. All or nothing.

        create: a model name; the sequence is created in the same call when
        it does not exist, with ttl_seconds and codecs as create_sequence
        takes them (one round trip to store a new object); a sequence so
        created is deleted again if the append fails. When the sequence
        exists it must be of that model (else FailedPrecondition), and the
        append goes on as without create. The SequenceInfo's `created` says
        which happened."""
        a, keep = self._append_args(sid, k, v, token_start, layer_start, dtype, token_ids,
                                    engine_hashes, create, ttl_seconds, codecs)
        return _set_created(self._info_call(lib.kvdepot_sequence_append, a), a)

    def append_start(self, sid: Id, k, v, *, token_start: int, layer_start: int = 0,
                     dtype: Optional[str] = None, token_ids: Optional[Sequence[int]] = None,
                     engine_hashes: Optional[EngineHashes] = None,
                     create: Optional[str] = None, ttl_seconds: int = 0,
                     codecs: Optional[Codecs] = None) -> "Transfer":
        """append() without waiting: returns a Transfer at once while the
        append runs on libkvdepot's transfer threads (an engine puts layer
        l while computing layer l + 1). k and v must not change until the
        transfer is done (the Transfer keeps them alive)."""
        a, keep = self._append_args(sid, k, v, token_start, layer_start, dtype, token_ids,
                                    engine_hashes, create, ttl_seconds, codecs)
        out = ffi.new("kvdepot_transfer **")
        self._check(lib.kvdepot_append_start(self._client(), a, ffi.NULL, ffi.NULL, out))
        return Transfer(self, out[0], (a, keep), True)

    def _append_args(self, sid, k, v, token_start, layer_start, dtype, token_ids, engine_hashes,
                     create=None, ttl_seconds=0, codecs=None):
        b = _id(sid)
        ka, va = _kv_array(k, "k"), _kv_array(v, "v")
        if ka.shape != va.shape or ka.dtype != va.dtype:
            raise InvalidArgument(f"k {ka.shape} {ka.dtype} and v {va.shape} {va.dtype} differ",
                                  -3, "INVALID_ARGUMENT")
        if dtype is None:
            dtype = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}.get(ka.dtype)
            if dtype is None:
                raise InvalidArgument(f"k, v: dtype {ka.dtype}: give dtype= (bf16: uint16 bits)",
                                      -3, "INVALID_ARGUMENT")
        a = ffi.new("kvdepot_append_args *")
        idb = ffi.from_buffer(b)
        kb, vb = ffi.from_buffer(ka), ffi.from_buffer(va)
        a.id, a.id_len = idb, len(b)
        a.layer_start, a.num_layers = layer_start, ka.shape[0]
        a.token_start, a.num_tokens = token_start, ka.shape[1]
        a.dtype = _DTYPE_BY_NAME[dtype]
        a.k, a.k_bytes, a.v, a.v_bytes = kb, ka.nbytes, vb, va.nbytes
        ids = None
        if token_ids is not None:
            ids = np.ascontiguousarray(np.asarray(token_ids, dtype=np.uint32))
            a.token_ids, a.num_token_ids = ffi.cast("const uint32_t *", ffi.from_buffer(ids)), \
                len(ids)
        if engine_hashes is not None:
            engine_hashes._fill(a.engine_hashes)
        made = _create_into(a, create, ttl_seconds, codecs)
        return a, (b, idb, ka, va, kb, vb, ids, engine_hashes, made)

    def _read_into_args(self, sid, k_out, v_out, layer_start, token_start, num_tokens):
        for name, arr in (("k_out", k_out), ("v_out", v_out)):
            if not isinstance(arr, np.ndarray) or arr.ndim != 4 or \
                    not arr.flags.c_contiguous or not arr.flags.writeable:
                raise _bad(f"{name}: a writable C-contiguous (layers, tokens, kv_heads, "
                           f"head_dim) array")
        if k_out.shape != v_out.shape or k_out.dtype != v_out.dtype:
            raise _bad(f"k_out {k_out.shape} and v_out {v_out.shape} differ")
        b = _id(sid)
        a = ffi.new("kvdepot_read_args *")
        idb = ffi.from_buffer(b)
        kb, vb = ffi.from_buffer(k_out), ffi.from_buffer(v_out)
        a.id, a.id_len = idb, len(b)
        a.layer_start, a.num_layers = layer_start, k_out.shape[0]
        a.token_start, a.num_tokens = token_start, num_tokens or k_out.shape[1]
        a.k, a.v, a.capacity = kb, vb, k_out.nbytes
        return a, (b, idb, kb, vb, k_out, v_out)

    def read_into(self, sid: Id, k_out: np.ndarray, v_out: np.ndarray, *, layer_start: int = 0,
                  token_start: int = 0, num_tokens: int = 0) -> None:
        """Read layers [layer_start, +k_out.shape[0]) x tokens [token_start,
        +k_out.shape[1]) straight into the caller's arrays (the model's
        dtype, (layers, tokens, kv_heads, head_dim), C-contiguous)."""
        a, keep = self._read_into_args(sid, k_out, v_out, layer_start, token_start, num_tokens)
        r = ffi.new("kvdepot_read_result *")
        self._check(lib.kvdepot_sequence_read(self._client(), a, r))

    def read_start(self, sid: Id, k_out: np.ndarray, v_out: np.ndarray, *, layer_start: int = 0,
                   token_start: int = 0, num_tokens: int = 0) -> "Transfer":
        """read_into() without waiting: returns a Transfer; the arrays are
        filled once it is done."""
        a, keep = self._read_into_args(sid, k_out, v_out, layer_start, token_start, num_tokens)
        r = ffi.new("kvdepot_read_result *")
        out = ffi.new("kvdepot_transfer **")
        self._check(lib.kvdepot_read_start(self._client(), a, r, ffi.NULL, ffi.NULL, out))
        return Transfer(self, out[0], (a, r, keep), False)

    def read(self, sid: Id, *, layer_start: int = 0, num_layers: int = 0, token_start: int = 0,
             num_tokens: int = 0) -> Tuple[np.ndarray, np.ndarray]:
        """K and V of layers [layer_start, +num_layers) x tokens
        [token_start, +num_tokens) (0: all layers from layer_start, tokens
        to the end), each (layers, tokens, kv_heads, head_dim)."""
        b = _id(sid)
        a = ffi.new("kvdepot_read_args *")
        idb = ffi.from_buffer(b)
        a.id, a.id_len = idb, len(b)
        a.layer_start, a.num_layers = layer_start, num_layers
        a.token_start, a.num_tokens = token_start, num_tokens
        r = ffi.new("kvdepot_read_result *")
        self._check(lib.kvdepot_sequence_read(self._client(), a, r))
        owned = ffi.gc(r.owned, lib.kvdepot_free) if r.owned != ffi.NULL else None
        npdt = _NUMPY_BY_DTYPE[r.dtype]
        shape = (r.num_layers, r.num_tokens, r.num_kv_heads, r.head_dim)
        if owned is None or r.kv_bytes == 0:
            empty = np.zeros(shape, dtype=npdt)
            return empty, empty.copy()
        buf = ffi.buffer(owned, 2 * r.kv_bytes)
        whole = np.frombuffer(buf, dtype=npdt)
        n = r.kv_bytes // np.dtype(npdt).itemsize
        return whole[:n].reshape(shape), whole[n:].reshape(shape)

    # ---- pages, artifacts, calibration ----

    def read_pages(self, sid: Id, *, layer_start: int = 0, num_layers: int = 0,
                   token_start: int = 0, num_tokens: int = 0) -> List[bytes]:
        """The stored pages of a layer range x token range as the server
        keeps them (encoded, checksummed; docs/page-format.md)."""
        b = _id(sid)
        a = ffi.new("kvdepot_read_args *")
        idb = ffi.from_buffer(b)
        a.id, a.id_len = idb, len(b)
        a.layer_start, a.num_layers = layer_start, num_layers
        a.token_start, a.num_tokens = token_start, num_tokens
        pages, count = ffi.new("kvdepot_page **"), ffi.new("size_t *")
        self._check(lib.kvdepot_sequence_read_pages(self._client(), a, pages, count))
        return _pages_out(pages, count)

    def append_pages(self, sid: Id, pages: Sequence[bytes], *, create: Optional[str] = None,
                     ttl_seconds: int = 0, codecs: Optional[Codecs] = None) -> SequenceInfo:
        """Store pages encoded here (encode_pages): only their bytes cross
        the network; each is checked before any is stored. create: as for
        append(), the sequence is created in the same call when it does not
        exist (its codecs must be those the pages were encoded with), and
        deleted again if the pages are refused; the SequenceInfo's
        `created` says which happened."""
        b = _id(sid)
        arr = ffi.new("kvdepot_page[]", max(len(pages), 1))
        keep = []
        for i, p in enumerate(pages):
            buf = ffi.from_buffer(bytes(p))
            keep.append(buf)
            arr[i].data, arr[i].len = buf, len(p)
        a = ffi.new("kvdepot_append_pages_args *")
        idb = ffi.from_buffer(b)
        a.id, a.id_len, a.pages, a.count = idb, len(b), arr, len(pages)
        keep.append(_create_into(a, create, ttl_seconds, codecs))
        return _set_created(self._info_call(lib.kvdepot_sequence_append_pages, a), a)

    def upload_artifacts(self, model: str, artifacts: Sequence[Artifact]) -> int:
        """Store calibration artifacts of a model (all or nothing); the count."""
        a, keep = _artifacts_c(artifacts)
        n = ffi.new("uint32_t *")
        self._check(lib.kvdepot_artifacts_upload(self._client(), model.encode(), a,
                                                 len(artifacts), n))
        return n[0]

    def get_artifacts(self, model: str, kinds: Sequence[str] = ()) -> List[Artifact]:
        """The model's stored artifacts (of the given kinds; all when none)."""
        ks = [ARTIFACT_KINDS[k] for k in kinds]
        kc = ffi.new("int[]", ks) if ks else ffi.NULL
        out, n = ffi.new("kvdepot_artifact **"), ffi.new("size_t *")
        self._check(lib.kvdepot_artifacts_get(self._client(), model.encode(), kc, len(ks), out,
                                              n))
        try:
            res = []
            for i in range(n[0]):
                a = out[0][i]
                shape = (a.shape[0],) if a.ndim == 1 else (a.shape[0], a.shape[1])
                size = int(np.prod(shape))
                d = np.frombuffer(ffi.buffer(a.data, 4 * size), dtype=np.float32).reshape(shape)
                res.append(Artifact(_KIND_NAME.get(a.kind, str(a.kind)), a.layer, a.kv_head,
                                    d.copy()))
            return res
        finally:
            lib.kvdepot_artifacts_free(out[0], n[0])

    def calibrate(self, model: str, samples: Sequence[Tuple], *, vq_sub_dim: int = 0,
                  vq_bits: int = 0, svd: bool = False, iterations: int = 0, seed: int = 0,
                  max_samples: int = 0, error_budget: float = 0.0, eval_queries: int = 0,
                  exhaustive: bool = False) -> CalibrateResult:
        """Fit the model's artifacts (key smoothing, VQ codebooks, SVD
        rotations) on samples: (layer, k, v) or (layer, k, v, q), k and v
        (tokens, kv_heads, head_dim), q (tokens, q_heads, head_dim), in the
        model's dtype. Stores them; returns the per-head errors. With
        error_budget > 0 (samples with q, 512 tokens a layer or more) the
        result's advice recommends codecs whose attention-output error
        ||o - o^||^2 / ||o||^2 stays within it (see CodecAdvice)."""
        a = ffi.new("kvdepot_calibrate_args *")
        mb = ffi.new("char[]", model.encode())
        a.model, a.vq_sub_dim, a.vq_bits, a.svd = mb, vq_sub_dim, vq_bits, int(svd)
        a.iterations, a.seed, a.max_samples = iterations, seed, max_samples
        a.error_budget, a.eval_queries, a.exhaustive = error_budget, eval_queries, int(exhaustive)
        cs = ffi.new("kvdepot_calibrate_sample[]", max(len(samples), 1))
        keep = []
        for i, smp in enumerate(samples):
            layer, k, v = smp[0], _kv_array(smp[1], "k", 3), _kv_array(smp[2], "v", 3)
            if k.shape != v.shape:
                raise _bad(f"sample {i}: k {k.shape} and v {v.shape} differ")
            kb, vb = ffi.from_buffer(k), ffi.from_buffer(v)
            keep += [k, v, kb, vb]
            cs[i].layer, cs[i].num_tokens = layer, k.shape[0]
            cs[i].k, cs[i].v, cs[i].kv_bytes = kb, vb, k.nbytes
            if len(smp) > 3 and smp[3] is not None:
                q = _kv_array(smp[3], "q", 3)
                qb = ffi.from_buffer(q)
                keep += [q, qb]
                cs[i].q, cs[i].q_bytes = qb, q.nbytes
        r = ffi.new("kvdepot_calibrate_result *")
        self._check(lib.kvdepot_calibrate(self._client(), a, cs, len(samples), r))
        try:
            errs = [CalibrationError(e.layer, e.kv_head, e.vq_k, e.vq_v, e.svd_k, e.svd_v,
                                     e.svd_width_k, e.svd_width_v)
                    for e in (r.errors[i] for i in range(r.n_errors))]
            adv = _advice_of(r.advice) if r.advice != ffi.NULL else None
            return CalibrateResult(r.samples, r.artifacts, errs, adv)
        finally:
            lib.kvdepot_calibrate_result_clear(r)

    # ---- compute ----

    def attend(self, layer: int, queries: Sequence[Tuple], scale: float = 0.0
               ) -> List[AttendResult]:
        """Attention of each query over its sequence's stored K/V of `layer`
        on the server, in one call: queries are (id, q) or (id, q,
        token_start, num_tokens) with q (num_q_heads, head_dim). When every
        q is float16 they travel as f16 and so do the outputs (half the
        bytes, twice the queries per message); otherwise float32. Outputs
        are float32 either way. scale 0: 1/sqrt(head_dim)."""
        n = len(queries)
        qs = ffi.new("kvdepot_attend_query[]", max(n, 1))
        keep = []
        half = n > 0 and all(np.asarray(qd[1]).dtype == np.float16 for qd in queries)
        for i, qd in enumerate(queries):
            sid, q = qd[0], qd[1]
            t0 = qd[2] if len(qd) > 2 else 0
            nt = qd[3] if len(qd) > 3 else 0
            b = _id(sid)
            qa = np.ascontiguousarray(np.asarray(q, dtype=np.float16 if half else np.float32))
            idb, qb = ffi.from_buffer(b), ffi.from_buffer(qa)
            keep += [b, qa, idb, qb]
            qs[i].id, qs[i].id_len = idb, len(b)
            qs[i].q, qs[i].q_len = ffi.cast("const float *", qb), qa.size
            qs[i].token_start, qs[i].num_tokens = t0, nt
        res = ffi.new("kvdepot_attend_result[]", max(n, 1))
        dt = lib.KVDEPOT_DTYPE_F16 if half else lib.KVDEPOT_DTYPE_F32
        self._check(lib.kvdepot_attend_dtype(self._client(), layer, scale, dt, qs, n, res))
        try:
            out = []
            for i in range(n):
                h, d = res[i].num_q_heads, res[i].head_dim
                o = np.frombuffer(ffi.buffer(res[i].output, 4 * h * d), dtype=np.float32)
                lse = np.frombuffer(ffi.buffer(res[i].lse, 4 * h), dtype=np.float32)
                out.append(AttendResult(o.reshape(h, d).copy(), lse.copy(), res[i].num_tokens))
            return out
        finally:
            lib.kvdepot_attend_results_free(res, n)

    def _search_args(self, sid, layer, q, k, initial_tokens, recent_tokens, token_start,
                     num_tokens, keep):
        b = _id(sid)
        qa = np.ascontiguousarray(np.asarray(q, dtype=np.float32))
        idb, qb = ffi.from_buffer(b), ffi.from_buffer(qa)
        keep += [b, qa, idb, qb]
        a = ffi.new("kvdepot_search_args *")
        a.id, a.id_len, a.layer = idb, len(b), layer
        a.q, a.q_len = ffi.cast("const float *", qb), qa.size
        a.k, a.initial_tokens, a.recent_tokens = k, initial_tokens, recent_tokens
        a.token_start, a.num_tokens = token_start, num_tokens
        return a

    def search(self, sid: Id, layer: int, q, k: int, *, initial_tokens: int = 0,
               recent_tokens: int = 0, token_start: int = 0,
               num_tokens: int = 0) -> List[HeadTokens]:
        """Top-k tokens per kv head by PQ-approximate q.k over the
        sequence's PQ index (a sequence created with Codecs(pq_m=...)),
        plus the first initial_tokens and last recent_tokens of the range."""
        keep = []
        a = self._search_args(sid, layer, q, k, initial_tokens, recent_tokens, token_start,
                              num_tokens, keep)
        r = ffi.new("kvdepot_search_result *")
        self._check(lib.kvdepot_search(self._client(), a, r))
        try:
            return _heads_of(r)
        finally:
            lib.kvdepot_search_result_free(r)

    def pq_centroids(self, sid: Id, layer: int) -> Tuple[np.ndarray, int]:
        """The stored PQ centroids of one layer (GetPQCentroids): a float32
        array (num_kv_heads, m, 2**bits, head_dim // m), centroid c of
        sub-space j of kv head h covering dimensions [j * head_dim // m,
        (j + 1) * head_dim // m) of that head's keys, and the centroids id the
        pages' PQ sections carry. With the pages (read_pages) they reproduce
        every search answer."""
        b = _id(sid)
        pc = ffi.new("kvdepot_pq_centroids *")
        self._check(lib.kvdepot_pq_centroids_get(self._client(), ffi.from_buffer(b), len(b),
                                                 layer, pc))
        try:
            shape = (pc.num_kv_heads, pc.m, 1 << pc.bits, pc.head_dim // pc.m)
            a = np.frombuffer(ffi.buffer(pc.data, 4 * pc.count), dtype=np.float32).copy()
            return a.reshape(shape), int(pc.centroids_id)
        finally:
            lib.kvdepot_pq_centroids_free(pc)

    def pq_rebuild(self, sid: Id, layer_start: int = 0,
                   num_layers: int = 0) -> Tuple[int, int, SequenceInfo]:
        """Train the PQ centroids of layers [layer_start, +num_layers) (0 =
        to the last) again on 4096 keys spread over the whole sequence and
        code every sealed page of its own under them (RebuildPQIndex): for a
        long sequence whose keys drifted, or one shorter than
        pq_min_train_tokens. (layers rebuilt, tokens coded, the sequence)."""
        b = _id(sid)
        nl, nt = ffi.new("uint32_t *"), ffi.new("uint64_t *")
        info = self._info_call(lib.kvdepot_pq_rebuild, ffi.from_buffer(b), len(b), layer_start,
                               num_layers, nl, nt)
        return nl[0], nt[0], info

    def sparse_attend(self, sid: Id, layer: int, q, k: int, *, initial_tokens: int = 0,
                      recent_tokens: int = 0, token_start: int = 0, num_tokens: int = 0,
                      scale: float = 0.0) -> Tuple[AttendResult, List[HeadTokens]]:
        """search, then attention of every query head over the tokens chosen
        for its kv head, in one call: the result and the tokens."""
        keep = []
        a = self._search_args(sid, layer, q, k, initial_tokens, recent_tokens, token_start,
                              num_tokens, keep)
        res = ffi.new("kvdepot_attend_result *")
        r = ffi.new("kvdepot_search_result *")
        self._check(lib.kvdepot_sparse_attend(self._client(), a, scale, res, r))
        try:
            h, d = res.num_q_heads, res.head_dim
            o = np.frombuffer(ffi.buffer(res.output, 4 * h * d), dtype=np.float32)
            lse = np.frombuffer(ffi.buffer(res.lse, 4 * h), dtype=np.float32)
            return AttendResult(o.reshape(h, d).copy(), lse.copy(), res.num_tokens), _heads_of(r)
        finally:
            lib.kvdepot_attend_results_free(res, 1)
            lib.kvdepot_search_result_free(r)

    def plan_fetch(self, sid: Id, bandwidth_bytes_per_s: float, compute_flops_per_s: float, *,
                   layer_start: int = 0, num_layers: int = 0,
                   assume_activations: bool = False) -> FetchPlan:
        """PlanFetch: where to split a fetch between activations (recomputed
        into K/V by the caller) and K/V, for the given link and compute."""
        b = _id(sid)
        p = ffi.new("kvdepot_fetch_plan *")
        self._check(lib.kvdepot_plan_fetch(self._client(), ffi.from_buffer(b), len(b),
                                           bandwidth_bytes_per_s, compute_flops_per_s,
                                           layer_start, num_layers, int(assume_activations), p))
        return FetchPlan(p.split_tokens, p.num_tokens, p.predicted_seconds, p.kv_only_seconds,
                         p.recompute_seconds, p.activation_bytes, p.kv_bytes)

    def backup(self, dir: str) -> Dict:
        """A consistent copy of the server's whole store in `dir` on the
        server's host (absolute; must not exist, its parent must), taken
        while it serves; admin token needed where the server has tokens.
        Restore with `kvdepotd restore DIR --data-dir NEW`. Returns files,
        bytes and duration_ms."""
        b = ffi.new("kvdepot_backup_info *")
        self._check(lib.kvdepot_backup(self._client(), os.fsencode(dir), b))
        return {"files": b.files, "bytes": b.bytes, "duration_ms": b.duration_ms}

    def stats(self) -> Dict:
        """The server's Stats: tiers, sequences, backend and device, and its
        memory by part (zeros for a tenant's token)."""
        s = ffi.new("kvdepot_stats *")
        self._check(lib.kvdepot_stats_get(self._client(), s))
        tiers = [{"name": ffi.string(t.name).decode(), "limit_bytes": t.limit_bytes,
                  "bytes": t.bytes, "pages": t.pages, "hits": t.hits, "evictions": t.evictions}
                 for t in (s.tiers[i] for i in range(s.num_tiers))]
        return {"durability": ffi.string(s.durability).decode(), "tiers": tiers,
                "sequences": s.sequences, "backend": ffi.string(s.backend).decode(),
                "device": ffi.string(s.device).decode(),
                "device_memory_bytes": s.device_memory_bytes,
                "device_healthy": bool(s.device_healthy),
                "memory": {"rss_bytes": s.mem_rss_bytes, "appends_bytes": s.mem_appends_bytes,
                           "memtables_bytes": s.mem_memtables_bytes,
                           "block_cache_bytes": s.mem_block_cache_bytes}}
