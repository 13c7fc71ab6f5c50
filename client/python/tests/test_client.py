"""kvdepot.Client against a real kvdepotd: every call, and its errors."""
import numpy as np
import pytest

import kvdepot

L, H, D, HQ = 2, 2, 64, 4


def kv(tokens, seed, dtype=np.float16):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((L, tokens, H, D)).astype(dtype)


def reference_attention(q, k, v):
    """Attention of q (HQ, D) over one layer's k, v (T, H, D), GQA, f32."""
    k, v = k.astype(np.float32), v.astype(np.float32)
    out = np.empty((HQ, D), np.float32)
    lse = np.empty(HQ, np.float32)
    for h in range(HQ):
        kh = h // (HQ // H)
        s = k[:, kh, :] @ q[h] / np.sqrt(D)
        m = s.max()
        w = np.exp(s - m)
        out[h] = (w[:, None] * v[:, kh, :]).sum(0) / w.sum()
        lse[h] = m + np.log(w.sum())
    return out, lse


@pytest.fixture(scope="module")
def client(server):
    with kvdepot.Client(server) as c:
        c.put_model(kvdepot.Model("py", num_layers=L, num_kv_heads=H, head_dim=D,
                                  num_q_heads=HQ))
        yield c


def test_health_and_models(client):
    assert client.health() == "SERVING"
    m = client.get_model("py")
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.num_q_heads, m.dtype) == (L, H, D, HQ,
                                                                                  "f16")
    _, created = client.put_model(kvdepot.Model("py", num_layers=L, num_kv_heads=H, head_dim=D,
                                                num_q_heads=HQ))
    assert not created
    with pytest.raises(kvdepot.AlreadyExists):
        client.put_model(kvdepot.Model("py", num_layers=L + 1, num_kv_heads=H, head_dim=D))
    with pytest.raises(kvdepot.NotFound) as e:
        client.get_model("no-such-model")
    assert "no-such-model" in str(e.value) and e.value.code == "NOT_FOUND"


def test_append_read_exact(client):
    k, v = kv(300, 1), kv(300, 2)
    info = client.create_sequence("s1", "py")
    assert info.num_tokens == 0 and info.id == b"s1"
    info = client.append("s1", k[:, :100], v[:, :100], token_start=0)
    assert info.num_tokens == 100
    info = client.append("s1", k[:, 100:], v[:, 100:], token_start=100)
    assert info.num_tokens == 300 and info.layer_tokens == [300, 300]
    k2, v2 = client.read("s1")
    assert k2.shape == (L, 300, H, D) and k2.dtype == np.float16
    assert np.array_equal(k2, k) and np.array_equal(v2, v)
    k3, v3 = client.read("s1", layer_start=1, token_start=50, num_tokens=70)
    assert np.array_equal(k3, k[1:, 50:120]) and np.array_equal(v3, v[1:, 50:120])
    assert client.stat("s1").num_tokens == 300
    assert [s.id for s in client.list_sequences("py")].count(b"s1") == 1


def test_errors_are_typed(client):
    with pytest.raises(kvdepot.NotFound):
        client.stat("missing")
    client.create_sequence("s2", "py")
    with pytest.raises(kvdepot.AlreadyExists):
        client.create_sequence("s2", "py")
    k = kv(10, 3)
    with pytest.raises(kvdepot.FailedPrecondition):  # not at the layer's end
        client.append("s2", k, k, token_start=5)
    with pytest.raises(kvdepot.InvalidArgument):  # another dtype than the model's
        client.append("s2", k.astype(np.float32), k.astype(np.float32), token_start=0)
    with pytest.raises(kvdepot.OutOfRange):
        client.read("s2", token_start=0, num_tokens=1)
    assert client.stat("s2").num_tokens == 0  # nothing stored by the failures


