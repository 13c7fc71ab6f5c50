"""kvdepot.integrations.transformers with a small randomly initialised Llama
(built from a config, nothing downloaded) against a real kvdepotd."""
import pytest
import torch
import transformers.generation.utils as _gen
from transformers import LlamaConfig, LlamaForCausalLM

import kvdepot
from kvdepot.integrations import transformers as kt

# Debian's torch 1.13 cannot import torch.distributed.fsdp on Python 3.11
# (a dataclass with a mutable default); generate() only asks whether the
# model is FSDP-wrapped, which it is not here.
_gen.is_fsdp_managed_module = lambda module: False

VOCAB = 256


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def client(server, model):
    with kvdepot.Client(server) as c:
        kt.put_model(c, model, "llama-tiny")
        yield c


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n), generator=g)


def greedy(model, ids, n, cache=None):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=n, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores, 1)[0]


def test_model_shape(model):
    m = kt.model_of(model, "x")
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.num_q_heads, m.dtype) == \
        (3, 2, 32, 4, "f32")


def test_offload_restore_continues_exactly(model, client):
    ids = prompt(40, 1)
    ref, ref_scores = greedy(model, ids, 12)
    cache = kt.KvdepotCache()
    first, _ = greedy(model, ids, 6, cache)
    assert torch.equal(first, ref[:, :46])
    info = cache.offload(client, "hf-1", "llama-tiny")
    assert info.num_tokens == cache.get_seq_length() == 45
    del cache
    restored = kt.KvdepotCache.restore(client, "hf-1")
    assert restored.get_seq_length() == 45
    rest, scores = greedy(model, first, 6, restored)
    assert torch.equal(rest, ref), "continuation differs from the uninterrupted run"
    assert torch.equal(scores, ref_scores[6:])  # raw pages: bit-exact


def test_prefix_reuse(model, client):
    shared = prompt(256, 2)
    a = torch.cat([shared, prompt(44, 3)], 1)
    cache = kt.KvdepotCache()
    out_a, _ = greedy(model, a, 4, cache)
    n = cache.get_seq_length()
    cache.offload(client, "hf-a", "llama-tiny", token_ids=out_a[0, :n].numpy())
    b = torch.cat([shared, prompt(30, 4)], 1)
    ref, ref_scores = greedy(model, b, 8)
    pre = kt.restore_prefix(client, "llama-tiny", b[0].numpy(), "hf-b")
    assert pre.get_seq_length() == 256  # the shared page, found by its hash
    got, scores = greedy(model, b, 8, pre)
    assert torch.equal(got, ref)
    assert torch.allclose(scores, ref_scores, rtol=0, atol=1e-4)
    # hf-b starts from the shared page; the rest of b's request goes after it.
    pre.offload(client, "hf-b", "llama-tiny", start=256, create=False)
    assert client.stat("hf-b").num_tokens == pre.get_seq_length()
    none = kt.restore_prefix(client, "llama-tiny", prompt(300, 5)[0].numpy(), "hf-c")
    assert none.get_seq_length() == 0


def test_remote_prefix_attention(model, client):
    c = prompt(300, 6)
    ref, ref_scores = greedy(model, c, 8)
    with torch.no_grad():  # the first page's cache, offloaded
        pc = kt.KvdepotCache()
        model(c[:, :256], past_key_values=pc, use_cache=True)
    pc.offload(client, "hf-r", "llama-tiny")
    calls = []
    real = kt.kvdepot_attention

    def counting(module, *a, **k):
        calls.append(module.layer_idx)
        return real(module, *a, **k)

    kt.register_attention()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    ALL_ATTENTION_FUNCTIONS[kt.ATTENTION_NAME] = counting
    try:
        with kt.RemotePrefix(model, client, "hf-r", 256) as local:
            got, scores = greedy(model, c, 8, local)
            # only what came after the prefix is held here
            assert local.key_cache[0].shape[-2] == 300 + 7 - 256
    finally:
        ALL_ATTENTION_FUNCTIONS[kt.ATTENTION_NAME] = real
    assert model.config._attn_implementation == "eager"
    assert len(calls) == 3 * 8  # every layer of every step went through kvdepot
    assert torch.equal(got, ref)
    err = (scores - ref_scores).abs().max().item() / ref_scores.abs().max().item()
    print(f"remote prefix: logits max relative error {err:.2e}")
    assert err < 1e-4


@pytest.mark.parametrize("codec", ["int4", "int2"])
def test_compressed_continuation_reported(model, client, codec):
    """INT4/INT2 caches: the continuation is reported, not asserted equal."""
    ids = prompt(300, 7)
    ref, ref_scores = greedy(model, ids, 16)
    cache = kt.KvdepotCache()
    first, _ = greedy(model, ids, 1, cache)
    sid = f"hf-{codec}"
    cache.offload(client, sid, "llama-tiny",
                  codecs=kvdepot.Codecs(k=codec, v=codec, k_group=32, v_group=32))
    restored = kt.KvdepotCache.restore(client, sid)
    assert restored.get_seq_length() == 300
    rest, scores = greedy(model, first, 15, restored)
    agree = (rest[0, 300:] == ref[0, 300:]).float().mean().item()
    err = (scores - ref_scores[1:]).abs().max().item() / ref_scores.abs().max().item()
    print(f"{codec}: 1 page of 300 tokens coded; next 15 tokens agree {agree:.0%}, "
          f"logits max relative error {err:.2e}")
    assert torch.isfinite(scores).all()
    raw = 3 * 300 * 2 * 32 * 4 * 2  # layers x tokens x kv heads x dim x f32 x (K, V)
    assert client.stat(sid).stored_bytes < 0.6 * raw


def test_example_runs(server):
    """The README's example script runs as written against a server."""
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    ex = os.path.join(here, "..", "examples", "transformers_offload.py")
    p = subprocess.run([sys.executable, ex, "--addr", server], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert "offloaded request 1" in p.stdout and "(same as local)" in p.stdout
    assert "request 2 reused 256 prefix tokens" in p.stdout
