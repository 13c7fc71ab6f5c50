#!/usr/bin/python3
"""kvdepot interop test: Python grpcio against a real kvdepotd.

The client side shares no code with kvdepot: message classes are generated at
run time by protoc from proto/kvdepot/v1/kvdepot.proto (and the standard
grpc/health/v1/health.proto) into a temporary directory, and calls go through
grpcio's generic channel methods with the generated serializers. The prefix
hash is computed with libxxhash through ctypes, from the definition in the
.proto.

Usage:
    test_interop.py --kvdepotd PATH --proto-dir DIR --health-proto-dir DIR
                    [--protoc PATH] [--large-mib N] [--large-only] [--keep]

Each check prints "ok" or "FAIL" with the reason; the last line is
"interop-python: N passed, N failed" and the exit status is non-zero when a
check failed or a prerequisite is missing.
"""

import argparse
import ctypes
import ctypes.util
import hashlib
import importlib.util
import math
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback

PREFIX = "interop-python"


def fatal(msg):
    # A missing prerequisite is a failure, never a skip: CI installs them.
    print("%s: FATAL: %s" % (PREFIX, msg), file=sys.stderr, flush=True)
    print("%s: 0 passed, 1 failed" % PREFIX, flush=True)
    sys.exit(1)


try:
    import grpc
except ImportError as e:
    fatal("python module grpc missing (Debian package python3-grpcio): %s" % e)
try:
    import google.protobuf  # noqa: F401
except ImportError as e:
    fatal("python module google.protobuf missing (Debian package python3-protobuf): %s" % e)

MiB = 1 << 20
CALL_TIMEOUT = 60.0
SC = grpc.StatusCode