def test_append_creates(client):
    k, v = kv(40, 11), kv(40, 12)
    info = client.append("ca1", k, v, token_start=0, create="py", ttl_seconds=600)
    assert info.num_tokens == 40 and info.id == b"ca1" and info.created is True
    k2, v2 = client.read("ca1")
    assert np.array_equal(k2, k) and np.array_equal(v2, v)
    with pytest.raises(kvdepot.FailedPrecondition):  # the retry of a stored append
        client.append("ca1", k, v, token_start=0, create="py")
    info = client.append("ca1", k, v, token_start=40, create="py")
    assert info.num_tokens == 80 and info.created is False
    assert client.append("ca1", k, v, token_start=80).created is None  # no create=
    # a failed append leaves no sequence behind
    with pytest.raises(kvdepot.FailedPrecondition):
        client.append("ca2", k, v, token_start=3, create="py")
    with pytest.raises(kvdepot.NotFound):
        client.stat("ca2")
    with pytest.raises(kvdepot.NotFound):
        client.append("ca2", k, v, token_start=0, create="no-such-model")
    with pytest.raises(kvdepot.InvalidArgument):
        client.append("ca2", k, v, token_start=0, ttl_seconds=5)
    with pytest.raises(kvdepot.NotFound):
        client.stat("ca2")
    t = client.append_start("ca3", k, v, token_start=0, create="py")
    info = t.wait()
    assert info.num_tokens == 40 and info.created is True
    assert client.append_start("ca3", k, v, token_start=40, create="py").wait().created is False
    assert np.array_equal(client.read("ca3", num_tokens=40)[0], k)


def test_attend_matches_reference(client):
    k, v = kv(500, 4), kv(500, 5)
    client.create_sequence("s3", "py")
    client.append("s3", k, v, token_start=0)
    rng = np.random.default_rng(6)
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    r_all, r_part = client.attend(1, [("s3", q), ("s3", q, 100, 200)])
    assert r_all.num_tokens == 500 and r_part.num_tokens == 200
    for r, (t0, t1) in ((r_all, (0, 500)), (r_part, (100, 300))):
        out, lse = reference_attention(q, k[1, t0:t1], v[1, t0:t1])
        assert np.allclose(r.output, out, rtol=1e-3, atol=1e-4)
        assert np.allclose(r.lse, lse, rtol=1e-4, atol=1e-4)
    # float16 queries travel as f16 and so do the outputs: the f32 call on
    # the same values, rounded to f16
    q16 = q.astype(np.float16)
    (h16,) = client.attend(1, [("s3", q16, 100, 200)])
    (h32,) = client.attend(1, [("s3", q16.astype(np.float32), 100, 200)])
    assert h16.output.dtype == np.float32
    assert np.array_equal(h16.output, h32.output.astype(np.float16).astype(np.float32))
    assert np.array_equal(h16.lse, h32.lse)


def test_delete_evict_stats(client):
    client.create_sequence("s4", "py")
    k = kv(600, 7)
    client.append("s4", k, k, token_start=0)
    pages, _ = client.evict("s4")
    assert pages >= 0
    k2, _ = client.read("s4")  # back from disk
    assert np.array_equal(k2, k)
    st = client.stats()
    assert st["sequences"] >= 1 and [t["name"] for t in st["tiers"]] == ["device", "host", "disk"]
    # memory by part: the process is resident, an append went through the
    # memtables, none is in flight now
    mem = st["memory"]
    assert mem["rss_bytes"] > 1 << 20 and mem["memtables_bytes"] > 0
    assert mem["appends_bytes"] == 0
    assert client.delete_sequence("s4") > 0
    with pytest.raises(kvdepot.NotFound):
        client.read("s4")


def test_closed_client(server):
    c = kvdepot.Client(server)
    c.close()
    with pytest.raises(kvdepot.Unavailable):
        c.stats()


def test_coded_sequence(client):
    """INT4 keys, INT2 values: read back within the codecs' error, smaller."""
    k, v = kv(512, 8), kv(512, 9)
    client.create_sequence("c1", "py", codecs=kvdepot.Codecs(k="int4", v="int2"))
    client.create_sequence("r1", "py")
    info = client.append("c1", k, v, token_start=0)
    raw = client.append("r1", k, v, token_start=0)
    assert info.sealed_pages == raw.sealed_pages and info.stored_bytes < raw.stored_bytes / 3
    k2, v2 = client.read("c1")
    ek = np.abs(k2.astype(np.float32) - k.astype(np.float32)).max()
    ev = np.abs(v2.astype(np.float32) - v.astype(np.float32)).max()
    assert 0 < ek < 0.6 and 0 < ev < 2.5, (ek, ev)  # groups of 64 over N(0, 1) values
    # the codecs as the server resolved them: default group 64, K and V per
    # channel (the default axis, the group dividing the page size); the raw
    # sequence reports raw
    want = kvdepot.Codecs(k="int4", v="int2", k_group=64, v_group=64, k_axis="channel",
                          v_axis="channel")
    assert info.codecs == want and client.stat("c1").codecs == want
    assert client.stat("r1").codecs == kvdepot.Codecs()
    assert client.stat("c1").artifacts_fingerprint == 0 and info.svd_widths == ([], [])
    with pytest.raises(kvdepot.InvalidArgument):
        client.create_sequence("c2", "py", codecs=kvdepot.Codecs(k="int3"))


