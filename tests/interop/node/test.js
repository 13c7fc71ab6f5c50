#!/usr/bin/env node
// kvdepot interop test: Node @grpc/grpc-js + @grpc/proto-loader against a real
// kvdepotd.
//
// The client shares no code with kvdepot: proto-loader reads
// proto/kvdepot/v1/kvdepot.proto and the standard grpc/health/v1/health.proto
// at run time. Prefix hashes are checked against kvd_prefix_hash, a helper
// that computes the hash documented in the .proto with libxxhash.
//
// Usage:
//   node test.js --kvdepotd PATH --proto-dir DIR [--health-proto-dir DIR]
//                --hash-tool PATH [--large-mib N] [--large-only] [--keep]
//
// Each check prints "ok" or "FAIL" with the reason; the last line is
// "interop-node: N passed, N failed"; the exit status is non-zero when a check
// failed or a prerequisite is missing.
'use strict';

const PREFIX = 'interop-node';

function fatal(msg) {
  // A missing prerequisite is a failure, never a skip: CI installs them.
  process.stderr.write(`${PREFIX}: FATAL: ${msg}\n`);
  process.stdout.write(`${PREFIX}: 0 passed, 1 failed\n`);
  process.exit(1);
}

let grpc, protoLoader;
try {
  grpc = require('@grpc/grpc-js');
  protoLoader = require('@grpc/proto-loader');
} catch (e) {
  fatal(`@grpc/grpc-js or @grpc/proto-loader missing: run "npm ci" (or "npm install") ` +
        `in ${__dirname}: ${e.message}`);
}

const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { spawn, execFileSync } = require('node:child_process');

const MiB = 1 << 20;
const CALL_TIMEOUT_MS = 60000;
const S = grpc.status;
const statusName = (code) => Object.keys(S).find((k) => S[k] === code) || String(code);

class CheckFailed extends Error {}

function check(cond, msg) {
  if (!cond) throw new CheckFailed(msg);
}

function eq(got, want, what) {
  try {
    assert.deepStrictEqual(got, want);
  } catch (e) {
    throw new CheckFailed(`${what}: got ${JSON.stringify(got)}, want ${JSON.stringify(want)}`);
  }
}

function parseArgs(argv) {
  const args = {
    healthProtoDir: '/usr/share/grpc-proto',
    largeMib: 64,
    keep: false,
  };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    const val = () => {
      if (i + 1 >= argv.length) fatal(`${a} needs a value`);
      return argv[++i];
    };
    if (a === '--kvdepotd') args.kvdepotd = val();
    else if (a === '--proto-dir') args.protoDir = val();
    else if (a === '--health-proto-dir') args.healthProtoDir = val();
    else if (a === '--hash-tool') args.hashTool = val();
    else if (a === '--large-mib') args.largeMib = Number(val());
    else if (a === '--keep') args.keep = true;
    else if (a === '--large-only') args.largeOnly = true;
    else if (a === '--security-only') args.securityOnly = true;
    else fatal(`unknown argument ${a}`);
  }
  if (!args.kvdepotd || !args.protoDir || !args.hashTool) {
    fatal('usage: test.js --kvdepotd PATH --proto-dir DIR --hash-tool PATH ' +
          '[--health-proto-dir DIR] [--large-mib N] [--large-only] [--keep]');
  }
  if (!Number.isInteger(args.largeMib) || args.largeMib < 1) fatal('--large-mib must be >= 1');
  for (const [what, p] of [['kvdepotd', args.kvdepotd], ['hash tool', args.hashTool]]) {
    try {
      fs.accessSync(p, fs.constants.X_OK);
    } catch (e) {
      fatal(`${what} not found or not executable: ${p}`);
    }
  }
  return args;
}

// ---------------------------------------------------------------------------
// Prefix hash through the helper: h_i = xxh3-64(le32 ids of block i, seed h_{i-1}).

function prefixChain(hashTool, tokenIds, pageTokens, parent = null) {
  const out = parent === null
    ? execFileSync(hashTool, [], { input: `${pageTokens} ${tokenIds.join(' ')}\n` })
    : execFileSync(hashTool, ['-s'], { input: `${pageTokens} ${parent} ${tokenIds.join(' ')}\n` });
  return out.toString().split('\n').filter((l) => l.length > 0);
}

// ---------------------------------------------------------------------------
// The server under test

class Server {
  constructor(exe, workdir) {
    this.exe = exe;
    this.workdir = workdir;
    this.dataDir = path.join(workdir, 'data');
    this.logPath = path.join(workdir, 'kvdepotd.log');
    this.proc = null;
    this.exitCode = null;
    this.addr = null;
  }

  async start(timeoutMs = 60000, extraArgs = []) {
    const portFile = path.join(this.workdir, 'port');
    fs.rmSync(portFile, { force: true });
    fs.mkdirSync(this.dataDir, { recursive: true });
    const log = fs.openSync(this.logPath, 'a');
    const argv = [this.exe, '--listen', '127.0.0.1:0', '--data-dir', this.dataDir,
                  '--port-file', portFile, ...extraArgs];
    // setpriv (util-linux) makes the server die with this process, so a test
    // killed by a timeout leaves no server behind; it execs, keeping the pid.
    if (fs.existsSync('/usr/bin/setpriv')) argv.unshift('/usr/bin/setpriv', '--pdeathsig', 'KILL', '--');
    const proc = spawn(argv[0], argv.slice(1), { stdio: ['ignore', log, log] });
    fs.closeSync(log);
    this.proc = proc;
    this.exitCode = null;
    proc.exited = new Promise((resolve) => {
      proc.on('exit', (code, signal) => {
        this.exitCode = code === null ? `signal ${signal}` : code;
        resolve(this.exitCode);
      });
      proc.on('error', (e) => {
        this.exitCode = `spawn error ${e.message}`;
        resolve(this.exitCode);
      });
    });
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      if (this.exitCode !== null) {
        this.proc = null;
        throw new CheckFailed(`kvdepotd exited (${this.exitCode}) before serving; log:\n` +
                              this.logTail());
      }
      let text = null;
      try {
        text = fs.readFileSync(portFile, 'utf8');
      } catch (e) { /* not written yet */ }
      if (text && text.endsWith('\n') && /^\d+\n$/.test(text)) {
        this.addr = `127.0.0.1:${parseInt(text, 10)}`;
        return;
      }
      if (Date.now() > deadline) {
        await this.kill();
        throw new CheckFailed(`kvdepotd wrote no port file in ${timeoutMs / 1000} s; log:\n` +
                              this.logTail());
      }
      await sleep(50);
    }
  }

  alive() {
    return this.proc !== null && this.exitCode === null;
  }

  // SIGTERM and wait; resolves to the exit status, or null after a forced kill.
  async stop(timeoutMs = 30000) {
    const proc = this.proc;
    if (proc === null) return null;
    if (this.exitCode === null) proc.kill('SIGTERM');
    let timer;
    const timeout = new Promise((resolve) => { timer = setTimeout(resolve, timeoutMs); });
    const rc = await Promise.race([proc.exited, timeout]);
    clearTimeout(timer); // a pending timer would keep node alive after the run
    if (rc === undefined) {
      await this.kill();
      return null;
    }
    this.proc = null;
    return rc;
  }

  async kill() {
    const proc = this.proc;
    if (proc === null) return;
    if (this.exitCode === null) {
      proc.kill('SIGKILL');
      await proc.exited;
    }
    this.proc = null;
  }

  // The server's peak virtual memory (VmPeak), in KiB.
  vmPeakKib() {
    const m = /^VmPeak:\s+(\d+)/m.exec(fs.readFileSync(`/proc/${this.proc.pid}/status`, 'utf8'));
    if (!m) throw new CheckFailed(`no VmPeak in /proc/${this.proc.pid}/status`);
    return Number(m[1]);
  }

  logTail(lines = 40) {
    try {
      return fs.readFileSync(this.logPath, 'utf8').split('\n').slice(-lines).join('\n');
    } catch (e) {
      return '(no log)';
    }
  }
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// ---------------------------------------------------------------------------
// Client side

const LOADER_OPTS = {
  keepCase: true,
  longs: String,   // uint64 / fixed64 as decimal strings: exact beyond 2^53
  enums: Number,
  defaults: true,
  oneofs: true,
};

class Api {
  // creds: grpc ChannelCredentials for TLS (default plaintext); serverName
  // overrides the name the server certificate must carry.
  constructor(addr, protoDir, healthProtoDir, creds = null, serverName = null) {
    const kv = grpc.loadPackageDefinition(
      protoLoader.loadSync('kvdepot/v1/kvdepot.proto', { ...LOADER_OPTS, includeDirs: [protoDir] }));
    const health = grpc.loadPackageDefinition(
      protoLoader.loadSync('grpc/health/v1/health.proto',
                           { ...LOADER_OPTS, includeDirs: [healthProtoDir] }));
    const opts = {
      'grpc.max_receive_message_length': 16 * MiB,
      'grpc.max_send_message_length': 16 * MiB,
    };
    if (serverName) opts['grpc.ssl_target_name_override'] = serverName;
    if (creds === null) creds = grpc.credentials.createInsecure();
    this.client = new kv.kvdepot.v1.KVDepot(addr, creds, opts);
    this.health = new health.grpc.health.v1.Health(addr, creds, opts);
    this.enums = {
      F16: 1, BF16: 2, F32: 3, UNSPECIFIED: 0,
    };
  }

  close() {
    this.client.close();
    this.health.close();
  }

  static deadline(ms = CALL_TIMEOUT_MS) {
    return { deadline: new Date(Date.now() + ms) };
  }

  unary(method, req, ms) {
    return new Promise((resolve, reject) => {
      this.client[method](req, Api.deadline(ms), (err, resp) => (err ? reject(err) : resolve(resp)));
    });
  }

  healthCheck(service) {
    return new Promise((resolve, reject) => {
      this.health.Check({ service }, Api.deadline(), (err, r) => (err ? reject(err) : resolve(r)));
    });
  }

  // Writes messages into a client stream, honouring back-pressure; `msgs` may
  // be an array or a generator.
  static async pump(call, msgs) {
    let finished = false;
    call.once('status', () => { finished = true; });
    for (const m of msgs) {
      if (finished) break; // the server already answered: nothing more to send
      if (!call.write(m)) {
        // Wait for room, or for the call to end (then no drain ever comes).
        await new Promise((resolve) => {
          const events = ['drain', 'error', 'status', 'close'];
          const done = () => {
            for (const ev of events) call.removeListener(ev, done);
            resolve();
          };
          for (const ev of events) call.on(ev, done);
        });
      }
    }
    call.end();
  }

  appendMsgs(seqId, data, tokenStart, numTokens, o = {}) {
    const header = {
      sequence_id: idBuf(seqId),
      layer_start: o.layerStart || 0,
      num_layers: o.numLayers || 0,
      token_start: String(tokenStart),
      num_tokens: String(numTokens),
      dtype: o.dtype === undefined ? this.enums.F16 : o.dtype,
      token_ids: o.tokenIds || [],
      block_hashes: o.blockHashes || [],
    };
    // dataWithHeader: the first piece rides in the header's message;
    // emptyBetween: a message without data after every piece.
    const msgs = [{ header }];
    for (const piece of split(data, o.chunks)) {
      if (o.dataWithHeader && msgs.length === 1 && !msgs[0].data) msgs[0].data = piece;
      else msgs.push({ data: piece });
      if (o.emptyBetween) msgs.push({});
    }
    return msgs;
  }

  appendStream(msgs, ms = CALL_TIMEOUT_MS) {
    return new Promise((resolve, reject) => {
      const call = this.client.Append(Api.deadline(ms), (err, r) => (err ? reject(err) : resolve(r)));
      Api.pump(call, msgs).catch(reject);
    });
  }

