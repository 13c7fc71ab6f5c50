package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"fmt"
	"io"
	"math"
	"math/rand"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	pb "kvdinterop/kvdepot/v1"
)

// ---------------------------------------------------------------------------
// Connections

type api struct {
	conn   *grpc.ClientConn
	kv     pb.KVDepotClient
	health healthpb.HealthClient
}

// tokenCreds sends a bearer token with every call (TLS only).
type tokenCreds string

func (t tokenCreds) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(t)}, nil
}
func (tokenCreds) RequireTransportSecurity() bool { return true }

// dial connects and waits until the channel is ready (the server's HTTP/2
// settings received), at most ready. tlsConf nil = plaintext.
func dial(addr string, tlsConf *tls.Config, token string, ready time.Duration) (*api, error) {
	opts := []grpc.DialOption{
		grpc.WithBlock(),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16*mib),
			grpc.MaxCallSendMsgSize(16*mib)),
	}
	if tlsConf == nil {
		opts = append(opts, grpc.WithInsecure())
	} else {
		opts = append(opts, grpc.WithTransportCredentials(credentials.NewTLS(tlsConf)))
	}
	if token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(tokenCreds(token)))
	}
	ctx, cancel := context.WithTimeout(context.Background(), ready)
	defer cancel()
	conn, err := grpc.DialContext(ctx, addr, opts...)
	if err != nil {
		return nil, err
	}
	return &api{conn: conn, kv: pb.NewKVDepotClient(conn),
		health: healthpb.NewHealthClient(conn)}, nil
}

func (a *api) close() { a.conn.Close() }

func ctxFor(d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), d)
}

func (a *api) healthCheck(service string) (*healthpb.HealthCheckResponse, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	return a.health.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
}

// The unary calls, each with the default deadline.
func (a *api) putModel(m *pb.Model, replace bool) (*pb.PutModelResponse, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	return a.kv.PutModel(ctx, &pb.PutModelRequest{Model: m, Replace: replace})
}

func (a *api) getModel(name string) (*pb.Model, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	r, err := a.kv.GetModel(ctx, &pb.GetModelRequest{Name: name})
	return r.GetModel(), err
}

func (a *api) listModels() ([]string, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	r, err := a.kv.ListModels(ctx, &pb.ListModelsRequest{})
	var names []string
	for _, m := range r.GetModels() {
		names = append(names, m.Name)
	}
	return names, err
}

func (a *api) deleteModel(name string, force bool) (*pb.DeleteModelResponse, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	return a.kv.DeleteModel(ctx, &pb.DeleteModelRequest{Name: name, Force: force})
}

func (a *api) create(req *pb.CreateSequenceRequest) (*pb.SequenceInfo, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	r, err := a.kv.CreateSequence(ctx, req)
	return r.GetSequence(), err
}

func (a *api) stat(id string) (*pb.SequenceInfo, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	r, err := a.kv.StatSequence(ctx, &pb.StatSequenceRequest{SequenceId: []byte(id)})
	return r.GetSequence(), err
}

func (a *api) deleteSequence(id string) (*pb.DeleteSequenceResponse, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	return a.kv.DeleteSequence(ctx, &pb.DeleteSequenceRequest{SequenceId: []byte(id)})
}

func (a *api) listSequences(req *pb.ListSequencesRequest) (*pb.ListSequencesResponse, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	return a.kv.ListSequences(ctx, req)
}

func (a *api) lookup(model string, hashes []uint64) (*pb.LookupResponse, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	return a.kv.Lookup(ctx, &pb.LookupRequest{Model: model, BlockHashes: hashes})
}

func (a *api) attend(req *pb.AttendRequest) (*pb.AttendResponse, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	return a.kv.Attend(ctx, req)
}

func (a *api) search(req *pb.SearchRequest) (*pb.SearchResponse, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	return a.kv.Search(ctx, req)
}