def test_search_sparse_attend_plan(client):
    k, v = kv(700, 10), kv(700, 11)
    # the default waits for 4096 tokens (a whole prefill) before training
    client.create_sequence("p0", "py", codecs=kvdepot.Codecs(pq_m=8, pq_bits=6))
    assert client.stat("p0").codecs == kvdepot.Codecs(pq_m=8, pq_bits=6, pq_iterations=10,
                                                      pq_min_train_tokens=4096)
    client.append("p0", k, v, token_start=0)
    with pytest.raises(kvdepot.FailedPrecondition, match="min_train_tokens"):
        client.pq_centroids("p0", 0)
    # an explicit rebuild trains it on its sealed pages (2 of 256 tokens)
    layers, tokens, info = client.pq_rebuild("p0")
    assert layers == L and tokens == L * 512 and info.pq_index_bytes > 0
    assert client.pq_centroids("p0", 0)[0].shape == (H, 8, 64, D // 8)
    with pytest.raises(kvdepot.InvalidArgument):
        client.pq_rebuild("p0", L)
    client.create_sequence("p1", "py",
                           codecs=kvdepot.Codecs(pq_m=8, pq_bits=6, pq_min_train_tokens=256))
    client.append("p1", k, v, token_start=0)
    assert client.stat("p1").codecs == kvdepot.Codecs(pq_m=8, pq_bits=6, pq_iterations=10,
                                                      pq_min_train_tokens=256)
    q = np.random.default_rng(12).standard_normal((HQ, D)).astype(np.float32)
    heads = client.search("p1", 0, q, 16, initial_tokens=2, recent_tokens=4)
    assert [h.kv_head for h in heads] == list(range(H))
    for h in heads:
        assert len(h.tokens) == 16 + 2 + 4 and len(set(h.tokens.tolist())) == 22
        assert {0, 1, 696, 697, 698, 699} <= set(h.tokens.tolist()) and h.tokens.max() < 700
    # the stored centroids reproduce the scores: each key's nearest centroid
    # per sub-space, scored against the group's summed query
    cent, cid = client.pq_centroids("p1", 0)
    assert cent.shape == (H, 8, 64, D // 8) and cid != 0
    ds = D // 8
    for h in heads:
        keys = k[0, :, h.kv_head, :].astype(np.float32)
        qbar = q[h.kv_head * (HQ // H):(h.kv_head + 1) * (HQ // H)].sum(0)
        ref = np.zeros(700, dtype=np.float64)
        for j in range(8):
            c = cent[h.kv_head, j]
            sub = keys[:, j * ds:(j + 1) * ds]
            code = ((sub[:, None, :] - c[None]) ** 2).sum(-1).argmin(1)
            ref += c[code] @ qbar[j * ds:(j + 1) * ds]
        assert np.allclose(h.scores, ref[h.tokens], rtol=1e-4, atol=1e-4)
    with pytest.raises(kvdepot.InvalidArgument):
        client.pq_centroids("p1", L)
    r, chosen = client.sparse_attend("p1", 0, q, 16, initial_tokens=2, recent_tokens=4)
    assert r.num_tokens == 22 and len(chosen) == H
    # the reference: each query head over its kv head's chosen tokens
    for hq in range(HQ):
        kh = hq // (HQ // H)
        t = np.sort(chosen[kh].tokens.astype(np.int64))
        ref, lse = reference_attention(q, k[0, t], v[0, t])
        assert np.allclose(r.output[hq], ref[hq], rtol=1e-3, atol=1e-4)
        assert np.allclose(r.lse[hq], lse[hq], rtol=1e-4, atol=1e-4)
    plan = client.plan_fetch("p1", 1e9, 1e12)
    assert plan.num_tokens == 700 and plan.split_tokens == 0  # no activations stored
    assert plan.kv_only_seconds > 0 and plan.predicted_seconds == pytest.approx(
        plan.kv_only_seconds)


def test_prefix_chain(client):
    ids = np.arange(600, dtype=np.uint32) * 7 + 3
    k, v = kv(600, 13), kv(600, 14)
    client.create_sequence("x1", "py")
    client.append("x1", k, v, token_start=0, token_ids=ids)
    hashes = kvdepot.prefix_hashes(ids, client.stat("x1").page_tokens)
    assert len(hashes) == 600 // client.stat("x1").page_tokens
    assert client.lookup("py", hashes) == (len(hashes), 256 * len(hashes))
    assert client.lookup("py", kvdepot.prefix_hashes(ids + 1)) == (0, 0)
    info = client.create_sequence("x2", "py", prefix_hashes=hashes)
    assert info.num_tokens == 256 * len(hashes) and info.prefix_blocks == len(hashes)
    k2, _ = client.read("x2")
    assert np.array_equal(k2, k[:, :256 * len(hashes)])


def test_engine_block_hashes(client):
    """vLLM-style names: sha256 over 16-token blocks chained with the
    parent's; the server finds pages by the names of their last blocks."""
    import hashlib
    ids = np.arange(600, dtype=np.uint32) * 5 + 1
    names, parent = [], b""
    for j in range(600 // 16):
        parent = hashlib.sha256(parent + ids[16 * j:16 * (j + 1)].tobytes()).digest()
        names.append(parent)
    k, v = kv(600, 21), kv(600, 22)
    client.create_sequence("e1", "py")
    # Two appends: the names of the blocks whose last token each carries.
    client.append("e1", k[:, :300], v[:, :300], token_start=0,
                  engine_hashes=kvdepot.EngineHashes(names[:300 // 16], 16))
    client.append("e1", k[:, 300:], v[:, 300:], token_start=300,
                  engine_hashes=kvdepot.EngineHashes(names[300 // 16:], 16))
    pt = client.stat("e1").page_tokens
    per = pt // 16
    full = 600 // pt
    assert client.engine_lookup("py", kvdepot.EngineHashes(names, 16)) == (full * per, full * pt)
    other = [hashlib.sha256(b"x" + n).digest() for n in names]
    assert client.engine_lookup("py", kvdepot.EngineHashes(other, 16)) == (0, 0)
    with pytest.raises(kvdepot.InvalidArgument):
        client.engine_lookup("py", kvdepot.EngineHashes(names, 24))
    with pytest.raises(kvdepot.InvalidArgument):  # a count that does not match the append
        client.append("e1", k[:, :16], v[:, :16], token_start=600,
                      engine_hashes=kvdepot.EngineHashes(names[:3], 16))
    info = client.create_sequence("e2", "py",
                                  engine_prefix=kvdepot.EngineHashes(names[:full * per], 16))
    assert info.num_tokens == full * pt and info.prefix_blocks == full
    k2, v2 = client.read("e2")
    assert np.array_equal(k2, k[:, :full * pt]) and np.array_equal(v2, v[:, :full * pt])
    with pytest.raises(kvdepot.NotFound):
        client.create_sequence("e3", "py", engine_prefix=kvdepot.EngineHashes(other[:per], 16))


def test_layerwise_transfers(client):
    """Every layer's put in flight at once, then reads into caller arrays in
    flight together; a failing put raises from wait()."""
    k, v = kv(500, 31), kv(500, 32)
    client.create_sequence("lw", "py")
    ts = [client.append_start("lw", k[l:l + 1], v[l:l + 1], token_start=0, layer_start=l)
          for l in range(L)]
    infos = [t.wait() for t in ts]
    assert all(t.done() for t in ts)
    assert infos[-1].num_tokens == 500 or max(i.num_tokens for i in infos) == 500
    assert client.stat("lw").num_tokens == 500
    kb, vb = np.empty_like(k), np.empty_like(v)
    rs = [client.read_start("lw", kb[l:l + 1], vb[l:l + 1], layer_start=l) for l in range(L)]
    for r in rs:
        assert r.wait() is None
    assert np.array_equal(kb, k) and np.array_equal(vb, v)
    bad = client.append_start("lw", k[:1, :5], v[:1, :5], token_start=7)
    with pytest.raises(kvdepot.KvdepotError) as e:
        bad.wait()
    assert "token_start" in str(e.value)
    with pytest.raises(kvdepot.InvalidArgument):
        client.read_start("lw", kb[:, :3].copy()[:, ::2], vb[:, :2])


def test_models_listed(client):
    names = [m.name for m in client.list_models()]
    assert "py" in names


def test_pages_encoded_here(client):
    """Pages encoded by the client (INT4 whole blocks, raw tail) go up with
    append_pages, come back byte for byte with read_pages, and decode to
    what the server's own coding of the same K/V gives."""
    m = client.get_model("py")
    k, v = kv(600, 41), kv(600, 42)
    codecs = kvdepot.Codecs(k="int4", v="int4")
    client.create_sequence("pg", "py", codecs=codecs)
    pages = []
    for layer in range(L):
        pages += kvdepot.encode_pages(m, k[layer], v[layer], layer=layer, codecs=codecs)
    assert len(pages) == L * 3  # two whole pages and the raw tail per layer
    info = client.append_pages("pg", pages)
    assert info.num_tokens == 600
    back = client.read_pages("pg")
    assert sorted(back) == sorted(pages)
    client.create_sequence("pg2", "py", codecs=codecs)
    client.append("pg2", k, v, token_start=0)
    a, _ = client.read("pg")
    b, _ = client.read("pg2")
    assert np.array_equal(a, b)
    with pytest.raises(kvdepot.DataLoss):
        bad = bytearray(pages[0])
        bad[-1] ^= 1
        client.create_sequence("pg3", "py", codecs=codecs)
        client.append_pages("pg3", [bytes(bad)])
    # create= stores a new object in one call; refused pages leave none
    info = client.append_pages("pgc", pages, create="py", codecs=codecs)
    assert info.created and info.num_tokens == 600
    assert sorted(client.read_pages("pgc")) == sorted(pages)
    with pytest.raises(kvdepot.FailedPrecondition, match="of model"):
        client.append_pages("pgc", pages, create="other")
    with pytest.raises(kvdepot.DataLoss):
        client.append_pages("pgd", [pages[0], bytes(bad)], create="py", codecs=codecs)
    with pytest.raises(kvdepot.NotFound):
        client.stat("pgd")
    first = [pages[3 * layer] for layer in range(L)]  # each layer's first block
    second = [pages[3 * layer + 1] for layer in range(L)]
    info = client.append_pages("pge", first, create="py", codecs=codecs)
    assert info.created and info.num_tokens == 256
    info = client.append_pages("pge", second, create="py")  # exists: appended to
    assert not info.created and info.num_tokens == 512
    # an empty page among good ones: refused, nothing stored
    client.create_sequence("pg4", "py", codecs=codecs)
    with pytest.raises(kvdepot.DataLoss, match="0 bytes"):
        client.append_pages("pg4", [pages[0], b"", pages[1]])
    assert client.stat("pg4").num_tokens == 0


def test_artifacts_and_calibrate(client):
    """Calibrate stores smoothing factors and SVD rotations fitted on the
    samples; get_artifacts reads them back; an upload round-trips."""
    k, v = kv(512, 51), kv(512, 52)
    res = client.calibrate("py", [(layer, k[layer], v[layer]) for layer in range(L)], svd=True)
    assert res.samples == L * 512 and res.artifacts > 0
    assert len(res.errors) == L * H and all(0 <= e.svd_k < 1 for e in res.errors)
    arts = client.get_artifacts("py", ["svd_rotation_k"])
    assert len(arts) == L * H and arts[0].data.shape == (D, D)
    r = arts[0].data.astype(np.float64)
    assert np.allclose(r.T @ r, np.eye(D), atol=1e-3)  # a rotation
    mine = kvdepot.Artifact("key_smoothing", 0, 0, np.linspace(0.5, 2.0, D, dtype=np.float32))
    assert client.upload_artifacts("py", [mine]) == 1
    [got] = [a for a in client.get_artifacts("py", ["key_smoothing"])
             if (a.layer, a.kv_head) == (0, 0)]
    assert np.array_equal(got.data, mine.data)
    with pytest.raises(kvdepot.InvalidArgument):
        client.upload_artifacts("py", [kvdepot.Artifact("key_smoothing", 0, 0,
                                                        np.ones(D + 1, np.float32))])


def test_calibrate_advice(client):
    """Calibrate with an error budget measures every codec on held-out
    tokens and recommends a pair within the budget that a new sequence
    takes as is; without queries it is refused."""
    k, v = kv(1024, 71), kv(1024, 72)
    q = np.random.default_rng(73).standard_normal((L, 1024, HQ, D)).astype(np.float16)
    res = client.calibrate("py", [(layer, k[layer], v[layer], q[layer]) for layer in range(L)],
                           error_budget=0.05, eval_queries=8)
    adv = res.advice
    assert adv is not None and adv.eval_tokens == 256 and adv.eval_queries == 8
    assert [la.layer for la in adv.layers] == list(range(L))
    for la in adv.layers:
        raw = la.k[0]
        assert raw.choice.codec == "raw" and raw.attention_error == 0 and raw.bits_per_value == 16
        assert {e.choice.codec for e in la.v} == {"raw", "int2", "int4"}
        assert la.attention_error <= 0.05 and la.bits_per_value < 16
        assert la.k_best is None  # not exhaustive
    assert adv.max_attention_error <= 0.05 and adv.bits_per_value < 16
    codecs = adv.codecs()
    client.create_sequence("advised", "py", codecs=codecs)
    client.append("advised", k[:, :512], v[:, :512], token_start=0)
    info = client.stat("advised")
    assert info.codecs.k == adv.k.codec and info.codecs.v == adv.v.codec
    with pytest.raises(kvdepot.InvalidArgument):
        client.calibrate("py", [(layer, k[layer], v[layer]) for layer in range(L)],
                         error_budget=0.05)


def test_backup(client, tmp_path):
    """Backup writes a store that kvdepotd opens; an existing directory or
    a relative path is refused."""
    client.create_sequence("bk-1", "py")
    k, v = kv(300, 81), kv(300, 82)
    client.append("bk-1", k, v, token_start=0)
    info = client.backup(str(tmp_path / "bk"))
    assert info["files"] > 0 and info["bytes"] > 0
    assert (tmp_path / "bk" / "CURRENT").exists()
    with pytest.raises(kvdepot.AlreadyExists):
        client.backup(str(tmp_path / "bk"))
    with pytest.raises(kvdepot.InvalidArgument):
        client.backup("relative/dir")


def test_local_attention_helpers(client):
    rng = np.random.default_rng(3)
    k, v = kv(300, 61)[0], kv(300, 62)[0]
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    out, lse = kvdepot.attention_local(q, k, v)
    ro, rl = reference_attention(q, k, v)
    assert np.allclose(out, ro, rtol=1e-3, atol=1e-4) and np.allclose(lse, rl, atol=1e-4)
    oa, la = kvdepot.attention_local(q, k[:100], v[:100])
    ob, lb = kvdepot.attention_local(q, k[100:], v[100:])
    om, lm = kvdepot.attention_merge(oa, la, ob, lb)
    assert np.allclose(om, ro, rtol=1e-3, atol=1e-4) and np.allclose(lm, rl, atol=1e-4)
    kvdepot.transfer_threads(8)
    with pytest.raises(kvdepot.InvalidArgument):
        kvdepot.transfer_threads(0)


def test_module_cli(client, server, tmp_path):
    """python -m kvdepot: the CLI's common commands through the package."""
    import subprocess
    import sys

    def cli(*args, ok=True):
        p = subprocess.run([sys.executable, "-m", "kvdepot", "--addr", server, *args],
                           capture_output=True, text=True, timeout=120)
        assert (p.returncode == 0) == ok, p.stderr
        return p

    assert cli("health").stdout.strip() == "SERVING"
    cli("model", "put", "cli-m", "--layers", "2", "--kv-heads", "2", "--head-dim", "64")
    assert "cli-m" in cli("models").stdout
    k, v = kv(300, 71), kv(300, 72)
    np.savez(tmp_path / "in.npz", k=k, v=v)
    assert "300 tokens" in cli("put", "cli-1", "--model", "cli-m", "--file",
                               str(tmp_path / "in.npz")).stdout
    p = cli("put", "cli-1", "--model", "py", "--file", str(tmp_path / "in.npz"), ok=False)
    assert p.returncode == 2 and "holds model cli-m" in p.stderr
    cli("get", "cli-1", "--file", str(tmp_path / "out.npz"), "--tokens", "200")
    with np.load(tmp_path / "out.npz") as z:
        assert np.array_equal(z["k"], k[:, :200]) and np.array_equal(z["v"], v[:, :200])
    assert '"num_tokens": 300' in cli("seq", "stat", "cli-1").stdout
    assert "cli-1" in cli("seqs", "--model", "cli-m").stdout
    p = cli("seq", "stat", "nope", ok=False)
    assert p.returncode == 1 and "NOT_FOUND" in p.stderr
    cli("seq", "rm", "cli-1")
    cli("model", "rm", "cli-m")