  append(seqId, data, tokenStart, numTokens, o = {}) {
    return this.appendStream(this.appendMsgs(seqId, data, tokenStart, numTokens, o));
  }

  // Reads a range, checking the stream framing; resolves to { header, data }.
  read(seqId, o = {}, ms = CALL_TIMEOUT_MS) {
    const req = {
      sequence_id: idBuf(seqId),
      layer_start: o.layerStart || 0,
      num_layers: o.numLayers || 0,
      token_start: String(o.tokenStart || 0),
      num_tokens: String(o.numTokens || 0),
      max_chunk_bytes: o.maxChunk || 0,
    };
    const limit = o.limit || o.maxChunk || MiB;
    return new Promise((resolve, reject) => {
      const call = this.client.Read(req, Api.deadline(ms));
      let header = null;
      let n = 0;
      let bad = null;
      const parts = [];
      const hash = o.hash ? crypto.createHash('sha256') : null;
      let size = 0;
      call.on('data', (resp) => {
        if (n === 0) {
          if (!resp.header) bad = bad || 'first Read response carries no header';
          header = resp.header;
        } else if (resp.header) {
          bad = bad || `Read response ${n} repeats the header`;
        }
        if (resp.data.length > limit) {
          bad = bad || `Read chunk of ${resp.data.length} bytes exceeds ${limit}`;
        }
        size += resp.data.length;
        if (hash) hash.update(resp.data);
        else parts.push(resp.data);
        n++;
      });
      call.on('error', reject);
      call.on('end', () => {
        if (bad) return reject(new CheckFailed(bad));
        if (header === null) return reject(new CheckFailed('Read stream carried no message'));
        if (String(size) !== header.total_bytes) {
          return reject(new CheckFailed(
            `Read bytes ${size} vs header.total_bytes ${header.total_bytes}`));
        }
        resolve({ header, data: hash ? null : Buffer.concat(parts), size,
                  digest: hash ? hash.digest('hex') : null });
      });
    });
  }

  // Raw calls: the request goes out as the given bytes.
  rawUnary(method, buf) {
    return new Promise((resolve, reject) => {
      this.client.makeUnaryRequest(`/kvdepot.v1.KVDepot/${method}`, (x) => x, (x) => x, buf,
                                   Api.deadline(), (err, r) => (err ? reject(err) : resolve(r)));
    });
  }

  rawServerStream(method, buf) {
    return new Promise((resolve, reject) => {
      const call = this.client.makeServerStreamRequest(`/kvdepot.v1.KVDepot/${method}`,
                                                       (x) => x, (x) => x, buf, Api.deadline());
      call.on('data', () => {});
      call.on('error', reject);
      call.on('end', resolve);
    });
  }

  rawClientStream(method, bufs) {
    return new Promise((resolve, reject) => {
      const call = this.client.makeClientStreamRequest(
        `/kvdepot.v1.KVDepot/${method}`, (x) => x, (x) => x, Api.deadline(),
        (err, r) => (err ? reject(err) : resolve(r)));
      Api.pump(call, bufs).catch(reject);
    });
  }
}

// Sequence ids are bytes: a Buffer as is, a string as latin1 (one byte per char).
function idBuf(id) {
  return Buffer.isBuffer(id) ? id : Buffer.from(id, 'latin1');
}

function split(data, chunks) {
  if (chunks === undefined) return data.length ? [data] : [];
  const out = [];
  if (typeof chunks === 'number') {
    for (let i = 0; i < data.length; i += chunks) out.push(data.subarray(i, i + chunks));
    return out;
  }
  let pos = 0;
  for (const n of chunks) {
    if (pos >= data.length) break;
    out.push(data.subarray(pos, pos + n));
    pos += n;
  }
  if (pos < data.length) out.push(data.subarray(pos));
  return out;
}

// Requires `p` to fail with `code` (or one of an array) and a message.
async function expectCode(code, p) {
  const codes = Array.isArray(code) ? code : [code];
  const want = codes.map(statusName).join('/');
  let resp;
  try {
    resp = await p;
  } catch (e) {
    if (e instanceof CheckFailed) throw e;
    if (typeof e.code !== 'number') throw e;
    if (!codes.includes(e.code)) {
      throw new CheckFailed(`expected ${want}, got ${statusName(e.code)}: ${e.details}`);
    }
    check(typeof e.details === 'string' && e.details.length > 0,
          `status ${statusName(e.code)} without a message`);
    return e;
  }
  throw new CheckFailed(`expected ${want}, call succeeded (${JSON.stringify(resp)?.slice(0, 200)})`);
}

// ---------------------------------------------------------------------------
// Reference copy of what a sequence should hold: K and V per layer, token rows.

class Reference {
  constructor(numLayers, kvHeads, headDim, esize) {
    this.numLayers = numLayers;
    this.row = kvHeads * headDim * esize;
    this.k = Array.from({ length: numLayers }, () => Buffer.alloc(0));
    this.v = Array.from({ length: numLayers }, () => Buffer.alloc(0));
  }

  tokens(layer) {
    return this.k[layer].length / this.row;
  }

  minTokens() {
    return Math.min(...this.k.map((b) => b.length / this.row));
  }

  // Bytes of a range in the wire layout: K [layer][token][head][dim], then V.
  wire(layerStart, numLayers, tokenStart, numTokens) {
    const a = tokenStart * this.row;
    const b = (tokenStart + numTokens) * this.row;
    const ks = [];
    const vs = [];
    for (let l = layerStart; l < layerStart + numLayers; l++) {
      ks.push(this.k[l].subarray(a, b));
      vs.push(this.v[l].subarray(a, b));
    }
    return Buffer.concat([...ks, ...vs]);
  }

  makeAppend(numLayers, numTokens) {
    return crypto.randomBytes(2 * numLayers * numTokens * this.row);
  }

  commit(layerStart, numLayers, numTokens, data) {
    const per = numTokens * this.row;
    const half = numLayers * per;
    for (let i = 0; i < numLayers; i++) {
      const l = layerStart + i;
      this.k[l] = Buffer.concat([this.k[l], data.subarray(i * per, (i + 1) * per)]);
      this.v[l] = Buffer.concat([this.v[l], data.subarray(half + i * per, half + (i + 1) * per)]);
    }
  }
}

// ---------------------------------------------------------------------------
// The checks

// Bytes no protobuf parser may accept (field 0 and stray end-group tags are
// left out: some parsers take them as the end of the message).
const GARBAGE = [
  Buffer.from([0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]), // long varint
  Buffer.concat([Buffer.from([0x0a, 0x7f]), Buffer.from('short')]), // length past the end
  Buffer.from([0x0f, 0x01]),                                        // wire type 7
  Buffer.from([0x0a]),                                              // tag without a value
  Buffer.concat([Buffer.from([0x08, 0x96, 0x01, 0x12, 0xff, 0xff, 0xff, 0xff, 0x0f]),
                 Buffer.from('junk')]),                             // 4 GiB length field
  Buffer.from('GET / HTTP/1.1\r\n\r\n'),                          // text: 'G' is wire type 7
];

class Suite {
  constructor(args) {
    this.args = args;
    this.passed = 0;
    this.failed = 0;
    this.workdir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvd-interop-node-'));
    this.server = new Server(args.kvdepotd, this.workdir);
    this.api = null;
    this.refs = new Map(); // sequence id (string) -> Reference
    this.B = null;
    this.largeDigest = null;
    this.prefixChain = null;
  }

  async connect() {
    await this.server.start();
    this.api = new Api(this.server.addr, this.args.protoDir, this.args.healthProtoDir);
    await new Promise((resolve, reject) => {
      this.api.client.waitForReady(new Date(Date.now() + 30000),
                                   (err) => (err ? reject(err) : resolve()));
    });
  }

  async run(name, fn) {
    const t0 = Date.now();
    try {
      await fn.call(this);
      this.passed++;
      console.log(`ok   ${name.padEnd(28)} (${((Date.now() - t0) / 1000).toFixed(2)} s)`);
    } catch (e) {
      this.failed++;
      let why;
      if (e instanceof CheckFailed) why = e.message;
      else if (typeof e.code === 'number') why = `unexpected status ${statusName(e.code)}: ${e.details}`;
      else why = e.stack || String(e);
      console.log(`FAIL ${name.padEnd(28)} ${why}`);
      if (this.server.proc !== null && !this.server.alive()) {
        console.log(`     kvdepotd died (${this.server.exitCode}); log tail:\n${this.server.logTail()}`);
      }
    }
  }

  // -- helpers --------------------------------------------------------------

  model(name, layers, kvHeads, headDim, o = {}) {
    return {
      name, revision: 'interop', num_layers: layers, num_kv_heads: kvHeads,
      num_q_heads: o.qHeads || 0, head_dim: headDim,
      dtype: o.dtype === undefined ? this.api.enums.F16 : o.dtype,
    };
  }

  putModel(m) {
    return this.api.unary('PutModel', { model: m });
  }

  async create(seqId, model, extra = {}) {
    const r = await this.api.unary('CreateSequence',
                                   { sequence_id: idBuf(seqId), model, ...extra });
    return r.sequence;
  }

  async stat(seqId) {
    return (await this.api.unary('StatSequence', { sequence_id: idBuf(seqId) })).sequence;
  }

  async appendRef(seqId, ref, layerStart, numLayers, numTokens, o = {}) {
    const tokenStart = ref.tokens(layerStart);
    const data = ref.makeAppend(numLayers, numTokens);
    const r = await this.api.append(seqId, data, tokenStart, numTokens,
                                    { ...o, layerStart, numLayers });
    ref.commit(layerStart, numLayers, numTokens, data);
    eq(r.bytes_received, String(data.length), 'AppendResponse.bytes_received');
    const want = [];
    for (let l = layerStart; l < layerStart + numLayers; l++) want.push(String(ref.tokens(l)));
    eq(r.sequence.layer_tokens.slice(layerStart, layerStart + numLayers), want,
       'layer_tokens after Append');
    return r;
  }

  // The stored sequence equals its reference: stat and a full read.
  async verify(seqId, what = 'sequence') {
    const ref = this.refs.get(seqId);
    const n = ref.minTokens();
    const info = await this.stat(seqId);
    eq(info.num_tokens, String(n), `${what} num_tokens`);
    eq(info.layer_tokens, ref.k.map((_, l) => String(ref.tokens(l))), `${what} layer_tokens`);
    if (n === 0) return;
    const { header, data } = await this.api.read(seqId);
    eq([header.layer_start, header.num_layers, header.token_start, header.num_tokens],
       [0, ref.numLayers, '0', String(n)], `${what} read header range`);
    check(data.equals(ref.wire(0, ref.numLayers, 0, n)),
          `${what}: bytes read back differ from what was appended`);
  }

  async expectUnchanged(code, seqId, p) {
    await expectCode(code, p);
    check(this.server.alive(), 'kvdepotd died');
    await this.verify(seqId, 'after the failed call, sequence');
  }

  async lookup(model, hashes) {
    const r = await this.api.unary('Lookup', { model, block_hashes: hashes });
    return [Number(r.matched_blocks), Number(r.matched_tokens)];
  }

  // -- checks ---------------------------------------------------------------

  async tHealth() {
    const r = await this.api.healthCheck('');
    eq(r.status, 1, 'Health/Check status (1 = SERVING)');
    await expectCode(S.NOT_FOUND, this.api.healthCheck('no.such.Service'));
  }

  async tModels() {
    const m = this.model('js-f16', 3, 2, 64, { qHeads: 4 });
    const r = await this.putModel(m);
    check(r.created, 'first PutModel reports created=false');
    eq([r.model.name, r.model.num_layers, r.model.num_kv_heads, r.model.head_dim, r.model.dtype],
       ['js-f16', 3, 2, 64, 1], 'PutModel echo');
    const r2 = await this.putModel(m);
    check(!r2.created, 'identical PutModel again reports created=true');
    const g = (await this.api.unary('GetModel', { name: 'js-f16' })).model;
    eq([g.num_layers, g.num_kv_heads, g.num_q_heads, g.head_dim, g.dtype], [3, 2, 4, 64, 1],
       'GetModel shape');
    check(BigInt(g.created_unix_ms) > 0n, 'GetModel created_unix_ms not set');
    const names = (await this.api.unary('ListModels', {})).models.map((x) => x.name);
    check(names.includes('js-f16'), `ListModels lacks js-f16: ${names}`);
  }