func (a *api) sparseAttend(req *pb.SparseAttendRequest) (*pb.SparseAttendResponse, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	return a.kv.SparseAttend(ctx, req)
}

func (a *api) planFetch(req *pb.PlanFetchRequest) (*pb.PlanFetchResponse, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	return a.kv.PlanFetch(ctx, req)
}

// ---------------------------------------------------------------------------
// Append

type appendOpts struct {
	layerStart, numLayers uint32
	dtype                 pb.DType // 0 = F16
	tokenIDs              []uint32
	blockHashes           []uint64
	chunk                 int   // pieces of this size (0 = one piece) ...
	chunks                []int // ... or of these sizes, the rest in one piece
	dataWithHeader        bool  // the first piece rides in the header's message
	emptyBetween          bool  // a message without data after every piece
	withActivations       bool
}

func split(data []byte, o appendOpts) [][]byte {
	var out [][]byte
	switch {
	case o.chunks != nil:
		pos := 0
		for _, n := range o.chunks {
			if pos >= len(data) {
				break
			}
			end := pos + n
			if end > len(data) {
				end = len(data)
			}
			out = append(out, data[pos:end])
			pos = end
		}
		if pos < len(data) {
			out = append(out, data[pos:])
		}
	case o.chunk > 0:
		for i := 0; i < len(data); i += o.chunk {
			end := i + o.chunk
			if end > len(data) {
				end = len(data)
			}
			out = append(out, data[i:end])
		}
	case len(data) > 0:
		out = append(out, data)
	}
	return out
}

func appendMsgs(id []byte, data []byte, tokenStart, numTokens uint64, o appendOpts) []*pb.AppendRequest {
	dtype := o.dtype
	if dtype == pb.DType_DTYPE_UNSPECIFIED {
		dtype = pb.DType_DTYPE_F16
	}
	header := &pb.AppendHeader{SequenceId: id, LayerStart: o.layerStart, NumLayers: o.numLayers,
		TokenStart: tokenStart, NumTokens: numTokens, Dtype: dtype, TokenIds: o.tokenIDs,
		BlockHashes: o.blockHashes, WithActivations: o.withActivations}
	msgs := []*pb.AppendRequest{{Header: header}}
	for _, piece := range split(data, o) {
		if o.dataWithHeader && len(msgs) == 1 && msgs[0].Data == nil {
			msgs[0].Data = piece
		} else {
			msgs = append(msgs, &pb.AppendRequest{Data: piece})
		}
		if o.emptyBetween {
			msgs = append(msgs, &pb.AppendRequest{})
		}
	}
	return msgs
}

// clientStream is what the generated client-streaming calls return.
type clientStream[Req, Resp any] interface {
	Send(*Req) error
	CloseAndRecv() (*Resp, error)
}

// sendStream opens a client stream, sends the messages next() returns until
// it returns nil, and returns the reply. A server that answers early makes
// Send return io.EOF; its status then comes from CloseAndRecv.
func sendStream[Req, Resp any](timeout time.Duration,
	open func(context.Context) (clientStream[Req, Resp], error), next func() *Req) (*Resp, error) {
	ctx, cancel := ctxFor(timeout)
	defer cancel()
	st, err := open(ctx)
	if err != nil {
		return nil, err
	}
	for m := next(); m != nil; m = next() {
		if err := st.Send(m); err != nil {
			if err == io.EOF {
				break
			}
			return nil, err
		}
	}
	return st.CloseAndRecv()
}

// recvAll opens a server stream and returns every message of it.
func recvAll[Resp any](open func(context.Context) (interface{ Recv() (*Resp, error) }, error)) ([]*Resp, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	st, err := open(ctx)
	if err != nil {
		return nil, err
	}
	var out []*Resp
	for {
		m, err := st.Recv()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		out = append(out, m)
	}
}

func (a *api) appendNext(next func() *pb.AppendRequest, timeout time.Duration) (*pb.AppendResponse, error) {
	return sendStream(timeout, func(ctx context.Context) (clientStream[pb.AppendRequest, pb.AppendResponse], error) {
		return a.kv.Append(ctx)
	}, next)
}

