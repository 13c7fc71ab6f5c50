"""kvdepot for Hugging Face transformers: offload a request's cache, restore
it into a later generate() call, start a prompt from a stored prefix, and
attend to an offloaded prefix on the server during decode.

    from kvdepot.integrations import transformers as kt

    kt.put_model(client, model, "llama-tiny")            # the shape, once
    cache = kt.KvdepotCache()
    out = model.generate(ids, past_key_values=cache, max_new_tokens=8)
    cache.offload(client, "req-1", "llama-tiny", token_ids=out[0, :-1])
    ...
    cache = kt.KvdepotCache.restore(client, "req-1")
    out = model.generate(out, past_key_values=cache, max_new_tokens=8)

    # a new prompt sharing a stored prefix starts from it
    cache = kt.restore_prefix(client, "llama-tiny", prompt_ids, "req-2")
    out = model.generate(prompt, past_key_values=cache, max_new_tokens=8)

    # attention over an offloaded prefix computed by kvdepot (Attend),
    # merged with the recent tokens held here by log-sum-exp
    with kt.RemotePrefix(model, client, "req-1", prefix_tokens=256) as cache:
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=8)

Caches are moved in kvdepot's wire layout (layers, tokens, kv_heads,
head_dim), one layer per transfer with every layer in flight at once. Keys
are stored as the model caches them (after rotary embedding), so restored
and remote caches continue exactly where the offloaded one stopped. Works
with transformers 4.48 and 4.49 (ALL_ATTENTION_FUNCTIONS) and Llama-style
models whose cache is a DynamicCache, batch size 1.
"""
from typing import Optional, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from .. import Client, Codecs, EngineHashes, Model, SequenceInfo, prefix_hashes

ATTENTION_NAME = "kvdepot"

_WIRE_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def model_of(model, name: str, dtype: Optional[torch.dtype] = None) -> Model:
    """The kvdepot Model (shape of the cache) of a transformers model."""
    c = model.config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    wire = _WIRE_DTYPE[dtype or model.dtype]
    return Model(name, num_layers=c.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                 num_q_heads=heads, dtype=wire)


def put_model(client: Client, model, name: str) -> Model:
    """Register the model's cache shape with kvdepot (idempotent)."""
    return client.put_model(model_of(model, name))[0]


def _to_wire(t: torch.Tensor) -> np.ndarray:
    """(1, kv_heads, tokens, head_dim) -> (tokens, kv_heads, head_dim) numpy."""
    if t.shape[0] != 1:
        raise ValueError(f"kvdepot caches hold one sequence: batch size {t.shape[0]}")
    x = t[0].transpose(0, 1).contiguous().cpu()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


class KvdepotCache(DynamicCache):
    """A DynamicCache that can be offloaded to kvdepot and restored from it."""

    def offload(self, client: Client, sid, model: str, *, codecs: Optional[Codecs] = None,
                token_ids: Optional[Sequence[int]] = None,
                engine_hashes: Optional[EngineHashes] = None, start: int = 0,
                create: bool = True) -> SequenceInfo:
        """Store tokens [start, cached) of every layer under sequence sid of
        model (created unless create=False, optionally coded by codecs).
        token_ids (of the cached tokens from start) or engine_hashes let
        later prompts find the stored prefix. Every layer's put is in
        flight at once."""
        n = self.get_seq_length()
        if start > n:
            raise ValueError(f"start {start} is past the {n} cached tokens")
        if create:
            client.create_sequence(sid, model, codecs=codecs)
        ts = []
        for layer in range(len(self.key_cache)):
            k = _to_wire(self.key_cache[layer][:, :, start:n])[None]
            v = _to_wire(self.value_cache[layer][:, :, start:n])[None]
            dt = "bf16" if k.dtype == np.uint16 else None
            ids = None
            if token_ids is not None:
                ids = np.asarray(token_ids, dtype=np.uint32)[: n - start]
            ts.append(client.append_start(sid, k, v, token_start=start, layer_start=layer,
                                          dtype=dt, token_ids=ids, engine_hashes=engine_hashes))
        for t in ts:
            t.wait()
        # Each append's answer is the sequence as its own commit left it
        # (layers complete in any order): the state after all of them.
        return client.stat(sid)

    @classmethod
    def restore(cls, client: Client, sid, *, num_tokens: int = 0,
                device: Optional[torch.device] = None) -> "KvdepotCache":
        """A cache holding the first num_tokens (0: all) tokens of every
        layer of sequence sid, read with every layer in flight at once."""
        info = client.stat(sid)
        m = client.get_model(info.model)
        n = num_tokens or info.num_tokens
        dt = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[m.dtype]
        k = np.empty((m.num_layers, n, m.num_kv_heads, m.head_dim), dt)
        v = np.empty_like(k)
        ts = [client.read_start(sid, k[l:l + 1], v[l:l + 1], layer_start=l, num_tokens=n)
              for l in range(m.num_layers)]
        for t in ts:
            t.wait()
        cache = cls()
        for layer in range(m.num_layers):
            kl, vl = torch.from_numpy(k[layer]), torch.from_numpy(v[layer])
            if dt == np.uint16:
                kl, vl = kl.view(torch.bfloat16), vl.view(torch.bfloat16)
            kl = kl.transpose(0, 1)[None].contiguous()
            vl = vl.transpose(0, 1)[None].contiguous()
            if device is not None:
                kl, vl = kl.to(device), vl.to(device)
            cache.update(kl, vl, layer)
        return cache