  async tModelErrors() {
    const E = this.api.enums;
    await expectCode(S.ALREADY_EXISTS, this.putModel(this.model('js-f16', 4, 2, 64, { qHeads: 4 })));
    await expectCode(S.NOT_FOUND, this.api.unary('GetModel', { name: 'js-nope' }));
    const bad = [
      [this.model('js-bad', 0, 2, 64), 'num_layers 0'],
      [this.model('js-bad', 2, 0, 64), 'num_kv_heads 0'],
      [this.model('js-bad', 2, 2, 0), 'head_dim 0'],
      [this.model('js-bad', 2, 2, 64, { dtype: E.UNSPECIFIED }), 'dtype unspecified'],
      [this.model('js-bad', 2, 2, 64, { qHeads: 3 }), 'q_heads not multiple'],
      [this.model('bad name!', 2, 2, 64), 'bad name'],
      [this.model('', 2, 2, 64), 'empty name'],
      [this.model('x'.repeat(129), 2, 2, 64), '129-byte name'],
      [this.model('js-bad', 1025, 2, 64), 'num_layers 1025'],
      [this.model('js-bad', 2, 1025, 64), 'num_kv_heads 1025'],
      [this.model('js-bad', 2, 2, 1025), 'head_dim 1025'],
      [{ ...this.model('js-bad', 2, 2, 64), revision: 'r'.repeat(129) }, '129-byte revision'],
    ];
    for (const [m, why] of bad) {
      try {
        await expectCode(S.INVALID_ARGUMENT, this.putModel(m));
      } catch (e) {
        throw new CheckFailed(`${why}: ${e.message}`);
      }
    }
    await expectCode(S.NOT_FOUND, this.api.unary('DeleteModel', { name: 'js-nope' }));
    // The longest valid name is fine.
    await this.putModel(this.model('n'.repeat(128), 1, 1, 4));
    await this.api.unary('DeleteModel', { name: 'n'.repeat(128) });
    const g = (await this.api.unary('GetModel', { name: 'js-f16' })).model;
    eq([g.num_layers, g.num_kv_heads, g.head_dim], [3, 2, 64], 'js-f16 shape after failed PutModels');
    const names = (await this.api.unary('ListModels', {})).models.map((x) => x.name);
    check(!names.includes('js-bad'), 'a rejected model was stored');
  }

  // Attention computed here (GQA), over rows[t][h][i]; tokens per kv head or all.
  static attention(q, k, v, hq, hkv, d, scale, tokens = null) {
    const g = hq / hkv;
    const out = [];
    const lse = [];
    for (let h = 0; h < hq; h++) {
      const kh = Math.floor(h / g);
      const ts = tokens ? tokens[kh] : k.map((_, t) => t);
      const s = ts.map((t) => { let x = 0; for (let i = 0; i < d; i++) x += q[h * d + i] * k[t][kh][i]; return scale * x; });
      const mx = Math.max(...s);
      const w = s.map((x) => Math.exp(x - mx));
      const z = w.reduce((a, b) => a + b, 0);
      lse.push(mx + Math.log(z));
      for (let i = 0; i < d; i++) {
        let o = 0;
        ts.forEach((t, j) => { o += w[j] * v[t][kh][i]; });
        out.push(o / z);
      }
    }
    return { out, lse };
  }

  // Attend (raw and INT4), Search, SparseAttend, PlanFetch and their errors
  // from this client.
  // Calibrate, UploadArtifacts and GetArtifacts from grpc-js: smoothing
  // factors against their definition computed here, rotations orthonormal,
  // codebook shapes, a bit-exact upload round trip, and errors that change
  // nothing.
  async tCalibrate() {
    const api = this.api;
    const L = 1, HKV = 2, HQ = 4, D = 16, n = 200;
    await this.putModel(this.model('js-cal', L, HKV, D, { qHeads: HQ, dtype: api.enums.F32 }));
    let seed = 777;
    const rnd = (a) => { seed = (seed * 1103515245 + 12345) % 2147483648; return (seed / 1073741824 - 1) * a; };
    const floats = (xs) => { const b = Buffer.alloc(4 * xs.length); xs.forEach((x, i) => b.writeFloatLE(x, 4 * i)); return b; };
    const k = Array.from({ length: n * HKV * D }, () => rnd(2));
    const v = Array.from({ length: n * HKV * D }, () => rnd(1));
    const q = Array.from({ length: n * HQ * D }, () => rnd(1));
    const kb = floats(k);
    const calibrate = (o = {}) => new Promise((resolve, reject) => {
      const call = api.client.Calibrate(Api.deadline(), (err, r) => (err ? reject(err) : resolve(r)));
      const header = { model: o.model || 'js-cal', svd: true, seed: '4', vq: { sub_dim: 4, bits: 5 } };
      const sample = { layer: o.layer || 0, num_tokens: String(n), k: o.k || kb, v: floats(v), q: floats(q) };
      Api.pump(call, [{ header }, { sample }]).catch(reject);
    });
    const artifacts = () => new Promise((resolve, reject) => {
      const out = [];
      const call = api.client.GetArtifacts({ model: 'js-cal', kinds: [] }, Api.deadline());
      call.on('data', (r) => out.push(r.artifact));
      call.on('error', reject);
      call.on('end', () => resolve(out));
    });
    const upload = (arts) => new Promise((resolve, reject) => {
      const call = api.client.UploadArtifacts(Api.deadline(), (err, r) => (err ? reject(err) : resolve(r)));
      Api.pump(call, [{ model: 'js-cal', artifacts: arts }]).catch(reject);
    });

    const r = await calibrate();
    eq(r.samples, String(n), 'Calibrate samples');
    eq(r.artifacts, HKV * 7, 'artifacts written');
    eq(r.errors.length, HKV, 'error rows');
    for (const e of r.errors) {
      check(e.vq_k > 0 && e.vq_k < 1 && e.vq_v > 0 && e.vq_v < 1, `VQ errors ${e.vq_k} ${e.vq_v}`);
      check(e.svd_width_k >= 1 && e.svd_width_k <= D && e.svd_k >= 0 && e.svd_k <= 0.1, 'SVD width/error of K');
    }
    const arts = await artifacts();
    eq(arts.length, HKV * 7, 'artifacts stored');
    for (const a of arts) {
      const vals = Array.from({ length: a.data.length / 4 }, (_, i) => a.data.readFloatLE(4 * i));
      if (a.kind === 1) { // KEY_SMOOTHING: lambda_i = sqrt(max_t |k_ti|)
        for (let i = 0; i < D; i++) {
          let mx = 0;
          for (let t = 0; t < n; t++) mx = Math.max(mx, Math.abs(Math.fround(k[(t * HKV + a.kv_head) * D + i])));
          check(Math.abs(vals[i] - Math.sqrt(mx)) <= 1e-6 * Math.sqrt(mx), `lambda[${i}] of head ${a.kv_head}`);
        }
      } else if (a.kind === 4 || a.kind === 5) { // SVD rotations
        eq(a.shape.map(Number), [D, D], 'rotation shape');
        for (let i = 0; i < D; i++) {
          for (let j = 0; j < D; j++) {
            let dot = 0;
            for (let row = 0; row < D; row++) dot += vals[row * D + i] * vals[row * D + j];
            check(Math.abs(dot - (i === j ? 1 : 0)) < 1e-4, 'rotation not orthonormal');
          }
        }
      } else if (a.kind === 2 || a.kind === 3) {
        eq(a.shape.map(Number), [32, 4], 'codebook shape');
      }
    }
    // A replacement uploaded and read back bit-exact (odd bit patterns too).
    const lam = floats([...Array.from({ length: D - 1 }, (_, i) => i + 0.1), 1e-30]);
    eq((await upload([{ kind: 1, layer: 0, kv_head: 1, shape: [D], data: lam }])).artifacts, 1, 'uploaded');
    const got = (await artifacts()).filter((a) => a.kind === 1 && a.kv_head === 1);
    eq(got.length, 1, 'one smoothing artifact for head 1');
    check(got[0].data.equals(lam), 'uploaded artifact bytes differ');
    // Errors: nothing changes.
    const before = (await artifacts()).map((a) => a.data.toString('hex'));
    await expectCode(S.INVALID_ARGUMENT, calibrate({ k: kb.subarray(0, kb.length - 4) }));
    await expectCode(S.INVALID_ARGUMENT, calibrate({ layer: L }));
    await expectCode(S.NOT_FOUND, calibrate({ model: 'js-nosuch' }));
    await expectCode(S.INVALID_ARGUMENT,
                     upload([{ kind: 4, layer: 0, kv_head: 0, shape: [D, 8], data: floats(new Array(D * 8).fill(0)) }]));
    await expectCode(S.INVALID_ARGUMENT,
                     upload([{ kind: 1, layer: 0, kv_head: 0, shape: [D], data: lam.subarray(0, lam.length - 4) }]));
    eq((await artifacts()).map((a) => a.data.toString('hex')), before, 'artifacts after errors');
  }