func sliceNext[T any](msgs []*T) func() *T {
	i := 0
	return func() *T {
		if i >= len(msgs) {
			return nil
		}
		i++
		return msgs[i-1]
	}
}

func (a *api) appendStream(msgs []*pb.AppendRequest) (*pb.AppendResponse, error) {
	return a.appendNext(sliceNext(msgs), callTimeout)
}

func (a *api) append(id string, data []byte, tokenStart, numTokens uint64, o appendOpts) (*pb.AppendResponse, error) {
	return a.appendStream(appendMsgs([]byte(id), data, tokenStart, numTokens, o))
}

// ---------------------------------------------------------------------------
// Read

type readOpts struct {
	layerStart, numLayers uint32
	tokenStart, numTokens uint64
	maxChunk              uint32
	limit                 int  // largest chunk allowed (default maxChunk or 1 MiB)
	hash                  bool // keep a sha256 of the data instead of the bytes
	timeout               time.Duration
}

type readResult struct {
	header *pb.ReadHeader
	data   []byte
	size   uint64
	digest [32]byte
}

// read reads a decoded range, checking the stream framing.
func (a *api) read(id string, o readOpts) (*readResult, error) {
	limit := o.limit
	if limit == 0 {
		limit = int(o.maxChunk)
	}
	if limit == 0 {
		limit = mib
	}
	if o.timeout == 0 {
		o.timeout = callTimeout
	}
	ctx, cancel := ctxFor(o.timeout)
	defer cancel()
	st, err := a.kv.Read(ctx, &pb.ReadRequest{SequenceId: []byte(id), LayerStart: o.layerStart,
		NumLayers: o.numLayers, TokenStart: o.tokenStart, NumTokens: o.numTokens,
		MaxChunkBytes: o.maxChunk})
	if err != nil {
		return nil, err
	}
	r := &readResult{}
	h := sha256.New()
	var buf bytes.Buffer
	bad := ""
	for n := 0; ; n++ {
		m, err := st.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
		if n == 0 {
			if m.Header == nil && bad == "" {
				bad = "first Read response carries no header"
			}
			r.header = m.Header
		} else if m.Header != nil && bad == "" {
			bad = fmt.Sprintf("Read response %d repeats the header", n)
		}
		if len(m.Data) > limit && bad == "" {
			bad = fmt.Sprintf("Read chunk of %d bytes exceeds %d", len(m.Data), limit)
		}
		r.size += uint64(len(m.Data))
		if o.hash {
			h.Write(m.Data)
		} else {
			buf.Write(m.Data)
		}
	}
	if bad != "" {
		fail("%s", bad)
	}
	if r.header == nil {
		fail("Read stream carried no message")
	}
	if r.size != r.header.TotalBytes {
		fail("Read bytes %d vs header.total_bytes %d", r.size, r.header.TotalBytes)
	}
	r.data = buf.Bytes()
	copy(r.digest[:], h.Sum(nil))
	return r, nil
}

// readAll returns every message of a Read (any format, activations too).
func (a *api) readAll(req *pb.ReadRequest) ([]*pb.ReadResponse, error) {
	return recvAll(func(ctx context.Context) (interface {
		Recv() (*pb.ReadResponse, error)
	}, error) {
		return a.kv.Read(ctx, req)
	})
}

// ---------------------------------------------------------------------------
// Raw calls: the request goes out as the given bytes, the answer comes back
// as bytes.

type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string { return "proto" }

func method(name string) string { return "/kvdepot.v1.KVDepot/" + name }

func (a *api) rawUnary(name string, in []byte) ([]byte, error) {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	var out []byte
	err := a.conn.Invoke(ctx, method(name), &in, &out, grpc.ForceCodec(rawCodec{}))
	return out, err
}

