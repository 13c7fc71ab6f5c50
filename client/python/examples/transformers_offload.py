"""An engine's use of kvdepot with Hugging Face transformers, end to end:
offload a finished request's cache, restore it into a later generate(),
start a new prompt from a stored prefix, and attend to an offloaded prefix
on the server.

    python transformers_offload.py --addr 127.0.0.1:50051 [--model NAME]

Without --model a small random Llama is built from a config (nothing is
downloaded); with --model a transformers causal LM of that name is loaded
(Llama-style, eager attention, batch 1).
"""
import argparse

import numpy as np
import torch
import transformers
import transformers.generation.utils as gen_utils

import kvdepot
from kvdepot.integrations import transformers as kt

# Debian's torch 1.13 on Python 3.11 cannot import torch.distributed.fsdp,
# which generate() touches to ask whether the model is FSDP-wrapped.
gen_utils.is_fsdp_managed_module = lambda module: False


def load(name):
    if name:
        return transformers.AutoModelForCausalLM.from_pretrained(
            name, attn_implementation="eager").eval()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg).eval()


def generate(model, ids, n, cache=None):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                              max_new_tokens=n, do_sample=False, pad_token_id=0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--model", default="")
    a = p.parse_args()
    model = load(a.model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    system = torch.randint(0, vocab, (1, 256), generator=g)  # a shared 256-token prefix
    q1 = torch.cat([system, torch.randint(0, vocab, (1, 40), generator=g)], 1)
    q2 = torch.cat([system, torch.randint(0, vocab, (1, 25), generator=g)], 1)

    with kvdepot.Client(a.addr) as c:
        kt.put_model(c, model, "example-llm")
        for sid in ("ex-req-1", "ex-req-2"):
            try:
                c.delete_sequence(sid)
            except kvdepot.NotFound:
                pass

        # 1. Serve request 1, then offload its cache (token ids register its
        #    full pages for prefix reuse).
        cache = kt.KvdepotCache()
        out1 = generate(model, q1, 8, cache)
        n = cache.get_seq_length()
        info = cache.offload(c, "ex-req-1", "example-llm", token_ids=out1[0, :n].numpy())
        print(f"offloaded request 1: {info.num_tokens} tokens, {info.stored_bytes} bytes")

        # 2. Later: continue request 1 from the stored cache.
        cache = kt.KvdepotCache.restore(c, "ex-req-1")
        more = generate(model, out1, 8, cache)
        print("request 1 continued:", more[0, out1.shape[1]:].tolist())

        # 3. Request 2 shares the 256-token prefix: start from the stored page.
        cache = kt.restore_prefix(c, "example-llm", q2[0].numpy(), "ex-req-2")
        out2 = generate(model, q2, 8, cache)
        print(f"request 2 reused {min(256, cache.get_seq_length())} prefix tokens:",
              out2[0, q2.shape[1]:].tolist())

        # 4. Attention over the offloaded prefix computed by kvdepot.
        with kt.RemotePrefix(model, c, "ex-req-1", prefix_tokens=256) as local:
            out3 = generate(model, q1, 8, local)
        same = torch.equal(out3, generate(model, q1, 8))
        print("request 1 with the prefix attended remotely:", out3[0, q1.shape[1]:].tolist(),
              "(same as local)" if same else "(differs from local)")
        for sid in ("ex-req-1", "ex-req-2"):
            c.delete_sequence(sid)


if __name__ == "__main__":
    main()