  // KVPR from grpc-js: Append with_activations stores X; a Read with
  // activation_tokens l (l from PlanFetch) streams X of [t0, t0 + l) then K/V
  // of the rest, equal to what was appended; errors change nothing.
  async tActivations() {
    const api = this.api;
    const L = 2, HKV = 2, D = 8, HID = 16, n = 300;
    const m = this.model('js-act', L, HKV, D);
    m.hidden_size = HID;
    await this.putModel(m);
    await this.create('js-act', 'js-act', { codecs: { store_activations: true } });
    await this.create('js-act-plain', 'js-act');
    const kvTok = HKV * D * 2, xTok = HID * 2;
    const rand = (len, seed) => {
      const b = Buffer.alloc(len);
      let x = seed;
      for (let i = 0; i < len; i++) { x = (x * 1103515245 + 12345) % 2147483648; b[i] = x >> 16; }
      return b;
    };
    const k = [0, 1].map((l) => rand(n * kvTok, 10 + l));
    const v = [0, 1].map((l) => rand(n * kvTok, 20 + l));
    const x = [0, 1].map((l) => rand(n * xTok, 30 + l));
    const sl = (parts, tb, t0, t1) => Buffer.concat(parts.map((p) => p.subarray(t0 * tb, t1 * tb)));
    const append = (id, t0, nt, withX = true) => {
      let data = Buffer.concat([sl(k, kvTok, t0, t0 + nt), sl(v, kvTok, t0, t0 + nt)]);
      if (withX) data = Buffer.concat([data, sl(x, xTok, t0, t0 + nt)]);
      const msgs = api.appendMsgs(id, data, t0, nt, { chunks: 7000 });
      msgs[0].header.with_activations = withX;
      return api.appendStream(msgs);
    };
    const readX = (req) => new Promise((resolve, reject) => {
      const call = api.client.Read({ sequence_id: idBuf('js-act'), max_chunk_bytes: 4096, ...req },
                                   Api.deadline());
      let header = null;
      const parts = [];
      call.on('data', (r) => { if (!header) header = r.header; parts.push(r.data); });
      call.on('error', reject);
      call.on('end', () => resolve({ header, data: Buffer.concat(parts) }));
    });

    await append('js-act', 0, 256);
    await append('js-act', 256, 44);
    eq((await this.stat('js-act')).activation_tokens, String(n), 'activation_tokens');
    const p = await api.unary('PlanFetch', { sequence_id: idBuf('js-act'),
                                             bandwidth_bytes_per_s: 1e9, compute_flops_per_s: 1e11 });
    const l0 = Number(p.split_tokens);
    check(l0 > 0 && l0 <= n, `PlanFetch split ${l0} with ${n} stored activations`);
    for (const [t0, nt, l] of [[0, n, l0], [0, n, n], [5, 290, 251], [299, 1, 1]]) {
      const { header, data } = await readX({ token_start: String(t0), num_tokens: String(nt),
                                              activation_tokens: String(l) });
      eq([header.activation_tokens, header.hidden_size, header.activation_bytes],
         [String(l), HID, String(L * l * xTok)], 'activation-first Read header');
      eq(String(data.length), String(Number(header.activation_bytes) + Number(header.total_bytes)),
         'activation-first Read bytes');
      const want = Buffer.concat([sl(x, xTok, t0, t0 + l), sl(k, kvTok, t0 + l, t0 + nt),
                                  sl(v, kvTok, t0 + l, t0 + nt)]);
      check(data.equals(want), `activation-first Read t0=${t0} n=${nt} l=${l} differs`);
      if (l < nt) {
        const plain = await api.read('js-act', { tokenStart: t0 + l, numTokens: nt - l });
        check(data.subarray(L * l * xTok).equals(plain.data),
              'K/V part differs from a plain Read of the remaining tokens');
      }
    }
    // Errors: clear status, nothing stored.
    await expectCode(S.FAILED_PRECONDITION, append('js-act-plain', 0, 10));
    eq((await this.stat('js-act-plain')).num_tokens, '0', 'plain sequence after refused X');
    await expectCode(S.INVALID_ARGUMENT, readX({ activation_tokens: String(n + 1) }));
    await expectCode(S.INVALID_ARGUMENT, readX({ activation_tokens: '1', format: 1 }));
    // A gap: 10 tokens with X, 5 without; X can no longer follow, and a Read
    // cannot ask for X past the 10.
    await this.create('js-act2', 'js-act', { codecs: { store_activations: true } });
    await append('js-act2', 0, 10);
    await append('js-act2', 10, 5, false);
    await expectCode(S.FAILED_PRECONDITION, append('js-act2', 15, 5));
    const s2 = await this.stat('js-act2');
    eq([s2.num_tokens, s2.activation_tokens], ['15', '10'], 'tokens, activation_tokens after a gap');
    await expectCode(S.OUT_OF_RANGE, readX({ sequence_id: idBuf('js-act2'), activation_tokens: '11' }));
    // Deleting the sequence takes its activations along.
    await api.unary('DeleteSequence', { sequence_id: idBuf('js-act') });
    await this.create('js-act', 'js-act', { codecs: { store_activations: true } });
    eq((await this.stat('js-act')).activation_tokens, '0', 'activation_tokens after re-create');
  }