func (a *api) rawStream(name string, server, client bool, ins [][]byte) error {
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	desc := &grpc.StreamDesc{ServerStreams: server, ClientStreams: client}
	st, err := a.conn.NewStream(ctx, desc, method(name), grpc.ForceCodec(rawCodec{}))
	if err != nil {
		return err
	}
	for _, in := range ins {
		in := in
		if err := st.SendMsg(&in); err != nil {
			if err == io.EOF {
				break
			}
			return err
		}
	}
	if err := st.CloseSend(); err != nil {
		return err
	}
	for {
		var out []byte
		if err := st.RecvMsg(&out); err != nil {
			if err == io.EOF {
				return nil
			}
			return err
		}
	}
}

// ---------------------------------------------------------------------------
// Status checks

// expectCode requires err to be a status with one of the codes and a message.
func expectCode(err error, want ...codes.Code) *status.Status {
	names := ""
	for i, c := range want {
		if i > 0 {
			names += "/"
		}
		names += c.String()
	}
	if err == nil {
		fail("expected %s, call succeeded", names)
	}
	st, ok := status.FromError(err)
	if !ok {
		fail("expected %s, got error %v", names, err)
	}
	for _, c := range want {
		if st.Code() == c {
			check(st.Message() != "", "status %s without a message", st.Code())
			return st
		}
	}
	fail("expected %s, got %s: %s", names, st.Code(), st.Message())
	return nil
}

// ---------------------------------------------------------------------------
// Reference copy of what a sequence should hold: K and V per layer, token rows.

type reference struct {
	numLayers int
	row       int // bytes per token per layer of K (or V)
	k, v      [][]byte
}

func newReference(numLayers, kvHeads, headDim, esize int) *reference {
	return &reference{numLayers: numLayers, row: kvHeads * headDim * esize,
		k: make([][]byte, numLayers), v: make([][]byte, numLayers)}
}

func (r *reference) tokens(layer int) int { return len(r.k[layer]) / r.row }

func (r *reference) minTokens() int {
	n := math.MaxInt
	for l := range r.k {
		if t := r.tokens(l); t < n {
			n = t
		}
	}
	return n
}

func (r *reference) layerTokens() []uint64 {
	out := make([]uint64, r.numLayers)
	for l := range out {
		out[l] = uint64(r.tokens(l))
	}
	return out
}

// wire is a range in the wire layout: K [layer][token][head][dim], then V.
func (r *reference) wire(layerStart, numLayers, tokenStart, numTokens int) []byte {
	a, b := tokenStart*r.row, (tokenStart+numTokens)*r.row
	var out []byte
	for l := layerStart; l < layerStart+numLayers; l++ {
		out = append(out, r.k[l][a:b]...)
	}
	for l := layerStart; l < layerStart+numLayers; l++ {
		out = append(out, r.v[l][a:b]...)
	}
	return out
}

func (r *reference) makeAppend(numLayers, numTokens int) []byte {
	return randomBytes(2 * numLayers * numTokens * r.row)
}

func (r *reference) commit(layerStart, numLayers, numTokens int, data []byte) {
	per := numTokens * r.row
	half := numLayers * per
	for i := 0; i < numLayers; i++ {
		l := layerStart + i
		r.k[l] = append(append([]byte(nil), r.k[l]...), data[i*per:(i+1)*per]...)
		r.v[l] = append(append([]byte(nil), r.v[l]...), data[half+i*per:half+(i+1)*per]...)
	}
}

// clonePrefix is a reference holding the first tokens of r.
func (r *reference) clonePrefix(tokens int) *reference {
	c := &reference{numLayers: r.numLayers, row: r.row,
		k: make([][]byte, r.numLayers), v: make([][]byte, r.numLayers)}
	for l := range r.k {
		c.k[l] = append([]byte(nil), r.k[l][:tokens*r.row]...)
		c.v[l] = append([]byte(nil), r.v[l][:tokens*r.row]...)
	}
	return c
}