def restore_prefix(client: Client, model: str, token_ids: Sequence[int], sid,
                   *, page_tokens: Optional[int] = None) -> KvdepotCache:
    """The longest stored prefix of token_ids (whole pages, found by the
    prefix hash chain) as a cache, and a new sequence sid that starts from
    it (its pages shared, not copied), to offload the rest of the request
    to later (offload(..., start=cache length, create=False)). At least the
    last token is left for the model to compute. An empty cache (and a new
    empty sequence) when nothing is stored."""
    ids = np.asarray(token_ids, dtype=np.uint32)
    if page_tokens is None:
        page_tokens = 256
    hashes = prefix_hashes(ids, page_tokens)
    blocks, tokens = client.lookup(model, hashes) if len(hashes) else (0, 0)
    info = client.create_sequence(sid, model, prefix_hashes=hashes[:blocks] if blocks else None)
    keep = min(tokens, len(ids) - 1)
    if keep <= 0:
        return KvdepotCache()
    if info.num_tokens != tokens:
        raise RuntimeError(f"sequence {sid!r} started from a {tokens}-token prefix holds "
                           f"{info.num_tokens} tokens")
    return KvdepotCache.restore(client, sid, num_tokens=keep)


# ---- attention over a remote prefix -------------------------------------------


class RemotePrefixCache(DynamicCache):
    """The recent tokens held here, after prefix_tokens tokens that kvdepot
    holds: positions (and the causal mask) count the remote ones."""

    def __init__(self, prefix_tokens: int):
        super().__init__()
        self.prefix_tokens = prefix_tokens

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        return self.prefix_tokens + super().get_seq_length(layer_idx)


def _local_attention(query, key, value, mask, scaling):
    """Attention over the local keys with its log-sum-exp (natural log)."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    s = torch.matmul(query.float(), k.float().transpose(2, 3)) * scaling
    if mask is not None:
        s = s + mask.float()
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.softmax(s, dim=-1), v.float())
    return out, lse


def kvdepot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """Attention function (transformers' attention interface) of a layer
    whose first tokens live in kvdepot: those through Attend on the server
    (one query per position and batch row), the recent ones held here
    locally, merged by log-sum-exp. Needs RemotePrefix around the call."""
    remote = getattr(module, "_kvdepot_remote", None)
    if remote is None:
        raise RuntimeError("kvdepot attention outside RemotePrefix")
    client, sid, p = remote
    b, hq, q_len, d = query.shape
    scaling = scaling if scaling is not None else d ** -0.5
    mask = attention_mask[:, :, :, p:p + key.shape[-2]] if attention_mask is not None else None
    out_l, lse_l = _local_attention(query, key, value, mask, scaling)
    qs = query.detach().float().cpu().numpy()
    batch = [(sid, qs[0, :, i, :], 0, p) for i in range(q_len)]
    res = client.attend(module.layer_idx, batch, scale=float(scaling))
    out_r = torch.from_numpy(np.stack([r.output for r in res], axis=1))[None]  # (1, hq, q, d)
    lse_r = torch.from_numpy(np.stack([r.lse for r in res], axis=1))[None]     # (1, hq, q)
    m = torch.maximum(lse_l, lse_r)
    wl, wr = torch.exp(lse_l - m), torch.exp(lse_r - m)
    out = (out_l * wl[..., None] + out_r * wr[..., None]) / (wl + wr)[..., None]
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Make "kvdepot" an attention implementation transformers knows (a
    function registered under that name already stays)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    ALL_ATTENTION_FUNCTIONS.setdefault(ATTENTION_NAME, kvdepot_attention)
    return ATTENTION_NAME


class RemotePrefix:
    """Within it, model's attention reads the first prefix_tokens tokens of
    every layer from kvdepot sequence sid (Attend on the server) and the
    rest from the RemotePrefixCache it yields (give it to generate() as
    past_key_values, with input ids that start with the prefix's)."""

    def __init__(self, model, client: Client, sid, prefix_tokens: int):
        self.model, self.client, self.sid, self.p = model, client, sid, prefix_tokens

    def __enter__(self) -> RemotePrefixCache:
        register_attention()
        # Submodules may hold configs of their own: switch every one.
        self._was = []
        for mod in self.model.modules():
            cfg = getattr(mod, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                self._was.append((cfg, cfg._attn_implementation))
                cfg._attn_implementation = ATTENTION_NAME
            if hasattr(mod, "layer_idx") and hasattr(mod, "num_key_value_groups"):
                mod._kvdepot_remote = (self.client, self.sid, self.p)
        return RemotePrefixCache(self.p)

    def __exit__(self, *exc):
        for cfg, was in reversed(self._was):
            cfg._attn_implementation = was
        for mod in self.model.modules():
            if hasattr(mod, "_kvdepot_remote"):
                del mod._kvdepot_remote
        return False