  // VQ and SVD-reduced sequences from grpc-js: FAILED_PRECONDITION before
  // the model is calibrated (nothing created), then pages seal coded (page
  // codec 3 VQ, 4 SVD) and Attend equals attention computed here on the
  // tensors read back; a VQ shape that was not calibrated is refused.
  async tCodecsVqSvd() {
    const api = this.api;
    const HKV = 2, HQ = 4, D = 16, n = 300;
    await this.putModel(this.model('js-vq', 1, HKV, D, { qHeads: HQ, dtype: api.enums.F32 }));
    let seed = 4242;
    const rnd = () => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed / 1073741824 - 1; };
    const floats = (cnt) => { const b = Buffer.alloc(4 * cnt); for (let i = 0; i < cnt; i++) b.writeFloatLE(rnd(), 4 * i); return b; };
    const vq = { codec: 3, vq: { sub_dim: 4, bits: 5 } };
    const svd = { codec: 0, svd: { removal_rate: 0.2 } };
    await expectCode(S.FAILED_PRECONDITION, this.create('js-vq', 'js-vq', { codecs: { k: vq, v: vq } }));
    await expectCode(S.FAILED_PRECONDITION, this.create('js-svd', 'js-vq', { codecs: { k: svd, v: svd } }));
    await expectCode(S.NOT_FOUND, this.stat('js-vq'));
    await new Promise((resolve, reject) => {
      const call = api.client.Calibrate(Api.deadline(), (err, r) => (err ? reject(err) : resolve(r)));
      Api.pump(call, [{ header: { model: 'js-vq', svd: true, seed: '3', vq: { sub_dim: 4, bits: 5 } } },
                      { sample: { layer: 0, num_tokens: String(n), k: floats(n * HKV * D), v: floats(n * HKV * D), q: floats(n * HQ * D) } }])
        .catch(reject);
    });
    await expectCode(S.INVALID_ARGUMENT, this.create('js-vq', 'js-vq', { codecs: { k: { codec: 3, vq: { sub_dim: 3, bits: 5 } } } }));
    await expectCode(S.FAILED_PRECONDITION, this.create('js-vq', 'js-vq', { codecs: { k: { codec: 3, vq: { sub_dim: 4, bits: 8 } } } }));
    await expectCode(S.NOT_FOUND, this.stat('js-vq'));
    const data = floats(2 * n * HKV * D);
    const q = Array.from({ length: HQ * D }, rnd);
    for (const [sid, codecs, want] of [['js-vq', { k: vq, v: vq }, 3], ['js-svd', { k: svd, v: svd }, 4]]) {
      await this.create(sid, 'js-vq', { codecs });
      await api.append(sid, data, 0, n, { dtype: api.enums.F32 });
      const back = (await api.read(sid)).data;
      const row = (off) => Array.from({ length: D }, (_, i) => back.readFloatLE(off + 4 * i));
      const kb = [], vb = [];
      for (let t = 0; t < n; t++) {
        kb.push([]); vb.push([]);
        for (let h = 0; h < HKV; h++) {
          kb[t].push(row(((t * HKV + h) * D) * 4));
          vb[t].push(row((n * HKV * D + (t * HKV + h) * D) * 4));
        }
      }
      const r = (await api.unary('Attend', { layer: 0, queries: [{ sequence_id: idBuf(sid), q }] })).results[0];
      const w = Suite.attention(q, kb, vb, HQ, HKV, D, 1 / Math.sqrt(D));
      for (let i = 0; i < HQ * D; i++) {
        check(Math.abs(r.output[i] - w.out[i]) <= 1e-4, `${sid} Attend output[${i}] ${r.output[i]} vs ${w.out[i]}`);
      }
      for (let h = 0; h < HQ; h++) check(Math.abs(r.lse[h] - w.lse[h]) <= 1e-4, `${sid} Attend lse[${h}]`);
      const pages = await new Promise((resolve, reject) => {
        const msgs = [];
        const call = api.client.Read({ sequence_id: idBuf(sid), format: 1 }, Api.deadline());
        call.on('data', (m) => msgs.push(m));
        call.on('error', reject);
        call.on('end', () => resolve(msgs.slice(1).map((m) => m.data)));
      });
      eq([pages[0][8], pages[0][9], pages[pages.length - 1][8]], [want, want, 0],
         `${sid} stored page codecs (sealed, tail)`);
    }
  }

  async tCompute() {
    const api = this.api;
    const L = 1, HKV = 2, HQ = 4, D = 32, n = 200;
    const m = this.model('js-compute', L, HKV, D, { qHeads: HQ, dtype: api.enums.F32 });
    m.hidden_size = 32;
    await this.putModel(m);
    let seed = 12345;
    const rnd = () => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed / 1073741824 - 1; };
    const mk = () => Array.from({ length: n }, () => Array.from({ length: HKV }, () => Array.from({ length: D }, rnd)));
    const rows = mk();
    const vrows = mk();
    const buf = Buffer.alloc(2 * n * HKV * D * 4);
    let off = 0;
    for (const r of [rows, vrows]) for (const t of r) for (const h of t) for (const x of h) { buf.writeFloatLE(x, off); off += 4; }
    const q = Array.from({ length: HQ * D }, rnd);
    const scale = 1 / Math.sqrt(D);
    const int4 = { codec: 2, quant: { group_size: 32 } };
    for (const [sid, codecs] of [['js-raw', null], ['js-int4', { k: int4, v: int4 }]]) {
      await this.create(sid, 'js-compute', codecs ? { codecs } : {});
      await api.append(sid, buf, 0, n, { dtype: api.enums.F32 });
      const { data } = await api.read(sid);
      const vals = [];
      for (let i = 0; i < data.length; i += 4) vals.push(data.readFloatLE(i));
      const kb = [], vb = [];
      for (let t = 0; t < n; t++) {
        kb.push([]); vb.push([]);
        for (let h = 0; h < HKV; h++) {
          kb[t].push(vals.slice((t * HKV + h) * D, (t * HKV + h + 1) * D));
          vb[t].push(vals.slice(n * HKV * D + (t * HKV + h) * D, n * HKV * D + (t * HKV + h + 1) * D));
        }
      }
      if (!codecs) check(data.equals(buf), 'raw read-back differs');
      for (const [t0, cnt] of [[0, 0], [7, 150]]) {
        const r = (await api.unary('Attend', { layer: 0, queries: [{ sequence_id: idBuf(sid), q, token_start: String(t0), num_tokens: String(cnt) }] })).results[0];
        const c = cnt || n - t0;
        eq(r.num_tokens, String(c), 'Attend num_tokens');
        const want = Suite.attention(q, kb.slice(t0, t0 + c), vb.slice(t0, t0 + c), HQ, HKV, D, scale);
        const tol = codecs ? 3e-2 : 1e-4;
        for (let i = 0; i < HQ * D; i++) {
          check(Math.abs(r.output[i] - want.out[i]) <= tol, `${sid} Attend output[${i}] ${r.output[i]} vs ${want.out[i]}`);
        }
        for (let h = 0; h < HQ; h++) check(Math.abs(r.lse[h] - want.lse[h]) <= 1e-3, `${sid} lse[${h}]`);
      }
    }
    // Search + SparseAttend on a PQ-indexed (raw K/V) sequence: SparseAttend
    // attends over exactly the tokens Search picks, and equals attention over
    // them computed here.
    await this.create('js-pq', 'js-compute', { codecs: { pq: { m: 4, bits: 4 } } });
    await api.append('js-pq', buf, 0, n, { dtype: api.enums.F32 });
    const sreq = { sequence_id: idBuf('js-pq'), layer: 0, q, k: 20, initial_tokens: 2, recent_tokens: 5 };
    const sr = await api.unary('Search', sreq);
    eq(sr.heads.length, HKV, 'Search heads');
    for (const hd of sr.heads) {
      eq(hd.tokens.length, 27, 'Search tokens per head (k + initial + recent)');
      const got = new Set(hd.tokens.map(Number));
      for (const t of [0, 1, n - 5, n - 1]) check(got.has(t), `Search: forced token ${t} missing`);
      eq(got.size, 27, 'Search tokens distinct');
      for (let i = 1; i < hd.scores.length; i++) check(hd.scores[i - 1] >= hd.scores[i], 'Search scores not ordered');
    }
    const sa = await api.unary('SparseAttend', { search: sreq });
    const toks = sa.heads.map((hd) => hd.tokens.map(Number));
    eq(JSON.stringify(toks), JSON.stringify(sr.heads.map((hd) => hd.tokens.map(Number))), 'SparseAttend tokens vs Search');
    const sw = Suite.attention(q, rows, vrows, HQ, HKV, D, scale, toks);
    for (let i = 0; i < HQ * D; i++) {
      check(Math.abs(sa.result.output[i] - sw.out[i]) <= 1e-4, `SparseAttend output[${i}] ${sa.result.output[i]} vs ${sw.out[i]}`);
    }
    for (let h = 0; h < HQ; h++) check(Math.abs(sa.result.lse[h] - sw.lse[h]) <= 1e-3, `SparseAttend lse[${h}]`);
    await expectCode(S.INVALID_ARGUMENT, api.unary('Search', { ...sreq, k: n + 1 }));
    await expectCode(S.INVALID_ARGUMENT, api.unary('SparseAttend', { search: { ...sreq, q: q.slice(0, D) } }));
    await expectCode(S.FAILED_PRECONDITION, api.unary('Search', { ...sreq, sequence_id: idBuf('js-raw') }));
    await expectCode(S.NOT_FOUND, api.unary('SparseAttend', { search: { ...sreq, sequence_id: idBuf('js-none') } }));
    eq((await this.stat('js-pq')).num_tokens, String(n), 'js-pq after errors');
    // Read in page format: one stored page per message, every page holding a
    // token of the range; sealed pages INT2, the tail raw and equal to what
    // was appended (its K section is head-major).
    const info = await this.create('js-pages', 'js-compute', { codecs: { k: { codec: 1, quant: { group_size: 32 } } } });
    const B = Number(info.page_tokens);
    const n2 = B + 40;
    const pbuf = Buffer.alloc(2 * n2 * HKV * D * 4);
    for (let i = 0; i < pbuf.length; i += 4) pbuf.writeFloatLE(rnd(), i);
    await api.append('js-pages', pbuf, 0, n2, { dtype: api.enums.F32 });
    const readPages = (req) => new Promise((resolve, reject) => {
      const msgs = [];
      const call = api.client.Read({ sequence_id: idBuf('js-pages'), format: 1, ...req }, Api.deadline(CALL_TIMEOUT_MS));
      call.on('data', (r) => msgs.push(r));
      call.on('error', reject);
      call.on('end', () => resolve(msgs));
    });
    const msgs = await readPages({ token_start: '3', num_tokens: String(B + 1) });
    eq(msgs[0].header.format, 1, 'Read pages: header format');
    const pages = msgs.slice(1).map((r) => r.data);
    eq(pages.length, 2, 'Read pages: page count');
    pages.forEach((pg, b) => {
      eq(pg.subarray(0, 4).toString('latin1'), 'KVDP', `Read pages: page ${b} magic`);
      eq([pg.readUInt32LE(12), Number(pg.readBigUInt64LE(16)), pg.readUInt32LE(24), pg.readUInt32LE(28)],
         [0, b * B, b ? n2 - B : B, B], `Read pages: page ${b} header`);
      eq(pg[8], b ? 0 : 1, `Read pages: page ${b} K codec`);
    });
    const tail = pages[1];
    const koff = Number(tail.readBigUInt64LE(64 + 8));
    for (let h = 0; h < HKV; h++) {
      for (let t = 0; t < n2 - B; t++) {
        const got = tail.subarray(koff + ((h * (n2 - B) + t) * D) * 4, koff + ((h * (n2 - B) + t + 1) * D) * 4);
        const want = pbuf.subarray(((B + t) * HKV + h) * D * 4, ((B + t) * HKV + h + 1) * D * 4);
        check(got.equals(want), `Read pages: tail K of token ${B + t} head ${h}`);
      }
    }
    await expectCode(S.INVALID_ARGUMENT, readPages({ activation_tokens: '1' }));
    await expectCode(S.OUT_OF_RANGE, readPages({ token_start: String(n2), num_tokens: '1' }));
    for (const [bw, fl] of [[1e6, 1e12], [1e9, 1e9]]) {
      const p = await api.unary('PlanFetch', { sequence_id: idBuf('js-raw'), bandwidth_bytes_per_s: bw, compute_flops_per_s: fl, assume_activations: true });
      const t = (l) => l * p.activation_bytes_per_token / bw + Math.max(l * p.flops_per_token / fl, (n - l) * p.kv_bytes_per_token / bw);
      let best = Infinity;
      for (let l = 0; l <= n; l++) best = Math.min(best, t(l));
      check(t(Number(p.split_tokens)) <= best * (1 + 1e-9), `PlanFetch split ${p.split_tokens} not minimal`);
    }
    await expectCode(S.INVALID_ARGUMENT, this.create('js-bad', 'js-compute', { codecs: { k: { codec: 1, quant: { group_size: 48 } } } }));
    await expectCode(S.NOT_FOUND, this.stat('js-bad'));
    await expectCode(S.NOT_FOUND, api.unary('Attend', { layer: 0, queries: [{ sequence_id: idBuf('js-none'), q }] }));
    await expectCode(S.INVALID_ARGUMENT, api.unary('Attend', { layer: 0, queries: [{ sequence_id: idBuf('js-raw'), q: q.slice(0, D) }] }));
  }

  async tRoundtrip() {
    const info = await this.create('js-seq', 'js-f16');
    eq(info.num_tokens, '0', 'new sequence num_tokens');
    check(info.page_tokens > 0, 'page_tokens not reported');
    const B = this.B = info.page_tokens;
    const ref = new Reference(3, 2, 64, 2);
    this.refs.set('js-seq', ref);
    await this.appendRef('js-seq', ref, 0, 3, B + 37, { chunks: [1, 4093, 65536, 3] });
    await this.appendRef('js-seq', ref, 0, 3, B + 63,
                         { chunks: 100000, dataWithHeader: true, emptyBetween: true });
    const n = 2 * B + 100;
    await this.verify('js-seq');
    const st = await this.stat('js-seq');
    eq(st.num_tokens, String(n), 'num_tokens');
    eq(st.sealed_pages, String(3 * Math.floor(n / B)), 'sealed_pages (full pages over all layers)');
    const raw = ref.wire(0, 3, 0, n).length;
    check(Number(st.stored_bytes) >= raw, `stored_bytes ${st.stored_bytes} below the ${raw} bytes appended`);
    let r = await this.api.read('js-seq', { layerStart: 1, numLayers: 1, tokenStart: B - 5,
                                            numTokens: 65, maxChunk: 777 });
    eq([r.header.num_kv_heads, r.header.head_dim, r.header.dtype], [2, 64, 1], 'read header shape');
    check(r.data.equals(ref.wire(1, 1, B - 5, 65)), 'layer 1 tokens [B-5, B+60) differ');
    r = await this.api.read('js-seq', { layerStart: 1, tokenStart: 10, maxChunk: 4 * MiB });
    eq([r.header.num_layers, r.header.num_tokens], [2, String(n - 10)], 'open-ended read range');
    check(r.data.equals(ref.wire(1, 2, 10, n - 10)), 'layers 1.. tokens 10.. differ');
  }

  async tLayerwise() {
    const ref = new Reference(3, 2, 64, 2);
    this.refs.set('js-layers', ref);
    await this.create('js-layers', 'js-f16');
    await this.appendRef('js-layers', ref, 0, 1, 50);
    const info = await this.stat('js-layers');
    eq(info.layer_tokens, ['50', '0', '0'], 'layer_tokens after layer 0');
    eq(info.num_tokens, '0', 'num_tokens with layers 1,2 empty');
    await this.appendRef('js-layers', ref, 1, 2, 50, { chunks: 999 });
    await this.verify('js-layers');
  }

  // f32 and bf16 models round-trip too; sequence ids are bytes, not text.
  async tDtypes() {
    const E = this.api.enums;
    for (const [name, dtype, esize] of [['js-f32', E.F32, 4], ['js-bf16', E.BF16, 2]]) {
      await this.putModel(this.model(name, 2, 1, 16, { dtype }));
      const id = Buffer.concat([Buffer.from([0, 0xff]), Buffer.from(name), Buffer.from([0, 10])]);
      const key = id.toString('latin1');
      const ref = new Reference(2, 1, 16, esize);
      this.refs.set(key, ref);
      await this.create(id, name);
      await this.appendRef(id, ref, 0, 2, this.B + 3, { dtype, chunks: 1000 });
      await this.appendRef(id, ref, 0, 2, 7, { dtype });
      await this.verify(key, name);
      const r = await this.api.read(id, { numTokens: 1 });
      eq(r.header.dtype, dtype, `${name} read header dtype`);
      await this.expectUnchanged(S.INVALID_ARGUMENT, key,
                                 this.api.append(id, Buffer.alloc(2 * 2 * 16 * 2), ref.tokens(0), 1,
                                                 { dtype: E.F16 }));
      const listed = (await this.api.unary('ListSequences', { model: name })).sequences;
      check(listed.length === 1 && listed[0].sequence_id.equals(id),
            `ListSequences(${name}) ids, byte for byte: ${listed.map((x) => x.sequence_id.toString('hex'))}`);
    }
  }

  async tErrorsUnknown() {
    const api = this.api;
    const X = 'js-seq';
    const none = Buffer.from('js-none');
    await this.expectUnchanged(S.NOT_FOUND, X, api.unary('StatSequence', { sequence_id: none }));
    await this.expectUnchanged(S.NOT_FOUND, X, api.read('js-none'));
    await this.expectUnchanged(S.NOT_FOUND, X, api.append('js-none', Buffer.alloc(2 * 3 * 256), 0, 1));
    await this.expectUnchanged(S.NOT_FOUND, X, api.unary('DeleteSequence', { sequence_id: none }));
    await this.expectUnchanged(S.NOT_FOUND, X, this.create('js-new', 'js-no-model'));
    await expectCode(S.NOT_FOUND, api.unary('StatSequence', { sequence_id: Buffer.from('js-new') }));
  }

  async tErrorsCreate() {
    const X = 'js-seq';
    await this.expectUnchanged(S.ALREADY_EXISTS, X, this.create(X, 'js-f16'));
    await this.expectUnchanged(S.INVALID_ARGUMENT, X, this.create('', 'js-f16'));
    await this.expectUnchanged(S.INVALID_ARGUMENT, X, this.create('x'.repeat(257), 'js-f16'));
    // The longest valid id is fine.
    const longest = Buffer.from(Array.from({ length: 256 }, (_, i) => i));
    check((await this.create(longest, 'js-f16')).sequence_id.equals(longest), '256-byte id');
    await this.api.unary('DeleteSequence', { sequence_id: longest });
  }

  async tErrorsAppend() {
    const api = this.api;
    const E = api.enums;
    const X = 'js-seq';
    const ref = this.refs.get(X);
    const n = ref.tokens(0);
    const good = ref.makeAppend(3, 10);
    const third = good.length / 3;
    await this.expectUnchanged(S.INVALID_ARGUMENT, X,
                               api.append(X, good.subarray(0, good.length - 1), n, 10, { chunks: [7] }));
    await this.expectUnchanged(S.INVALID_ARGUMENT, X,
                               api.append(X, Buffer.concat([good, Buffer.alloc(1)]), n, 10));
    await this.expectUnchanged(S.INVALID_ARGUMENT, X, api.append(X, good, n, 11));
    await this.expectUnchanged(S.INVALID_ARGUMENT, X, api.append(X, good, n, 10, { dtype: E.BF16 }));
    await this.expectUnchanged(S.INVALID_ARGUMENT, X,
                               api.append(X, Buffer.concat([good, good]), n, 10, { dtype: E.F32 }));
    await this.expectUnchanged(S.FAILED_PRECONDITION, X, api.append(X, good, n + 1, 10));
    await this.expectUnchanged(S.FAILED_PRECONDITION, X, api.append(X, good, 0, 10));
    await this.expectUnchanged(S.INVALID_ARGUMENT, X,
                               api.append(X, good.subarray(0, third), n, 10,
                                          { layerStart: 3, numLayers: 1 }));
    await this.expectUnchanged(S.INVALID_ARGUMENT, X,
                               api.append(X, good.subarray(0, 2 * third), n, 10,
                                          { layerStart: 2, numLayers: 2 }));
    await this.expectUnchanged(S.INVALID_ARGUMENT, X,
                               api.append(X, good, n, 10, { tokenIds: [0, 1, 2, 3, 4, 5, 6, 7, 8] }));
    await this.expectUnchanged(S.INVALID_ARGUMENT, X, api.appendStream([{ data: good }]));
    await this.expectUnchanged(S.INVALID_ARGUMENT, X, api.appendStream([]));
    await this.appendRef(X, ref, 0, 3, 10);
    await this.verify(X);
  }

  async tErrorsRead() {
    const api = this.api;
    const X = 'js-seq';
    const n = this.refs.get(X).tokens(0);
    await this.expectUnchanged(S.OUT_OF_RANGE, X, api.read(X, { tokenStart: n, numTokens: 1 }));
    await this.expectUnchanged(S.OUT_OF_RANGE, X, api.read(X, { tokenStart: 0, numTokens: n + 1 }));
    await this.expectUnchanged(S.OUT_OF_RANGE, X, api.read(X, { tokenStart: n + 5 }));
    // token_start + num_tokens wraps around 2^64: must not wrap into range.
    await this.expectUnchanged([S.OUT_OF_RANGE, S.INVALID_ARGUMENT], X,
                               api.read(X, { tokenStart: '9223372036854775808',
                                             numTokens: '9223372036854775808' }));
    await this.expectUnchanged([S.INVALID_ARGUMENT, S.OUT_OF_RANGE], X, api.read(X, { layerStart: 3 }));
    await this.expectUnchanged([S.INVALID_ARGUMENT, S.OUT_OF_RANGE], X,
                               api.read(X, { layerStart: 1, numLayers: 3 }));
  }

  async tErrorsLimits() {
    const api = this.api;
    const X = 'js-seq';
    const n = this.refs.get(X).tokens(0);
    const perToken = 2 * 3 * 2 * 64 * 2;
    const RE = S.RESOURCE_EXHAUSTED;
    // One 12 MiB message: over the server's default 8 MiB message limit.
    await this.expectUnchanged(RE, X, api.append(X, Buffer.alloc(12 * MiB, 1), n, 12 * MiB / perToken));
    // Sizes that overflow: 2^55 + 1 tokens of 1536 bytes is 1536 modulo 2^64.
    await this.expectUnchanged([S.INVALID_ARGUMENT, RE], X,
                               api.append(X, Buffer.alloc(perToken, 2), n, '36028797018963969'));
    await this.expectUnchanged([S.INVALID_ARGUMENT, RE], X,
                               api.append(X, Buffer.alloc(1024, 3), n, '1099511627776'));
    await this.expectUnchanged([S.INVALID_ARGUMENT, RE], X,
                               api.append(X, Buffer.alloc(perToken, 4), n, '18446744073709551615'));
    // Replacing the shape of a model that has sequences is refused ...
    await this.expectUnchanged([S.FAILED_PRECONDITION, S.ALREADY_EXISTS], X,
                               api.unary('PutModel', { model: this.model('js-f16', 4, 2, 64, { qHeads: 4 }),
                                                       replace: true }));
    let g = (await api.unary('GetModel', { name: 'js-f16' })).model;
    eq(g.num_layers, 3, 'js-f16 num_layers after a refused replace');
    // ... and allowed without sequences.
    await this.putModel(this.model('js-rep', 2, 2, 8));
    await api.unary('PutModel', { model: this.model('js-rep', 5, 2, 8), replace: true });
    g = (await api.unary('GetModel', { name: 'js-rep' })).model;
    eq(g.num_layers, 5, 'js-rep num_layers after replace');
  }

  // A header promising 2^30 tokens (1.5 TiB) with 1 KiB behind it is refused
  // before the server sets memory aside for it: the claim is untrusted until
  // the bytes arrive.
  async tHeaderMemory() {
    const X = 'js-seq';
    const n = this.refs.get(X).tokens(0);
    const before = this.server.vmPeakKib();
    await this.expectUnchanged([S.INVALID_ARGUMENT, S.RESOURCE_EXHAUSTED], X,
                               this.api.append(X, Buffer.alloc(1024, 3), n, 2 ** 30));
    const grown = this.server.vmPeakKib() - before;
    check(grown < 1024 * 1024,
          `an Append header claiming 2^30 tokens grew kvdepotd's peak virtual memory by ` +
          `${Math.floor(grown / 1024)} MiB before any data arrived`);
  }

  // Appends and reads from several concurrent streams on one channel.
  async tConcurrent() {
    const ids = [0, 1, 2, 3].map((i) => `js-conc-${i}`);
    for (const id of ids) {
      this.refs.set(id, new Reference(3, 2, 64, 2));
      await this.create(id, 'js-f16');
    }
    const errors = [];
    await Promise.all(ids.map(async (id) => {
      try {
        for (let i = 0; i < 3; i++) {
          await this.appendRef(id, this.refs.get(id), 0, 3, 97, { chunks: 20000 });
          await this.api.read('js-seq', { maxChunk: 65536 });
          await this.verify(id);
        }
      } catch (e) {
        errors.push(`${id}: ${e.message || e.details}`);
      }
    }));
    check(errors.length === 0, errors.join('; '));
    for (const id of ids) await this.verify(id);
    await this.verify('js-seq');
  }

  // Deleting a sequence while it is read gives the reader all of it or an
  // error, never part; an append racing with a deletion fails; so does one
  // racing with a forced model deletion.
  async tDeleteRaces() {
    const api = this.api;
    await this.putModel(this.model('js-race', 8, 8, 128));
    const tokens = 512; // 32 KiB per token: 16 MiB
    const data = crypto.randomBytes(tokens * 32 * 1024);
    await this.create('js-race-read', 'js-race');
    await api.append('js-race-read', data, 0, tokens, { chunks: MiB });
    const reading = api.read('js-race-read', { maxChunk: MiB }).then(
      (r) => ['ok', r.data.equals(data)], (e) => [e.code, e.details || e.message]);
    await sleep(50);
    await api.unary('DeleteSequence', { sequence_id: idBuf('js-race-read') });
    const outcome = await reading;
    check((outcome[0] === 'ok' && outcome[1] === true) || [S.NOT_FOUND, S.ABORTED].includes(outcome[0]),
          `read racing with a delete: ${JSON.stringify(outcome)}`);

    const racingAppend = async (id, del) => {
      await this.create(id, 'js-race');
      let result = null;
      let call;
      const done = new Promise((resolve) => {
        call = api.client.Append(Api.deadline(), (err, r) => {
          result = err || r;
          resolve();
        });
      });
      call.write(api.appendMsgs(id, data.subarray(0, MiB), 0, tokens, { dataWithHeader: true })[0]);
      await sleep(300);
      await del();
      await Api.pump(call, split(data.subarray(MiB), MiB).map((d) => ({ data: d })));
      await done;
      check(result instanceof Error, `append to ${id} succeeded across its deletion`);
      check([S.NOT_FOUND, S.ABORTED].includes(result.code),
            `append across deletion: ${statusName(result.code)}: ${result.details}`);
      await expectCode(S.NOT_FOUND, api.unary('StatSequence', { sequence_id: idBuf(id) }));
    };
    await racingAppend('js-race-a', () => api.unary('DeleteSequence', { sequence_id: idBuf('js-race-a') }));
    await racingAppend('js-race-b', () => api.unary('DeleteModel', { name: 'js-race', force: true }));
    check(this.server.alive(), 'kvdepotd died');
    await this.verify('js-seq');
  }

  async tErrorsGarbage() {
    const X = 'js-seq';
    for (const method of ['StatSequence', 'CreateSequence', 'PutModel', 'Lookup', 'GetModel',
                          'DeleteSequence', 'ListSequences']) {
      for (const g of GARBAGE) {
        try {
          await this.expectUnchanged(S.INVALID_ARGUMENT, X, this.api.rawUnary(method, g));
        } catch (e) {
          throw new CheckFailed(`${method} with ${g.subarray(0, 12).toString('hex')}: ${e.message}`);
        }
      }
    }
    for (const g of GARBAGE) {
      await this.expectUnchanged(S.INVALID_ARGUMENT, X, this.api.rawServerStream('Read', g));
    }
    // Not garbage: fields this version does not know are skipped, as protobuf
    // requires (a newer client talking to this server).
    const svc = this.api.client.constructor.service;
    for (const extra of [[0x78, 0x05], [0xfa, 0x06, 0x03, 0x61, 0x62, 0x63], [0xf9, 0x07, 0, 0, 0, 0, 0, 0, 0, 0]]) {
      const raw = Buffer.concat([svc.StatSequence.requestSerialize({ sequence_id: idBuf(X) }),
                                 Buffer.from(extra)]);
      const r = svc.StatSequence.responseDeserialize(await this.api.rawUnary('StatSequence', raw));
      eq(r.sequence.num_tokens, String(this.refs.get(X).tokens(0)),
         `StatSequence with unknown field ${Buffer.from(extra).toString('hex')}`);
    }
    // Garbage inside an Append stream after a valid header and some data.
    const ref = this.refs.get(X);
    const data = ref.makeAppend(3, 4);
    const msgs = this.api.appendMsgs(X, data.subarray(0, 100), ref.tokens(0), 4);
    const type = this.api.client.constructor.service.Append;
    const encoded = msgs.map((m) => type.requestSerialize(m));
    for (const g of GARBAGE) {
      await this.expectUnchanged(S.INVALID_ARGUMENT, X,
                                 this.api.rawClientStream('Append', [...encoded, g]));
      await this.expectUnchanged(S.INVALID_ARGUMENT, X, this.api.rawClientStream('Append', [g]));
    }
  }

  // An Append is invisible until acknowledged; of two appends racing for the
  // same token_start exactly one lands.
  async tAppendAtomic() {
    const X = 'js-seq';
    const ref = this.refs.get(X);
    const n = ref.tokens(0);
    const datas = [ref.makeAppend(3, 30), ref.makeAppend(3, 30)];
    const results = [null, null];
    const calls = [];
    const done = datas.map((d, i) => new Promise((resolve) => {
      const call = this.api.client.Append(Api.deadline(), (err, r) => {
        results[i] = err || r;
        resolve();
      });
      calls.push(call);
      const [first] = this.api.appendMsgs(X, d.subarray(0, d.length / 2), n, 30, { dataWithHeader: true });
      call.write(first);
    }));
    try {
      await sleep(300);
      await this.verify(X, 'while two appends are half sent, sequence');
      calls[0].write({ data: datas[0].subarray(datas[0].length / 2) });
      calls[0].end();
      await done[0];
      check(!(results[0] instanceof Error), `first append failed: ${results[0].details}`);
      eq(results[0].sequence.num_tokens, String(n + 30), 'num_tokens after the first append');
      ref.commit(0, 3, 30, datas[0]);
      calls[1].write({ data: datas[1].subarray(datas[1].length / 2) });
      calls[1].end();
      await done[1];
      check(results[1] instanceof Error, `both appends at token ${n} succeeded`);
      check([S.FAILED_PRECONDITION, S.ABORTED].includes(results[1].code),
            `losing append: expected FAILED_PRECONDITION/ABORTED, got ${statusName(results[1].code)}: ` +
            results[1].details);
      await this.verify(X, 'after the race, sequence');
    } finally {
      for (const c of calls) c.cancel();
    }
  }

  async tCancelledAppend() {
    const X = 'js-seq';
    const ref = this.refs.get(X);
    const n = ref.tokens(0);
    const data = ref.makeAppend(3, 40);
    const msgs = this.api.appendMsgs(X, data.subarray(0, data.length / 2), n, 40);
    let result = null;
    const done = new Promise((resolve) => {
      const call = this.api.client.Append(Api.deadline(), (err) => {
        result = err ? err.code : 'ok';
        resolve();
      });
      for (const m of msgs) call.write(m);
      setTimeout(() => call.cancel(), 500);
    });
    await done;
    check(result !== 'ok', 'cancelled Append succeeded');
    await sleep(500);
    check(this.server.alive(), 'kvdepotd died');
    await this.verify(X, 'after a cancelled Append, sequence');
    await this.appendRef(X, ref, 0, 3, 40);
    await this.verify(X);
  }

  async tPrefix() {
    const api = this.api;
    const hashTool = this.args.hashTool;
    await this.putModel(this.model('js-prefix', 2, 2, 32));
    const B = this.B || (await this.create('js-prefix-probe', 'js-prefix')).page_tokens;
    const ids = Array.from({ length: 3 * B + 10 }, () => crypto.randomBytes(4).readUInt32LE(0));
    const src = new Reference(2, 2, 32, 2);
    this.refs.set('js-prefix-src', src);
    await this.create('js-prefix-src', 'js-prefix');
    // Block 0 completes in the second append: the server has to keep the
    // token ids of the first one.
    await this.appendRef('js-prefix-src', src, 0, 2, B - 56, { tokenIds: ids.slice(0, B - 56) });
    await this.appendRef('js-prefix-src', src, 0, 2, B + 66,
                         { chunks: 5000, tokenIds: ids.slice(B - 56, 2 * B + 10) });
    const h = prefixChain(hashTool, ids, B);
    eq(h.length, 3, 'helper block count');
    const info = await this.stat('js-prefix-src');
    eq(info.block_hashes, h.slice(0, 2), 'block_hashes vs the documented xxh3-64 chain');

    const bogus = String(BigInt(h[1]) ^ 0x5a5a5a5a5a5a5a5an);
    eq(await this.lookup('js-prefix', h.slice(0, 2)), [2, 2 * B], 'Lookup of the stored chain');
    eq(await this.lookup('js-prefix', h), [2, 2 * B], 'Lookup of chain + unstored block');
    eq(await this.lookup('js-prefix', [h[0], bogus]), [1, B], 'Lookup with a wrong second hash');
    eq(await this.lookup('js-prefix', [bogus, h[1]]), [0, 0], 'Lookup with a wrong first hash');
    eq(await this.lookup('js-prefix', []), [0, 0], 'Lookup of an empty chain');
    eq(await this.lookup('js-f16', h.slice(0, 2)), [0, 0], 'Lookup under another model');
    await expectCode(S.NOT_FOUND, api.unary('Lookup', { model: 'js-no-model', block_hashes: [h[0]] }));

    const dst = new Reference(2, 2, 32, 2);
    this.refs.set('js-prefix-dst', dst);
    for (let l = 0; l < 2; l++) {
      dst.k[l] = Buffer.from(src.k[l].subarray(0, 2 * B * src.row));
      dst.v[l] = Buffer.from(src.v[l].subarray(0, 2 * B * src.row));
    }
    const created = await this.create('js-prefix-dst', 'js-prefix',
                                      { prefix_hashes: h.slice(0, 2), prefix_token_ids: ids.slice(0, 2 * B) });
    eq([created.num_tokens, created.prefix_blocks], [String(2 * B), '2'], 'sequence created from prefix');
    await this.verify('js-prefix-dst');
    await this.appendRef('js-prefix-dst', dst, 0, 2, B, { tokenIds: ids.slice(2 * B, 3 * B) });
    await this.verify('js-prefix-dst');
    eq((await this.stat('js-prefix-dst')).block_hashes, h, 'block_hashes of the grown sequence');
    eq(await this.lookup('js-prefix', h), [3, 3 * B], 'Lookup after growing from the prefix');
    this.prefixChain = h;

    await this.expectUnchanged(S.NOT_FOUND, 'js-prefix-dst',
                               this.create('js-prefix-bad', 'js-prefix', { prefix_hashes: [h[0], bogus] }));
    const wrongIds = ids.slice(0, 2 * B);
    wrongIds[7] ^= 1;
    await this.expectUnchanged(S.INVALID_ARGUMENT, 'js-prefix-dst',
                               this.create('js-prefix-bad', 'js-prefix',
                                           { prefix_hashes: h.slice(0, 2), prefix_token_ids: wrongIds }));
    await this.expectUnchanged(S.INVALID_ARGUMENT, 'js-prefix-dst',
                               this.create('js-prefix-bad', 'js-prefix',
                                           { prefix_hashes: h.slice(0, 2),
                                             prefix_token_ids: ids.slice(0, 2 * B - 1) }));
    await expectCode(S.NOT_FOUND, api.unary('StatSequence', { sequence_id: Buffer.from('js-prefix-bad') }));

    await api.unary('DeleteSequence', { sequence_id: Buffer.from('js-prefix-src') });
    this.refs.delete('js-prefix-src');
    await this.verify('js-prefix-dst', 'prefix sequence after deleting its source:');
  }

  // Chaining from a prefix given by hashes alone; blocks count only once every
  // layer is sealed; prefixes are per model.
  async tPrefixMore() {
    const B = this.B;
    const h = this.prefixChain;
    check(h !== null, 'needs the prefix check');
    const ref = new Reference(2, 2, 32, 2);
    this.refs.set('js-prefix-h', ref);
    const dst = this.refs.get('js-prefix-dst');
    for (let l = 0; l < 2; l++) {
      ref.k[l] = Buffer.from(dst.k[l].subarray(0, 3 * B * dst.row));
      ref.v[l] = Buffer.from(dst.v[l].subarray(0, 3 * B * dst.row));
    }
    const info = await this.create('js-prefix-h', 'js-prefix', { prefix_hashes: h });
    eq([info.num_tokens, info.prefix_blocks], [String(3 * B), '3'], 'sequence from hashes only');
    const ids = Array.from({ length: B }, () => crypto.randomBytes(4).readUInt32LE(0));
    await this.appendRef('js-prefix-h', ref, 0, 1, B, { tokenIds: ids });
    eq((await this.stat('js-prefix-h')).block_hashes, h, 'block_hashes with one layer of block 3 sealed');
    const h3 = prefixChain(this.args.hashTool, ids, B, h[2]);
    eq((await this.lookup('js-prefix', [...h, ...h3]))[0], 3, 'Lookup while block 3 lacks a layer');
    await this.appendRef('js-prefix-h', ref, 1, 1, B, { tokenIds: ids });
    eq((await this.stat('js-prefix-h')).block_hashes, [...h, ...h3],
       'block_hashes chained from a prefix given by hashes only');
    eq((await this.lookup('js-prefix', [...h, ...h3]))[0], 4, 'Lookup after block 3 is sealed on every layer');
    await this.verify('js-prefix-h');
    await this.verify('js-prefix-dst', 'the sequence the prefix came from:');
    await this.expectUnchanged(S.NOT_FOUND, 'js-prefix-h',
                               this.create('js-prefix-x', 'js-f16', { prefix_hashes: h.slice(0, 1) }));
  }

  async tEngineHashes() {
    const B = this.B;
    const ref = new Reference(2, 2, 32, 2);
    this.refs.set('js-engine', ref);
    await this.create('js-engine', 'js-prefix');
    // Above 2^63 on purpose: fixed64 must travel unsigned and exact.
    const e = ['81985529216486895', '18364758544493064720'];
    await this.appendRef('js-engine', ref, 0, 2, 2 * B + 3, { blockHashes: e });
    eq((await this.stat('js-engine')).block_hashes, e, 'engine-supplied block_hashes');
    eq(await this.lookup('js-prefix', e), [2, 2 * B], 'Lookup of engine hashes');
    await this.verify('js-engine');
  }

  async tListDelete() {
    const api = this.api;
    let ids = [];
    let token = Buffer.alloc(0);
    for (let i = 0; i < 100; i++) {
      const r = await api.unary('ListSequences', { model: 'js-f16', page_size: 1, page_token: token });
      check(r.sequences.length <= 1, `page_size 1 returned ${r.sequences.length}`);
      ids = ids.concat(r.sequences.map((s) => s.sequence_id.toString()));
      token = r.next_page_token;
      if (!token.length) break;
    }
    eq(ids.sort(), ['js-layers', 'js-seq'], 'ListSequences(js-f16) paged by 1');
    const all = (await api.unary('ListSequences', {})).sequences.map((s) => s.sequence_id.toString());
    check(all.includes('js-prefix-dst') && all.includes('js-seq'), `ListSequences() lacks sequences: ${all}`);
    await this.expectUnchanged(S.FAILED_PRECONDITION, 'js-seq',
                               api.unary('DeleteModel', { name: 'js-f16' }));
    await api.unary('DeleteSequence', { sequence_id: Buffer.from('js-layers') });
    this.refs.delete('js-layers');
    await expectCode(S.NOT_FOUND, api.unary('StatSequence', { sequence_id: Buffer.from('js-layers') }));
    await expectCode(S.NOT_FOUND, api.read('js-layers'));
    await this.verify('js-seq', 'js-seq after deleting js-layers:');
    await this.putModel(this.model('js-tmp', 1, 1, 8));
    await this.create('js-tmp-1', 'js-tmp');
    await this.create('js-tmp-2', 'js-tmp');
    await api.append('js-tmp-1', Buffer.alloc(2 * 8 * 2 * 300, 7), 0, 300);
    const r = await api.unary('DeleteModel', { name: 'js-tmp', force: true });
    eq(r.deleted_sequences, '2', 'DeleteModel(force) deleted_sequences');
    await expectCode(S.NOT_FOUND, api.unary('GetModel', { name: 'js-tmp' }));
    await expectCode(S.NOT_FOUND, api.unary('StatSequence', { sequence_id: Buffer.from('js-tmp-1') }));
    await this.verify('js-seq', 'js-seq after deleting model js-tmp:');
    // Names come back clean: a new model of another shape under the old name,
    // a sequence under the old id, and none of the old data.
    await this.putModel(this.model('js-tmp', 2, 1, 8));
    const ref = new Reference(2, 1, 8, 2);
    const info = await this.create('js-tmp-1', 'js-tmp');
    eq([info.num_tokens, info.layer_tokens], ['0', ['0', '0']], 're-created js-tmp-1');
    this.refs.set('js-tmp-1', ref);
    await this.appendRef('js-tmp-1', ref, 0, 2, 5);
    await this.verify('js-tmp-1');
    this.refs.delete('js-tmp-1');
    const r2 = await api.unary('DeleteModel', { name: 'js-tmp', force: true });
    eq(r2.deleted_sequences, '1', 'DeleteModel(force) deleted_sequences');
  }

  // A model the size of an 8B-class LLM (32 layers x 8 KV heads x 128, f16):
  // 128 KiB of K+V per token; --large-mib MiB appended in one stream of 1 MiB
  // messages and read back in 4 MiB chunks.
  async tLarge() {
    const mib = this.args.largeMib;
    const tokens = mib * 8;
    const total = mib * MiB;
    await this.putModel(this.model('js-large', 32, 8, 128, { qHeads: 32 }));
    await this.create('js-large', 'js-large');
    const sent = crypto.createHash('sha256');
    const api = this.api;
    function* msgs() {
      yield api.appendMsgs('js-large', Buffer.alloc(0), 0, tokens)[0];
      for (let left = total; left > 0; left -= MiB) {
        const piece = crypto.randomBytes(Math.min(MiB, left));
        sent.update(piece);
        yield { data: piece };
      }
    }
    let t0 = Date.now();
    const r = await api.appendStream(msgs(), 600000);
    const tAppend = (Date.now() - t0) / 1000;
    eq(r.bytes_received, String(total), 'large Append bytes_received');
    eq(r.sequence.num_tokens, String(tokens), 'large Append num_tokens');
    this.largeDigest = sent.digest('hex');
    t0 = Date.now();
    await this.readLarge();
    const tRead = (Date.now() - t0) / 1000;
    // A Read cancelled after its first chunks leaves the server healthy.
    await new Promise((resolve) => {
      const call = api.client.Read({ sequence_id: Buffer.from('js-large') }, Api.deadline());
      let n = 0;
      call.on('data', () => {
        if (++n === 3) call.cancel();
      });
      call.on('error', resolve);
      call.on('end', resolve);
    });
    eq((await api.healthCheck('')).status, 1, 'health after a cancelled Read');
    // max_chunk_bytes is capped at 4 MiB (or refused).
    try {
      await this.readLarge(64 * MiB);
    } catch (e) {
      if (typeof e.code !== 'number') throw e;
      check(e.code === S.INVALID_ARGUMENT, `max_chunk_bytes 64 MiB: ${statusName(e.code)} ${e.details}`);
    }
    console.log(`     large: ${mib} MiB, append ${(total / tAppend / 1e6).toFixed(0)} MB/s, ` +
                `read ${(total / tRead / 1e6).toFixed(0)} MB/s (node client)`);
  }

  async readLarge(maxChunk = 4 * MiB) {
    const mib = this.args.largeMib;
    // Chunks beyond 4 MiB never come, whatever was asked.
    const r = await this.api.read('js-large', { maxChunk, hash: true, limit: 4 * MiB }, 600000);
    eq([r.header.num_layers, r.header.num_tokens, r.header.total_bytes],
       [32, String(mib * 8), String(mib * MiB)], 'large read header');
    check(r.digest === this.largeDigest, 'large sequence read back differs (sha256)');
  }

  async tRestart() {
    this.api.close();
    this.api = null;
    const t0 = Date.now();
    const rc = await this.server.stop();
    const t1 = Date.now();
    eq(rc, 0, 'kvdepotd exit status on SIGTERM');
    await this.connect();
    console.log(`     stop ${((t1 - t0) / 1000).toFixed(2)} s, start ${((Date.now() - t1) / 1000).toFixed(2)} s`);
    for (const id of [...this.refs.keys()].sort()) await this.verify(id, `after restart, ${id}`);
    if (this.largeDigest !== null) await this.readLarge();
    if (this.args.largeOnly) return;
    // Deletions are as durable as writes.
    const api = this.api;
    for (const gone of ['js-layers', 'js-prefix-src', 'js-tmp-1', 'js-tmp-2']) {
      await expectCode(S.NOT_FOUND, api.unary('StatSequence', { sequence_id: idBuf(gone) }));
    }
    await expectCode(S.NOT_FOUND, api.unary('GetModel', { name: 'js-tmp' }));
    const names = (await api.unary('ListModels', {})).models.map((m) => m.name);
    for (const m of ['js-f16', 'js-prefix', 'js-f32', 'js-bf16']) {
      check(names.includes(m), `models after restart: ${names}`);
    }
    if (this.prefixChain !== null) {
      const h = this.prefixChain;
      eq(await this.lookup('js-prefix', h), [3, 3 * this.B], 'Lookup after restart');
      // A new sequence from the persisted prefix holds the same bytes.
      const dst = this.refs.get('js-prefix-dst');
      const ref = new Reference(2, 2, 32, 2);
      for (let l = 0; l < 2; l++) {
        ref.k[l] = Buffer.from(dst.k[l].subarray(0, h.length * this.B * dst.row));
        ref.v[l] = Buffer.from(dst.v[l].subarray(0, h.length * this.B * dst.row));
      }
      this.refs.set('js-prefix-r', ref);
      await this.create('js-prefix-r', 'js-prefix', { prefix_hashes: h });
      await this.verify('js-prefix-r', 'sequence from the prefix after restart:');
    }
  }

  async tShutdown() {
    this.api.close();
    this.api = null;
    const rc = await this.server.stop();
    eq(rc, 0, 'kvdepotd exit status on SIGTERM');
  }

  // TLS, mTLS and bearer tokens against a server run with a certificate, a
  // client CA and a tokens file, all made here with the openssl CLI.
  async tSecurity() {
    const pki = path.join(this.workdir, 'pki');
    fs.mkdirSync(pki);
    const ssl = (...a) => {
      try {
        execFileSync('openssl', a, { cwd: pki, stdio: 'ignore' });
      } catch (e) {
        fatal(`openssl failed (Debian package openssl): ${e.message}`);
      }
    };
    const pem = (n) => fs.readFileSync(path.join(pki, n));
    ssl('req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-keyout', 'ca.key', '-out', 'ca.pem',
        '-days', '1', '-subj', '/CN=interop CA');
    for (const [who, ext] of [['server', 'subjectAltName=DNS:kvdepot.test'], ['client', null]]) {
      ssl('req', '-newkey', 'rsa:2048', '-nodes', '-keyout', `${who}.key`, '-out', `${who}.csr`,
          '-subj', `/CN=${who}`);
      const extra = [];
      if (ext) {
        fs.writeFileSync(path.join(pki, `${who}.ext`), `${ext}\n`);
        extra.push('-extfile', `${who}.ext`);
      }
      ssl('x509', '-req', '-in', `${who}.csr`, '-CA', 'ca.pem', '-CAkey', 'ca.key',
          '-CAcreateserial', '-out', `${who}.pem`, '-days', '1', ...extra);
    }
    const tokens = path.join(this.workdir, 'tokens.yaml');
    fs.writeFileSync(tokens, [
      'tokens:',
      '  - {token: js-rw-0123456789abc, tenant: js, namespaces: ["js-*"]}',
      '  - {token: js-ro-0123456789abc, tenant: js, namespaces: ["js-*"], access: read-only}',
      '  - {token: js-old-0123456789ab, tenant: js, namespaces: ["*"],' +
        ' expires: 2001-01-01T00:00:00Z}',
      ''].join('\n'));
    await this.server.start(60000, [
      '--tls-cert', path.join(pki, 'server.pem'), '--tls-key', path.join(pki, 'server.key'),
      '--tls-client-ca', path.join(pki, 'ca.pem'), '--tokens-file', tokens,
      '--metrics-listen', '']);
    const opened = [];
    const api = async (token, clientCert = true, readyMs = 30000) => {
      let creds = clientCert
        ? grpc.credentials.createSsl(pem('ca.pem'), pem('client.key'), pem('client.pem'))
        : grpc.credentials.createSsl(pem('ca.pem'));
      if (token) {
        creds = grpc.credentials.combineChannelCredentials(creds,
          grpc.credentials.createFromMetadataGenerator((_, cb) => {
            const md = new grpc.Metadata();
            md.set('authorization', `Bearer ${token}`);
            cb(null, md);
          }));
      }
      const a = new Api(this.server.addr, this.args.protoDir, this.args.healthProtoDir, creds,
                        'kvdepot.test');
      opened.push(a);
      await new Promise((resolve, reject) => {
        a.client.waitForReady(new Date(Date.now() + readyMs), (e) => (e ? reject(e) : resolve()));
      });
      return a;
    };
    try {
      // Without a client certificate the handshake fails.
      let connected = true;
      try {
        await api(null, false, 1500);
      } catch (e) {
        connected = false;
      }
      check(!connected, 'mTLS handshake succeeded without a client certificate');
      const anon = await api(null);
      const h = await anon.healthCheck('');
      eq(h.status, 1, 'health over mTLS without a token (1 = SERVING)');
      await expectCode(S.UNAUTHENTICATED, anon.unary('ListModels', {}));
      for (const bad of ['js-nope-0123456789a', 'js-old-0123456789ab']) {
        const b = await api(bad);
        await expectCode(S.UNAUTHENTICATED, b.unary('ListModels', {}));
      }
      const rw = await api('js-rw-0123456789abc');
      this.api = rw;
      await rw.unary('PutModel', { model: this.model('js-m', 2, 1, 8) });
      await expectCode(S.PERMISSION_DENIED,
                       rw.unary('PutModel', { model: this.model('other', 2, 1, 8) }));
      await rw.unary('CreateSequence', { sequence_id: idBuf('js-s'), model: 'js-m' });
      const data = crypto.randomBytes(2 * 2 * 3 * 8 * 2); // K+V, 2 layers, 3 tokens, 8 dims, f16
      await rw.append('js-s', data, 0, 3);
      const back = await rw.read('js-s');
      check(Buffer.compare(back.data, data) === 0, 'bytes read back over mTLS differ');
      const ro = await api('js-ro-0123456789abc');
      await expectCode(S.PERMISSION_DENIED, ro.append('js-s', data, 3, 3));
      const back2 = await ro.read('js-s');
      check(Buffer.compare(back2.data, data) === 0, 'read-only token read different bytes');
    } finally {
      this.api = null;
      for (const a of opened) a.close();
    }
    eq(await this.server.stop(), 0, 'kvdepotd exit status on SIGTERM');
  }

  async main() {
    if (this.args.securityOnly) {
      await this.run('tls, mtls and tokens', this.tSecurity);
      return;
    }
    try {
      await this.connect();
    } catch (e) {
      this.failed++;
      console.log(`FAIL ${'start kvdepotd'.padEnd(28)} ${e.message}`);
      return;
    }
    const checks = [
      ['health', this.tHealth],
      ['models', this.tModels],
      ['model errors', this.tModelErrors],
      ['append/read round trip', this.tRoundtrip],
      ['append layer by layer', this.tLayerwise],
      ['f32, bf16, binary ids', this.tDtypes],
      ['unknown ids', this.tErrorsUnknown],
      ['create errors', this.tErrorsCreate],
      ['append errors', this.tErrorsAppend],
      ['read errors', this.tErrorsRead],
      ['header reserves no memory', this.tHeaderMemory],
      ['limits and overflow', this.tErrorsLimits],
      ['garbage messages', this.tErrorsGarbage],
      ['append atomicity', this.tAppendAtomic],
      ['cancelled append', this.tCancelledAppend],
      ['prefix hash and lookup', this.tPrefix],
      ['prefix chains, per layer', this.tPrefixMore],
      ['engine-supplied hashes', this.tEngineHashes],
      ['list and delete', this.tListDelete],
      ['concurrent clients', this.tConcurrent],
      ['deletes racing reads/appends', this.tDeleteRaces],
      [`large ${this.args.largeMib} MiB`, this.tLarge],
      ['compute: attend, search, sparse attend, plan', this.tCompute],
      ['activations (KVPR)', this.tActivations],
      ['calibrate and artifacts', this.tCalibrate],
      ['codecs: VQ and SVD', this.tCodecsVqSvd],
      ['restart', this.tRestart],
      ['shutdown', this.tShutdown],
    ];
    const keep = ['health', `large ${this.args.largeMib} MiB`, 'restart', 'shutdown'];
    for (const [name, fn] of checks) {
      if (this.args.largeOnly && !keep.includes(name)) continue;
      if (!this.server.alive() && name !== 'restart') {
        this.failed++;
        console.log(`FAIL ${name.padEnd(28)} kvdepotd is not running`);
        continue;
      }
      await this.run(name, fn);
    }
  }

  async cleanup() {
    if (this.api !== null) this.api.close();
    await this.server.kill();
    if (this.args.keep) console.log(`${PREFIX}: kept ${this.workdir}`);
    else fs.rmSync(this.workdir, { recursive: true, force: true });
  }
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  for (const [dir, rel] of [[args.protoDir, 'kvdepot/v1/kvdepot.proto'],
                            [args.healthProtoDir, 'grpc/health/v1/health.proto']]) {
    if (!fs.existsSync(path.join(dir, rel))) fatal(`${rel} not found under ${dir}`);
  }
  try {
    execFileSync(args.hashTool, [], { input: '1\n' });
  } catch (e) {
    fatal(`hash tool ${args.hashTool} does not run: ${e.message}`);
  }
  const suite = new Suite(args);
  // A hung call must not hang ctest forever: the whole run has a ceiling.
  const guard = setTimeout(() => {
    console.log(`${PREFIX}: FATAL: overall time limit reached`);
    suite.server.kill().finally(() => process.exit(1));
  }, 1800 * 1000);
  try {
    await suite.main();
  } finally {
    await suite.cleanup();
    clearTimeout(guard);
  }
  console.log(`${PREFIX}: ${suite.passed} passed, ${suite.failed} failed`);
  process.exitCode = suite.failed || !suite.passed ? 1 : 0;
}

main().catch((e) => {
  console.error(e.stack || String(e));
  process.exit(1);
});