var (
	rngMu sync.Mutex
	rng   = rand.New(rand.NewSource(time.Now().UnixNano()))
)

// randomBytes is safe for concurrent use.
func randomBytes(n int) []byte {
	b := make([]byte, n)
	rngMu.Lock()
	rng.Read(b)
	rngMu.Unlock()
	return b
}

// f32s is the little-endian bytes of xs.
func f32s(xs []float32) []byte {
	b := make([]byte, 4*len(xs))
	for i, x := range xs {
		putU32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func readF32s(b []byte) []float32 {
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(getU32(b[4*i:]))
	}
	return out
}

func getU16(b []byte) uint16 { return uint16(b[0]) | uint16(b[1])<<8 }
func getU32(b []byte) uint32 { return uint32(getU16(b)) | uint32(getU16(b[2:]))<<16 }
func getU64(b []byte) uint64 { return uint64(getU32(b)) | uint64(getU32(b[4:]))<<32 }
func putU16(b []byte, x uint16) {
	b[0], b[1] = byte(x), byte(x>>8)
}
func putU32(b []byte, x uint32) {
	putU16(b, uint16(x))
	putU16(b[2:], uint16(x>>16))
}
func putU64(b []byte, x uint64) {
	putU32(b, uint32(x))
	putU32(b[4:], uint32(x>>32))
}

// uniform returns n floats uniform in [-a, a).
func uniform(r *rand.Rand, n int, a float32) []float32 {
	out := make([]float32, n)
	for i := range out {
		out[i] = (2*r.Float32() - 1) * a
	}
	return out
}

// attention over rows k[t][h*d+i], v likewise (GQA), computed here; tokens per
// kv head, or nil for all. Returns out (hq*d) and lse (hq).
func attention(q []float32, k, v [][]float32, hq, hkv, d int, scale float64, tokens [][]int) ([]float64, []float64) {
	g := hq / hkv
	out := make([]float64, 0, hq*d)
	lse := make([]float64, 0, hq)
	for h := 0; h < hq; h++ {
		kh := h / g
		var ts []int
		if tokens != nil {
			ts = tokens[kh]
		} else {
			for t := range k {
				ts = append(ts, t)
			}
		}
		s := make([]float64, len(ts))
		mx := math.Inf(-1)
		for j, t := range ts {
			x := 0.0
			for i := 0; i < d; i++ {
				x += float64(q[h*d+i]) * float64(k[t][kh*d+i])
			}
			s[j] = scale * x
			mx = math.Max(mx, s[j])
		}
		z := 0.0
		for j := range s {
			s[j] = math.Exp(s[j] - mx)
			z += s[j]
		}
		lse = append(lse, mx+math.Log(z))
		for i := 0; i < d; i++ {
			o := 0.0
			for j, t := range ts {
				o += s[j] * float64(v[t][kh*d+i])
			}
			out = append(out, o/z)
		}
	}
	return out, lse
}

// rowsF32 splits f32 wire bytes of one layer (K then V, n tokens of hkv*d)
// into token rows.
func rowsF32(data []byte, n, width int) (k, v [][]float32) {
	vals := readF32s(data)
	for t := 0; t < n; t++ {
		k = append(k, vals[t*width:(t+1)*width])
		v = append(v, vals[(n+t)*width:(n+t+1)*width])
	}
	return k, v
}

func checkAttend(what string, got *pb.AttendResult, out, lse []float64, tolOut, tolLse float64) {
	eq(len(got.Output), len(out), what+" output length")
	for i := range out {
		check(math.Abs(float64(got.Output[i])-out[i]) <= tolOut,
			"%s output[%d] %v vs %v", what, i, got.Output[i], out[i])
	}
	eq(len(got.Lse), len(lse), what+" lse length")
	for h := range lse {
		check(math.Abs(float64(got.Lse[h])-lse[h]) <= tolLse, "%s lse[%d] %v vs %v",
			what, h, got.Lse[h], lse[h])
	}
}
