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
    assert client.delete_sequence("s4") > 0
    with pytest.raises(kvdepot.NotFound):
        client.read("s4")


def test_closed_client(server):
    c = kvdepot.Client(server)
    c.close()
    with pytest.raises(kvdepot.Unavailable):
        c.stats()