class CheckFailed(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise CheckFailed(msg)


def eq(got, want, what):
    if got != want:
        raise CheckFailed("%s: got %r, want %r" % (what, got, want))


# --------------------------------------------------------------------------
# Generated code and the prefix hash


def load_generated(protoc, proto_dir, health_dir, gen_dir):
    """Runs protoc --python_out and imports the two generated modules by path.

    They are loaded under private names: the health module's natural package
    name, grpc.health.v1, would collide with the grpc package itself.
    """
    for include, rel in ((proto_dir, "kvdepot/v1/kvdepot.proto"),
                         (health_dir, "grpc/health/v1/health.proto")):
        if not os.path.isfile(os.path.join(include, rel)):
            fatal("%s not found under %s" % (rel, include))
        try:
            subprocess.run([protoc, "--python_out=" + gen_dir, "-I" + include, rel],
                           check=True, capture_output=True, text=True)
        except FileNotFoundError:
            fatal("protoc not found at %r (Debian package protobuf-compiler)" % protoc)
        except subprocess.CalledProcessError as e:
            fatal("protoc failed on %s: %s" % (rel, e.stderr.strip()))

    def load(name, rel):
        spec = importlib.util.spec_from_file_location(name, os.path.join(gen_dir, rel))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return (load("kvd_interop_kvdepot_pb2", "kvdepot/v1/kvdepot_pb2.py"),
            load("kvd_interop_health_pb2", "grpc/health/v1/health_pb2.py"))


class PrefixHash:
    """h_i = XXH3_64bits_withSeed(le32 token ids of block i, 4*B, h_{i-1}), h_{-1} = 0."""

    def __init__(self):
        name = ctypes.util.find_library("xxhash") or "libxxhash.so.0"
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            fatal("cannot load libxxhash (Debian package libxxhash0): %s" % e)
        self.fn = lib.XXH3_64bits_withSeed
        self.fn.restype = ctypes.c_uint64
        self.fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
        # Known answer: xxh3-64 of the empty input with seed 0.
        if self.fn(b"", 0, 0) != 0x2D06800538D394C2:
            fatal("libxxhash XXH3_64bits_withSeed gives a wrong known answer")

    def chain(self, token_ids, page_tokens, parent=0):
        out = []
        h = parent
        for i in range(len(token_ids) // page_tokens):
            block = token_ids[i * page_tokens:(i + 1) * page_tokens]
            data = struct.pack("<%dI" % page_tokens, *block)
            h = self.fn(data, len(data), h)
            out.append(h)
        return out


# --------------------------------------------------------------------------
# The server under test


def die_with_parent():
    """In the child before exec: SIGKILL it when this process dies, so a test
    killed by a timeout leaves no server behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Server:
    def __init__(self, exe, workdir):
        self.exe = exe
        self.workdir = workdir
        self.data_dir = os.path.join(workdir, "data")
        self.log_path = os.path.join(workdir, "kvdepotd.log")
        self.proc = None
        self.addr = None

    def start(self, timeout=60.0, extra_args=()):
        port_file = os.path.join(self.workdir, "port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        os.makedirs(self.data_dir, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [self.exe, "--listen", "127.0.0.1:0", "--data-dir", self.data_dir,
                 "--port-file", port_file] + list(extra_args),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent)
        except OSError as e:
            fatal("cannot start kvdepotd %r: %s" % (self.exe, e))
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise CheckFailed("kvdepotd exited with %d before serving; log:\n%s"
                                  % (self.proc.returncode, self.log_tail()))
            try:
                with open(port_file) as f:
                    text = f.read()
                if text.endswith("\n") and text.strip().isdigit():
                    self.addr = "127.0.0.1:%d" % int(text)
                    return
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise CheckFailed("kvdepotd wrote no port file within %.0f s; log:\n%s"
                                  % (timeout, self.log_tail()))
            time.sleep(0.05)

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout=30.0):
        """SIGTERM and wait; returns the exit status (None after a forced kill)."""
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = None
        self.proc = None
        return rc

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def vm_peak_kib(self):
        """The server's peak virtual memory (VmPeak), in KiB."""
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                if line.startswith("VmPeak:"):
                    return int(line.split()[1])
        raise CheckFailed("no VmPeak in /proc/%d/status" % self.proc.pid)

    def log_tail(self, lines=40):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"


# --------------------------------------------------------------------------
# Client side: generic grpcio calls with the generated serializers


class Api:
    SVC = "/kvdepot.v1.KVDepot/"

    def __init__(self, addr, pb, hpb, creds=None, server_name=None, ready_timeout=30):
        """creds: grpc.ChannelCredentials for TLS (None = plaintext);
        server_name overrides the name the server certificate must carry."""
        self.pb = pb
        self.hpb = hpb
        opts = [("grpc.max_receive_message_length", 16 * MiB),
                ("grpc.max_send_message_length", 16 * MiB)]
        if creds is None:
            self.channel = grpc.insecure_channel(addr, options=opts)
        else:
            if server_name:
                opts.append(("grpc.ssl_target_name_override", server_name))
            self.channel = grpc.secure_channel(addr, creds, options=opts)
        grpc.channel_ready_future(self.channel).result(timeout=ready_timeout)

        def uu(name, req, resp):
            return self.channel.unary_unary(self.SVC + name,
                                            request_serializer=req.SerializeToString,
                                            response_deserializer=resp.FromString)

        for name in ("PutModel", "GetModel", "ListModels", "DeleteModel", "CreateSequence",
                     "Lookup", "StatSequence", "ListSequences", "DeleteSequence"):
            setattr(self, name, uu(name, getattr(pb, name + "Request"),
                                   getattr(pb, name + "Response")))
        self.Append = self.channel.stream_unary(
            self.SVC + "Append", request_serializer=pb.AppendRequest.SerializeToString,
            response_deserializer=pb.AppendResponse.FromString)
        self.Read = self.channel.unary_stream(
            self.SVC + "Read", request_serializer=pb.ReadRequest.SerializeToString,
            response_deserializer=pb.ReadResponse.FromString)
        self.HealthCheck = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=hpb.HealthCheckRequest.SerializeToString,
            response_deserializer=hpb.HealthCheckResponse.FromString)

    def raw_unary(self, method):
        # No serializers: the request goes out as the given bytes.
        return self.channel.unary_unary(self.SVC + method)

    def raw_stream_unary(self, method):
        return self.channel.stream_unary(self.SVC + method)

    def raw_unary_stream(self, method):
        return self.channel.unary_stream(self.SVC + method)

    def close(self):
        self.channel.close()

    # -- helpers ---------------------------------------------------------

    def append(self, seq_id, data, token_start, num_tokens, layer_start=0, num_layers=0,
               dtype=None, chunks=None, token_ids=None, block_hashes=None, timeout=CALL_TIMEOUT,
               data_with_header=False, empty_between=False):
        """One Append stream: header in the first message, data in `chunks` pieces.
        data_with_header puts the first piece in the header's message;
        empty_between sends a message without data after every piece."""
        pb = self.pb
        hdr = pb.AppendHeader(sequence_id=seq_id, layer_start=layer_start,
                              num_layers=num_layers, token_start=token_start,
                              num_tokens=num_tokens,
                              dtype=pb.DTYPE_F16 if dtype is None else dtype)
        if token_ids is not None:
            hdr.token_ids.extend(token_ids)
        if block_hashes is not None:
            hdr.block_hashes.extend(block_hashes)
        msgs = [pb.AppendRequest(header=hdr)]
        for piece in split(data, chunks):
            if data_with_header and len(msgs) == 1 and not msgs[0].data:
                msgs[0].data = piece
            else:
                msgs.append(pb.AppendRequest(data=piece))
            if empty_between:
                msgs.append(pb.AppendRequest())
        return self.Append(iter(msgs), timeout=timeout)

    def read(self, seq_id, layer_start=0, num_layers=0, token_start=0, num_tokens=0,
             max_chunk_bytes=0, timeout=CALL_TIMEOUT):
        """Reads a range; checks the stream's framing; returns (header, bytes)."""
        req = self.pb.ReadRequest(sequence_id=seq_id, layer_start=layer_start,
                                  num_layers=num_layers, token_start=token_start,
                                  num_tokens=num_tokens, max_chunk_bytes=max_chunk_bytes)
        limit = max_chunk_bytes if max_chunk_bytes else MiB
        header = None
        parts = []
        for i, resp in enumerate(self.Read(req, timeout=timeout)):
            if i == 0:
                check(resp.HasField("header"), "first Read response carries no header")
                header = resp.header
            else:
                check(not resp.HasField("header"), "Read response %d repeats the header" % i)
            check(len(resp.data) <= limit, "Read chunk of %d bytes exceeds max_chunk_bytes %d"
                  % (len(resp.data), limit))
            parts.append(resp.data)
        check(header is not None, "Read stream carried no message")
        data = b"".join(parts)
        eq(len(data), header.total_bytes, "Read bytes vs header.total_bytes")
        return header, data


def split(data, chunks):
    """Splits data into pieces: chunks is None (one piece), an int (piece size)
    or a list of sizes (the rest goes in a last piece)."""
    if chunks is None:
        return [data] if data else []
    if isinstance(chunks, int):
        return [data[i:i + chunks] for i in range(0, len(data), chunks)]
    out, pos = [], 0
    for n in chunks:
        if pos >= len(data):
            break
        out.append(data[pos:pos + n])
        pos += n
    if pos < len(data):
        out.append(data[pos:])
    return out


def expect_code(code, fn, *args, **kwargs):
    """Calls fn and requires it to fail with `code` (or one of a tuple) and a message."""
    codes = code if isinstance(code, tuple) else (code,)
    try:
        result = fn(*args, **kwargs)
        # Server streams fail lazily: drain them.
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            for _ in result:
                pass
    except grpc.RpcError as e:
        got = e.code()
        if got not in codes:
            raise CheckFailed("expected %s, got %s: %s"
                              % ("/".join(c.name for c in codes), got.name, e.details()))
        check(bool(e.details()), "status %s without a message" % got.name)
        return e
    raise CheckFailed("expected %s, call succeeded" % "/".join(c.name for c in codes))


# --------------------------------------------------------------------------
# Reference copy of what a sequence should hold


class Reference:
    """K and V of every layer as bytes in token order: k[layer] = token rows."""

    def __init__(self, num_layers, kv_heads, head_dim, esize, seed):
        self.num_layers = num_layers
        self.row = kv_heads * head_dim * esize
        self.k = [bytearray() for _ in range(num_layers)]
        self.v = [bytearray() for _ in range(num_layers)]
        self.rng = random.Random(seed)

    def tokens(self, layer):
        return len(self.k[layer]) // self.row

    def wire(self, layer_start, num_layers, token_start, num_tokens):
        """Bytes of the range in the wire layout: K [layer][token][head][dim], then V."""
        a, b = token_start * self.row, (token_start + num_tokens) * self.row
        ls = range(layer_start, layer_start + num_layers)
        return b"".join(bytes(self.k[l][a:b]) for l in ls) + \
            b"".join(bytes(self.v[l][a:b]) for l in ls)

    def make_append(self, layer_start, num_layers, num_tokens):
        """Random K/V for the next num_tokens of the layers; returns the wire bytes
        without recording them (see commit)."""
        return self.rng.randbytes(2 * num_layers * num_tokens * self.row)

    def commit(self, layer_start, num_layers, num_tokens, data):
        per = num_tokens * self.row
        half = num_layers * per
        for i, l in enumerate(range(layer_start, layer_start + num_layers)):
            self.k[l] += data[i * per:(i + 1) * per]
            self.v[l] += data[half + i * per:half + (i + 1) * per]


# --------------------------------------------------------------------------
# The checks


class Suite:
    def __init__(self, args):
        self.args = args
        self.passed = 0
        self.failed = 0
        self.workdir = tempfile.mkdtemp(prefix="kvd-interop-py-")
        gen_dir = os.path.join(self.workdir, "gen")
        os.makedirs(gen_dir)
        try:
            self.pb, self.hpb = load_generated(args.protoc, args.proto_dir,
                                               args.health_proto_dir, gen_dir)
            self.hash = PrefixHash()
        except SystemExit:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self.server = Server(args.kvdepotd, self.workdir)
        self.api = None
        self.refs = {}     # sequence id -> Reference
        self.B = None      # page_tokens reported by the server
        self.large_digest = None
        self.prefix_chain = None

    def connect(self):
        self.server.start()
        self.api = Api(self.server.addr, self.pb, self.hpb)

    def run(self, name, fn):
        t0 = time.monotonic()
        try:
            fn()
            self.passed += 1
            print("ok   %-28s (%.2f s)" % (name, time.monotonic() - t0), flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported, then we go on
            self.failed += 1
            if isinstance(e, CheckFailed):
                why = str(e)
            elif isinstance(e, grpc.RpcError):
                why = "unexpected status %s: %s" % (e.code().name, e.details())
            else:
                why = traceback.format_exc()
            print("FAIL %-28s %s" % (name, why), flush=True)
            if self.server.proc is not None and not self.server.alive():
                print("     kvdepotd died (exit %s); log tail:\n%s"
                      % (self.server.proc.returncode, self.server.log_tail()), flush=True)

    # -- helpers used by several checks ------------------------------------

    def model(self, name, layers, kv_heads, head_dim, dtype=None, q_heads=0):
        pb = self.pb
        return pb.Model(name=name, revision="interop", num_layers=layers,
                        num_kv_heads=kv_heads, num_q_heads=q_heads, head_dim=head_dim,
                        dtype=pb.DTYPE_F16 if dtype is None else dtype)

    def put_model(self, m):
        return self.api.PutModel(self.pb.PutModelRequest(model=m), timeout=CALL_TIMEOUT)

    def create(self, seq_id, model, **kw):
        r = self.api.CreateSequence(self.pb.CreateSequenceRequest(
            sequence_id=seq_id, model=model, **kw), timeout=CALL_TIMEOUT)
        return r.sequence

    def stat(self, seq_id):
        return self.api.StatSequence(self.pb.StatSequenceRequest(sequence_id=seq_id),
                                     timeout=CALL_TIMEOUT).sequence

    def append_ref(self, seq_id, ref, layer_start, num_layers, num_tokens, **kw):
        token_start = ref.tokens(layer_start)
        data = ref.make_append(layer_start, num_layers, num_tokens)
        r = self.api.append(seq_id, data, token_start, num_tokens, layer_start=layer_start,
                            num_layers=num_layers, **kw)
        ref.commit(layer_start, num_layers, num_tokens, data)
        eq(r.bytes_received, len(data), "AppendResponse.bytes_received")
        eq(list(r.sequence.layer_tokens)[layer_start:layer_start + num_layers],
           [ref.tokens(l) for l in range(layer_start, layer_start + num_layers)],
           "layer_tokens after Append")
        return r

    def verify(self, seq_id, what="sequence"):
        """The stored sequence equals its reference: stat and a full read."""
        ref = self.refs[seq_id]
        n = min(ref.tokens(l) for l in range(ref.num_layers))
        info = self.stat(seq_id)
        eq(info.num_tokens, n, "%s num_tokens" % what)
        eq(list(info.layer_tokens), [ref.tokens(l) for l in range(ref.num_layers)],
           "%s layer_tokens" % what)
        if n == 0:
            return
        hdr, data = self.api.read(seq_id)
        eq((hdr.layer_start, hdr.num_layers, hdr.token_start, hdr.num_tokens),
           (0, ref.num_layers, 0, n), "%s read header range" % what)
        check(data == ref.wire(0, ref.num_layers, 0, n),
              "%s: bytes read back differ from what was appended" % what)

    def expect_unchanged(self, code, seq_id, fn, *args, **kwargs):
        expect_code(code, fn, *args, **kwargs)
        check(self.server.alive(), "kvdepotd died")
        self.verify(seq_id, "after the failed call, sequence")

    # -- checks ------------------------------------------------------------

    def t_health(self):
        hpb = self.hpb
        r = self.api.HealthCheck(hpb.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT)
        eq(r.status, hpb.HealthCheckResponse.SERVING, "Health/Check status")
        expect_code(SC.NOT_FOUND, self.api.HealthCheck,
                    hpb.HealthCheckRequest(service="no.such.Service"), timeout=CALL_TIMEOUT)

    def t_models(self):
        pb = self.pb
        m = self.model("py-f16", 3, 2, 64, q_heads=4)
        r = self.put_model(m)
        check(r.created, "first PutModel reports created=false")
        eq((r.model.name, r.model.num_layers, r.model.num_kv_heads, r.model.head_dim,
            r.model.dtype), ("py-f16", 3, 2, 64, pb.DTYPE_F16), "PutModel echo")
        r2 = self.put_model(m)
        check(not r2.created, "identical PutModel again reports created=true")
        g = self.api.GetModel(pb.GetModelRequest(name="py-f16"), timeout=CALL_TIMEOUT).model
        eq((g.num_layers, g.num_kv_heads, g.num_q_heads, g.head_dim, g.dtype),
           (3, 2, 4, 64, pb.DTYPE_F16), "GetModel shape")
        check(g.created_unix_ms > 0, "GetModel created_unix_ms not set")
        names = [x.name for x in self.api.ListModels(pb.ListModelsRequest(),
                                                     timeout=CALL_TIMEOUT).models]
        check("py-f16" in names, "ListModels lacks py-f16: %r" % names)

    def t_model_errors(self):
        pb = self.pb
        expect_code(SC.ALREADY_EXISTS, self.put_model, self.model("py-f16", 4, 2, 64, q_heads=4))
        expect_code(SC.NOT_FOUND, self.api.GetModel, pb.GetModelRequest(name="py-nope"),
                    timeout=CALL_TIMEOUT)
        for bad, why in ((self.model("py-bad", 0, 2, 64), "num_layers 0"),
                         (self.model("py-bad", 2, 0, 64), "num_kv_heads 0"),
                         (self.model("py-bad", 2, 2, 0), "head_dim 0"),
                         (self.model("py-bad", 2, 2, 64, dtype=pb.DTYPE_UNSPECIFIED),
                          "dtype unspecified"),
                         (self.model("py-bad", 2, 2, 64, q_heads=3), "q_heads not multiple"),
                         (self.model("bad name!", 2, 2, 64), "bad name"),
                         (self.model("", 2, 2, 64), "empty name"),
                         (self.model("x" * 129, 2, 2, 64), "129-byte name"),
                         (self.model("py-bad", 1025, 2, 64), "num_layers 1025"),
                         (self.model("py-bad", 2, 1025, 64), "num_kv_heads 1025"),
                         (self.model("py-bad", 2, 2, 1025), "head_dim 1025")):
            try:
                expect_code(SC.INVALID_ARGUMENT, self.put_model, bad)
            except CheckFailed as e:
                raise CheckFailed("%s: %s" % (why, e))
        m = self.model("py-bad", 2, 2, 64)
        m.revision = "r" * 129
        try:
            expect_code(SC.INVALID_ARGUMENT, self.put_model, m)
        except CheckFailed as e:
            raise CheckFailed("129-byte revision: %s" % e)
        expect_code(SC.NOT_FOUND, self.api.DeleteModel, pb.DeleteModelRequest(name="py-nope"),
                    timeout=CALL_TIMEOUT)
        # The longest valid name is fine.
        self.put_model(self.model("n" * 128, 1, 1, 4))
        self.api.DeleteModel(pb.DeleteModelRequest(name="n" * 128), timeout=CALL_TIMEOUT)
        g = self.api.GetModel(pb.GetModelRequest(name="py-f16"), timeout=CALL_TIMEOUT).model
        eq((g.num_layers, g.num_kv_heads, g.head_dim), (3, 2, 64),
           "py-f16 shape after failed PutModels")
        names = [x.name for x in self.api.ListModels(pb.ListModelsRequest(),
                                                     timeout=CALL_TIMEOUT).models]
        check("py-bad" not in names, "a rejected model was stored")

    # -- compute RPCs ---------------------------------------------------

    def uu(self, name):
        pb = self.pb
        return self.api.channel.unary_unary(
            self.api.SVC + name, request_serializer=getattr(pb, name + "Request").SerializeToString,
            response_deserializer=getattr(pb, name + "Response").FromString)

    @staticmethod
    def attention(q, k, v, hq, hkv, d, scale, tokens=None):
        """Plain float attention with GQA over rows of k/v ([token][head][dim] lists);
        tokens: per kv head the token list to use (None = all). Returns (out, lse)."""
        g = hq // hkv
        out, lses = [], []
        for h in range(hq):
            kh = h // g
            ts = range(len(k)) if tokens is None else tokens[kh]
            s = [scale * sum(q[h * d + i] * k[t][kh][i] for i in range(d)) for t in ts]
            if not s:
                out.extend([0.0] * d)
                lses.append(float("-inf"))
                continue
            mx = max(s)
            w = [math.exp(x - mx) for x in s]
            z = sum(w)
            lses.append(mx + math.log(z))
            for i in range(d):
                out.append(sum(w[j] * v[t][kh][i] for j, t in enumerate(ts)) / z)
        return out, lses

    def t_calibrate(self):
        """Calibrate from an independent client: key smoothing factors checked against
        their definition computed here, rotations orthonormal, artifacts round trip
        bit-exact through GetArtifacts/UploadArtifacts, errors change nothing."""
        pb = self.pb
        L, HKV, HQ, D, n = 1, 2, 4, 16, 200
        m = self.model("py-cal", L, HKV, D, dtype=pb.DTYPE_F32, q_heads=HQ)
        self.put_model(m)
        rng = random.Random(9)
        k = [rng.uniform(-2, 2) for _ in range(n * HKV * D)]
        v = [rng.uniform(-1, 1) for _ in range(n * HKV * D)]
        q = [rng.uniform(-1, 1) for _ in range(n * HQ * D)]
        pack = lambda xs: struct.pack("<%df" % len(xs), *xs)
        api = self.api
        Cal = api.channel.stream_unary(
            api.SVC + "Calibrate", request_serializer=pb.CalibrateRequest.SerializeToString,
            response_deserializer=pb.CalibrateResponse.FromString)
        Up = api.channel.stream_unary(
            api.SVC + "UploadArtifacts",
            request_serializer=pb.UploadArtifactsRequest.SerializeToString,
            response_deserializer=pb.UploadArtifactsResponse.FromString)
        Get = api.channel.unary_stream(
            api.SVC + "GetArtifacts", request_serializer=pb.GetArtifactsRequest.SerializeToString,
            response_deserializer=pb.GetArtifactsResponse.FromString)

        def calibrate(model="py-cal", kb=None, vq=True, layer=0):
            hdr = pb.CalibrateHeader(model=model, svd=True, seed=4)
            if vq:
                hdr.vq.sub_dim, hdr.vq.bits = 4, 5
            return Cal(iter([pb.CalibrateRequest(header=hdr),
                             pb.CalibrateRequest(sample=pb.CalibrateSample(
                                 layer=layer, num_tokens=n, k=kb if kb is not None else pack(k),
                                 v=pack(v), q=pack(q)))]), timeout=CALL_TIMEOUT)

        def artifacts():
            return [r.artifact for r in Get(pb.GetArtifactsRequest(model="py-cal"),
                                            timeout=CALL_TIMEOUT)]

        r = calibrate()
        eq(r.samples, n, "samples")
        eq(r.artifacts, HKV * 7, "artifacts written")
        eq(len(r.errors), HKV, "error rows")
        for e in r.errors:
            check(0 < e.vq_k < 1 and 0 < e.vq_v < 1, "VQ errors %g %g" % (e.vq_k, e.vq_v))
            check(1 <= e.svd_width_k <= D and 0 <= e.svd_k <= 0.1, "SVD width/error of K")
        arts = artifacts()
        eq(len(arts), HKV * 7, "artifacts stored")
        for a in arts:
            vals = struct.unpack("<%df" % (len(a.data) // 4), a.data)
            if a.kind == pb.ARTIFACT_KEY_SMOOTHING:
                for i in range(D):
                    mx = max(abs(k[(t * HKV + a.kv_head) * D + i]) for t in range(n))
                    check(abs(vals[i] - math.sqrt(mx)) <= 1e-6 * math.sqrt(mx),
                          "lambda[%d] of head %d" % (i, a.kv_head))
            if a.kind in (pb.ARTIFACT_SVD_ROTATION_K, pb.ARTIFACT_SVD_ROTATION_V):
                eq(list(a.shape), [D, D], "rotation shape")
                for i in range(D):
                    for j in range(D):
                        dot = sum(vals[r * D + i] * vals[r * D + j] for r in range(D))
                        check(abs(dot - (i == j)) < 1e-4, "rotation not orthonormal")
            if a.kind == pb.ARTIFACT_VQ_CODEBOOK_K:
                eq(list(a.shape), [32, 4], "codebook shape")

        # Upload a replacement and read it back bit-exact (odd bit patterns too).
        lam = pack([float(i) + 0.1 for i in range(D - 1)] + [1e-30])
        new = pb.Artifact(kind=pb.ARTIFACT_KEY_SMOOTHING, layer=0, kv_head=1, shape=[D], data=lam)
        eq(Up(iter([pb.UploadArtifactsRequest(model="py-cal", artifacts=[new])]),
              timeout=CALL_TIMEOUT).artifacts, 1, "uploaded")
        after = artifacts()
        got = [a for a in after if a.kind == pb.ARTIFACT_KEY_SMOOTHING and a.kv_head == 1]
        eq(len(got), 1, "one smoothing artifact for head 1")
        eq(got[0].data, lam, "uploaded artifact bytes")

        # Errors: nothing changed.
        before = [a.SerializeToString() for a in artifacts()]
        expect_code(SC.INVALID_ARGUMENT, calibrate, kb=pack(k)[:-4])
        expect_code(SC.INVALID_ARGUMENT, calibrate, layer=L)
        expect_code(SC.NOT_FOUND, calibrate, model="py-nosuch")
        bad = pb.Artifact(kind=pb.ARTIFACT_SVD_ROTATION_K, layer=0, kv_head=0, shape=[D, 8],
                          data=pack([0.0] * (D * 8)))
        expect_code(SC.INVALID_ARGUMENT, Up, iter([pb.UploadArtifactsRequest(
            model="py-cal", artifacts=[new, bad])]), timeout=CALL_TIMEOUT)
        short = pb.Artifact(kind=pb.ARTIFACT_KEY_SMOOTHING, layer=0, kv_head=0, shape=[D],
                            data=lam[:-4])
        expect_code(SC.INVALID_ARGUMENT, Up, iter([pb.UploadArtifactsRequest(
            model="py-cal", artifacts=[short])]), timeout=CALL_TIMEOUT)
        eq([a.SerializeToString() for a in artifacts()], before, "artifacts after errors")

    def t_compute(self):
        """Attend, SparseAttend, Search and PlanFetch from an independent client, on
        raw and INT4 caches, checked against attention computed here in Python."""
        pb = self.pb
        L, HKV, HQ, D = 1, 2, 4, 32
        m = self.model("py-compute", L, HKV, D, dtype=pb.DTYPE_F32, q_heads=HQ)
        m.hidden_size = 32
        self.put_model(m)
        rng = random.Random(5)
        n = 300
        rows = [[[rng.uniform(-1, 1) for _ in range(D)] for _ in range(HKV)] for _ in range(n)]
        vrows = [[[rng.uniform(-1, 1) for _ in range(D)] for _ in range(HKV)] for _ in range(n)]
        flat = lambda r: struct.pack("<%df" % (len(r) * HKV * D),
                                     *[x for t in r for h in t for x in h])
        data = flat(rows) + flat(vrows)
        q = [rng.uniform(-1, 1) for _ in range(HQ * D)]
        scale = 1 / math.sqrt(D)
        Attend, PlanFetch = self.uu("Attend"), self.uu("PlanFetch")
        Search, SparseAttend = self.uu("Search"), self.uu("SparseAttend")
        int4 = pb.CodecSpec(codec=pb.CODEC_INT4, quant=pb.QuantSpec(group_size=32))
        int4t = pb.CodecSpec(codec=pb.CODEC_INT4,
                             quant=pb.QuantSpec(group_size=32, axis=pb.QUANT_AXIS_TOKEN))
        # the codecs each sequence reports, resolved (axis and group, PQ
        # defaults), the same in CreateSequence, StatSequence, Append and Read:
        # the default axis groups keys and values per channel (the group
        # divides the page size)
        rq = lambda axis: pb.QuantSpec(group_size=32, axis=axis)
        reported = {
            b"py-raw": pb.SequenceCodecs(k=pb.CodecSpec(), v=pb.CodecSpec()),
            b"py-int4": pb.SequenceCodecs(
                k=pb.CodecSpec(codec=pb.CODEC_INT4, quant=rq(pb.QUANT_AXIS_CHANNEL)),
                v=pb.CodecSpec(codec=pb.CODEC_INT4, quant=rq(pb.QUANT_AXIS_CHANNEL))),
            b"py-int4t": pb.SequenceCodecs(
                k=pb.CodecSpec(codec=pb.CODEC_INT4, quant=rq(pb.QUANT_AXIS_TOKEN)),
                v=pb.CodecSpec(codec=pb.CODEC_INT4, quant=rq(pb.QUANT_AXIS_TOKEN))),
            b"py-pq": pb.SequenceCodecs(k=pb.CodecSpec(), v=pb.CodecSpec(),
                                        pq=pb.PQSpec(m=4, bits=4, iterations=10,
                                                        min_train_tokens=4096))}
        for sid, codecs in ((b"py-raw", None), (b"py-int4", pb.SequenceCodecs(k=int4, v=int4)),
                            (b"py-int4t", pb.SequenceCodecs(k=int4t, v=int4t)),
                            (b"py-pq", pb.SequenceCodecs(pq=pb.PQSpec(m=4, bits=4)))):
            kw = {"codecs": codecs} if codecs is not None else {}
            eq(self.create(sid, "py-compute", **kw).codecs, reported[sid],
               "%s codecs in CreateSequence" % sid)
            ar = self.api.append(sid, data, 0, n, dtype=pb.DTYPE_F32, timeout=CALL_TIMEOUT)
            eq(ar.sequence.codecs, reported[sid], "%s codecs in Append" % sid)
            eq(self.stat(sid).codecs, reported[sid], "%s codecs in StatSequence" % sid)
            # What the server holds, as it reads it back (decoded for INT4).
            hdr, back = self.api.read(sid)
            eq(hdr.codecs, reported[sid], "%s codecs in ReadHeader" % sid)
            vals = struct.unpack("<%df" % (2 * n * HKV * D), back)
            kb = [[list(vals[(t * HKV + h) * D:(t * HKV + h + 1) * D]) for h in range(HKV)]
                  for t in range(n)]
            off = n * HKV * D
            vb = [[list(vals[off + (t * HKV + h) * D:off + (t * HKV + h + 1) * D])
                   for h in range(HKV)] for t in range(n)]
            if codecs is None:
                check(back == data, "raw read-back differs")
            for t0, cnt in ((0, 0), (10, 250), (299, 1)):
                r = Attend(pb.AttendRequest(layer=0, queries=[pb.AttendQuery(
                    sequence_id=sid, q=q, token_start=t0, num_tokens=cnt)]),
                    timeout=CALL_TIMEOUT).results[0]
                cnt = cnt or n - t0
                eq(r.num_tokens, cnt, "Attend num_tokens")
                out, lse = self.attention(q, kb[t0:t0 + cnt], vb[t0:t0 + cnt], HQ, HKV, D, scale)
                tol = 1e-4 if codecs is None else 3e-2
                for i in range(HQ * D):
                    check(abs(r.output[i] - out[i]) <= tol, "%s Attend output[%d] %g vs %g"
                          % (sid, i, r.output[i], out[i]))
                # coded: the kernel rounds the query (folded with the key
                # scales for keys per channel) to int8
                ltol = 1e-3 if codecs is None else 3e-3
                for h in range(HQ):
                    check(abs(r.lse[h] - lse[h]) <= ltol, "%s Attend lse[%d] %g vs %g"
                          % (sid, h, r.lse[h], lse[h]))
        listed = {s.sequence_id: s.codecs for s in self.api.ListSequences(
            pb.ListSequencesRequest(model="py-compute"), timeout=CALL_TIMEOUT).sequences}
        for sid, want in reported.items():
            eq(listed.get(sid), want, "%s codecs in ListSequences" % sid)
        # Search + SparseAttend on the PQ sequence: attention over exactly the tokens.
        sreq = pb.SearchRequest(sequence_id=b"py-pq", layer=0, q=q, k=20, initial_tokens=2,
                                recent_tokens=5)
        sr = Search(sreq, timeout=CALL_TIMEOUT)
        eq(len(sr.heads), HKV, "Search heads")
        for hd in sr.heads:
            eq(len(hd.tokens), 27, "Search tokens per head (k + initial + recent)")
            check({0, 1, n - 1, n - 5}.issubset(set(hd.tokens)), "forced tokens missing")
            check(list(hd.scores) == sorted(hd.scores, reverse=True), "scores not ordered")
        sa = SparseAttend(pb.SparseAttendRequest(search=sreq), timeout=CALL_TIMEOUT)
        toks = [list(hd.tokens) for hd in sa.heads]
        eq(toks, [list(hd.tokens) for hd in sr.heads], "SparseAttend tokens vs Search")
        out, lse = self.attention(q, rows, vrows, HQ, HKV, D, scale, tokens=toks)
        for i in range(HQ * D):
            check(abs(sa.result.output[i] - out[i]) <= 1e-4, "SparseAttend output[%d]" % i)
        # Read in page format: the stored pages unchanged, one per message, every
        # page holding a token of the range (INT4 where sealed, the tail raw).
        B = self.stat(b"py-int4").page_tokens
        t0, cnt = 5, min(B + 10, n - 5)
        msgs = list(self.api.Read(pb.ReadRequest(
            sequence_id=b"py-int4", token_start=t0, num_tokens=cnt,
            format=pb.READ_FORMAT_PAGES), timeout=CALL_TIMEOUT))
        eq(msgs[0].header.format, pb.READ_FORMAT_PAGES, "Read pages: header format")
        eq((msgs[0].header.token_start, msgs[0].header.num_tokens), (t0, cnt),
           "Read pages: header range")
        eq(msgs[0].header.codecs, reported[b"py-int4"], "Read pages: header codecs")
        pages = [m.data for m in msgs[1:]]
        eq(len(pages), (t0 + cnt + B - 1) // B - t0 // B, "Read pages: page count")
        for b, pg in enumerate(pages, start=t0 // B):
            check(pg[:4] == b"KVDP", "Read pages: page %d magic" % b)
            layer, ts, nt, pt = struct.unpack_from("<IQII", pg, 12)
            eq((layer, ts, nt, pt), (0, b * B, min(B, n - b * B), B),
               "Read pages: page %d header" % b)
            eq(pg[8], pb.CODEC_INT4 if nt == B else pb.CODEC_RAW,
               "Read pages: page %d K codec" % b)
        expect_code(grpc.StatusCode.INVALID_ARGUMENT, lambda: list(self.api.Read(
            pb.ReadRequest(sequence_id=b"py-int4", format=pb.READ_FORMAT_PAGES,
                           activation_tokens=1), timeout=CALL_TIMEOUT)))
        expect_code(grpc.StatusCode.NOT_FOUND, lambda: list(self.api.Read(
            pb.ReadRequest(sequence_id=b"nope", format=pb.READ_FORMAT_PAGES),
            timeout=CALL_TIMEOUT)))
        expect_code(grpc.StatusCode.OUT_OF_RANGE, lambda: list(self.api.Read(
            pb.ReadRequest(sequence_id=b"py-int4", token_start=n, num_tokens=1,
                           format=pb.READ_FORMAT_PAGES), timeout=CALL_TIMEOUT)))
        # PlanFetch: the split minimises the documented cost model.
        for bw, fl in ((1e6, 1e12), (1e9, 1e9), (1e8, 1e15)):
            p = PlanFetch(pb.PlanFetchRequest(sequence_id=b"py-raw", bandwidth_bytes_per_s=bw,
                                              compute_flops_per_s=fl, assume_activations=True),
                          timeout=CALL_TIMEOUT)
            t = lambda l: (l * p.activation_bytes_per_token / bw +
                           max(l * p.flops_per_token / fl, (n - l) * p.kv_bytes_per_token / bw))
            best = min(t(l) for l in range(n + 1))
            check(t(p.split_tokens) <= best * (1 + 1e-9), "PlanFetch split %d not minimal"
                  % p.split_tokens)
        # Errors: nothing is created or changed.
        bad = pb.SequenceCodecs(k=pb.CodecSpec(codec=pb.CODEC_INT2,
                                               quant=pb.QuantSpec(group_size=48)))
        expect_code(grpc.StatusCode.INVALID_ARGUMENT, self.create, b"py-bad", "py-compute",
                    codecs=bad)
        expect_code(grpc.StatusCode.NOT_FOUND, self.stat, b"py-bad")
        expect_code(grpc.StatusCode.INVALID_ARGUMENT, Attend, pb.AttendRequest(
            layer=0, queries=[pb.AttendQuery(sequence_id=b"py-raw", q=q[:D])]),
            timeout=CALL_TIMEOUT)
        expect_code(grpc.StatusCode.NOT_FOUND, Attend, pb.AttendRequest(
            layer=0, queries=[pb.AttendQuery(sequence_id=b"nope", q=q)]), timeout=CALL_TIMEOUT)
        expect_code(grpc.StatusCode.INVALID_ARGUMENT, Search, pb.SearchRequest(
            sequence_id=b"py-pq", layer=0, q=q, k=n + 1), timeout=CALL_TIMEOUT)
        expect_code(grpc.StatusCode.FAILED_PRECONDITION, Search, pb.SearchRequest(
            sequence_id=b"py-raw", layer=0, q=q, k=3), timeout=CALL_TIMEOUT)
        eq(self.stat(b"py-raw").num_tokens, n, "py-raw after errors")

    def t_codecs_vq_svd(self):
        """VQ and SVD-reduced sequences from an independent client: FAILED_PRECONDITION
        before the model is calibrated, then pages seal coded (codec 3 VQ, 4 SVD in the
        stored pages), Attend equals attention computed here on the data read back,
        bad VQ shapes are INVALID_ARGUMENT; nothing is created on errors."""
        pb = self.pb
        HKV, HQ, D, n = 2, 4, 16, 300
        m = self.model("py-vq", 1, HKV, D, dtype=pb.DTYPE_F32, q_heads=HQ)
        self.put_model(m)
        vq = pb.CodecSpec(codec=pb.CODEC_VQ, vq=pb.VQSpec(sub_dim=4, bits=5))
        svd = pb.CodecSpec(codec=pb.CODEC_RAW, svd=pb.SVDSpec(removal_rate=0.3, align=2))
        expect_code(SC.FAILED_PRECONDITION, self.create, b"py-vq", "py-vq",
                    codecs=pb.SequenceCodecs(k=vq, v=vq))
        expect_code(SC.FAILED_PRECONDITION, self.create, b"py-svd", "py-vq",
                    codecs=pb.SequenceCodecs(k=svd, v=svd))
        expect_code(SC.NOT_FOUND, self.stat, b"py-vq")
        rng = random.Random(12)
        pack = lambda xs: struct.pack("<%df" % len(xs), *xs)
        sample = lambda cnt, heads: [rng.uniform(-1, 1) for _ in range(cnt * heads * D)]
        Cal = self.api.channel.stream_unary(
            self.api.SVC + "Calibrate", request_serializer=pb.CalibrateRequest.SerializeToString,
            response_deserializer=pb.CalibrateResponse.FromString)
        hdr = pb.CalibrateHeader(model="py-vq", svd=True, seed=3)
        hdr.vq.sub_dim, hdr.vq.bits = 4, 5
        Cal(iter([pb.CalibrateRequest(header=hdr), pb.CalibrateRequest(
            sample=pb.CalibrateSample(layer=0, num_tokens=n, k=pack(sample(n, HKV)),
                                      v=pack(sample(n, HKV)), q=pack(sample(n, HQ))))]),
            timeout=CALL_TIMEOUT)
        bad = pb.CodecSpec(codec=pb.CODEC_VQ, vq=pb.VQSpec(sub_dim=3, bits=5))
        expect_code(SC.INVALID_ARGUMENT, self.create, b"py-vq", "py-vq",
                    codecs=pb.SequenceCodecs(k=bad))
        expect_code(SC.FAILED_PRECONDITION, self.create, b"py-vq", "py-vq",  # b 8: not calibrated
                    codecs=pb.SequenceCodecs(k=pb.CodecSpec(codec=pb.CODEC_VQ,
                                                            vq=pb.VQSpec(sub_dim=4, bits=8))))
        expect_code(SC.NOT_FOUND, self.stat, b"py-vq")
        # no silent no-ops: a reduction that keeps all 16 dimensions of every
        # head (the flat spectrum of uniform samples, widths rounded up to
        # the default multiple of 8), and quantization fields on a raw side
        noop = pb.CodecSpec(codec=pb.CODEC_RAW, svd=pb.SVDSpec(removal_rate=0.2))
        rawq = pb.CodecSpec(codec=pb.CODEC_RAW, quant=pb.QuantSpec(group_size=32))
        for codecs, what in ((pb.SequenceCodecs(k=noop), "k.svd: every head keeps all 16"),
                             (pb.SequenceCodecs(v=rawq), "codecs.v.quant")):
            try:
                self.create(b"py-noop", "py-vq", codecs=codecs)
                check(False, "%s: created" % what)
            except grpc.RpcError as e:
                eq(e.code(), SC.INVALID_ARGUMENT, what)
                check(what in e.details(), "%s: message %r" % (what, e.details()))
        expect_code(SC.NOT_FOUND, self.stat, b"py-noop")
        data = pack(sample(n, HKV)) + pack(sample(n, HKV))
        q = [rng.uniform(-1, 1) for _ in range(HQ * D)]
        Attend = self.uu("Attend")
        for sid, codecs, want in ((b"py-vq", pb.SequenceCodecs(k=vq, v=vq), pb.CODEC_VQ),
                                  (b"py-svd", pb.SequenceCodecs(k=svd, v=svd), 4)):
            got = self.create(sid, "py-vq", codecs=codecs).codecs
            # reported: VQ as asked; SVD with the width kept per (layer, kv
            # head); a fingerprint of the artifacts either way
            check(got.artifacts_fingerprint != 0, "%s: no artifacts fingerprint" % sid)
            for side in (got.k, got.v):
                eq(side.codec, codecs.k.codec, "%s reported codec" % sid)
                if want == pb.CODEC_VQ:
                    eq((side.vq.sub_dim, side.vq.bits), (4, 5), "%s reported VQ spec" % sid)
                else:
                    eq(len(side.svd.kept_widths), 1 * HKV, "%s kept widths per (layer, head)" % sid)
                    check(all(1 <= w <= D for w in side.svd.kept_widths) and
                          min(side.svd.kept_widths) < D,
                          "%s kept widths %s" % (sid, list(side.svd.kept_widths)))
            eq(self.stat(sid).codecs, got, "%s codecs in StatSequence" % sid)
            self.api.append(sid, data, 0, n, dtype=pb.DTYPE_F32, timeout=CALL_TIMEOUT)
            hdr, back = self.api.read(sid)
            eq(hdr.codecs, got, "%s codecs in ReadHeader" % sid)
            vals = struct.unpack("<%df" % (2 * n * HKV * D), back)
            kb = [[list(vals[(t * HKV + h) * D:(t * HKV + h + 1) * D]) for h in range(HKV)]
                  for t in range(n)]
            off = n * HKV * D
            vb = [[list(vals[off + (t * HKV + h) * D:off + (t * HKV + h + 1) * D])
                   for h in range(HKV)] for t in range(n)]
            r = Attend(pb.AttendRequest(layer=0, queries=[pb.AttendQuery(sequence_id=sid, q=q)]),
                       timeout=CALL_TIMEOUT).results[0]
            out, lse = self.attention(q, kb, vb, HQ, HKV, D, 1 / math.sqrt(D))
            for i in range(HQ * D):
                check(abs(r.output[i] - out[i]) <= 1e-4, "%s Attend output[%d] %g vs %g"
                      % (sid, i, r.output[i], out[i]))
            for h in range(HQ):
                check(abs(r.lse[h] - lse[h]) <= 1e-4, "%s Attend lse[%d]" % (sid, h))
            pages = [x.data for x in list(self.api.Read(pb.ReadRequest(
                sequence_id=sid, format=pb.READ_FORMAT_PAGES), timeout=CALL_TIMEOUT))[1:]]
            eq((pages[0][8], pages[0][9], pages[-1][8]), (want, want, pb.CODEC_RAW),
               "%s stored page codecs (sealed, tail)" % sid)

    def t_activations(self):
        """KVPR from an independent client: Append with_activations stores X; a Read
        with activation_tokens l (l from PlanFetch) streams X of [0, l) then K/V of
        [l, n), equal to what was appended; errors change nothing."""
        pb = self.pb
        L, HKV, D, HID, n = 2, 2, 8, 16, 300
        m = self.model("py-act", L, HKV, D)
        m.hidden_size = HID
        self.put_model(m)
        self.create(b"py-act", "py-act", codecs=pb.SequenceCodecs(store_activations=True))
        self.create(b"py-act-plain", "py-act")
        rng = random.Random(11)
        kv_tok, x_tok = HKV * D * 2, HID * 2
        k = [bytes(rng.getrandbits(8) for _ in range(n * kv_tok)) for _ in range(L)]
        v = [bytes(rng.getrandbits(8) for _ in range(n * kv_tok)) for _ in range(L)]
        x = [bytes(rng.getrandbits(8) for _ in range(n * x_tok)) for _ in range(L)]

        def append(sid, t0, nt, with_x=True, x_cut=0):
            sl = lambda parts, tb: b"".join(p[t0 * tb:(t0 + nt) * tb] for p in parts)
            data = sl(k, kv_tok) + sl(v, kv_tok)
            if with_x:
                data += sl(x, x_tok)[:len(sl(x, x_tok)) - x_cut]
            hdr = pb.AppendHeader(sequence_id=sid, token_start=t0, num_tokens=nt,
                                  dtype=pb.DTYPE_F16, with_activations=with_x)
            msgs = [pb.AppendRequest(header=hdr)] + [pb.AppendRequest(data=c)
                                                     for c in split(data, 5000)]
            return self.api.Append(iter(msgs), timeout=CALL_TIMEOUT)

        append(b"py-act", 0, 200)
        append(b"py-act", 200, 100)
        eq(self.stat(b"py-act").activation_tokens, n, "activation_tokens")
        PlanFetch = self.uu("PlanFetch")
        p = PlanFetch(pb.PlanFetchRequest(sequence_id=b"py-act", bandwidth_bytes_per_s=1e9,
                                          compute_flops_per_s=1e11), timeout=CALL_TIMEOUT)
        check(0 < p.split_tokens <= n, "PlanFetch split %d with %d stored activations"
              % (p.split_tokens, n))
        for t0, nt, l in ((0, n, p.split_tokens), (0, n, n), (10, 250, 246), (250, 50, 7)):
            req = pb.ReadRequest(sequence_id=b"py-act", token_start=t0, num_tokens=nt,
                                 activation_tokens=l, max_chunk_bytes=4096)
            hdr, parts = None, []
            for i, resp in enumerate(self.api.Read(req, timeout=CALL_TIMEOUT)):
                if i == 0:
                    hdr = resp.header
                parts.append(resp.data)
            data = b"".join(parts)
            eq((hdr.activation_tokens, hdr.hidden_size, hdr.token_start, hdr.num_tokens),
               (l, HID, t0, nt), "activation-first Read header")
            eq(hdr.activation_bytes, L * l * x_tok, "ReadHeader.activation_bytes")
            eq(len(data), hdr.activation_bytes + hdr.total_bytes, "activation-first Read bytes")
            want = b"".join(x[i][t0 * x_tok:(t0 + l) * x_tok] for i in range(L))
            want += b"".join(k[i][(t0 + l) * kv_tok:(t0 + nt) * kv_tok] for i in range(L))
            want += b"".join(v[i][(t0 + l) * kv_tok:(t0 + nt) * kv_tok] for i in range(L))
            check(data == want, "activation-first Read t0=%d n=%d l=%d differs" % (t0, nt, l))
            if l < nt:
                _, plain = self.api.read(b"py-act", token_start=t0 + l, num_tokens=nt - l)
                check(data[hdr.activation_bytes:] == plain,
                      "K/V part differs from a plain Read of the remaining tokens")
        # Errors: clear status, nothing stored.
        expect_code(grpc.StatusCode.FAILED_PRECONDITION, append, b"py-act-plain", 0, 10)
        eq(self.stat(b"py-act-plain").num_tokens, 0, "plain sequence after refused X")
        append(b"py-act-plain", 0, 10, with_x=False)
        m0 = self.model("py-act-nohidden", L, HKV, D)
        self.put_model(m0)
        expect_code(grpc.StatusCode.FAILED_PRECONDITION, self.create, b"py-act-x",
                    "py-act-nohidden", codecs=pb.SequenceCodecs(store_activations=True))
        expect_code(grpc.StatusCode.NOT_FOUND, self.stat, b"py-act-x")
        self.create(b"py-act2", "py-act", codecs=pb.SequenceCodecs(store_activations=True))
        expect_code(grpc.StatusCode.INVALID_ARGUMENT, append, b"py-act2", 0, 10, x_cut=1)
        eq(self.stat(b"py-act2").num_tokens, 0, "sequence after a short X")
        # A gap: 10 tokens with X, 5 without; X can no longer follow, and a Read
        # cannot ask for X past the 10.
        append(b"py-act2", 0, 10)
        append(b"py-act2", 10, 5, with_x=False)
        expect_code(grpc.StatusCode.FAILED_PRECONDITION, append, b"py-act2", 15, 5)
        eq((self.stat(b"py-act2").num_tokens, self.stat(b"py-act2").activation_tokens),
           (15, 10), "tokens, activation_tokens after a gap")
        expect_code(grpc.StatusCode.OUT_OF_RANGE, lambda: list(self.api.Read(
            pb.ReadRequest(sequence_id=b"py-act2", activation_tokens=11),
            timeout=CALL_TIMEOUT)))
        expect_code(grpc.StatusCode.FAILED_PRECONDITION, lambda: list(self.api.Read(
            pb.ReadRequest(sequence_id=b"py-act-plain", activation_tokens=1),
            timeout=CALL_TIMEOUT)))
        expect_code(grpc.StatusCode.INVALID_ARGUMENT, lambda: list(self.api.Read(
            pb.ReadRequest(sequence_id=b"py-act", activation_tokens=1,
                           format=pb.READ_FORMAT_PAGES), timeout=CALL_TIMEOUT)))
        # Deleting the sequence takes its activations along.
        self.api.DeleteSequence(pb.DeleteSequenceRequest(sequence_id=b"py-act"),
                                timeout=CALL_TIMEOUT)
        self.create(b"py-act", "py-act", codecs=pb.SequenceCodecs(store_activations=True))
        eq(self.stat(b"py-act").activation_tokens, 0, "activation_tokens after re-create")

    def t_roundtrip(self):
        info = self.create(b"py-seq", "py-f16")
        eq(info.num_tokens, 0, "new sequence num_tokens")
        check(info.page_tokens > 0, "page_tokens not reported")
        self.B = B = info.page_tokens
        ref = self.refs[b"py-seq"] = Reference(3, 2, 64, 2, seed=1)
        # Two appends over all layers, data in odd-sized chunks, crossing pages.
        self.append_ref(b"py-seq", ref, 0, 3, B + 37, chunks=[1, 4093, 65536, 3])
        self.append_ref(b"py-seq", ref, 0, 3, B + 63, chunks=100000, data_with_header=True,
                        empty_between=True)
        n = 2 * B + 100
        self.verify(b"py-seq")
        info = self.stat(b"py-seq")
        eq(info.num_tokens, n, "num_tokens")
        eq(info.sealed_pages, 3 * (n // B), "sealed_pages (full pages over all layers)")
        check(info.stored_bytes >= len(ref.wire(0, 3, 0, n)),
              "stored_bytes %d below the %d bytes of K+V appended"
              % (info.stored_bytes, len(ref.wire(0, 3, 0, n))))
        # Sub-ranges: one layer across a page boundary, small chunks.
        hdr, data = self.api.read(b"py-seq", layer_start=1, num_layers=1, token_start=B - 5,
                                  num_tokens=65, max_chunk_bytes=777)
        eq((hdr.num_kv_heads, hdr.head_dim, hdr.dtype), (2, 64, self.pb.DTYPE_F16),
           "read header shape")
        check(data == ref.wire(1, 1, B - 5, 65), "layer 1 tokens [B-5, B+60) differ")
        # num_tokens 0 = up to the end; num_layers 0 = all layers from layer_start.
        hdr, data = self.api.read(b"py-seq", layer_start=1, token_start=10,
                                  max_chunk_bytes=4 * MiB)
        eq((hdr.num_layers, hdr.num_tokens), (2, n - 10), "open-ended read range")
        check(data == ref.wire(1, 2, 10, n - 10), "layers 1.. tokens 10.. differ")

    def t_dtypes(self):
        """f32 and bf16 models round-trip too; sequence ids are bytes, not text."""
        pb = self.pb
        for name, dtype, esize in (("py-f32", pb.DTYPE_F32, 4), ("py-bf16", pb.DTYPE_BF16, 2)):
            self.put_model(self.model(name, 2, 1, 16, dtype=dtype))
            seq_id = b"\x00\xff" + name.encode() + b"\x00\n"
            ref = self.refs[seq_id] = Reference(2, 1, 16, esize, seed=len(name) + dtype)
            self.create(seq_id, name)
            self.append_ref(seq_id, ref, 0, 2, self.B + 3, dtype=dtype, chunks=1000)
            self.append_ref(seq_id, ref, 0, 2, 7, dtype=dtype)
            self.verify(seq_id, name)
            hdr, _ = self.api.read(seq_id, num_tokens=1)
            eq(hdr.dtype, dtype, "%s read header dtype" % name)
            self.expect_unchanged(SC.INVALID_ARGUMENT, seq_id, self.api.append, seq_id,
                                  b"\0" * (2 * 2 * 16 * 2), ref.tokens(0), 1,
                                  dtype=pb.DTYPE_F16)
            listed = [s.sequence_id for s in self.api.ListSequences(
                pb.ListSequencesRequest(model=name), timeout=CALL_TIMEOUT).sequences]
            eq(listed, [seq_id], "ListSequences(%s) ids, byte for byte" % name)

    def t_layerwise(self):
        ref = self.refs[b"py-layers"] = Reference(3, 2, 64, 2, seed=2)
        self.create(b"py-layers", "py-f16")
        self.append_ref(b"py-layers", ref, 0, 1, 50)
        info = self.stat(b"py-layers")
        eq(list(info.layer_tokens), [50, 0, 0], "layer_tokens after layer 0")
        eq(info.num_tokens, 0, "num_tokens with layers 1,2 empty")
        self.append_ref(b"py-layers", ref, 1, 2, 50, chunks=999)
        self.verify(b"py-layers")

    def t_errors_unknown(self):
        pb, api = self.pb, self.api
        S = b"py-seq"
        self.expect_unchanged(SC.NOT_FOUND, S, api.StatSequence,
                              pb.StatSequenceRequest(sequence_id=b"py-none"), timeout=CALL_TIMEOUT)
        self.expect_unchanged(SC.NOT_FOUND, S, api.read, b"py-none")
        self.expect_unchanged(SC.NOT_FOUND, S, api.append, b"py-none", b"\0" * (2 * 3 * 256),
                              0, 1)
        self.expect_unchanged(SC.NOT_FOUND, S, api.DeleteSequence,
                              pb.DeleteSequenceRequest(sequence_id=b"py-none"),
                              timeout=CALL_TIMEOUT)
        self.expect_unchanged(SC.NOT_FOUND, S, self.create, b"py-new", "py-no-model")
        expect_code(SC.NOT_FOUND, api.StatSequence, pb.StatSequenceRequest(sequence_id=b"py-new"),
                    timeout=CALL_TIMEOUT)

    def t_errors_create(self):
        S = b"py-seq"
        self.expect_unchanged(SC.ALREADY_EXISTS, S, self.create, S, "py-f16")
        self.expect_unchanged(SC.INVALID_ARGUMENT, S, self.create, b"", "py-f16")
        self.expect_unchanged(SC.INVALID_ARGUMENT, S, self.create, b"x" * 257, "py-f16")
        # The longest valid id is fine.
        longest = bytes(range(256))
        eq(self.create(longest, "py-f16").sequence_id, longest, "256-byte id")
        self.api.DeleteSequence(self.pb.DeleteSequenceRequest(sequence_id=longest),
                                timeout=CALL_TIMEOUT)

    def t_errors_append(self):
        pb, api = self.pb, self.api
        S = b"py-seq"
        ref = self.refs[S]
        n = ref.tokens(0)
        good = ref.make_append(0, 3, 10)
        # Wrong total size: one byte short, one byte over.
        self.expect_unchanged(SC.INVALID_ARGUMENT, S, api.append, S, good[:-1], n, 10,
                              chunks=[7])
        self.expect_unchanged(SC.INVALID_ARGUMENT, S, api.append, S, good + b"\0", n, 10)
        # Header promising more than is sent (truncated stream).
        self.expect_unchanged(SC.INVALID_ARGUMENT, S, api.append, S, good, n, 11)
        # dtype mismatch with the model's f16.
        self.expect_unchanged(SC.INVALID_ARGUMENT, S, api.append, S, good, n, 10,
                              dtype=pb.DTYPE_BF16)
        self.expect_unchanged(SC.INVALID_ARGUMENT, S, api.append, S, good + good, n, 10,
                              dtype=pb.DTYPE_F32)
        # Not at the layer's end.
        self.expect_unchanged(SC.FAILED_PRECONDITION, S, api.append, S, good, n + 1, 10)
        self.expect_unchanged(SC.FAILED_PRECONDITION, S, api.append, S, good, 0, 10)
        # Layers outside the model.
        self.expect_unchanged(SC.INVALID_ARGUMENT, S, api.append, S, good[:len(good) // 3],
                              n, 10, layer_start=3, num_layers=1)
        self.expect_unchanged(SC.INVALID_ARGUMENT, S, api.append, S, good[:2 * len(good) // 3],
                              n, 10, layer_start=2, num_layers=2)
        # token_ids of the wrong count.
        self.expect_unchanged(SC.INVALID_ARGUMENT, S, api.append, S, good, n, 10,
                              token_ids=list(range(9)))
        # No header at all, and an empty stream.
        self.expect_unchanged(SC.INVALID_ARGUMENT, S, api.Append,
                              iter([pb.AppendRequest(data=good)]), timeout=CALL_TIMEOUT)
        self.expect_unchanged(SC.INVALID_ARGUMENT, S, api.Append, iter([]), timeout=CALL_TIMEOUT)
        # A good append still works after all that.
        self.append_ref(S, ref, 0, 3, 10)
        self.verify(S)

    def t_errors_limits(self):
        pb, api = self.pb, self.api
        S = b"py-seq"
        n = self.refs[S].tokens(0)
        per_token = 2 * 3 * 2 * 64 * 2
        # One 12 MiB message: over the server's default 8 MiB message limit.
        tokens = 12 * MiB // per_token
        self.expect_unchanged(SC.RESOURCE_EXHAUSTED, S, api.append, S, b"\1" * (12 * MiB), n,
                              tokens)
        # Sizes that overflow: 2^55 + 1 tokens of 1536 bytes is 1536 modulo 2^64.
        self.expect_unchanged((SC.INVALID_ARGUMENT, SC.RESOURCE_EXHAUSTED), S, api.append, S,
                              b"\2" * per_token, n, (1 << 55) + 1)
        self.expect_unchanged((SC.INVALID_ARGUMENT, SC.RESOURCE_EXHAUSTED), S, api.append, S,
                              b"\3" * 1024, n, 1 << 40)
        self.expect_unchanged((SC.INVALID_ARGUMENT, SC.RESOURCE_EXHAUSTED), S, api.append, S,
                              b"\4" * per_token, n, (1 << 64) - 1)
        # Replacing the shape of a model that has sequences is refused.
        self.expect_unchanged((SC.FAILED_PRECONDITION, SC.ALREADY_EXISTS), S, api.PutModel,
                              pb.PutModelRequest(model=self.model("py-f16", 4, 2, 64, q_heads=4),
                                                 replace=True), timeout=CALL_TIMEOUT)
        g = api.GetModel(pb.GetModelRequest(name="py-f16"), timeout=CALL_TIMEOUT).model
        eq(g.num_layers, 3, "py-f16 num_layers after a refused replace")
        # ... and allowed without sequences.
        self.put_model(self.model("py-rep", 2, 2, 8))
        api.PutModel(pb.PutModelRequest(model=self.model("py-rep", 5, 2, 8), replace=True),
                     timeout=CALL_TIMEOUT)
        g = api.GetModel(pb.GetModelRequest(name="py-rep"), timeout=CALL_TIMEOUT).model
        eq(g.num_layers, 5, "py-rep num_layers after replace")

    def t_header_memory(self):
        """A header promising 2^30 tokens (1.5 TiB) with 1 KiB behind it is
        refused before the server sets memory aside for it: the claim is
        untrusted until the bytes arrive."""
        S = b"py-seq"
        n = self.refs[S].tokens(0)
        before = self.server.vm_peak_kib()
        self.expect_unchanged((SC.INVALID_ARGUMENT, SC.RESOURCE_EXHAUSTED), S, self.api.append,
                              S, b"\3" * 1024, n, 1 << 30)
        grown = self.server.vm_peak_kib() - before
        check(grown < 1024 * 1024,
              "an Append header claiming 2^30 tokens grew kvdepotd's peak virtual memory by "
              "%d MiB before any data arrived" % (grown // 1024))

    def t_concurrent(self):
        """Appends and reads from several threads at once, on one channel."""
        seqs = [b"py-conc-%d" % i for i in range(4)]
        for i, seq_id in enumerate(seqs):
            self.refs[seq_id] = Reference(3, 2, 64, 2, seed=100 + i)
            self.create(seq_id, "py-f16")
        errors = []

        def worker(seq_id):
            try:
                ref = self.refs[seq_id]
                for _ in range(3):
                    self.append_ref(seq_id, ref, 0, 3, 97, chunks=20000)
                    self.api.read(b"py-seq", max_chunk_bytes=65536)
                    self.verify(seq_id)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append("%r: %s" % (seq_id, e if isinstance(e, CheckFailed) else repr(e)))

        threads = [threading.Thread(target=worker, args=(s,)) for s in seqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        check(not errors, "; ".join(errors))
        for seq_id in seqs:
            self.verify(seq_id)
        self.verify(b"py-seq")

    def t_delete_races(self):
        """Deleting a sequence while it is read gives the reader all of it or an
        error, never part; an append racing with a deletion fails; so does one
        racing with a forced model deletion."""
        pb, api = self.pb, self.api
        self.put_model(self.model("py-race", 8, 8, 128))
        tokens = 512  # 32 KiB per token: 16 MiB
        data = os.urandom(tokens * 32 * 1024)
        self.create(b"py-race-read", "py-race")
        api.append(b"py-race-read", data, 0, tokens, chunks=MiB)
        outcome = []

        def reader():
            try:
                _, got = api.read(b"py-race-read", max_chunk_bytes=MiB)
                outcome.append(("ok", got == data))
            except grpc.RpcError as e:
                outcome.append((e.code(), e.details()))
            except CheckFailed as e:
                outcome.append(("check", str(e)))

        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.05)
        api.DeleteSequence(pb.DeleteSequenceRequest(sequence_id=b"py-race-read"),
                           timeout=CALL_TIMEOUT)
        t.join(120)
        check(outcome, "read racing with a delete did not finish")
        check(outcome[0] == ("ok", True) or outcome[0][0] in (SC.NOT_FOUND, SC.ABORTED),
              "read racing with a delete: %r" % (outcome[0],))

        def racing_append(seq_id, delete):
            self.create(seq_id, "py-race")
            release = threading.Event()

            def msgs():
                yield pb.AppendRequest(header=pb.AppendHeader(
                    sequence_id=seq_id, num_tokens=tokens, dtype=pb.DTYPE_F16), data=data[:MiB])
                release.wait(30)
                for i in range(MiB, len(data), MiB):
                    yield pb.AppendRequest(data=data[i:i + MiB])

            fut = api.Append.future(msgs(), timeout=CALL_TIMEOUT)
            try:
                time.sleep(0.3)
                delete()
            finally:
                release.set()
            try:
                fut.result()
                raise CheckFailed("append to %r succeeded across its deletion" % seq_id)
            except grpc.RpcError as e:
                check(e.code() in (SC.NOT_FOUND, SC.ABORTED),
                      "append across deletion: %s: %s" % (e.code().name, e.details()))
            expect_code(SC.NOT_FOUND, api.StatSequence,
                        pb.StatSequenceRequest(sequence_id=seq_id), timeout=CALL_TIMEOUT)

        racing_append(b"py-race-a", lambda: api.DeleteSequence(
            pb.DeleteSequenceRequest(sequence_id=b"py-race-a"), timeout=CALL_TIMEOUT))
        racing_append(b"py-race-b", lambda: api.DeleteModel(
            pb.DeleteModelRequest(name="py-race", force=True), timeout=CALL_TIMEOUT))
        check(self.server.alive(), "kvdepotd died")
        self.verify(b"py-seq")

    def t_errors_read(self):
        api = self.api
        S = b"py-seq"
        n = self.refs[S].tokens(0)
        self.expect_unchanged(SC.OUT_OF_RANGE, S, api.read, S, token_start=n, num_tokens=1)
        self.expect_unchanged(SC.OUT_OF_RANGE, S, api.read, S, token_start=0, num_tokens=n + 1)
        self.expect_unchanged(SC.OUT_OF_RANGE, S, api.read, S, token_start=n + 5)
        # token_start + num_tokens wraps around 2^64: must not wrap into range.
        self.expect_unchanged((SC.OUT_OF_RANGE, SC.INVALID_ARGUMENT), S, api.read, S,
                              token_start=(1 << 63), num_tokens=(1 << 63))
        # A layer range outside the model is a bad range either way.
        self.expect_unchanged((SC.INVALID_ARGUMENT, SC.OUT_OF_RANGE), S, api.read, S,
                              layer_start=3)
        self.expect_unchanged((SC.INVALID_ARGUMENT, SC.OUT_OF_RANGE), S, api.read, S,
                              layer_start=1, num_layers=3)

    # Bytes no protobuf parser may accept (field 0 and stray end-group tags
    # are left out: some parsers take them as the end of the message).
    GARBAGE = (
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # over-long varint tag
        b"\x0a\x7fshort",                                   # length past the end
        b"\x0f\x01",                                        # wire type 7
        b"\x0a",                                            # tag without a value
        b"\x08\x96\x01\x12\xff\xff\xff\xff\x0fjunk",         # 4 GiB length field
        b"GET / HTTP/1.1\r\n\r\n",                         # text: 'G' is wire type 7
    )

    def t_errors_garbage(self):
        pb = self.pb
        S = b"py-seq"
        for method in ("StatSequence", "CreateSequence", "PutModel", "Lookup", "GetModel",
                       "DeleteSequence", "ListSequences"):
            for g in self.GARBAGE:
                try:
                    self.expect_unchanged(SC.INVALID_ARGUMENT, S, self.api.raw_unary(method), g,
                                          timeout=CALL_TIMEOUT)
                except CheckFailed as e:
                    raise CheckFailed("%s with %r: %s" % (method, g[:12], e))
        for g in self.GARBAGE:
            self.expect_unchanged(SC.INVALID_ARGUMENT, S, self.api.raw_unary_stream("Read"), g,
                                  timeout=CALL_TIMEOUT)
        # Not garbage: fields this version does not know are skipped, as
        # protobuf requires (a newer client talking to this server).
        for extra in (b"\x78\x05", b"\xfa\x06\x03abc", b"\xf9\x07" + b"\0" * 8):
            raw = pb.StatSequenceRequest(sequence_id=S).SerializeToString() + extra
            r = pb.StatSequenceResponse.FromString(
                self.api.raw_unary("StatSequence")(raw, timeout=CALL_TIMEOUT))
            eq(r.sequence.num_tokens, self.refs[S].tokens(0),
               "StatSequence with unknown field %r" % extra)
        # Garbage inside an Append stream after a valid header and some data.
        ref = self.refs[S]
        n = ref.tokens(0)
        data = ref.make_append(0, 3, 4)
        hdr = pb.AppendRequest(header=pb.AppendHeader(
            sequence_id=S, token_start=n, num_tokens=4, dtype=pb.DTYPE_F16))
        for g in self.GARBAGE:
            msgs = [hdr.SerializeToString(),
                    pb.AppendRequest(data=data[:100]).SerializeToString(), g]
            self.expect_unchanged(SC.INVALID_ARGUMENT, S, self.api.raw_stream_unary("Append"),
                                  iter(msgs), timeout=CALL_TIMEOUT)
            # Garbage as the very first message.
            self.expect_unchanged(SC.INVALID_ARGUMENT, S, self.api.raw_stream_unary("Append"),
                                  iter([g]), timeout=CALL_TIMEOUT)

    def t_append_atomic(self):
        """An Append is invisible until acknowledged; of two appends racing for
        the same token_start exactly one lands."""
        pb = self.pb
        S = b"py-seq"
        ref = self.refs[S]
        n = ref.tokens(0)
        datas = [ref.make_append(0, 3, 30), ref.make_append(0, 3, 30)]
        half_sent = [threading.Event(), threading.Event()]
        release = [threading.Event(), threading.Event()]

        def msgs(i):
            d = datas[i]
            yield pb.AppendRequest(header=pb.AppendHeader(
                sequence_id=S, token_start=n, num_tokens=30, dtype=pb.DTYPE_F16),
                data=d[:len(d) // 2])
            half_sent[i].set()
            release[i].wait(30)
            yield pb.AppendRequest(data=d[len(d) // 2:])

        futs = [self.api.Append.future(msgs(i), timeout=CALL_TIMEOUT) for i in (0, 1)]
        try:
            for ev in half_sent:
                check(ev.wait(10), "append stream did not start")
            time.sleep(0.3)
            self.verify(S, "while two appends are half sent, sequence")
            release[0].set()
            r = futs[0].result()
            eq(r.sequence.num_tokens, n + 30, "num_tokens after the first append")
            ref.commit(0, 3, 30, datas[0])
            release[1].set()
            try:
                futs[1].result()
                raise CheckFailed("both appends at token %d succeeded" % n)
            except grpc.RpcError as e:
                check(e.code() in (SC.FAILED_PRECONDITION, SC.ABORTED),
                      "losing append: expected FAILED_PRECONDITION/ABORTED, got %s: %s"
                      % (e.code().name, e.details()))
            self.verify(S, "after the race, sequence")
        finally:
            for ev in release:
                ev.set()

    def t_cancelled_append(self):
        pb = self.pb
        S = b"py-seq"
        ref = self.refs[S]
        n = ref.tokens(0)
        data = ref.make_append(0, 3, 40)
        release = threading.Event()

        def msgs():
            yield pb.AppendRequest(header=pb.AppendHeader(
                sequence_id=S, token_start=n, num_tokens=40, dtype=pb.DTYPE_F16),
                data=data[:len(data) // 2])
            release.wait(30)

        fut = self.api.Append.future(msgs(), timeout=CALL_TIMEOUT)
        time.sleep(0.5)
        fut.cancel()
        release.set()
        check(fut.cancelled() or fut.exception() is not None, "cancelled Append succeeded")
        time.sleep(0.5)
        check(self.server.alive(), "kvdepotd died")
        self.verify(S, "after a cancelled Append, sequence")
        # The sequence still takes the append that was cancelled.
        self.append_ref(S, ref, 0, 3, 40)
        self.verify(S)

    def t_prefix(self):
        pb, api = self.pb, self.api
        self.put_model(self.model("py-prefix", 2, 2, 32))
        B = self.B or self.create(b"py-prefix-probe", "py-prefix").page_tokens
        rng = random.Random(3)
        ids = [rng.getrandbits(32) for _ in range(3 * B + 10)]
        src = self.refs[b"py-prefix-src"] = Reference(2, 2, 32, 2, seed=4)
        self.create(b"py-prefix-src", "py-prefix")
        # Block 0 completes in the second append: the server has to keep the
        # token ids of the first one.
        self.append_ref(b"py-prefix-src", src, 0, 2, B - 56, token_ids=ids[:B - 56])
        self.append_ref(b"py-prefix-src", src, 0, 2, B + 66, chunks=5000,
                        token_ids=ids[B - 56:2 * B + 10])
        h = self.hash.chain(ids, B)
        info = self.stat(b"py-prefix-src")
        eq(list(info.block_hashes), h[:2], "block_hashes vs the documented xxh3-64 chain")

        def lookup(model, hashes):
            r = api.Lookup(pb.LookupRequest(model=model, block_hashes=hashes),
                           timeout=CALL_TIMEOUT)
            return (r.matched_blocks, r.matched_tokens)

        bogus = (h[1] ^ 0x5A5A5A5A5A5A5A5A) or 1
        eq(lookup("py-prefix", h[:2]), (2, 2 * B), "Lookup of the stored chain")
        eq(lookup("py-prefix", h[:3]), (2, 2 * B), "Lookup of chain + unstored block")
        eq(lookup("py-prefix", [h[0], bogus]), (1, B), "Lookup with a wrong second hash")
        eq(lookup("py-prefix", [bogus, h[1]]), (0, 0), "Lookup with a wrong first hash")
        eq(lookup("py-prefix", []), (0, 0), "Lookup of an empty chain")
        eq(lookup("py-f16", h[:2]), (0, 0), "Lookup under another model")
        expect_code(SC.NOT_FOUND, api.Lookup,
                    pb.LookupRequest(model="py-no-model", block_hashes=h[:1]),
                    timeout=CALL_TIMEOUT)

        # A new sequence from the stored prefix, then grown by one block.
        dst = self.refs[b"py-prefix-dst"] = Reference(2, 2, 32, 2, seed=5)
        for l in range(2):
            dst.k[l] += src.k[l][:2 * B * src.row]
            dst.v[l] += src.v[l][:2 * B * src.row]
        info = self.create(b"py-prefix-dst", "py-prefix", prefix_hashes=h[:2],
                           prefix_token_ids=ids[:2 * B])
        eq((info.num_tokens, info.prefix_blocks), (2 * B, 2), "sequence created from prefix")
        self.verify(b"py-prefix-dst")
        self.append_ref(b"py-prefix-dst", dst, 0, 2, B, token_ids=ids[2 * B:3 * B])
        self.verify(b"py-prefix-dst")
        eq(list(self.stat(b"py-prefix-dst").block_hashes), h[:3],
           "block_hashes of the grown sequence")
        eq(lookup("py-prefix", h[:3]), (3, 3 * B), "Lookup after growing from the prefix")
        self.prefix_chain = h[:3]

        # Bad prefixes.
        self.expect_unchanged(SC.NOT_FOUND, b"py-prefix-dst", self.create, b"py-prefix-bad",
                              "py-prefix", prefix_hashes=[h[0], bogus])
        wrong_ids = list(ids[:2 * B])
        wrong_ids[7] ^= 1
        self.expect_unchanged(SC.INVALID_ARGUMENT, b"py-prefix-dst", self.create,
                              b"py-prefix-bad", "py-prefix", prefix_hashes=h[:2],
                              prefix_token_ids=wrong_ids)
        self.expect_unchanged(SC.INVALID_ARGUMENT, b"py-prefix-dst", self.create,
                              b"py-prefix-bad", "py-prefix", prefix_hashes=h[:2],
                              prefix_token_ids=ids[:2 * B - 1])
        expect_code(SC.NOT_FOUND, api.StatSequence,
                    pb.StatSequenceRequest(sequence_id=b"py-prefix-bad"), timeout=CALL_TIMEOUT)

        # Shared pages outlive the sequence they came from.
        r = api.DeleteSequence(pb.DeleteSequenceRequest(sequence_id=b"py-prefix-src"),
                               timeout=CALL_TIMEOUT)
        del self.refs[b"py-prefix-src"]
        check(r.freed_pages >= 0, "freed_pages")
        self.verify(b"py-prefix-dst", "prefix sequence after deleting its source:")

    def t_prefix_more(self):
        """Chaining from a prefix given by hashes alone; blocks count only once
        every layer is sealed; prefixes are per model."""
        pb, api = self.pb, self.api
        B = self.B
        h = self.prefix_chain
        check(h is not None, "needs the prefix check")
        rng = random.Random(8)
        # From hashes only (no token ids): the next block chains from h[2].
        ref = self.refs[b"py-prefix-h"] = Reference(2, 2, 32, 2, seed=9)
        dst = self.refs[b"py-prefix-dst"]
        for l in range(2):
            ref.k[l] += dst.k[l][:3 * B * dst.row]
            ref.v[l] += dst.v[l][:3 * B * dst.row]
        info = self.create(b"py-prefix-h", "py-prefix", prefix_hashes=h)
        eq((info.num_tokens, info.prefix_blocks), (3 * B, 3), "sequence from hashes only")
        ids = [rng.getrandbits(32) for _ in range(B)]
        # Layer by layer: the block is complete only with its last layer.
        self.append_ref(b"py-prefix-h", ref, 0, 1, B, token_ids=ids)
        eq(list(self.stat(b"py-prefix-h").block_hashes), h,
           "block_hashes with one layer of block 3 sealed")
        h3 = self.hash.chain(ids, B, parent=h[2])
        r = api.Lookup(pb.LookupRequest(model="py-prefix", block_hashes=h + h3),
                       timeout=CALL_TIMEOUT)
        eq(r.matched_blocks, 3, "Lookup while block 3 lacks a layer")
        self.append_ref(b"py-prefix-h", ref, 1, 1, B, token_ids=ids)
        eq(list(self.stat(b"py-prefix-h").block_hashes), h + h3,
           "block_hashes chained from a prefix given by hashes only")
        r = api.Lookup(pb.LookupRequest(model="py-prefix", block_hashes=h + h3),
                       timeout=CALL_TIMEOUT)
        eq(r.matched_blocks, 4, "Lookup after block 3 is sealed on every layer")
        self.verify(b"py-prefix-h")
        self.verify(b"py-prefix-dst", "the sequence the prefix came from:")
        # A chain stored for one model does not exist for another.
        self.expect_unchanged(SC.NOT_FOUND, b"py-prefix-h", self.create, b"py-prefix-x",
                              "py-f16", prefix_hashes=h[:1])

    def t_engine_hashes(self):
        B = self.B
        ref = self.refs[b"py-engine"] = Reference(2, 2, 32, 2, seed=6)
        self.create(b"py-engine", "py-prefix")
        e = [0x0123456789ABCDEF, 0xFEDCBA9876543210]
        self.append_ref(b"py-engine", ref, 0, 2, 2 * B + 3, block_hashes=e)
        eq(list(self.stat(b"py-engine").block_hashes), e, "engine-supplied block_hashes")
        r = self.api.Lookup(self.pb.LookupRequest(model="py-prefix", block_hashes=e),
                            timeout=CALL_TIMEOUT)
        eq((r.matched_blocks, r.matched_tokens), (2, 2 * B), "Lookup of engine hashes")
        self.verify(b"py-engine")

    def t_list_delete(self):
        pb, api = self.pb, self.api
        ids = []
        token = b""
        for _ in range(100):
            r = api.ListSequences(pb.ListSequencesRequest(model="py-f16", page_size=1,
                                                          page_token=token),
                                  timeout=CALL_TIMEOUT)
            check(len(r.sequences) <= 1, "page_size 1 returned %d" % len(r.sequences))
            ids += [s.sequence_id for s in r.sequences]
            token = r.next_page_token
            if not token:
                break
        eq(sorted(ids), [b"py-layers", b"py-seq"], "ListSequences(py-f16) paged by 1")
        all_ids = [s.sequence_id for s in api.ListSequences(
            pb.ListSequencesRequest(), timeout=CALL_TIMEOUT).sequences]
        check(b"py-prefix-dst" in all_ids and b"py-seq" in all_ids,
              "ListSequences() lacks sequences: %r" % all_ids)
        self.expect_unchanged(SC.FAILED_PRECONDITION, b"py-seq", api.DeleteModel,
                              pb.DeleteModelRequest(name="py-f16"), timeout=CALL_TIMEOUT)
        api.DeleteSequence(pb.DeleteSequenceRequest(sequence_id=b"py-layers"),
                           timeout=CALL_TIMEOUT)
        del self.refs[b"py-layers"]
        expect_code(SC.NOT_FOUND, api.StatSequence,
                    pb.StatSequenceRequest(sequence_id=b"py-layers"), timeout=CALL_TIMEOUT)
        expect_code(SC.NOT_FOUND, api.read, b"py-layers")
        self.verify(b"py-seq", "py-seq after deleting py-layers:")
        # Forced model deletion takes its sequences along, and nothing else.
        self.put_model(self.model("py-tmp", 1, 1, 8))
        self.create(b"py-tmp-1", "py-tmp")
        self.create(b"py-tmp-2", "py-tmp")
        self.api.append(b"py-tmp-1", b"\7" * (2 * 1 * 8 * 2 * 300), 0, 300)
        r = api.DeleteModel(pb.DeleteModelRequest(name="py-tmp", force=True),
                            timeout=CALL_TIMEOUT)
        eq(r.deleted_sequences, 2, "DeleteModel(force) deleted_sequences")
        expect_code(SC.NOT_FOUND, api.GetModel, pb.GetModelRequest(name="py-tmp"),
                    timeout=CALL_TIMEOUT)
        expect_code(SC.NOT_FOUND, api.StatSequence,
                    pb.StatSequenceRequest(sequence_id=b"py-tmp-1"), timeout=CALL_TIMEOUT)
        self.verify(b"py-seq", "py-seq after deleting model py-tmp:")
        # Names come back clean: a new model of another shape under the old
        # name, a sequence under the old id, and none of the old data.
        self.put_model(self.model("py-tmp", 2, 1, 8))
        ref = Reference(2, 1, 8, 2, seed=11)
        info = self.create(b"py-tmp-1", "py-tmp")
        eq((info.num_tokens, list(info.layer_tokens)), (0, [0, 0]), "re-created py-tmp-1")
        self.refs[b"py-tmp-1"] = ref
        self.append_ref(b"py-tmp-1", ref, 0, 2, 5)
        self.verify(b"py-tmp-1")
        del self.refs[b"py-tmp-1"]
        r = api.DeleteModel(pb.DeleteModelRequest(name="py-tmp", force=True),
                            timeout=CALL_TIMEOUT)
        eq(r.deleted_sequences, 1, "DeleteModel(force) deleted_sequences")

    def t_large(self):
        """A model the size of an 8B-class LLM (32 layers x 8 KV heads x 128, f16):
        128 KiB of K+V per token; --large-mib MiB appended in one stream of 1 MiB
        messages and read back in 4 MiB chunks."""
        pb = self.pb
        mib = self.args.large_mib
        tokens = mib * 8
        self.put_model(self.model("py-large", 32, 8, 128, q_heads=32))
        self.create(b"py-large", "py-large")
        total = 2 * 32 * tokens * 8 * 128 * 2
        sent = hashlib.sha256()
        rng = random.Random(7)

        def msgs():
            yield pb.AppendRequest(header=pb.AppendHeader(
                sequence_id=b"py-large", num_tokens=tokens, dtype=pb.DTYPE_F16))
            left = total
            while left:
                piece = rng.randbytes(min(MiB, left))
                sent.update(piece)
                left -= len(piece)
                yield pb.AppendRequest(data=piece)

        t0 = time.monotonic()
        r = self.api.Append(msgs(), timeout=600)
        t_append = time.monotonic() - t0
        eq(r.bytes_received, total, "large Append bytes_received")
        eq(r.sequence.num_tokens, tokens, "large Append num_tokens")
        self.large_digest = sent.digest()
        t_read = self.read_large(tokens, total)
        # A Read cancelled after its first chunks leaves the server healthy.
        call = self.api.Read(pb.ReadRequest(sequence_id=b"py-large"), timeout=600)
        for i, _ in enumerate(call):
            if i == 2:
                call.cancel()
                break
        h = self.api.HealthCheck(self.hpb.HealthCheckRequest(), timeout=CALL_TIMEOUT)
        eq(h.status, self.hpb.HealthCheckResponse.SERVING, "health after a cancelled Read")
        # max_chunk_bytes is capped at 4 MiB (or refused).
        try:
            self.read_large(tokens, total, max_chunk=64 * MiB)
        except grpc.RpcError as e:
            check(e.code() == SC.INVALID_ARGUMENT,
                  "max_chunk_bytes 64 MiB: %s %s" % (e.code().name, e.details()))
        print("     large: %d MiB, append %.0f MB/s, read %.0f MB/s (python client)"
              % (mib, total / t_append / 1e6, total / t_read / 1e6), flush=True)

    def read_large(self, tokens, total, max_chunk=4 * MiB):
        req = self.pb.ReadRequest(sequence_id=b"py-large", max_chunk_bytes=max_chunk)
        got = hashlib.sha256()
        size = 0
        t0 = time.monotonic()
        for i, resp in enumerate(self.api.Read(req, timeout=600)):
            if i == 0:
                check(resp.HasField("header"), "first Read response carries no header")
                eq((resp.header.num_layers, resp.header.num_tokens, resp.header.total_bytes),
                   (32, tokens, total), "large read header")
            check(len(resp.data) <= 4 * MiB, "Read chunk over max_chunk_bytes")
            got.update(resp.data)
            size += len(resp.data)
        elapsed = time.monotonic() - t0
        eq(size, total, "large read size")
        check(got.digest() == self.large_digest, "large sequence read back differs (sha256)")
        return elapsed

    def t_restart(self):
        """SIGTERM exits 0; a restarted server serves everything acknowledged."""
        self.api.close()
        self.api = None
        t0 = time.monotonic()
        rc = self.server.stop()
        t1 = time.monotonic()
        eq(rc, 0, "kvdepotd exit status on SIGTERM")
        self.connect()
        print("     stop %.2f s, start %.2f s" % (t1 - t0, time.monotonic() - t1), flush=True)
        for seq_id in sorted(self.refs):
            self.verify(seq_id, "after restart, %r" % seq_id)
        if self.large_digest is not None:
            self.read_large(self.args.large_mib * 8, self.args.large_mib * 8 * 128 * 1024)
        if self.args.large_only:
            return
        # Deletions are as durable as writes.
        pb, api = self.pb, self.api
        for gone in (b"py-layers", b"py-prefix-src", b"py-tmp-1", b"py-tmp-2"):
            expect_code(SC.NOT_FOUND, api.StatSequence,
                        pb.StatSequenceRequest(sequence_id=gone), timeout=CALL_TIMEOUT)
        expect_code(SC.NOT_FOUND, api.GetModel, pb.GetModelRequest(name="py-tmp"),
                    timeout=CALL_TIMEOUT)
        names = {m.name for m in api.ListModels(pb.ListModelsRequest(),
                                                timeout=CALL_TIMEOUT).models}
        check({"py-f16", "py-prefix", "py-f32", "py-bf16"} <= names,
              "models after restart: %r" % sorted(names))
        if self.prefix_chain is not None:
            h = self.prefix_chain
            r = api.Lookup(pb.LookupRequest(model="py-prefix", block_hashes=h),
                           timeout=CALL_TIMEOUT)
            eq(r.matched_blocks, len(h), "Lookup after restart")
            # A new sequence from the persisted prefix holds the same bytes.
            B = self.B
            dst = self.refs[b"py-prefix-dst"]
            ref = self.refs[b"py-prefix-r"] = Reference(2, 2, 32, 2, seed=12)
            for l in range(2):
                ref.k[l] += dst.k[l][:len(h) * B * dst.row]
                ref.v[l] += dst.v[l][:len(h) * B * dst.row]
            self.create(b"py-prefix-r", "py-prefix", prefix_hashes=h)
            self.verify(b"py-prefix-r", "sequence from the prefix after restart:")

    def t_security(self):
        """TLS, mTLS and bearer tokens against a server run with a certificate,
        a client CA and a tokens file, all made here (openssl CLI)."""
        pb, hpb = self.pb, self.hpb
        pki = os.path.join(self.workdir, "pki")
        os.makedirs(pki)

        def ssl(*a):
            try:
                subprocess.run(["openssl"] + list(a), cwd=pki, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            except (OSError, subprocess.CalledProcessError) as e:
                fatal("openssl failed (Debian package openssl): %s" % e)

        def pem(name):
            with open(os.path.join(pki, name), "rb") as f:
                return f.read()

        ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "1", "-subj", "/CN=interop CA")
        for who, ext in (("server", "subjectAltName=DNS:kvdepot.test"), ("client", None)):
            ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", who + ".key", "-out",
                who + ".csr", "-subj", "/CN=" + who)
            extra = []
            if ext:
                with open(os.path.join(pki, who + ".ext"), "w") as f:
                    f.write(ext + "\n")
                extra = ["-extfile", who + ".ext"]
            ssl("x509", "-req", "-in", who + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", who + ".pem", "-days", "1", *extra)
        tokens = os.path.join(self.workdir, "tokens.yaml")
        with open(tokens, "w") as f:
            f.write("tokens:\n"
                    "  - {token: py-rw-0123456789abc, tenant: py, namespaces: [\"py-*\"]}\n"
                    "  - {token: py-ro-0123456789abc, tenant: py, namespaces: [\"py-*\"],"
                    " access: read-only}\n"
                    "  - {token: py-old-0123456789ab, tenant: py, namespaces: [\"*\"],"
                    " expires: 2001-01-01T00:00:00Z}\n")
        self.server.start(extra_args=[
            "--tls-cert", os.path.join(pki, "server.pem"),
            "--tls-key", os.path.join(pki, "server.key"),
            "--tls-client-ca", os.path.join(pki, "ca.pem"),
            "--tokens-file", tokens, "--metrics-listen", ""])

        def api(token=None, client_cert=True, ready_timeout=30):
            creds = grpc.ssl_channel_credentials(
                root_certificates=pem("ca.pem"),
                private_key=pem("client.key") if client_cert else None,
                certificate_chain=pem("client.pem") if client_cert else None)
            if token:
                creds = grpc.composite_channel_credentials(
                    creds, grpc.access_token_call_credentials(token))
            return Api(self.server.addr, pb, hpb, creds=creds, server_name="kvdepot.test",
                       ready_timeout=ready_timeout)

        # Without a client certificate the handshake fails.
        try:
            a = api(client_cert=False, ready_timeout=1.5)
            a.close()
            raise CheckFailed("mTLS handshake succeeded without a client certificate")
        except grpc.FutureTimeoutError:
            pass
        anon = api()
        r = anon.HealthCheck(hpb.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT)
        eq(r.status, hpb.HealthCheckResponse.SERVING, "health over mTLS without a token")
        expect_code(SC.UNAUTHENTICATED, anon.ListModels, pb.ListModelsRequest(),
                    timeout=CALL_TIMEOUT)
        anon.close()
        for bad in ("py-nope-0123456789a", "py-old-0123456789ab"):
            b = api(bad)
            expect_code(SC.UNAUTHENTICATED, b.ListModels, pb.ListModelsRequest(),
                        timeout=CALL_TIMEOUT)
            b.close()
        rw = api("py-rw-0123456789abc")
        m = self.model("py-m", 2, 1, 8)
        rw.PutModel(pb.PutModelRequest(model=m), timeout=CALL_TIMEOUT)
        expect_code(SC.PERMISSION_DENIED, rw.PutModel,
                    pb.PutModelRequest(model=self.model("other", 2, 1, 8)), timeout=CALL_TIMEOUT)
        rw.CreateSequence(pb.CreateSequenceRequest(sequence_id=b"py-s", model="py-m"),
                          timeout=CALL_TIMEOUT)
        data = os.urandom(2 * 2 * 3 * 8 * 2)  # K+V, 2 layers, 3 tokens, 1 head x 8, f16
        rw.append(b"py-s", data, 0, 3, chunks=2)
        eq(rw.read(b"py-s")[1], data, "bytes read back over mTLS")
        ro = api("py-ro-0123456789abc")
        expect_code(SC.PERMISSION_DENIED, ro.append, b"py-s", data, 3, 3)
        eq(ro.read(b"py-s")[1], data, "read-only token reads")
        ro.close()
        rw.close()
        eq(self.server.stop(), 0, "kvdepotd exit status on SIGTERM")

    def t_shutdown(self):
        self.api.close()
        self.api = None
        rc = self.server.stop()
        eq(rc, 0, "kvdepotd exit status on SIGTERM")

    def main(self):
        if self.args.security_only:
            self.run("tls, mtls and tokens", self.t_security)
            return
        try:
            self.connect()
        except CheckFailed as e:
            print("FAIL %-28s %s" % ("start kvdepotd", e), flush=True)
            self.failed += 1
            return
        checks = [
            ("health", self.t_health),
            ("models", self.t_models),
            ("model errors", self.t_model_errors),
            ("append/read round trip", self.t_roundtrip),
            ("append layer by layer", self.t_layerwise),
            ("f32, bf16, binary ids", self.t_dtypes),
            ("unknown ids", self.t_errors_unknown),
            ("create errors", self.t_errors_create),
            ("append errors", self.t_errors_append),
            ("read errors", self.t_errors_read),
            ("header reserves no memory", self.t_header_memory),
            ("limits and overflow", self.t_errors_limits),
            ("garbage messages", self.t_errors_garbage),
            ("append atomicity", self.t_append_atomic),
            ("cancelled append", self.t_cancelled_append),
            ("prefix hash and lookup", self.t_prefix),
            ("prefix chains, per layer", self.t_prefix_more),
            ("engine-supplied hashes", self.t_engine_hashes),
            ("list and delete", self.t_list_delete),
            ("concurrent clients", self.t_concurrent),
            ("deletes racing reads/appends", self.t_delete_races),
            ("large %d MiB" % self.args.large_mib, self.t_large),
            ("compute: attend, search, plan", self.t_compute),
            ("codecs: VQ and SVD", self.t_codecs_vq_svd),
            ("activations (KVPR)", self.t_activations),
            ("calibrate and artifacts", self.t_calibrate),
            ("restart", self.t_restart),
            ("shutdown", self.t_shutdown),
        ]
        if self.args.large_only:
            keep = ("health", "large %d MiB" % self.args.large_mib, "restart", "shutdown")
            checks = [c for c in checks if c[0] in keep]
        for name, fn in checks:
            if not self.server.alive():
                # Without a server the rest cannot say anything: count them failed.
                if name not in ("restart",):
                    self.failed += 1
                    print("FAIL %-28s kvdepotd is not running" % name, flush=True)
                    continue
            self.run(name, fn)

    def cleanup(self):
        if self.api is not None:
            self.api.close()
        self.server.kill()
        if self.args.keep:
            print("%s: kept %s" % (PREFIX, self.workdir))
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvdepotd", required=True)
    ap.add_argument("--proto-dir", required=True, help="directory holding kvdepot/v1/kvdepot.proto")
    ap.add_argument("--health-proto-dir", default="/usr/share/grpc-proto",
                    help="directory holding grpc/health/v1/health.proto")
    ap.add_argument("--protoc", default=shutil.which("protoc") or "protoc")
    ap.add_argument("--large-mib", type=int, default=64, help="size of the large case (MiB)")
    ap.add_argument("--large-only", action="store_true",
                    help="run only the large case (with health, restart and shutdown)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--security-only", action="store_true",
                    help="run only the TLS/mTLS and token checks (own server)")
    args = ap.parse_args()
    if args.large_mib < 1:
        ap.error("--large-mib must be at least 1")
    if not os.access(args.kvdepotd, os.X_OK):
        fatal("kvdepotd not found or not executable: %s" % args.kvdepotd)

    suite = Suite(args)
    try:
        suite.main()
    finally:
        suite.cleanup()
    print("%s: %d passed, %d failed" % (PREFIX, suite.passed, suite.failed), flush=True)
    return 1 if suite.failed or not suite.passed else 0


if __name__ == "__main__":
    sys.exit(main())
